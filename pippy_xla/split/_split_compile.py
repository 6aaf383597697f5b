"""Compiled stages with a real W: a torch.compile backend whose backward is two compiled graphs.

[Note: compiled W] A stage compiled the usual way has one autograd node for its whole backward,
so a split-backward schedule's B computes the weight gradients too and W has nothing left to do.
This backend (``compile=True`` under a schedule that splits the backward) traces the stage's
joint forward-backward graph with AOTAutograd, partitions it into a forward and a backward graph
(inductor's min-cut partitioner, as a plain ``torch.compile`` does), and cuts the backward in two
by what each output needs:

- ``input``: the gradients of the stage inputs (activations), plus the values the weight
  gradients need from it (typically the gradients at the weight GEMMs' outputs);
- ``weight``: the gradients of the parameters, from those values and the saved tensors that only
  it reads.

Inductor compiles each graph as AOTAutograd hands it its graphs (``compile_fx_inner``: no retrace),
on first use with the real arguments, so during the first step. A call builds two autograd nodes:
one whose backward runs ``input`` (its edges lead to the stage inputs and to the other node) and
one whose backward runs ``weight`` (its edges lead to the parameters). A full backward runs both;
the engine's split backward (``csrc/runtime/split_backward.cpp``) runs the first in B and leaves the
second to W, and between them a microbatch holds only what ``weight`` reads. Dynamo still owns
guards and recompiles, so the recompile watch counts graphs as before. A graph this cannot split
(one that mutates an input or returns an alias of one, has dynamic shapes or another non-tensor
input such as a tensor-parallel stage's DeviceMesh, or that AOTAutograd's export cannot trace) is
compiled the plain way, with one backward node and an empty W, and a warning that says why.
"""

from __future__ import annotations

import operator
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import fx

__all__ = ["split_backward_backend"]


def split_backward_backend(
    mode: str | None = None, options: dict[str, Any] | None = None
) -> Callable:
    """A ``torch.compile`` backend whose graphs keep input and weight gradients in separate
    autograd nodes: inductor underneath, configured by ``mode`` and ``options`` as
    ``torch.compile(mode=..., options=...)`` would configure it."""
    if mode is not None and mode != "default":
        from torch._inductor import list_mode_options

        options = {**list_mode_options(mode), **(options or {})}

    def backend(gm: fx.GraphModule, example_inputs: list) -> Callable:
        from torch._inductor.compile_fx import compile_fx

        params = [isinstance(a, torch.nn.Parameter) and a.requires_grad for a in example_inputs]
        if not torch.is_grad_enabled() or not any(params):
            return compile_fx(gm, example_inputs, config_patches=options)
        try:
            return _SplitStage(gm, example_inputs, params, options)
        except _Unsupported as e:
            warnings.warn(
                f"pippy_xla: a compiled stage keeps one backward node (W runs nothing): {e}",
                stacklevel=2,
            )
            return compile_fx(gm, example_inputs, config_patches=options)

    return backend


class _Unsupported(Exception):
    pass


def _trace_joint(gm: fx.GraphModule, example_inputs: list) -> tuple[fx.GraphModule, list[bool]]:
    """The functional joint graph (placeholders ``primals_*`` then ``tangents_*``; outputs the
    forward outputs then one gradient per primal) and which forward outputs take a tangent."""
    from torch._functorch._aot_autograd.schemas import OutputType
    from torch._functorch.aot_autograd import _aot_export_function
    from torch._inductor.decomposition import select_decomp_table

    def flat(*args):
        out = gm(*args)
        return tuple(out) if isinstance(out, (list, tuple)) else (out,)

    try:
        joint, meta, _, _ = _aot_export_function(
            flat, tuple(example_inputs), decompositions=select_decomp_table(), trace_joint=True
        )
    except Exception as e:  # what AOTAutograd's export cannot trace (some higher-order ops)
        raise _Unsupported(f"AOTAutograd could not trace its joint graph: {e!r}"[:300]) from e
    if any(i.mutates_data or i.mutates_metadata for i in meta.input_info):
        raise _Unsupported("the stage graph mutates an input (a buffer?)")
    if any(o.output_type != OutputType.non_alias for o in meta.output_info):
        raise _Unsupported("the stage graph returns an alias of an input")
    differentiable = [
        getattr(o, "requires_grad_for_backward", o.requires_grad) for o in meta.output_info
    ]
    return joint, differentiable


