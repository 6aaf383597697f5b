"""Split a decoder-only model into one ``torch.fx.GraphModule`` per pipeline stage.

The model is traced once with torch.fx, with the decoder layers, rotary embeddings and the mask
factories as leaves (see :mod:`pippy_xla.split.hf`), and every node of the trace is assigned to
stages:

- layer ``k``'s call goes to the stage whose range holds ``k``;
- any other node goes to the stage of the highest-index layer upstream of it (its "depth");
- "prologue" nodes (no layer upstream) that depend only on the batch inputs are replicated onto
  every stage that consumes them. See [Note: replicated prologue].

"""

from __future__ import annotations

import contextlib
import inspect
import keyword
import logging
import operator
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.utils.checkpoint
from torch import fx, nn

from pippy_xla._native import _C
from pippy_xla.split import hf

__all__ = ["StageGraph", "UnsupportedModelError", "find_layers", "partition"]

logger = logging.getLogger(__name__)

_ROOT_PREFIX = "model."

_META_ATTRS = ("shape", "dtype", "device", "ndim", "is_cuda", "layout")
_META_METHODS = ("size", "dim", "get_device")


class UnsupportedModelError(ValueError):
    """A model the partitioner cannot split into pipeline stages (refused at construction)."""


"""[Note: replicated prologue]

Rotary tables, attention masks and position ids are computed once from the batch inputs and
consumed by every decoder layer. Shipping them across stage boundaries would turn them into skip
connections over every boundary (pytorch #184361), so each stage recomputes them from its own
batch inputs instead. A prologue node is *replicable* when its value does not depend on parameter
data. Some prologue nodes read a parameter-dependent value only for its metadata: the mask
factories read ``inputs_embeds`` for shape/dtype/device, rotary modules read their first argument
for dtype/device, and ``x.shape`` / ``x.size()`` / ``x.device`` read nothing else either. Such
"meta-only" edges do not make the consumer parameter-dependent. When the producer behind a
meta-only edge is an ``nn.Embedding`` call, stages > 0 replace it by a zero-memory stand-in
``torch.full((), nan).expand(*ids.shape, dim)`` with the same shape, dtype and device, so those
stages hold no embedding parameter; NaN makes any wrong use of its data visible. Likewise a
parameter that a replicated value reads only for its metadata (Gemma's scaled embedding computed
by ``F.embedding`` and read by the rotary module for its dtype) is a NaN stand-in of its shape,
dtype and device (``_emit_standin``) on a stage that does not compute with it. Any other
parameter- or layer-dependent value a later stage needs is sent as a boundary tensor, except
values of parameters only (see [Note: values of parameters only]).
"""


@dataclass(kw_only=True, slots=True)
class StageGraph:
    """One pipeline stage: a graph over the original model's modules and its calling convention.

    Call as ``stage.module(*[batch[n] for n in stage.batch_inputs], *boundary_inputs)``; the
    result is always a tuple of tensors: ``num_boundary_outputs`` tensors for the next stage, or
    ``(logits,)`` on the last stage (``(logits, added)`` when :attr:`added_loss`).
    """

    index: int
    """Stage number."""
    module: fx.GraphModule
    """The stage's graph; references the original model's submodules and parameters (no copies)."""
    batch_inputs: list[str]
    """Model keyword inputs this stage consumes (in ``input_names`` order); first placeholders."""
    num_boundary_inputs: int
    """Number of tensors received from stage ``index - 1`` (0 for stage 0); last placeholders."""
    num_boundary_outputs: int
    """Number of tensors returned for stage ``index + 1`` (0 for the last stage)."""
    layers: list[int]
    """Decoder-layer indices the stage runs."""
    param_names: dict[str, str]
    """Stage-module qualified name -> original model qualified name, for every parameter and
    buffer of ``module`` (tied weights appear under every name the stage uses)."""
    code: str
    """``module.code``, for determinism checks."""
    added_loss: bool = False
    """The last stage returns ``(logits, added)``: the terms the model adds to its loss function's
    result (see [Note: terms added to the loss])."""


def _outermost(model: nn.Module, layer_cls: type[nn.Module]) -> list[str]:
    names: list[str] = []
    for name, mod in model.named_modules():
        if isinstance(mod, layer_cls) and not any(name.startswith(n + ".") for n in names):
            names.append(name)
    return names


def find_layers(model: nn.Module, layer_cls: type[nn.Module]) -> list[str]:
    """Qualified names of the decoder layers (instances of ``layer_cls``) in forward order.

    Order is registration order (``ModuleList`` index order); :func:`partition` checks it against
    the traced call order. Nested instances are not counted twice.

    Raises:
        ValueError: ``model`` holds no instance of ``layer_cls``.
    """
    if not (isinstance(layer_cls, type) and issubclass(layer_cls, nn.Module)):
        raise ValueError(f"layer_cls must be an nn.Module subclass, got {layer_cls!r}")
    names = _outermost(model, layer_cls)
    if not names:
        raise ValueError(
            f"{type(model).__name__} contains no {layer_cls.__qualname__} module. "
            + _layer_hint(model)
        )
    parents = {n.rpartition(".")[0] for n in names}
    stack = model.get_submodule(next(iter(parents)))
    if len(parents) > 1 or not isinstance(stack, (nn.ModuleList, nn.Sequential)):
        raise UnsupportedModelError(
            f"layer_cls={layer_cls.__qualname__}: its {len(names)} instances in "
            f"{type(model).__name__} ({', '.join(names[:3])}{', ...' if len(names) > 3 else ''}) "
            "are not the entries of one nn.ModuleList; the pipeline splits a model between the "
            "repeated layers of one stack. " + _layer_hint(model)
        )
    return names


