"""Planner: layers per stage and checkpointed layers per stage under a memory limit.

Under 1F1B, stage ``s`` holds activations of ``min(stages - s, microbatches)`` microbatches, so
equal layer counts leave memory unbalanced. :func:`plan` profiles the model once
(:func:`profile_model`), builds the cost model of [Note: planner cost model] (``csrc/planner.h``)
and asks the exact C++ solver (``_C.solve_plan``, see [Note: planner exactness]) for contiguous
layer ranges and a set of checkpointed layers per stage that minimize the bottleneck stage time
(forward + backward + recomputation) under each device's memory limit. The plan's reported step
time is the C++ schedule simulator's makespan for the chosen per-stage costs.

``PipelineModel(..., plan=plan)`` applies it: its layer ranges, and its checkpointed layers run
under non-reentrant ``torch.utils.checkpoint`` inside the stage graphs
(see [Note: checkpointed layers] in :mod:`pippy_xla.partition`).
"""

from __future__ import annotations

import json
import logging
import re
import statistics
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field

import torch
import torch.utils.checkpoint
from torch import nn

from pippy_xla import _C
from pippy_xla.partition import find_layers

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
    "parse_bytes",
    "plan",
    "profile_model",
    "solve",
]

logger = logging.getLogger(__name__)

ADAMW_STATES = 2
"""Optimizer-state tensors per parameter (AdamW: ``exp_avg`` and ``exp_avg_sq``)."""


# ----------------------------------------------------------------------------- cost model


@dataclass(kw_only=True, slots=True)
class LayerCost:
    """Per-microbatch cost of one decoder layer."""

    fwd: float
    """Forward time (seconds, or any unit used consistently)."""
    bwd: float
    """Backward time, without recomputation."""
    saved_bytes: int
    """Bytes saved for backward, not checkpointed."""
    saved_bytes_ckpt: int
    """Bytes saved for backward when checkpointed (the layer's positional inputs)."""
    static_bytes: int
    """Parameters + gradients + optimizer state."""
    transient_bytes: int = 0
    """Largest working set of its forward or backward on top of what persists (temporaries)."""


@dataclass(kw_only=True, slots=True)
class StageExtra:
    """Per-microbatch cost a stage has besides its layers (prologue, epilogue, shared tensors)."""

    fwd: float = 0.0
    bwd: float = 0.0
    saved_bytes: int = 0
    static_bytes: int = 0
    transient_bytes: int = 0
    buffer_bytes: int = 0
    """Transfer buffers live during a step (receives posted ahead, sends in flight)."""


@dataclass(kw_only=True, slots=True)
class PlanProblem:
    """Solver input: see [Note: planner cost model] in ``csrc/planner.h``."""

    layers: list[LayerCost]
    """One entry per decoder layer."""
    extras: list[StageExtra]
    """One entry per stage."""
    inflight: list[int]
    """Microbatches whose activations each stage holds at once."""
    memory_limit: list[int]
    """Bytes per stage's device."""
    allow_checkpoint: bool = True
    """False: plan layer ranges only."""

    def __post_init__(self) -> None:
        n = len(self.memory_limit)
        if len(self.extras) != n or len(self.inflight) != n:
            raise ValueError(
                f"extras ({len(self.extras)}), inflight ({len(self.inflight)}) and memory_limit "
                f"({n}) need one entry per stage"
            )

    def _args(self) -> tuple:
        layers = [
            (
                ly.fwd,
                ly.bwd,
                int(ly.saved_bytes),
                int(ly.saved_bytes_ckpt),
                int(ly.static_bytes),
                int(ly.transient_bytes),
            )
            for ly in self.layers
        ]
        extras = [
            (
                e.fwd,
                e.bwd,
                int(e.saved_bytes),
                int(e.static_bytes),
                int(e.transient_bytes),
                int(e.buffer_bytes),
            )
            for e in self.extras
        ]
        return layers, extras, [int(x) for x in self.inflight], [int(x) for x in self.memory_limit]