def _subgraph(
    gm: fx.GraphModule, inputs: Sequence[fx.Node], outputs: Sequence[fx.Node]
) -> fx.GraphModule:
    """A graph of the nodes of ``gm`` that ``outputs`` need, reading ``inputs`` as placeholders
    (in that order) and returning ``outputs``."""
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for n in inputs:
        env[n] = graph.placeholder(n.name)
        env[n].meta = dict(n.meta)
    need = _ancestors(outputs, stop=set(inputs))
    for n in gm.graph.nodes:
        if n in need and n not in env:
            assert n.op != "placeholder", f"{n} is neither computed nor an input"
            env[n] = graph.node_copy(n, lambda a: env[a])
    graph.output(tuple(env[o] for o in outputs))
    return fx.GraphModule(gm, graph)


def _ancestors(roots: Sequence[fx.Node], stop: set[fx.Node] = frozenset()) -> set[fx.Node]:
    seen: set[fx.Node] = set()
    todo = list(roots)
    while todo:
        n = todo.pop()
        if n in seen:
            continue
        seen.add(n)
        if n not in stop:
            todo.extend(n.all_input_nodes)
    return seen


def _not_a_tensor(arg: Any) -> str:
    """Why a graph with ``arg`` among its inputs is compiled the plain way."""
    if isinstance(arg, int | torch.SymInt):
        return "dynamic shapes (a graph input is a symbolic size)"
    return (
        f"a graph input is a {type(arg).__name__}, not a tensor (a tensor-parallel stage's "
        "DTensor layers pass their DeviceMesh), and this backend splits graphs of tensors only"
    )


class _SplitStage:
    """The compiled callable dynamo runs for one graph: forward, input and weight graphs."""

    def __init__(self, gm, example_inputs, params: list[bool], options) -> None:
        from torch._functorch.partitioners import min_cut_rematerialization_partition

        odd = [a for a in example_inputs if not isinstance(a, torch.Tensor)]
        if odd:
            raise _Unsupported(_not_a_tensor(odd[0]))
        joint, self.differentiable = _trace_joint(gm, example_inputs)
        self.num_outputs = len(self.differentiable)
        self.param_index = [i for i, p in enumerate(params) if p]
        self.input_index = [i for i, p in enumerate(params) if not p]
        fw, bw = min_cut_rematerialization_partition(joint, None, num_fwd_outputs=self.num_outputs)
        bw_inputs = [n for n in bw.graph.nodes if n.op == "placeholder"]
        grads = list(bw.graph.output_node().args[0])
        assert len(grads) == len(params), (len(grads), len(params))
        input_grads = [g for g, p in zip(grads, params, strict=True) if not p]
        weight_grads = [g for g, p in zip(grads, params, strict=True) if p]
        need_input = _ancestors([g for g in input_grads if g is not None])
        weight_only = _ancestors([g for g in weight_grads if g is not None], stop=need_input)
        weight_only = {n for n in weight_only - need_input if n.op != "placeholder"}
        # Values cross from one graph to the other as tensors: an item of a multi-output node
        # of the input graph is taken there.
        weight_only -= {
            n for n in weight_only if n.target is operator.getitem and n.args[0] not in weight_only
        }
        # What the weight graph reads: backward inputs it uses, and values the input graph computes.
        reads = {a for n in weight_only for a in n.all_input_nodes if a not in weight_only}
        reads |= {g for g in weight_grads if g is not None and g not in weight_only}
        kept = [n for n in bw_inputs if n in reads]
        cross = [n for n in bw.graph.nodes if n in reads and n.op != "placeholder"]
        self.kept_index = [bw_inputs.index(n) for n in kept]
        # Graphs return tensors only; a gradient that is None stays out of them.
        self.input_slots = [i for i, g in enumerate(input_grads) if g is not None]
        self.weight_slots = [i for i, g in enumerate(weight_grads) if g is not None]
        input_graph = _subgraph(bw, bw_inputs, [input_grads[i] for i in self.input_slots] + cross)
        weight_graph = _subgraph(bw, kept + cross, [weight_grads[i] for i in self.weight_slots])
        self.num_inputs = len(input_grads)
        self.num_params = len(weight_grads)
        self.forward = _LazyGraph(fw, options, backward=False)
        self.input_backward = _LazyGraph(input_graph, options, backward=True)
        self.weight_backward = _LazyGraph(weight_graph, options, backward=True)

    def __call__(self, *args):
        run = _Run(self, args)
        token = _WeightNode.apply(run, *[args[i] for i in self.param_index])
        return _InputNode.apply(run, token, *[args[i] for i in self.input_index])


