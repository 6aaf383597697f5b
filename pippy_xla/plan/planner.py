"""Planner: layers per stage and checkpointed layers per stage under a memory limit.

Under 1F1B, stage ``s`` holds activations of ``min(stages - s, microbatches)`` microbatches, so
equal layer counts leave memory unbalanced; ZB-H1 also holds microbatches between B and W, and
interleaved puts several stages on a rank. :func:`plan` profiles the model once
(:func:`pippy_xla.plan.profiler.profile_model`), builds the cost model of [Note: planner cost model]
(``csrc/plan/planner.h``, :mod:`pippy_xla.plan.cost_model`) from the schedule's live states (the C++
simulator's replay of what each rank holds when) and asks the exact C++ solver for contiguous
layer ranges and a set of checkpointed layers per stage that minimize the bottleneck rank time
(forward + backward + recomputation) under each rank's memory limit. The plan's reported step
time is the C++ schedule simulator's makespan for the chosen per-stage costs.

``PipelineModel(..., plan=plan)`` applies it: its layer ranges, and its checkpointed layers run
under non-reentrant ``torch.utils.checkpoint`` inside the stage graphs
(see [Note: checkpointed layers] in :mod:`pippy_xla.split.partition`).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field

from torch import nn

from pippy_xla._native import _C
from pippy_xla.plan.cost_model import (
    PLANNED_SCHEDULES,
    LayerCost,
    ModelProfile,
    PlanInfeasibleError,
    PlanProblem,
    StageEval,
    StageExtra,
    evaluate_stages,
    inflight_counts,
    solve,
)
from pippy_xla.plan.profiler import Sharding, profile_model
from pippy_xla.split.partition import LayerCls
from pippy_xla.units import format_bytes, parse_bytes

__all__ = [
    "LayerCost",
    "ModelProfile",
    "Plan",
    "PlanInfeasibleError",
    "PlanProblem",
    "StageExtra",
    "StagePlan",
    "evaluate",
    "inflight_counts",
    "limit_range",
    "parse_bytes",
    "plan",
    "profile_model",
    "solve",
]

logger = logging.getLogger(__name__)


@dataclass(kw_only=True, slots=True)
class StagePlan:
    """One stage of a :class:`Plan`, with its predicted costs."""

    index: int
    layers: tuple[int, int]
    """Half-open layer range."""
    checkpoint_layers: list[int]
    """Global indices of the stage's checkpointed layers."""
    forward_time: float
    backward_time: float
    """Including recomputation of checkpointed layers."""
    inflight: int
    """Microbatches whose activations it holds at its rank's peak."""
    activation_bytes: int
    """``inflight`` times the stage's saved-for-backward bytes per microbatch, plus
    ``pending_weight`` times ``weight_bytes``."""
    static_bytes: int
    """Parameters, gradients and optimizer state."""
    memory_bytes: int
    """Predicted peak: static + activations + buffers + transient."""
    memory_limit: int
    transient_bytes: int = 0
    """Largest working set on top of static bytes and activations (see [Note: planner cost
    model] in csrc/plan/planner.h)."""
    buffer_bytes: int = 0
    """Transfer buffers: receives posted ahead and the sends in flight."""
    rank: int = 0
    """The rank (device) that runs it. With several stages per rank (interleaved),
    ``memory_bytes``, ``transient_bytes``, ``buffer_bytes`` and ``memory_limit`` are the rank's,
    and ``activation_bytes`` is this stage's part of the rank's peak."""
    weight_time: float = 0.0
    """W's part of ``backward_time`` (ZB-H1, stages that split their backward)."""
    pending_weight: int = 0
    """Microbatches whose B has run and W not, at the rank's peak (ZB-H1)."""
    weight_bytes: int = 0
    """What one such microbatch keeps from B to W (ZB-H1)."""