def _layer_hint(model: nn.Module) -> str:
    in_lists: list[str] = []
    for _, mod in model.named_modules():
        if isinstance(mod, nn.ModuleList):
            for child in mod:
                cls = type(child).__name__
                if cls not in in_lists:
                    in_lists.append(cls)
    no_split = list(getattr(model, "_no_split_modules", None) or [])
    return (
        f"Classes found in its ModuleLists: {in_lists}; model._no_split_modules: {no_split}. "
        "Pass the decoder-layer class of this model as layer_cls."
    )


def _check_ranges(layer_ranges: Sequence[tuple[int, int]], num_layers: int) -> None:
    ranges = [tuple(r) for r in layer_ranges]
    if not ranges:
        raise ValueError("layer_ranges is empty; pass one (start, stop) range per stage")
    _C.check_stage_count(num_layers, len(ranges))
    expected = 0
    for s, r in enumerate(ranges):
        if len(r) != 2 or not all(isinstance(x, int) for x in r):
            raise ValueError(f"layer_ranges[{s}] must be a (start, stop) pair of ints, got {r!r}")
        start, stop = r
        if start != expected or stop <= start:
            raise ValueError(
                f"layer_ranges must be contiguous, non-empty, half-open ranges covering layers "
                f"0..{num_layers} in order: expected layer_ranges[{s}] = ({expected}, stop > "
                f"{expected}), found {r!r} (all ranges: {ranges})"
            )
        expected = stop
    if expected != num_layers:
        raise ValueError(
            f"layer_ranges must cover all {num_layers} decoder layers, but they end at layer "
            f"{expected} (ranges: {ranges}); make the last range end at {num_layers}"
        )


class _Root(nn.Module):
    """Our own fx root: the HF forward's decorators then run as plain Python while tracing."""

    def __init__(self, model: nn.Module, leaves: nn.ModuleDict) -> None:
        super().__init__()
        self.model = model
        setattr(self, hf.MASKS_ATTR, leaves)
        setattr(self, hf.LOSS_ATTR, hf.LossMarker())

    def _run(self, **inputs: Any) -> Any:
        params = inspect.signature(self.model.forward).parameters
        takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
        for flag, value in (("use_cache", False), ("return_dict", True)):
            if flag in params or takes_any:
                inputs[flag] = value
        if "labels" in inputs:
            with hf.patch_loss_function(self.model, getattr(self, hf.LOSS_ATTR)):
                out = self.model(**inputs)
        else:
            out = self.model(**inputs)
        if isinstance(out, (torch.Tensor, fx.Proxy)):
            return out  # a plain module: its output is the logits
        get = out.get if hasattr(out, "get") else lambda key: getattr(out, key, None)
        logits = get("logits")
        if logits is None:
            raise UnsupportedModelError(
                f"{type(self.model).__name__}'s forward returned {type(out).__name__} without "
                "logits; pippy_xla pipelines models whose output is the logits (a tensor, or an "
                "output with .logits, as HF's *ForCausalLM models return)"
            )
        loss = get("loss")
        return (logits, loss) if isinstance(loss, fx.Proxy) else logits


def _traced_root(
    model: nn.Module, layer_cls: type[nn.Module], input_names: Sequence[str], device_type: str
) -> tuple[_Root, fx.Graph]:
    """The partitioner's root around ``model`` and its trace: with a ``labels`` input when the
    model has an HF loss (see [Note: terms added to the loss]), and without it if the model's
    Python cannot be traced with labels (its logits are all the pipeline needs then)."""
    with_labels = _traces_loss(model, input_names)
    while True:
        inputs = [*input_names, "labels"] if with_labels else list(input_names)
        root_cls = type("PippyRoot", (_Root,), {"forward": _root_forward(inputs)})
        root = root_cls(model, hf.make_mask_leaves(model))
        try:
            graph = _trace(root, model, layer_cls, device_type)
        except UnsupportedModelError:
            if not with_labels:
                raise
            logger.info("%s: traced without labels", type(model).__name__, exc_info=True)
            with_labels = False
            continue
        graph.owning_module = root
        return root, graph


def _traces_loss(model: nn.Module, input_names: Sequence[str]) -> bool:
    """Whether to trace ``model`` with labels (see [Note: terms added to the loss])."""
    params = inspect.signature(model.forward).parameters
    return "labels" in params and "labels" not in input_names and hasattr(model, "loss_function")


def _root_forward(input_names: Sequence[str]) -> Any:
    args = ", ".join(input_names)
    kwargs = ", ".join(f"{n}={n}" for n in input_names)
    namespace: dict[str, Any] = {}
    exec(f"def forward(self, {args}):\n    return self._run({kwargs})\n", namespace)  # noqa: S102
    return namespace["forward"]


"""[Note: one device]

Every tensor of a stage lives on the pipeline's device. While tracing, ``x.device`` of any value
is therefore read from the first batch input, not from ``x``: a device read then never ties a
replicated value to a parameter-dependent one (``aux_loss.to(loss.device)``, ``torch.arange(...,
device=inputs_embeds.device)``), and ``x.device.type`` is the pipeline's device type as a string,
so models may branch on it (``if device.type != "mps"``).
"""


