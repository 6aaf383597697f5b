"""HuggingFace transformers specifics for the partitioner, free of any model family.

transformers 5.x has no fx tracer. The partitioner traces an HF model as a child of its own root
module and relies on three facts kept here:

- rotary-embedding modules are fx leaves (:func:`is_rotary_module`);
- the module-level mask factories (``masking_utils.create_causal_mask`` and friends, imported into
  each ``modeling_*`` module) are routed through leaf modules (:class:`MaskLeaf`) while tracing,
  because they take a config object fx cannot record (:func:`patch_mask_functions`);
- some inputs of those leaves are only read for their shape, dtype and device: the mask
  factories' :data:`META_ONLY_MASK_KWARGS`, and a rotary module's first argument (the
  partitioner's ``_producers`` reads both);
- outputs that HF records inside a layer with forward hooks (``output_router_logits``) become
  outputs of the layer's call (:func:`call_recording`), and the model's ``loss_function`` is a
  leaf while tracing (:class:`LossMarker`), so that what the model adds to it (MoE router
  losses) is found in the graph.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import inspect
import re
import sys
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch import nn

from pippy_xla.hf_compat import checkpoint_conversion, mask_factory_globals

__all__ = [
    "FEATURE_METHODS",
    "POSITION_METHODS",
    "LOSS_ATTR",
    "MASKS_ATTR",
    "META_ONLY_MASK_KWARGS",
    "REF_ATTR",
    "call_features",
    "smallest_images",
    "call_positions",
    "ragged_inputs",
    "cat_features",
    "batch_term",
    "batch_terms_handled",
    "call_recording",
    "deliver",
    "encoder_children",
    "feature_owners",
    "find_configs",
    "input_rows",
    "position_kinds",
    "is_mask_function_name",
    "is_traced_check",
    "is_rotary_module",
    "LossMarker",
    "make_mask_leaves",
    "mark_masks_read_outside",
    "MaskLeaf",
    "ModuleRef",
    "patch_loss_function",
    "patch_mask_functions",
    "recorded_outputs",
    "recorded_traced_checks",
    "text_vocab_size",
    "traced_check",
]

MASKS_ATTR = "pippy_masks"
"""Attribute of the partitioner's root module holding the :class:`MaskLeaf` modules."""

REF_ATTR = "pippy_ref_"
"""Prefix of the root's :class:`ModuleRef` attributes (see [Note: encoders of other
modalities])."""

LOSS_ATTR = "pippy_loss"
"""Attribute of the partitioner's root module holding the :class:`LossMarker`."""

META_ONLY_MASK_KWARGS = ("inputs_embeds", "encoder_hidden_states")
"""Keyword arguments of the mask factories that are read only for shape, dtype and device
(``masking_utils`` documents ``inputs_embeds`` as "used only to infer the batch size, query length
and dtype")."""


def is_rotary_module(module: nn.Module) -> bool:
    """Whether ``module`` is a rotary-embedding module (made an fx leaf).

    Generic rule: a direct buffer named ``inv_freq`` or a class name ending in ``RotaryEmbedding``.
    Rotary modules have data-dependent branches (dynamic / long RoPE) and an autocast context that
    fx cannot capture; they read their first argument only for its dtype and device.
    """
    return "inv_freq" in module._buffers or type(module).__name__.endswith("RotaryEmbedding")


def is_mask_function_name(name: str) -> bool:
    """Whether a module global named ``name`` is a mask factory (``create_*mask*``)."""
    return name.startswith("create_") and "mask" in name


def _is_config(obj: Any) -> bool:
    try:
        from transformers import PretrainedConfig
    except ImportError:  # pragma: no cover - transformers is optional for non-HF models
        return False
    return isinstance(obj, PretrainedConfig)


_ABSENT = object()
"""A name that a module's globals did not hold."""


