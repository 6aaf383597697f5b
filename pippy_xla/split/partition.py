"""Split a decoder-only model into one ``torch.fx.GraphModule`` per pipeline stage.

:func:`partition` checks its arguments and runs three steps, one module each:

- :mod:`~pippy_xla.split.trace`: the model is traced once with torch.fx, with the decoder layers
  (one class or several; by default those of the list HF's ``base_model_pp_plan`` names),
  rotary embeddings, the mask factories and the encoders of other modalities as leaves (see
  :mod:`pippy_xla.split.hf`);
- :mod:`~pippy_xla.split.classify`: every live node of the trace gets one record saying which
  stage computes it. Layer ``k``'s call goes to the stage whose range holds ``k``; any other node
  to the stage of the highest-index layer upstream of it (its "depth"); "prologue" nodes (no
  layer upstream) that depend only on the batch inputs are replicated onto every stage that
  consumes them (see [Note: replicated prologue]);
- :mod:`~pippy_xla.split.emit`: one graph per stage.
"""

from __future__ import annotations

import inspect
import keyword
import logging
from collections.abc import Sequence
from typing import Any

from torch import nn

from pippy_xla._native import _C
from pippy_xla.split.classify import classify, index_limits, mark_batch_terms
from pippy_xla.split.emit import StageGraph, emit_stage
from pippy_xla.split.trace import UnsupportedModelError, separate_added_loss, traced_root

__all__ = [
    "LayerCls",
    "StageGraph",
    "UnsupportedModelError",
    "class_names",
    "decoder_stack",
    "find_layers",
    "layer_classes",
    "partition",
]

logger = logging.getLogger(__name__)


LayerCls = type[nn.Module] | tuple[type[nn.Module], ...] | None
"""What ``layer_cls`` may be: a decoder-layer class, a tuple of them (a stack of several layer
classes), or ``None`` for the stack :func:`layer_classes` finds."""


def _outermost(model: nn.Module, classes: tuple[type[nn.Module], ...]) -> list[str]:
    names: list[str] = []
    for name, mod in model.named_modules():
        if isinstance(mod, classes) and not any(name.startswith(n + ".") for n in names):
            names.append(name)
    return names


def class_names(classes: tuple[type[nn.Module], ...]) -> str:
    """``A`` for one class, ``(A, B)`` for several: how messages name ``layer_cls``."""
    names = [c.__qualname__ for c in classes]
    return names[0] if len(names) == 1 else f"({', '.join(names)})"


def layer_classes(model: nn.Module, layer_cls: LayerCls = None) -> tuple[type[nn.Module], ...]:
    """The decoder-layer classes: ``layer_cls`` as a tuple, or for ``None`` the classes of the
    entries of the model's layer stack (:func:`decoder_stack`), in order of first entry.

    Raises:
        ValueError: ``layer_cls`` is not a module class or a tuple of them.
        UnsupportedModelError: ``None`` and the model has no layer stack.
    """
    if layer_cls is None:
        return tuple(dict.fromkeys(type(m) for m in decoder_stack(model)))
    classes = layer_cls if isinstance(layer_cls, tuple) else (layer_cls,)
    if not classes or not all(isinstance(c, type) and issubclass(c, nn.Module) for c in classes):
        raise ValueError(
            "layer_cls must be an nn.Module subclass, a tuple of them or None (the model's "
            f"layer stack), got {layer_cls!r}"
        )
    return classes


