"""Tracing a model for the partitioner: torch.fx with the decoder layers, rotary embeddings and
mask factories as leaves (see :mod:`pippy_xla.split.hf`), under our own root module, on any
device type including ``meta`` (metadata branches answered by sampling), rebuilt in a canonical
order, with the terms a model adds to its loss separated from the loss function's result."""

from __future__ import annotations

import collections
import contextlib
import inspect
import logging
import operator
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import fx, nn

from pippy_xla.split import hf

__all__ = [
    "ROOT_PREFIX",
    "SELF_META",
    "SELF_META_METHODS",
    "SUPPORTED",
    "UnsupportedModelError",
    "separate_added_loss",
    "traced_root",
]

logger = logging.getLogger(__name__)


ROOT_PREFIX = "model."


class UnsupportedModelError(ValueError):
    """A model the partitioner cannot split into pipeline stages (refused at construction)."""


class _Root(nn.Module):
    """Our own fx root: the HF forward's decorators then run as plain Python while tracing."""

    def __init__(self, model: nn.Module, leaves: nn.ModuleDict) -> None:
        super().__init__()
        self.model = model
        setattr(self, hf.MASKS_ATTR, leaves)
        setattr(self, hf.LOSS_ATTR, hf.LossMarker())

    constants: dict[str, Any] = {}
    """Keyword arguments passed to the model as constants where its forward names them."""

    def _run(self, **inputs: Any) -> Any:
        params = inspect.signature(self.model.forward).parameters
        takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
        for flag, value in (("use_cache", False), ("return_dict", True)):
            if flag in params or takes_any:
                inputs[flag] = value
        inputs.update((k, v) for k, v in self.constants.items() if k in params)
        if "labels" in inputs:
            with hf.patch_loss_function(self.model, getattr(self, hf.LOSS_ATTR)):
                out = self.model(**inputs)
        else:
            out = self.model(**inputs)
        if isinstance(out, (torch.Tensor, fx.Proxy)):
            return out  # a plain module: its output is the logits
        get = out.get if hasattr(out, "get") else lambda key: getattr(out, key, None)
        logits = get("logits")
        if logits is None:  # a base model (no head): its last hidden states, for a loss_fn
            logits = get("last_hidden_state")
        if logits is None:
            raise UnsupportedModelError(
                f"{type(self.model).__name__}'s forward returned {type(out).__name__} without "
                "logits or last_hidden_state; pippy_xla pipelines models whose output is the "
                "logits (a tensor, or an output with .logits, as HF's *ForCausalLM models "
                "return) or a base model's last hidden states (with a loss_fn)"
            )
        loss = get("loss")
        return (logits, loss) if isinstance(loss, fx.Proxy) else logits


def traced_root(
    model: nn.Module,
    layer_cls: tuple[type[nn.Module], ...],
    input_names: Sequence[str],
    device_type: str,
    loss: bool = True,
    constants: dict[str, Any] | None = None,
) -> tuple[_Root, fx.Graph]:
    """The partitioner's root around ``model`` and its trace: with a ``labels`` input when
    ``loss`` and the model has an HF loss (see [Note: terms added to the loss]), and without it
    if the model's Python cannot be traced with labels (its logits are all the pipeline needs
    then). ``constants``: keyword arguments of the model's forward fixed in the trace."""
    _refuse_state_across_layers(model)
    with_labels = loss and _traces_loss(model, input_names)
    while True:
        inputs = [*input_names, "labels"] if with_labels else list(input_names)
        body = {"forward": _root_forward(inputs), "constants": dict(constants or {})}
        root_cls = type("PippyRoot", (_Root,), body)
        root = root_cls(model, hf.make_mask_leaves(model))
        try:
            graph = _trace(root, model, layer_cls, device_type, inputs)
        except UnsupportedModelError:
            if not with_labels:
                raise
            logger.info("%s: traced without labels", type(model).__name__, exc_info=True)
            with_labels = False
            continue
        graph.owning_module = root
        hf.mark_masks_read_outside(graph)
        return root, graph


def _traces_loss(model: nn.Module, input_names: Sequence[str]) -> bool:
    """Whether to trace ``model`` with labels (see [Note: terms added to the loss])."""
    if "labels" in input_names or not hasattr(model, "loss_function"):
        return False
    params = inspect.signature(model.forward).parameters
    passes = "labels" in params or any(p.kind is p.VAR_KEYWORD for p in params.values())
    # A wrapper (PEFT's PeftModel) passes its keyword arguments to the model that owns the loss.
    return passes and "labels" in inspect.signature(hf.loss_owner(model).forward).parameters


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


