"""Tied weights across stages (GPT-2's ``lm_head`` and ``wte``).

A parameter that appears under several names of the model stays one parameter on a rank. When
stages on different ranks hold it, those ranks (its owners) start from the first owner's values
and sum its gradient every step, over point-to-point transfers of the pipeline's group tagged
above every engine tag (see [Note: transfer tags] in csrc/engine.h).

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

from pippy_xla import ops
from pippy_xla._native import _C
from pippy_xla.partition import StageGraph

__all__ = [
    "Tie",
    "TiedParams",
    "add_back_grads",
    "combine_among",
    "local_ties",
    "set_aside_grads",
    "tied_names",
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
    tied: list[list[str]], stages: Sequence[StageGraph], stage_rank: Sequence[int], rank: int
) -> list[Tie]:
    """The ties of ``tied`` (from :func:`tied_names`, the same list on every rank) held by more
    than one rank and by ``rank``. A tie's tags follow from its place in ``tied``, so every
    owner uses the same ones."""
    ties = []
    for i, names in enumerate(tied):
        held_by = [st.index for st in stages if set(names) & set(st.param_names.values())]
        owners = sorted({stage_rank[s] for s in held_by})
        if len(owners) >= 2 and rank in owners:
            ties.append(Tie(owners=owners, names=names, tag=_C.tied_weight_tag(i)))
    return ties


def combine_among(
    tie: Tie,
    tensors: Sequence[torch.Tensor],
    *,
    add: bool,
    rank: int,
    group_name: str,
    timeout_ms: int,
) -> None:
    """Makes ``tensors`` (this rank's values or gradients of ``tie``) equal on all its owners:
    the first owner's values, or with ``add`` their sum, added in owner order so every owner
    gets the same bits. Point-to-point over the pipeline group, through the ``pippy_xla`` ops."""
    owners, tag, name, timeout = tie.owners, tie.tag, group_name, timeout_ms
    first = owners[0]
    with torch.no_grad():
        for t in tensors:
            if rank == first:
                if add:
                    for r in owners[1:]:
                        t += ops.recv_wait(t.shape, t.dtype, r, tag, name, t.device, None, timeout)
                for r in owners[1:]:
                    ops.send_wait(t.contiguous(), r, tag + 1, name, timeout)
            else:
                if add:
                    ops.send_wait(t.contiguous(), first, tag, name, timeout)
                t.copy_(
                    ops.recv_wait(t.shape, t.dtype, first, tag + 1, name, t.device, None, timeout)
                )


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
    earlier = iter(held)
    with torch.no_grad():
        for _, params in ties:
            for p in params:
                old = next(earlier)
                if old is not None:
                    if p.grad is not None:
                        old.add_(p.grad)
                    p.grad = old
