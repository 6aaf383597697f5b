"""The failure machinery of a pipeline step: the abort channel that turns an error on one rank into
the same :class:`~pippy_xla.errors.PipelineError` on every rank, the watcher and worker threads
that fail a step fast when a peer fails, and the heartbeats that name a rank that died."""

from __future__ import annotations

import atexit
import logging
import os
import queue
import threading
import time
import weakref
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import NoReturn, TypeVar

import torch.distributed as dist

from pippy_xla._native import _C
from pippy_xla.errors import PipelineError

__all__ = ["AbortChannel", "FailureState", "check_mesh_usable"]

"""[Note: failing fast]

A step fails on one rank first: its stage code raised (a bug, a loss that raises, out of memory),
or a transfer failed (a peer died, a shape disagreed). That rank's peers are then blocked in
receives that will never complete. Waiting out the timeout (minutes) is what gloo alone would do,
and a rank that catches the exception and lives on (a notebook, a retrying loop) would never close
its sockets for gloo to notice. So:

- the failing rank posts an abort record, ``"<rank>\\n<exception text>"``, into the c10d store of
  the job (the rendezvous store every rank already shares) under a key of this pipeline;
- during every step a watcher thread of the rank (one per pipeline, started at its first step
  and armed at every step's start without being woken) checks that key every ``POLL_S``
  seconds; when it appears (within ``2 * POLL_S``), the watcher calls the engine's ``abort()``,
  which wakes the rank's blocked transfer waits (c10d's ``Work::abort``) so that its step fails
  at once;
- every rank raises a :class:`PipelineError` naming the rank that failed first and its exception
  text. The pipeline then refuses further steps (peers were left mid-step).

The first record wins (``compare_set``), so every rank names the same origin. A store that cannot
be reached (its host died) is ignored: the transport's own errors and timeouts still end the step.
"""

logger = logging.getLogger(__name__)

T = TypeVar("T")

POLL_S = 0.1
"""How often a rank checks the store for a peer's abort record during a step."""


def _none_if_negative(x: int) -> int | None:
    return None if x < 0 else x


def _cause(exc: BaseException) -> str:
    """``exc``'s text for a :class:`PipelineError`'s cause. A transfer's error starts with
    where it failed (``[rank 0] step handshake all_gather failed: ...``), which the
    :class:`PipelineError` already says: only what follows is kept."""
    text = str(exc)
    if isinstance(exc, _C.TransferError) and text.startswith("[rank ") and "] " in text:
        return text.split("] ", 1)[1].partition(": ")[2] or text
    return f"{type(exc).__name__}: {text}"


"""[Note: naming a dead rank]

When a rank dies (killed, out of memory, a crashed node), its peers' transfers fail with the
transport's words (gloo: "Connection reset by peer"), and the first survivor to fail would post
its own failure: the dead rank would be named nowhere and a survivor blamed. So every rank that
builds a pipeline runs one heartbeat thread per process, which adds 1 to its counter
``pippy_xla/alive/<global rank>`` in the job's store every ``HEARTBEAT_S`` seconds. A rank whose
transfer or collective fails (:class:`_C.TransferError`, not an error of its own stage's code)
watches its pipeline's counters for ``SILENT_S`` seconds before posting: if a rank's counter does
not move, that rank died, and the abort record (and every survivor's :class:`PipelineError`) names
it, with ``died=True``. A peer that is alive but slow or stuck keeps beating, so a timeout still
reads as a timeout.
"""


_GLOO_TRANSPORT = ("gloo/transport/", "Connection reset by peer", "Connection closed by peer")
"""Words of gloo's transport errors, which torch raises from its collectives as plain
``RuntimeError`` (measured: a peer SIGKILLed inside DCP's ``save``)."""