class MaskLeaf(nn.Module):
    """fx leaf calling one mask factory with a fixed config.

    Only tensors, ``None`` and plain constants reach the graph; the config stays on the module.
    At run time the leaf returns whatever the factory returns for the attention implementation in
    the config: a boolean / additive float mask, or ``None`` when sdpa can use ``is_causal``
    (no padding).
    """

    def __init__(self, fn: Callable[..., Any], config: Any) -> None:
        super().__init__()
        self.fn = fn
        self.config = config
        self.read_outside = False
        """Whether the model's code outside the layers reads the mask (see [Note: masks read
        outside the layers]): a ``None`` at run time is then the mask built as under a
        compiler."""

    def forward(self, **kwargs: Any) -> Any:
        out = self.fn(config=self.config, **kwargs)
        if out is None and self.read_outside:  # See [Note: masks read outside the layers]
            return self._compiled(**kwargs)
        return out

    def sample(self, **kwargs: Any) -> Any:
        """The mask of a sample batch on the ``meta`` device: the factory's, or where it reads
        the values of its inputs (shortcuts for an all-ones mask, packed-sequence detection),
        the one it builds under a compiler (``is_tracing``), which reads none."""
        try:
            return self.forward(**kwargs)
        except RuntimeError:
            return self._compiled(**kwargs)

    def _compiled(self, **kwargs: Any) -> Any:
        """The factory's mask as it builds it under a compiler (``is_tracing``): without the
        shortcuts that read its inputs' values (``None`` for an all-ones mask)."""
        names = mask_factory_globals(self.fn)
        saved = names.get("is_tracing", _ABSENT)
        names["is_tracing"] = lambda *args, **kw: True
        try:
            return self.fn(config=self.config, **kwargs)
        finally:
            if saved is _ABSENT:
                del names["is_tracing"]
            else:
                names["is_tracing"] = saved

    def extra_repr(self) -> str:
        return f"fn={self.fn.__module__}.{self.fn.__qualname__}"


def _modeling_modules(model: nn.Module) -> list[Any]:
    """Python modules defining the classes of ``model``'s submodules, in ``named_modules`` order."""
    names: list[str] = []
    for _, mod in model.named_modules():
        name = type(mod).__module__
        if name not in names:
            names.append(name)
    return [sys.modules[n] for n in names if n in sys.modules]


def _mask_functions(model: nn.Module) -> list[tuple[Any, str, Callable[..., Any]]]:
    """``(python_module, global_name, function)`` for every mask factory global, sorted by name."""
    found = []
    for pymod in _modeling_modules(model):
        for name in sorted(vars(pymod)):
            obj = vars(pymod)[name]
            if is_mask_function_name(name) and inspect.isfunction(obj):
                found.append((pymod, name, obj))
    return found


def find_configs(model: nn.Module) -> list[Any]:
    """Distinct HF config objects held by ``model``'s submodules, in ``named_modules`` order."""
    configs: list[Any] = []
    for _, mod in model.named_modules():
        cfg = getattr(mod, "config", None)
        if _is_config(cfg) and not any(cfg is c for c in configs):
            configs.append(cfg)
    return configs


"""[Note: masks read outside the layers]

A mask factory returns ``None`` where the batch needs no mask (no padding: sdpa's ``is_causal``,
a recurrent layer's unmasked states), which every layer takes. The trace samples the factory on
``meta``, where it cannot read the values and builds the mask (a tensor): code of the model
outside the layers that reads it (Qwen4-Exp's ``torch.where(conv_mask.bool(), ...)`` over its
n-gram ids) is then traced for a tensor, and a microbatch without padding gave it ``None``. A
leaf whose output reaches anything but a layer (a call of a leaf module, a layer recording its
outputs, an item of a dict of masks that goes only there) is marked after the trace
(:func:`mark_masks_read_outside`) and returns, instead of ``None``, the mask the factory builds
under a compiler: the same values (the padding mask itself, all ones), where only those models
pay for it.
"""


def mark_masks_read_outside(graph: Any) -> None:
    """Marks the :class:`MaskLeaf` modules of ``graph`` (its owning module's) whose output the
    model's code outside the layers reads (see [Note: masks read outside the layers])."""
    import operator

    root = graph.owning_module

    def inside(user: Any) -> bool:
        if user.op == "call_module" or user.target in (call_recording, call_positions):
            return True
        if user.op == "call_function" and user.target is operator.getitem:
            return all(inside(u) for u in user.users)
        return False

    for node in graph.nodes:
        if node.op != "call_module":
            continue
        leaf = root.get_submodule(node.target)
        if isinstance(leaf, MaskLeaf) and not all(inside(u) for u in node.users):
            leaf.read_outside = True