class _Builtins:
    """Python's builtins on traced sizes and shapes (``len``, ``int``, ``float``, ``range``'s
    ``__index__``): the value the sample batches agree on, a constant of the model (see [Note:
    branches on metadata]). A size that depends on the batch stays an error."""

    def __len__(self) -> int:
        # Unpacking (``*x.shape[1:]``) asks for the length first.
        length = self.tracer.sample_length(self)
        return length if length is not None else fx.Proxy.__len__(self)

    def __int__(self) -> int:
        return int(self.tracer.agreed_number(self, "int"))

    def __index__(self) -> int:
        return int(self.tracer.agreed_number(self, "an index"))

    def __float__(self) -> float:
        return float(self.tracer.agreed_number(self, "float"))


class _Proxy(_Builtins, fx.Proxy):
    """A proxy whose ``ndim`` is concrete when known (batch inputs are 2-D token tensors), whose
    ``device`` is the batch's (see [Note: one device]), and which Python's builtins on sizes
    accept (:class:`_Builtins`).

    GPT-2 branches on ``attention_mask.ndim < 4``.
    """

    @property
    def ndim(self) -> Any:  # type: ignore[override]
        if "pippy_ndim" in self.node.meta:
            return self.node.meta["pippy_ndim"]
        return _Attribute(self, "ndim")

    def __getattr__(self, k: str) -> Any:
        return _Attribute(self, k)

    def __setitem__(self, key: Any, value: Any) -> None:
        """``x[key] = value`` (Qwen3-VL's features added at the image tokens): one
        :func:`setitem_` node, an in-place op whose later readers of ``x`` read its result (see
        [Note: in-place ops outside the layers])."""
        self.tracer.create_proxy("call_function", setitem_, (self, key, value), {})

    @property
    def device(self) -> Any:
        tracer = self.tracer
        if tracer.first_input is None:
            return _Attribute(self, "device")
        return _Device(tracer.first_input, "device")


def setitem_(x: torch.Tensor, key: Any, value: Any) -> torch.Tensor:
    """``x[key] = value``, returning ``x``: a traced item assignment (``_Proxy.__setitem__``)."""
    x[key] = value
    return x


class _Attribute(_Builtins, fx.proxy.Attribute):
    """An attribute of a traced value (``x.shape``): builtins accept it too (``len(x.shape)``)."""