def _is_transport(exc: BaseException) -> bool:
    """Whether ``exc`` is a failure of communication (a transfer, a collective, or DCP's report
    of one on some rank), not of this rank's own code."""
    if isinstance(exc, _C.TransferError | dist.DistError):
        return True
    if isinstance(exc, RuntimeError) and any(w in str(exc) for w in _GLOO_TRANSPORT):
        return True
    failures = getattr(exc, "failures", None)  # DCP's CheckpointException: rank -> error
    if isinstance(failures, dict):
        errors = (f[0] if isinstance(f, tuple) else f for f in failures.values())
        return any(isinstance(e, BaseException) and _is_transport(e) for e in errors)
    return False


HEARTBEAT_S = 0.25
"""How often each rank adds to its liveness counter (see [Note: naming a dead rank])."""
SILENT_S = 1.5
"""How long a counter must stand still for its rank to count as dead."""


class _Heartbeat:
    """This process's liveness counter in the job's store: one daemon thread, stopped at exit."""

    _current: _Heartbeat | None = None

    def __init__(self, store, global_rank: int) -> None:
        self._store, self._key = store, self.key(global_rank)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._beat, name="pippy_xla-heartbeat", daemon=True)
        self._thread.start()

    @staticmethod
    def key(global_rank: int) -> str:
        return f"pippy_xla/alive/{global_rank}"

    @classmethod
    def ensure(cls, store, global_rank: int) -> None:
        """Starts the heartbeat unless one is beating for this rank."""
        beat = cls._current
        if beat is not None and beat._thread.is_alive() and beat._key == cls.key(global_rank):
            return
        if beat is not None:
            beat.stop()
        cls._current = cls(store, global_rank)

    def _beat(self) -> None:
        try:
            self._store.add(self._key, 1)
            while not self._stop.wait(HEARTBEAT_S):
                self._store.add(self._key, 1)
        except Exception:  # noqa: BLE001  (the store is gone: the job is over)
            return

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2 * HEARTBEAT_S)


@atexit.register
def _stop_heartbeat() -> None:
    if _Heartbeat._current is not None:
        _Heartbeat._current.stop()


"""[Note: watched collectives]

The engine's transfers fail fast because the watcher of [Note: failing fast] aborts their c10d
work. Every other collective of a pipeline cannot be aborted that way: the step handshake, the
tied-weight gradient sums, the loss broadcast and all-reduce, the gradient-norm all-reduce,
FSDP's all-gathers and reductions over the replicas (torch's own collectives, on the mesh's
data-parallel groups: the all-gathers run once before the engine's step, so that none runs
inside a stage's forward) and the collectives inside ``save``, ``load``, ``save_pretrained`` and
``load_pretrained`` (DCP's and ``all_gather_object``). Gloo's collectives
have no ``Work::abort``, and a peer that raised and lives on keeps its sockets open, so a rank
waiting for it would wait out the process group's timeout. So each of them runs through one
helper, :meth:`FailureState.watched` (:meth:`AbortChannel.call`):

- the collective runs on a daemon thread of the pipeline (one, started at the first such call
  and reused: a fresh thread per call cost 0.1-2 ms in a step, more than the collective itself;
  every collective releases the GIL while it waits), and the calling thread waits for it in
  slices of ``POLL_S`` seconds, checking the abort record between slices (no store traffic when
  the collective completes within the first slice, as it does in a healthy job);
- a peer's record (its own failure, or a rank it found dead) ends the wait at once: the caller
  raises :class:`PipelineError` naming that rank, ``aborted=True``; the collective's thread is
  left behind (a later call starts another) and ends when the transport fails (the failed peer
  exits) or at the collective's timeout (the pipeline is unusable from then on, as after any
  failed step). At exit, the process waits for such threads (at most ``ABANDONED_EXIT_S``
  seconds): one that returned from C++ during interpreter finalization would take the GIL
  there, and Python 3.11 ends it with ``pthread_exit``, whose unwinding through C++ kills the
  process with SIGABRT ("terminate called without an active exception"; seen in the tests
  before this wait), and it ends the idle ones;
- the collective's own error is this rank's failure: its record is posted (after the dead-rank
  check of [Note: naming a dead rank] when it is a transport error, gloo's or DCP's report of
  one), so the ranks still waiting are woken by it in turn.

Where a collective runs over shared memory (the step handshake, the loss broadcast and the
gradient-norm all-reduce of a pipeline whose whole group is on one host: [Note: small
collectives over shared memory] in csrc/transport/p2p.cpp), its waits can be aborted like the
engine's: :meth:`FailureState.watched` with ``abortable=True`` (:meth:`AbortChannel.call_abortable`)
runs it on the calling thread with an ``_C.Abortable`` armed in the step's watcher, which aborts
it when a peer's record appears (the caller then raises as above). The hand-off to the helper
thread and back cost 30-150 us per call in a rank process, the collective itself 2-5 us.

On a mesh the record spans every replica (the data-parallel groups cross the pipelines), and
the ranks a :class:`PipelineError` names are the job's ranks.
"""


