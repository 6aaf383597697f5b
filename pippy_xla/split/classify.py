"""Classifying the nodes of a trace: which stage computes each node (its home), which prologue
nodes every stage recomputes (see [Note: replicated prologue]), and which values cross each
boundary between stages. One :class:`NodeClass` record per live node."""

from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import Any

import torch
from torch import fx, nn

from pippy_xla.split import hf
from pippy_xla.split.trace import ROOT_PREFIX, SELF_META

__all__ = [
    "Classified",
    "NodeClass",
    "classify",
    "fetch",
    "index_limits",
    "is_parameter",
    "keeps_self_meta",
    "layer_target",
    "mark_batch_terms",
    "producers",
]


_META_ATTRS = ("shape", "dtype", "device", "ndim", "is_cuda", "layout")
_META_METHODS = ("size", "dim", "get_device")


def keeps_self_meta(node: fx.Node) -> bool:
    """Whether ``node``'s shape, dtype and device are its first argument's (marked by the tracer:
    see :data:`pippy_xla.split.trace.SELF_META_METHODS`)."""
    return bool(node.meta.get(SELF_META, False))


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


@dataclass(slots=True)
class NodeClass:
    """What the partitioner knows of one live node of the trace."""

    home: int | None
    """The one stage that computes the node; ``None`` for placeholders, ``get_attr`` references
    and replicable prologue nodes, which every stage that needs them computes or holds."""
    depth: int = 0
    """The stage of the highest-index layer upstream of the node (the layer's own stage for a
    layer call); -1 in the prologue (no layer upstream). 0 for the output node."""
    reads_params: bool = False
    """The node's value depends on parameter data (prologue nodes only)."""
    replicable: bool = False
    """A prologue node whose value every stage can recompute from its batch inputs."""
    metarep: bool = False
    """A prologue node whose shape, dtype and device can be recomputed without parameters."""


@dataclass(slots=True)
class Classified:
    """A trace classified for a stage layout: the record of every live node, in trace order, and
    the values that cross each boundary."""

    root: nn.Module
    """The traced root (the model is its ``model`` child)."""
    nodes: dict[fx.Node, NodeClass]
    """One record per node the output depends on, in trace order (the output node last)."""
    boundaries: list[list[fx.Node]]
    """``boundaries[s]``: the values sent from stage ``s`` to stage ``s + 1``, in trace order."""
    layer_index: dict[str, int]
    """The module path of each decoder layer (under the root) -> its index."""

    @property
    def num_stages(self) -> int:
        return len(self.boundaries) + 1


def classify(
    root: nn.Module, graph: fx.Graph, layer_names: list[str], layer_ranges: list[tuple[int, int]]
) -> Classified:
    """The trace ``graph`` of ``root`` classified for ``layer_ranges`` (see [Note: replicated
    prologue] and [Note: stage boundary values])."""
    layer_index = {ROOT_PREFIX + n: i for i, n in enumerate(layer_names)}
    stage_of_layer = [s for s, (a, b) in enumerate(layer_ranges) for _ in range(a, b)]
    live = _live_nodes(graph)
    _check_layer_calls(live, layer_index, layer_names)
    nodes: dict[fx.Node, NodeClass] = {}
    for n in live:
        nodes[n] = _classify_node(root, n, nodes, layer_index, stage_of_layer, len(layer_ranges))
    _move_values_of_parameters(nodes)
    boundaries = _boundaries(nodes, len(layer_ranges))
    _check_boundaries(root, nodes, boundaries)
    return Classified(root=root, nodes=nodes, boundaries=boundaries, layer_index=layer_index)


def _live_nodes(graph: fx.Graph) -> list[fx.Node]:
    """The nodes the output or a check (see [Note: checks on traced values]) depends on, in
    trace order."""
    nodes = list(graph.nodes)
    live: dict[fx.Node, None] = {nodes[-1]: None}
    for n in reversed(nodes):
        if n in live or hf.is_traced_check(n):
            live[n] = None
            for p, _ in producers(n):
                live[p] = None
    return [n for n in nodes if n in live]


