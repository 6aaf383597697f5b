"""The errors a pipeline step raises: one type on every rank (:class:`PipelineError`), and
:class:`BatchMismatchError` for batches that disagree across ranks. The machinery that turns a
failure on one rank into the same error on all of them is :mod:`pippy_xla.runtime.failures`."""

from __future__ import annotations

__all__ = ["BatchMismatchError", "PipelineError"]


class PipelineError(RuntimeError):
    """A pipeline step failed; raised on every rank of the pipeline that takes part.

    Attributes:
        rank: this rank (in the pipeline's group).
        failed_rank: the rank where the failure started (``rank`` itself, or a peer that
            reported it).
        stage: the stage of the action this rank was running or waiting on (``None`` if none).
        microbatch: that action's microbatch (``None`` if none).
        action: the action (``F``, ``B``, ``W``, ``SF``, ``RF``, ``SB``, ``RB``) or the
            collective (``"loss broadcast"``, ...) that failed here.
        peer: the rank that action exchanged data with, if any.
        cause: the underlying error's text (the failing rank's exception, or the transport's).
        aborted: this rank's step was stopped by a peer's abort record (see [Note: failing
            fast] in :mod:`pippy_xla.runtime.failures`), not by its own error, a timeout or
            the transport.
        died: ``failed_rank`` died: the transport failed and that rank stopped answering the
            job's store (see [Note: naming a dead rank]).
    """

    def __init__(
        self,
        *,
        rank: int,
        failed_rank: int,
        action: str,
        cause: str,
        stage: int | None = None,
        microbatch: int | None = None,
        peer: int | None = None,
        aborted: bool = False,
        died: bool = False,
    ) -> None:
        self.rank, self.failed_rank, self.action, self.cause = rank, failed_rank, action, cause
        self.stage, self.microbatch, self.peer, self.aborted = stage, microbatch, peer, aborted
        self.died = died
        where = f"[rank {rank}"
        if stage is not None:
            where += f" stage {stage}"
        where += f"] {action}"
        if microbatch is not None:
            where += f" microbatch {microbatch}"
        if peer is not None:
            where += f" (peer rank {peer})"
        if died:
            origin = f"failed: rank {failed_rank} died (it stopped answering the job's store)"
        elif failed_rank == rank:
            origin = "failed"
        else:
            origin = f"aborted: rank {failed_rank} failed"
        super().__init__(f"{where} {origin}: {cause}")

    def __reduce__(self):
        kwargs = {k: getattr(self, k) for k in _FIELDS}
        return (_rebuild, (kwargs,))


class BatchMismatchError(PipelineError, ValueError):
    """Ranks were given batches of different shapes or dtypes (found before any transfer; the
    pipeline stays usable)."""

    def __reduce__(self):
        kwargs = {k: getattr(self, k) for k in _FIELDS}
        return (_rebuild_mismatch, (kwargs,))


_FIELDS = (
    "rank",
    "failed_rank",
    "action",
    "cause",
    "stage",
    "microbatch",
    "peer",
    "aborted",
    "died",
)


def _rebuild(kwargs: dict) -> PipelineError:
    return PipelineError(**kwargs)


def _rebuild_mismatch(kwargs: dict) -> BatchMismatchError:
    return BatchMismatchError(**kwargs)