ABANDONED_EXIT_S = 60.0
"""How long a process waits at exit for the collectives a peer's failure left behind."""

_ABANDONED: list[threading.Thread] = []


@atexit.register
def _join_abandoned() -> None:
    """Waits for the collectives' threads left behind by [Note: watched collectives]."""
    alive = [t for t in _ABANDONED if t.is_alive()]
    if alive:
        logger.info("waiting for %d collective(s) a failed peer left open", len(alive))
    deadline = time.monotonic() + ABANDONED_EXIT_S
    for t in alive:
        t.join(timeout=max(0.0, deadline - time.monotonic()))


class PeerFailed(Exception):
    """A watched wait ended because a peer posted its failure (see [Note: watched
    collectives])."""

    def __init__(self, origin: tuple[int, bool, str]) -> None:
        self.origin = origin
        super().__init__(f"rank {origin[0]} {'died' if origin[1] else 'failed'}: {origin[2]}")


class _Worker:
    """The daemon thread that runs an :class:`AbortChannel`'s watched collectives, one at a time
    (see [Note: watched collectives]). It lives as long as its channel, or until a peer's
    failure leaves it stuck in a collective."""

    def __init__(self) -> None:
        self.jobs: queue.SimpleQueue = queue.SimpleQueue()
        self.thread = threading.Thread(
            target=_Worker._loop, args=(self.jobs,), name="pippy_xla-collective", daemon=True
        )
        self.thread.start()
        _WORKERS.add(self)
        weakref.finalize(self, self.jobs.put, None)  # the channel is gone: the thread ends

    @staticmethod
    def _loop(jobs: queue.SimpleQueue) -> None:
        while (job := jobs.get()) is not None:
            fn, args, outcome, done = job
            try:
                outcome.append((True, fn(*args)))
            except BaseException as e:  # noqa: BLE001  (re-raised by the caller)
                outcome.append((False, e))
            finally:
                done.set()
            del job, fn, args, outcome, done  # nothing of a finished call stays alive


class _Watcher:
    """The daemon thread behind :meth:`AbortChannel.run_armed`: while a target (an engine's step, or
    an ``_C.Abortable`` given to a collective) is armed, it reads the abort record every
    ``POLL_S`` seconds and calls the target's ``abort()`` when a record appears. Started once
    per channel, so a step costs no thread start (it cost 100-250 us)."""

    def __init__(self, channel: AbortChannel) -> None:
        self._cv = threading.Condition()
        self._target = None
        self._step = 0  # bumped at every arm and disarm
        thread = threading.Thread(
            target=_Watcher._loop,
            args=(weakref.ref(self), weakref.ref(channel), self._cv),
            name="pippy_xla-abort-watch",
            daemon=True,
        )
        thread.start()

    def arm(self, target) -> None:
        """Watches ``target`` (with an ``abort()``) from now on (``None``: it ended). The thread
        is not woken: it looks every ``POLL_S`` seconds (waking it cost the caller 10-40 us per
        arming, as much as a step's handshake), so a record is seen within ``2 * POLL_S``."""
        with self._cv:
            self._target = target
            self._step += 1

    @staticmethod
    def _loop(me: weakref.ref, channel: weakref.ref, cv: threading.Condition) -> None:
        while True:
            with cv:
                while (watcher := me()) is not None and watcher._target is None:
                    del watcher
                    cv.wait(POLL_S)  # a timeout, so that a dropped channel ends the thread
                if watcher is None:
                    return
                step, target = watcher._step, watcher._target
                del watcher
            time.sleep(POLL_S)  # a step shorter than POLL_S never reads the store
            with cv:
                watcher = me()
                current = watcher is not None and watcher._step == step
                del watcher
            owner = channel() if current else None
            failed = owner is not None and owner.read() is not None
            del owner
            with cv:
                watcher = me()
                if watcher is not None and failed and watcher._step == step:
                    target.abort()
                    while watcher._step == step:  # one abort per arming
                        cv.wait(POLL_S)
                del watcher, target


