"""Pipeline x tensor parallel on a ``DeviceMesh``: each stage's decoder layers under the model's
own HF tensor-parallel plan, applied by transformers' and torch's DTensor machinery.

[Note: pipeline x tensor parallel]

A 3-D mesh ``(dp, pp, tp)`` holds, for each pipeline stage, ``tp`` ranks that run that stage
together. The pipeline's process group of a rank is the mesh's ``pp`` dimension at its own
``(dp, tp)`` coordinates, so rank ``(pp=i, tp=j)`` exchanges activations and gradients with
``(pp=i+1, tp=j)`` only: every tp rank has its own copy of each boundary tensor, no gather and
no extra hop.

- Layers: after partitioning, the rules of ``model.tp_plan`` (HF's: ``config.base_model_tp_plan``
  with the model class's own ``_tp_plan``, keys with ``*`` for the layer index) that fall inside
  this rank's decoder layers are expanded by HF (``_expand_parallel_plan``) and applied by HF
  (``apply_tensor_parallelism``): parameters become DTensors sharded over the ``tp`` dimension,
  and HF's styles (``colwise``, ``rowwise`` and their ``colwise_gather_output`` /
  ``rowwise_split_input`` variants; for experts ``packed_colwise``, ``packed_rowwise`` and
  ``moe_tp_experts``, which all-reduce the experts' partial outputs; ``embedding_colwise`` for an
  embedding inside a layer) redistribute inside each layer. pippy_xla writes no parallel layer.
  Experts on which the tp plan sets no rule (transformers 5.25 dropped them from the configs'
  plans, see ``hf_compat.py``) are sharded by the model's expert-parallel plan instead
  (:data:`_EXPERTS`): each tp rank holds ``1/tp`` of the experts, whole.
  Outside the decoder layers, the input embedding's ``embedding_rowwise`` is applied on the
  first stage where the embedding is not tied to the head and there are no replicas
  (:data:`_EMBEDDING`), and the head's ``colwise_gather_output`` on the last stage where it is
  untied, as a vocabulary-parallel head whose logits are not gathered (:data:`_VOCAB_HEAD`, see
  [Note: the vocabulary-parallel head]); the norms stay whole on every tp rank.
- Boundaries: HF's styles give plain (local) outputs, and a decoder layer's output is replicated
  over the ``tp`` group (a ``rowwise`` projection all-reduces it), so the tensors that travel
  between stages are plain tensors, equal on every tp rank. Their gradients are replicated too
  (a ``colwise`` projection all-reduces its input's gradient in backward).
- Gradients: a sharded parameter's gradient is a DTensor with the same placement (its local
  shard), but for the vocabulary-parallel embedding's, which DTensor's backward leaves whole
  and replicated: the step reshards it to the weight's rows after the last backward
  (:meth:`TensorParallel.reshard_grads`; the planner counts it whole). A parameter outside HF's
  rules (norms, a whole embedding, a whole head) sees replicated inputs and replicated output
  gradients, so every tp rank computes the same whole gradient and nothing is reduced. A
  ``replicated_with_grad_allreduce`` rule (Qwen3's per-head ``q_norm`` / ``k_norm``, which see
  only the rank's heads) marks a parameter whose gradient is partial: HF's style
  all-reduces ``param.grad`` after every accumulation, which sums the earlier microbatches again
  at each one; here it is not installed, and the step all-reduces those gradients once, after
  the last backward (:meth:`TensorParallel.reduce_partial_grads`).
  A plan can miss one: Apertus' xIELU activation has learned scalars (``act_fn.alpha_p``) between
  a ``colwise`` and a ``rowwise`` projection, unmarked, so each tp rank's gradient covers its own
  columns only (HF's own tensor parallelism trains them with that partial gradient). So every
  other parameter left whole inside the layers is checked each step, after the last backward:
  the tp ranks compare three sums of its gradient (all-reduced as a ``tp x 3k`` table, so every
  rank decides alike); a gradient that differs over ``tp`` by more than rounding is partial and
  is summed too, with a warning naming it once (:meth:`TensorParallel.reduce_partial_grads`).
- Batches: the tp ranks of a stage must be given the same step; each step they compare their
  step keys, and the pipeline's step handshake carries every rank's verdict. A pipeline group
  holds a rank of every stage, so a mismatch in any tp group fails every rank's handshake alike
  (no rank is left waiting in a collective its peers skipped).
- Start: the tp ranks' values are made equal (copied from tp rank 0) before sharding, so a model
  initialized differently per rank still trains as one model.
- Replicas: with ``dp`` > 1, each stage module is wrapped by FSDP2 over the ``dp`` dimension
  after tensor parallelism ([Note: pipeline x data parallel]); FSDP2 composes with the tp
  DTensors (``"shard"`` makes 2-D shards), and the global norm counts a tensor replicated over
  ``tp`` on tp rank 0 only (:meth:`TensorParallel.counts_in_norm`, by the DTensor's ``tp``
  placement).
- Rules: ``tensor_parallel="auto"`` takes the model's plan as it is; a dict is merged over it
  the way HF merges ``DistributedConfig(tp_plan={...})`` (:func:`merge_tp_rules`: keys like
  ``model.tp_plan``'s, an equal key overrides, a new key adds, ``"replicate"`` keeps a module
  whole, ``{}`` applies nothing), so a model without a plan can be sharded by hand too. What a
  rule cannot see is the model's code: a ``colwise`` projection must feed a module that reshapes
  by ``-1`` heads (HF's Llama-style attention, any MLP), not by ``config.num_attention_heads``.
- Plans: the planner profiles decoder layers sharded by the same functions
  (:func:`layer_tp_plan`, :func:`shard_layers`, through :class:`LayerSharding`), so a plan's
  layer costs are a tp rank's, collectives included; a plan made for another tp degree is refused
  (see [Note: planning under tensor parallelism] in ``plan/profiler.py``).
- Refused at build, on every rank alike, with one line naming the module and the numbers: a
  model without a plan (``"auto"``), a plan with no rule that shards the decoder layers, a style
  HF does not know, a dict key that names nothing in the model, changes a rule outside the
  decoder layers or replicates a module whose children keep sharding rules, a style not covered
  yet, and a rule whose sharded dimension (or the attention heads and key/value heads) does not
  divide by ``tp``.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator, Sequence

import torch
from torch import nn

from pippy_xla._native import _C
from pippy_xla.hf_compat import tensor_parallel_api
from pippy_xla.runtime.data_parallel import copy_from_first, local_tensor
from pippy_xla.runtime.expert_parallel import EXPERT_STYLES, expert_rules
from pippy_xla.split.partition import UnsupportedModelError

logger = logging.getLogger(__name__)

__all__ = [
    "TP_STYLES",
    "LayerSharding",
    "TensorParallel",
    "expand_plan",
    "layer_tp_plan",
    "merge_tp_rules",
    "shard_layers",
    "vocabulary_parallel_loss",
    "whole_tensor",
]

_COLWISE = ("colwise", "colwise_gather_output")
_ROWWISE = ("rowwise", "rowwise_split_input")
_PACKED_COLWISE = ("packed_colwise",)
_PACKED_ROWWISE = ("packed_rowwise",)
"""Experts whose fused gate and up projections are packed along their last dim (Aria's
``(experts, hidden, 2 x intermediate)``): each half sharded there, strided."""
_PARTIAL_GRAD = "replicated_with_grad_allreduce"
_INNER_EMBEDDING = ("embedding_colwise",)
"""An embedding inside the decoder layers sharded by its width (Qwen4-Exp's n-gram embeddings),
each tp rank looking up its columns, HF's style gathering them."""
_MOE = ("moe_tp_experts",)
_LOCAL = ("local_params",)
"""A module whose own parameters another rule shards (attention sinks, ``colwise``) and whose
forward then runs on their local shards."""
_OUTPUT = ("mla_kv_a_proj", "moe_identity_expert")
"""Styles that keep their module's parameters whole and act on its input or output (MLA's rotary
part of ``kv_a_proj_with_mqa``, which skips the sharded ``kv_b_proj``: its gradient summed over
tp; LongCat-Flash's identity ("zero") experts, whose input is divided by tp, which the experts'
sum over tp restores)."""
_EXPERTS = EXPERT_STYLES
"""HF's expert-parallel styles, from the model's ``ep_plan``, for experts on which the tp plan
sets no rule, at them or around them (:func:`_expert_rules`): the experts' parameters sharded by
expert (dim 0), each tp rank running its own experts on the batch the stage's tp ranks share,
the routes to the others' masked, the outputs summed over tp (HF's ``apply_expert_parallelism``
with the tp ranks as the expert group and its all-reduce implementation; the input and routing
weights' gradients summed over tp in backward). The same rules and function as expert
parallelism's over other ranks ([Note: pipeline x expert parallel])."""
_REPLICATE = "replicate"
_EMBEDDING = ("embedding_rowwise",)
"""The input embedding's styles the pipeline applies: HF's vocabulary-parallel embedding, each tp
rank holding rows of the vocabulary (its weight, gradient and optimizer state a ``1/tp`` share),
the ranks' partial lookups summed by HF's style. DTensor's backward gives the weight a whole,
replicated gradient; the step reshards it to the weight's rows
(:meth:`TensorParallel.reshard_grads`)."""
_HEAD = ("colwise_gather_output", "colwise")
"""The output head's styles in a model's plan (the model class's ``_tp_plan``, HF's
``{"lm_head": "colwise_gather_output"}``) that the pipeline applies as :data:`_VOCAB_HEAD`."""
_VOCAB_HEAD = "vocab_parallel_head"
"""The pipeline's own name, in a plan, for the vocabulary-parallel head: HF's ``ColwiseParallel``
(each tp rank holding rows of the vocabulary) with the logits left a DTensor sharded by the
vocabulary, not gathered; the model's own loss takes them under torch's ``loss_parallel`` and
everything else that reads logits gathers them (see [Note: the vocabulary-parallel head])."""
_DIFFERS = 1e-4
"""A whole parameter's gradient is partial when its tp ranks' sums differ by more than this
fraction of their magnitude (rounding differs by about 1e-7; partial sums by O(1))."""
TP_STYLES = (
    *_COLWISE,
    *_ROWWISE,
    *_PACKED_COLWISE,
    *_PACKED_ROWWISE,
    *_INNER_EMBEDDING,
    *_MOE,
    *_LOCAL,
    *_OUTPUT,
    _PARTIAL_GRAD,
)
"""The HF tensor-parallel styles a pipeline applies (those its tests cover); a plan with another
style inside the decoder layers is refused at build."""


_HEAD_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "qkv_proj", "query_key_value")
"""Projections whose output holds attention heads (fused or not, as HF's
``get_kv_heads_per_rank`` names them): sharding one needs the heads to divide by ``tp``."""


