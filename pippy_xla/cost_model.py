"""The planner's cost model: what a stage costs in time and memory for a choice of layers and
checkpointed layers, and the exact C++ solver over it.

The cost types (:class:`LayerCost`, :class:`StageExtra`, :class:`PlanProblem`) are the C++
structs of ``csrc/planner.h``, bound with the same field names; the formulas are in
[Note: planner cost model] there. :class:`ModelProfile` holds measured costs of a model
(:func:`pippy_xla.profiler.profile_model`) and turns them into a :class:`PlanProblem` for a
number of stages.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from pippy_xla import _C
from pippy_xla._C import LayerCost, PlanProblem, PlanResult, StageEval, StageExtra
from pippy_xla.units import format_bytes

__all__ = [
    "PLANNED_SCHEDULES",
    "LayerCost",
    "ModelProfile",
    "PlanInfeasibleError",
    "PlanProblem",
    "PlanResult",
    "StageEval",
    "StageExtra",
    "evaluate_stages",
    "inflight_counts",
    "solve",
]

PLANNED_SCHEDULES = ("1f1b", "gpipe")
"""Schedules whose memory the cost model describes. ZB-H1 also keeps each microbatch's
weight-gradient inputs and recorded gradients between B and W, and interleaved stages share a
device; neither is modeled yet, so :func:`pippy_xla.planner.plan` refuses them."""


@dataclass(kw_only=True, slots=True)
class ModelProfile:
    """Measured per-microbatch costs of a model at one (microbatch size, sequence length, dtype).

    ``prologue`` is what only the first stage runs (embeddings), ``epilogue`` what only the last
    runs (final norm, head and loss); ``shared_saved_bytes`` are tensors every stage recomputes
    and its layers save (rotary tables, attention masks), counted once per stage.
    """

    layers: list[LayerCost]
    prologue: StageExtra
    epilogue: StageExtra
    shared_saved_bytes: int
    boundary_bytes: int
    """Bytes of one microbatch's hidden states (a decoder layer's output): what crosses a stage
    boundary, forward as activations and backward as gradients."""
    microbatch_size: int
    seq_len: int
    dtype: str

    def problem(
        self,
        schedule: str,
        num_stages: int,
        num_microbatches: int,
        memory_limit: Sequence[int],
        allow_checkpoint: bool = True,
    ) -> PlanProblem:
        """The solver input for ``num_stages`` stages (one per rank) under ``schedule``."""
        inflight = inflight_counts(schedule, num_stages, num_microbatches)
        receives = _C.peak_receive_buffers(_C.make_schedule(schedule, num_stages, num_microbatches))
        extras = []
        for s in range(num_stages):
            # Transfers: a stage other than the last keeps each in-flight microbatch's output (a
            # backward root). Receive buffers: the most alive at once under the engine's posting
            # rule (_C.peak_receive_buffers). A stage other than the first also has up to two
            # input gradients being sent (the previous one's send may still wait for its
            # receiver while the next is computed). Every rank also holds the whole batch
            # (token ids, attention mask and labels, int64).
            e = StageExtra(
                saved_bytes=self.shared_saved_bytes
                + (self.boundary_bytes if s < num_stages - 1 else 0),
                buffer_bytes=self.boundary_bytes * (receives[s] + (2 if s > 0 else 0))
                + 3 * 8 * num_microbatches * self.microbatch_size * self.seq_len,
            )
            for part, on in ((self.prologue, s == 0), (self.epilogue, s == num_stages - 1)):
                if on:
                    e.fwd += part.fwd
                    e.bwd += part.bwd
                    e.saved_bytes += part.saved_bytes
                    e.static_bytes += part.static_bytes
                    e.transient_bytes = max(e.transient_bytes, part.transient_bytes)
            extras.append(e)
        return PlanProblem(
            layers=list(self.layers),
            extras=extras,
            inflight=inflight,
            memory_limit=list(memory_limit),
            allow_checkpoint=allow_checkpoint,
        )

    def predict_saved_bytes(
        self, layer_range: tuple[int, int], checkpoint: Sequence[int], first: bool, last: bool
    ) -> int:
        """Predicted saved-for-backward bytes of one microbatch on a stage, as
        ``saved_tensors_hooks`` count them. The shared tensors (rotary tables, masks) are saved
        only by uncheckpointed layers; a stage whose layers are all checkpointed still keeps
        them alive (the checkpoint frames hold their keyword inputs), invisibly to the hooks,
        so the cost model handed to the solver counts them on every stage."""
        a, b = layer_range
        ck = set(checkpoint)
        total = self.shared_saved_bytes if any(k not in ck for k in range(a, b)) else 0
        total += self.prologue.saved_bytes if first else 0
        total += self.epilogue.saved_bytes if last else 0
        for k in range(a, b):
            total += self.layers[k].saved_bytes_ckpt if k in ck else self.layers[k].saved_bytes
        return total


class PlanInfeasibleError(ValueError):
    """No plan fits the memory limits; ``min_memory_limit`` holds the smallest limits that do."""

    def __init__(self, message: str, min_memory_limit: list[int]) -> None:
        super().__init__(message)
        self.min_memory_limit = min_memory_limit


def inflight_counts(schedule: str, num_stages: int, num_microbatches: int) -> list[int]:
    """Microbatches each stage holds activations for at once, from the C++ simulator's replay
    of the schedule (1F1B: ``min(stages - s, microbatches)``; GPipe: ``microbatches``)."""
    sched = _C.make_schedule(schedule, num_stages, num_microbatches)
    return [int(x) for x in sched.simulate().peak_inflight]


def solve(problem: PlanProblem) -> PlanResult:
    """Runs the exact C++ solver (see [Note: planner exactness] in ``csrc/planner.h``).

    Raises:
        PlanInfeasibleError: no plan fits; the message names the smallest limit that would.
    """
    out = _C.solve_plan(problem)
    if not out.feasible:
        need = list(out.min_memory_limit)
        limits = problem.memory_limit
        if len(set(limits)) == 1:
            what = "the smallest memory limit that fits is "
            what += f"{need[0]} bytes ({format_bytes(need[0])})"
        else:
            what = "the smallest limits that fit (every device's limit raised by the same amount) "
            what += f"are {need} bytes"
        raise PlanInfeasibleError(
            f"no plan fits the memory limit {limits} bytes per stage, even with "
            f"{'every layer checkpointed' if problem.allow_checkpoint else 'the best layer split'}"
            f"; {what}. Raise the limit, use more stages or fewer microbatches in flight.",
            need,
        )
    return out


def evaluate_stages(
    problem: PlanProblem,
    ranges: Sequence[tuple[int, int]],
    checkpoint: Sequence[Sequence[int]],
) -> list[StageEval]:
    """The cost model applied to given layer ranges and checkpointed layers per stage."""
    return _C.evaluate_plan(problem, [tuple(r) for r in ranges], [list(c) for c in checkpoint])
