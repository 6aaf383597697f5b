"""Batches of a pipeline step: checking and splitting them, and the per-step handshake.

Every rank gets the whole batch. :func:`check_batch` checks it; :func:`step_key` and
:func:`agree_on_step` make sure every rank of the pipeline runs the same kind of step on the same
batch before any point-to-point transfer; :func:`split_batch` then cuts this replica's rows into
microbatches (after the handshake, so that a rank's splitting does not delay its peers' start).
The batch signature is also the key under which the engine remembers the boundary shapes (see
[Note: boundary specs] in csrc/runtime/boundary.h). The step runner
(:class:`pippy_xla.runtime._step.StepRunner`) calls these in that order.

[Note: step handshake]

Before a step's first transfer, every rank of the pipeline all_gathers three 64-bit words: the
step's kind (train or eval), the batch signature (input names, shapes, dtypes) and a digest of the
batch's values (C++ ``content_digest`` of each input; ``check_batch_content=False`` turns it off).
Any difference raises :class:`BatchMismatchError` on every rank at once, naming the ranks and what
differs (for values, a second all_gather of the per-input digests names the inputs): a rank that
evaluates while another trains, or ranks that were given other rows (a data-parallel habit: a
seed per rank, a sharding sampler), would otherwise pair wrong transfers, train on mismatched
inputs and labels, or hang until the timeout. No transfer has started, so the pipeline stays
usable.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from pippy_xla._native import _C
from pippy_xla.errors import BatchMismatchError

__all__ = [
    "STEP_KINDS",
    "StepKey",
    "agree_on_step",
    "check_batch",
    "cut_ragged",
    "digest64",
    "replica_rows",
    "split_batch",
    "step_key",
]

Batch = dict[str, torch.Tensor]
RowShares = Callable[[Batch], dict[str, torch.Tensor]]
"""A batch -> for each of its inputs whose dim 0 is not the rows (a ragged input), each row's
count of its entries along dim 0."""


def digest64(data: bytes) -> int:
    """A signed 64-bit digest of ``data`` (what the C++ collectives exchange)."""
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little", signed=True)


def check_batch(
    batch: Batch,
    *,
    input_names: Sequence[str],
    num_microbatches: int,
    need_labels: bool,
    dp_size: int = 1,
    index_limits: Mapping[str, int] | None = None,
    label_rows: int | None = None,
    ragged: RowShares | None = None,
) -> Batch:
    """Checks a step's batch; returns it as the pipeline reads it (``None`` entries dropped, a
    default ``attention_mask`` added). Raises ``ValueError`` / ``TypeError`` naming what is
    wrong, before any communication; every rank holds the whole batch, so every rank raises the
    same error. ``index_limits``: the inputs that index an embedding table, and its rows
    (:attr:`pippy_xla.split.emit.StageGraph.index_limits`). ``label_rows``: the vocabulary
    the model's own loss reads the labels against (``None`` with a user ``loss_fn``): labels lie
    in ``[0, label_rows)`` or are the ignore index -100. ``ragged``: the rows' shares of the
    inputs whose dim 0 is not the rows (see [Note: images concatenated over a batch] in
    ``split/hf.py``)."""
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
    _check_rows(batch, first, ragged(batch) if ragged else {})
    _check_indices(batch, index_limits or {})
    if label_rows is not None:
        _check_indices(batch, {"labels": label_rows}, ignore=IGNORE_INDEX)
    m, dp = num_microbatches, dp_size
    if size % (m * dp) != 0:
        what = f"num_microbatches={m}"
        if dp > 1:
            what = f"data-parallel size {dp} x num_microbatches={m} = {dp * m}"
        raise ValueError(
            f"batch size {size} is not divisible by {what}; use a batch size that is a "
            f"multiple of {m * dp}"
        )
    return batch


def _check_rows(batch: Batch, first: str, shares: Mapping[str, torch.Tensor]) -> None:
    """Every input has the batch's rows in dim 0 (those of ``first``), or for a ragged input,
    the sum of its rows' ``shares``."""
    size = batch[first].shape[0]
    for k, v in batch.items():
        if k in shares and v.dim() > 0:
            if v.shape[0] != int(shares[k].sum()):
                raise ValueError(
                    f"batch['{k}'] has {v.shape[0]} entries in dim 0, but its rows' shares "
                    f"add up to {int(shares[k].sum())}"
                )
        elif v.dim() == 0 or v.shape[0] != size:
            raise ValueError(
                f"batch['{k}'] has shape {tuple(v.shape)}; every input needs batch size "
                f"{size} (that of '{first}') in dim 0"
            )