class PlanInfeasibleError(ValueError):
    """No plan fits the memory limits; ``min_memory_limit`` holds the smallest limits that do."""

    def __init__(self, message: str, min_memory_limit: list[int]) -> None:
        super().__init__(message)
        self.min_memory_limit = min_memory_limit


def inflight_counts(schedule: str, num_stages: int, num_microbatches: int) -> list[int]:
    """Microbatches each stage holds activations for at once, from the C++ simulator's replay
    of the schedule (1F1B: ``min(stages - s, microbatches)``; GPipe: ``microbatches``)."""
    sched = _C.make_schedule(schedule, num_stages, num_microbatches)
    return [int(x) for x in sched.simulate()["peak_inflight"]]


def solve(problem: PlanProblem) -> dict:
    """Runs the exact C++ solver. Returns its result dict (``stages``: per-stage ``range``,
    ``checkpoint``, ``forward``, ``backward``, ``time``, ``activation_bytes``, ``static_bytes``,
    ``memory``; ``bottleneck``; ``total_time``; ``min_memory_limit``).

    Raises:
        PlanInfeasibleError: no plan fits; the message names the smallest limit that would.
    """
    layers, extras, inflight, limits = problem._args()
    out = _C.solve_plan(layers, extras, inflight, limits, problem.allow_checkpoint)
    if not out["feasible"]:
        need = list(out["min_memory_limit"])
        if len(set(limits)) == 1:
            what = f"the smallest memory limit that fits is {need[0]} bytes ({_fmt_bytes(need[0])})"
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


def _evaluate(problem: PlanProblem, ranges, checkpoint) -> list[dict]:
    layers, extras, inflight, limits = problem._args()
    return _C.evaluate_plan(
        layers, extras, inflight, limits, [tuple(r) for r in ranges], [list(c) for c in checkpoint]
    )


# ----------------------------------------------------------------------------- plan


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
    activation_bytes: int
    """``inflight`` times the stage's saved-for-backward bytes per microbatch."""
    static_bytes: int
    """Parameters, gradients and optimizer state."""
    memory_bytes: int
    """Predicted peak: static + activations + buffers + transient."""
    memory_limit: int
    transient_bytes: int = 0
    """Largest working set on top of static bytes and activations (see [Note: planner cost
    model] in csrc/planner.h)."""
    buffer_bytes: int = 0
    """Transfer buffers: receives posted ahead and the sends in flight."""