class _Device(_Attribute):
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
a branch on sizes (``if seq_len > 4``) gives different answers and stays an error. Python's
builtins on sizes and shapes (``len(x.shape)``, ``int(n)``, ``range(n)``, ``float(n)``) are
answered the same way, with a third, long odd sample (``_NUMBER_SHAPES``) so that a number the
two short ones agree on by chance (``seq // 8``) is not taken for a constant: the value the
samples agree on is a constant of the model; one that depends on the batch is an error. Inputs
that are not token tensors (``pixel_values``) have one row shape in every sample, from the config
(``image_size``): a number computed from an image's size is therefore taken as a constant of the
model, and a batch of images of another size is outside what the pipeline supports. A value whose
sample cannot be computed, or a branch on tensor data, is an error naming the model's line.
``torch.finfo`` of a traced dtype becomes a graph value (:class:`_FInfo`), so the dtype stays
symbolic (autocast may change it at run time).
"""


SELF_META_METHODS = ("masked_scatter", "masked_fill", "index_put", "scatter", "index_copy")
"""Tensor methods whose result may have their tensor's shape, dtype and device: for metadata, the
result is then the tensor (a vision-language model scatters image features into the token
embeddings that the mask factories read for their shape). Out of place they may broadcast, so
the tracer marks the calls whose samples keep the tensor's shape (``SELF_META``)."""

SELF_META = "pippy_self_meta"
"""``node.meta`` key: the call's result has its first argument's shape, dtype and device."""

_SAMPLE_SHAPES = ((2, 4), (3, 7))
"""Sample batch shapes ``(batch, sequence)``: a branch is followed only if they all agree."""

_NUMBER_SHAPES = (*_SAMPLE_SHAPES, (5, 1031))
"""Sample batch shapes for a number fixed in the graph (``int(n)``): a long odd sequence as well,
so that a number computed from the batch's sizes that the short samples happen to agree on
(``seq // 8``, ``(seq + 63) // 64``) disagrees, and stays an error."""


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
    def __init__(
        self,
        layer_cls: tuple[type[nn.Module], ...],
        device_type: str,
        input_rows: dict[str, tuple[int, ...]],
    ) -> None:
        super().__init__()
        self.layer_cls = layer_cls
        self.device_type = device_type
        self.input_rows = input_rows
        """The shape of one row of each input that is not a 2-D token tensor (``pixel_values``):
        its samples are float tensors of that shape (see [Note: branches on metadata])."""
        self.first_input: fx.Proxy | None = None
        self._containers: dict[int, tuple[Any, fx.Node]] = {}
        """Each empty container handed to the layers and its one constructor node (see [Note:
        containers handed to the layers])."""
        self._samples: dict[tuple[int, int], dict[fx.Node, Any]] = {}
        self.input_leads: dict[str, tuple[int, ...]] = {}
        """The dims before the batch's of an input that has some (M-RoPE's ``position_ids``:
        ``[kinds, batch, length]``); its samples are token tensors of those dims first."""

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

    def agreed_number(self, obj: fx.Proxy, what: str) -> int | float:
        """``obj``'s value if it is a number that every sample batch agrees on; else a
        ``TypeError`` saying that a size of the batch cannot be fixed in the graph."""
        try:
            value = self._agreed_sample(obj.node, _NUMBER_SHAPES)
        except _NoSample:
            value = None
        if isinstance(value, (int, float)):
            return value
        raise TypeError(
            f"{what} of a traced value that depends on the batch's shape or values cannot be "
            "fixed in the graph; only sizes of the model (the same for every batch) can"
        )

    def mark_self_meta(self, graph: fx.Graph) -> None:
        """Marks the calls of :data:`SELF_META_METHODS` whose result has their tensor's shape and
        dtype (``node.meta[SELF_META]``): in place always; out of place only if every sample
        batch says so (``zeros(3).masked_fill(mask_of_shape_2_3, 1)`` broadcasts to ``(2, 3)``)."""
        for n in graph.nodes:
            if not (
                n.op == "call_method"
                and n.target.rstrip("_") in SELF_META_METHODS
                and n.args
                and isinstance(n.args[0], fx.Node)
            ):
                continue
            n.meta[SELF_META] = n.target.endswith("_") or self._same_meta_as_first(n)

    def _same_meta_as_first(self, node: fx.Node) -> bool:
        for shape in _SAMPLE_SHAPES:
            try:
                first = self._meta_sample(node.args[0], shape)
            except _NoSample:
                return False
            try:
                out = self._sample_for(node, shape)
            except _NoSample:
                out = self._masked_sample(node, shape)
            if not (
                isinstance(out, torch.Tensor)
                and isinstance(first, torch.Tensor)
                and out.shape == first.shape
                and out.dtype == first.dtype
            ):
                return False
        return True

    def _meta_sample(self, arg: Any, shape: tuple[int, int]) -> Any:
        """``arg``'s sample, or, where it has none and keeps its first argument's metadata
        (marked before it: the image features scattered before the video features), that
        argument's. Raises ``_NoSample``."""
        try:
            return self._sample_for(arg, shape)
        except _NoSample:
            if isinstance(arg, fx.Node) and arg.meta.get(SELF_META):
                return self._meta_sample(arg.args[0], shape)
            raise

    def _masked_sample(self, node: fx.Node, shape: tuple[int, int]) -> torch.Tensor | None:
        """The metadata of ``x.masked_scatter(mask, source)`` or ``x.masked_fill(mask, value)``
        from ``x``'s and ``mask``'s samples alone (``x`` broadcast with ``mask``, in ``x``'s
        dtype) where the source has none: image features, whose vision tower reads sizes from
        the batch's values (LLaVA-OneVision's ``image_sizes``)."""
        if node.target.rstrip("_") not in ("masked_scatter", "masked_fill") or len(node.args) < 2:
            return None
        try:
            first, mask = (
                self._meta_sample(node.args[0], shape),
                self._sample_for(node.args[1], shape),
            )
        except _NoSample:
            return None
        if not (isinstance(first, torch.Tensor) and isinstance(mask, torch.Tensor)):
            return None
        meta = torch.broadcast_shapes(first.shape, mask.shape)
        return torch.empty(meta, dtype=first.dtype, device="meta")

    def sample_keys(self, obj: fx.Proxy) -> tuple[Any, ...] | None:
        """The keys of ``obj``'s sample value if it is a dict with the same keys for every
        sample batch (a mask factory's masks by layer type); else ``None``."""
        return self._agreed_about(obj, lambda v: tuple(v) if isinstance(v, dict) else None)

    def sample_length(self, obj: fx.Proxy) -> int | None:
        """The length of ``obj``'s sample value if it is a sequence (a shape)."""
        sized = (tuple, list, torch.Size)
        return self._agreed_about(obj, lambda v: len(v) if isinstance(v, sized) else None)

    def _agreed_about(self, obj: fx.Proxy, read: Callable[[Any], Any]) -> Any:
        """``read`` of ``obj``'s sample value if every sample batch gives the same; else
        ``None``."""
        seen = set()
        for shape in _SAMPLE_SHAPES:
            try:
                seen.add(read(self._sample_for(obj.node, shape)))
            except _NoSample:
                return None
        return seen.pop() if len(seen) == 1 else None

    def _agreed_sample(
        self, node: fx.Node, shapes: Sequence[tuple[int, int]] = _SAMPLE_SHAPES
    ) -> Any:
        """``node``'s value (a Python value, not a tensor) if it is the same for every sample
        batch shape in ``shapes``: a branch on sizes is not followed. Raises
        :class:`_NoSample`."""
        values = [self._sample_for(node, shape) for shape in shapes]
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
        kwargs = {k: self._kwarg_sample(node, k, v, shape) for k, v in node.kwargs.items()}
        try:
            with _fx_patches_reverted():
                value = self._compute_sample(node, args, kwargs, shape)
            if any(isinstance(v, fx.Proxy) for v in torch.utils._pytree.tree_leaves(value)):
                raise _NoSample(node.name)
        except _NoSample:
            raise
        except Exception as e:  # noqa: BLE001  (any op that cannot run on meta tensors)
            raise _NoSample(node.name) from e
        samples[node] = value
        return value

    def _kwarg_sample(self, node: fx.Node, key: str, value: Any, shape: tuple[int, int]) -> Any:
        """A keyword argument's sample; ``None`` for the token embeddings that a position
        method reads for their shape only, when they have none (see [Note: multimodal
        positions])."""
        try:
            return fx.node.map_arg(value, lambda n: self._sample_for(n, shape))
        except _NoSample:
            if node.target is hf.call_positions and key in hf.META_ONLY_MASK_KWARGS:
                return None
            raise

    def _compute_sample(self, node: fx.Node, args: Any, kwargs: Any, shape: tuple[int, int]):
        if node.op == "placeholder":
            lead = self.input_leads.get(node.target)
            if lead is not None:
                return torch.ones((*lead, *shape), dtype=torch.long, device="meta")
            return _placeholder_sample(self.input_rows.get(node.target), shape)
        if node.op == "get_attr":
            value = _fetch_untraced(self.root, node.target)
            if isinstance(value, torch.Tensor):
                value = torch.empty_like(value, device="meta")
            return value
        if node.op == "call_function" and node.target is hf.call_positions:
            return _positions_sample(node.target, args, kwargs)
        if node.op == "call_function" and node.target is hf.call_features:
            return _features_sample(node.target, args, kwargs)
        if node.op == "call_function" and node.target is hf.call_recording:
            with _on_meta(args[0]):  # a layer, as its call_module is sampled below
                return node.target(*args, **kwargs)
        if node.op == "call_function":
            return node.target(*args, **kwargs)
        if node.op == "call_method" and node.target == "to" and _is_meta(args[0]):
            return _meta_to(args[0], args[1:], kwargs)
        if node.op == "call_method":
            return getattr(args[0], node.target)(*args[1:], **kwargs)
        if node.op == "call_module":
            mod = self.root.get_submodule(node.target)
            with _on_meta(mod):
                return (
                    mod.sample(**kwargs) if isinstance(mod, hf.MaskLeaf) else mod(*args, **kwargs)
                )
        raise _NoSample(node.name)

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

    def create_arg(self, a: Any) -> Any:
        # See [Note: containers handed to the layers]
        if isinstance(a, (collections.UserDict, collections.UserList)) and not a.data:
            held = self._containers.get(id(a))
            if held is None:
                held = (a, self.create_node("call_function", type(a), (), {}))
                self._containers[id(a)] = held  # the object is kept: its id stays its own
            return held[1]
        return super().create_arg(a)

    def create_proxy(self, kind: str, target: Any, args: Any, kwargs: Any, *a: Any, **k: Any):
        p = super().create_proxy(kind, target, args, kwargs, *a, **k)
        if kind == "placeholder":
            lead = len(self.input_leads.get(target, ()))
            p.node.meta["pippy_ndim"] = lead + 1 + len(self.input_rows.get(target, (0,)))
            if self.first_input is None:
                self.first_input = p
        return p


"""[Note: containers handed to the layers]

A model may create an empty container in its forward and hand it to every layer (Gemma 4's
``KVSharingDict``, where layers that reuse another layer's keys and values find them). fx
records a dataclass argument as a call of its constructor; an empty ``UserDict`` or
``UserList`` is recorded the same way, once per container object (``_Tracer.create_arg``), so the
layers it is handed to share one node. That node reads no input and no parameter: it is
replicated (see [Note: replicated prologue]), and each stage creates one container that the
layers of that stage share. What a layer puts there therefore reaches the later layers of its own
stage only. Whether a layer reads an entry written on another stage cannot be seen in the trace
(the layers are leaves), so the models known to do it are refused before tracing
(``_refuse_state_across_layers``): Gemma 4 with ``num_kv_shared_layers > 0``, whose last layers
read the keys and values that earlier layers store.
"""


def _refuse_state_across_layers(model: nn.Module) -> None:
    """Refuses a model whose layers read what other layers write into a container they are all
    handed (see [Note: containers handed to the layers])."""
    for cfg in hf.find_configs(model):
        shared = getattr(cfg, "num_kv_shared_layers", 0) or 0
        if shared > 0:
            raise UnsupportedModelError(
                f"{type(model).__name__} shares keys and values between layers "
                f"(num_kv_shared_layers={shared}): its last {shared} layers read the keys and "
                "values that earlier layers write into a container handed to every layer, and a "
                "layer on one stage cannot read what a layer on another stage wrote (each stage "
                "has its own container); use a config with num_kv_shared_layers=0"
            )


@contextlib.contextmanager
def _fx_patches_reverted() -> Any:
    """fx's patches of ``nn.Module.__call__`` and ``__getattr__`` lifted inside the block: a
    sample value (see [Note: branches on metadata]) runs the module's own Python, submodules
    included, instead of recording their calls."""
    patcher = fx._symbolic_trace.CURRENT_PATCHER
    if patcher is None:
        yield
        return
    patcher.revert_all_patches()
    try:
        yield
    finally:
        patcher.reapply_all_patches()


@contextlib.contextmanager
def _on_meta(mod: nn.Module) -> Any:
    """``mod`` with ``meta`` stand-ins of its parameters and buffers inside the block, its ops'
    meta kernels as lenient as the CPU's (:class:`_CpuMetaRules`), and ``nonzero`` on ``meta``
    taking every element for nonzero (torch's ``meta_nonzero_assume_all_nonzero``): a module is
    sampled for the metadata of its output, which a data-dependent count inside it (an MoE's hit
    experts, a sparse attention's selected tokens: Inkling-2's, Qwen4-Exp's) does not change."""
    tensors = {**dict(mod.named_parameters()), **dict(mod.named_buffers())}
    meta = {k: torch.empty_like(t, device="meta") for k, t in tensors.items()}
    assume = torch.fx.experimental._config.patch(meta_nonzero_assume_all_nonzero=True)
    with torch.nn.utils.stateless._reparametrize_module(mod, meta), _CpuMetaRules(), assume:
        yield


class _CpuMetaRules(torch.utils._python_dispatch.TorchDispatchMode):
    """Ops whose ``meta`` kernel checks a rule of another device's kernel, run on ``meta`` with the
    CPU kernel's rule: torch's ``_grouped_mm`` meta kernel takes bf16 inputs only (CUDA's rule),
    where the CPU kernel takes fp32 too (HF's MoE experts call it in fp32 on the CPU, so a sample
    of such a decoder layer on ``meta`` failed where the layer runs). Its output's metadata comes
    from bf16 stand-ins of the inputs, in the dtype the CPU kernel gives (``out_dtype``, else the
    inputs')."""

    _BF16_ONLY = (torch.ops.aten._grouped_mm.default,)

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None):
        kwargs = kwargs or {}
        first = args[0] if args else None
        if func in self._BF16_ONLY and _is_meta(first) and first.dtype != torch.bfloat16:
            named = dict(zip((a.name for a in func._schema.arguments), args, strict=False))
            named |= kwargs
            dtype = named.pop("out_dtype", None) or first.dtype
            named = torch.utils._pytree.tree_map_only(
                torch.Tensor, lambda t: t.to(torch.bfloat16) if t.is_floating_point() else t, named
            )
            return func(**named).to(dtype)
        return func(*args, **kwargs)


