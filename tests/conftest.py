import os
import sys

# Test helpers (models.py) import as top-level modules, in this process and in the
# processes that the spawn helper starts.
sys.path.insert(0, os.path.dirname(__file__))