class _LazyGraph:
    """An aten graph traced already, compiled by inductor on its first call with the real
    arguments, as AOTAutograd hands its graphs to inductor: no retrace, no autograd, no autocast
    of its own."""

    def __init__(self, gm: fx.GraphModule, options: dict | None, *, backward: bool) -> None:
        self.gm, self.options, self.backward = gm, options, backward
        self.compiled: Callable | None = None

    def __call__(self, args: list) -> tuple:
        if self.compiled is None:
            from torch._inductor import config
            from torch._inductor.compile_fx import compile_fx_inner

            device = next(a.device.type for a in args if isinstance(a, torch.Tensor))
            with torch.no_grad(), torch.autocast(device, enabled=False):
                with config.patch(self.options or {}):
                    self.compiled = compile_fx_inner(self.gm, args, is_backward=self.backward)
        return tuple(self.compiled(list(args)))  # it takes a list it may empty


def _scatter(slots: list[int], values: Sequence, size: int) -> list:
    """``size`` entries, ``values`` at ``slots`` and ``None`` elsewhere."""
    out: list = [None] * size
    for i, v in zip(slots, values, strict=True):
        out[i] = v
    return out


class _Run:
    """One call's state, shared by its two autograd nodes."""

    __slots__ = ("stage", "args", "saved", "weight_args")

    def __init__(self, stage: _SplitStage, args: tuple) -> None:
        self.stage = stage
        self.args = list(args)
        self.saved: list | None = None
        self.weight_args: list | None = None


class _WeightNode(torch.autograd.Function):
    """Its backward is W: the weight graph, into the parameters' gradients."""

    @staticmethod
    def forward(ctx, run: _Run, *params):
        ctx.run = run
        return torch.zeros((), device=params[0].device)

    @staticmethod
    def backward(ctx, _token):
        run = ctx.run
        if run.weight_args is None:
            raise RuntimeError("pippy_xla: a compiled stage's W ran before its B")
        args, run.weight_args = run.weight_args, None
        stage = run.stage
        return (None, *_scatter(stage.weight_slots, stage.weight_backward(args), stage.num_params))


class _InputNode(torch.autograd.Function):
    """Runs the forward graph; its backward is B: the input graph, whose values for W it keeps."""

    @staticmethod
    def forward(ctx, run: _Run, token, *inputs):
        stage = run.stage
        out = stage.forward(run.args)
        run.args = None
        outs, run.saved = out[: stage.num_outputs], list(out[stage.num_outputs :])
        ctx.run = run
        ctx.token_device = token.device
        ctx.mark_non_differentiable(
            *[
                o
                for o, d in zip(outs, stage.differentiable, strict=True)
                if not d and isinstance(o, torch.Tensor)
            ]
        )
        return outs

    @staticmethod
    def backward(ctx, *grads):
        run = ctx.run
        stage = run.stage
        tangents = [g.contiguous() for g, d in zip(grads, stage.differentiable, strict=True) if d]
        bw_args = run.saved + tangents
        run.saved = None
        out = stage.input_backward(bw_args)
        n = len(stage.input_slots)
        input_grads = _scatter(stage.input_slots, out[:n], stage.num_inputs)
        run.weight_args = [bw_args[i] for i in stage.kept_index] + list(out[n:])
        del bw_args
        token_grad = torch.zeros((), device=ctx.token_device)
        return (None, token_grad, *input_grads)