def make_mask_leaves(model: nn.Module) -> nn.ModuleDict:
    """One :class:`MaskLeaf` per (mask factory, config); register it on the root before tracing.

    Keys are the factory's name, suffixed with ``_<config index>`` when the model holds several
    configs, so that leaf names (and the generated code) are deterministic.
    """
    configs = find_configs(model)
    leaves = nn.ModuleDict()
    for _, name, fn in _mask_functions(model):
        for i, cfg in enumerate(configs):
            key = name if len(configs) == 1 else f"{name}_{i}"
            if key not in leaves:
                leaves[key] = MaskLeaf(fn, cfg)
    return leaves


def _leaf_for(leaves: nn.ModuleDict, name: str, fn: Callable[..., Any], config: Any) -> MaskLeaf:
    for leaf in leaves.values():
        if leaf.fn is fn and leaf.config is config:
            return leaf
    raise ValueError(
        f"{name} was called with a config object that no submodule of the model holds; the "
        "partitioner only supports mask factories called with a submodule's config"
    )


def _flat_arguments(sig: inspect.Signature, args: Any, kwargs: Any) -> dict[str, Any]:
    """The arguments of a call by name, those a ``**kwargs`` parameter collects among them
    (``create_recurrent_attention_mask(config, inputs_embeds, attention_mask, **kwargs)`` gets
    ``position_ids`` that way): each is an argument of the leaf's call like any other."""
    arguments: dict[str, Any] = {}
    for key, value in sig.bind(*args, **kwargs).arguments.items():
        if sig.parameters[key].kind is inspect.Parameter.VAR_KEYWORD:
            arguments.update(value)
        else:
            arguments[key] = value
    return arguments


def _make_shim(name: str, fn: Callable[..., Any], leaves: nn.ModuleDict) -> Callable[..., Any]:
    sig = inspect.signature(fn)

    def shim(*args: Any, **kwargs: Any) -> Any:
        arguments = _flat_arguments(sig, args, kwargs)
        if not any(isinstance(v, torch.fx.Proxy) for v in arguments.values()):
            # A call on real values: a factory's own call of another (Gemma 3's
            # create_masks_for_vision_model calls create_causal_mask) while the tracer samples it.
            return fn(*args, **kwargs)
        config = arguments.pop("config", None)
        leaf = _leaf_for(leaves, name, fn, config)
        call: dict[str, Any] = {}
        for key, value in arguments.items():
            if value is None or isinstance(value, (torch.fx.Proxy, bool, int, float, str)):
                call[key] = value
            else:
                raise ValueError(
                    f"{name}() got {key}={type(value).__name__} while tracing; only tensors, "
                    "None and plain constants can reach the graph (use_cache must be False and "
                    "custom mask functions are not supported)"
                )
        out = leaf(**call)
        # A factory of several masks returns a dict (one per layer type, Gemma 3's
        # create_masks_for_vision_model): the model's code tests isinstance(mask, dict), so it
        # gets a dict of the leaf's entries.
        keys = getattr(getattr(out, "tracer", None), "sample_keys", lambda _: None)(out)
        return out if keys is None else {k: out[k] for k in keys}

    shim.__wrapped__ = fn  # type: ignore[attr-defined]
    return shim


@contextlib.contextmanager
def patch_mask_functions(model: nn.Module, leaves: nn.ModuleDict) -> Iterator[None]:
    """Route every ``create_*mask*`` global of the model's modeling modules through ``leaves``.

    The globals are restored on exit, also on error.
    """
    saved = _mask_functions(model)
    try:
        for pymod, name, fn in saved:
            setattr(pymod, name, _make_shim(name, fn, leaves))
        yield
    finally:
        for pymod, name, fn in saved:
            setattr(pymod, name, fn)


"""[Note: outputs recorded inside layers]

transformers 5.x collects some outputs with forward hooks that ``capture_outputs`` installs on
submodules and activates through a context variable: MoE routers' logits
(``output_router_logits=True``) are recorded this way, from inside the decoder layers, which the
partitioner traces as leaves. So while tracing, a layer holding an active recording hook is called
through :func:`call_recording`, which runs the layer under its own collector and returns what the
hooks recorded as extra outputs; :func:`deliver` hands those to the model's collector, so that
the model's code after the layers (the load-balancing loss) reads them as graph values. They cross
stage boundaries like any other value, and their gradients flow back to every stage's router.
"""


def _collector() -> Any:
    from transformers.utils import output_capturing

    return output_capturing._active_collector


