"""Profiler: measures a model's per-microbatch costs for the planner's cost model
(:class:`pippy_xla.plan.cost_model.ModelProfile`): times, saved-for-backward bytes, static bytes and
transient working sets per layer, prologue and epilogue, in one process."""

from __future__ import annotations

import contextlib
import copy
import json
import logging
import statistics
import time
import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.utils.checkpoint
from torch import nn

from pippy_xla._native import _C
from pippy_xla.plan.cost_model import LayerCost, ModelProfile, StageExtra
from pippy_xla.split.hf import input_rows, patch_loss_function, text_vocab_size
from pippy_xla.split.partition import (
    LayerCls,
    UnsupportedModelError,
    class_names,
    find_layers,
    layer_classes,
)

__all__ = ["ADAMW_STATES", "Sharding", "SavedBytes", "profile_model"]

logger = logging.getLogger(__name__)

ADAMW_STATES = 2
"""Optimizer-state tensors per parameter (AdamW: ``exp_avg`` and ``exp_avg_sq``)."""


class Sharding(Protocol):
    """[Note: planning under tensor parallelism]

    A tensor-parallel pipeline shards each stage's decoder layers over the mesh's ``tp`` ranks
    (see [Note: pipeline x tensor parallel] in ``runtime/tensor_parallel.py``), so a layer's
    costs are a tp rank's: its time includes the layer's collectives, its static bytes are the
    rank's shard (parameters, gradients and optimizer state: ``1/tp`` of each sharded projection
    plus the whole replicated norms), its saved and transient bytes those of the sharded layer.
    The profiler measures exactly that: given a sharding (``pippy_xla.LayerSharding(mesh)``, the
    runtime's, which applies the same HF rules as the build), it shards a copy of the model's
    decoder layers (or the stand-in's, see [Note: profiling a meta model]) and runs the model on
    the ``tp`` ranks of the first pipeline position of the first replica together, the only
    ranks that profile (their layers' collectives pair up). The embedding and the head are
    sharded by the vocabulary where the pipeline shards them (the embedding's gradient counted
    whole, as the step holds it), and the model runs under the sharding's ``loss_context`` (the
    head's logits and their loss a tp rank's shard: see [Note: the vocabulary-parallel head] in
    ``runtime/tensor_parallel.py``), as in the pipeline. Saved tensors and parameters are then
    DTensors: bytes are counted on their local tensors.

    :func:`pippy_xla.plan.planner.plan` solves for the pipeline dimension with those per-rank
    costs; every tp rank of a stage holds the same shard sizes, so one rank's plan serves them
    all. The first profiling rank plans and broadcasts its plan (or its error) to every rank of
    the job: the ranks of a mesh all build the same partition (``Plan.tp_size`` records the
    degree, and a pipeline with another one refuses the plan). A ``profile=`` passed to
    ``plan`` serves the first rank only; it must go to every profiling rank or to none (a
    profiling rank without one profiles, which needs its tp peers to profile too): the profiling
    ranks check that first (:meth:`Sharding.gather`), and a mismatch is a ``ValueError`` on every
    rank instead of a rank waiting for peers that do not profile.

    This protocol is what the plan wing needs of a sharding (it imports nothing from the
    runtime)."""

    size: int
    """The tensor-parallel degree."""
    expert_parallel: int
    """The expert-parallel degree (1 for tensor parallelism)."""
    profiles: bool
    """Whether this rank profiles."""
    first_rank: int
    """The job rank whose plan every rank takes (a profiling rank)."""

    def shard(self, model: nn.Module, layer_names: Sequence[str]) -> None:
        """Shards ``model``'s decoder layers ``layer_names`` in place (a collective over the
        profiling ranks)."""

    def gather(self, value: object) -> list:
        """``value`` of every profiling rank, in tp-rank order (a collective over them)."""

    def loss_context(self) -> contextlib.AbstractContextManager:
        """The context the sharded model runs in (a vocabulary-parallel head's loss over its
        shards), after :meth:`shard`."""