def _text_config(model: nn.Module):
    config = getattr(model, "config", None)
    if config is None:
        return None
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def layer_tp_plan(
    model: nn.Module,
    layer_names: Sequence[str],
    tp_size: int,
    rules: str | dict[str, str] = "auto",
    embedding: bool = True,
    experts: bool = True,
) -> dict[str, str]:
    """The tensor-parallel plan over the decoder layers ``layer_names`` (every layer of the model,
    so that every rank checks the same): concrete module and parameter names -> HF style.
    ``rules``: ``"auto"`` (the model's own HF plan, ``model.tp_plan``) or a dict merged over it
    as HF merges ``DistributedConfig(tp_plan={...})`` (:func:`merge_tp_rules`). Raises
    ``UnsupportedModelError`` for a model without a plan (``"auto"``) or without a rule that
    shards its layers, ``ValueError`` for a bad rule or a size that does not divide by
    ``tp_size``, ``NotImplementedError`` for a style not covered yet; each in one line naming
    the module and the numbers. With the plan's rule of the head too, where it shards it by the
    vocabulary (:func:`_head_rules`), and with ``embedding`` the input embedding's
    (:func:`_embedding_rules`). Without ``experts`` (expert parallelism shards them over other
    ranks, [Note: pipeline x expert parallel]) the experts modules of the model's expert plan
    get no rule, as HF drops tp rules on the modules its ep plan covers."""
    name = type(model).__name__
    label = _label(rules)
    plan = _model_or_merged_plan(model, layer_names, rules, label)
    prefixes = tuple(f"{n}." for n in layer_names)
    expanded = expand_plan(model, plan)
    inside = {
        k: v
        for k, v in expanded.items()
        if k.startswith(prefixes) and v != _REPLICATE  # HF's "replicate" does nothing
    }
    if experts:
        # Experts the tp plan leaves whole, by the model's expert-parallel plan (an empty plan, a
        # dict of rules {}, applies nothing).
        experts = _expert_rules(model, plan, prefixes, label) if plan else {}
    else:
        roots = [k for k, v in expert_rules(model, prefixes).items() if v == EXPERT_STYLES[1]]
        inside = {k: v for k, v in inside.items() if not _under(k, roots)}
        experts = {}
    if not inside and not experts:
        raise UnsupportedModelError(
            f"{label}: {name}'s tp plan {plan} has no rule that shards its decoder layers "
            f"({layer_names[0]}, ...); nothing to shard over tp={tp_size}"
        )
    odd = sorted({v for v in inside.values() if v not in TP_STYLES})
    if odd:
        where = next(k for k, v in inside.items() if v == odd[0])
        raise NotImplementedError(
            f"{label}: {name}'s tp plan uses style(s) {odd} (e.g. {where}), which the pipeline "
            f"does not apply yet (issue 48); covered: {list(TP_STYLES)} and {_REPLICATE!r}"
        )
    inside |= experts
    _check_divides(model, inside, tp_size, label)
    return {
        **inside,
        **(_embedding_rules(model, expanded) if embedding else {}),
        **_head_rules(model, expanded, tp_size),
    }


