"""Materialize the local stages of a model built (wholly or partly) on the ``meta`` device."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator, Sequence

import torch
from torch import nn

from pippy_xla.split.partition import StageGraph

__all__ = ["UninitializedTensorError", "materialize", "materialize_tensors"]

"""[Note: materialization through the model's own modules]

A stage ``GraphModule`` does not own the model's modules in the model's layout: fx copies a
``call_module`` target (a decoder layer, a rotary module) by reference, but a parameter that the
trace reached through ``get_attr`` (Llama's final ``model.norm.weight``, OPT's learned position
table) sits under a plain ``nn.Module`` container of the GraphModule. An initializer applied to
the GraphModule's submodules (HF's ``_init_weights`` dispatches on module class and class name)
never sees such a parameter. So materialization goes through the original model instead:

1. every tensor a local stage uses is looked up in the original module that owns it (by its
   original name); a ``meta`` tensor is replaced there by an empty tensor on the device, filled
   with NaN (float) or left with its version counter recorded (integer / bool). One meta tensor
   reached under several names (tied weights) becomes one new tensor under all of them;
2. the model's own initialization runs on the owning modules and their ancestors, children
   before parents, exactly as HF's ``initialize_weights`` (``post_init`` of ``from_config``)
   visits them: each module through the ``_initialize_weights`` of its nearest enclosing
   ``PreTrainedModel`` under ``transformers.initialization.guard_torch_init_functions``. Real
   (already materialized) tensors carry ``_is_hf_initialized`` meanwhile, HF's own flag for
   loaded weights, so a partly-meta model keeps them untouched. Models that are not HF models
   get each owning module's ``reset_parameters()``;
3. a fresh tensor still holding NaN (or, without NaN, never written) is an error naming it and
   its owning module class: no tensor stays uninitialized silently;
4. the stage GraphModules are re-pointed at the owners' tensors, so a stage computes with, and
   the optimizer updates, the very tensors of the original model's modules.
"""


class UninitializedTensorError(RuntimeError):
    """A materialized tensor that the model's initialization did not (fully) write."""


def _split(name: str) -> tuple[str, str]:
    owner, _, attr = name.rpartition(".")
    return owner, attr


def _slot(module: nn.Module, attr: str) -> dict:
    if attr in module._parameters:
        return module._parameters
    if attr in module._buffers:
        return module._buffers
    raise AttributeError(f"{type(module).__name__} has no parameter or buffer {attr!r}")