_WORKERS: weakref.WeakSet[_Worker] = weakref.WeakSet()
"""Every live :class:`_Worker` (ended at exit unless a failure left it in a collective)."""


@atexit.register
def _stop_workers() -> None:
    """Ends the idle collective threads before the interpreter finalizes (a daemon thread that
    wakes during finalization is killed mid-C++; see [Note: watched collectives])."""
    for worker in list(_WORKERS):
        if worker.thread not in _ABANDONED:
            worker.jobs.put(None)
            worker.thread.join(timeout=1.0)


"""[Note: torchrun's store across restarts]

Under torchrun a rank's default store is, unless told otherwise, a TCPStore that the agent serves
(``TORCHELASTIC_USE_AGENT_STORE=True``), and torch 2.13's agent keeps that store, keys and all,
when ``--max-restarts`` restarts the ranks: the static rendezvous (torchrun's default) always, the
c10d one (``--standalone``, ``--rdzv-backend c10d``) unless ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``
(``DynamicRendezvousHandler.next_rendezvous`` makes its store server at the first round only;
``torch.distributed.rendezvous._create_c10d_store`` adds no prefix per attempt, assuming a new
store). Process group names repeat in every attempt (the default group's ``0``, ``new_group``'s
hash of its ranks), so gloo's rendezvous keys repeat too (``default_pg/0//cpu//0/1``: rank 1's
address): a restarted rank that reads a peer's key before the restarted peer wrote it gets the
killed rank's address, and its connect is refused (gloo retries 3 times and fails) or it waits out
the group's timeout. A pipeline's abort record stays too, the killed attempt's failure. Measured
(2 CPU cores): every restart failed so, a two-rank job of plain ``torch.distributed`` under either
rendezvous and ``examples/sft.py`` killed mid-run (5 runs of 5). A rank cannot tell a stale key from
a fresh one, and ``TORCHELASTIC_RESTART_COUNT`` cannot name the attempt for every rank: each agent
counts its own restarts (an agent restarted by another node's failure counts none). With the c10d
rendezvous and ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``, each attempt's rank 0 serves a new store
on a new ``MASTER_PORT``: nothing is stale. torch reads that variable in the agent, before any
rank runs, so a job cannot set it for itself; a rank launched the other way logs why, once
(:func:`warn_if_store_outlives_restarts`). ``docs/checkpoints.md`` shows the launch.
"""

_WARNED_STORE = False


def warn_if_store_outlives_restarts() -> None:
    """Logs, once per process, that torchrun restarts this job's ranks over a store that keeps
    the killed attempt's keys, and what to launch instead. See [Note: torchrun's store across
    restarts]."""
    global _WARNED_STORE
    restarts = os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0")
    shared = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    if _WARNED_STORE or not shared or not restarts.isdigit() or int(restarts) == 0:
        return
    _WARNED_STORE = True
    logger.warning(
        "[rank %s] torchrun restarts this job (--max-restarts %s) over its agent's store, which "
        "keeps the killed attempt's keys: restarted ranks can read a dead rank's gloo address "
        "(connect refused, or a hang). Launch torchrun with TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 "
        "and --standalone or --rdzv-backend c10d: a new store per attempt (docs/checkpoints.md)",
        os.environ.get("RANK", "?"),
        restarts,
    )