def _check_layer_calls(live: list[fx.Node], layer_index: dict[str, int], names: list[str]) -> None:
    called = [layer_index[layer_target(n)] for n in live if layer_target(n) in layer_index]
    if called != list(range(len(names))):
        raise ValueError(
            f"decoder layers must each be called once in registration order; the trace calls "
            f"layers {called} of {names}"
        )


def _classify_node(
    root: nn.Module,
    n: fx.Node,
    nodes: dict[fx.Node, NodeClass],
    layer_index: dict[str, int],
    stage_of_layer: list[int],
    num_stages: int,
) -> NodeClass:
    """``n``'s record, given the records of the nodes before it. See [Note: replicated
    prologue]."""
    if n.op == "output":
        return NodeClass(home=num_stages - 1)
    prods = producers(n)
    if layer_target(n) in layer_index:
        depth = stage_of_layer[layer_index[layer_target(n)]]
    else:
        depth = max((nodes[p].depth for p, _ in prods), default=-1)
    if depth >= 0:
        return NodeClass(home=depth, depth=depth)
    mod = root.get_submodule(n.target) if n.op == "call_module" else None
    own_params = _own_params(root, n, mod, prods)
    reads_params = own_params or any(nodes[p].reads_params for p, meta in prods if not meta)
    if isinstance(mod, nn.Embedding):
        metarep = (
            len(n.args) == 1
            and not n.kwargs
            and isinstance(n.args[0], fx.Node)
            and nodes[n.args[0]].replicable
        )
    elif n.op == "get_attr":
        metarep = True  # a stand-in has its shape, dtype and device
    elif keeps_self_meta(n):
        first = nodes[n.args[0]]
        metarep = first.replicable or first.metarep
    else:
        metarep = not own_params and all(nodes[p].replicable or nodes[p].metarep for p, _ in prods)
    replicable = not reads_params and all(
        nodes[p].replicable or (meta and nodes[p].metarep) for p, meta in prods
    )
    # A get_attr is a reference, not a computation: every stage using it holds its own. A check
    # is used by nothing: stage 0 runs it (see [Note: checks on traced values]).
    home = None if (replicable and not hf.is_traced_check(n)) or n.op == "get_attr" else 0
    return NodeClass(
        home=home, depth=-1, reads_params=reads_params, replicable=replicable, metarep=metarep
    )


def _boundaries(nodes: dict[fx.Node, NodeClass], num_stages: int) -> list[list[fx.Node]]:
    """A value crosses ``s -> s+1`` when computed on a stage ``<= s`` and used on one ``> s``."""
    last_use: dict[fx.Node, int] = {}
    for n, c in nodes.items():
        if c.home is None:
            continue
        for p, _ in producers(n):
            home = nodes[p].home
            if home is not None and c.home > home:
                last_use[p] = max(last_use.get(p, -1), c.home)
    return [
        [v for v in nodes if v in last_use and nodes[v].home <= s < last_use[v]]
        for s in range(num_stages - 1)
    ]


def _home_after(c: NodeClass | None, s: int) -> bool:
    return c is not None and c.home is not None and c.home > s


def _check_boundaries(
    root: nn.Module, nodes: dict[fx.Node, NodeClass], boundaries: list[list[fx.Node]]
) -> None:
    """See [Note: stage boundary values]."""
    for s, values in enumerate(boundaries):
        for v in values:
            if known_non_tensor(root, v):
                users = [u.name for u in v.users if _home_after(nodes.get(u), s)]
                fixed = [
                    _describe(p)
                    for p, meta in producers(v)
                    if not (nodes[p].replicable or (meta and nodes[p].metarep))
                ]
                why = f"; it is computed from {', '.join(fixed)}, not from the batch inputs alone"
                kind = _KINDS[_value_kind(root, v)]
                raise ValueError(
                    f"{_describe(v)} ({kind}) is not a tensor but would cross "
                    f"the boundary between stages {s} and {s + 1} (used by {users})"
                    f"{why if fixed else ''}; only tensors can be sent. Choose layer_ranges that "
                    "keep its producer and users on one stage, or make the value recomputable "
                    "from the batch inputs."
                )


