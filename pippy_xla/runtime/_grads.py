"""Gradients across the pipeline: the global gradient norm and clipping by it.

[Note: global gradient clipping]

``torch.nn.utils.clip_grad_norm_(pipe.parameters(), max_norm)`` on each rank clips each stage by
its own stage's norm: every rank scales by another factor, and training silently differs from
one process. The norm single-process training clips by is that of *every* gradient of the model,
so ``PipelineModel.clip_grad_norm_`` computes it from every rank's share
(:func:`local_gradients`, :func:`global_norm`, :func:`clip_`):

- each rank takes the norms of its local gradients, each tensor once: a tied weight held by
  several ranks (its gradient already summed on every owner) only on its first owner; on a mesh,
  the local shard of a sharded (``fully_shard``) gradient, or the whole of a replicated one; on
  an HSDP mesh, whose shards repeat on every replica of the replicate dim, on its first only;
- experts sharded by expert parallelism count on the first of their copies, their share summed
  over the ranks that run their stage first ([Note: pipeline x expert parallel]);
- the shares are combined over the pipeline's group (and, for sharded gradients, over the
  replicas): ``(sum_r sum_i |g_i|_p^p)^(1/p)`` for a finite ``p``, the largest for ``inf``, by
  all-reduces on C++-owned buffers (``_C.all_reduce_sum_copy``; a maximum as the sum of a
  one-hot vector of every rank's value);
- every rank scales its gradients by ``max_norm / (total + 1e-6)`` clamped to 1, as torch does.

The total is the same on every rank, so ``error_if_nonfinite`` raises on every rank or none.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch
from torch import nn

from pippy_xla.runtime._ties import Tie
from pippy_xla.runtime.data_parallel import local_tensor

__all__ = ["clip_", "global_norm", "local_gradients"]

Reduce = Callable[[torch.Tensor, str], torch.Tensor]
"""``reduce(tensor, what) -> sum over a group``, on buffers the caller does not keep."""


def local_gradients(
    params: Sequence[nn.Parameter], ties: Sequence[tuple[Tie, list[nn.Parameter]]], rank: int
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """This rank's gradients (local shards of DTensors): all of them, to scale, and those this
    rank counts in the global norm (a tied weight once: its first owner's first copy)."""
    not_mine = {id(p) for tie, ps in ties for p in (ps if tie.owners[0] != rank else ps[1:])}
    scaled, counted = [], []
    for p in params:
        if p.grad is None:
            continue
        g = local_tensor(p.grad)
        scaled.append(g)
        if id(p) not in not_mine:
            counted.append(g)
    return scaled, counted


def _combine(value: torch.Tensor, norm_type: float, reduce: Reduce, rank: int, size: int):
    """Every rank's ``value`` (a power sum, or for ``inf`` a maximum) combined over a group."""
    if norm_type == math.inf:  # a maximum, as the sum of one-hot vectors
        slots = torch.zeros(size, dtype=value.dtype, device=value.device)
        slots[rank] = value
        return reduce(slots, "gradient norm (max)").max()
    return reduce(value, "gradient norm (sum)")


def global_norm(
    parts: Sequence[tuple[Sequence[torch.Tensor], Sequence[tuple[Reduce, int, int]]]],
    norm_type: float,
    device: torch.device,
    reductions: Sequence[tuple[Reduce, int, int]],
) -> torch.Tensor:
    """The ``norm_type`` norm of every rank's counted gradients (see [Note: global gradient
    clipping]), on every rank.

    Args:
        parts: ``(counted, first)`` per kind of gradient: the local gradients that count in the
            norm and the ``(reduce, rank, size)`` groups their share is combined over before
            the others' (the replicas, for sharded gradients; the ranks of a stage, for experts
            sharded over them).
        reductions: ``(reduce, rank, size)`` per group to combine the parts' sum over, in order
            (the pipeline's group; the tensor-parallel ranks).
    """
    if norm_type <= 0 and norm_type != math.inf:
        raise ValueError(f"norm_type must be positive or inf, got {norm_type}")
    values = []
    for counted, first in parts:
        norms = [torch.linalg.vector_norm(g.detach(), norm_type).float() for g in counted]
        stacked = torch.stack(norms) if norms else torch.zeros(0, device=device)
        if norm_type == math.inf:
            value = stacked.max() if norms else torch.zeros((), device=device)
        else:
            value = stacked.pow(norm_type).sum()
        for reduce, rank, size in first:
            value = _combine(value, norm_type, reduce, rank, size)
        values.append(value)
    value = torch.stack(values).amax() if norm_type == math.inf else torch.stack(values).sum()
    for reduce, rank, size in reductions:
        value = _combine(value, norm_type, reduce, rank, size)
    return value if norm_type == math.inf else value.pow(1.0 / norm_type)


def clip_(
    scaled: Sequence[torch.Tensor],
    total: torch.Tensor,
    *,
    max_norm: float,
    norm_type: float,
    error_if_nonfinite: bool,
) -> None:
    """Scales ``scaled`` in place by ``max_norm / (total + 1e-6)`` clamped to 1, as
    ``torch.nn.utils.clip_grad_norm_`` does."""
    if error_if_nonfinite and not torch.isfinite(total):
        raise RuntimeError(
            f"The total norm of order {norm_type} for gradients from `parameters` is non-finite, "
            "so it cannot be clipped. To disable this error and scale the gradients by the "
            "non-finite norm anyway, set `error_if_nonfinite=False`"
        )
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    with torch.no_grad():
        for g in scaled:
            g.mul_(coef.to(g.device, g.dtype))