class AbortChannel:
    """The abort record of one pipeline in the job's c10d store. See [Note: failing fast]."""

    def __init__(
        self,
        group_name: str,
        instance: int,
        rank: int,
        global_ranks: Sequence[int] = (),
        peers: Sequence[int] | None = None,
    ) -> None:
        """``rank``: this rank among the record's ranks (those of the pipeline's group; on a
        mesh, every rank of the mesh by job rank). ``global_ranks``: the job-wide rank of each of
        them (whose liveness counters name a dead rank). ``peers``: the record's rank of each
        rank of the pipeline's group, where they differ (a mesh)."""
        self.key = f"pippy_xla/{group_name}/{instance}/abort"
        self.rank = rank
        self.global_ranks = list(global_ranks)
        self.peers = None if peers is None else list(peers)
        try:
            self._store = dist.distributed_c10d._get_default_store()
        except Exception:  # noqa: BLE001  (no store: failing fast is off, timeouts remain)
            self._store = None
        if self._store is not None and self.global_ranks:
            _Heartbeat.ensure(self._store, self.global_ranks[rank])
        warn_if_store_outlives_restarts()
        self._worker: _Worker | None = None  # runs call()'s collectives, started on first use
        self._watcher: _Watcher | None = None  # run_armed()'s poller, started on first use

    def announce(self, text: str, origin: int | None = None, died: bool = False) -> None:
        """Posts a failure (this rank's, or the death of rank ``origin``) unless another came
        first."""
        if self._store is None:
            return
        origin = self.rank if origin is None else origin
        record = f"{origin}\n{'died' if died else 'failed'}\n{text}"
        try:
            self._store.compare_set(self.key, "", record)
        except Exception as e:  # noqa: BLE001
            logger.warning("[rank %d] could not post the abort record: %s", self.rank, e)

    def read(self) -> tuple[int, bool, str] | None:
        """The first failure any rank posted: ``(rank, died, text)``, or ``None``."""
        if self._store is None:
            return None
        try:
            if not self._store.check([self.key]):
                return None
            rank, kind, text = self._store.get(self.key).decode().split("\n", 2)
            return int(rank), kind == "died", text
        except Exception:  # noqa: BLE001  (an unreachable store says nothing)
            return None

    def dead_ranks(self) -> list[int]:
        """The pipeline's ranks whose liveness counter did not move for ``SILENT_S`` seconds
        (see [Note: naming a dead rank])."""
        if self._store is None or not self.global_ranks:
            return []
        keys = [_Heartbeat.key(g) for g in self.global_ranks]
        try:
            start = [self._store.add(k, 0) for k in keys]
            silent = set(range(len(keys)))
            deadline = time.monotonic() + SILENT_S
            while silent and time.monotonic() < deadline:
                time.sleep(HEARTBEAT_S)
                silent = {r for r in silent if self._store.add(keys[r], 0) == start[r]}
        except Exception:  # noqa: BLE001  (an unreachable store says nothing)
            return []
        return sorted(silent)

    def call(self, fn: Callable[..., T], *args) -> T:
        """``fn(*args)``, a collective, run so that a peer's failure ends the wait: raises
        :class:`PeerFailed` as soon as a peer's record appears. See [Note: watched
        collectives]."""
        if self._store is None:
            return fn(*args)
        worker = self._worker
        if worker is None:
            worker = self._worker = _Worker()
        outcome: list = []
        done = threading.Event()
        worker.jobs.put((fn, args, outcome, done))
        while not done.wait(POLL_S):
            origin = self.read()
            if origin is not None and (origin[0] != self.rank or origin[1]):
                # Stuck in fn: it ends once fn returns (the transport fails, or its timeout);
                # a later call starts another.
                worker.jobs.put(None)
                _ABANDONED.append(worker.thread)
                self._worker = None
                raise PeerFailed(origin)
        ok, value = outcome[0]
        if ok:
            return value
        raise value

    def call_abortable(self, fn: Callable[..., T], *args) -> T:
        """``fn(*args, abortable=...)``, a collective whose waits the ``_C.Abortable`` it is given
        can end, run on this thread: a peer's record aborts it, which raises
        :class:`PeerFailed`. See [Note: watched collectives]."""
        if self._store is None:
            return fn(*args)
        abortable = _C.Abortable()
        try:
            return self.run_armed(abortable, fn, *args, abortable=abortable)
        except BaseException:
            origin = self.read()
            if origin is not None and (origin[0] != self.rank or origin[1]):
                raise PeerFailed(origin) from None
            raise

    def run_armed(self, target, fn: Callable[..., T], *args, **kwargs) -> T:
        """``fn(*args, **kwargs)``, during which ``target.abort()`` (an engine's, which aborts its
        step, or an ``_C.Abortable``'s) is called as soon as a peer posts a failure. A plain
        ``try`` / ``finally``: a generator context manager cost 2-3 us a step hot, 10 cold
        ([Note: a step's own time])."""
        self._arm(target)
        try:
            return fn(*args, **kwargs)
        finally:
            self._arm(None)

    def _arm(self, target) -> None:
        if self._store is None:
            return
        if self._watcher is None:
            self._watcher = _Watcher(self)
        self._watcher.arm(target)

    def error(
        self, exc: BaseException, action: str, failure: _C.Failure | None = None
    ) -> PipelineError:
        """The :class:`PipelineError` for ``exc``, raised here while running ``action`` (at
        ``failure``, the engine's record of where its step failed, if it was one). Posts this
        rank's failure first if no peer's came before it."""
        peer_failed = isinstance(exc, PeerFailed)
        aborted = (failure is not None and failure.aborted) or peer_failed
        where = {"action": action, "stage": None, "microbatch": None, "peer": None}
        if failure is not None and not peer_failed:
            peer = _none_if_negative(failure.peer)
            where = {
                "action": failure.action or action,
                "stage": _none_if_negative(failure.stage),
                "microbatch": _none_if_negative(failure.microbatch),
                "peer": peer if peer is None or self.peers is None else self.peers[peer],
            }
        own = _cause(exc)
        if not aborted:
            transport = _is_transport(exc) and self.read() is None
            dead = self.dead_ranks() if transport else []
            if dead:
                self.announce(own, origin=dead[0], died=True)
            else:
                self.announce(own)
        origin = self.read()
        if origin is None or (origin[0] == self.rank and not origin[1]):
            return PipelineError(rank=self.rank, failed_rank=self.rank, cause=own, **where)
        failed_rank, died, text = origin
        return PipelineError(
            rank=self.rank,
            failed_rank=failed_rank,
            cause=own if died and not aborted else text,
            aborted=aborted,
            died=died,
            **where,
        )


