"""pippy_xla: pipeline-parallel training for PyTorch, with a C++ engine."""

from pippy_xla._native import _C
from pippy_xla._version import __version__  # noqa: F401
from pippy_xla.config import PipelineConfig
from pippy_xla.errors import BatchMismatchError, PipelineError
from pippy_xla.integrations import PipelineTrainer, pipelined
from pippy_xla.pipeline import EvalOutput, PipelineModel, balanced_ranges
from pippy_xla.plan import Plan, PlanInfeasibleError, plan
from pippy_xla.runtime import ops  # noqa: F401  (registers the ops' fake kernels and autograd)
from pippy_xla.runtime.expert_parallel import ExpertSharding
from pippy_xla.runtime.tensor_parallel import LayerSharding
from pippy_xla.split import (
    Fingerprint,
    StageGraph,
    UninitializedTensorError,
    UnsupportedModelError,
    explain_difference,
    find_layers,
    fingerprint,
    materialize,
    partition,
)

Schedule = _C.Schedule
"""A pipeline schedule as data (every rank's actions): ``Schedule.from_csv(text)`` reads
torch.distributed.pipelining's CSV format; pass one as ``PipelineModel(schedule=...)``."""
make_schedule = _C.make_schedule
"""``make_schedule(name, num_ranks, num_microbatches, chunks=0, *, forward=, backward=,
weight=)``: a generated :class:`Schedule` (``chunks`` 0: the schedule's default); per-stage
costs order a list-scheduled one (``schedule_info(name).list_scheduled``)."""
schedule_info = _C.schedule_info
"""``schedule_info(name)``: the facts of a generated schedule (stages per rank, placement, split
backward, list-scheduled)."""

__all__ = [
    "BatchMismatchError",
    "EvalOutput",
    "Fingerprint",
    "ExpertSharding",
    "LayerSharding",
    "PipelineConfig",
    "PipelineError",
    "PipelineModel",
    "PipelineTrainer",
    "Plan",
    "PlanInfeasibleError",
    "Schedule",
    "StageGraph",
    "UninitializedTensorError",
    "UnsupportedModelError",
    "balanced_ranges",
    "explain_difference",
    "find_layers",
    "fingerprint",
    "make_schedule",
    "materialize",
    "partition",
    "pipelined",
    "plan",
    "schedule_info",
]
