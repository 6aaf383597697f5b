"""What differs between the transformers releases pippy_xla supports, in one place.

``pyproject.toml`` declares the range of releases CI tests: the suite runs on its newest, the
tests marked ``compat`` on its oldest (``scripts/setup.sh``, ``scripts/test.sh``); building a
pipeline under a release outside it warns once (:func:`warn_if_untested`). The private entry
points the pipeline uses that moved between releases are reached through this module:

- ``create_causal_mask`` and the other mask factories: 5.24 wraps them in a deprecation decorator
  (``past_key_values`` renamed ``cache``), so the module whose globals they read is the wrapped
  function's (:func:`mask_factory_globals`), and the cache is passed under the factory's or the
  layer's own parameter name (:func:`cache_param`), which 5.25's decorator hides behind the
  deprecated alias it adds to the visible signature;
- tensor parallelism applies HF's tensor-parallel API (``transformers.distributed.parallel_utils``,
  ``apply_tensor_parallelism``, ``DistributedMixin._expand_parallel_plan``), which 5.23 introduced:
  an older release gets a one-line error (:func:`tensor_parallel_api`);
- MoE experts: up to 5.24 the configs' ``base_model_tp_plan`` shard them (``packed_colwise`` /
  ``rowwise`` parameters under ``moe_tp_experts``); 5.25 drops those rules from every config but
  Llama 4's and deprecates ``moe_tp_experts`` (removal announced for 5.28), pointing to expert
  parallelism instead: the configs' ``base_model_ep_plan`` (``grouped_gemm`` parameters under
  ``ep_dispatch_experts``) with ``ep_implementation="all_reduce"``, the same masking and
  all-reduce over ranks that share a batch. The pipeline applies that plan over the tp ranks
  where the tp plan leaves the experts whole (``ep_plan`` and ``apply_experts`` of
  :func:`tensor_parallel_api`; ``expert_parallel.py``, unchanged from 5.23 to 5.25);
- expert parallelism (``expert_parallel=``) applies the same plan through the same function
  with ``ep_implementation="all_to_all"`` over ranks that hold different batches
  (:func:`expert_parallel_api`); 5.17 has neither the module nor the configs' dispatch rules
  (its plans name ``ep_router`` and ``moe_tp_experts``): refused in one line there;
- checkpoint keys: HF's weight conversions (``transformers.conversion_mapping``,
  ``transformers.core_model_loading``: ``WeightRenaming`` and ``WeightConverter``, the same from
  5.17 to 5.25) rename older layouts' keys and merge the per-expert tensors that
  ``save_pretrained`` writes into the fused experts of the model (:func:`checkpoint_conversion`).
"""

from __future__ import annotations

import copy
import functools
import inspect
import warnings
from types import SimpleNamespace
from typing import Any

CACHE_ARG = "past_key_values"
"""The cache's parameter name of HF's decoder layers and mask factories up to 5.23; also the name
of the pipeline's generation graphs' last placeholder."""


def mask_factory_globals(fn: Any) -> dict[str, Any]:
    """The globals of the module defining the mask factory ``fn`` (under HF's decorators)."""
    return inspect.unwrap(fn).__globals__


def cache_param(fn: Any) -> str | None:
    """The parameter through which a layer's forward or a mask factory ``fn`` takes the cache:
    ``past_key_values``, or the first one annotated as a ``Cache`` (GPT-NeoX's and Falcon's
    ``layer_past``; transformers 5.24's ``cache``, the layers' and the mask factories' new name,
    where the old one stays a deprecated alias of the factories: passing the cache under it
    beside the traced ``cache=None`` left the masks without the cache).

    The names are those of the function's own signature, under HF's decorators: transformers
    5.25 adds the alias to the mask factories' (and a few encoder-decoder layers') visible
    signature (``deprecate_kwarg(..., expose_in_signature=True)``, ``utils/deprecation.py``),
    where it is no parameter of the function and the cache must not go."""
    params = inspect.signature(inspect.unwrap(fn)).parameters
    if CACHE_ARG in params:
        return CACHE_ARG
    for p in params.values():
        if p.kind is not p.VAR_KEYWORD and "Cache" in str(p.annotation):
            return p.name
    return None