def _under(key: str, roots: Sequence[str]) -> bool:
    """Whether ``key`` names one of the modules ``roots`` or something inside one."""
    return any(key == r or key.startswith(f"{r}.") for r in roots)


def _model_or_merged_plan(
    model: nn.Module, layer_names: Sequence[str], rules: str | dict[str, str], label: str
) -> dict[str, str]:
    """The model's own tp plan (``rules="auto"``; refused in one line without one) or ``rules``
    merged over it (:func:`merge_tp_rules`)."""
    if rules != "auto":
        return merge_tp_rules(model, rules, layer_names)
    plan = dict(getattr(model, "tp_plan", None) or {})
    if not plan:
        layers = layer_names[0].rpartition(".")[0]
        raise UnsupportedModelError(
            f"{label}: {type(model).__name__} has no HF tensor-parallel plan "
            "(config.base_model_tp_plan is empty); pass HF rules, "
            f"tensor_parallel={{'{layers}.*.<module>': 'colwise', ...}}, or use a mesh without "
            "a 'tp' dim (or of size 1)"
        )
    return plan


def _expert_rules(
    model: nn.Module, plan: dict[str, str], prefixes: tuple[str, ...], label: str
) -> dict[str, str]:
    """The model's expert-parallel rules (:data:`_EXPERTS`, expanded) inside the decoder layers
    (``prefixes``) of the experts modules (``ep_dispatch_experts``) on which the tp ``plan``
    (keys with ``*``) sets no rule: none at the module, under it or above it. Raises
    ``NotImplementedError`` for another style among them that is not a partial gradient's."""
    rules = expert_rules(model, prefixes, skip=list(plan))
    odd = sorted({v for v in rules.values() if v not in (*_EXPERTS, _PARTIAL_GRAD)})
    if odd:
        raise NotImplementedError(
            f"{label}: {type(model).__name__}'s expert-parallel plan, which shards the experts "
            f"its tp plan leaves whole, uses style(s) {odd}, which the pipeline does not apply "
            f"yet (issue 48); covered: {list(_EXPERTS)} and {_PARTIAL_GRAD!r}"
        )
    return rules