def _fresh_like(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    new = torch.empty_like(t, device=device)
    if new.is_floating_point() or new.is_complex():
        new.fill_(float("nan"))
    if isinstance(t, nn.Parameter):
        return nn.Parameter(new, requires_grad=t.requires_grad)
    return new


def _pretrained_model_cls() -> type | None:
    try:
        from transformers import PreTrainedModel
    except ImportError:  # pragma: no cover - transformers is optional for non-HF models
        return None
    return PreTrainedModel


def _guard_init() -> contextlib.AbstractContextManager:
    try:
        from transformers.initialization import guard_torch_init_functions
    except ImportError:  # pragma: no cover
        return contextlib.nullcontext()
    return guard_torch_init_functions()


def _reset_parameters(module: nn.Module) -> None:
    """Non-HF fallback: the module's own ``reset_parameters``, keeping its real tensors."""
    reset = getattr(module, "reset_parameters", None)
    if reset is None:
        return
    keep = {
        name: t.detach().clone()
        for name, t in [
            *module.named_parameters(recurse=False),
            *module.named_buffers(recurse=False),
        ]
        if t.device.type != "meta" and not getattr(t, "_pippy_fresh", False)
    }
    reset()
    for name, value in keep.items():
        getattr(module, name).copy_(value)


def _initializer_walk(
    model: nn.Module, wanted: set[nn.Module]
) -> Iterator[tuple[nn.Module, Callable[[nn.Module], None]]]:
    """``(module, initializer)`` for the ``wanted`` modules, children before parents, as HF's
    ``initialize_weights`` visits them: a ``PreTrainedModel`` (the root or a nested sub-model)
    initializes its subtree with its own ``_initialize_weights``."""
    pretrained = _pretrained_model_cls()
    seen: set[int] = set()

    def visit(module: nn.Module, init: Callable[[nn.Module], None]):
        if id(module) in seen:
            return
        seen.add(id(module))
        for child in module.children():
            if child in wanted:
                child_init = init
                if pretrained is not None and isinstance(child, pretrained):
                    child_init = child._initialize_weights
                yield from visit(child, child_init)
        yield module, init

    root_init = _reset_parameters
    if pretrained is not None and isinstance(model, pretrained):
        root_init = model._initialize_weights
    yield from visit(model, root_init)


def materialize(model: nn.Module, stages: Sequence[StageGraph], device: torch.device) -> None:
    """Gives every tensor of ``stages`` a real value on ``device``, through ``model``'s modules.

    Meta tensors are created on ``device`` and initialized by the model's own initialization;
    real tensors keep their values (CPU tensors are moved to ``device``, keeping their identity).
    See [Note: materialization through the model's own modules].

    Raises:
        ValueError: a real tensor lives on another accelerator than ``device``.
        UninitializedTensorError: the model's initialization left a materialized tensor (partly)
            unwritten; the message names the tensor and its owning module class.
    """
    names: dict[str, None] = {}
    for st in stages:
        names.update(dict.fromkeys(st.param_names.values()))
    owners = materialize_tensors(model, names, device)

    # The stage graphs use the owners' tensors (see [Note: materialization through ...]).
    for st in stages:
        for stage_name, name in st.param_names.items():
            attr = _split(name)[1]
            owner_tensor = _slot(owners[name], attr)[attr]
            container_name, stage_attr = _split(stage_name)
            slot = _slot(st.module.get_submodule(container_name), stage_attr)
            if slot[stage_attr] is not owner_tensor:
                slot[stage_attr] = owner_tensor


def materialize_tensors(
    model: nn.Module, names: Iterable[str], device: torch.device
) -> dict[str, nn.Module]:
    """:func:`materialize` for the model's tensors ``names`` (parameters and buffers, by their
    names in the model): meta ones created on ``device`` and initialized by the model's own
    initialization, real ones moved there. Returns the owning module of each name."""
    replaced: dict[int, torch.Tensor] = {}  # id(meta tensor) -> its replacement
    fresh: dict[str, torch.Tensor] = {}  # original name -> fresh tensor (first name of a tie)
    versions: dict[int, int] = {}
    owners: dict[str, nn.Module] = {}
    for name in names:
        owner_name, attr = _split(name)
        owner = model.get_submodule(owner_name)
        owners[name] = owner
        slot = _slot(owner, attr)
        t = slot[attr]
        if t.device.type == "meta":
            new = replaced.get(id(t))
            if new is None:
                new = _fresh_like(t, device)
                new._pippy_fresh = True
                replaced[id(t)] = new
                versions[id(new)] = new._version
                fresh[name] = new
            slot[attr] = new
        elif t.device != device:
            if t.device.type != "cpu":
                raise ValueError(
                    f"'{name}' is on {t.device} but the pipeline's device is {device}; build the "
                    "model on 'meta' or on the CPU (each rank then moves only its own stage), "
                    f"or pass device='{t.device}'"
                )
            with torch.no_grad():
                t.data = t.data.to(device)

    if fresh:
        _initialize(model, {owners[n] for n in fresh})
        for t in fresh.values():
            del t._pippy_fresh
        _check_initialized(fresh, owners, versions, model)
    return owners


def _initialize(model: nn.Module, owner_modules: set[nn.Module]) -> None:
    parent_of: dict[nn.Module, nn.Module] = {}
    for module in model.modules():
        for child in module.children():
            parent_of.setdefault(child, module)
    wanted: set[nn.Module] = set()
    for m in owner_modules:
        while m is not None and m not in wanted:
            wanted.add(m)
            m = parent_of.get(m)

    # Real tensors are protected by HF's own "already loaded" flag while initializers run.
    flagged = []
    for t in [*model.parameters(), *model.buffers()]:
        if t.device.type != "meta" and not getattr(t, "_pippy_fresh", False):
            if not getattr(t, "_is_hf_initialized", False):
                t._is_hf_initialized = True
                flagged.append(t)
    try:
        with torch.no_grad(), _guard_init():
            for module, init in _initializer_walk(model, wanted):
                if init is _reset_parameters and module not in owner_modules:
                    continue  # reset_parameters of a parent may reset its children's tensors
                if getattr(module, "_is_hf_initialized", False):
                    module._is_hf_initialized = False  # it holds fresh tensors now
                init(module)
    finally:
        for t in flagged:
            del t._is_hf_initialized


def _check_initialized(
    fresh: dict[str, torch.Tensor],
    owners: dict[str, nn.Module],
    versions: dict[int, int],
    model: nn.Module,
) -> None:
    initializer = (
        f"{type(model).__name__}._init_weights"
        if hasattr(model, "_init_weights")
        else "reset_parameters()"
    )
    problems = []
    for name, t in fresh.items():
        if t.is_floating_point() or t.is_complex():
            bad = int(torch.isnan(t).sum())
            if bad == 0:
                continue
            what = f"{bad} of its {t.numel()} elements still hold the NaN it was filled with"
        elif t._version != versions[id(t)]:
            continue
        else:
            what = "never written"
        kind = "parameter" if isinstance(t, nn.Parameter) else "buffer"
        problems.append(f"'{name}' (a {kind} of {type(owners[name]).__name__}: {what})")
    if problems:
        shown = "; ".join(problems[:8]) + ("; ..." if len(problems) > 8 else "")
        raise UninitializedTensorError(
            f"{len(problems)} tensor(s) materialized from the meta device were not initialized "
            f"by {initializer}: {shown}. Give those modules an initialization (a case in the "
            "model's _init_weights, or reset_parameters()), build them on a real device, or "
            "load their weights with load_state_dict."
        )
