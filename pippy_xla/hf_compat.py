"""What differs between the transformers releases pippy_xla supports, in one place.

``pyproject.toml`` declares the oldest release; CI tests it and the newest beside the one it pins
(``scripts/test.sh``'s compatibility pass, the tests marked ``compat``). The private entry points
the pipeline uses that moved between them are reached through this module:

- ``create_causal_mask`` and the other mask factories: 5.24 wraps them in a deprecation decorator
  (``past_key_values`` renamed ``cache``), so the module whose globals they read is the wrapped
  function's (:func:`mask_factory_globals`), and the cache is passed under the factory's or the
  layer's own parameter name (:func:`cache_param`);
- tensor parallelism applies HF's tensor-parallel API (``transformers.distributed.parallel_utils``,
  ``apply_tensor_parallelism``, ``DistributedMixin._expand_parallel_plan``), which 5.23 introduced:
  an older release gets a one-line error (:func:`tensor_parallel_api`).
"""

from __future__ import annotations

import inspect
from types import SimpleNamespace
from typing import Any

CACHE_ARG = "past_key_values"
"""The cache's parameter name of HF's decoder layers and mask factories up to 5.23; also the name
of the pipeline's generation graphs' last placeholder."""


def mask_factory_globals(fn: Any) -> dict[str, Any]:
    """The globals of the module defining the mask factory ``fn`` (under HF's decorators)."""
    return inspect.unwrap(fn).__globals__


def cache_param(sig: inspect.Signature) -> str | None:
    """The parameter through which a layer or a mask factory takes the cache:
    ``past_key_values``, or the first one annotated as a ``Cache`` (GPT-NeoX's and Falcon's
    ``layer_past``; transformers 5.24's ``cache``, the layers' and the mask factories' new name,
    where the old one stays a deprecated alias of the factories: passing the cache under it
    beside the traced ``cache=None`` left the masks without the cache)."""
    if CACHE_ARG in sig.parameters:
        return CACHE_ARG
    for p in sig.parameters.values():
        if p.kind is not p.VAR_KEYWORD and "Cache" in str(p.annotation):
            return p.name
    return None


def tensor_parallel_api() -> SimpleNamespace:
    """HF's tensor-parallel entry points that the pipeline applies: ``expand_plan(model, plan)``
    (``*`` in a plan's keys expanded to the layer indices), ``styles`` (HF's style names),
    ``wildcard(name)`` (a name's layer index replaced by ``*``), ``apply(model, mesh, plan)`` and
    ``colwise`` (the class of HF's ``colwise`` styles, for a style HF registers no name for).
    Raises ``NotImplementedError`` (one line) on a transformers release without them."""
    try:
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
    return SimpleNamespace(
        expand_plan=expand,
        styles=ALL_PARALLEL_STYLES,
        wildcard=replace_layer_number_by_wildcard,
        apply=apply_tensor_parallelism,
        colwise=ColwiseParallel,
    )