"""[Note: features of several layers]

Qwen3-VL's ``get_image_features`` returns, besides the pooled features, a list of the features
of some vision layers (DeepStack), each a tuple per image; the model's Python iterates over that
list (``[torch.cat(feat) for feat in deepstack_features]``) and its text model adds entry ``i``
to the hidden states after layer ``i`` at the image tokens (``h[mask, :] = h[mask, :] + f``).
Iterating a traced value needs its length from the value's samples (:meth:`_Tracer.iter`), and
the feature method's sample, its encoders on ``meta``, fails for images concatenated over the
batch: the tower reads their grid sizes as numbers (``.tolist()``). So that sample runs once more
on one image of the smallest grid (:func:`hf.smallest_images`): the grid a CPU tensor, the
pixels on ``meta``, and every op with a ``meta`` input on ``meta`` (:class:`_MetaWins`), which
gives the list's length (a size of the model, the same for every batch). ``x[key] = value`` on a
traced value is one in-place op, :func:`setitem_`, threaded like the others ([Note: in-place ops
outside the layers]). The features of each layer are then values of the graph like any other:
made on the first stage, sent to the stage that holds the layer adding them.
"""


def _features_sample(fn: Any, args: Any, kwargs: Any) -> Any:
    """A feature method's value for a sample batch, its encoders on ``meta``; where that fails on
    images concatenated over the batch (whose grid sizes the encoder reads as numbers), once more
    on one image of the smallest grid, the grid on the CPU (see [Note: features of several
    layers])."""
    with contextlib.ExitStack() as on_meta:
        for mod in args[2]:  # the encoders it runs
            on_meta.enter_context(_on_meta(mod))
        try:
            return fn(*args, **kwargs)
        except Exception:
            ref, method = args[:2]
            bound = inspect.signature(getattr(type(ref.module), method)).bind_partial(
                ref.module, *args[3:], **kwargs
            )
            images = hf.smallest_images(ref.module, bound.arguments)
            if not images:
                raise
            bound.arguments.update(images)
            with _MetaWins():
                return fn(*args[:3], *bound.args[1:], **bound.kwargs)