IGNORE_INDEX = -100
"""The label HF's losses skip."""


def _check_indices(
    batch: Batch, index_limits: Mapping[str, int], ignore: int | None = None
) -> None:
    """Values of inputs that index an embedding table (or, for the labels, the logits) lie in
    ``[0, rows)`` or equal ``ignore``: an id outside the vocabulary would fail deep inside one
    stage's step, with its peers mid-transfer."""
    for name, rows in index_limits.items():
        v = batch.get(name)
        if v is None or v.numel() == 0 or v.is_floating_point():
            continue
        low, high = (int(x) for x in torch.aminmax(v))
        if low >= 0 and high < rows:
            continue
        outside = v.lt(0).logical_or(v.ge(rows))
        if ignore is not None:
            outside = outside.logical_and(v.ne(ignore))
        if not bool(outside.any()):
            continue
        bad = outside.nonzero()[0].tolist()
        if ignore is None:
            what, allowed = f"indexes an embedding table of {rows} rows", f"[0, {rows})"
        else:
            what = f"is read by the model's loss against a vocabulary of {rows} tokens"
            allowed = f"[0, {rows}) or be {ignore} (ignored)"
        raise ValueError(
            f"batch['{name}'] holds {int(v[tuple(bad)])} at {tuple(bad)} (values "
            f"{low}..{high}), but it {what}: every value must lie in {allowed}; check the "
            "tokenizer's vocabulary against the model's (resize the embeddings for added tokens)"
        )


def replica_rows(size: int, dp_rank: int, dp_size: int) -> slice:
    """The rows of a global batch of ``size`` rows (a multiple of ``dp_size``) that replica
    ``dp_rank`` of ``dp_size`` runs: its equal contiguous share (see [Note: pipeline x data
    parallel])."""
    share = size // dp_size
    return slice(dp_rank * share, (dp_rank + 1) * share)


def split_batch(
    batch: Batch,
    *,
    num_microbatches: int,
    device: torch.device,
    dp_rank: int = 0,
    dp_size: int = 1,
    split: Collection[str] | None = None,
    ragged: RowShares | None = None,
) -> dict[str, tuple[torch.Tensor, ...]]:
    """A checked batch (:func:`check_batch`) split: per input of ``split`` (default: every input;
    a rank splits only what its stages read: 32 views of an input cost 15-40 us), this replica's
    rows (replica ``dp_rank`` of ``dp_size``: see [Note: pipeline x data parallel]) on ``device``
    in ``num_microbatches`` chunks; a ``ragged`` input cut at the same rows by its rows'
    shares."""
    shares = ragged(batch) if ragged else {}
    size = len(next(v for k, v in batch.items() if k not in shares))
    rows = replica_rows(size, dp_rank, dp_size)
    parts = {}
    for k, v in batch.items():
        if split is not None and k not in split:
            continue
        if k in shares:
            parts[k] = cut_ragged(v.to(device), shares[k], rows, num_microbatches)
            continue
        if dp_size > 1:
            v = v[rows]
        if v.device != device:
            v = v.to(device)
        parts[k] = v.chunk(num_microbatches)
    return parts


def cut_ragged(v: torch.Tensor, shares: torch.Tensor, rows: slice, chunks: int = 1) -> tuple:
    """A ragged input's entries of ``rows`` in ``chunks`` microbatches of equal rows, each row
    holding its ``shares`` of the entries."""
    ends = [0, *shares.cumsum(0).tolist()]
    step = (rows.stop - rows.start) // chunks
    starts = range(rows.start, rows.stop, step)
    return tuple(v[ends[a] : ends[a + step]] for a in starts)


