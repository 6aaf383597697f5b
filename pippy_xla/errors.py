"""Failures of a pipeline step: one error type on every rank, and failing fast when a peer fails."""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING

import torch.distributed as dist

if TYPE_CHECKING:
    from pippy_xla._native import _C

__all__ = ["AbortChannel", "BatchMismatchError", "FailureState", "PipelineError"]

"""[Note: failing fast]

A step fails on one rank first: its stage code raised (a bug, a loss that raises, out of memory),
or a transfer failed (a peer died, a shape disagreed). That rank's peers are then blocked in
receives that will never complete. Waiting out the timeout (minutes) is what gloo alone would do,
and a rank that catches the exception and lives on (a notebook, a retrying loop) would never close
its sockets for gloo to notice. So:

- the failing rank posts an abort record, ``"<rank>\\n<exception text>"``, into the c10d store of
  the job (the rendezvous store every rank already shares) under a key of this pipeline;
- during every step each rank runs a small watcher thread that checks that key every
  ``POLL_S`` seconds; when it appears, the watcher calls the engine's ``abort()``, which wakes the
  rank's blocked transfer waits (c10d's ``Work::abort``) so that its step fails at once;
- every rank raises a :class:`PipelineError` naming the rank that failed first and its exception
  text. The pipeline then refuses further steps (peers were left mid-step).

The first record wins (``compare_set``), so every rank names the same origin. A store that cannot
be reached (its host died) is ignored: the transport's own errors and timeouts still end the step.
"""

logger = logging.getLogger(__name__)

POLL_S = 0.1
"""How often a rank checks the store for a peer's abort record during a step."""


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
            fast]), not by its own error, a timeout or the transport.
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
    ) -> None:
        self.rank, self.failed_rank, self.action, self.cause = rank, failed_rank, action, cause
        self.stage, self.microbatch, self.peer, self.aborted = stage, microbatch, peer, aborted
        where = f"[rank {rank}"
        if stage is not None:
            where += f" stage {stage}"
        where += f"] {action}"
        if microbatch is not None:
            where += f" microbatch {microbatch}"
        if peer is not None:
            where += f" (peer rank {peer})"
        origin = "failed" if failed_rank == rank else f"aborted: rank {failed_rank} failed"
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


_FIELDS = ("rank", "failed_rank", "action", "cause", "stage", "microbatch", "peer", "aborted")


def _rebuild(kwargs: dict) -> PipelineError:
    return PipelineError(**kwargs)


def _rebuild_mismatch(kwargs: dict) -> BatchMismatchError:
    return BatchMismatchError(**kwargs)


def _none_if_negative(x: int) -> int | None:
    return None if x < 0 else x


class AbortChannel:
    """The abort record of one pipeline in the job's c10d store. See [Note: failing fast]."""

    def __init__(self, group_name: str, instance: int, rank: int) -> None:
        self.key = f"pippy_xla/{group_name}/{instance}/abort"
        self.rank = rank
        try:
            self._store = dist.distributed_c10d._get_default_store()
        except Exception:  # noqa: BLE001  (no store: failing fast is off, timeouts remain)
            self._store = None

    def announce(self, text: str) -> None:
        """Posts this rank's failure unless another rank's came first."""
        if self._store is None:
            return
        try:
            self._store.compare_set(self.key, "", f"{self.rank}\n{text}")
        except Exception as e:  # noqa: BLE001
            logger.warning("[rank %d] could not post the abort record: %s", self.rank, e)

    def read(self) -> tuple[int, str] | None:
        """The first failure any rank posted: ``(rank, text)``, or ``None``."""
        if self._store is None:
            return None
        try:
            if not self._store.check([self.key]):
                return None
            rank, _, text = self._store.get(self.key).decode().partition("\n")
            return int(rank), text
        except Exception:  # noqa: BLE001  (an unreachable store says nothing)
            return None

    @contextmanager
    def watch(self, engine) -> Iterator[None]:
        """While the block runs, aborts ``engine``'s step as soon as a peer posts a failure."""
        if self._store is None:
            yield
            return
        stop = threading.Event()

        def poll() -> None:
            while not stop.wait(POLL_S):
                if self.read() is not None:
                    engine.abort()
                    return

        thread = threading.Thread(target=poll, name="pippy_xla-abort-watch", daemon=True)
        thread.start()
        try:
            yield
        finally:
            stop.set()
            thread.join()

    def error(
        self, exc: BaseException, action: str, failure: _C.Failure | None = None
    ) -> PipelineError:
        """The :class:`PipelineError` for ``exc``, raised here while running ``action`` (at
        ``failure``, the engine's record of where its step failed, if it was one). Posts this
        rank's failure first if no peer's came before it."""
        aborted = failure is not None and failure.aborted
        where = {"action": action, "stage": None, "microbatch": None, "peer": None}
        if failure is not None:
            where = {
                "action": failure.action or action,
                "stage": _none_if_negative(failure.stage),
                "microbatch": _none_if_negative(failure.microbatch),
                "peer": _none_if_negative(failure.peer),
            }
        own = f"{type(exc).__name__}: {exc}"
        if not aborted:
            self.announce(own)
        origin = self.read()
        if origin is None or origin[0] == self.rank:
            return PipelineError(rank=self.rank, failed_rank=self.rank, cause=own, **where)
        return PipelineError(
            rank=self.rank,
            failed_rank=origin[0],
            cause=origin[1],
            aborted=aborted,
            **where,
        )


class FailureState:
    """Failure handling of one pipeline: turns an exception on this rank into the
    :class:`PipelineError` every rank raises (posting this rank's failure first; see [Note:
    failing fast]) and, once a step failed, refuses further steps (the peers were left mid-step).
    """

    def __init__(self, abort: AbortChannel, rank: int) -> None:
        self.abort = abort
        """This pipeline's abort record in the job's store."""
        self.rank = rank
        self.failed: PipelineError | None = None
        """The error that made the pipeline unusable, if any."""

    def check_usable(self) -> None:
        """Raises if an earlier step failed."""
        if self.failed is not None:
            raise PipelineError(
                rank=self.rank,
                failed_rank=self.failed.failed_rank,
                action="step",
                cause=(
                    f"the pipeline failed in an earlier step and its peers were left mid-step "
                    f"({self.failed}); restart the job"
                ),
            )

    def error(self, exc: BaseException, action: str, engine=None) -> BaseException:
        """The error to raise for ``exc`` raised while running ``action`` (in ``engine``'s step,
        if given); the pipeline is then unusable. Non-``Exception`` errors
        (``KeyboardInterrupt``) keep their type."""
        err = self.abort.error(exc, action, engine.failure() if engine is not None else None)
        self.failed = err
        if not isinstance(exc, Exception):
            return exc
        logger.error("%s", err)
        return err

    @contextmanager
    def guard(self, action: str, engine=None) -> Iterator[None]:
        """Runs the block as ``action`` of a step: any failure becomes :meth:`error`'s.
        Communication outside the engine (collectives, tied weights) fails through the transport
        or the process group's timeout; an engine step (``engine`` given) is also aborted early
        by a peer's record, see :meth:`AbortChannel.watch`."""
        try:
            if engine is None:
                yield
            else:
                with self.abort.watch(engine):
                    yield
        except BaseException as e:
            err = self.error(e, action, engine)
            if err is e:
                raise
            raise err from e