@dataclass(kw_only=True, slots=True)
class Plan:
    """Layer ranges and checkpointed layers per stage, with predicted memory and time."""

    schedule: str
    num_microbatches: int
    stages: list[StagePlan]
    step_time: float
    """Simulated makespan of one step (``_C`` schedule simulator) with the planned stage costs."""
    bottleneck_time: float
    """Largest per-stage forward + backward time of one microbatch (the solver's objective)."""
    batch_size: int | None = None
    seq_len: int | None = None
    time_unit: str = "s"
    meta: dict = field(default_factory=dict)
    """Free-form provenance (model name, dtype, ...)."""

    @property
    def num_stages(self) -> int:
        return len(self.stages)

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
        head = (
            f"{'stage':>5} {'layers':>9} {'n':>3} {'ckpt':>4} {'inflight':>8} "
            f"{'fwd ' + unit:>10} {'bwd ' + unit:>10} {'static':>10} {'activations':>12} "
            f"{'buffers':>9} {'transient':>10} {'peak':>10} {'limit':>10}"
        )
        rows = [head]
        for st in self.stages:
            a, b = st.layers
            rows.append(
                f"{st.index:>5} {f'{a}-{b - 1}':>9} {b - a:>3} {len(st.checkpoint_layers):>4} "
                f"{st.inflight:>8} {st.forward_time * scale:>10.3f} "
                f"{st.backward_time * scale:>10.3f} {_fmt_bytes(st.static_bytes):>10} "
                f"{_fmt_bytes(st.activation_bytes):>12} {_fmt_bytes(st.buffer_bytes):>9} "
                f"{_fmt_bytes(st.transient_bytes):>10} "
                f"{_fmt_bytes(st.memory_bytes):>10} {_fmt_bytes(st.memory_limit):>10}"
            )
        rows.append(
            f"schedule {self.schedule}, {self.num_microbatches} microbatches: bottleneck stage "
            f"{self.bottleneck_time * scale:.3f} {unit}/microbatch, simulated step "
            f"{self.step_time * scale:.3f} {unit}; checkpointed layers {self.checkpoint_layers}"
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


def _make_plan(
    problem: PlanProblem, stages: list[dict], schedule: str, num_microbatches: int, **kw
) -> Plan:
    fwd = [st["forward"] for st in stages]
    bwd = [st["backward"] for st in stages]
    sim = _C.make_schedule(schedule, len(stages), num_microbatches).simulate(
        forward=fwd, backward=bwd
    )
    return Plan(
        schedule=schedule,
        num_microbatches=num_microbatches,
        stages=[
            StagePlan(
                index=s,
                layers=tuple(st["range"]),
                checkpoint_layers=list(st["checkpoint"]),
                forward_time=st["forward"],
                backward_time=st["backward"],
                inflight=problem.inflight[s],
                activation_bytes=st["activation_bytes"],
                static_bytes=st["static_bytes"],
                transient_bytes=st["transient_bytes"],
                buffer_bytes=st["buffer_bytes"],
                memory_bytes=st["memory"],
                memory_limit=problem.memory_limit[s],
            )
            for s, st in enumerate(stages)
        ],
        step_time=float(sim["makespan"]),
        bottleneck_time=max(st["time"] for st in stages),
        **kw,
    )


# ----------------------------------------------------------------------------- profiler


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
        num_stages: int,
        inflight: Sequence[int],
        memory_limit: Sequence[int],
        allow_checkpoint: bool = True,
    ) -> PlanProblem:
        """The solver input for ``num_stages`` stages."""
        extras = []
        for s in range(num_stages):
            # Transfers: a stage other than the last keeps each in-flight microbatch's output (a
            # backward root); every stage has up to RECV_LOOKAHEAD receives posted ahead, and one
            # other than the first an input gradient being sent.
            e = StageExtra(
                saved_bytes=self.shared_saved_bytes
                + (self.boundary_bytes if s < num_stages - 1 else 0),
                buffer_bytes=self.boundary_bytes * (_C.RECV_LOOKAHEAD + (1 if s > 0 else 0)),
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
            inflight=list(inflight),
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


class SavedBytes:
    """Counts bytes saved for backward under ``saved_tensors_hooks``, deduplicated by storage
    and excluding parameters and buffers (``exclude``: storages not to count)."""

    def __init__(self, exclude: Sequence[torch.Tensor] = ()) -> None:
        self._exclude = {_storage_key(t) for t in exclude}
        self.owner: dict[tuple, str] = {}
        self.sizes: dict[tuple, int] = {}
        self.region = ""

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        key = _storage_key(t)
        if key not in self._exclude and key not in self.owner:
            self.owner[key] = self.region
            self.sizes[key] = t.untyped_storage().nbytes()
        return t

    def hooks(self):
        return torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)

    def total(self) -> int:
        return sum(self.sizes.values())

    def by_region(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for key, region in self.owner.items():
            out[region] = out.get(region, 0) + self.sizes[key]
        return out


def _storage_key(t: torch.Tensor) -> tuple:
    s = t.untyped_storage()
    return (t.device.type, s.data_ptr(), s.nbytes())


def _tensors(value) -> list[torch.Tensor]:
    out: list[torch.Tensor] = []
    if isinstance(value, torch.Tensor):
        out.append(value)
    elif isinstance(value, (list, tuple)):
        for v in value:
            out.extend(_tensors(v))
    elif isinstance(value, dict):
        for v in value.values():
            out.extend(_tensors(v))
    return out


def _first_tensor(value) -> torch.Tensor:
    ts = _tensors(value)
    if not ts:
        raise ValueError("a decoder layer returned no tensor")
    return ts[0]


class _WorkingSets:
    """Largest working set per region of a forward and backward: the peak of live tensor bytes
    inside the region minus the larger of its live bytes at the start and at the end (what the
    region leaves behind is not transient). Live bytes come from the CUDA caching allocator's
    counters, or on CPU from the counting allocator (``_C.memory_stats``, see [Note: counting CPU
    allocator] in csrc/memory.h), which this installs for the rest of the process."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        if device.type == "cuda":
            self._live = lambda: torch.cuda.memory_allocated(device)
            self._peak = lambda: torch.cuda.max_memory_allocated(device)
            self._reset = lambda: torch.cuda.reset_peak_memory_stats(device)
        else:
            _C.memory_tracker_install()
            self._live = lambda: _C.memory_stats()["live_bytes"]
            self._peak = lambda: _C.memory_stats()["peak_bytes"]
            self._reset = _C.memory_reset_peak
        self.bytes: dict[str, int] = {}
        self._open: dict[str, int] = {}

    def open(self, region: str) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self._reset()
        self._open[region] = self._live()

    def close(self, region: str) -> None:
        if region not in self._open:
            return
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        start = self._open.pop(region)
        extra = max(0, self._peak() - max(start, self._live()))
        self.bytes[region] = max(self.bytes.get(region, 0), extra)

    def get(self, region: str) -> int:
        return self.bytes.get(region, 0)


_CACHE: dict[str, ModelProfile] = {}


def _cache_key(model: nn.Module, layer_cls, mb: int, seq: int, dtype, repeats: int) -> str:
    cfg = getattr(model, "config", None)
    desc = (
        cfg.to_json_string()
        if hasattr(cfg, "to_json_string")
        else repr([(n, tuple(p.shape)) for n, p in model.named_parameters()])
    )
    return json.dumps(
        [type(model).__qualname__, layer_cls.__qualname__, desc, mb, seq, str(dtype), repeats]
    )


def profile_model(
    model: nn.Module,
    layer_cls: type[nn.Module],
    *,
    microbatch_size: int,
    seq_len: int,
    repeats: int = 5,
    optimizer_states: int = ADAMW_STATES,
    vocab_size: int | None = None,
    cache: bool = True,
) -> ModelProfile:
    """Profiles ``model`` on random token batches of shape ``[microbatch_size, seq_len]`` in one
    process (no distributed needed).

    Saved-for-backward bytes are counted with ``saved_tensors_hooks`` (deduplicated by storage,
    parameters excluded) over a whole forward with the loss, attributed to the region that first
    saved them: the prologue (before the first layer), each layer, the epilogue (after the last
    layer, loss included), or "shared" (tensors passed to layers as keyword inputs: rotary
    tables, masks). A checkpointed layer saves its positional inputs (measured on layer 0 under
    ``checkpoint(..., use_reentrant=False)``, and equal to the hidden-state input for every layer).
    Times come from timestamps at layer boundaries during forward and backward (tensor hooks on
    each layer's input and output), median of ``repeats`` runs after a warm-up. The decoder layers
    are one class with one config, so they cost the same: every layer gets the median over layers
    (tiny layers are too fast to time one by one). Static bytes are parameter bytes times
    ``2 + optimizer_states`` (parameters, gradients, AdamW state). Transient bytes are each
    region's largest working set during forward and backward (the peak of live tensor bytes on
    top of what the region starts with and leaves behind: see :class:`_WorkingSets`); on CPU this
    installs the counting allocator for the rest of the process. Results are cached in memory per
    (model config, shape, dtype).
    """
    dtype = next(model.parameters()).dtype
    key = _cache_key(model, layer_cls, microbatch_size, seq_len, dtype, repeats)
    if cache and key in _CACHE:
        return _CACHE[key]
    names = find_layers(model, layer_cls)
    layers = [model.get_submodule(n) for n in names]
    num = len(layers)
    if vocab_size is None:
        vocab_size = int(getattr(getattr(model, "config", None), "vocab_size", 2))
    device = next(model.parameters()).device
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab_size, (microbatch_size, seq_len), generator=g).to(device)
    batch = {
        "input_ids": ids,
        "attention_mask": torch.ones_like(ids),
        "labels": ids.clone(),
    }
    exclude = list(model.parameters()) + list(model.buffers())
    static_factor = 2 + optimizer_states

    state = {"region": "prologue", "t": {}, "kw": [], "args": None}
    counter = SavedBytes(exclude)
    work = _WorkingSets(device)
    handles = []

    def now() -> float:
        return time.perf_counter()

    # Backward regions: the epilogue's from loss.backward() to the last layer's output gradient,
    # layer k's from its output gradient to its input gradient, the prologue's after layer 0.
    def backward_out(k: int) -> None:
        state["t"][("bout", k)] = now()
        if k == num - 1:
            work.close("epilogue backward")
        work.open(f"layer{k} backward")

    def backward_in(k: int) -> None:
        state["t"][("bin", k)] = now()
        work.close(f"layer{k} backward")
        if k == 0:
            work.open("prologue backward")

    def make_hooks(k: int):
        def pre(mod, args, kwargs):
            state["t"][("f0", k)] = now()
            if k == 0:
                work.close("prologue")
            work.open(f"layer{k}")
            counter.region = f"layer{k}"
            state["kw"].extend(_tensors(kwargs))
            if k == 0 and state["args"] is None:
                state["args"] = (args, kwargs)
            x = args[0] if args else None
            if isinstance(x, torch.Tensor) and x.requires_grad:
                x.register_hook(lambda grad: backward_in(k))

        def post(mod, args, kwargs, out):
            state["t"][("f1", k)] = now()
            work.close(f"layer{k}")
            y = _first_tensor(out)
            state["boundary"] = y.numel() * y.element_size()
            if k == num - 1:
                work.open("epilogue")
            counter.region = "epilogue" if k == num - 1 else f"between{k}"
            if y.requires_grad:
                y.register_hook(lambda grad: backward_out(k))

        return pre, post

    for k, layer in enumerate(layers):
        pre, post = make_hooks(k)
        handles.append(layer.register_forward_pre_hook(pre, with_kwargs=True))
        handles.append(layer.register_forward_hook(post, with_kwargs=True))

    # Which non-layer parameters the prologue / epilogue use (tied weights count in both).
    layer_params = {id(p) for layer in layers for p in layer.parameters()}
    used: dict[str, dict[int, torch.Tensor]] = {"prologue": {}, "epilogue": {}}

    def param_hook(mod, args):
        region = "prologue" if counter.region == "prologue" else "epilogue"
        for p in mod.parameters(recurse=False):
            if id(p) not in layer_params:
                used[region][id(p)] = p

    for mod in model.modules():
        if any(True for _ in mod.parameters(recurse=False)) and not isinstance(mod, layer_cls):
            handles.append(mod.register_forward_pre_hook(param_hook))

    was_training = model.training
    model.train()
    runs = []
    try:
        for run in range(repeats + 1):
            counter.__init__(exclude)
            counter.region = "prologue"
            state["t"].clear()
            state["kw"].clear()
            t0 = now()
            work.open("prologue")
            with counter.hooks():
                out = model(**batch, use_cache=False)
            loss = out.loss if hasattr(out, "loss") else out["loss"]
            t1 = now()
            work.close("epilogue")
            work.open("epilogue backward")
            loss.backward()
            work.close("prologue backward")
            t2 = now()
            model.zero_grad(set_to_none=True)
            if run > 0:  # the first run warms up
                runs.append((t0, t1, t2, dict(state["t"])))
            regions = counter.by_region()
            shared_keys = {_storage_key(t) for t in state["kw"]}
            shared = sum(counter.sizes[k] for k in counter.owner if k in shared_keys)
            layer_saved = [0] * num
            for key, region in counter.owner.items():
                if key in shared_keys:
                    continue
                if region.startswith("layer"):
                    layer_saved[int(region[5:])] += counter.sizes[key]
            pro_saved = sum(
                counter.sizes[k]
                for k, r in counter.owner.items()
                if r == "prologue" and k not in shared_keys
            )
            epi_saved = sum(
                counter.sizes[k]
                for k, r in counter.owner.items()
                if r == "epilogue" and k not in shared_keys
            )
            between = sum(v for r, v in regions.items() if r.startswith("between"))
            if between:
                logger.debug("profile: %d saved bytes between layers (counted in layers)", between)

        for h in handles:
            h.remove()
        handles.clear()
        # Checkpointed layer: what non-reentrant checkpointing keeps (positional inputs).
        args, kwargs = state["args"]
        args = tuple(
            a.detach().requires_grad_(a.is_floating_point()) if isinstance(a, torch.Tensor) else a
            for a in args
        )
        ck = SavedBytes(exclude + _tensors(kwargs))
        with ck.hooks():
            torch.utils.checkpoint.checkpoint(layers[0], *args, use_reentrant=False, **kwargs)
        ckpt_saved = ck.total()
    finally:
        for h in handles:
            h.remove()
        model.train(was_training)
        model.zero_grad(set_to_none=True)

    def med(values):
        return float(statistics.median(values))

    fwd_l, bwd_l, pro_f, pro_b, epi_f, epi_b = [], [], [], [], [], []
    for t0, t1, t2, t in runs:
        pro_f.append(t[("f0", 0)] - t0)
        epi_f.append(t1 - t[("f1", num - 1)])
        epi_b.append(t.get(("bout", num - 1), t1) - t1)
        pro_b.append(t2 - t.get(("bin", 0), t2))
        for k in range(num):
            fwd_l.append(t[("f1", k)] - t[("f0", k)])
            if ("bin", k) in t and ("bout", k) in t:
                bwd_l.append(t[("bin", k)] - t[("bout", k)])
    layer_fwd, layer_bwd = med(fwd_l), med(bwd_l) if bwd_l else 2 * med(fwd_l)

    def nbytes(params) -> int:
        return sum(p.numel() * p.element_size() for p in params)

    def static(params) -> int:
        trainable = [p for p in params if p.requires_grad]
        return nbytes(params) + (static_factor - 1) * nbytes(trainable)

    layer_costs = []
    for k, layer in enumerate(layers):
        params = list({id(p): p for p in layer.parameters()}.values())
        layer_costs.append(
            LayerCost(
                fwd=layer_fwd,
                bwd=layer_bwd,
                saved_bytes=layer_saved[k],
                saved_bytes_ckpt=ckpt_saved,
                static_bytes=static(params),
                transient_bytes=max(work.get(f"layer{k}"), work.get(f"layer{k} backward")),
            )
        )
    prof = ModelProfile(
        layers=layer_costs,
        prologue=StageExtra(
            fwd=med(pro_f),
            bwd=med(pro_b),
            saved_bytes=pro_saved,
            static_bytes=static(list(used["prologue"].values())),
            transient_bytes=max(work.get("prologue"), work.get("prologue backward")),
        ),
        epilogue=StageExtra(
            fwd=med(epi_f),
            bwd=med(epi_b),
            saved_bytes=epi_saved,
            static_bytes=static(list(used["epilogue"].values())),
            transient_bytes=max(work.get("epilogue"), work.get("epilogue backward")),
        ),
        shared_saved_bytes=shared,
        boundary_bytes=state["boundary"],
        microbatch_size=microbatch_size,
        seq_len=seq_len,
        dtype=str(dtype),
    )
    if cache:
        _CACHE[key] = prof
    return prof


# ----------------------------------------------------------------------------- API

_UNITS = {
    "": 1,
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}


def parse_bytes(value: float | str) -> int:
    """``20MiB``, ``1.5 GB``, ``4096`` -> bytes."""
    if isinstance(value, (int, float)):
        return int(value)
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([A-Za-z]*)\s*", value)
    if not m or m.group(2).lower() not in _UNITS:
        raise ValueError(f"cannot parse memory size {value!r}; use e.g. 20MiB, 1.5GB or 4096")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


def _fmt_bytes(n: int) -> str:
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= size:
            return f"{n / size:.2f}{unit}"
    return f"{n}B"


def _limits(memory_limit, num_stages: int) -> list[int]:
    if isinstance(memory_limit, (list, tuple)):
        if len(memory_limit) != num_stages:
            raise ValueError(
                f"memory_limit has {len(memory_limit)} entries; give one per stage "
                f"({num_stages}) or a single limit"
            )
        return [parse_bytes(x) for x in memory_limit]
    return [parse_bytes(memory_limit)] * num_stages


def plan(
    model: nn.Module,
    *,
    layer_cls: type[nn.Module],
    num_stages: int,
    num_microbatches: int,
    batch_size: int,
    seq_len: int,
    memory_limit: int | str | Sequence[int | str],
    schedule: str = "1f1b",
    allow_checkpoint: bool = True,
    profile: ModelProfile | None = None,
    repeats: int = 5,
) -> Plan:
    """Chooses layers and checkpointed layers per stage for ``model`` under ``memory_limit``.

    Args:
        model: the full model, on a real device (it is run to be profiled).
        layer_cls: the decoder-layer class.
        num_stages: pipeline stages (ranks).
        num_microbatches: microbatches per step.
        batch_size: global batch size (divisible by ``num_microbatches``).
        seq_len: sequence length.
        memory_limit: bytes per device (``int``, ``"20MiB"``, or one per stage).
        schedule: ``"1f1b"`` or ``"gpipe"`` (sets activations in flight per stage).
        allow_checkpoint: False plans layer ranges only.
        profile: a precomputed :func:`profile_model` result (default: profile now).
        repeats: timing runs for the profiler.

    Raises:
        PlanInfeasibleError: nothing fits; the message names the smallest limit that would.
    """
    if batch_size % num_microbatches:
        raise ValueError(
            f"batch_size {batch_size} is not divisible by num_microbatches {num_microbatches}"
        )
    if profile is None:
        profile = profile_model(
            model,
            layer_cls,
            microbatch_size=batch_size // num_microbatches,
            seq_len=seq_len,
            repeats=repeats,
        )
    problem = profile.problem(
        num_stages,
        inflight_counts(schedule, num_stages, num_microbatches),
        _limits(memory_limit, num_stages),
        allow_checkpoint,
    )
    out = solve(problem)
    result = _make_plan(
        problem,
        out["stages"],
        schedule,
        num_microbatches,
        batch_size=batch_size,
        seq_len=seq_len,
        meta={"model": type(model).__name__, "dtype": profile.dtype},
    )
    logger.info("plan:\n%s", result.table())
    return result


def evaluate(
    profile: ModelProfile,
    *,
    layer_ranges: Sequence[tuple[int, int]],
    checkpoint_layers: Sequence[int] = (),
    num_microbatches: int,
    memory_limit: int | str | Sequence[int | str] = 0,
    schedule: str = "1f1b",
) -> Plan:
    """The cost model's prediction for a given layout (for comparisons)."""
    n = len(layer_ranges)
    problem = profile.problem(
        n, inflight_counts(schedule, n, num_microbatches), _limits(memory_limit, n)
    )
    ck = set(checkpoint_layers)
    per_stage = [[k for k in range(a, b) if k in ck] for a, b in layer_ranges]
    stages = _evaluate(problem, layer_ranges, per_stage)
    return _make_plan(problem, stages, schedule, num_microbatches)
