"""Stage graphs for generation: each stage's graph with its own key/value cache threaded through
its decoder layers and mask factories, the per-stage cache itself, and HF's generation settings
(logits processors, stopping criteria, lengths, special tokens) prepared by HF's own code.

[Note: per-stage generation graphs]

Training graphs are traced with ``use_cache=False`` and compute positions from the sequence
length. Generation needs positions of left-padded prompts (HF's ``attention_mask.cumsum - 1``)
and a cache that the layers update in place. So the model is partitioned a second time, lazily at
the first ``generate``, with ``position_ids`` among the batch inputs (the same partitioner, layer
ranges and classification rules: positions, masks and rotary tables are still recomputed on every
stage from the 2-D inputs) and ``logits_to_keep=1`` where the model takes it (the head computes
the last position's logits only, as in HF's ``generate``), and each stage's graph is then
rewritten: a last placeholder, ``past_key_values``, is passed to every decoder-layer call and
every mask-factory leaf in place of the traced ``None`` (and ``use_cache=True`` where the layer
takes it). Nothing else changes, so
any family the partitioner splits gets a cache this way, with no per-family code; the model's own
attention code updates the cache, as in one process.

The cache (:func:`stage_cache`) is HF's ``StaticCache`` for the model's config: one layer object
per decoder layer of the family's own kind (sliding-window layers where the config has them),
each allocating its ``[batch, kv_heads, length, head_dim]`` tensors lazily at its first update.
Only this stage's layers are ever updated, so a rank allocates its layers' share once per
generation, for the generation's whole length, and keeps its shapes at every decode step (the
2-D mask input still grows by a column per token in the eager graphs: compiled decode graphs
take it padded to the cache's length, as HF's static-cache decoding does; see [Note: compiled
generation] in ``runtime/_generate.py``). The mask
factories size masks and read the number of tokens seen from one layer of the cache (the first
full-attention one, or the first of each sliding kind): the other stages' entries of this stage's
cache are therefore the same objects as a local layer of the same kind, which has seen the same
tokens. Under autocast the default is HF's ``DynamicCache`` (same aliasing, tensors grown per
token): HF's static layers refuse the mixed key dtypes autocast produces, in one process too. The
training graphs, runners and engines are untouched, so ``run_train`` and ``run_eval``
neither rebuild nor recompile around a ``generate``; with ``compile=True`` the generation graphs
are compiled apart from the training ones.
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import fx, nn

from pippy_xla.hf_compat import CACHE_ARG, cache_param
from pippy_xla.split import hf
from pippy_xla.split.classify import producers
from pippy_xla.split.emit import StageGraph
from pippy_xla.split.partition import LayerCls, UnsupportedModelError, layer_classes, partition

__all__ = [
    "CACHE_ARG",
    "GENERATION_INPUTS",
    "POSITION_INPUTS",
    "PROMPT_INPUTS",
    "GenerationSettings",
    "check_can_generate",
    "early_init",
    "generation_stages",
    "prepare_generation",
    "stage_cache",
]

GENERATION_INPUTS = ("input_ids", "attention_mask", "position_ids")
"""The batch inputs of generation graphs (see [Note: per-stage generation graphs])."""


def check_can_generate(model: nn.Module) -> None:
    """Raises ``UnsupportedModelError`` unless ``model`` is an HF model with a generation head
    whose forward takes ``position_ids``."""
    can = getattr(model, "can_generate", None)
    if not (callable(can) and can()):
        raise UnsupportedModelError(
            f"{type(model).__name__} has no generation head: PipelineModel.generate needs an HF "
            "model that can generate (a *ForCausalLM with GenerationMixin)"
        )
    if "position_ids" not in inspect.signature(model.forward).parameters:
        raise UnsupportedModelError(
            f"{type(model).__name__}.forward takes no position_ids; PipelineModel.generate "
            "passes the positions of left-padded prompts as HF's generate does"
        )


def generation_stages(
    model: nn.Module,
    layer_cls: LayerCls,
    layer_ranges: list[tuple[int, int]],
    device_type: str,
    extra_inputs: Sequence[str] = (),
) -> list[StageGraph]:
    """Every stage's generation graph (see [Note: per-stage generation graphs]): called as
    ``module(*batch_inputs, *boundary_inputs, cache)``. ``extra_inputs``: inputs of the prompts
    besides the token ids (a vision-language model's ``pixel_values``: the prefill's graphs,
    see [Note: images in the prefill])."""
    check_can_generate(model)
    stages = partition(
        model,
        layer_cls,
        layer_ranges,
        (*GENERATION_INPUTS, *extra_inputs),
        device_type=device_type,
        loss=False,
        constants={"logits_to_keep": 1},  # the last position's logits only, as HF's generate
    )
    classes = layer_classes(model, layer_cls)
    for st in stages:
        _thread_cache(st.module, classes)
        st.code = st.module.code
    # The decode steps give later stages no token ids (see [Note: generation data flow]); the
    # prefill gives every stage the prompts' (Qwen3-VL's later layers find the image tokens).
    for st in stages[1:] if not extra_inputs else []:
        reader = _value_reader(st.module, "input_ids")
        if reader is not None:
            raise UnsupportedModelError(
                f"{type(model).__name__} cannot generate through the pipeline: stage {st.index} "
                f"reads the values of the token ids (`{reader}`), which only the first stage "
                "receives while decoding (see [Note: generation data flow] in "
                "runtime/_generate.py); training and evaluation are not affected"
            )
    return stages


def _value_reader(gm: fx.GraphModule, name: str) -> str | None:
    """The first node of ``gm`` whose result depends on the values of placeholder ``name`` and
    reaches the output (not only its shape, dtype or device), or ``None``."""
    nodes = list(gm.graph.nodes)
    needed = {nodes[-1]}
    for n in reversed(nodes):
        if n in needed:
            needed.update(p for p, meta_only in producers(n) if not meta_only)
    placeholder = next((n for n in nodes if n.op == "placeholder" and n.target == name), None)
    if placeholder is None or placeholder not in needed:
        return None
    return next(
        u.format_node()
        for u in placeholder.users
        if u in needed and any(p is placeholder and not meta for p, meta in producers(u))
    )


def _thread_cache(gm: fx.GraphModule, layer_cls: tuple[type[nn.Module], ...]) -> None:
    """Adds the cache placeholder and passes it to every layer call and mask leaf of ``gm``."""
    graph = gm.graph
    last = [n for n in graph.nodes if n.op == "placeholder"][-1]
    with graph.inserting_after(last):
        cache = graph.placeholder(CACHE_ARG)
    for node in graph.nodes:
        if node.op == "call_module":
            mod = gm.get_submodule(node.target)
            if isinstance(mod, hf.MaskLeaf):
                name = cache_param(mod.fn) or CACHE_ARG
                node.kwargs = {**node.kwargs, name: cache}
            elif isinstance(mod, layer_cls):
                node.args, node.kwargs = _with_cache(mod, node.args, node.kwargs, cache)
        elif node.op == "call_function" and node.target is hf.call_recording:
            layer, keys, *args = node.args
            mod = gm.get_submodule(layer.target)
            args, kwargs = _with_cache(mod, tuple(args), node.kwargs, cache)
            node.args, node.kwargs = (layer, keys, *args), kwargs
    graph.lint()
    gm.recompile()


def _with_cache(
    layer: nn.Module, args: tuple, kwargs: dict[str, Any], cache: fx.Node
) -> tuple[tuple, dict[str, Any]]:
    """A layer call's arguments with the cache (and ``use_cache=True``) in place of the traced
    ones, wherever the layer's signature puts them."""
    sig = inspect.signature(layer.forward)
    params = sig.parameters
    var_kw = next((p.name for p in params.values() if p.kind is p.VAR_KEYWORD), None)
    name = cache_param(layer.forward)
    if name is None and var_kw is None:
        raise UnsupportedModelError(
            f"{type(layer).__name__}.forward takes no {CACHE_ARG} (nor a parameter annotated as "
            "a Cache); generation passes the cache to each decoder layer"
        )
    bound = sig.bind(*args, **kwargs)
    extra = dict(bound.arguments.pop(var_kw, {})) if var_kw else {}
    for key, value in ((name or CACHE_ARG, cache), ("use_cache", True)):
        if key in params:
            bound.arguments[key] = value
        elif key == CACHE_ARG or key in extra:
            extra[key] = value
    return tuple(bound.args), {**bound.kwargs, **extra}