def decoder_stack(model: nn.Module) -> nn.ModuleList | nn.Sequential:
    """The model's decoder layers (see [Note: finding the layer stack]).

    Raises:
        UnsupportedModelError: the model has no such stack, or several with nothing to choose
            between them.
    """
    stacks = _plan_stacks(model) or _parameter_stacks(model)
    if not stacks:
        raise UnsupportedModelError(
            f"{type(model).__name__} has no nn.ModuleList or nn.Sequential of layers (none named "
            "by HF's base_model_pp_plan, none of modules with parameters) for the pipeline to "
            "split between; pass layer_cls=<the class of its repeated layers>"
        )
    # Lists inside another candidate (a layer's own sublayers) are not the stack.
    stacks = {
        name: owner_list
        for name, owner_list in stacks.items()
        if not any(name.startswith(other + ".") for other in stacks)
    }
    text = _text_config(model)
    of_text = {n: ol for n, ol in stacks.items() if text is not None and _config(ol[0]) is text}
    stacks = of_text or stacks
    if len(stacks) > 1:
        found = ", ".join(
            f"{n} ({len(ol[1])} x {type(ol[1][0]).__name__})" for n, ol in stacks.items()
        )
        raise UnsupportedModelError(
            f"{type(model).__name__} has several layer stacks the pipeline could split between "
            f"({found}), none of them the text model's; pass layer_cls=<the class of the "
            "decoder layers>"
        )
    return next(iter(stacks.values()))[1]


"""[Note: finding the layer stack]

With ``layer_cls=None`` the pipeline splits the model between the entries of one stack, an
``nn.ModuleList`` or ``nn.Sequential``: the non-empty stacks that HF's ``base_model_pp_plan``
names on a submodule (on its config), or without any, every stack whose entries all hold
parameters. A stack inside another candidate (a layer's own sublayers) is not one. Of the rest,
the stack owned by the module whose config is the model's text config
(``model.config.get_text_config()``: the language model of a vision-language model, not its
vision tower or another sub-model with a plan of its own) is chosen; if there is none of the
text model's and more than one remain, the model is refused with the candidates named and
``layer_cls`` asked for.
"""


def _plan_stacks(model: nn.Module) -> dict[str, tuple[nn.Module, nn.Module]]:
    """Qualified name -> (owner, stack) of every non-empty stack a ``base_model_pp_plan``
    names."""
    found: dict[str, tuple[nn.Module, nn.Module]] = {}
    for name, mod in model.named_modules():
        plan = getattr(_config(mod), "base_model_pp_plan", None) or {}
        for key in plan:
            sub = mod._modules.get(key)
            if isinstance(sub, (nn.ModuleList, nn.Sequential)) and len(sub):
                qual = f"{name}.{key}" if name else key
                if not any(sub is s for _, s in found.values()):
                    found[qual] = (mod, sub)
    return found


def _parameter_stacks(model: nn.Module) -> dict[str, tuple[nn.Module, nn.Module]]:
    """Qualified name -> (owner, stack) of every non-empty stack whose entries all hold
    parameters."""
    found: dict[str, tuple[nn.Module, nn.Module]] = {}
    for name, mod in model.named_modules():
        for key, sub in mod._modules.items():
            if (
                isinstance(sub, (nn.ModuleList, nn.Sequential))
                and len(sub)
                and all(any(True for _ in c.parameters()) for c in sub)
                and not any(sub is s for _, s in found.values())
            ):
                found[f"{name}.{key}" if name else key] = (mod, sub)
    return found


def _config(mod: nn.Module) -> object | None:
    return getattr(mod, "config", None)


def _text_config(model: nn.Module) -> object | None:
    """``model.config.get_text_config()``: the config of its language model, if it has one."""
    get = getattr(_config(model), "get_text_config", None)
    return get() if callable(get) else None