def _vocabulary_modules(model: nn.Module) -> tuple[tuple[str, nn.Module] | None, ...]:
    """``(name, module)`` of the model's input embedding and of its output head
    (``get_input_embeddings()``, ``get_output_embeddings()``), each ``None`` where it has none
    or the head shares the embedding's weight (tied: both stay whole, on the first stage and on
    the last)."""
    found = []
    for getter in ("get_input_embeddings", "get_output_embeddings"):
        get = getattr(model, getter, None)
        module = get() if callable(get) else None
        name = next((n for n, m in model.named_modules() if m is module), None)
        found.append((name, module) if name is not None else None)
    embedding, head = found
    weights = [getattr(m, "weight", None) for _, m in filter(None, found)]
    tied = len(weights) == 2 and weights[0] is weights[1] and weights[0] is not None
    return (None, None) if tied else (embedding, head)


def _embedding_rules(model: nn.Module, expanded: dict[str, str]) -> dict[str, str]:
    """The plan's rules of the model's untied input embedding (:func:`_vocabulary_modules`)
    where it is an ``nn.Embedding`` with a style of :data:`_EMBEDDING`; else none."""
    embedding = _vocabulary_modules(model)[0]
    if embedding is None or not isinstance(embedding[1], nn.Embedding):
        return {}
    name = embedding[0]
    if expanded.get(name) not in _EMBEDDING:
        return {}
    return {k: v for k, v in expanded.items() if k == name or k.startswith(f"{name}.")}


def _head_rules(model: nn.Module, expanded: dict[str, str], tp_size: int) -> dict[str, str]:
    """``{head: _VOCAB_HEAD}`` where the plan gives the model's untied output head
    (:func:`_vocabulary_modules`, an ``nn.Linear``) a style of :data:`_HEAD` and the vocabulary
    divides by ``tp_size``; else none (the head stays whole on every tp rank)."""
    head = _vocabulary_modules(model)[1]
    if head is None or not isinstance(head[1], nn.Linear) or expanded.get(head[0]) not in _HEAD:
        return {}
    return {} if head[1].out_features % tp_size else {head[0]: _VOCAB_HEAD}


"""[Note: the vocabulary-parallel head]

Where the model's plan shards the head by the vocabulary (``lm_head: colwise_gather_output``),
the last stage's tp ranks each hold ``1/tp`` of its rows (weight, gradient, optimizer state),
through HF's own ``ColwiseParallel`` with its output left a DTensor sharded on the vocabulary
dim (:data:`_VOCAB_HEAD`): the logits are never gathered for the loss. Whatever the model's
forward does to them between the head and its loss (Gemma 2's soft-capping, a scale) runs on
that DTensor with DTensor's own rules, so an op across the vocabulary would be computed right
(gathering), not on a shard. The model's own loss (HF's ``loss_function``: a cross entropy of
the shifted labels) takes the sharded logits under torch's ``loss_parallel``
(:func:`vocabulary_parallel_loss`), which computes the log-softmax and the picked log-probability
over the shards with two all-reduces of a row's max and sum, in forward and in backward: the
step runs its engine inside it, so both are. Everything else that reads logits gets them whole
(:func:`whole_tensor`, one all-gather): a loss of the user's own (``loss_fn``), ``run_eval``'s
logits and ``generate``'s last position. The profiler shards the head the same way and runs its
model under the same context (:meth:`LayerSharding.loss_context`), so a plan counts a tp rank's
share of the logits. A tied head and a vocabulary that does not divide by ``tp`` stay whole. With
replicas (``dp`` > 1) FSDP2 shards the head's tp shards again, as it does the layers' (the
embedding stays whole there: see :data:`_EMBEDDING`).
"""


def whole_tensor(t: torch.Tensor) -> torch.Tensor:
    """``t`` whole: a DTensor gathered (the vocabulary-parallel head's logits, see [Note: the
    vocabulary-parallel head]), else ``t`` itself."""
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t


@contextlib.contextmanager
def vocabulary_parallel_loss() -> Iterator[None]:
    """torch's ``loss_parallel`` while inside: a cross entropy of logits sharded by the
    vocabulary, and its backward, computed over the shards. torch's context manager leaves its
    op handlers installed when its block raises; this one removes them either way."""
    from torch.distributed.tensor.parallel import loss_parallel

    context = loss_parallel()
    context.__enter__()
    try:
        yield
    finally:
        context.__exit__(None, None, None)


def _label(rules: str | dict[str, str]) -> str:
    """How errors name the ``tensor_parallel`` argument."""
    return f"tensor_parallel={rules!r}" if isinstance(rules, str) else "tensor_parallel={...}"


def expand_plan(model: nn.Module, plan: dict[str, str]) -> dict[str, str]:
    """HF's ``_expand_parallel_plan``: ``plan``'s keys with ``*`` replaced by the layer indices,
    one entry per module and per parameter (HF's method reads only ``named_modules``, so it
    serves a module that is not a ``PreTrainedModel`` too)."""
    return tensor_parallel_api().expand_plan(model, plan)