class _Proxy(fx.Proxy):
    """A proxy whose ``ndim`` is concrete when known (batch inputs are 2-D token tensors), and
    whose ``device`` is the batch's (see [Note: one device]).

    GPT-2 branches on ``attention_mask.ndim < 4``.
    """

    @property
    def ndim(self) -> Any:  # type: ignore[override]
        if "pippy_ndim" in self.node.meta:
            return self.node.meta["pippy_ndim"]
        return fx.proxy.Attribute(self, "ndim")

    def __len__(self) -> int:
        # Unpacking (``*x.shape[1:]``) asks for the length first: see [Note: branches on
        # metadata].
        length = self.tracer.sample_length(self)
        return length if length is not None else super().__len__()

    @property
    def device(self) -> Any:
        tracer = self.tracer
        if tracer.first_input is None:
            return fx.proxy.Attribute(self, "device")
        return _Device(tracer.first_input, "device")


class _Device(fx.proxy.Attribute):
    """The batch's device while tracing: its ``type`` is a concrete string."""

    @property
    def type(self) -> str:
        return self.tracer.device_type


"""[Note: branches on metadata]

Some models' Python outside the layers branches on the metadata of a value (Falcon with ALiBi:
``if causal_mask.ndim == 4``, ``if causal_mask.dtype == torch.bool``) or unpacks a shape
(``*alibi.shape[1:]``). Those branches depend on the config and the attention implementation,
not on the batch: the tracer evaluates the value on the ``meta`` device, from sample batches of
2-D token tensors of two shapes, and follows the branch they agree on (``to_bool``, ``iter``):
a branch on sizes (``if seq_len > 4``) gives different answers and stays an error. A value whose
sample cannot be computed, or a branch on tensor data, is an error naming the model's line.
``torch.finfo`` of a traced dtype becomes a graph value (:class:`_FInfo`), so the dtype stays
symbolic (autocast may change it at run time).
"""


_SAMPLE_SHAPES = ((2, 4), (3, 7))
"""Sample batch shapes ``(batch, sequence)``: a branch is followed only if they all agree."""


class _NoSample(Exception):
    """A traced value has no sample value on the meta device."""


def _finfo_attr(dtype: torch.dtype, attr: str) -> float:
    return getattr(torch.finfo(dtype), attr)


class _FInfo:
    """``torch.finfo`` of a traced dtype: each attribute a graph value."""

    def __init__(self, dtype: fx.Proxy) -> None:
        self._dtype = dtype

    def __getattr__(self, attr: str) -> fx.Proxy:
        return self._dtype.tracer.create_proxy(
            "call_function", _finfo_attr, (self._dtype, attr), {}
        )


class _Tracer(fx.Tracer):
    def __init__(self, layer_cls: type[nn.Module], device_type: str) -> None:
        super().__init__()
        self.layer_cls = layer_cls
        self.device_type = device_type
        self.first_input: fx.Proxy | None = None
        self._samples: dict[tuple[int, int], dict[fx.Node, Any]] = {}

    def to_bool(self, obj: fx.Proxy) -> bool:
        # See [Note: branches on metadata]
        try:
            value = self._agreed_sample(obj.node)
        except _NoSample:
            value = None
        if isinstance(value, bool):
            return value
        return super().to_bool(obj)

    def iter(self, obj: fx.Proxy) -> Any:
        length = self.sample_length(obj)
        if length is not None:
            return iter([obj[i] for i in range(length)])
        return super().iter(obj)

    def sample_length(self, obj: fx.Proxy) -> int | None:
        """The length of ``obj``'s sample value if it is a sequence (a shape)."""
        lengths = set()
        for shape in _SAMPLE_SHAPES:
            try:
                value = self._sample_for(obj.node, shape)
            except _NoSample:
                return None
            lengths.add(len(value) if isinstance(value, (tuple, list, torch.Size)) else None)
        return lengths.pop() if len(lengths) == 1 else None

    def _agreed_sample(self, node: fx.Node) -> Any:
        """``node``'s value (a Python value, not a tensor) if it is the same for every sample
        batch shape: a branch on sizes is not followed. Raises :class:`_NoSample`."""
        values = [self._sample_for(node, shape) for shape in _SAMPLE_SHAPES]
        first = values[0]
        if isinstance(first, torch.Tensor) or any(
            type(v) is not type(first) or v != first for v in values[1:]
        ):
            raise _NoSample(node.name)
        return first

    def _sample_for(self, node: fx.Node, shape: tuple[int, int]) -> Any:
        """``node``'s value on the meta device for a sample batch of ``shape`` (see [Note:
        branches on metadata]); raises :class:`_NoSample`."""
        samples = self._samples.setdefault(shape, {})
        if node in samples:
            return samples[node]
        args = fx.node.map_arg(node.args, lambda n: self._sample_for(n, shape))
        kwargs = fx.node.map_arg(node.kwargs, lambda n: self._sample_for(n, shape))
        try:
            if node.op == "placeholder":
                value = torch.ones(shape, dtype=torch.long, device="meta")
            elif node.op == "get_attr":
                value = _fetch_untraced(self.root, node.target)
                if isinstance(value, torch.Tensor):
                    value = torch.empty_like(value, device="meta")
            elif node.op == "call_function":
                value = node.target(*args, **kwargs)
            elif node.op == "call_method":
                value = getattr(args[0], node.target)(*args[1:], **kwargs)
            elif node.op == "call_module":
                mod = self.root.get_submodule(node.target)
                tensors = {**dict(mod.named_parameters()), **dict(mod.named_buffers())}
                meta = {k: torch.empty_like(t, device="meta") for k, t in tensors.items()}
                # forward, not __call__: the tracer routes module calls into the graph.
                with torch.nn.utils.stateless._reparametrize_module(mod, meta):
                    value = mod.forward(*args, **kwargs)
            else:
                raise _NoSample(node.name)
            if any(isinstance(v, fx.Proxy) for v in torch.utils._pytree.tree_leaves(value)):
                raise _NoSample(node.name)  # it called a submodule
        except _NoSample:
            raise
        except Exception as e:  # noqa: BLE001  (any op that cannot run on meta tensors)
            raise _NoSample(node.name) from e
        samples[node] = value
        return value

    def is_leaf_module(self, m: nn.Module, module_qualified_name: str) -> bool:
        return (
            isinstance(m, (self.layer_cls, hf.MaskLeaf, hf.LossMarker))
            or hf.is_rotary_module(m)
            or super().is_leaf_module(m, module_qualified_name)
        )

    def call_module(self, m: nn.Module, forward: Any, args: Any, kwargs: Any) -> Any:
        # See [Note: outputs recorded inside layers]
        keys = hf.recorded_outputs(m) if isinstance(m, self.layer_cls) else ()
        if not keys:
            return super().call_module(m, forward, args, kwargs)
        layer = self.create_proxy("get_attr", self.path_of_module(m), (), {})
        out = self.create_proxy("call_function", hf.call_recording, (layer, keys, *args), kwargs)
        hf.deliver(keys, [out[i + 1] for i in range(len(keys))])
        return out[0]

    def proxy(self, node: fx.Node) -> fx.Proxy:
        return _Proxy(node, self)

    def create_proxy(self, kind: str, target: Any, args: Any, kwargs: Any, *a: Any, **k: Any):
        p = super().create_proxy(kind, target, args, kwargs, *a, **k)
        if kind == "placeholder":
            p.node.meta["pippy_ndim"] = 2
            if self.first_input is None:
                self.first_input = p
        return p