@dataclass(frozen=True, slots=True)
class StepKey:
    """What every rank of the pipeline must agree on before a step's first transfer (see
    [Note: step handshake])."""

    kind: str
    """``"train"`` or ``"eval"``."""
    signature: int
    """A fingerprint of the batch's input names, dtypes and shapes."""
    content: int
    """A fingerprint of the batch's values, or 0 when the content check is off."""

    def words(self) -> list[int]:
        return [STEP_KINDS.index(self.kind), self.signature, self.content]


STEP_KINDS = ("train", "eval", "generate")
_RUN = {"train": "run_train", "eval": "run_eval", "generate": "generate"}


def step_key(kind: str, batch: Batch, check_content: bool) -> tuple[StepKey, list[int]]:
    """This rank's :class:`StepKey` for a step of ``kind`` on ``batch``, and the per-input
    content digests behind it, in sorted name order (empty when ``check_content`` is off).
    Computed in one C++ call (``_C.batch_key``: 51 -> 23 us in a step, where Python's own
    fingerprints ran cold; [Note: a step's own time] in _step.py)."""
    names = sorted(batch)
    key = _C.batch_key(names, [batch[k] for k in names], check_content)
    return StepKey(kind=kind, signature=key.signature, content=key.content), key.contents


class Gather(Protocol):
    def __call__(self, values: Sequence[int], what: str) -> list[list[int]]: ...


def agree_on_step(
    key: StepKey, contents: Sequence[int], batch: Batch, rank: int, gather: Gather
) -> None:
    """The step handshake: one all_gather of every rank's :class:`StepKey` (through ``gather``,
    an all_gather of int64s over the pipeline's group). Raises :class:`BatchMismatchError` on
    every rank, naming what differs, if any rank's key differs; see [Note: step handshake]."""
    everyone = gather(key.words(), "step handshake all_gather")
    if all(words == everyone[0] for words in everyone):
        return
    keys = [StepKey(STEP_KINDS[w[0]], w[1], w[2]) for w in everyone]
    peer = next((r for r, k in enumerate(keys) if k.kind != key.kind), None)
    if peer is not None:
        _mismatch(
            rank,
            peer,
            f"rank {peer} called {_RUN[keys[peer].kind]} while this rank called "
            f"{_RUN[key.kind]}; every rank of the pipeline must run the same steps in the same "
            "order (an evaluation on one rank only cannot run: call run_eval on every rank)",
        )
    peer = next((r for r, k in enumerate(keys) if k.signature != key.signature), None)
    if peer is not None:
        describe = {k: (tuple(batch[k].shape), batch[k].dtype) for k in sorted(batch)}
        _mismatch(
            rank,
            peer,
            f"rank {peer} got a batch with other inputs, shapes or dtypes than this rank's "
            f"{describe}; every rank must get the same batch shapes (the whole batch goes to "
            "every rank)",
        )
    # Equal shapes but other values: every rank gathers its per-input digests to name them.
    peer = next(r for r, k in enumerate(keys) if k.content != key.content)
    _mismatch(
        rank,
        peer,
        _content_cause(peer, gather(contents, "batch content digests all_gather"), batch),
    )


def _content_cause(peer: int, per_input: Sequence[Sequence[int]], batch: Batch) -> str:
    differ = [
        f"'{name}' (ranks {_groups([d[i] for d in per_input])})"
        for i, name in enumerate(sorted(batch))
        if len({d[i] for d in per_input}) > 1
    ]
    return (
        f"rank {peer} got a batch with the same shapes but other values in {', '.join(differ)}; "
        "every rank of a pipeline must pass the same batch (the same data, seed and order on "
        "every rank; a sampler that shards the data belongs to the data-parallel dimension only)"
    )


def _groups(values: Sequence[int]) -> str:
    """Ranks grouped by equal value: ``"0, 2 vs 1"``."""
    by: dict[int, list[int]] = {}
    for r, v in enumerate(values):
        by.setdefault(v, []).append(r)
    return " vs ".join(", ".join(map(str, rs)) for rs in by.values())


def _mismatch(rank: int, peer: int, cause: str) -> None:
    raise BatchMismatchError(
        rank=rank, failed_rank=rank, peer=peer, action="step handshake", cause=cause
    )