def merge_tp_rules(
    model: nn.Module, rules: dict[str, str], layer_names: Sequence[str]
) -> dict[str, str]:
    """The model's own plan with ``rules`` merged over it, with HF's semantics
    (``DistributedConfig(tp_plan=rules)``, ``_resolve_parallel_plans``): keys name modules or
    parameters relative to the model passed, as ``model.tp_plan``'s do, or to its base model, as
    ``config.base_model_tp_plan``'s do (:func:`_relative_to_model`), with ``*`` for a layer
    index; a key of the model's plan is overridden, a new key adds a rule, ``"replicate"`` keeps
    a module whole (HF's way to drop a rule), and an empty dict applies no rule. Raises
    ``ValueError`` (one line, naming the rule) for a style HF does not know, a key that names
    nothing in the model, and a rule outside the decoder layers that changes the model's own
    other than to ``"replicate"`` (see [Note: pipeline x tensor parallel])."""
    hf = tensor_parallel_api()
    name = type(model).__name__
    own = dict(getattr(model, "tp_plan", None) or {})
    names = {hf.wildcard(n) for n, _ in [*model.named_modules(), *model.named_parameters()]}
    prefixes = tuple(f"{n}." for n in layer_names)
    rules = _relative_to_model(model, rules, names | set(own))
    for key, style in rules.items():
        if not isinstance(style, str) or style not in hf.styles:
            raise ValueError(
                f"tensor_parallel={{...}}: rule {key!r}: {style!r} is not an HF tensor-parallel "
                f"style; HF's: {list(hf.styles)} ('replicate' keeps a module whole)"
            )
        if key not in names and key not in own:
            raise ValueError(
                f"tensor_parallel={{...}}: key {key!r} names no module or parameter of {name} "
                "or of its base model; keys are relative to the model passed (like "
                "model.tp_plan's) or to its base model (like config.base_model_tp_plan's), with "
                f"* for the layer index (e.g. '{layer_names[0].rpartition('.')[0]}.*...')"
            )
        outside = not any(k.startswith(prefixes) for k in expand_plan(model, {key: style}))
        if outside and style not in (own.get(key), _REPLICATE):
            raise ValueError(
                f"tensor_parallel={{...}}: rule {key!r}: {style!r} is outside the decoder layers "
                f"({layer_names[0]}, ...); the pipeline applies rules inside them and the model's "
                "own embedding and head rules only ('replicate' keeps them whole; norms stay "
                "whole on every tp rank): drop the rule"
            )
    merged = own | rules if rules else {}
    _check_replicate_covers(rules, merged)
    return merged


def _check_replicate_covers(rules: dict[str, str], merged: dict[str, str]) -> None:
    """A ``"replicate"`` rule of ``rules`` whose module's children keep sharding rules: HF's rules
    name modules one by one, so it would keep nothing whole; refused (``ValueError``) rather
    than run differently from what it says."""
    for key, style in rules.items():
        inner = [k for k, v in merged.items() if k.startswith(f"{key}.") and v != _REPLICATE]
        if style == _REPLICATE and inner:
            raise ValueError(
                f"tensor_parallel={{...}}: rule {key!r}: 'replicate' does not cover the rules of "
                f"its children ({inner[0]!r}: {merged[inner[0]]!r}, ...): HF's rules name modules "
                "one by one; set 'replicate' on each of them"
            )


def _relative_to_model(model: nn.Module, rules: dict[str, str], names: set[str]) -> dict:
    """``rules`` with keys written relative to the base model (``config.base_model_tp_plan``'s
    way: ``layers.*.mlp.up_proj``) prefixed with its name in the model passed
    (``model.layers.*.mlp.up_proj``, ``model.tp_plan``'s way); keys that name something as
    written stay as they are."""
    prefix = getattr(model, "base_model_prefix", "")
    if not prefix or not hasattr(model, prefix):
        return dict(rules)
    return {
        (f"{prefix}.{k}" if k not in names and f"{prefix}.{k}" in names else k): v
        for k, v in rules.items()
    }


def _sharded_dim(style: str, param: torch.Tensor) -> tuple[int, int] | None:
    """The dimension HF's ``style`` shards ``param`` on and the factor its size must divide by
    (besides ``tp``: a packed projection splits each of its halves), or ``None`` when the
    style keeps ``param`` whole."""
    if style in _COLWISE:
        return (param.ndim - 2 if param.ndim > 1 else -1), 1
    if style in _ROWWISE:
        return (-1, 1) if param.ndim > 1 else None  # a rowwise bias is replicated
    if style in _PACKED_COLWISE:
        return (param.ndim - 2, 2) if param.ndim > 1 else (-1, 1)
    if style in _PACKED_ROWWISE:
        return (-1, 2) if param.ndim > 1 else None  # HF replicates a packed 1-D parameter
    if style in _INNER_EMBEDDING:
        return (1, 1) if param.ndim > 1 else None
    if style in _EXPERTS:
        return 0, 1  # by expert
    return None