def _trace(root: _Root, model: nn.Module, layer_cls: type[nn.Module], device_type: str) -> fx.Graph:
    modes = [(m, m.training) for m in model.modules()]
    model.eval()
    try:
        with hf.patch_mask_functions(model, getattr(root, hf.MASKS_ATTR)), _traced_finfo():
            return _canonical(_Tracer(layer_cls, device_type).trace(root))
    except UnsupportedModelError:
        raise
    except Exception as e:  # noqa: BLE001  (any failure of the model's Python under the tracer)
        raise UnsupportedModelError(
            f"cannot trace {type(model).__name__} into a pipeline: {type(e).__name__}: {e}"
            f"{_model_line(e)}. {SUPPORTED}"
        ) from e
    finally:
        for m, mode in modes:
            m.training = mode


@contextlib.contextmanager
def _traced_finfo() -> Any:
    """``torch.finfo`` accepts a traced dtype inside the block (see [Note: branches on
    metadata])."""
    finfo = torch.finfo

    def traced(dtype: Any = None) -> Any:
        if isinstance(dtype, fx.Proxy):
            return _FInfo(dtype)
        return finfo() if dtype is None else finfo(dtype)

    torch.finfo = traced  # type: ignore[assignment]
    try:
        yield
    finally:
        torch.finfo = finfo


"""[Note: canonical graphs]

The order in which the model's Python creates nodes may depend on more than the model: Olmo 3
iterates over a ``set`` of layer types, whose order depends on ``PYTHONHASHSEED``, which differs
between torchrun's ranks. The traced graph is therefore rebuilt in an order that depends only on
its data flow: placeholders in input order, then a depth-first walk from the output that visits
each node's inputs in argument order, with node names made afresh in that order. Two traces that
compute the same values give the same code, byte for byte, on every rank.
"""


def _canonical(graph: fx.Graph) -> fx.Graph:
    """``graph`` in data-flow order with fresh names. See [Note: canonical graphs]."""
    order: dict[fx.Node, None] = {n: None for n in graph.nodes if n.op == "placeholder"}
    output = next(n for n in reversed(graph.nodes) if n.op == "output")
    stack: list[tuple[fx.Node, bool]] = [(output, False)]
    while stack:
        node, expanded = stack.pop()
        if node in order:
            continue
        if expanded:
            order[node] = None
            continue
        stack.append((node, True))
        stack.extend((p, False) for p in reversed(node.all_input_nodes) if p not in order)
    new = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for n in order:
        name = n.target if n.op == "placeholder" else None
        args = fx.node.map_arg(n.args, lambda a: env[a])
        kwargs = fx.node.map_arg(n.kwargs, lambda a: env[a])
        env[n] = new.create_node(n.op, n.target, args, kwargs, name=name, type_expr=n.type)
        env[n].meta = dict(n.meta)
    return new


SUPPORTED = (
    "pippy_xla pipelines models torch.fx can trace outside their repeated layers: HF decoder-only "
    "causal LMs (*ForCausalLM, decoder layers of one class in one nn.ModuleList) with their own "
    "loss, and other models whose output is the logits given a loss_fn=...; the code outside the "
    "layers must not branch on tensor values or sizes"
)
"""What the partitioner can split, for the errors of models it cannot."""


def _model_line(e: BaseException) -> str:
    """`` (at file:line in function: `source`)`` for the deepest frame of ``e``'s traceback in
    the model's own code (not torch's nor pippy_xla's), or ``""``."""
    import os
    import traceback

    # torch's and pippy_xla's own frames, and the root's generated forward (see _root_forward).
    package = os.path.dirname(os.path.dirname(__file__))  # pippy_xla/, above split/
    skip = (os.path.dirname(torch.__file__), package, "<string>")
    frames = [f for f in traceback.extract_tb(e.__traceback__) if not f.filename.startswith(skip)]
    if not frames:
        return ""
    f = frames[-1]
    return f" (at {f.filename}:{f.lineno} in {f.name}: `{(f.line or '').strip()}`)"