class SavedBytes:
    """Counts bytes saved for backward under ``saved_tensors_hooks``, deduplicated by storage
    and excluding parameters and buffers (``exclude``: storages not to count).

    Only what is still saved when the hooks are left counts: a saved tensor that dies while
    they are on (saved by a graph the forward dropped, such as a recurrent layer's chunked
    kernel) is forgotten, as are its storage's bytes once no saved tensor holds it. Counting it
    would be wrong twice: its bytes are not held until backward, and a later tensor the
    allocator places at the same address with the same size would pass for it and go
    uncounted (a storage is known by its address and size)."""

    def __init__(self, exclude: Sequence[torch.Tensor] = ()) -> None:
        self._exclude = {_storage_key(t) for t in exclude}
        self.owner: dict[tuple, str] = {}
        self.sizes: dict[tuple, int] = {}
        self.region = ""
        self._holders: dict[tuple, int] = {}  # saved tensors alive per counted storage
        self._epoch = 0  # bumped when the hooks are left or the counts cleared

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        key = _storage_key(t)
        if key in self._exclude:
            return t
        if key not in self.owner:
            self.owner[key] = self.region
            self.sizes[key] = _local(t).untyped_storage().nbytes()
        self._holders[key] = self._holders.get(key, 0) + 1
        weakref.finalize(t, self._release, key, self._epoch)
        return t

    def _release(self, key: tuple, epoch: int) -> None:
        if epoch != self._epoch:  # died after the hooks were left (in backward): it counted
            return
        self._holders[key] -= 1
        if not self._holders[key]:
            del self._holders[key], self.owner[key], self.sizes[key]

    @contextlib.contextmanager
    def hooks(self):
        try:
            with torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t):
                yield
        finally:
            self._epoch += 1
            self._holders.clear()

    def clear(self) -> None:
        """Forgets what was counted (the excluded storages stay excluded)."""
        self._epoch += 1
        self._holders.clear()
        self.owner.clear()
        self.sizes.clear()
        self.region = ""

    def total(self) -> int:
        return sum(self.sizes.values())

    def by_region(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for key, region in self.owner.items():
            out[region] = out.get(region, 0) + self.sizes[key]
        return out


def _storage_key(t: torch.Tensor) -> tuple:
    t = _local(t)
    s = t.untyped_storage()
    return (t.device.type, s.data_ptr(), s.nbytes())


def _local(t: torch.Tensor) -> torch.Tensor:
    """``t``'s local tensor if it is a DTensor (a tensor-parallel shard), else ``t``."""
    return t._local_tensor if hasattr(t, "_local_tensor") else t


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


def _hook_layers(layers: Sequence[nn.Module], hooks) -> list:
    """Registers ``hooks.pre(k)`` and ``hooks.post(k)`` (with keyword arguments) on layer ``k``;
    the handles."""
    handles = []
    for k, layer in enumerate(layers):
        handles.append(layer.register_forward_pre_hook(hooks.pre(k), with_kwargs=True))
        handles.append(layer.register_forward_hook(hooks.post(k), with_kwargs=True))
    return handles


def _layer_kind(layer: nn.Module) -> tuple:
    """What makes decoder layers cost the same: class, parameter shapes and dtypes, and the
    attention kind transformers records on a layer or its attention module (``attention_type``:
    sliding-window or full; ``sliding_window``)."""
    kind: list = [type(layer).__qualname__]
    kind += [(n, tuple(p.shape), str(p.dtype)) for n, p in layer.named_parameters()]
    for mod in (layer, *layer.children()):
        for attr in ("attention_type", "sliding_window", "is_sliding"):
            kind.append((attr, repr(getattr(mod, attr, None))))
    return tuple(kind)


def _stand_in(
    model: nn.Module,
    layer_cls: tuple[type[nn.Module], ...],
    device: torch.device,
    sharding: Sharding | None = None,
) -> tuple[nn.Module, dict[int, int]]:
    """[Note: profiling a meta model]

    A model built on ``meta`` has no values to run. Its stand-in is a copy (still on ``meta``,
    so nothing is copied) in which the tensors outside the decoder layers and one layer of each
    kind (:func:`_layer_kind`) are materialized on ``device`` by the model's own initialization,
    and every other layer of a kind holds that layer's tensors (the same ``Parameter`` objects).
    It runs the model's forward and backward through every layer, with the activations, times
    and working sets of the real model, while holding one layer per kind: a model too large for
    any one device can be profiled where its prologue, epilogue and one layer per kind fit.

    One difference remains: a shared parameter's gradient accumulates, where a layer of the real
    model allocates its own and leaves it behind, so a sharing layer's backward working set
    would count that gradient. The kind's last layer runs its backward first (the real way), so
    each layer reports its kind's last layer's backward working set: the second value returned
    maps each layer to that layer (by index).

    With a ``sharding`` the layers are sharded after the materialization, before the sharing (so
    that every layer of a kind holds its representative's shards)."""
    from pippy_xla.split.materialize import materialize_tensors

    stand_in = copy.deepcopy(model)
    layer_names = find_layers(stand_in, layer_cls)
    layers = [stand_in.get_submodule(n) for n in layer_names]
    last_of_kind: dict[tuple, int] = {}
    for k, layer in enumerate(layers):
        last_of_kind[_layer_kind(layer)] = k
    reps = set(last_of_kind.values())
    sharing = {k: last_of_kind[_layer_kind(layer)] for k, layer in enumerate(layers)}
    skip = tuple(f"{n}." for k, n in enumerate(layer_names) if k not in reps)
    tensors = [
        *(n for n, _ in stand_in.named_parameters(remove_duplicate=False)),
        *(n for n, _ in stand_in.named_buffers(remove_duplicate=False)),
    ]
    materialize_tensors(stand_in, [n for n in tensors if not n.startswith(skip)], device)
    if sharding is not None:
        sharding.shard(stand_in, layer_names)
    for k, layer in enumerate(layers):
        rep = layers[sharing[k]]
        if rep is layer:
            continue
        for name, t in [*rep.named_parameters(), *rep.named_buffers()]:
            owner, _, attr = name.rpartition(".")
            target = layer.get_submodule(owner)
            slot = target._parameters if attr in target._parameters else target._buffers
            slot[attr] = t
    return stand_in, sharing


@contextlib.contextmanager
def _checkpointed(layers: Sequence[nn.Module], on_recompute):
    """Runs each layer's forward under non-reentrant ``torch.utils.checkpoint`` (as the stage
    graphs do, see [Note: checkpointed layers] in :mod:`pippy_xla.split.partition`) while active,
    and calls ``on_recompute(k, seconds)`` with the duration of layer ``k``'s recomputation (its
    forward run again during backward)."""

    def wrap(k: int, fn):
        def timed(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:  # a recomputation stops early (by raising) once it has what backward needs
                if torch._C._current_graph_task_id() != -1:  # inside backward: a recomputation
                    on_recompute(k, time.perf_counter() - t0)

        def forward(*args, **kwargs):
            return torch.utils.checkpoint.checkpoint(timed, *args, use_reentrant=False, **kwargs)

        return forward

    saved = [layer.__dict__.get("forward") for layer in layers]
    for k, layer in enumerate(layers):
        layer.forward = wrap(k, layer.forward)
    try:
        yield
    finally:
        for layer, fwd in zip(layers, saved, strict=True):
            if fwd is None:
                del layer.forward
            else:
                layer.forward = fwd


class _WorkingSets:
    """Largest working set per region of a forward and backward: the peak of live tensor bytes
    inside the region minus the larger of its live bytes at the start and at the end (what the
    region leaves behind is not transient). Live bytes come from the CUDA caching allocator's
    counters, or on CPU from the counting allocator (``_C.memory_stats``, see [Note: counting CPU
    allocator] in csrc/runtime/memory.h), which this installs for the rest of the process.

    Regions may overlap: in backward one tensor's gradient hook closes a layer's region and
    opens the next one's, in either order. The device has one peak counter, so before each
    reset the peak so far is credited to every region still open."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        if device.type == "cuda":
            self._live = lambda: torch.cuda.memory_allocated(device)
            self._peak = lambda: torch.cuda.max_memory_allocated(device)
            self._reset = lambda: torch.cuda.reset_peak_memory_stats(device)
        else:
            _C.memory_tracker_install()
            self._live = lambda: _C.memory_stats().live_bytes
            self._peak = lambda: _C.memory_stats().peak_bytes
            self._reset = _C.memory_reset_peak
        self.bytes: dict[str, int] = {}
        self._open: dict[str, list[int]] = {}  # region -> [live at open, peak seen]
        self.enabled = True

    def synchronize(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def live(self) -> int:
        """Live tensor bytes on the device now."""
        self.synchronize()
        return self._live()

    def peak(self) -> int:
        """The most live tensor bytes since the last reset."""
        self.synchronize()
        return self._peak()

    def reset_peak(self) -> None:
        self._reset()

    def _sync(self) -> None:
        self.synchronize()
        peak = self._peak()
        for seen in self._open.values():
            seen[1] = max(seen[1], peak)

    def open(self, region: str) -> None:
        if not self.enabled:
            return
        self._sync()
        self._reset()
        live = self._live()
        self._open[region] = [live, live]

    def close(self, region: str) -> None:
        if not self.enabled or region not in self._open:
            return
        self._sync()
        start, peak = self._open.pop(region)
        extra = max(0, peak - max(start, self._live()))
        self.bytes[region] = max(self.bytes.get(region, 0), extra)

    def get(self, region: str) -> int:
        return self.bytes.get(region, 0)


@dataclass(slots=True)
class _SplitCosts:
    """What :func:`_split_backward_costs` measures, per layer and for the epilogue."""

    w_time: list[list[float]]  # per layer: W time samples
    kept: list[int]  # per layer: what W frees (kept from B to W)
    recorded: list[int]  # per layer: what B leaves behind beyond its input gradient
    b_transient: list[int]  # per layer: B's working set on top of that
    epi_time: list[float]
    epi_kept: int
    epi_recorded: int
    epi_b_transient: int


class _SegmentCuts:
    """Forward hooks that cut the graph at every layer's input and after the last layer: each
    segment's input is a leaf (``leaves[k]``; ``leaves[num]`` the epilogue's) and ``outs[k]`` is
    layer ``k``'s output, so each segment's B and W can run alone."""

    def __init__(self, num: int) -> None:
        self.num = num
        self.leaves: dict[int, torch.Tensor] = {}
        self.outs: dict[int, torch.Tensor] = {}

    def pre(self, k: int):
        def hook(mod, args, kwargs):
            if not args or not isinstance(args[0], torch.Tensor):
                raise ValueError("profile: a decoder layer got its hidden states not positionally")
            self.leaves[k] = args[0].detach().requires_grad_(True)
            return (self.leaves[k], *args[1:]), kwargs

        return hook

    def post(self, k: int):
        def hook(mod, args, kwargs, out):
            self.outs[k] = _first_tensor(out)
            if k < self.num - 1:
                return None
            self.leaves[self.num] = self.outs[k].detach().requires_grad_(True)
            if isinstance(out, torch.Tensor):
                return self.leaves[self.num]
            return (self.leaves[self.num], *out[1:])

        return hook


def _b_step(mem: _WorkingSets, root: torch.Tensor, grad: torch.Tensor, leaf: torch.Tensor):
    """B of one segment: (input gradient, its WeightWork, bytes recorded for W, B's working set
    on top of them)."""
    before = mem.live()
    mem.reset_peak()
    (g,), work = _C.input_gradients([root], [grad], [leaf])
    top = mem.peak()
    recorded = max(0, mem.live() - before - g.numel() * g.element_size())
    return g, work, recorded, max(0, top - before - recorded)


def _split_backward_costs(
    model: nn.Module, layers: Sequence[nn.Module], batch: dict, mem: _WorkingSets, runs: int
) -> _SplitCosts:
    """A split backward (ZB-H1's B and W, :func:`_C.input_gradients`) of each layer and of the
    epilogue, as the engine runs it: one forward cut at every layer's input and after the last
    layer (each segment's input a leaf), B of every segment from the top down, then W of each
    segment alone. Measured per segment: what B leaves alive beyond its input gradient while the
    segment's graph still exists (the gradients recorded for W), W's time, and what W frees
    (what the segment kept from B to W: the weight GEMMs' inputs and the recorded gradients);
    parameter gradients exist beforehand so that W accumulates in place. Stage 0 needs none of
    this: no input of it needs a gradient, so its B is empty and its W the whole backward (see
    Engine::do_backward)."""
    num = len(layers)
    cuts = _SegmentCuts(num)
    handles = _hook_layers(layers, cuts)
    for p in model.parameters():
        if p.requires_grad:
            p.grad = torch.zeros_like(p)
    out = _SplitCosts([[] for _ in range(num)], [0] * num, [0] * num, [0] * num, [], 0, 0, 0)
    try:
        for run in range(runs + 1):
            works = _split_b(model, batch, cuts, mem, out)
            _split_w(works, mem, out, timed=run > 0)  # the first run warms up
    finally:
        for h in handles:
            h.remove()
        cuts.leaves.clear()
        cuts.outs.clear()
        model.zero_grad(set_to_none=True)
    return out


def _split_b(
    model: nn.Module, batch: dict, cuts: _SegmentCuts, mem: _WorkingSets, out: _SplitCosts
) -> list:
    """One forward and the B of every segment from the top down; ``(segment, WeightWork)`` of
    each, the epilogue's (segment ``num``) first."""
    num = cuts.num
    with _loss_function_part(model) as parts:
        result = model(**batch, use_cache=False)
    loss = parts[-1] if len(parts) == 1 else _loss(result)
    del result, parts
    grad, epi_work, rec, extra = _b_step(mem, loss, torch.ones_like(loss), cuts.leaves[num])
    out.epi_recorded = max(out.epi_recorded, rec)
    out.epi_b_transient = max(out.epi_b_transient, extra)
    del loss
    works = [(num, epi_work)]
    for k in reversed(range(num)):
        grad, work, rec, extra = _b_step(mem, cuts.outs.pop(k), grad, cuts.leaves.pop(k))
        out.recorded[k] = max(out.recorded[k], rec)
        out.b_transient[k] = max(out.b_transient[k], extra)
        works.append((k, work))
    del grad, epi_work, work
    cuts.leaves.clear()
    return works


def _split_w(works: list, mem: _WorkingSets, out: _SplitCosts, *, timed: bool) -> None:
    """W of each segment alone: its time and what it frees. Empties ``works``."""
    num = len(out.kept)
    while works:
        k, work = works.pop(0)
        before = mem.live()
        t0 = time.perf_counter()
        work.run()
        mem.synchronize()
        seconds = time.perf_counter() - t0
        freed = max(0, before - mem.live())
        del work
        if k == num:
            out.epi_kept = max(out.epi_kept, freed)
            if timed:
                out.epi_time.append(seconds)
        else:
            out.kept[k] = max(out.kept[k], freed)
            if timed:
                out.w_time[k].append(seconds)


@contextlib.contextmanager
def _loss_function_part(model: nn.Module):
    """Collects what ``model.loss_function`` returns inside the block (see [Note: terms added to
    the loss] in ``split/hf.py``). A split backward is cut at the layers' hidden states; terms
    a model adds to its loss function's loss read values inside the layers past those cuts (an
    MoE's router losses read each layer's router logits, recorded by hooks), so the epilogue's
    B would run through the layers' graphs and free what their own B and W need. The split
    costs are measured on the loss function's part alone: the pipeline computes the added
    terms beside it too, and their backward (into the routers) is small next to a layer's."""
    parts: list[torch.Tensor] = []
    fn = getattr(model, "loss_function", None)
    if fn is None:
        yield parts
        return

    def record(*args, **kwargs):  # the model may add in place (``loss += ...``): a copy
        parts.append(fn(*args, **kwargs))
        return parts[-1].clone()

    with patch_loss_function(model, record):
        yield parts


def _loss(out) -> torch.Tensor:
    """The loss of an HF model's output (an object with ``.loss``, or fx's dict of it)."""
    return out.loss if hasattr(out, "loss") else out["loss"]


_CACHE: dict[str, ModelProfile] = {}


def _cache_key(
    model: nn.Module,
    layer_cls,
    shape: tuple[int, int],
    dtype,
    repeats: int,
    inputs: Sequence[str],
    degrees: tuple[int, int],
) -> str:
    cfg = getattr(model, "config", None)
    desc = (
        cfg.to_json_string()
        if hasattr(cfg, "to_json_string")
        else repr([(n, tuple(p.shape)) for n, p in model.named_parameters()])
    )
    return json.dumps(
        [
            type(model).__qualname__,
            class_names(layer_cls),
            desc,
            *shape,
            str(dtype),
            repeats,
            list(inputs),
            list(degrees),
        ]
    )


def profile_model(
    model: nn.Module,
    layer_cls: LayerCls = None,
    *,
    microbatch_size: int,
    seq_len: int,
    repeats: int = 5,
    optimizer_states: int = ADAMW_STATES,
    vocab_size: int | None = None,
    cache: bool = True,
    device: torch.device | str | None = None,
    input_names: Sequence[str] = ("input_ids", "attention_mask"),
    tensor_parallel: Sharding | None = None,
) -> ModelProfile:
    """Profiles ``model`` on random ``[microbatch_size, seq_len]`` batches of ``input_names``
    (``PipelineConfig.input_names``; see :func:`profile_batch`), in one process.

    Saved-for-backward bytes are counted with ``saved_tensors_hooks`` (deduplicated by storage,
    parameters excluded) over a whole forward with the loss, attributed to the region that first
    saved them: the prologue (before the first layer), each layer, the epilogue (after the last
    layer, loss included), or "shared" (tensors passed to layers as keyword inputs: rotary tables,
    masks). A checkpointed layer saves its positional inputs (measured on layer 0 under
    ``checkpoint(..., use_reentrant=False)``, and equal to the hidden-state input for every layer).
    Times come from timestamps at layer boundaries during forward and backward (tensor hooks on each
    layer's input and output) over ``repeats`` runs after a warm-up. Layers of one kind
    (:func:`_layer_kind`: class, parameter shapes, attention kind) pool their samples (median).
    Recomputation time is measured too: the same runs with every layer checkpointed, timing each
    layer's forward when it runs again in backward. For split-backward schedules (ZB-H1) a split
    backward of each layer and of the epilogue is run as the engine runs it
    (:func:`_split_backward_costs`), plain and checkpointed: W's time, the bytes kept from B to W,
    and the gradients B records for W and its working set. Static bytes are parameter bytes times
    ``2 + optimizer_states`` (parameters, gradients, AdamW state). Transient bytes are each region's
    largest working set during forward and backward (the peak of live tensor bytes on top of what
    the region starts with and leaves behind: see :class:`_WorkingSets`); on CPU this installs the
    counting allocator for the rest of the process. Cached per (config, shape, dtype, degrees).

    A model built on ``meta`` is profiled through a stand-in (see [Note: profiling a meta
    model]) on ``device`` (default: the CPU), so a model that fits on no single device can be
    planned; a real model is profiled where it is (``device`` is ignored). ``tensor_parallel``
    (``LayerSharding(mesh)``, or ``ExpertSharding(mesh, ep)`` for experts) shards the layers of a
    copy, a collective ([Note: planning under tensor parallelism])."""
    _refuse_non_token_inputs(model, input_names)
    dtype = next(model.parameters()).dtype
    layer_cls = layer_classes(model, layer_cls)
    shape = (microbatch_size, seq_len)
    tp = tensor_parallel.size if tensor_parallel is not None else 1
    ep = getattr(tensor_parallel, "expert_parallel", 1)
    key = _cache_key(model, layer_cls, shape, dtype, repeats, input_names, (tp, ep))
    if cache and key in _CACHE:
        return _CACHE[key]
    model, layers, shared_backward = _profiled_model(model, layer_cls, device, tensor_parallel)
    vocab_size = _config_vocab_size(model) if vocab_size is None else vocab_size
    batch = profile_batch(input_names, *shape, vocab_size, next(model.parameters()).device)
    with getattr(tensor_parallel, "loss_context", contextlib.nullcontext)():
        measured = _measure(model, layer_cls, layers, batch, repeats)
    prof = _model_profile(measured, layers, batch, shared_backward, optimizer_states, dtype, tp)
    _worst_over(tensor_parallel, prof, ep)
    if cache:
        _CACHE[key] = prof
    return prof


def _worst_over(sharding: Sharding | None, prof: ModelProfile, ep: int) -> None:
    """``prof`` made an expert rank's of ``ep``: ``ep_size`` set and, for ``ep`` above 1, each
    cost (times and bytes of the prologue, the epilogue and every layer) set to its largest over
    the profiling ranks, a collective over them: each rank's experts receive the tokens the
    router sends them, so their bytes and times differ between the ranks, and the plan holds
    for the busiest ([Note: planning under expert parallelism] in
    ``runtime/expert_parallel.py``)."""
    prof.ep_size = ep
    if sharding is None or ep == 1:
        return
    parts = [prof.prologue, prof.epilogue, *prof.layers]
    mine = [
        {
            f: v
            for f in dir(part)
            if not f.startswith("_")
            for v in [getattr(part, f)]
            if isinstance(v, (int, float)) and not isinstance(v, bool)
        }
        for part in parts
    ]
    every = sharding.gather(mine)
    for k, part in enumerate(parts):
        for field_name in mine[k]:
            setattr(part, field_name, max(rank[k][field_name] for rank in every))


def _profiled_model(
    model: nn.Module,
    layer_cls: tuple[type[nn.Module], ...],
    device: torch.device | str | None,
    sharding: Sharding | None,
) -> tuple[nn.Module, list[nn.Module], dict[int, int]]:
    """The model to run: ``model`` itself, or its stand-in if it is on ``meta``; with a
    ``sharding``, a copy with its decoder layers sharded. Its decoder layers, and
    :func:`_stand_in`'s layer map."""
    shared_backward: dict[int, int] = {}
    if any(t.device.type == "meta" for t in [*model.parameters(), *model.buffers()]):
        model, shared_backward = _stand_in(
            model, layer_cls, torch.device(device or "cpu"), sharding
        )
    elif sharding is not None:
        model = copy.deepcopy(model)
        sharding.shard(model, find_layers(model, layer_cls))
    return model, [model.get_submodule(n) for n in find_layers(model, layer_cls)], shared_backward


def _refuse_non_token_inputs(model: nn.Module, input_names: Sequence[str]) -> None:
    """The profiler's batches are token ids and masks (:func:`profile_batch`): a model with other
    inputs (images) is refused rather than profiled on token-shaped stand-ins of them."""
    others = sorted(set(input_rows(model, input_names)) | ({"pixel_values"} & set(input_names)))
    if others:
        raise UnsupportedModelError(
            f"{type(model).__name__} takes {others}, which the profiler cannot build (it profiles "
            "on token ids and masks only, and a vision-language model's image tokens must match "
            "its images), so plan() and profile_model() cannot cost it; choose layer_ranges "
            "yourself (or leave them to the balanced default)"
        )


def _config_vocab_size(model: nn.Module) -> int:
    return int(text_vocab_size(getattr(model, "config", None)) or 2)


def _model_profile(
    measured: _Measured,
    layers: Sequence[nn.Module],
    batch: dict[str, torch.Tensor],
    shared_backward: dict[int, int],
    optimizer_states: int,
    dtype: torch.dtype,
    tp_size: int,
) -> ModelProfile:
    """The :class:`ModelProfile` of what :func:`_measure` measured on ``batch``, a tp rank's of
    ``tp_size``."""
    static = _StaticBytes(2 + optimizer_states, measured.grad_bytes)
    microbatch_size, seq_len = next(iter(batch.values())).shape
    return ModelProfile(
        layers=_layer_costs(layers, measured, static, shared_backward),
        prologue=_extra_cost(measured, static, "prologue"),
        epilogue=_extra_cost(measured, static, "epilogue"),
        shared_saved_bytes=measured.saved.shared,
        boundary_bytes=measured.hooks.boundary,
        batch_bytes_per_row=sum(t[0].numel() * t.element_size() for t in batch.values()),
        microbatch_size=microbatch_size,
        seq_len=seq_len,
        dtype=str(dtype),
        tp_size=tp_size,
    )


def profile_batch(
    input_names: Sequence[str],
    microbatch_size: int,
    seq_len: int,
    vocab_size: int,
    device: torch.device,
) -> dict[str, torch.Tensor]:
    """A random microbatch to profile with: random token ids in ``[0, vocab_size)`` for the first
    input, ones for every other (an attention mask that keeps every token: costs depend on
    shapes, not values), and ``labels`` equal to the first input (drawn from a generator seeded
    with 0)."""
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab_size, (microbatch_size, seq_len), generator=g).to(device)
    batch = {name: ids if i == 0 else torch.ones_like(ids) for i, name in enumerate(input_names)}
    batch["labels"] = ids.clone()
    return batch


class _LayerHooks:
    """Forward hooks on every decoder layer, and tensor hooks on each layer's input and output
    for backward: timestamps at layer boundaries (``t``), working-set regions (forward: the
    prologue, each layer, the epilogue; backward: the epilogue's from ``loss.backward()`` to the
    last layer's output gradient, layer ``k``'s from its output gradient to its input gradient,
    the prologue's after layer 0), the region saved tensors are counted to, the tensors passed
    to layers as keyword inputs (``kw``), layer 0's first inputs (``args``) and the size of a
    layer's output (``boundary``)."""

    def __init__(self, num: int, counter: SavedBytes, work: _WorkingSets) -> None:
        self.num, self.counter, self.work = num, counter, work
        self.t: dict[tuple[str, int], float] = {}
        self.kw: list[torch.Tensor] = []
        self.args: tuple | None = None
        self.boundary = 0

    def backward_out(self, k: int) -> None:
        self.t[("bout", k)] = time.perf_counter()
        if k == self.num - 1:
            self.work.close("epilogue backward")
        self.work.open(f"layer{k} backward")

    def backward_in(self, k: int) -> None:
        self.t[("bin", k)] = time.perf_counter()
        self.work.close(f"layer{k} backward")
        if k == 0:
            self.work.open("prologue backward")

    def pre(self, k: int):
        def hook(mod, args, kwargs):
            self.t[("f0", k)] = time.perf_counter()
            if k == 0:
                self.work.close("prologue")
            self.work.open(f"layer{k}")
            self.counter.region = f"layer{k}"
            self.kw.extend(_tensors(kwargs))
            if k == 0 and self.args is None:
                self.args = (args, kwargs)
            x = args[0] if args else None
            if isinstance(x, torch.Tensor) and x.requires_grad:
                x.register_hook(lambda grad: self.backward_in(k))

        return hook

    def post(self, k: int):
        def hook(mod, args, kwargs, out):
            self.t[("f1", k)] = time.perf_counter()
            self.work.close(f"layer{k}")
            y = _first_tensor(out)
            self.boundary = y.numel() * y.element_size()
            if k == self.num - 1:
                self.work.open("epilogue")
            self.counter.region = "epilogue" if k == self.num - 1 else f"between{k}"
            if y.requires_grad:
                y.register_hook(lambda grad: self.backward_out(k))

        return hook


def _watch_param_use(
    model: nn.Module,
    layers: Sequence[nn.Module],
    layer_cls: tuple[type[nn.Module], ...],
    counter: SavedBytes,
) -> tuple[dict[str, dict[int, torch.Tensor]], list]:
    """Which non-layer parameters the prologue and the epilogue use (tied weights count in
    both), filled in while the model runs; and the hooks' handles."""
    layer_params = {id(p) for layer in layers for p in layer.parameters()}
    used: dict[str, dict[int, torch.Tensor]] = {"prologue": {}, "epilogue": {}}

    def param_hook(mod, args):
        region = "prologue" if counter.region == "prologue" else "epilogue"
        for p in mod.parameters(recurse=False):
            if id(p) not in layer_params:
                used[region][id(p)] = p

    handles = []
    for mod in model.modules():
        if any(True for _ in mod.parameters(recurse=False)) and not isinstance(mod, layer_cls):
            handles.append(mod.register_forward_pre_hook(param_hook))
    return used, handles


@dataclass(slots=True)
class _Saved:
    """Saved-for-backward bytes of one forward by region (see :func:`profile_model`)."""

    layers: list[int]
    prologue: int
    epilogue: int
    shared: int


@dataclass(slots=True)
class _Measured:
    """Everything :func:`_measure` takes from running the model."""

    runs: list[tuple[float, float, float, dict]]  # per timed run: start, forward end, end, hooks.t
    recompute: list[list[float]]  # per layer: recomputation time samples
    saved: _Saved
    ckpt_saved: int  # what a checkpointed layer saves (layer 0's positional inputs)
    used: dict[str, dict[int, torch.Tensor]]  # see _watch_param_use
    split: _SplitCosts
    split_ckpt: _SplitCosts
    work: _WorkingSets
    hooks: _LayerHooks
    grad_bytes: dict[int, int]  # id(param) -> its gradient's bytes, where not its shard's


def _measure(
    model: nn.Module,
    layer_cls: tuple[type[nn.Module], ...],
    layers: Sequence[nn.Module],
    batch: dict,
    repeats: int,
) -> _Measured:
    """Runs the model in training mode: timed runs with saved bytes and working sets, the same
    runs with every layer checkpointed (recomputation times), the split backward plain and
    checkpointed, and one checkpointed layer's saved bytes."""
    exclude = list(model.parameters()) + list(model.buffers())
    counter = SavedBytes(exclude)
    work = _WorkingSets(next(model.parameters()).device)
    hooks = _LayerHooks(len(layers), counter, work)
    handles = _hook_layers(layers, hooks)
    used, param_handles = _watch_param_use(model, layers, layer_cls, counter)
    handles += param_handles
    was_training = model.training
    model.train()
    try:
        runs, saved, grad_bytes = _timed_runs(model, batch, hooks, repeats)
        recompute = _recompute_times(model, layers, batch, hooks, repeats)
        for h in handles:
            h.remove()
        handles.clear()
        # Split backward (ZB-H1): W times and what each layer and the epilogue keep from B to W,
        # plain and with every layer checkpointed.
        split = _split_backward_costs(model, layers, batch, work, repeats)
        with _checkpointed(layers, lambda k, seconds: None):
            split_ckpt = _split_backward_costs(model, layers, batch, work, repeats)
        ckpt_saved = _checkpointed_layer_saved(layers[0], hooks.args, exclude)
    finally:
        for h in handles:
            h.remove()
        model.train(was_training)
        model.zero_grad(set_to_none=True)
        # Layer 0's input holds (through its autograd node) a hook that holds ``hooks``: a cycle
        # gc cannot see, which kept that input's graph (the embedding, a microbatch's hidden
        # states) alive after profiling, counted in a later pipeline's peak on that rank.
        hooks.args = None
        hooks.kw.clear()
    return _Measured(
        runs, recompute, saved, ckpt_saved, used, split, split_ckpt, work, hooks, grad_bytes
    )


def _timed_runs(
    model: nn.Module, batch: dict, hooks: _LayerHooks, repeats: int
) -> tuple[list[tuple[float, float, float, dict]], _Saved, dict[int, int]]:
    """``repeats`` timed runs of forward and backward after a warm-up: their timestamps, the
    last run's saved bytes by region, and the gradients of another size than their parameter's
    local shard (:class:`_StaticBytes`)."""
    counter, work = hooks.counter, hooks.work
    runs = []
    out = None  # the last output stays alive until the next forward returns, as a caller's would
    for run in range(repeats + 1):
        counter.clear()
        counter.region = "prologue"
        hooks.t.clear()
        hooks.kw.clear()
        t0 = time.perf_counter()
        work.open("prologue")
        with counter.hooks():
            out = model(**batch, use_cache=False)
        loss = _loss(out)
        t1 = time.perf_counter()
        work.close("epilogue")
        work.open("epilogue backward")
        loss.backward()
        work.close("prologue backward")
        t2 = time.perf_counter()
        grad_bytes = {
            id(p): _nbytes([p.grad])
            for p in model.parameters()
            if p.grad is not None and _nbytes([p.grad]) != _nbytes([p])
        }
        model.zero_grad(set_to_none=True)
        if run > 0:  # the first run warms up
            runs.append((t0, t1, t2, dict(hooks.t)))
    return runs, _saved_by_region(counter, hooks.kw, hooks.num), grad_bytes


def _saved_by_region(counter: SavedBytes, kw: list[torch.Tensor], num: int) -> _Saved:
    """The counted bytes by region; tensors passed to layers as keyword inputs are "shared"."""
    shared_keys = {_storage_key(t) for t in kw}
    saved = _Saved([0] * num, 0, 0, 0)
    for key, region in counter.owner.items():
        size = counter.sizes[key]
        if key in shared_keys:
            saved.shared += size
        elif region.startswith("layer"):
            saved.layers[int(region[5:])] += size
        elif region == "prologue":
            saved.prologue += size
        elif region == "epilogue":
            saved.epilogue += size
    between = sum(v for r, v in counter.by_region().items() if r.startswith("between"))
    if between:
        logger.debug("profile: %d saved bytes between layers (counted in layers)", between)
    return saved


def _recompute_times(
    model: nn.Module, layers: Sequence[nn.Module], batch: dict, hooks: _LayerHooks, repeats: int
) -> list[list[float]]:
    """The runs of :func:`_timed_runs` with every layer checkpointed, timing each layer's
    recomputation. Only times are taken (working sets and saved bytes come from those runs)."""
    hooks.work.enabled = False
    samples: list[list[float]] = [[] for _ in layers]
    recording = [False]

    def on_recompute(k: int, seconds: float) -> None:
        if recording[0]:
            samples[k].append(seconds)

    with _checkpointed(layers, on_recompute):
        for run in range(repeats + 1):
            recording[0] = run > 0  # the first run warms up
            hooks.counter.region = "prologue"  # the hooks track regions as above
            out = model(**batch, use_cache=False)
            _loss(out).backward()
            model.zero_grad(set_to_none=True)
    hooks.work.enabled = True
    return samples


def _checkpointed_layer_saved(layer: nn.Module, inputs: tuple, exclude: list) -> int:
    """What non-reentrant checkpointing of ``layer`` keeps (its positional inputs), given the
    ``(args, kwargs)`` it was called with."""
    args, kwargs = inputs
    args = tuple(
        a.detach().requires_grad_(a.is_floating_point()) if isinstance(a, torch.Tensor) else a
        for a in args
    )
    ck = SavedBytes(exclude + _tensors(kwargs))
    with ck.hooks():  # the output holds what is saved until the hooks are left
        out = torch.utils.checkpoint.checkpoint(layer, *args, use_reentrant=False, **kwargs)
    del out
    return ck.total()


def _med(values) -> float:
    return float(statistics.median(values))


@dataclass(slots=True)
class _Times:
    """Time samples per timed run: the prologue's and epilogue's forward and backward, and each
    layer's forward and backward."""

    pro_f: list[float]
    pro_b: list[float]
    epi_f: list[float]
    epi_b: list[float]
    fwd: list[list[float]]
    bwd: list[list[float]]


def _times(runs: list[tuple[float, float, float, dict]], num: int) -> _Times:
    out = _Times([], [], [], [], [[] for _ in range(num)], [[] for _ in range(num)])
    for t0, t1, t2, t in runs:
        out.pro_f.append(t[("f0", 0)] - t0)
        out.epi_f.append(t1 - t[("f1", num - 1)])
        out.epi_b.append(t.get(("bout", num - 1), t1) - t1)
        out.pro_b.append(t2 - t.get(("bin", 0), t2))
        for k in range(num):
            out.fwd[k].append(t[("f1", k)] - t[("f0", k)])
            if ("bin", k) in t and ("bout", k) in t:
                out.bwd[k].append(t[("bin", k)] - t[("bout", k)])
    return out


def _layer_times(
    layers: Sequence[nn.Module], times: _Times, m: _Measured
) -> list[tuple[float, float, float, float, float]]:
    """``(forward, backward, recompute, W, checkpointed W)`` per layer. Layers of one kind pool
    their samples (one tiny layer is too fast to time alone, and identical layers should get
    identical costs)."""
    kinds: dict[tuple, list[int]] = {}
    for k, layer in enumerate(layers):
        kinds.setdefault(_layer_kind(layer), []).append(k)
    layer_time = [(0.0, 0.0, 0.0, 0.0, 0.0)] * len(layers)
    for members in kinds.values():
        f = _med([x for k in members for x in times.fwd[k]])
        b_samples = [x for k in members for x in times.bwd[k]]
        b = _med(b_samples) if b_samples else 2 * f
        r_samples = [x for k in members for x in m.recompute[k]]
        r = _med(r_samples) if r_samples else f
        w = min(b, _med([x for k in members for x in m.split.w_time[k]]))
        w_ckpt = _med([x for k in members for x in m.split_ckpt.w_time[k]])
        for k in members:
            layer_time[k] = (f, b, r, w, w_ckpt)
    return layer_time


@dataclass(slots=True)
class _StaticBytes:
    """Parameter bytes, their gradients' and ``factor - 2`` times the trainable ones' (optimizer
    states). A gradient is the size of the parameter's local shard, or ``grad_bytes``' where the
    backward left it another size (a vocabulary-parallel embedding's gradient is whole until
    the step reshards it)."""

    factor: int
    grad_bytes: dict[int, int]

    def __call__(self, params: Sequence[torch.Tensor]) -> int:
        trainable = [p for p in params if p.requires_grad]
        grads = sum(self.grad_bytes.get(id(p), _nbytes([p])) for p in trainable)
        return _nbytes(params) + grads + (self.factor - 2) * _nbytes(trainable)


def _nbytes(params: Sequence[torch.Tensor]) -> int:
    """Bytes held by this rank (a DTensor's local shard)."""
    return sum(_local(p).numel() * p.element_size() for p in params)


def _layer_costs(
    layers: Sequence[nn.Module],
    m: _Measured,
    static: _StaticBytes,
    shared_backward: dict[int, int],
) -> list[LayerCost]:
    layer_time = _layer_times(layers, _times(m.runs, len(layers)), m)
    costs = []
    for k, layer in enumerate(layers):
        params = list({id(p): p for p in layer.parameters()}.values())
        f, b, r, w, w_ckpt = layer_time[k]
        costs.append(
            LayerCost(
                fwd=f,
                bwd=b,
                recompute=r,
                saved_bytes=m.saved.layers[k],
                saved_bytes_ckpt=m.ckpt_saved,
                static_bytes=static(params),
                transient_bytes=max(
                    m.work.get(f"layer{k}"),
                    m.work.get(f"layer{shared_backward.get(k, k)} backward"),
                ),
                weight=w,
                weight_ckpt=w_ckpt,
                weight_bytes=m.split.kept[k],
                weight_bytes_ckpt=m.split_ckpt.kept[k],
                recorded_bytes=m.split.recorded[k],
                split_transient_bytes=m.split.b_transient[k],
            )
        )
    return costs


def _extra_cost(m: _Measured, static: _StaticBytes, region: str) -> StageExtra:
    """The costs of the ``"prologue"`` or the ``"epilogue"``. Stage 0's W is its whole backward
    (see :func:`_split_backward_costs`); the epilogue's comes from the split backward."""
    times = _times(m.runs, len(m.recompute))
    fwd, bwd = (times.pro_f, times.pro_b) if region == "prologue" else (times.epi_f, times.epi_b)
    extra = StageExtra(
        fwd=_med(fwd),
        bwd=_med(bwd),
        saved_bytes=getattr(m.saved, region),
        static_bytes=static(list(m.used[region].values())),
        transient_bytes=max(m.work.get(region), m.work.get(f"{region} backward")),
        weight=_med(bwd),
    )
    if region == "epilogue":
        extra.weight = min(_med(bwd), _med(m.split.epi_time))
        extra.weight_bytes = m.split.epi_kept
        extra.recorded_bytes = m.split.epi_recorded
        extra.split_transient_bytes = m.split.epi_b_transient
    return extra