def find_layers(model: nn.Module, layer_cls: LayerCls = None) -> list[str]:
    """Qualified names of the decoder layers (instances of ``layer_cls``, a class or a tuple of
    classes; ``None``: see :func:`layer_classes`) in forward order.

    Order is registration order (``ModuleList`` index order); :func:`partition` checks it against
    the traced call order. Nested instances are not counted twice.

    Raises:
        ValueError: ``model`` holds no instance of ``layer_cls``.
    """
    classes = layer_classes(model, layer_cls)
    names = _outermost(model, classes)
    if not names:
        raise ValueError(
            f"{type(model).__name__} contains no {class_names(classes)} module. "
            + _layer_hint(model)
        )
    parents = {n.rpartition(".")[0] for n in names}
    stack = model.get_submodule(next(iter(parents)))
    if len(parents) > 1 or not isinstance(stack, (nn.ModuleList, nn.Sequential)):
        raise UnsupportedModelError(
            f"layer_cls={class_names(classes)}: its {len(names)} instances in "
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
        "Pass the decoder-layer class of this model as layer_cls (a tuple of classes for a "
        "stack of several)."
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


def _check_checkpoint_layers(checkpoint_layers: Sequence[int], num_layers: int) -> frozenset[int]:
    layers = list(checkpoint_layers)
    for k in layers:
        if not isinstance(k, int) or isinstance(k, bool) or not 0 <= k < num_layers:
            raise ValueError(
                f"checkpoint_layers must hold decoder-layer indices in [0, {num_layers}), "
                f"found {k!r} (all: {layers})"
            )
    return frozenset(layers)


def partition(
    model: nn.Module,
    layer_cls: LayerCls,
    layer_ranges: list[tuple[int, int]],
    input_names: Sequence[str] = ("input_ids", "attention_mask"),
    checkpoint_layers: Sequence[int] = (),
    device_type: str = "cpu",
    loss: bool = True,
    constants: dict[str, Any] | None = None,
) -> list[StageGraph]:
    """Trace ``model`` (an HF ``*ForCausalLM``, or a module whose output is the logits) and split
    it into one graph per stage.

    Works on ``meta``-device models: tracing reads no data. The trace uses ``use_cache=False``,
    ``return_dict=True``, with the model in eval mode (modes restored afterwards) and, for an HF
    model, a ``labels`` input (see [Note: terms added to the loss]); the last stage returns
    ``(logits,)``, or ``(logits, added)`` for a model that adds terms to its loss.

    Args:
        model: the model; stage graphs reference its submodules, parameters and buffers.
        layer_cls: the decoder-layer class, a tuple of them, or ``None`` for the classes of the
            model's layer stack (fx leaves; see :func:`find_layers`).
        layer_ranges: ``layer_ranges[s] = (start, stop)``, half-open, contiguous, covering all
            layers.
        input_names: model keyword inputs that the batch provides, each a 2-D ``[batch, seq]``
            tensor.
        checkpoint_layers: decoder-layer indices to run under non-reentrant activation
            checkpointing. See [Note: checkpointed layers].
        device_type: the type of the device the stages run on (see [Note: one device]).
        loss: trace the model's loss too (``False``: the logits only, nothing the loss alone
            reads); ``constants``: forward keywords fixed in the trace (``logits_to_keep=1``).

    Raises:
        ValueError: bad ``layer_cls``, ``layer_ranges`` or ``input_names``, or a model the
            partitioner cannot split.
    """
    classes = layer_classes(model, layer_cls)
    layer_names = find_layers(model, classes)
    _check_ranges(layer_ranges, len(layer_names))
    checkpoint_set = _check_checkpoint_layers(checkpoint_layers, len(layer_names))
    input_names = _check_input_names(model, input_names)
    root, graph = traced_root(model, classes, input_names, device_type, loss, constants)
    output = next(iter(reversed(graph.nodes)))  # torch 2.11: a _node_list, no iterator
    if output.op != "output":
        raise ValueError("traced graph does not end in an output node")
    added_loss = separate_added_loss(graph, output, type(model).__name__)
    over_batch = added_loss and mark_batch_terms(root, graph)
    classified = classify(root, graph, layer_names, layer_ranges)
    limits = index_limits(root, graph)
    stages = [
        emit_stage(s, classified, input_names, layer_range, checkpoint_set, added_loss)
        for s, layer_range in enumerate(layer_ranges)
    ]
    stages[-1].added_over_batch = over_batch
    for st in stages:
        st.index_limits = dict(limits)
        _log_stage(st)
    return stages


def _log_stage(st: StageGraph) -> None:
    logger.debug(
        "stage %d: layers %s, batch inputs %s, %d boundary inputs, %d boundary outputs",
        st.index,
        st.layers,
        st.batch_inputs,
        st.num_boundary_inputs,
        st.num_boundary_outputs,
    )


def _check_input_names(model: nn.Module, input_names: Sequence[str]) -> list[str]:
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
    return input_names