class _MetaWins(torch.utils._python_dispatch.TorchDispatchMode):
    """An op with a ``meta`` tensor among its inputs runs on ``meta`` (its CPU tensors moved
    there); one without runs as it is: numbers read from CPU tensors stay readable."""

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None):
        kwargs = kwargs or {}
        leaves = torch.utils._pytree.tree_leaves((args, kwargs))
        if any(_is_meta(t) for t in leaves):
            args, kwargs = torch.utils._pytree.tree_map_only(
                torch.Tensor, lambda t: t.to("meta"), (args, kwargs)
            )
        return func(*args, **kwargs)


def _positions_sample(fn: Any, args: Any, kwargs: Any) -> Any:
    """A position method's value for a sample batch: run on zeros of the samples' shapes on the
    CPU (text tokens only; a mask of ones), on ``meta`` again after (see [Note: multimodal
    positions])."""

    def real(name: str | None, value: Any) -> Any:
        if not _is_meta(value):
            return value
        fill = torch.ones if name is not None and "attention_mask" in name else torch.zeros
        return fill(value.shape, dtype=value.dtype)

    args = tuple(real(None, a) for a in args)
    kwargs = {k: real(k, v) for k, v in kwargs.items()}
    out = fn(*args, **kwargs)
    return torch.utils._pytree.tree_map(
        lambda t: t.to("meta") if isinstance(t, torch.Tensor) else t, out
    )