@dataclass(kw_only=True, slots=True)
class Plan:
    """Layer ranges and checkpointed layers per stage, with predicted memory and time."""

    schedule: str
    num_microbatches: int
    stages: list[StagePlan]
    step_time: float
    """Simulated makespan of one step (``_C`` schedule simulator) with the planned stage costs."""
    bottleneck_time: float
    """Largest per-rank forward + backward time of one microbatch (the solver's objective)."""
    batch_size: int | None = None
    seq_len: int | None = None
    time_unit: str = "s"
    chunks: int = 1
    """Stages per rank (interleaved: 2 or more)."""
    tp_size: int = 1
    """The tensor-parallel degree it was made for: its costs are a tp rank's, and a pipeline
    with another ``tp`` refuses it (see [Note: planning under tensor parallelism] in
    :mod:`pippy_xla.plan.profiler`)."""
    ep_size: int = 1
    """The expert-parallel degree it was made for: its MoE layers' costs are an expert rank's, and
    a pipeline with another ``expert_parallel`` refuses it (see [Note: planning under expert
    parallelism] in :mod:`pippy_xla.runtime.expert_parallel`)."""
    meta: dict = field(default_factory=dict)
    """Free-form provenance (model name, dtype, ...)."""

    @property
    def num_stages(self) -> int:
        return len(self.stages)

    @property
    def num_ranks(self) -> int:
        return len(self.stages) // self.chunks

    @property
    def layer_ranges(self) -> list[tuple[int, int]]:
        return [tuple(st.layers) for st in self.stages]

    @property
    def checkpoint_layers(self) -> list[int]:
        return sorted(k for st in self.stages for k in st.checkpoint_layers)

    def table(self) -> str:
        """The plan as a text table, one row per stage."""
        unit = "ms" if self.time_unit == "s" else self.time_unit
        scale = 1e3 if self.time_unit == "s" else 1.0
        split = any(st.weight_time or st.pending_weight for st in self.stages)
        columns = [c for c in _table_columns(unit, scale) if split or not c[3]]
        rows = [" ".join(f"{title:>{width}}" for title, width, _, _ in columns)]
        rows += [
            " ".join(f"{cell(st):>{width}}" for _, width, cell, _ in columns) for st in self.stages
        ]
        per_rank = "; a rank's peak, buffers and transient are shared by its stages"
        rows.append(
            f"schedule {self.schedule}"
            + (f" ({self.chunks} stages per rank{per_rank})" if self.chunks > 1 else "")
            + f", {self.num_microbatches} microbatches: bottleneck rank "
            f"{self.bottleneck_time * scale:.3f} {unit}/microbatch, simulated step "
            f"{self.step_time * scale:.3f} {unit}; checkpointed layers {self.checkpoint_layers}"
            + (f"; per tp rank of {self.tp_size}" if self.tp_size > 1 else "")
            + (f"; experts over {self.ep_size} ranks" if self.ep_size > 1 else "")
        )
        return "\n".join(rows)

    def __str__(self) -> str:
        return self.table()

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=1, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> Plan:
        d = json.loads(text)
        stages = []
        for s in d.pop("stages"):
            s["layers"] = tuple(s["layers"])
            stages.append(StagePlan(**s))
        return cls(stages=stages, **d)


def _table_columns(unit: str, scale: float) -> list[tuple[str, int, Callable, bool]]:
    """``(title, width, cell of a StagePlan, split-backward schedules only)`` of each column of
    :meth:`Plan.table`."""
    return [
        ("stage", 5, lambda st: st.index, False),
        ("rank", 4, lambda st: st.rank, False),
        ("layers", 9, lambda st: f"{st.layers[0]}-{st.layers[1] - 1}", False),
        ("n", 3, lambda st: st.layers[1] - st.layers[0], False),
        ("ckpt", 4, lambda st: len(st.checkpoint_layers), False),
        ("inflight", 8, lambda st: st.inflight, False),
        ("B->W", 4, lambda st: st.pending_weight, True),
        (f"fwd {unit}", 10, lambda st: f"{st.forward_time * scale:.3f}", False),
        (f"bwd {unit}", 10, lambda st: f"{st.backward_time * scale:.3f}", False),
        (f"W {unit}", 10, lambda st: f"{st.weight_time * scale:.3f}", True),
        ("static", 10, lambda st: format_bytes(st.static_bytes), False),
        ("activations", 12, lambda st: format_bytes(st.activation_bytes), False),
        ("buffers", 9, lambda st: format_bytes(st.buffer_bytes), False),
        ("transient", 10, lambda st: format_bytes(st.transient_bytes), False),
        ("peak", 10, lambda st: format_bytes(st.memory_bytes), False),
        ("limit", 10, lambda st: format_bytes(st.memory_limit), False),
    ]