def stage_cache(config: Any, layers: Sequence[int], max_len: int, kind: str | None = None) -> Any:
    """The cache of one stage (see [Note: per-stage generation graphs]): HF's ``StaticCache`` of
    ``max_len`` tokens (``kind`` ``None`` or ``"static"``) or its ``DynamicCache``
    (``"dynamic"``, for models whose code does not take a static cache, as in one process),
    whose entries outside ``layers`` (this stage's decoder layers) are a local layer of the same
    kind."""
    from transformers import DynamicCache, StaticCache

    if kind in (None, "static"):
        cache = StaticCache(config=config, max_cache_len=max_len)
    elif kind == "dynamic":
        cache = DynamicCache(config=config)
    else:
        raise ValueError(
            f"cache_implementation={kind!r} is not supported by PipelineModel.generate; use "
            "'static' (the default) or 'dynamic'"
        )
    local = [cache.layers[i] for i in layers]
    for i, entry in enumerate(cache.layers):
        if i in layers:
            continue
        same = next((e for e in local if type(e) is type(entry)), None)
        if same is not None:
            cache.layers[i] = same
    return cache


def early_init(
    cache: Any,
    layers: Sequence[int],
    rows: int,
    shape: tuple[int | list[int], int | list[int]],
    dtype: torch.dtype,
    device: torch.device,
) -> None:
    """Allocates the tensors of a stage's ``cache`` (its ``layers`` only) for ``rows`` rows now,
    as HF's ``StaticCache.early_initialization`` does for a whole model: ``shape`` is the model's
    ``(kv_heads, head_dim)``, each a number or one per layer. Compiled graphs then never allocate
    them (see [Note: compiled generation] in ``runtime/_generate.py``)."""
    heads, dims = shape
    for i in layers:
        layer = cache.layers[i]
        if not getattr(layer, "supports_early_init", False) or layer.is_initialized:
            continue
        h = heads[i] if isinstance(heads, list) else heads
        d = dims[i] if isinstance(dims, list) else dims
        empty = torch.zeros((rows, h, 0, d), dtype=dtype, device=device)
        layer.lazy_initialization(empty, empty)