def _is_meta(value: Any) -> bool:
    return isinstance(value, torch.Tensor) and value.is_meta


def _meta_to(sample: torch.Tensor, args: tuple, kwargs: dict) -> torch.Tensor:
    """``sample.to(*args, **kwargs)`` kept on the meta device: its dtype follows, a device does
    not (Idefics3 moves the token embeddings to the image features' device: a copy out of a meta
    tensor)."""
    dtype = kwargs.get("dtype")
    for a in (*args, kwargs.get("other")):
        if isinstance(a, torch.dtype):
            dtype = a
        elif isinstance(a, torch.Tensor):
            dtype = a.dtype
    return sample if dtype is None else sample.to(dtype)


def _placeholder_sample(row: tuple[int, ...] | None, shape: tuple[int, int]) -> torch.Tensor:
    if row is None:  # token ids (or a mask) of the sample shape
        return torch.ones(shape, dtype=torch.long, device="meta")
    return torch.ones((shape[0], *row), device="meta")


def _method_leaf(
    tracer: fx.Tracer, owner: nn.Module, ref: str, method: str, used: list[str] | None
) -> Any:
    """A feature method's stand-in while tracing: one :func:`hf.call_features` node, whose
    ``used`` modules and parameters the stage holds (see [Note: encoders of other modalities]);
    with ``used`` ``None``, a position method's: one :func:`hf.call_positions` node (see [Note:
    multimodal positions]). Called on values that are not traced (a sample's run of another
    feature method that calls this one: Qwen3-VL's video features are its image features), the
    method itself."""

    def leaf(*args: Any, **kwargs: Any) -> Any:
        leaves = torch.utils._pytree.tree_leaves((args, kwargs))
        if not any(isinstance(v, fx.Proxy) for v in leaves):
            return getattr(type(owner), method)(owner, *args, **kwargs)
        head: tuple[Any, ...] = (tracer.create_proxy("get_attr", ref, (), {}), method)
        if used is None:
            return tracer.create_proxy("call_function", hf.call_positions, (*head, *args), kwargs)
        mods = tuple(tracer.create_proxy("get_attr", path, (), {}) for path in used)
        return tracer.create_proxy("call_function", hf.call_features, (*head, mods, *args), kwargs)

    return leaf


@contextlib.contextmanager
def _feature_leaves(root: _Root, tracer: fx.Tracer, layer_cls: tuple[type[nn.Module], ...]):
    """The model's feature methods are leaves inside the block (see [Note: encoders of other
    modalities])."""
    model = root.model
    layers = [m for m in model.modules() if isinstance(m, layer_cls)]
    patched: list[tuple[nn.Module, str]] = []
    try:
        for i, (name, owner) in enumerate(hf.feature_owners(model, layers) if layers else []):
            ref = f"{hf.REF_ATTR}{i}"
            setattr(root, ref, hf.ModuleRef(owner))
            prefix = ROOT_PREFIX + (f"{name}." if name else "")
            used = [prefix + c for c in hf.encoder_children(owner, layers)]
            used += [prefix + n for n, _ in owner.named_parameters(recurse=False)]
            leaves = [(m, used) for m in hf.FEATURE_METHODS]
            for method, reads in [*leaves, *((m, None) for m in hf.POSITION_METHODS)]:
                if callable(getattr(type(owner), method, None)):
                    vars(owner)[method] = _method_leaf(tracer, owner, ref, method, reads)
                    patched.append((owner, method))
        yield
    finally:
        for owner, method in patched:
            del vars(owner)[method]