def _check_divides(model: nn.Module, plan: dict[str, str], tp_size: int, label: str) -> None:
    """Every sharded dimension, and the attention heads when a projection is sharded, divide by
    ``tp_size``."""
    config = _text_config(model)
    if config is not None and any(k.endswith(_HEAD_PROJECTIONS) for k in plan):
        for field in ("num_attention_heads", "num_key_value_heads"):
            heads = getattr(config, field, None)
            if isinstance(heads, int) and heads % tp_size:
                raise ValueError(
                    f"{label}: {type(config).__name__}.{field}={heads} does not "
                    f"divide by tp={tp_size}; choose a tp size that divides it"
                )
    modules = dict(model.named_modules())
    params = dict(model.named_parameters())
    for key, style in plan.items():
        module = modules.get(key)
        if module is not None:
            if style in (*_COLWISE, *_ROWWISE) and not isinstance(module, nn.Linear):
                raise NotImplementedError(
                    f"{label}: {key} is a {type(module).__name__} under style "
                    f"{style!r}; the pipeline applies {style!r} to nn.Linear only yet (issue 48)"
                )
            continue
        param = params.get(key)
        where = _sharded_dim(style, param) if param is not None else None
        if where is None:
            continue
        dim, factor = where
        size = param.shape[dim]
        if size % (tp_size * factor):
            by = f"tp={tp_size}" if factor == 1 else f"{factor} x tp={tp_size}"
            raise ValueError(
                f"{label}: {key} ({style}) has size {size} in dim "
                f"{dim % param.ndim}, which does not divide by {by}; choose a tp size that "
                "divides it"
            )


class TensorParallel:
    """This rank's decoder layers sharded over the mesh's ``tp`` dimension, and the gradient
    reductions that go with them. See [Note: pipeline x tensor parallel]."""

    def __init__(
        self,
        groups,
        model: nn.Module,
        plan: dict[str, str],
        local_layer_names: Sequence[str],
        modules: Sequence[nn.Module],
        timeout_ms: int,
        device: torch.device,
        build_key: int,
        apart: Sequence[str] = (),
    ) -> None:
        """``groups``: the rank's :class:`~pippy_xla.runtime.data_parallel.MeshGroups`;
        ``plan``: :func:`layer_tp_plan`'s; ``modules``: the local stage modules (their values are
        copied from tp rank 0 before sharding); ``build_key``: the digest of this rank's
        pipeline, which the tp ranks must agree on before any tensor is exchanged; ``apart``:
        modules another dimension shards after this (experts under expert parallelism), whose
        parameters are not checked for partial gradients over ``tp``."""
        self.mesh = groups.tp_mesh
        self._dim = self.mesh.mesh_dim_names[0]
        self.rank: int = groups.tp_rank
        self.size: int = groups.tp_size
        self._group_name = groups.tp_group.group_name
        self._timeout_ms = timeout_ms
        self._device = str(device)
        if not self.agree(build_key, f"[tp {self.rank}] tensor-parallel build handshake"):
            raise RuntimeError(
                f"[tp {self.rank}] the ranks on the mesh's tensor-parallel dimension built "
                "different pipelines (model, layer ranges, schedule, microbatches, inputs or "
                "tensor-parallel rules differ); every rank must wrap the same model with the "
                "same arguments"
            )
        for module in modules:
            self._sync_from_first(module)
        self._partial_modules: list[nn.Module] = shard_layers(
            model, self.mesh, plan, local_layer_names, modules
        )
        """Modules whose (replicated) parameters get partial gradients over ``tp``, summed
        after a step's last backward; their parameters are looked up at each step (data
        parallelism replaces them with its own after this)."""
        named = dict(model.named_modules())
        held = {id(m) for module in modules for m in module.modules()}
        self._vocab_parallel = [
            named[k] for k, v in plan.items() if v in _EMBEDDING and id(named.get(k)) in held
        ]
        """The local vocabulary-parallel embedding (or none), whose gradient
        :meth:`reshard_grads` places."""
        self.sharded_head: bool = any(
            v == _VOCAB_HEAD and id(named.get(k)) in held for k, v in plan.items()
        )
        """Whether this rank holds the vocabulary-parallel head (see [Note: the
        vocabulary-parallel head]): its steps run under :func:`vocabulary_parallel_loss`."""
        others = [named[k] for k in apart if k in named]
        self._whole = _whole_params(model, local_layer_names, [*self._partial_modules, *others])
        """``(module, name)`` of the other parameters left whole inside this rank's layers,
        checked for partial gradients each step (:meth:`reduce_partial_grads`)."""
        self._warned: set[tuple[int, str]] = set()

    def _sync_from_first(self, module: nn.Module) -> None:
        copy_from_first(module, self._group_name, self._timeout_ms)

    def from_first(self, tensor: torch.Tensor, what: str) -> torch.Tensor:
        """Tp rank 0's ``tensor`` (a broadcast over the tp ranks)."""
        return _C.broadcast_copy(tensor, 0, self._group_name, self._timeout_ms, what)

    @property
    def partial(self) -> list[nn.Parameter]:
        """The parameters of the partial-gradient modules, now."""
        return [p for m in self._partial_modules for p in m.parameters()]

    def _checked(self) -> list[nn.Parameter]:
        """The partial-gradient parameters, then the whole ones checked each step, now."""
        return [*self.partial, *(getattr(m, n) for m, n in self._whole)]

    def set_aside_partial(self) -> list[torch.Tensor | None]:
        """The gradients from before the step of the parameters :meth:`reduce_partial_grads`
        sums (taken off them, so the step's own are reduced alone)."""
        params = self._checked()
        earlier = [p.grad for p in params]
        for p in params:
            p.grad = None
        return earlier

    def reduce_partial_grads(self, earlier: Sequence[torch.Tensor | None]) -> None:
        """Sums over ``tp`` the step's gradients of the partial-gradient parameters and of the
        whole parameters whose gradients differ over ``tp`` (one all-reduce each, of the local
        shard where data parallelism shards them), and adds back ``earlier``."""
        params = self._checked()
        marked = len(params) - len(self._whole)
        differ = self._differing(params[marked:])
        for i, (p, before) in enumerate(zip(params, earlier, strict=True)):
            if p.grad is not None and (i < marked or differ[i - marked]):
                local = local_tensor(p.grad)
                summed = self.all_reduce_sum(local, "tensor-parallel partial gradient sum")
                local.copy_(summed)
            if before is not None:
                p.grad = before if p.grad is None else before.add_(p.grad)
        self.reshard_grads()

    def reshard_grads(self) -> None:
        """Gives the vocabulary-parallel embedding's gradient, which the backward leaves whole
        and replicated, the weight's own placement (each tp rank keeps its rows, no
        communication)."""
        from torch.distributed.tensor import DTensor

        for module in self._vocab_parallel:
            for p in module.parameters():
                g = p.grad
                if (
                    isinstance(p, DTensor)
                    and isinstance(g, DTensor)
                    and g.placements != p.placements
                ):
                    p.grad = g.redistribute(p.device_mesh, p.placements)

    def _differing(self, params: Sequence[nn.Parameter]) -> list[bool]:
        """Whether each parameter's gradient differs over ``tp`` (a partial gradient): three
        sums per gradient (plain, weighted by a fixed +-1 pattern, absolute) of every tp rank,
        gathered by one all-reduce of a ``tp x 3k`` table, so that every rank decides alike."""
        if not params:
            return []
        table = torch.zeros(self.size, len(params), 3, dtype=torch.float64, device=self._device)
        for i, p in enumerate(params):  # on the gradients' device: one copy to the host below
            if p.grad is not None:
                g = local_tensor(p.grad).detach().flatten().double()
                alternating = g[::2].sum() - g[1::2].sum()
                table[self.rank, i] = torch.stack([g.sum(), alternating, g.abs().sum()])
        table = self.all_reduce_sum(table, "tensor-parallel gradient check").cpu()
        spread = (table[:, :, :2] - table[:1, :, :2]).abs().amax(dim=(0, 2))
        differ = (spread > _DIFFERS * table[:, :, 2].amax(dim=0)).tolist()
        for (module, name), d in zip(self._whole, differ, strict=True):
            if d and (id(module), name) not in self._warned:
                self._warned.add((id(module), name))
                logger.warning(
                    "[tp %d] %s.%s: its gradient differs over tp (the plan leaves it whole but "
                    "it sees sharded activations): summed over tp each step; HF's own tensor "
                    "parallelism would train it with a partial gradient",
                    self.rank,
                    type(module).__name__,
                    name,
                )
        return differ

    def all_reduce_sum(self, tensor: torch.Tensor, what: str) -> torch.Tensor:
        return _C.all_reduce_sum_copy(tensor, self._group_name, self._timeout_ms, what)

    def agree(self, key: int, what: str) -> bool:
        """Whether every tp rank passed the same 64-bit ``key``."""
        everyone = _C.all_gather_int64(
            [key], self._group_name, self._device, self._timeout_ms, what
        )
        return all(k == [key] for k in everyone)

    def counts_in_norm(self, p: torch.Tensor) -> bool:
        """Whether this rank counts ``p``'s gradient in the global norm: a shard of a DTensor
        sharded over ``tp`` on every tp rank, a tensor replicated over ``tp`` (plain, or a
        DTensor of data parallelism only) on tp rank 0 only."""
        from torch.distributed.tensor import DTensor

        if isinstance(p, DTensor):
            names = p.device_mesh.mesh_dim_names or ()
            if self._dim in names and not p.placements[names.index(self._dim)].is_replicate():
                return True
        return self.rank == 0