_KINDS = {"meta": "a size, dtype or device", "tuple": "a tuple of tensors"}


def _describe(node: fx.Node) -> str:
    """How an error names a traced value: the module, method or function that computes it."""
    if node.op == "call_module":
        return f"the output of {node.target.removeprefix(ROOT_PREFIX)}"
    if node.op == "call_method":
        return f"the value of .{node.target}() ({node.name})"
    if node.op == "placeholder":
        return f"the input {node.target}"
    return f"the value of {getattr(node.target, '__name__', node.target)}() ({node.name})"


def producers(node: fx.Node) -> list[tuple[fx.Node, bool]]:
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
    if node.op == "call_function" and node.target is hf.call_positions:
        for key, value in node.kwargs.items():  # see [Note: multimodal positions]
            visit(value, key in hf.META_ONLY_MASK_KWARGS)
        visit(node.args, False)
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


def layer_target(node: fx.Node) -> str | None:
    """The module path of the layer that ``node`` calls, if it calls one."""
    if node.op == "call_module":
        return node.target
    if node.op == "call_function" and node.target is hf.call_recording:
        return node.args[0].target
    return None


"""[Note: stage boundary values]

Every boundary value is a tensor: stage outputs are sent with tensor point-to-point ops. Values
that the trace proves are not tensors (shape/dtype/device queries and Python arithmetic on them,
the ``(cos, sin)`` tuple of a rotary leaf) are rejected at partition time. Prologue values are
normally replicated (see [Note: replicated prologue]), so in practice only layer outputs and
values computed after a layer cross.
"""


def mark_batch_terms(root: nn.Module, graph: fx.Graph) -> bool:
    """Marks each value that enters the computation of the terms the model adds to its loss from
    outside it with a call of :func:`hf.batch_term`; whether those terms can be computed over the
    whole batch (none of their inputs is a value of parameters alone, whose gradient every
    microbatch would then add; buffers and constants may be). See [Note: added terms over the
    whole batch]."""
    output = next(iter(reversed(graph.nodes)))
    logits, added = output.args[0]

    def ancestors(node: fx.Node) -> dict[fx.Node, None]:
        seen: dict[fx.Node, None] = {}
        stack = [node]
        while stack:
            n = stack.pop()
            if n not in seen:
                seen[n] = None
                stack.extend(n.all_input_nodes)
        return seen

    of_logits = ancestors(logits)
    sources = ("placeholder", "get_attr")  # the batch's inputs, the model's tensors
    region = {n: None for n in ancestors(added) if n not in of_logits and n.op not in sources}
    for n in list(region):  # an item of a layer's outputs (its router logits) enters as a value
        if n.target is operator.getitem and _value_kind(root, n.args[0]) == "tuple":
            if n.args[0] not in region:
                del region[n]
    order = {n: i for i, n in enumerate(graph.nodes)}
    entries: dict[fx.Node, list[fx.Node]] = {}
    for n in sorted(region, key=order.__getitem__):
        for u in n.all_input_nodes:
            if u not in region:
                entries.setdefault(u, []).append(n)
    whole = True
    for u, users in entries.items():
        if _value_kind(root, u) != "tensor" or all(_value_kind(root, n) == "meta" for n in users):
            continue  # metadata, or read for it: the same for the batch as for a microbatch
        upstream = ancestors(u)
        if not any(a.op == "placeholder" for a in upstream):
            whole = whole and not any(is_parameter(root, a) for a in upstream)
            continue  # a constant, or a value of parameters alone
        with graph.inserting_before(users[0]):
            marked = graph.call_function(hf.batch_term, (u, u.name))
        for user in users:
            user.replace_input_with(u, marked)
    return whole


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


def known_non_tensor(root: nn.Module, node: fx.Node) -> bool:
    return _value_kind(root, node) != "tensor"


_SHAPE_ONLY_METHODS = (
    "view",
    "reshape",
    "flatten",
    "contiguous",
    "to",
    "long",
    "int",
    "squeeze",
    "unsqueeze",
    "expand",
    "clone",
)
"""Tensor methods whose result holds their tensor's values: ids reach an embedding through them
(GPT-2 views ``input_ids`` before ``wte``)."""