def _trace(
    root: _Root,
    model: nn.Module,
    layer_cls: tuple[type[nn.Module], ...],
    device_type: str,
    input_names: Sequence[str],
) -> fx.Graph:
    modes = [(m, m.training) for m in model.modules()]
    model.eval()
    tracer = _Tracer(layer_cls, device_type, hf.input_rows(model, input_names))
    kinds = hf.position_kinds(model) if "position_ids" in input_names else None
    if kinds is not None:  # M-RoPE's [kinds, batch, length] (generation graphs)
        tracer.input_leads["position_ids"] = (kinds,)
    try:
        with (
            hf.patch_mask_functions(model, getattr(root, hf.MASKS_ATTR)),
            _traced_finfo(),
            _traced_tensor_type(tracer),
            _traced_model_device(tracer),
            hf.recorded_traced_checks(),
            _feature_leaves(root, tracer, layer_cls),
        ):
            graph = tracer.trace(root)
            tracer.mark_self_meta(graph)
            _join_features(graph)
            _thread_mutations(graph)
            return _canonical(graph)
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


def _join_features(graph: fx.Graph) -> None:
    """``torch.cat(features, dim)`` of a feature method's pooled output becomes
    :func:`hf.cat_features` (see [Note: encoders of other modalities])."""
    for n in graph.nodes:
        if n.op == "call_function" and n.target is torch.cat and _of_features(n.args[0]):
            dim = n.args[1] if len(n.args) > 1 else n.kwargs.get("dim", 0)
            n.target, n.args, n.kwargs = hf.cat_features, (n.args[0], dim), {}


def _of_features(value: Any) -> bool:
    """Whether ``value`` is a node read from a feature method's output (an attribute or item
    of it, a few steps away)."""
    for _ in range(3):
        if not isinstance(value, fx.Node):
            return False
        if value.op == "call_function" and value.target is hf.call_features:
            return True
        if value.op != "call_function" or value.target not in (getattr, operator.getitem):
            return False
        value = value.args[0]
    return False


@contextlib.contextmanager
def _traced_model_device(tracer: _Tracer) -> Any:
    """An HF model's ``self.device`` is the batch's device inside the block, as a traced
    tensor's is: read while tracing, the model's own device would be fixed in the graph (on a
    model built on ``meta``, Idefics3's ``embeddings.to(self.device)`` moved them to ``meta``
    at every step)."""
    from transformers.modeling_utils import PreTrainedModel

    owner = next((c for c in PreTrainedModel.__mro__ if "device" in vars(c)), None)
    if owner is None:
        yield
        return
    real = vars(owner)["device"]

    def device(self: nn.Module) -> Any:
        if tracer.first_input is None:
            return real.__get__(self, type(self))
        return _Device(tracer.first_input, "device")

    owner.device = property(device)
    try:
        yield
    finally:
        owner.device = real


@contextlib.contextmanager
def _traced_tensor_type(tracer: fx.Tracer) -> Any:
    """``tensor.type(dtype)`` of a tensor that is not traced (a buffer: fx does not proxy them)
    to a traced dtype is recorded as ``tensor.to(dtype)`` inside the block (RecurrentGemma's
    ``self.normalizer.type(hidden_states.dtype)``)."""
    real = torch.Tensor.type
    # torch's caches of the tensor's methods are filled before the patch: filled during it, they
    # kept the patched method for good (seen as activation checkpointing that saved more after a
    # trace: the planner's measured peaks grew by 25%).
    overrides = torch.overrides
    overrides.get_overridable_functions()
    overrides.get_ignored_functions()
    overrides.get_testing_overrides()
    overrides.is_tensor_method_or_property(real)

    def traced(self: torch.Tensor, dtype: Any = None, *args: Any, **kwargs: Any) -> Any:
        if isinstance(dtype, fx.Proxy):
            return tracer.create_proxy("call_method", "to", (self, dtype), {})
        return real(self) if dtype is None else real(self, dtype, *args, **kwargs)

    torch.Tensor.type = traced  # type: ignore[method-assign]
    try:
        yield
    finally:
        del torch.Tensor.type  # the method is TensorBase's: torch.Tensor defines none of its own


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
compute the same values give the same code, byte for byte, on every rank. The model's checks on
traced values, which nothing uses, are walked first, in trace order (see [Note: checks on traced
values]), so each comes before the values computed after it.
"""


def _canonical(graph: fx.Graph) -> fx.Graph:
    """``graph`` in data-flow order with fresh names. See [Note: canonical graphs]."""
    order: dict[fx.Node, None] = {n: None for n in graph.nodes if n.op == "placeholder"}
    output = next(n for n in reversed(graph.nodes) if n.op == "output")
    checks = [n for n in graph.nodes if hf.is_traced_check(n)]
    stack: list[tuple[fx.Node, bool]] = [(output, False), *((n, False) for n in reversed(checks))]
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


"""[Note: in-place ops outside the layers]