def _producers(node: fx.Node) -> list[tuple[fx.Node, bool]]:
    """``(producer, meta_only)`` for every input edge of ``node``, in argument order."""
    out: list[tuple[fx.Node, bool]] = []

    def visit(value: Any, meta_only: bool) -> None:
        fx.node.map_arg(value, lambda n: out.append((n, meta_only)))

    meta_node = (
        node.op == "call_function" and node.target is getattr and node.args[1] in _META_ATTRS
    ) or (node.op == "call_method" and node.target in _META_METHODS)
    if meta_node:
        visit(node.args[0], True)
        visit(node.args[1:], False)
        visit(node.kwargs, False)
        return out
    if node.op == "call_module":
        mod = node.graph.owning_module.get_submodule(node.target)
        if isinstance(mod, hf.MaskLeaf):
            for key, value in node.kwargs.items():
                visit(value, key in hf.META_ONLY_MASK_KWARGS)
            visit(node.args, False)
            return out
        if hf.is_rotary_module(mod) and node.args:
            visit(node.args[0], True)
            visit(node.args[1:], False)
            visit(node.kwargs, False)
            return out
    visit(node.args, False)
    visit(node.kwargs, False)
    return out


"""[Note: checkpointed layers]

``partition(..., checkpoint_layers=[k, ...])`` (the planner's choice, see
:mod:`pippy_xla.plan.planner`) rewrites the ``call_module`` node of each listed decoder layer into
``torch.utils.checkpoint.checkpoint(<get_attr of the layer>, *args, use_reentrant=False,
**kwargs)``. The ``get_attr`` references the same submodule, so parameter names and order are
unchanged, and node names are kept, so the stage code stays a pure function of (model, partition
spec). Non-reentrant checkpointing keeps the positional tensor inputs (the hidden states) and
recomputes the layer's forward during backward; it works with inputs that do not require grad
and under the engine's C++ backward (its hooks take the GIL themselves).
"""


def _check_checkpoint_layers(checkpoint_layers: Sequence[int], num_layers: int) -> frozenset[int]:
    layers = list(checkpoint_layers)
    for k in layers:
        if not isinstance(k, int) or isinstance(k, bool) or not 0 <= k < num_layers:
            raise ValueError(
                f"checkpoint_layers must hold decoder-layer indices in [0, {num_layers}), "
                f"found {k!r} (all: {layers})"
            )
    return frozenset(layers)


def _emit_checkpoint(graph: fx.Graph, node: fx.Node, arg_transform: Any) -> fx.Node:
    # See [Note: checkpointed layers]
    args = fx.node.map_arg(node.args, arg_transform)
    kwargs = fx.node.map_arg(node.kwargs, arg_transform)
    if node.op != "call_module":  # a layer called through hf.call_recording
        return graph.create_node(
            "call_function", _checkpointed_recording, args, kwargs, name=node.name
        )
    layer = graph.create_node("get_attr", node.target, name=f"{node.name}_module")
    return graph.create_node(
        "call_function",
        torch.utils.checkpoint.checkpoint,
        (layer, *args),
        {**kwargs, "use_reentrant": False},
        name=node.name,
    )


def _checkpointed_recording(layer: nn.Module, keys: tuple[str, ...], *args: Any, **kwargs: Any):
    """:func:`hf.call_recording` under non-reentrant checkpointing (a function cannot be an
    argument in fx's generated code)."""
    return torch.utils.checkpoint.checkpoint(
        hf.call_recording, layer, keys, *args, use_reentrant=False, **kwargs
    )


def _layer_target(node: fx.Node) -> str | None:
    """The module path of the layer that ``node`` calls, if it calls one."""
    if node.op == "call_module":
        return node.target
    if node.op == "call_function" and node.target is hf.call_recording:
        return node.args[0].target
    return None


def _emit_embedding_stub(graph: fx.Graph, emb_node: fx.Node, emb: nn.Embedding, ids: fx.Node):
    # See [Note: replicated prologue]
    device = graph.call_function(getattr, (ids, "device"))
    shape = graph.call_function(getattr, (ids, "shape"))
    full = graph.call_function(
        torch.full, ((), float("nan")), {"dtype": emb.weight.dtype, "device": device}
    )
    size = graph.call_function(operator.add, (shape, (emb.embedding_dim,)))
    return graph.create_node("call_method", "expand", (full, size), name=f"{emb_node.name}_meta")