@dataclass(kw_only=True, slots=True)
class GenerationSettings:
    """What a ``generate`` call decodes with, prepared by HF's own generation code."""

    config: Any
    """The call's ``GenerationConfig`` (the model's, updated by the call's arguments)."""
    processors: Any
    """HF's ``LogitsProcessorList`` for it (penalties, temperature, top-k, top-p...)."""
    stopping: Any
    """HF's ``StoppingCriteriaList`` (maximum length, end-of-sequence tokens...)."""
    max_length: int
    """Prompt plus new tokens: the generated sequences' length at most."""
    has_eos: bool
    """Whether rows finish at an end-of-sequence token (then padded with ``pad``)."""
    pad: torch.Tensor | None
    """The padding token of finished rows."""


def _default_lengths(model: nn.Module, generation_config: Any, kwargs: dict) -> tuple[bool, bool]:
    """Whether the maximum and the minimum length are nobody's choice (as HF's ``generate``
    decides it, before its settings are merged)."""

    def default(name: str) -> bool:
        given = generation_config is not None and getattr(generation_config, name) is not None
        return (
            kwargs.get(name) is None
            and not given
            and getattr(model.generation_config, name) is None
        )

    return default("max_length"), default("min_length")


_UNSUPPORTED = {"num_beams": 1, "num_return_sequences": 1}


