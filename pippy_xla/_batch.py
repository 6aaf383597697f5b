"""Batches of a pipeline step: checking and splitting them, and the per-step signature handshake.

Every rank gets the whole batch. :func:`split_batch` checks it and cuts this replica's rows into
microbatches; :func:`batch_signature` digests its names, shapes and dtypes, and
:func:`gather_signatures` and :func:`check_same_signature` make sure every rank of the pipeline
got the same before any point-to-point transfer. The signature is also the key under which the
engine remembers the boundary shapes (see [Note: boundary specs] in csrc/boundary.h). The step
runner (:class:`pippy_xla._step.StepRunner`) calls these in that order.
"""

from __future__ import annotations

import hashlib
import zlib
from collections.abc import Sequence

import torch

from pippy_xla._native import _C
from pippy_xla.errors import BatchMismatchError

__all__ = [
    "MAX_DIMS",
    "batch_signature",
    "check_same_signature",
    "digest64",
    "gather_signatures",
    "split_batch",
]

MAX_DIMS = 8
"""Most dimensions a batch input may have (the signature's row width)."""

Batch = dict[str, torch.Tensor]


def digest64(data: bytes) -> int:
    """A signed 64-bit digest of ``data`` (what the C++ collectives exchange)."""
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little", signed=True)


def split_batch(
    batch: Batch,
    *,
    input_names: Sequence[str],
    num_microbatches: int,
    need_labels: bool,
    device: torch.device,
    dp_rank: int = 0,
    dp_size: int = 1,
) -> tuple[Batch, dict[str, tuple[torch.Tensor, ...]]]:
    """Checks a step's batch and splits it.

    Returns the batch as the pipeline reads it (``None`` entries dropped, a default
    ``attention_mask`` added) and, per input, this replica's rows (replica ``dp_rank`` of
    ``dp_size``: see [Note: pipeline x data parallel]) on ``device`` in ``num_microbatches``
    chunks. Raises ``ValueError`` / ``TypeError`` naming what is wrong, before any communication.
    """
    if need_labels and "labels" not in batch:
        raise ValueError("run_train needs labels=...")
    names = list(input_names)
    unknown = sorted(k for k in batch if k not in names and k != "labels")
    if unknown:
        raise ValueError(
            f"unexpected batch inputs {unknown}; this pipeline takes {names} and "
            "labels (set input_names=... when wrapping the model)"
        )
    batch = {k: v for k, v in batch.items() if v is not None}
    first = names[0]
    if first not in batch:
        raise ValueError(f"the batch needs '{first}'")
    if "attention_mask" in names and "attention_mask" not in batch:
        batch["attention_mask"] = torch.ones_like(batch[first])
    missing = [n for n in names if n not in batch]
    if missing:
        raise ValueError(f"the batch lacks {missing}")
    for k, v in batch.items():
        if not isinstance(v, torch.Tensor):
            raise TypeError(f"batch['{k}'] must be a tensor, got {type(v).__name__}")
    size = batch[first].shape[0]
    for k, v in batch.items():
        if v.dim() == 0 or v.shape[0] != size:
            raise ValueError(
                f"batch['{k}'] has shape {tuple(v.shape)}; every input needs batch size "
                f"{size} (that of '{first}') in dim 0"
            )
    m, dp = num_microbatches, dp_size
    if size % (m * dp) != 0:
        what = f"num_microbatches={m}"
        if dp > 1:
            what = f"data-parallel size {dp} x num_microbatches={m} = {dp * m}"
        raise ValueError(
            f"batch size {size} is not divisible by {what}; use a batch size that is a "
            f"multiple of {m * dp}"
        )
    for k, v in batch.items():
        if v.dim() > MAX_DIMS:
            raise ValueError(f"batch['{k}'] has {v.dim()} dims; at most {MAX_DIMS}")
    share = size // dp
    rows = slice(dp_rank * share, (dp_rank + 1) * share)
    return batch, {k: v[rows].to(device).chunk(m) for k, v in batch.items()}


def batch_signature(batch: Batch) -> int:
    """A 64-bit digest of the batch's input names, shapes and dtypes."""
    rows = []
    for k in sorted(batch):
        v = batch[k]
        dims = list(v.shape) + [-1] * (MAX_DIMS - v.dim())
        rows.append([zlib.crc32(k.encode()), zlib.crc32(str(v.dtype).encode()), v.dim(), *dims])
    return digest64(torch.tensor(rows, dtype=torch.long).numpy().tobytes())


def gather_signatures(
    signature: int, *, rank: int, group_name: str, device: torch.device, timeout_ms: int
) -> list[int]:
    """Every rank's batch signature: one all_gather of 64 bits over the pipeline's group, before
    any point-to-point transfer of the step."""
    return _C.all_gather_int64(
        signature, group_name, str(device), timeout_ms, f"[rank {rank}] batch signature all_gather"
    )


def check_same_signature(signature: int, everyone: Sequence[int], batch: Batch, rank: int) -> None:
    """Every rank must see the same batch shapes and dtypes, or the boundary transfers would
    disagree: raises :class:`BatchMismatchError` naming a rank whose signature (in ``everyone``,
    from :func:`gather_signatures`) differs from this rank's ``signature`` of ``batch``."""
    for r, theirs in enumerate(everyone):
        if theirs != signature:
            describe = {k: (tuple(batch[k].shape), batch[k].dtype) for k in sorted(batch)}
            raise BatchMismatchError(
                rank=rank,
                failed_rank=rank,
                peer=r,
                action="batch signature check",
                cause=(
                    f"rank {r} got a batch with other inputs, shapes or dtypes than this "
                    f"rank's {describe}; every rank must get the same batch shapes (the "
                    "whole batch goes to every rank)"
                ),
            )