_MESHES_LEFT_MID_STEP: dict[tuple, str] = {}
"""The layouts (:func:`_mesh_key`) of the meshes a failed step of a pipeline left mid-step -> the
failure (see [Note: a pipeline's own groups] in ``_build.py``)."""


def _mesh_key(mesh) -> tuple:
    """What makes two ``DeviceMesh`` objects equal: their ranks, shape, device type and dim names.
    torch's DTensor caches its sharding decisions by mesh equality, so a mesh equal to one that a
    failed step left goes on reaching that mesh's process groups (measured under torch 2.13: a
    gradient of a pipeline built on a new, equal mesh carried the old mesh, and gathering it
    waited on the old group)."""
    return (
        tuple(mesh.mesh.flatten().tolist()),
        tuple(mesh.mesh.shape),
        mesh.device_type,
        mesh.mesh_dim_names,
    )


def check_mesh_usable(mesh) -> None:
    """Raises ``RuntimeError`` if a pipeline's failed step left a mesh equal to ``mesh``
    mid-step."""
    failure = _MESHES_LEFT_MID_STEP.get(_mesh_key(mesh))
    if failure is not None:
        raise RuntimeError(
            f"[rank {dist.get_rank()}] a pipeline on a DeviceMesh of this layout and dim names "
            f"failed mid-step ({failure}); torch's DTensor caches give every such mesh the process "
            "groups that step left mid-collective, so build the mesh with other dim names "
            "(passed as dp_dim, pp_dim and tp_dim) or resume in a new job from the last checkpoint"
        )