def _separate_added_loss(graph: fx.Graph, output: fx.Node, model_name: str) -> bool:
    """Rewrites a traced ``(logits, loss)`` output into ``(logits, added)`` or ``logits``; whether
    the model adds terms to its loss. See [Note: terms added to the loss]."""
    result = output.args[0]
    if not isinstance(result, tuple):
        return False
    logits, loss = result
    marker = next(
        (n for n in graph.nodes if n.op == "call_module" and n.target == hf.LOSS_ATTR), None
    )
    after_marker: dict[fx.Node, None] = {}
    if marker is not None:
        for n in graph.nodes:
            if n is marker or any(p in after_marker for p in n.all_input_nodes):
                after_marker[n] = None
    terms: list[Any] = []
    node = loss
    while node is not marker and node in after_marker:
        if not (
            node.op == "call_function"
            and node.target in (operator.add, operator.iadd, torch.add)
            and len(node.args) == 2
            and not node.kwargs
            and sum(a in after_marker for a in node.args) == 1
        ):
            raise UnsupportedModelError(
                f"{model_name} combines its loss function's result with other values by "
                f"{node.format_node()}; the pipeline supports a loss that is the loss function's "
                "result plus added terms (pass loss_fn=... to compute the whole loss yourself)"
            )
        on_path = next(a for a in node.args if a in after_marker)
        terms.extend(a for a in node.args if a is not on_path and isinstance(a, fx.Node))
        node = on_path
    if node is not marker or not terms:
        output.args = (logits,)  # no terms, or a loss computed without the loss function
        return False
    inputs: dict[fx.Node, None] = {}
    stack = list(terms)
    while stack:
        n = stack.pop()
        if n not in inputs:
            inputs[n] = None
            stack.extend(n.all_input_nodes)
    bad = [n.name for n in inputs if n in after_marker or n.target == "labels"]
    if bad:
        raise UnsupportedModelError(
            f"{model_name} adds terms to its loss that read the labels or the loss itself "
            f"({bad}); the pipeline supports added terms computed from the model's own values "
            "(pass loss_fn=... to compute the whole loss yourself)"
        )
    with graph.inserting_before(output):
        added = terms[0]
        for t in terms[1:]:
            added = graph.call_function(operator.add, (added, t))
    output.args = ((logits, added),)
    return True


def _emit_standin(graph: fx.Graph, node: fx.Node, param: nn.Parameter) -> fx.Node:
    # See [Note: replicated prologue]: a parameter read only for its metadata.
    first = next(n for n in graph.nodes if n.op == "placeholder")
    device = graph.call_function(getattr, (first, "device"))
    full = graph.call_function(
        torch.full, ((), float("nan")), {"dtype": param.dtype, "device": device}
    )
    return graph.create_node(
        "call_method", "expand", (full, tuple(param.shape)), name=f"{node.name}_standin"
    )


def partition(
    model: nn.Module,
    layer_cls: type[nn.Module],
    layer_ranges: list[tuple[int, int]],
    input_names: Sequence[str] = ("input_ids", "attention_mask"),
    checkpoint_layers: Sequence[int] = (),
    device_type: str = "cpu",
) -> list[StageGraph]:
    """Trace ``model`` (an HF ``*ForCausalLM``, or a module whose output is the logits) and split
    it into one graph per stage.

    Works on ``meta``-device models: tracing reads no data. The trace uses ``use_cache=False``,
    ``return_dict=True``, with the model in eval mode (modes restored afterwards) and, for an HF
    model, a ``labels`` input (see [Note: terms added to the loss]); the last stage returns
    ``(logits,)``, or ``(logits, added)`` for a model that adds terms to its loss.

    Args:
        model: the model; stage graphs reference its submodules, parameters and buffers.
        layer_cls: the decoder-layer class (an fx leaf; see :func:`find_layers`).
        layer_ranges: ``layer_ranges[s] = (start, stop)``, half-open, contiguous, covering all
            layers.
        input_names: model keyword inputs that the batch provides, each a 2-D ``[batch, seq]``
            tensor.
        checkpoint_layers: decoder-layer indices to run under non-reentrant activation
            checkpointing. See [Note: checkpointed layers].
        device_type: the type of the device the stages run on (see [Note: one device]).

    Raises:
        ValueError: bad ``layer_cls``, ``layer_ranges`` or ``input_names``, or a model the
            partitioner cannot split.
    """
    layer_names = find_layers(model, layer_cls)
    _check_ranges(layer_ranges, len(layer_names))
    checkpoint_set = _check_checkpoint_layers(checkpoint_layers, len(layer_names))
    input_names = list(input_names)
    for name in input_names:
        if not name.isidentifier() or keyword.iskeyword(name) or input_names.count(name) > 1:
            raise ValueError(f"input_names must be distinct identifiers, got {input_names}")
    params = inspect.signature(model.forward).parameters
    has_var_kw = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    unknown = [n for n in input_names if n not in params]
    if unknown and not has_var_kw:
        raise ValueError(
            f"{type(model).__name__}.forward has no parameter(s) {unknown}; it accepts "
            f"{list(params)}"
        )

    num_stages = len(layer_ranges)
    stage_of_layer = [s for s, (a, b) in enumerate(layer_ranges) for _ in range(a, b)]
    layer_index = {_ROOT_PREFIX + n: i for i, n in enumerate(layer_names)}

    root, graph = _traced_root(model, layer_cls, input_names, device_type)
    output = next(iter(reversed(graph.nodes)))  # torch 2.11: a _node_list, no iterator
    if output.op != "output":
        raise ValueError("traced graph does not end in an output node")
    added_loss = _separate_added_loss(graph, output, type(model).__name__)
    nodes = list(graph.nodes)

    # Liveness: only nodes the logits depend on.
    live: dict[fx.Node, None] = {output: None}
    for n in reversed(nodes):
        if n in live:
            for p, _ in _producers(n):
                live[p] = None
    live_nodes = [n for n in nodes if n in live]

    # Layer calls, in trace order.
    called: list[int] = []
    for n in live_nodes:
        if _layer_target(n) in layer_index:
            called.append(layer_index[_layer_target(n)])
    if called != list(range(len(layer_names))):
        raise ValueError(
            f"decoder layers must each be called once in registration order; the trace calls "
            f"layers {called} of {layer_names}"
        )

    # Classify nodes. home[n] = the one stage computing n; None for placeholders and replicable
    # prologue nodes (computed wherever needed). See [Note: replicated prologue].
    depth: dict[fx.Node, int] = {}
    dp: dict[fx.Node, bool] = {}  # value depends on parameter data
    replicable: dict[fx.Node, bool] = {}
    metarep: dict[fx.Node, bool] = {}  # shape/dtype/device reproducible without parameters
    home: dict[fx.Node, int | None] = {}
    for n in live_nodes:
        prods = _producers(n)
        if n.op == "output":
            home[n] = num_stages - 1
            continue
        mod = root.get_submodule(n.target) if n.op == "call_module" else None
        if _layer_target(n) in layer_index:
            d = stage_of_layer[layer_index[_layer_target(n)]]
        else:
            d = max((depth[p] for p, _ in prods), default=-1)
        depth[n] = d
        if d >= 0:
            home[n] = d
            continue
        own_params = False
        if n.op == "get_attr":
            own_params = _is_parameter(root, n)
        elif mod is not None:
            own_params = any(True for _ in mod.parameters())
        dp[n] = own_params or any(dp[p] for p, meta in prods if not meta)
        if isinstance(mod, nn.Embedding):
            metarep[n] = (
                len(n.args) == 1
                and not n.kwargs
                and isinstance(n.args[0], fx.Node)
                and replicable[n.args[0]]
            )
        elif n.op == "get_attr":
            metarep[n] = True  # a stand-in has its shape, dtype and device
        else:
            metarep[n] = not own_params and all(replicable[p] or metarep[p] for p, _ in prods)
        replicable[n] = not dp[n] and all(
            replicable[p] or (meta and metarep[p]) for p, meta in prods
        )
        # A get_attr is a reference, not a computation: every stage using it holds its own.
        home[n] = None if replicable[n] or n.op == "get_attr" else 0
    _move_values_of_parameters(live_nodes, home, depth)

    # Boundaries: a value crosses s -> s+1 when computed on a stage <= s and used on one > s.
    last_use: dict[fx.Node, int] = {}
    for n in live_nodes:
        if home.get(n) is None:
            continue
        for p, _ in _producers(n):
            if home.get(p) is not None and home[n] > home[p]:
                last_use[p] = max(last_use.get(p, -1), home[n])
    boundaries: list[list[fx.Node]] = [
        [v for v in live_nodes if v in last_use and home[v] <= s < last_use[v]]
        for s in range(num_stages - 1)
    ]

    # See [Note: stage boundary values]
    for s, values in enumerate(boundaries):
        for v in values:
            if _known_non_tensor(root, v):
                users = [u.name for u in v.users if home.get(u) is not None and home[u] > s]
                raise ValueError(
                    f"{v.format_node()} is not a tensor but would cross the boundary between "
                    f"stages {s} and {s + 1} (used by {users}); only tensors can be sent. Choose "
                    "layer_ranges that keep its producer and users on one stage, or make the "
                    "value recomputable from the batch inputs."
                )

    stages = []
    for s in range(num_stages):
        stages.append(
            _build_stage(
                s,
                root,
                live_nodes,
                home,
                replicable,
                metarep,
                boundaries,
                input_names,
                layer_ranges[s],
                layer_index,
                checkpoint_set,
                added_loss,
            )
        )
    for st in stages:
        logger.debug(
            "stage %d: layers %s, batch inputs %s, %d boundary inputs, %d boundary outputs",
            st.index,
            st.layers,
            st.batch_inputs,
            st.num_boundary_inputs,
            st.num_boundary_outputs,
        )
    return stages


