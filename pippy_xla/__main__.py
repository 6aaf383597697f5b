"""``python -m pippy_xla``: the ``pippy-xla`` command line."""

import sys

from pippy_xla.cli import main

sys.exit(main())