def _same_values(node: fx.Node) -> list[fx.Node]:
    """The users of ``node`` that hold its values, rearranged (:data:`_SHAPE_ONLY_METHODS`)."""
    return [
        u
        for u in node.users
        if u.args[:1] == (node,)
        and (
            (u.op == "call_method" and u.target in _SHAPE_ONLY_METHODS)
            or (u.op == "call_function" and u.target in (torch.reshape, torch.flatten))
        )
    ]


def index_limits(root: nn.Module, graph: fx.Graph) -> dict[str, int]:
    """Batch input -> the rows of the smallest embedding table it indexes (an ``nn.Embedding``
    call or ``F.embedding``, directly or through ops that only rearrange it): its values must lie
    in ``[0, rows)``."""
    limits: dict[str, int] = {}
    for n in graph.nodes:
        if n.op != "placeholder":
            continue
        stack = [n]
        while stack:
            value = stack.pop()
            stack.extend(_same_values(value))
            for user in value.users:
                rows = _embedding_rows(root, user, value)
                if rows is not None:
                    limits[n.target] = min(rows, limits.get(n.target, rows))
    return limits


def _embedding_rows(root: nn.Module, user: fx.Node, ids: fx.Node) -> int | None:
    """The rows of the embedding table ``user`` looks ``ids`` up in, if it is a lookup."""
    if user.op == "call_module" and user.args[:1] == (ids,):
        mod = root.get_submodule(user.target)
        return mod.num_embeddings if isinstance(mod, nn.Embedding) else None
    if user.target is nn.functional.embedding and user.args[:1] == (ids,):
        weight = user.args[1] if len(user.args) > 1 else user.kwargs.get("weight")
        if isinstance(weight, fx.Node) and weight.op == "get_attr":
            return fetch(root, weight.target).shape[0]
    return None


def fetch(root: nn.Module, target: str) -> Any:
    obj: Any = root
    for atom in target.split("."):
        obj = getattr(obj, atom)
    return obj


def _own_params(
    root: nn.Module, n: fx.Node, mod: nn.Module | None, prods: list[tuple[fx.Node, bool]]
) -> bool:
    """Whether ``n`` reads parameters itself: a parameter, a module holding some, or a function
    running such a module (:func:`hf.call_features`)."""
    if n.op == "get_attr":
        return is_parameter(root, n)
    if mod is not None:
        return any(True for _ in mod.parameters())
    return n.op == "call_function" and any(_module_with_parameters(root, p) for p, _ in prods)


def _module_with_parameters(root: nn.Module, node: fx.Node) -> bool:
    """A ``get_attr`` of a module holding parameters (:func:`hf.call_features` runs it)."""
    if node.op != "get_attr":
        return False
    obj = fetch(root, node.target)
    return isinstance(obj, nn.Module) and any(True for _ in obj.parameters())


def is_parameter(root: nn.Module, node: fx.Node) -> bool:
    return node.op == "get_attr" and isinstance(fetch(root, node.target), nn.Parameter)


"""[Note: values of parameters only]

A prologue value computed from parameters alone (no batch input upstream), such as Gemma's final
norm factor ``1 + weight``, would be computed on stage 0 and sent to its users every microbatch.
Such a value is computed instead on the stage of its users, when they are all on one stage: the
parameters it reads then live there (and are tied across ranks like any other shared weight).
"""


def _move_values_of_parameters(nodes: dict[fx.Node, NodeClass]) -> None:
    """See [Note: values of parameters only]."""
    of_params: dict[fx.Node, bool] = {}
    for n in nodes:
        if n.op in ("get_attr", "placeholder", "output"):
            of_params[n] = n.op == "get_attr"
            continue
        of_params[n] = bool(n.all_input_nodes) and all(of_params[p] for p in n.all_input_nodes)
    for n in reversed(nodes):
        c = nodes[n]
        if not of_params[n] or n.op == "get_attr" or c.depth >= 0 or c.home is None:
            continue
        stages = {nodes[u].home for u in n.users if u in nodes}
        if len(stages) == 1 and None not in stages:
            c.home = stages.pop()
