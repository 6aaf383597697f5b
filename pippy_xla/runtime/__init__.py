"""How a step runs: building this rank's stages (placement, layout, schedule, handshake), the step
(batches, tied weights, gradients), transports (the point-to-point ops), data and tensor
parallelism, the recompile watch of compiled stages, and the failure machinery. Imports from
:mod:`pippy_xla.split`, never from :mod:`pippy_xla.plan` (``tests/test_layout.py``)."""

from pippy_xla.runtime import ops
from pippy_xla.runtime._build import BuiltPipeline, build
from pippy_xla.runtime._step import EvalOutput, StepRunner
from pippy_xla.runtime.data_parallel import DATA_PARALLEL_MODES
from pippy_xla.runtime.failures import AbortChannel, FailureState
from pippy_xla.runtime.tensor_parallel import TP_STYLES, LayerSharding

__all__ = [
    "DATA_PARALLEL_MODES",
    "AbortChannel",
    "BuiltPipeline",
    "EvalOutput",
    "FailureState",
    "LayerSharding",
    "StepRunner",
    "TP_STYLES",
    "build",
    "ops",
]
