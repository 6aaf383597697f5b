"""How a model is split: torch.fx tracing with the decoder layers as leaves, the classification of
every node, one ``GraphModule`` per stage, HF adapters, meta materialization, fingerprints and the
split-backward compile of a stage. Imports nothing from :mod:`pippy_xla.runtime` or
:mod:`pippy_xla.plan` (``tests/test_layout.py``)."""

from pippy_xla.split.fingerprint import Fingerprint, explain_difference, fingerprint
from pippy_xla.split.materialize import UninitializedTensorError, materialize
from pippy_xla.split.partition import StageGraph, UnsupportedModelError, find_layers, partition

__all__ = [
    "Fingerprint",
    "StageGraph",
    "UninitializedTensorError",
    "UnsupportedModelError",
    "explain_difference",
    "find_layers",
    "fingerprint",
    "materialize",
    "partition",
]