def _whole_params(
    model: nn.Module, layer_names: Sequence[str], partial: Sequence[nn.Module]
) -> list[tuple[nn.Module, str]]:
    """``(module, name)`` of the trainable parameters inside the decoder layers ``layer_names``
    that no rule sharded (plain tensors) and that are not in the ``partial`` modules (nor
    under them)."""
    from torch.distributed.tensor import DTensor

    named = dict(model.named_modules())
    skip = {id(m) for p in partial for m in p.modules()}
    return [
        (module, name)
        for layer in layer_names
        for module in named[layer].modules()
        if id(module) not in skip
        for name, p in module.named_parameters(recurse=False)
        if p.requires_grad and not isinstance(p, DTensor)
    ]


def shard_layers(
    model: nn.Module,
    tp_mesh,
    plan: dict[str, str],
    layer_names: Sequence[str],
    held: Sequence[nn.Module] | None = None,
) -> list[nn.Module]:
    """Applies the rules of ``plan`` (:func:`layer_tp_plan`'s) that fall inside the decoder
    layers ``layer_names``, and its rules outside them (the embedding's) whose module is among
    the modules ``held`` (all with ``None``), to ``model`` over the 1-D ``tp_mesh``, by HF's
    ``apply_tensor_parallelism``, and its expert-parallel rules (:data:`_EXPERTS`) by HF's
    ``apply_expert_parallelism`` over the same ranks. The ``replicated_with_grad_allreduce``
    rules are not installed (see [Note: pipeline x tensor parallel]): returns their modules,
    whose gradients the caller sums."""
    prefixes = tuple(f"{n}." for n in layer_names)
    named = dict(model.named_modules())
    mine_ids = None if held is None else {id(m) for h in held for m in h.modules()}

    def applies(key: str) -> bool:
        if key.startswith(prefixes) or mine_ids is None:
            return True
        module = named.get(key) or named.get(key.rpartition(".")[0])
        return module is not None and id(module) in mine_ids

    mine = {k: v for k, v in plan.items() if applies(k)}
    partial = [named[k] for k, v in mine.items() if v == _PARTIAL_GRAD and k in named]
    hf = tensor_parallel_api()
    own = (_PARTIAL_GRAD, _VOCAB_HEAD, *_EXPERTS)  # not HF's tensor parallelism's to apply
    hf.apply(model, tp_mesh, {k: v for k, v in mine.items() if v not in own})
    experts = {k: v for k, v in mine.items() if v in _EXPERTS}
    if experts:
        hf.apply_experts(model, tp_mesh, experts)
    for key in (k for k, v in mine.items() if v == _VOCAB_HEAD):
        _vocabulary_parallel_head(hf, named[key], tp_mesh)
    return partial