An in-place op traced outside the decoder layers (``h.masked_fill_(pad, 0)``, ``h.mul_(2)``, its
result unused) changes a value that later nodes read, but nothing in the graph's data flow says
so: the graph rebuilt from the output (see [Note: canonical graphs]) would leave it out, and the
stages would compute something else than the model, silently. So the mutation is made data
flow: every later node reading the mutated value reads the in-place op's result instead (an
in-place tensor method returns its tensor), which places the op on a stage before its readers
like any other node. A mutation through a view (``h.view(-1)[:3].zero_()``) would change values
that the graph reads through another node, the view's base: such a model is refused. An op is
in place when its name ends in ``_`` (``mul_``), except Python's ``operator`` functions, whose
in-place ones are ``iand``, ``iadd``, ... and whose ``and_``, ``or_`` and ``not_`` are out of place.
"""

_VIEW_METHODS = frozenset(
    "view view_as reshape flatten unflatten squeeze unsqueeze expand expand_as transpose t "
    "permute narrow select unbind split chunk diagonal movedim swapaxes as_strided detach "
    "__getitem__".split()
)
"""Tensor methods (and ``operator.getitem``) whose result may share its input's memory."""


def _mutated(n: fx.Node) -> fx.Node | None:
    """The value ``n`` changes in place (its first argument), or ``None``."""
    if n.op == "call_method":
        name = str(n.target)
    elif n.op == "call_function":
        name = getattr(n.target, "__name__", "")
        if n.kwargs.get("inplace") is True and n.args and isinstance(n.args[0], fx.Node):
            return n.args[0]
        if getattr(n.target, "__module__", None) in ("_operator", "operator"):
            # Python's operators: `a &= b` is `iand`; `and_`, `or_`, `not_` are `a & b`, `a | b`,
            # `not a`, out of place despite their names (taking `a & b` for a change of `a`
            # silently gave Gemma 3's image blocks one token each).
            in_place = name in _OPERATOR_IN_PLACE
            return n.args[0] if in_place and n.args and isinstance(n.args[0], fx.Node) else None
    else:
        return None
    in_place = name.endswith("_") and not name.startswith("_") and name != "requires_grad_"
    return n.args[0] if in_place and n.args and isinstance(n.args[0], fx.Node) else None


_OPERATOR_IN_PLACE = frozenset(
    f"i{op}"
    for op in (
        *("add", "sub", "mul", "matmul", "truediv", "floordiv", "mod", "pow"),
        *("and", "or", "xor", "lshift", "rshift", "concat"),
    )
)
"""The ``operator`` module's in-place functions (``a += b`` traces to ``operator.iadd``)."""


def _op_name(n: fx.Node) -> str:
    return str(n.target) if n.op == "call_method" else getattr(n.target, "__name__", n.name)


def _is_view(n: fx.Node) -> bool:
    if n.op == "call_method":
        return n.target in _VIEW_METHODS
    return n.op == "call_function" and (
        n.target is operator.getitem or getattr(n.target, "__name__", "") in _VIEW_METHODS
    )


def _thread_mutations(graph: fx.Graph) -> None:
    """Makes in-place ops data flow, or refuses them. See [Note: in-place ops outside the
    layers]."""
    order = {n: i for i, n in enumerate(graph.nodes)}
    for n in list(graph.nodes):
        target = _mutated(n)
        if target is None:
            continue
        if _is_view(target) and isinstance(target.args[0], fx.Node):
            raise UnsupportedModelError(
                f"the model changes a view in place outside its decoder layers "
                f"(`{_op_name(target)}` then `{_op_name(n)}`): the traced graph cannot "
                f"follow a mutation through a view to its base. Write it out of place "
                f"(`h = h.masked_fill(...)`) or inside a decoder layer. {SUPPORTED}"
            )
        for user in list(target.users):
            if user is not n and order[user] > order[n]:
                user.replace_input_with(target, n)


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
    skip = (os.path.dirname(torch.__file__) + os.sep, package + os.sep, "<string>")
    frames = [f for f in traceback.extract_tb(e.__traceback__) if not f.filename.startswith(skip)]
    if not frames:
        return ""
    f = frames[-1]
    return f" (at {f.filename}:{f.lineno} in {f.name}: `{(f.line or '').strip()}`)"


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


def separate_added_loss(graph: fx.Graph, output: fx.Node, model_name: str) -> bool:
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
