"""pippy_xla: pipeline-parallel training for PyTorch, with a C++ engine."""

import torch  # noqa: F401  (loads libtorch before the extension)

from pippy_xla import _C, ops  # noqa: F401
from pippy_xla.partition import StageGraph, find_layers, partition
from pippy_xla.pipeline import EvalOutput, PipelineModel, balanced_ranges

__all__ = [
    "EvalOutput",
    "PipelineModel",
    "StageGraph",
    "balanced_ranges",
    "find_layers",
    "partition",
]