"""[Note: stage boundary values]

Every boundary value is a tensor: stage outputs are sent with tensor point-to-point ops. Values
that the trace proves are not tensors (shape/dtype/device queries and Python arithmetic on them,
the ``(cos, sin)`` tuple of a rotary leaf) are rejected at partition time. Prologue values are
normally replicated (see [Note: replicated prologue]), so in practice only layer outputs and
values computed after a layer cross.
"""


def _value_kind(root: nn.Module, node: fx.Node) -> str:
    """``"meta"`` (Python metadata), ``"tuple"`` (tuple of tensors) or ``"tensor"`` (or unknown)."""
    if node.op == "call_function" and node.target is getattr:
        return "meta" if node.args[1] in _META_ATTRS else "tensor"
    if node.op == "call_method":
        return "meta" if node.target in _META_METHODS else "tensor"
    if node.op == "call_module":
        return "tuple" if hf.is_rotary_module(root.get_submodule(node.target)) else "tensor"
    if node.op == "call_function" and node.target is hf.call_recording:
        return "tuple"
    if node.op == "call_function" and node.target is operator.getitem:
        return "meta" if _value_kind(root, node.args[0]) == "meta" else "tensor"
    if node.op == "call_function" and getattr(node.target, "__module__", None) in (
        "_operator",
        "builtins",
    ):
        inputs = node.all_input_nodes
        if inputs and all(_value_kind(root, n) == "meta" for n in inputs):
            return "meta"
    return "tensor"


def _known_non_tensor(root: nn.Module, node: fx.Node) -> bool:
    return _value_kind(root, node) != "tensor"


def _fetch(root: nn.Module, target: str) -> Any:
    obj: Any = root
    for atom in target.split("."):
        obj = getattr(obj, atom)
    return obj


def _fetch_untraced(root: nn.Module, target: str) -> Any:
    """``target`` of ``root`` while tracing, when ``nn.Module.__getattr__`` returns proxies for
    parameters and buffers: read from the modules' own dictionaries."""
    *path, name = target.split(".")
    mod = root
    for atom in path:
        mod = mod._modules[atom]
    for table in (mod._parameters, mod._buffers, mod._modules, vars(mod)):
        if name in table:
            return table[name]
    raise AttributeError(target)


