"""Emitting one ``GraphModule`` per stage from a classified trace: the nodes the stage computes,
the prologue it recomputes, stand-ins for values read only for their metadata, and checkpointed
layers."""

from __future__ import annotations

import operator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.utils.checkpoint
from torch import fx, nn

from pippy_xla.split import hf
from pippy_xla.split.classify import (
    Classified,
    fetch,
    is_parameter,
    keeps_self_meta,
    layer_target,
    producers,
)
from pippy_xla.split.trace import ROOT_PREFIX

__all__ = ["StageGraph", "emit_stage"]


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
    added_over_batch: bool = False
    """The added terms can be computed over the whole batch rather than each microbatch (see
    [Note: added terms over the whole batch])."""
    index_limits: dict[str, int] = field(default_factory=dict)
    """Batch input -> the rows of the embedding table it indexes (the model's, every stage the
    same): the step checks its values against them before any transfer."""


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


def _emit_embedding_stub(graph: fx.Graph, emb_node: fx.Node, emb: nn.Embedding, ids: fx.Node):
    # See [Note: replicated prologue]
    device = graph.call_function(getattr, (ids, "device"))
    shape = graph.call_function(getattr, (ids, "shape"))
    full = graph.call_function(
        torch.full, ((), float("nan")), {"dtype": emb.weight.dtype, "device": device}
    )
    size = graph.call_function(operator.add, (shape, (emb.embedding_dim,)))
    return graph.create_node("call_method", "expand", (full, size), name=f"{emb_node.name}_meta")


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


def emit_stage(
    s: int,
    c: Classified,
    input_names: list[str],
    layer_range: tuple[int, int],
    checkpoint_set: frozenset[int] = frozenset(),
    added_loss: bool = False,
) -> StageGraph:
    """Stage ``s`` of the classified trace ``c``: its graph over the root's modules and its calling
    convention."""
    last = s == c.num_stages - 1
    received = c.boundaries[s - 1] if s > 0 else []
    sent = [] if last else c.boundaries[s]
    local = _stage_nodes(s, c, dict.fromkeys(received))
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    placeholders = {n.target: n for n in c.nodes if n.op == "placeholder"}
    batch_inputs = [
        name
        for name in input_names
        if name in placeholders and local.get(placeholders[name]) == "input"
    ]
    for name in batch_inputs:
        env[placeholders[name]] = graph.placeholder(name)
    for v in received:
        env[v] = graph.placeholder(v.name)
    _emit_nodes(graph, c, local, env, checkpoint_set)
    if last:
        results = next(iter(reversed(c.nodes))).args[0]
        results = results if isinstance(results, tuple) else (results,)
        graph.output(tuple(fx.node.map_arg(results, lambda a: env[a])))
    else:
        graph.output(tuple(env[v] for v in sent))
    graph.lint()
    gm = fx.GraphModule(c.root, graph, class_name=f"Stage{s}")
    start, stop = layer_range
    return StageGraph(
        index=s,
        module=gm,
        batch_inputs=batch_inputs,
        num_boundary_inputs=len(received),
        num_boundary_outputs=len(sent),
        layers=list(range(start, stop)),
        param_names=_param_names(s, gm),
        code=gm.code,
        added_loss=added_loss and last,
    )


def _stage_nodes(s: int, c: Classified, received: dict[fx.Node, None]) -> dict[fx.Node, str]:
    """What stage ``s`` computes: its homed nodes plus the replicated closure they need, each as
    ``"compute"``, ``"meta"`` (recomputed from embedding stand-ins only for its shape, dtype and
    device), ``"stub"``, ``"standin"`` or ``"input"``. See [Note: replicated prologue]."""
    local: dict[fx.Node, str] = {}
    stack = [n for n, nc in c.nodes.items() if nc.home == s]
    for n in stack:
        local[n] = "compute"
    while stack:
        n = stack.pop()
        replicated = c.nodes[n].home is None or local[n] == "meta"
        prods = producers(n)
        if local[n] == "meta" and keeps_self_meta(n):
            prods = [(n.args[0], True)]  # its metadata is its first argument's
        for p, meta in prods:
            pc = c.nodes[p]
            if p in received or pc.home == s:
                continue
            for_meta = meta or local[n] == "meta"
            if p in local:
                if local[p] == "standin" and not for_meta:
                    local[p] = "compute"  # also read for its values
                continue
            if p.op == "placeholder":
                local[p] = "input"
            elif is_parameter(c.root, p) and for_meta:
                local[p] = "standin"
            elif pc.home is None:
                local[p] = "compute"
                stack.append(p)
            elif s > 0 and replicated and for_meta and pc.metarep:
                is_embedding = p.op == "call_module" and isinstance(
                    c.root.get_submodule(p.target), nn.Embedding
                )
                local[p] = "stub" if is_embedding else "meta"
                stack.append(p)
            else:
                raise AssertionError(f"stage {s}: {p.name} needed by {n.name} is not available")
    return local


def _emit_nodes(
    graph: fx.Graph,
    c: Classified,
    local: dict[fx.Node, str],
    env: dict[fx.Node, fx.Node],
    checkpoint_set: frozenset[int],
) -> None:
    """Copies the stage's nodes into ``graph`` in trace order (the output node aside)."""
    for n in c.nodes:
        kind = local.get(n)
        if kind == "compute" and c.layer_index.get(layer_target(n)) in checkpoint_set:
            env[n] = _emit_checkpoint(graph, n, lambda a: env[a])
        elif kind == "meta" and keeps_self_meta(n):
            env[n] = env[n.args[0]]
        elif kind in ("compute", "meta") and n.op != "output":
            env[n] = graph.node_copy(n, lambda a: env[a])
        elif kind == "stub":
            env[n] = _emit_embedding_stub(graph, n, c.root.get_submodule(n.target), env[n.args[0]])
        elif kind == "standin":
            env[n] = _emit_standin(graph, n, fetch(c.root, n.target))


def _param_names(s: int, gm: fx.GraphModule) -> dict[str, str]:
    """Stage-module name -> original model name, for every parameter and buffer of ``gm``."""
    param_names: dict[str, str] = {}
    for name, _ in [
        *gm.named_parameters(remove_duplicate=False),
        *gm.named_buffers(remove_duplicate=False),
    ]:
        if not name.startswith(ROOT_PREFIX):
            raise AssertionError(f"stage {s} holds {name!r} outside the model")
        param_names[name] = name[len(ROOT_PREFIX) :]
    return param_names