def _make_plan(
    problem: PlanProblem,
    stages: list[StageEval],
    schedule: str,
    num_microbatches: int,
    chunks: int,
    **kw,
) -> Plan:
    sched = _C.make_schedule(schedule, len(stages) // chunks, num_microbatches, chunks)
    fwd = [st.forward for st in stages]
    if sched.split_backward:
        # B and W apart; a stage that does not split (the first) runs its whole backward in W.
        split = [e.split_backward for e in problem.extras]
        weight = [st.weight if sp else st.backward for st, sp in zip(stages, split, strict=True)]
        bwd = [st.backward - w for st, w in zip(stages, weight, strict=True)]
        sim = sched.simulate(forward=fwd, backward=bwd, weight=weight)
    else:
        sim = sched.simulate(forward=fwd, backward=[st.backward for st in stages])
    per_rank: dict[int, float] = {}
    for st in stages:
        per_rank[st.device] = per_rank.get(st.device, 0.0) + st.time
    return Plan(
        schedule=schedule,
        num_microbatches=num_microbatches,
        chunks=chunks,
        stages=[
            StagePlan(
                index=s,
                rank=st.device,
                layers=tuple(st.range),
                checkpoint_layers=list(st.checkpoint),
                forward_time=st.forward,
                backward_time=st.backward,
                weight_time=st.weight,
                inflight=st.inflight,
                pending_weight=st.pending_weight,
                weight_bytes=st.weight_bytes if st.pending_weight else 0,
                activation_bytes=st.activation_bytes,
                static_bytes=st.static_bytes,
                transient_bytes=st.transient_bytes,
                buffer_bytes=st.buffer_bytes,
                memory_bytes=st.memory,
                memory_limit=problem.memory_limit[st.device],
            )
            for s, st in enumerate(stages)
        ],
        step_time=float(sim.makespan),
        bottleneck_time=max(per_rank.values()),
        **kw,
    )


def _limits(memory_limit, num_ranks: int) -> list[int]:
    if isinstance(memory_limit, (list, tuple)):
        if len(memory_limit) != num_ranks:
            raise ValueError(
                f"memory_limit has {len(memory_limit)} entries; give one per rank "
                f"({num_ranks}) or a single limit"
            )
        return [parse_bytes(x) for x in memory_limit]
    return [parse_bytes(memory_limit)] * num_ranks


def _layout(schedule: str, num_stages: int, chunks: int | None) -> tuple[int, int]:
    """(chunks, ranks) of a plan for ``num_stages`` stages under ``schedule``."""
    if schedule not in PLANNED_SCHEDULES:
        known = ", ".join(repr(s) for s in PLANNED_SCHEDULES)
        raise ValueError(f"unknown schedule {schedule!r}; the planner models {known}")
    chunks = _C.default_chunks(schedule) if chunks is None else chunks
    if chunks < 1 or num_stages % chunks:
        raise ValueError(
            f"num_stages {num_stages} is not a multiple of chunks {chunks}: num_stages counts "
            f"every stage, ranks x chunks"
        )
    return chunks, num_stages // chunks


def plan(
    model: nn.Module,
    *,
    layer_cls: LayerCls = None,
    num_stages: int,
    num_microbatches: int,
    batch_size: int,
    seq_len: int,
    memory_limit: int | str | Sequence[int | str],
    schedule: str = "1f1b",
    chunks: int | None = None,
    allow_checkpoint: bool = True,
    profile: ModelProfile | None = None,
    repeats: int = 5,
    input_names: Sequence[str] = ("input_ids", "attention_mask"),
    tensor_parallel: Sharding | None = None,
    expert_parallel: Sharding | None = None,
) -> Plan:
    """Chooses layers and checkpointed layers per stage for ``model`` under ``memory_limit``.

    Args:
        model: the full model, on a real device (it is run to be profiled).
        layer_cls: the decoder-layer class, a tuple of them, or ``None`` (the model's layer
            stack: see :class:`~pippy_xla.PipelineModel`).
        num_stages: pipeline stages: ranks x ``chunks``.
        num_microbatches: microbatches per step.
        batch_size, seq_len: the global batch's shape (``batch_size`` divides by microbatches).
        memory_limit: bytes per rank (``int``, ``"20MiB"``, or one per rank).
        schedule: any of :data:`pippy_xla.plan.cost_model.PLANNED_SCHEDULES` (``"1f1b"``,
            ``"gpipe"``, ``"interleaved"``, ``"zbh1"``); it sets what each rank holds when.
        chunks: stages per rank (default: the schedule's, 2 for ``"interleaved"``); several
            split the layers into equal ranges, and the plan chooses the checkpointed layers.
        allow_checkpoint, profile: False plans layer ranges only; a :func:`profile_model`.
        repeats, input_names: the profiler's timing runs and batch inputs.
        tensor_parallel, expert_parallel: ``LayerSharding(mesh)`` (``(dp, pp, tp)``) or
            ``ExpertSharding(mesh, ep)`` (``(dp, pp)``; ``batch_size`` a replica's rows): a tp
            or expert rank's costs; a collective, the first rank's plan every rank's.

    Raises:
        PlanInfeasibleError: nothing fits; the message names the smallest limit that would.
    """
    chunks, ranks = _layout(schedule, num_stages, chunks)
    tensor_parallel = _one_sharding(tensor_parallel, expert_parallel)

    def make() -> Plan:
        shape = (batch_size, num_microbatches, seq_len)
        prof = _profile_for(model, layer_cls, profile, shape, repeats, input_names, tensor_parallel)
        return _plan_from_profile(
            prof,
            schedule=schedule,
            num_stages=num_stages,
            num_microbatches=num_microbatches,
            chunks=chunks,
            limits=_limits(memory_limit, ranks),
            allow_checkpoint=allow_checkpoint,
            shape=(batch_size, seq_len),
            model_name=type(model).__name__,
        )

    return make() if tensor_parallel is None else _agreed_plan(tensor_parallel, make)


def _check_profile_everywhere(sharding: Sharding, profile: ModelProfile | None) -> None:
    """A ``profile`` given to some profiling ranks only is a ``ValueError`` on all of them (see
    [Note: planning under tensor parallelism])."""
    given = sharding.gather(profile is not None)
    if any(given) and not all(given):
        raise ValueError(
            f"plan(..., tensor_parallel=...): profile= was given on tp ranks "
            f"{[r for r, g in enumerate(given) if g]} of the first stage but not on "
            f"{[r for r, g in enumerate(given) if not g]}; pass it on every rank or on none"
        )


def _agreed_plan(sharding: Sharding, make: Callable[[], Plan]) -> Plan:
    """``make()``'s plan on ``sharding.first_rank``, made on the profiling ranks (its tp
    group) and broadcast to every rank of the job; its error is raised on every rank."""
    import pickle

    import torch.distributed as dist

    shared: list = [None]
    error: Exception | None = None
    try:
        result = make() if sharding.profiles else None
        shared = [("plan", result.to_json() if result is not None else None)]
    except Exception as e:  # raised on every rank, not left to the ones that wait
        error = e
        try:
            shared = [("error", pickle.loads(pickle.dumps(e)))]
        except Exception:  # not picklable: its type and message
            shared = [("error", RuntimeError(f"{type(e).__name__}: {e}"))]
    dist.broadcast_object_list(shared, src=sharding.first_rank)
    kind, value = shared[0]
    if kind == "plan":
        return Plan.from_json(value)
    if error is not None:
        raise error
    raise value


def _one_sharding(tensor_parallel: Sharding | None, expert_parallel: Sharding | None):
    """The sharding :func:`plan` profiles under: one of them, not both (yet)."""
    if tensor_parallel is not None and expert_parallel is not None:
        raise NotImplementedError(
            "plan() with both tensor_parallel= and expert_parallel= is not supported yet; plan "
            "one of them"
        )
    return tensor_parallel or expert_parallel


def _profile_for(
    model: nn.Module,
    layer_cls: LayerCls,
    profile: ModelProfile | None,
    shape: tuple[int, int, int],
    repeats: int,
    input_names: Sequence[str],
    sharding: Sharding | None,
) -> ModelProfile:
    """``profile``, or the model profiled at the plan's microbatch shape (``shape``: batch size,
    microbatches, sequence length)."""
    batch_size, num_microbatches, seq_len = shape
    if sharding is not None:
        _check_profile_everywhere(sharding, profile)
    if batch_size % num_microbatches:
        raise ValueError(
            f"batch_size {batch_size} is not divisible by num_microbatches {num_microbatches}"
        )
    if profile is not None:
        return profile
    return profile_model(
        model,
        layer_cls,
        microbatch_size=batch_size // num_microbatches,
        seq_len=seq_len,
        repeats=repeats,
        input_names=input_names,
        tensor_parallel=sharding,
    )


def _plan_from_profile(
    profile: ModelProfile,
    *,
    schedule: str,
    num_stages: int,
    num_microbatches: int,
    chunks: int,
    limits: list[int],
    allow_checkpoint: bool,
    shape: tuple[int, int],
    model_name: str,
) -> Plan:
    """The solved plan for ``profile`` (the arguments as :func:`plan` checked them; ``shape``:
    batch size and sequence length), logged."""
    ranges = _fixed_ranges(profile, schedule, num_stages, chunks)
    problem = profile.problem(
        schedule, num_stages, num_microbatches, limits, allow_checkpoint, chunks, ranges
    )
    result = _make_plan(
        problem,
        solve(problem).stages,
        schedule,
        num_microbatches,
        chunks,
        batch_size=shape[0],
        seq_len=shape[1],
        tp_size=profile.tp_size,
        ep_size=profile.ep_size,
        meta={"model": model_name, "dtype": profile.dtype},
    )
    logger.info("plan:\n%s", result.table())
    return result


def _fixed_ranges(
    profile: ModelProfile, schedule: str, num_stages: int, chunks: int
) -> Sequence[tuple[int, int]]:
    """The layer ranges ``schedule`` fixes (equal ranges for one with several stages per rank),
    else none: the solver chooses them."""
    if not _C.schedule_info(schedule).equal_stages:
        return ()
    if len(profile.layers) % num_stages:
        raise ValueError(
            f"schedule {schedule!r} with {chunks} stages per rank runs equal layer ranges, "
            f"and {len(profile.layers)} layers do not split into {num_stages} equal stages"
        )
    return _C.balanced_ranges(len(profile.layers), num_stages)


def limit_range(model: nn.Module, **plan_kwargs) -> tuple[int, int]:
    """The smallest memory limit (per rank) any plan fits, and the largest rank peak of the plan
    with no limit: limits between them trade speed for memory. ``plan_kwargs`` are
    :func:`plan`'s, less ``memory_limit`` (pass ``profile=`` to profile once)."""
    try:
        plan(model, memory_limit=0, **plan_kwargs)
        low = 0
    except PlanInfeasibleError as e:
        low = e.min_memory_limit[0]
    free = plan(model, memory_limit=2**62, **plan_kwargs)
    return low, max(st.memory_bytes for st in free.stages)


def evaluate(
    profile: ModelProfile,
    *,
    layer_ranges: Sequence[tuple[int, int]],
    checkpoint_layers: Sequence[int] = (),
    num_microbatches: int,
    memory_limit: int | str | Sequence[int | str] = 0,
    schedule: str = "1f1b",
    chunks: int | None = None,
) -> Plan:
    """The cost model's prediction for a given layout (for comparisons)."""
    chunks, ranks = _layout(schedule, len(layer_ranges), chunks)
    problem = profile.problem(
        schedule,
        len(layer_ranges),
        num_microbatches,
        _limits(memory_limit, ranks),
        chunks=chunks,
        ranges=layer_ranges,
    )
    ck = set(checkpoint_layers)
    per_stage = [[k for k in range(a, b) if k in ck] for a, b in layer_ranges]
    stages = evaluate_stages(problem, layer_ranges, per_stage)
    return _make_plan(
        problem,
        stages,
        schedule,
        num_microbatches,
        chunks,
        tp_size=profile.tp_size,
        ep_size=profile.ep_size,
    )