def _is_parameter(root: nn.Module, node: fx.Node) -> bool:
    return node.op == "get_attr" and isinstance(_fetch(root, node.target), nn.Parameter)


"""[Note: values of parameters only]

A prologue value computed from parameters alone (no batch input upstream), such as Gemma's final
norm factor ``1 + weight``, would be computed on stage 0 and sent to its users every microbatch.
Such a value is computed instead on the stage of its users, when they are all on one stage: the
parameters it reads then live there (and are tied across ranks like any other shared weight).
"""


def _move_values_of_parameters(
    live_nodes: list[fx.Node], home: dict[fx.Node, int | None], depth: dict[fx.Node, int]
) -> None:
    """See [Note: values of parameters only]."""
    of_params: dict[fx.Node, bool] = {}
    for n in live_nodes:
        if n.op in ("get_attr", "placeholder", "output"):
            of_params[n] = n.op == "get_attr"
            continue
        of_params[n] = bool(n.all_input_nodes) and all(of_params[p] for p in n.all_input_nodes)
    for n in reversed(live_nodes):
        if not of_params[n] or n.op == "get_attr" or depth.get(n, 0) >= 0 or home[n] is None:
            continue
        stages = {home.get(u) for u in n.users if u in home}
        if len(stages) == 1 and None not in stages:
            home[n] = stages.pop()


def _build_stage(
    s: int,
    root: nn.Module,
    live_nodes: list[fx.Node],
    home: dict[fx.Node, int | None],
    replicable: dict[fx.Node, bool],
    metarep: dict[fx.Node, bool],
    boundaries: list[list[fx.Node]],
    input_names: list[str],
    layer_range: tuple[int, int],
    layer_index: dict[str, int],
    checkpoint_set: frozenset[int] = frozenset(),
    added_loss: bool = False,
) -> StageGraph:
    num_stages = len(boundaries) + 1
    received = boundaries[s - 1] if s > 0 else []
    sent = boundaries[s] if s < num_stages - 1 else []
    received_set = dict.fromkeys(received)

    # What this stage computes: its homed nodes plus the replicated closure they need.
    # "meta" nodes are recomputed from embedding stand-ins only for their shape/dtype/device.
    # See [Note: replicated prologue].
    local: dict[fx.Node, str] = {}  # node -> "compute" | "meta" | "stub" | "standin" | "input"
    stack = [n for n in live_nodes if home.get(n) == s]
    for n in stack:
        local[n] = "compute"
    while stack:
        n = stack.pop()
        replicated = home.get(n) is None or local[n] == "meta"
        for p, meta in _producers(n):
            if p in received_set or home.get(p) == s:
                continue
            if p in local:
                if local[p] == "standin" and not (meta or local[n] == "meta"):
                    local[p] = "compute"  # also read for its values
                continue
            if p.op == "placeholder":
                local[p] = "input"
            elif _is_parameter(root, p) and (meta or local[n] == "meta"):
                local[p] = "standin"
            elif home.get(p) is None:
                local[p] = "compute"
                stack.append(p)
            elif s > 0 and replicated and (meta or local[n] == "meta") and metarep.get(p, False):
                is_embedding = p.op == "call_module" and isinstance(
                    root.get_submodule(p.target), nn.Embedding
                )
                local[p] = "stub" if is_embedding else "meta"
                stack.append(p)
            else:
                raise AssertionError(f"stage {s}: {p.name} needed by {n.name} is not available")

    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    placeholders = {n.target: n for n in live_nodes if n.op == "placeholder"}
    batch_inputs = [
        name
        for name in input_names
        if name in placeholders and local.get(placeholders[name]) == "input"
    ]
    for name in batch_inputs:
        env[placeholders[name]] = graph.placeholder(name)
    for v in received:
        env[v] = graph.placeholder(v.name)
    for n in live_nodes:
        kind = local.get(n)
        if kind == "compute" and layer_index.get(_layer_target(n)) in checkpoint_set:
            env[n] = _emit_checkpoint(graph, n, lambda a: env[a])
        elif kind in ("compute", "meta") and n.op != "output":
            env[n] = graph.node_copy(n, lambda a: env[a])
        elif kind == "stub":
            env[n] = _emit_embedding_stub(graph, n, root.get_submodule(n.target), env[n.args[0]])
        elif kind == "standin":
            env[n] = _emit_standin(graph, n, _fetch(root, n.target))
    if s == num_stages - 1:
        results = live_nodes[-1].args[0]
        results = results if isinstance(results, tuple) else (results,)
        graph.output(tuple(fx.node.map_arg(results, lambda a: env[a])))
    else:
        graph.output(tuple(env[v] for v in sent))
    graph.lint()

    gm = fx.GraphModule(root, graph, class_name=f"Stage{s}")
    param_names: dict[str, str] = {}
    for name, _ in [
        *gm.named_parameters(remove_duplicate=False),
        *gm.named_buffers(remove_duplicate=False),
    ]:
        if not name.startswith(_ROOT_PREFIX):
            raise AssertionError(f"stage {s} holds {name!r} outside the model")
        param_names[name] = name[len(_ROOT_PREFIX) :]
    start, stop = layer_range
    return StageGraph(
        index=s,
        module=gm,
        batch_inputs=batch_inputs,
        num_boundary_inputs=len(received),
        num_boundary_outputs=len(sent),
        layers=list(range(start, stop)),
        param_names=param_names,
        code=gm.code,
        added_loss=added_loss and s == num_stages - 1,
    )
