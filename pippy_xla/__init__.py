"""pippy_xla: pipeline-parallel training for PyTorch, with a C++ engine."""

import torch  # noqa: F401  (loads libtorch before the extension)

from pippy_xla import _C, ops  # noqa: F401
from pippy_xla.errors import BatchMismatchError, PipelineError
from pippy_xla.fingerprint import Fingerprint, explain_difference, fingerprint
from pippy_xla.materialize import UninitializedTensorError, materialize
from pippy_xla.partition import StageGraph, find_layers, partition
from pippy_xla.pipeline import EvalOutput, PipelineModel, balanced_ranges
from pippy_xla.planner import Plan, PlanInfeasibleError, plan

__all__ = [
    "BatchMismatchError",
    "EvalOutput",
    "Fingerprint",
    "PipelineError",
    "PipelineModel",
    "Plan",
    "PlanInfeasibleError",
    "StageGraph",
    "UninitializedTensorError",
    "balanced_ranges",
    "explain_difference",
    "find_layers",
    "fingerprint",
    "materialize",
    "partition",
    "plan",
]