def _vocabulary_parallel_head(hf, head: nn.Linear, tp_mesh) -> None:
    """HF's ``ColwiseParallel`` applied to ``head`` as HF's ``apply_tensor_parallelism`` applies
    a style, its output a DTensor sharded by the vocabulary (see [Note: the
    vocabulary-parallel head])."""
    from torch.distributed.tensor import Replicate, Shard

    style = hf.colwise(input_layouts=Replicate(), output_layouts=Shard(-1), use_local_output=False)
    for name, _ in list(head.named_parameters(recurse=False)):
        style.shard_param(head, name, tp_mesh)
    style.install_forward(head, tp_mesh)
    head._is_hooked = True


class LayerSharding:
    """The planner's view of a ``(dp, pp, tp)`` mesh: the profiler measures decoder layers
    sharded as a tensor-parallel pipeline shards them, on the ``tp`` ranks of the first pipeline
    position of the first replica, and the first rank's plan is every rank's. See [Note:
    planning under tensor parallelism] in :mod:`pippy_xla.plan.profiler`."""

    def __init__(
        self,
        mesh,
        *,
        dp_dim: str | tuple[str, str] = "dp",
        pp_dim: str = "pp",
        tp_dim: str = "tp",
        timeout: float = _C.DEFAULT_TIMEOUT_MS / 1000,
        rules: str | dict[str, str] = "auto",
    ) -> None:
        """``mesh``: the ``DeviceMesh`` the pipeline will be built on (its dims named as
        ``PipelineConfig``'s ``dp_dim``, ``pp_dim`` and ``tp_dim``); ``timeout``: seconds a
        broadcast of the profiled layers' values may take; ``rules``: the pipeline's
        ``tensor_parallel`` (``"auto"`` or a dict of HF rules), so that the profiled layers are
        sharded as the pipeline's will be."""
        import torch.distributed as dist

        from pippy_xla.runtime.data_parallel import mesh_groups

        groups = mesh_groups(mesh, pp_dim, dp_dim, None, tp_dim)
        if groups.tp_mesh is None:
            raise ValueError(f"LayerSharding needs a mesh with a {tp_dim!r} dim; got {mesh}")
        self._mesh = groups.tp_mesh
        self._group = groups.tp_group
        self._group_name = groups.tp_group.group_name
        self._timeout_ms = int(timeout * 1000)
        self._rules = rules
        self._embedding = groups.dp_size == 1  # as the build's (see _EMBEDDING)
        self._sharded_head = False
        self.size: int = groups.tp_size
        """The tensor-parallel degree."""
        self.rank: int = groups.tp_rank
        self.profiles: bool = groups.dp_rank == 0 and dist.get_rank(groups.pp_group) == 0
        """Whether this rank profiles (the tp ranks of the first stage of the first replica)."""
        self.first_rank: int = int(mesh.mesh.flatten()[0])
        """The job rank whose plan every rank takes."""

    def shard(self, model: nn.Module, layer_names: Sequence[str]) -> None:
        """Shards ``model``'s decoder layers ``layer_names`` in place over the ``tp`` ranks, as
        the pipeline's build does (their values tp rank 0's; layers on ``meta`` stay there); a
        collective over the ``tp`` ranks."""
        plan = layer_tp_plan(model, layer_names, self.size, self._rules, self._embedding)
        copy_from_first(model, self._group_name, self._timeout_ms)
        shard_layers(model, self._mesh, plan, layer_names)
        self._sharded_head = _VOCAB_HEAD in plan.values()

    def loss_context(self) -> contextlib.AbstractContextManager:
        """The context the sharded model's steps run in: :func:`vocabulary_parallel_loss` where
        :meth:`shard` sharded the head, as the pipeline's steps run."""
        return vocabulary_parallel_loss() if self._sharded_head else contextlib.nullcontext()

    def gather(self, value: object) -> list:
        """``value`` of every ``tp`` rank of this rank's stage, in tp-rank order."""
        import torch.distributed as dist

        out: list = [None] * self.size
        dist.all_gather_object(out, value, group=self._group)
        return out