class FailureState:
    """Failure handling of one pipeline: turns an exception on this rank into the
    :class:`PipelineError` every rank raises (posting this rank's failure first; see [Note:
    failing fast]) and, once a step failed, refuses further steps (the peers were left mid-step)
    and marks the pipeline's mesh, if it has one (see [Note: a pipeline's own groups] in
    ``_build.py``)."""

    def __init__(self, abort: AbortChannel, rank: int, mesh=None) -> None:
        self.abort = abort
        """This pipeline's abort record in the job's store."""
        self.rank = rank
        self.mesh = mesh
        """The pipeline's ``DeviceMesh``, if it has one."""
        self.failed: PipelineError | None = None
        """The error that made the pipeline unusable, if any."""

    def check_usable(self) -> None:
        """Raises if an earlier step failed."""
        if self.failed is not None:
            fresh = "on a mesh with other dim names " if self.mesh is not None else ""
            raise PipelineError(
                rank=self.rank,
                failed_rank=self.failed.failed_rank,
                action="step",
                cause=(
                    f"the pipeline failed in an earlier step and its peers were left mid-step "
                    f"({self.failed}); build a new PipelineModel {fresh}to go on (see "
                    "docs/runtime.md, recovering after a failure)"
                ),
            )

    def error(self, exc: BaseException, action: str, engine=None) -> BaseException:
        """The error to raise for ``exc`` raised while running ``action`` (in ``engine``'s step,
        if given); the pipeline is then unusable, and so is its mesh. Non-``Exception`` errors
        (``KeyboardInterrupt``) keep their type."""
        err = self.abort.error(exc, action, engine.failure() if engine is not None else None)
        self.failed = err
        if self.mesh is not None:
            _MESHES_LEFT_MID_STEP[_mesh_key(self.mesh)] = str(err)
        if not isinstance(exc, Exception):
            return exc
        logger.error("%s", err)
        return err

    def watched(self, action: str, fn: Callable[..., T], *args, abortable: bool = False) -> T:
        """``fn(*args)``, a collective outside the engine, run as ``action``: a peer's failure
        ends the wait within ``POLL_S`` seconds, and any failure becomes :meth:`error`'s.
        ``abortable``: ``fn`` takes an ``abortable=`` (an ``_C.Abortable``) that ends its waits,
        so it runs on this thread (see [Note: watched collectives])."""
        try:
            if abortable:
                return self.abort.call_abortable(fn, *args)
            return self.abort.call(fn, *args)
        except BaseException as e:
            self._raise(e, action, None)

    def run_step(self, engine, *args) -> None:
        """``engine.run(*args)``, a step's engine run: a peer's posted failure aborts it early
        (see :meth:`AbortChannel.run_armed`), and any failure becomes :meth:`error`'s."""
        try:
            self.abort.run_armed(engine, engine.run, *args)
        except BaseException as e:
            self._raise(e, "step", engine)

    @contextmanager
    def guard(self, action: str) -> Iterator[None]:
        """Runs the block as ``action`` of a step (work outside the engine and its collectives):
        any failure becomes :meth:`error`'s."""
        try:
            yield
        except BaseException as e:
            self._raise(e, action, None)

    def _raise(self, e: BaseException, action: str, engine) -> NoReturn:
        """Raises ``e`` as the failure of ``action`` (see :meth:`error`)."""
        if e is self.failed:  # a watched collective inside the block already reported it
            raise e
        err = self.error(e, action, engine)
        if err is e:
            raise e
        raise err from e