"""[Note: images in the prefill]

A vision-language model generates from prompts with images as HF's ``generate`` does: the images
(``pixel_values`` and what the family adds: ``image_sizes``, ``pixel_attention_mask``, the
``token_type_ids`` that Gemma 3's and PaliGemma's prefill masks read) go into the
prefill only, where the first stage runs the vision tower and scatters the features into the
prompt's embeddings; the decode steps read the cache. The prefill runs graphs of its own,
partitioned with those inputs among the batch inputs (made at the first ``generate`` with
images, for the inputs it names), and every decode step the graphs without them. Each row's
images travel with the row: a group of rows, a replica's share. Images concatenated over the
prompts (Qwen2-VL's format: ``pixel_values`` of every image's patches, ``image_grid_thw``) are
cut at the groups' rows by each row's image tokens, as training cuts them (see [Note: images
concatenated over a batch] in ``hf.py``); a group takes the graphs of the inputs its rows
hold (videos but no image, say), and a group whose rows hold none runs the graphs without
images. Their M-RoPE positions are HF's: ``_prepare_position_ids_for_generation`` with
the grids and ``mm_token_type_ids`` gives ``[kinds, rows, length]``, the generation graphs are
traced with position ids of those kinds (:func:`hf.position_kinds`), and each decode step adds
one to a group's last, as HF's loop does, so the model keeps no state per group (its
``rope_deltas`` is not read). The prefill graphs give every stage the prompts' token ids (Qwen3-VL's
later layers find the image tokens in them), the decode graphs only the first. HF's own decode
steps give the mask no ``token_type_ids`` (Gemma 3) or ignore them once the cache holds the
prompt (PaliGemma), so the decode graphs without them are HF's. Chunked prefill
(``prefill_chunk_size``) is refused with images, as HF's ``generate`` refuses it.
"""

PROMPT_INPUTS = (
    "pixel_values",
    "image_sizes",
    "pixel_attention_mask",
    "image_grid_thw",
    "pixel_values_videos",
    "video_grid_thw",
    "mm_token_type_ids",
    "token_type_ids",
)
"""Model inputs ``generate`` takes besides the token ids, for the prefill only: the prompts'
images (a row each, or concatenated over the batch with their grids) and what the family adds
(see [Note: images in the prefill])."""

POSITION_INPUTS = ("image_grid_thw", "video_grid_thw", "mm_token_type_ids")
"""The prompt inputs HF's ``_prepare_position_ids_for_generation`` reads for M-RoPE's positions
(the images' and videos' grids and each token's modality)."""


def prepare_generation(
    model: nn.Module,
    input_ids: torch.Tensor,
    generation_config: Any,
    kwargs: dict[str, Any],
) -> GenerationSettings:
    """HF's generation settings for ``model.generate(input_ids, generation_config, **kwargs)``,
    in the order HF's ``generate`` prepares them (``kwargs`` without the prompts' images, see
    [Note: images in the prefill]). Raises ``ValueError`` for options the pipeline does not
    decode with yet (beams, several sequences per prompt, other model keyword inputs)."""
    from transformers import LogitsProcessorList, StoppingCriteriaList

    has_default_max, has_default_min = _default_lengths(model, generation_config, kwargs)
    config, model_kwargs = model._prepare_generation_config(generation_config, **kwargs)
    if model_kwargs:
        raise ValueError(
            f"generate got model inputs {sorted(model_kwargs)}; the pipeline generates from "
            f"input_ids and attention_mask, with images as {list(PROMPT_INPUTS)}"
        )
    for name, value in _UNSUPPORTED.items():
        if getattr(config, name) != value:
            raise ValueError(f"generate with {name}={getattr(config, name)} is not supported yet")
    chunk = config.prefill_chunk_size  # HF's chunked prefill, pipelined by chunks too
    if chunk is not None and (type(chunk) is not int or chunk < 1):
        raise ValueError(f"prefill_chunk_size must be a positive int or None, got {chunk!r}")
    device = input_ids.device
    model._prepare_special_tokens(config, True, device=device, batch_size=input_ids.shape[0])
    length = input_ids.shape[1]
    config = model._prepare_generated_length(
        generation_config=config,
        has_default_max_length=has_default_max,
        has_default_min_length=has_default_min,
        model_input_name="input_ids",
        inputs_tensor=input_ids,
        input_ids_length=length,
    )
    model._validate_generated_length(config, length, has_default_max)
    processors = model._get_logits_processor(
        generation_config=config,
        input_ids_seq_length=length,
        encoder_input_ids=input_ids,
        prefix_allowed_tokens_fn=None,
        logits_processor=LogitsProcessorList(),
        device=device,
        model_kwargs={},
    )
    stopping = model._get_stopping_criteria(
        generation_config=config, stopping_criteria=StoppingCriteriaList()
    )
    return GenerationSettings(
        config=config,
        processors=processors,
        stopping=stopping,
        max_length=config.max_length,
        has_eos=any(hasattr(c, "eos_token_id") for c in stopping),
        pad=config._pad_token_tensor,
    )