def recorded_outputs(layer: nn.Module) -> tuple[str, ...]:
    """The keys recorded by the active output-capturing hooks inside ``layer``, one per hook,
    in module order; empty when nothing is being recorded. See [Note: outputs recorded inside
    layers]."""
    try:
        collected = _collector().get()
    except ImportError:  # pragma: no cover - transformers is optional for non-HF models
        return ()
    if not collected:
        return ()
    keys = []
    for mod in layer.modules():
        for hook in mod._forward_hooks.values():
            if getattr(hook, "__name__", "") != "output_capturing_hook":
                continue
            key = inspect.getclosurevars(hook).nonlocals.get("key")
            if key in collected and key != "hidden_states":
                keys.append(key)
    return tuple(keys)


def call_recording(layer: nn.Module, keys: tuple[str, ...], *args: Any, **kwargs: Any) -> Any:
    """``(layer(*args, **kwargs), *recorded)``: the layer's output and what its hooks recorded
    for ``keys`` (see :func:`recorded_outputs`), in order."""
    collector = _collector()
    collected: dict[str, list[Any]] = {k: [] for k in keys}
    token = collector.set(collected)
    try:
        out = layer(*args, **kwargs)
    finally:
        collector.reset(token)
    recorded = [v for k in collected for v in collected[k]]
    if len(recorded) != len(keys):
        raise RuntimeError(
            f"{type(layer).__name__} recorded {len(recorded)} outputs {list(collected)} but "
            f"{len(keys)} were traced ({list(keys)}): a layer must call each recording "
            "submodule once per forward"
        )
    return (out, *recorded)


def deliver(keys: tuple[str, ...], values: Sequence[Any]) -> None:
    """Appends the traced ``values`` of ``keys`` to the model's active collector."""
    collected = _collector().get()
    for key, value in zip(keys, values, strict=True):
        collected[key].append(value)


"""[Note: terms added to the loss]

An HF model computes its loss as ``self.loss_function(logits, labels, ...)`` and may add terms to
it (``loss += router_aux_loss_coef * aux_loss``). The partitioner traces the model with a
``labels`` input and the loss function replaced by a leaf, :class:`LossMarker`; the graph's loss
is then the marker plus the added terms, which the last stage returns beside the logits (the
pipeline computes the marker's part, the loss function's, with ``loss_fn`` per microbatch). A
model whose Python cannot be traced with labels is traced without them (no added terms); one whose
loss is not the marker plus terms is refused (``trace.separate_added_loss``).
"""


"""[Note: added terms over the whole batch]

A term the model adds to its loss is a function of the microbatch it sees: HF's load-balancing
loss multiplies the routers' assignment counts by their probabilities, each summed over every
token and layer, so the mean of the microbatches' terms is not the term of the whole batch that
one process (HF's ``Trainer``) computes. The partitioner marks every value that enters the added
terms' computation from outside it (a batch input such as the attention mask, or an output a layer
records such as its router logits; their dim 0 runs over the microbatch's rows or tokens) with a
call of :func:`batch_term`, the identity unless a step installs a handler
(:func:`batch_terms_handled`). The step then runs the batch's forward once without gradients with
a handler that keeps each marked value per microbatch (every replica's, gathered), and trains with
one that puts a microbatch's live value among the others, concatenated along dim 0 in the global
batch's order: each microbatch's terms are then the whole batch's, with gradients through its own
rows only, so their gradients add up to the whole batch's (the step weighs their values so that
they add up to it once; ``_step.py``). Terms that read a value of parameters alone cannot be
computed so (each microbatch would add that value's whole gradient): ``StageGraph.added_over_batch``
is ``False`` for them.
"""


_batch_terms: Callable[[torch.Tensor, str], torch.Tensor] | None = None


def batch_term(value: torch.Tensor, key: str) -> torch.Tensor:
    """``value``, an input of the added loss terms marked ``key``; what the step's handler makes
    of it while one is installed. See [Note: added terms over the whole batch]."""
    handler = _batch_terms
    return value if handler is None else handler(value, key)


@contextlib.contextmanager
def batch_terms_handled(handler: Callable[[torch.Tensor, str], torch.Tensor]) -> Iterator[None]:
    """Every :func:`batch_term` call inside the block is ``handler(value, key)``."""
    global _batch_terms
    saved, _batch_terms = _batch_terms, handler
    try:
        yield
    finally:
        _batch_terms = saved


