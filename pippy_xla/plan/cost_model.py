"""The planner's cost model: what a stage costs in time and memory for a choice of layers and
checkpointed layers, and the exact C++ solver over it.

The cost types (:class:`LayerCost`, :class:`StageExtra`, :class:`PlanProblem`) are the C++
structs of ``csrc/plan/planner.h``, bound with the same field names; the formulas are in
[Note: planner cost model] there. :class:`ModelProfile` holds measured costs of a model
(:func:`pippy_xla.plan.profiler.profile_model`) and turns them into a :class:`PlanProblem` for a
number of stages.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from pippy_xla._native import _C
from pippy_xla.units import format_bytes

LayerCost = _C.LayerCost
PlanProblem = _C.PlanProblem
PlanResult = _C.PlanResult
StageEval = _C.StageEval
StageExtra = _C.StageExtra

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

PLANNED_SCHEDULES = tuple(_C.train_schedule_names())
"""Schedules the cost model describes: every training schedule (1F1B, GPipe, interleaved with
given equal layer ranges, ZB-H1 with what B keeps for W)."""


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
    batch_bytes_per_row: int
    """Bytes of one row (sample) of the batch the model was profiled with, over all its input
    tensors (token ids, attention mask and labels): what every rank holds of the batch, per
    row."""
    microbatch_size: int
    seq_len: int
    dtype: str
    tp_size: int = 1
    """The tensor-parallel degree the decoder layers were profiled at: their costs are a tp
    rank's (see [Note: planning under tensor parallelism] in :mod:`pippy_xla.plan.profiler`)."""
    ep_size: int = 1
    """The expert-parallel degree the decoder layers were profiled at: a rank's share of each MoE
    layer's experts, and the all-to-all in its time (see [Note: planning under expert
    parallelism] in :mod:`pippy_xla.runtime.expert_parallel`)."""

    def problem(
        self,
        schedule: str,
        num_stages: int,
        num_microbatches: int,
        memory_limit: Sequence[int],
        allow_checkpoint: bool = True,
        chunks: int | None = None,
        ranges: Sequence[tuple[int, int]] = (),
    ) -> PlanProblem:
        """The solver input for ``num_stages`` stages under ``schedule``: ``chunks`` stages per
        rank (default: the schedule's), placed on ranks as the schedule places them, and
        ``memory_limit`` per rank. ``ranges`` fixes the
        layer ranges (needed with several stages per rank)."""
        chunks = _C.default_chunks(schedule) if chunks is None else chunks
        if chunks < 1 or num_stages % chunks:
            raise ValueError(
                f"{num_stages} stages do not split into {chunks} stages per rank; "
                "num_stages is ranks x chunks"
            )
        ranks = num_stages // chunks
        sched = _C.make_schedule(schedule, ranks, num_microbatches, chunks)
        receives = _C.peak_receive_buffers(sched)
        batch_bytes = num_microbatches * self.microbatch_size * self.batch_bytes_per_row
        extras = [
            self._stage_extra(s, num_stages, ranks, sched, receives, batch_bytes)
            for s in range(num_stages)
        ]
        return PlanProblem(
            layers=list(self.layers),
            extras=extras,
            stage_device=list(sched.stage_rank),
            live_states=sched.simulate().live_states,
            memory_limit=list(memory_limit),
            ranges=[tuple(r) for r in ranges],
            allow_checkpoint=allow_checkpoint,
        )

    def _stage_extra(
        self,
        s: int,
        num_stages: int,
        ranks: int,
        sched: _C.Schedule,
        receives: Sequence[int],
        batch_bytes: int,
    ) -> StageExtra:
        """Stage ``s``'s costs besides its layers.

        Transfers: a stage other than the last keeps each in-flight microbatch's output (a
        backward root). Receive buffers: the most alive at once on the rank under the engine's
        posting rule (_C.peak_receive_buffers), counted once per rank (on its first stage), with
        the whole batch every rank holds (batch_bytes_per_row per row). A stage other than the
        first also has up to two input gradients being sent (the previous one's send may still
        wait for its receiver while the next is computed). Under a split backward every stage but
        the first splits (the first has no input that needs a gradient: its W is its whole
        backward)."""
        rank = sched.stage_rank[s]
        e = StageExtra(
            saved_bytes=self.shared_saved_bytes
            + (self.boundary_bytes if s < num_stages - 1 else 0),
            buffer_bytes=(self.boundary_bytes * receives[rank] + batch_bytes if s < ranks else 0)
            + (2 * self.boundary_bytes if s > 0 else 0),
            split_backward=sched.split_backward and s > 0,
        )
        for part, on in ((self.prologue, s == 0), (self.epilogue, s == num_stages - 1)):
            if on:
                e.fwd += part.fwd
                e.bwd += part.bwd
                e.weight += part.weight
                e.saved_bytes += part.saved_bytes
                e.weight_bytes += part.weight_bytes
                e.recorded_bytes += part.recorded_bytes
                e.static_bytes += part.static_bytes
                e.transient_bytes = max(e.transient_bytes, part.transient_bytes)
                e.split_transient_bytes = max(e.split_transient_bytes, part.split_transient_bytes)
        return e

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

    def __reduce__(self):  # pickled whole (a plan's error is broadcast to every rank)
        return type(self), (str(self), self.min_memory_limit)


def inflight_counts(schedule: str, num_stages: int, num_microbatches: int) -> list[int]:
    """Microbatches each stage holds activations for at once, from the C++ simulator's replay
    of the schedule (1F1B: ``min(stages - s, microbatches)``; GPipe: ``microbatches``)."""
    sched = _C.make_schedule(schedule, num_stages, num_microbatches)
    return [int(x) for x in sched.simulate().peak_inflight]


def solve(problem: PlanProblem) -> PlanResult:
    """Runs the exact C++ solver (see [Note: planner exactness] in ``csrc/plan/planner.h``).

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