EP_SHARED_BATCH = "all_reduce"
"""HF's expert-parallel implementation for a group of ranks that share one batch (a stage's tp
ranks): each rank runs its own experts on the whole batch, the routes to other ranks' experts
masked, and an all-reduce sums the outputs (``AllReduceEP``, ``ep_size == tp_size``)."""
EP_OWN_BATCHES = "all_to_all"
"""HF's expert-parallel implementation for a group of ranks that hold different batches (a
stage's data-parallel replicas, with their tp ranks): each (token, expert) pair is sent to the
expert's rank and its output back by two all-to-alls (``AllToAllEP``)."""


def tensor_parallel_api() -> SimpleNamespace:
    """HF's tensor-parallel entry points that the pipeline applies: ``expand_plan(model, plan)``
    (``*`` in a plan's keys expanded to the layer indices), ``styles`` (HF's style names),
    ``wildcard(name)`` (a name's layer index replaced by ``*``), ``apply(model, mesh, plan)``,
    ``colwise`` (the class of HF's ``colwise`` styles, for a style HF registers no name for),
    ``ep_plan(model)`` (the model's expert-parallel plan, ``{}`` without one) and
    ``apply_experts(model, mesh, plan, batch_mesh=None)`` (HF's expert parallelism of
    ``plan``'s expanded rules over the ranks of ``mesh``; ``batch_mesh``: the ranks among them
    that share one batch, HF's ``tp_mesh``: ``None`` when all of ``mesh`` share it,
    :data:`EP_SHARED_BATCH`, else :data:`EP_OWN_BATCHES`).
    Raises ``NotImplementedError`` (one line) on a transformers release without them."""
    try:
        from transformers.distributed.expert_parallel import apply_expert_parallelism
        from transformers.distributed.mixin import DistributedMixin
        from transformers.distributed.parallel_utils import (
            ALL_PARALLEL_STYLES,
            replace_layer_number_by_wildcard,
        )
        from transformers.distributed.tensor_parallel import (
            ColwiseParallel,
            apply_tensor_parallelism,
        )

        expand = DistributedMixin._expand_parallel_plan
    except (ImportError, AttributeError) as e:
        import transformers

        raise NotImplementedError(
            "tensor parallelism applies HF's tensor-parallel API of transformers>=5.23 "
            f"(transformers.distributed.parallel_utils); this is transformers "
            f"{transformers.__version__}: upgrade it, or use a mesh without a 'tp' dim"
        ) from e

    def apply_experts(
        model: Any, mesh: Any, plan: dict[str, str], batch_mesh: Any | None = None
    ) -> None:
        # Parameters first: HF's implementation reads the experts' local count, which sharding
        # their parameters sets, when its module rule is applied (LongCat-Flash's plan names
        # the module first).
        params = dict(model.named_parameters())
        ordered = sorted(plan.items(), key=lambda item: item[0] not in params)
        how = EP_SHARED_BATCH if batch_mesh is None else EP_OWN_BATCHES
        apply_expert_parallelism(
            model, mesh, batch_mesh or mesh, dict(ordered), ep_implementation=how
        )

    return SimpleNamespace(
        expand_plan=expand,
        styles=ALL_PARALLEL_STYLES,
        wildcard=replace_layer_number_by_wildcard,
        apply=apply_tensor_parallelism,
        colwise=ColwiseParallel,
        ep_plan=lambda model: dict(getattr(model, "ep_plan", None) or {}),
        apply_experts=apply_experts,
    )


def expert_parallel_api() -> SimpleNamespace:
    """:func:`tensor_parallel_api`'s entry points, for expert parallelism (``expert_parallel=``,
    HF's all-to-all dispatch of ``transformers.distributed.expert_parallel``). Raises
    ``NotImplementedError`` (one line) on a transformers release without it (before 5.23)."""
    try:
        return tensor_parallel_api()
    except NotImplementedError as e:
        import transformers

        raise NotImplementedError(
            "expert_parallel applies HF's expert parallelism with all-to-all dispatch of "
            "transformers>=5.23 (transformers.distributed.expert_parallel); this is transformers "
            f"{transformers.__version__}: upgrade it, or drop expert_parallel"
        ) from e