class LossMarker(nn.Module):
    """fx leaf standing for the model's ``loss_function`` while tracing; never run."""

    def forward(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        raise RuntimeError("LossMarker only marks the loss function in a trace")


def loss_owner(model: nn.Module) -> nn.Module:
    """The module whose ``loss_function`` the model's forward calls: ``model``, or the first
    module inside it whose class defines HF's ``loss_function`` property (the HF model inside a
    wrapper, such as PEFT's ``PeftModel``, which only forwards the attribute)."""
    if isinstance(getattr(type(model), "loss_function", None), property):
        return model
    return next(
        (
            m
            for m in model.modules()
            if isinstance(getattr(type(m), "loss_function", None), property)
        ),
        model,
    )


@contextlib.contextmanager
def patch_loss_function(model: nn.Module, marker: LossMarker) -> Iterator[None]:
    """``model.loss_function`` (that of :func:`loss_owner`) calls ``marker`` inside the block
    (HF's property setter)."""
    model = loss_owner(model)
    had = "_loss_function" in vars(model)
    saved = vars(model).get("_loss_function")
    # A plain function: assigning the module itself would register it under the model.
    vars(model)["_loss_function"] = lambda *args, **kwargs: marker(*args, **kwargs)
    try:
        yield
    finally:
        if had:
            vars(model)["_loss_function"] = saved
        else:
            del vars(model)["_loss_function"]


def position_kinds(model: nn.Module) -> int | None:
    """How many kinds of positions HF's ``generate`` gives the model per token: M-RoPE's
    ``position_ids`` are ``[kinds, batch, length]`` (Qwen2-VL's: a text row and three of the
    image grid), as ``_prepare_position_ids_for_generation`` makes them; ``None`` for
    ``[batch, length]``."""
    prepare = getattr(model, "_prepare_position_ids_for_generation", None)
    if prepare is None:
        return None
    ids = torch.ones(1, 2, dtype=torch.long)
    owners = [m for m in model.modules() if "rope_deltas" in vars(m)]
    kept = [vars(m)["rope_deltas"] for m in owners]  # the state it sets, put back
    try:
        positions = prepare(ids, {"attention_mask": torch.ones_like(ids)})
    except Exception:  # noqa: BLE001  (a model whose positions need more: plain positions)
        return None
    finally:
        for m, value in zip(owners, kept, strict=True):
            m.rope_deltas = value
    return int(positions.shape[0]) if positions.ndim == 3 else None


def input_rows(model: nn.Module, input_names: Sequence[str]) -> dict[str, tuple[int, ...]]:
    """The shape of one row of each batch input that is not a 2-D token tensor, from the model's
    configs: ``pixel_values`` ``(num_channels, height, width)`` from a vision config's
    ``image_size``."""
    rows: dict[str, tuple[int, ...]] = {}
    if "pixel_values" not in input_names:
        return rows
    for cfg in find_configs(model):
        vision = getattr(cfg, "vision_config", None)
        size = getattr(vision, "image_size", None)
        if size:
            h, w = (size, size) if isinstance(size, int) else tuple(size)
            rows["pixel_values"] = (int(getattr(vision, "num_channels", 3)), h, w)
            break
    return rows


def checkpoint_key_renamer(model: nn.Module) -> Callable[[str], str] | None:
    """HF's renaming of a checkpoint's keys to the model's names (``save_pretrained`` writes
    some models in an older layout: Llava's ``language_model.model.*`` for
    ``model.language_model.*``; per-expert keys named as the fused experts they are merged
    into), as ``from_pretrained`` applies it (:func:`pippy_xla.hf_compat.checkpoint_conversion`);
    ``None`` when the model has no conversions."""
    conversion = checkpoint_conversion(model)
    return None if conversion is None else lambda key: conversion.rename(key)[0]


def text_vocab_size(config: Any) -> int | None:
    """The text vocabulary's size, the language model's logits' last dim: its text config's
    ``vocab_size`` (a vision-language model's config holds it in ``text_config``; PaliGemma's
    has another, 257,152, at its top, which its own loss does not use), else ``config``'s."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    size = getattr(text, "vocab_size", None)
    return getattr(config, "vocab_size", None) if size is None else size


"""[Note: encoders of other modalities]

A vision-language model runs its vision tower and projector on the batch's ``pixel_values`` and
scatters the result into the token embeddings before the language model's layers. HF 5.x gives
every such model one entry point per modality, ``get_image_features`` (video, audio alike), whose
Python iterates over the batch (``list(image_features)``) and so cannot be traced for every batch
size. While tracing, that method is a leaf (:func:`call_features`): one call on the first stage,
run as the model's own Python, reading the owner's children that hold no decoder layer (the vision
tower and projector) and the owner's own parameters (LLaVA-OneVision's ``image_newline``, appended
to each image's rows of features), which are the first stage's. The method's pooled features are a
list of each image's rows in some families and a tensor in others, and the model's Python branches
on which (``isinstance(features, (list, tuple))``: Idefics3), which the trace cannot follow (a
proxy is neither); so :func:`call_features` returns them as one tensor (the images' rows, in
order), and the trace's ``torch.cat(features, dim=0)`` of them (Llava's) is
:func:`cat_features`, which keeps a tensor as it is. The owner itself (which holds the
language model too) reaches the graph through a :class:`ModuleRef`, which owns no parameters.
"""

FEATURE_METHODS = ("get_image_features", "get_video_features", "get_audio_features")
"""HF's entry points of the encoders of other modalities (see [Note: encoders of other
modalities])."""


class ModuleRef:
    """A module reached from a stage graph without making its parameters the stage's (not an
    ``nn.Module``: a ``GraphModule`` holds it as a plain attribute)."""

    def __init__(self, module: nn.Module) -> None:
        self.module = module

    def __repr__(self) -> str:
        return f"ModuleRef({type(self.module).__name__})"


def call_features(
    ref: ModuleRef, method: str, used: tuple[nn.Module, ...], *args: Any, **kwargs: Any
) -> Any:
    """``ref.module.<method>(*args, **kwargs)``, the model's own Python, its pooled features one
    tensor (see [Note: encoders of other modalities]); ``used`` are the modules it runs and the
    parameters it reads, held by the stage."""
    out = call_positions(ref, method, *args, **kwargs)  # the owner's method, as it is
    pooled = getattr(out, "pooler_output", None)
    if isinstance(pooled, (list, tuple)) and pooled:
        with contextlib.suppress(TypeError, RuntimeError):  # not tensors of one width: as is
            out.pooler_output = torch.cat(list(pooled), dim=0)
    return out


IMAGE_GRIDS = (
    ("pixel_values", "image_grid_thw", "image_token_id"),
    ("pixel_values_videos", "video_grid_thw", "video_token_id"),
)
"""Inputs that concatenate the batch's images (or videos) in row order, their grids (one row of
``(t, h, w)`` patches per image) and the token that stands for the image's features in the
text (Qwen2-VL's format; see [Note: images concatenated over a batch])."""


def smallest_images(model: nn.Module, arguments: dict[str, Any]) -> dict[str, torch.Tensor]:
    """For the images of :data:`IMAGE_GRIDS` among a feature method's ``arguments``: one image
    of the smallest grid a vision tower with ``spatial_merge_size`` ``m`` takes, ``(1, m, m)``
    (on the CPU), and its patches' pixels on ``meta`` (one row of ``in_channels *
    temporal_patch_size * patch_size**2`` per patch); empty for other models."""
    vision = getattr(getattr(model, "config", None), "vision_config", None)
    fields = ("spatial_merge_size", "in_channels", "temporal_patch_size", "patch_size")
    sizes = [getattr(vision, f, None) for f in fields]
    if not all(isinstance(n, int) for n in sizes):
        return {}
    merge, channels, temporal, patch = sizes
    out: dict[str, torch.Tensor] = {}
    for pixels, grid, _ in IMAGE_GRIDS:
        if grid in arguments and pixels in arguments:
            out[grid] = torch.tensor([[1, merge, merge]])
            row = channels * temporal * patch**2
            out[pixels] = torch.empty(merge * merge, row, device="meta")
    return out


def ragged_inputs(model: nn.Module, input_names: Sequence[str]) -> Callable | None:
    """The function that gives, for each batch input whose dim 0 is not the batch's rows
    (:data:`IMAGE_GRIDS`), each row's share of it, or ``None`` when the model takes none (see
    [Note: images concatenated over a batch])."""
    config = getattr(model, "config", None)
    merge = getattr(getattr(config, "vision_config", None), "spatial_merge_size", None)
    grids = [
        (pixels, grid, getattr(config, token))
        for pixels, grid, token in IMAGE_GRIDS
        if grid in input_names and getattr(config, token, None) is not None and merge
    ]
    if not grids:
        return None
    return functools.partial(_row_shares, grids=grids, merge=merge)


def _row_shares(batch: dict[str, torch.Tensor], *, grids: list, merge: int) -> dict:
    """Each ragged input of ``batch`` -> its rows' shares (:func:`_images_per_row`)."""
    shares = {}
    for pixels, grid, token_id in grids:
        shares[grid], patches = _images_per_row(batch, grid=grid, token_id=token_id, merge=merge)
        if pixels in batch:
            shares[pixels] = patches
    return shares


def _images_per_row(
    batch: dict[str, torch.Tensor], *, grid: str, token_id: int, merge: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's images and patches: images go to the rows in order, each taking as many of
    its row's image tokens as it has features (``t * h * w / merge**2``)."""
    grids = batch[grid].cpu().long()
    tokens = (grids.prod(-1) // merge**2).cumsum(0)
    row_tokens = (batch["input_ids"].cpu() == token_id).sum(1).cumsum(0)
    ends = torch.searchsorted(tokens, row_tokens, right=True)
    if len(tokens) != (ends[-1] if len(ends) else 0) or not torch.equal(
        torch.cat([tokens.new_zeros(1), tokens])[ends], row_tokens
    ):
        raise ValueError(
            f"the batch's image tokens ({int(row_tokens[-1]) if len(row_tokens) else 0} in "
            f"input_ids) do not match the features of its {len(grids)} images in {grid} "
            f"({int(tokens[-1]) if len(tokens) else 0}), image by image in row order"
        )
    images = torch.diff(ends, prepend=ends.new_zeros(1))
    patches = torch.zeros(len(images), dtype=torch.long)
    rows = torch.repeat_interleave(torch.arange(len(images)), images)
    patches.index_add_(0, rows, grids.prod(-1))
    return images, patches


"""[Note: images concatenated over a batch]

Qwen2-VL's processor concatenates every image's patches into one ``pixel_values`` tensor
(``[patches, channels * patch**2 * temporal_patch]``) and lists their grids in
``image_grid_thw`` (``[images, 3]``): neither has a row per prompt. A microbatch needs its rows'
images: each row's share comes from the batch itself (:func:`ragged_inputs`), the row's image
tokens in ``input_ids`` taken image by image in order (an image of grid ``(t, h, w)`` stands for
``t * h * w / spatial_merge_size**2`` tokens), and the step cuts those inputs at its
microbatches' (and replicas') row boundaries. A batch whose tokens do not fall on image
boundaries is a ``ValueError`` before the step.
"""


POSITION_METHODS = ("compute_3d_position_ids",)
"""HF's entry point of multimodal rotary positions (M-RoPE: Qwen2-VL and its descendants), whose
Python walks each row's images (see [Note: multimodal positions])."""


def call_positions(ref: ModuleRef, method: str, *args: Any, **kwargs: Any) -> Any:
    """``ref.module.<method>(*args, **kwargs)``, the model's own Python (see [Note: multimodal
    positions])."""
    return getattr(type(ref.module), method)(ref.module, *args, **kwargs)


"""[Note: multimodal positions]

Qwen2-VL's rotary positions (M-RoPE: temporal, height and width per token) come from
``compute_3d_position_ids``, which walks each row's images in Python (``iter(image_grid_thw)``,
``.tolist()``): not traceable. While tracing it is a leaf (:func:`call_positions`), computed on
every stage from the batch inputs (the token ids, their modality types, the images' grid sizes,
the mask), reading the token embeddings for their shape and device only, like a mask factory, so
the positions never cross a boundary. Its value's metadata (how many position kinds: a later
branch reads ``position_ids.ndim``) is sampled by running it on zeros of the sample batch's
shapes: text only, whose positions have the same kinds.
"""


def cat_features(features: Any, dim: int = 0) -> torch.Tensor:
    """``torch.cat(features, dim)`` where ``features`` are a feature method's pooled output,
    one tensor already at run time (see [Note: encoders of other modalities])."""
    return features if isinstance(features, torch.Tensor) else torch.cat(features, dim=dim)


def feature_owners(model: nn.Module, layers: Sequence[nn.Module]) -> list[tuple[str, nn.Module]]:
    """``(name, module)`` of every submodule whose class defines one of :data:`FEATURE_METHODS`
    and holds decoder layers (the one whose forward calls it), in ``named_modules`` order."""
    owners = []
    for name, mod in model.named_modules():
        defines = any(callable(getattr(type(mod), m, None)) for m in FEATURE_METHODS)
        if defines and any(any(lay is m for m in mod.modules()) for lay in layers[:1]):
            owners.append((name, mod))
    return owners


def encoder_children(owner: nn.Module, layers: Sequence[nn.Module]) -> list[str]:
    """The names of ``owner``'s children that hold no decoder layer: what its feature methods
    run (the vision tower and projector)."""
    first = layers[0]
    return [
        name
        for name, child in owner.named_children()
        if not any(m is first for m in child.modules())
    ]


"""[Note: checks on traced values]

A model may assert a condition on the batch's values with ``torch._check*`` (Llava's
``get_placeholder_mask``: as many image tokens as image features, else ``masked_scatter`` would
misalign the images). Such a condition cannot be decided while tracing; it is recorded instead as
a :func:`traced_check` node, side-effectful so that no dead-code elimination drops it, with the
message's traced values as arguments. The trace keeps it ([Note: canonical graphs]), the
classifier gives it a home like any node (the stage that computes its inputs, stage 0 for one
that only reads batch inputs), and that stage raises the model's own error type and message,
which every rank then raises as a ``PipelineError``, before the stage computes anything after it.
"""


@torch.fx.node.has_side_effect
def traced_check(cond: Any, error_type: str, message: tuple[Any, ...]) -> None:
    """A model's ``torch._check*`` recorded while tracing (see [Note: checks on traced
    values]): raises ``error_type`` (``module:qualname``, a graph holds no classes) with
    ``message``'s parts joined if ``cond`` is false."""
    if isinstance(cond, torch.Tensor):
        cond = bool(cond.all())
    if not cond:
        module, _, qualname = error_type.partition(":")
        cls: Any = importlib.import_module(module)
        for atom in qualname.split("."):
            cls = getattr(cls, atom)
        raise cls("".join(format(part) for part in message))


def _message_parts(msg: Any, tracer: torch.fx.Tracer) -> tuple[Any, ...]:
    """A check's message as text and the traced values it names (``Proxy(name)`` in the text
    formatted while tracing), so the stage formats it with the batch's values."""
    if msg is None:
        return ("Expected cond to be True, but got False",)
    text = str(msg() if callable(msg) else msg)
    nodes = {n.name: n for n in tracer.graph.nodes}
    parts: list[Any] = []
    for i, piece in enumerate(re.split(r"Proxy\((\w+)\)", text)):
        node = nodes.get(piece) if i % 2 else None
        parts.append(tracer.proxy(node) if node is not None else piece)
    return tuple(p for p in parts if not isinstance(p, str) or p)


def is_traced_check(node: torch.fx.Node) -> bool:
    return node.op == "call_function" and node.target is traced_check


@contextlib.contextmanager
def recorded_traced_checks() -> Iterator[None]:
    """``torch._check*`` on a traced condition is recorded as a :func:`traced_check` node inside
    the block (see [Note: checks on traced values])."""
    names = ("_check", "_check_with", "_check_tensor_all", "_check_tensor_all_with")
    saved = {n: getattr(torch, n) for n in names}

    def wrap(fn: Callable[..., Any], with_type: bool) -> Callable[..., Any]:
        def check(*args: Any, **kwargs: Any) -> Any:
            error_type = args[0] if with_type else RuntimeError
            rest = list(args[1:] if with_type else args)
            cond = rest[0] if rest else kwargs.get("cond")
            if not isinstance(cond, torch.fx.Proxy):
                return fn(*args, **kwargs)
            msg = rest[1] if len(rest) > 1 else kwargs.get("message")
            tracer = cond.tracer
            node = cond.node
            if node.op == "call_method" and node.target == "__call__" and len(node.args) == 1:
                # ``if callable(cond): cond = cond()`` (HF's ``torch_compilable_check``): a
                # proxy is callable, the condition is what it was called on.
                cond = tracer.proxy(node.args[0])
            message = _message_parts(msg, tracer)
            where = f"{error_type.__module__}:{error_type.__qualname__}"
            tracer.create_proxy("call_function", traced_check, (cond, where, message), {})
            return None

        return check

    try:
        for n, fn in saved.items():
            setattr(torch, n, wrap(fn, n.endswith("_with")))
        yield
    finally:
        for n, fn in saved.items():
            setattr(torch, n, fn)
