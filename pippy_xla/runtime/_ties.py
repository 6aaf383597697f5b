"""Tied weights across stages (GPT-2's ``lm_head`` and ``wte``).

A parameter that appears under several names of the model stays one parameter on a rank. When
stages on different ranks hold it, those ranks (its owners) start from the first owner's values
and sum its gradient every step, over point-to-point transfers of the pipeline's group tagged
above every engine tag (see [Note: transfer tags] in csrc/runtime/engine.h).

[Note: a copy per stage on a mesh] Data parallelism wraps each stage module on its own (see
[Note: pipeline x data parallel]), and one parameter cannot belong to two of them: two stages of
one rank that hold a tied weight (GPT-2's ``wte`` and ``lm_head`` on rank 0 of a V placement) get
a copy each on a mesh (:func:`untie_local_copies`), and the tie then counts every stage's copy:
the rank sums its copies' gradients, then sums with the other owners, and gives every copy the
result. Equal values and equal gradients keep the copies equal through any optimizer.

[Note: tied gradients accumulate once]

Gradients accumulate across ``run_train`` calls (two calls, then one optimizer step), as they do
across ``backward`` calls. A tied parameter's gradient is summed over its owners after each call,
so after the first call every owner holds the sum S; summing again after the second would count S
once per owner. So each call sets the earlier gradients aside (:func:`set_aside_grads`), sums only
its own contributions, and adds the earlier ones back (:func:`add_back_grads`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from pippy_xla._native import _C
from pippy_xla.runtime import ops
from pippy_xla.split.partition import StageGraph

__all__ = [
    "Tie",
    "TiedParams",
    "add_back_grads",
    "combine_among",
    "local_ties",
    "set_aside_grads",
    "tied_names",
    "untie_local_copies",
]


def tied_names(model: nn.Module) -> list[list[str]]:
    """Groups of names under which one parameter appears more than once, sorted. Call it before
    materializing, which replaces meta parameters."""
    names_of: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        names_of.setdefault(id(p), []).append(name)
    return sorted(names for names in names_of.values() if len(names) > 1)


@dataclass(frozen=True, slots=True)
class Tie:
    """A parameter shared by the stages of several ranks."""

    owners: list[int]
    """The ranks (of the pipeline's group) whose stages hold it, ascending."""
    names: list[str]
    """Its names in the model."""
    tag: int
    """The first of the two transfer tags of its transfers."""


def local_ties(
    tied: list[list[str]],
    stages: Sequence[StageGraph],
    stage_rank: Sequence[int],
    rank: int,
    per_stage: bool = False,
) -> list[Tie]:
    """The ties of ``tied`` (from :func:`tied_names`, the same list on every rank) held by
    ``rank`` and by more than one rank (``per_stage``: by more than one stage, see [Note: a copy
    per stage on a mesh]). A tie's tags follow from its place in ``tied``, so every owner uses the
    same ones."""
    ties = []
    for i, names in enumerate(tied):
        held_by = [st.index for st in stages if set(names) & set(st.param_names.values())]
        owners = sorted({stage_rank[s] for s in held_by})
        copies = len(held_by) if per_stage else len(owners)
        if copies >= 2 and rank in owners:
            ties.append(Tie(owners=owners, names=names, tag=_C.tied_weight_tag(i)))
    return ties


def untie_local_copies(tied: list[list[str]], local_stages: Sequence[StageGraph]) -> None:
    """Gives every local stage but the first that holds a tied weight its own copy of it (see
    [Note: a copy per stage on a mesh])."""
    for names in tied:
        holders = [st for st in local_stages if set(names) & set(st.param_names.values())]
        for st in holders[1:]:
            copies: dict[int, nn.Parameter] = {}
            for stage_name, p in list(st.module.named_parameters(remove_duplicate=False)):
                if st.param_names[stage_name] not in names:
                    continue
                copy = copies.setdefault(
                    id(p), nn.Parameter(p.detach().clone(), requires_grad=p.requires_grad)
                )
                owner, _, attr = stage_name.rpartition(".")
                setattr(st.module.get_submodule(owner), attr, copy)


def combine_among(
    tie: Tie,
    tensors: Sequence[torch.Tensor],
    *,
    add: bool,
    rank: int,
    group_name: str,
    timeout_ms: int,
) -> None:
    """Makes ``tensors`` (this rank's copies of ``tie``'s values or gradients: one per local stage
    holding it, or one) equal on all its owners: the first owner's first copy, or with ``add`` the
    sum of every copy, added in owner order so every owner gets the same bits. Point-to-point over
    the pipeline group, through the ``pippy_xla`` ops."""
    owners, tag, name, timeout = tie.owners, tie.tag, group_name, timeout_ms
    first = owners[0]
    if not tensors:
        return
    with torch.no_grad():
        t, others = tensors[0], tensors[1:]
        if add:
            for o in others:
                t += o
        if len(owners) > 1 and rank == first:
            if add:
                for r in owners[1:]:
                    t += ops.recv_wait(t.shape, t.dtype, r, tag, name, t.device, None, timeout)
            for r in owners[1:]:
                ops.send_wait(t.contiguous(), r, tag + 1, name, timeout)
        elif len(owners) > 1:
            if add:
                ops.send_wait(t.contiguous(), first, tag, name, timeout)
            t.copy_(ops.recv_wait(t.shape, t.dtype, first, tag + 1, name, t.device, None, timeout))
        for o in others:
            o.copy_(t)


TiedParams = Sequence[tuple[Tie, list[nn.Parameter]]]
"""This rank's ties, each with its parameters on this rank."""


def set_aside_grads(ties: TiedParams) -> list[torch.Tensor | None]:
    """Takes the tied parameters' gradients off them (``None`` in their place), in order; see
    [Note: tied gradients accumulate once]."""
    held = []
    for _, params in ties:
        for p in params:
            held.append(p.grad)
            p.grad = None
    return held


def add_back_grads(ties: TiedParams, held: Sequence[torch.Tensor | None]) -> None:
    """Adds the gradients :func:`set_aside_grads` took back onto the tied parameters."""
    if not ties:
        return
    earlier = iter(held)
    with torch.no_grad():
        for _, params in ties:
            for p in params:
                old = next(earlier)
                if old is not None:
                    if p.grad is not None:
                        old.add_(p.grad)
                    p.grad = old