def checkpoint_conversion(model: Any) -> SimpleNamespace | None:
    """HF's conversion of a checkpoint's keys and tensors to the model's, as ``from_pretrained``
    applies it (``convert_and_load_state_dict_in_model``; the same in transformers 5.17 and 5.25):

    - ``rename(key)``: ``(name, pattern)``, the model's name of the checkpoint key ``key`` (HF's
      ``WeightRenaming``s applied, then at most one ``WeightConverter``) and, where a converter
      matched, its source pattern (else ``None``). The keys a converter merges (Mixtral's
      ``experts.3.w1.weight``) share the name of its first target (``experts.gate_up_proj``);
    - ``targets(name, pattern)``: the model's names the converter of ``pattern`` makes from the
      keys named ``name`` (several for a one-to-many converter: a fused ``qkv`` split);
    - ``convert(name, sources)``: ``{name: tensor}`` of those targets, from ``sources``
      (``{pattern: [tensor, ...]}``, each list in the checkpoint keys' order, :func:`key_order`),
      by the converter's operations (``WeightConverter.convert``).

    ``None`` for a model that is no ``PreTrainedModel`` or that HF converts nothing of."""
    try:
        from transformers import PreTrainedModel
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import (
            WeightConverter,
            WeightRenaming,
            rename_source_key,
        )
    except ImportError:  # pragma: no cover - transformers is optional for non-HF models
        return None
    if not isinstance(model, PreTrainedModel):
        return None
    mapping = get_model_conversion_mapping(model)
    renamings = [t for t in mapping if isinstance(t, WeightRenaming)]
    converters = [t for t in mapping if isinstance(t, WeightConverter)]
    if not renamings and not converters:
        return None
    by_pattern = {p: c for c in converters for p in c.source_patterns}

    def targets(name: str, pattern: str) -> list[str]:
        first, *_ = patterns = by_pattern[pattern].target_patterns
        return [name.replace(first, t) for t in patterns]

    def convert(name: str, sources: dict[str, list[Any]]) -> dict[str, Any]:
        # A fresh converter per target, as from_pretrained makes one (it collects tensors).
        converter = copy.deepcopy(by_pattern[next(iter(sources))])
        for pattern, tensors in sources.items():
            for tensor in tensors:
                converter.add_tensor(name, name, pattern, tensor)
        out = converter.convert(name, model=model, config=model.config)
        return {k: v[0] if isinstance(v, list) else v for k, v in out.items()}

    return SimpleNamespace(
        rename=lambda key: rename_source_key(key, renamings, converters),
        targets=targets,
        convert=convert,
    )


def key_order(key: str) -> Any:
    """The order in which ``from_pretrained`` collects a converter's source tensors: the keys'
    natural order (``experts.2`` before ``experts.10``; ``dot_natural_key``, 5.17 and 5.25)."""
    from transformers.core_model_loading import dot_natural_key

    return dot_natural_key(key)


def tested_releases() -> str | None:
    """The transformers releases pippy_xla is tested with: the range ``pyproject.toml`` declares
    (CI runs the suite on its newest release and the ``compat`` tests on its oldest), read from
    the installed package's metadata; ``None`` when pippy_xla runs uninstalled."""
    from importlib import metadata

    from packaging.requirements import Requirement

    try:
        requires = metadata.requires("pippy_xla") or []
    except metadata.PackageNotFoundError:
        return None
    for line in requires:
        req = Requirement(line)
        if req.name == "transformers" and req.marker is None:
            return str(req.specifier)
    return None


@functools.cache
def warn_if_untested(version: str) -> bool:
    """Warns (once per process and release) when transformers ``version`` is outside
    :func:`tested_releases`: a newer release is allowed, since most keep working, but the
    pipeline reaches into HF internals that two releases in a row changed (5.24, 5.25), so the
    user is told which releases were tested. Returns whether ``version`` is outside the range."""
    from packaging.specifiers import SpecifierSet

    spec = tested_releases()
    if spec is None or SpecifierSet(spec).contains(version, prereleases=True):
        return False
    warnings.warn(
        f"transformers {version} is not among the releases pippy_xla is tested with ({spec}): "
        "it may fail where the pipeline uses HF internals (pippy_xla/hf_compat.py); if it does, "
        f"install a tested one: pip install 'transformers{spec}'",
        UserWarning,
        stacklevel=3,
    )
    return True
