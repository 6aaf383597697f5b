"""The one spawn helper for multi-rank runs: the tests' and the benchmarks'.

``run_ranks(world_size, fn, *args)`` starts ``world_size`` fresh processes, gives each a gloo
process group with a short timeout, runs ``fn(rank, world_size, *args)`` in each and returns the
ranks' return values. A rank that raises, dies or outlives ``timeout`` fails the test with every
rank's traceback, and all ranks are killed: a bug fails fast instead of hanging CI.

[Note: ranks forked from a preloaded server] A rank started by ``spawn`` is a new interpreter
that imports torch and transformers before it runs anything: 3-5 s of CPU per rank on CI's 2
cores (a 2-rank run took 5.4 s, a 4-rank one 12 s, for a function that returns at once), most of
the suite's time. Ranks of a function defined in an importable module are therefore forked from
multiprocessing's forkserver, which imports torch, transformers, pippy_xla and that module once
per session (0.1-0.2 s per run after the first, for the same function; the suite went from 22 to
13 minutes). The server starts once: the modules of later callers, and what they import, are
imported by every rank it forks unless :func:`preload` named them before the first run (the
suite's conftest names its helpers and every collected test module). What a forked rank does
not get: interpreter finalization (a forked child ends with ``os._exit``), so the worker runs
the ``atexit`` handlers itself (``atexit._run_exitfuncs``; pippy_xla's exit hook among them)
and the clean-exit check below still sees a crash in them; its own hash seed (``rank_env``
runs spawn); the parent's environment at call time (the server's is the parent's when it
started). ``spawn`` remains for ``backend="nccl"``, for
``rank_env`` and for functions of ``__main__`` (the benchmarks), and on request
(``start_method="spawn"``). User jobs run under torchrun, whose ranks are interpreters of their
own; the README's jobs are tested that way.

``backend="nccl"`` (GPU tests) puts every rank on ``cuda:0`` with its own ``NCCL_HOSTID``: NCCL
refuses two ranks on one GPU of one host, and with distinct host ids it treats them as two hosts
and carries the traffic over its socket transport. Such runs test correctness, not scaling.
"""

from __future__ import annotations

import atexit
import datetime
import faulthandler
import gc
import multiprocessing as mp
import os
import queue
import signal
import socket
import sys
import tempfile
import time
import traceback
import weakref
from collections.abc import Callable
from typing import Any

__all__ = ["EXIT_TIMEOUT_S", "PG_TIMEOUT_S", "preload", "run_ranks"]

# Long enough for a slow CI machine to finish one collective, short enough to fail fast.
PG_TIMEOUT_S = 60.0
# How long a rank that returned its result may take to tear down and exit.
EXIT_TIMEOUT_S = 30.0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


_PRELOAD = [
    "torch",
    "torch.distributed",
    "transformers",
    "transformers.modeling_utils",
    "pippy_xla",
]
"""What the forkserver imports before it forks any rank, with the first caller's module and what
:func:`preload` added. ``transformers`` imports its model stack lazily: ``modeling_utils`` (with
``torch.distributed.tensor``, ``torch._dynamo`` and the loss modules) is 1-2 s of CPU that every
rank building an HF model would pay again."""


def preload(*modules: str) -> None:
    """Adds ``modules`` to what the forkserver imports when it starts (see [Note: ranks forked
    from a preloaded server]): the modules the ranks' functions live in and import, so that a
    forked rank does not import them itself. The tests' own helpers (``tests/models.py`` imports
    every family's model classes) cost a rank 2.2 s of CPU: 4.4 s per 2-rank test, most of a
    short test's time. No effect once the server runs (call it before the first run)."""
    _PRELOAD.extend(m for m in modules if m not in _PRELOAD)


def _context(fn: Callable[..., Any], start_method: str | None, spawn_only: bool):
    """The multiprocessing context that starts the ranks; see [Note: ranks forked from a
    preloaded server]."""
    module = getattr(fn, "__module__", None)
    if start_method is None:
        importable = module not in (None, "__main__", "__mp_main__")
        start_method = "forkserver" if importable and not spawn_only else "spawn"
    ctx = mp.get_context(start_method)
    if start_method == "forkserver":
        ctx.set_forkserver_preload([*_PRELOAD, module])  # used when the server starts
        _warm_up(ctx)
    return ctx


_forkserver_warm = False
"""Whether this process's forkserver has forked a process yet (see :func:`_warm_up`)."""


def _warm_up(ctx) -> None:
    """Forks one trivial process from the forkserver the first time: the server's start and
    imports (seconds) are then not counted against the first run's deadline.

    The server is a new interpreter whose ``sys.path`` is its own: Python 3.11's forkserver is
    handed the caller's ``sys.path`` and does not apply it before importing what it preloads,
    and it skips a module it cannot import without a word. So a module found through an entry
    the caller added at run time (the tests' helpers: conftest puts ``tests/`` on ``sys.path``)
    was imported again by every rank, on unpickling its function: 2-3 s of CPU per rank, 180 s
    of the suite's. The server starts with the caller's ``sys.path`` in its ``PYTHONPATH``."""
    global _forkserver_warm
    if not _forkserver_warm:
        path = os.pathsep.join(p for p in sys.path if p)
        saved = os.environ.get("PYTHONPATH")
        os.environ["PYTHONPATH"] = path if not saved else path + os.pathsep + saved
        try:
            p = ctx.Process(target=time.sleep, args=(0,))
            p.start()
            p.join()
        finally:
            if saved is None:
                del os.environ["PYTHONPATH"]
            else:
                os.environ["PYTHONPATH"] = saved
        _forkserver_warm = True


_STACK_FILE = None
"""This rank's open stack file (kept open for faulthandler until the process ends)."""


def _worker(rank, world_size, port, fn, args, results, pg_timeout, backend, forked, stacks):
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_RANK="0" if backend == "nccl" else str(rank),
        LOCAL_WORLD_SIZE="1" if backend == "nccl" else str(world_size),
    )
    if backend == "nccl":
        os.environ["NCCL_HOSTID"] = f"host{rank}"
    # A rank that dies by a signal (a crash, or the parent's SIGABRT when it hangs) writes every
    # thread's Python stack to a file the parent reads into its report: a forked rank's own
    # stderr is the forkserver's, which may be an earlier test's captured one.
    global _STACK_FILE
    _STACK_FILE = open(os.path.join(stacks, f"rank{rank}"), "w")  # noqa: SIM115
    faulthandler.enable(file=_STACK_FILE, all_threads=True)
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    # What the rank holds before ``fn`` runs (the imported modules: 358,000 objects once torch,
    # transformers and the tests' helpers are in) is frozen out of the garbage collector, which
    # a full collection would walk each time: a rank function that collects after each of its cases
    # (the planner's measured peaks, 40 pipelines per rank) spent 43% of its time there.
    gc.freeze()
    try:
        dist.init_process_group(
            backend,
            rank=rank,
            world_size=world_size,
            timeout=datetime.timedelta(seconds=pg_timeout),
        )
        out = fn(rank, world_size, *args)
        results.put((rank, "ok", out))
    except BaseException:  # noqa: BLE001  (reported to the parent)
        results.put((rank, "error", traceback.format_exc()))
    finally:
        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:  # noqa: BLE001
                pass
        if forked:  # what an interpreter's exit would run: see [Note: ranks forked ...]
            _skip_operator_deregistration()
            atexit._run_exitfuncs()


def _skip_operator_deregistration() -> None:
    """Leaves out of a forked rank's exit the finalizers that deregister each
    ``torch.library.Library``'s operators (1.4% of the samples of a profile of the whole suite):
    the process ends with ``os._exit`` right after, and nothing runs an operator in between."""
    import torch.library

    for f, info in list(weakref.finalize._registry.items()):
        if info.func is torch.library._del_library:
            f.atexit = False


def run_ranks(
    world_size: int,
    fn: Callable[..., Any],
    *args: Any,
    timeout: float = 240.0,
    pg_timeout: float = PG_TIMEOUT_S,
    may_exit: tuple[int, ...] = (),
    backend: str = "gloo",
    rank_env: dict[int, dict[str, str]] | None = None,
    start_method: str | None = None,
) -> list[Any]:
    """Runs ``fn(rank, world_size, *args)`` on ``world_size`` ranks; returns their results.

    Ranks listed in ``may_exit`` may end their process without reporting (tests of dead
    peers); their result is ``None``. ``rank_env[r]`` is added to rank ``r``'s environment
    before its interpreter starts (``PYTHONHASHSEED``, as torchrun's ranks each have their own).
    ``start_method``: ``"spawn"`` or ``"forkserver"``; by default forkserver where it can (see
    [Note: ranks forked from a preloaded server]).
    """
    ctx = _context(fn, start_method, spawn_only=backend == "nccl" or bool(rank_env))
    forked = ctx.get_start_method() != "spawn"
    results = ctx.Queue()
    port = _free_port()
    with tempfile.TemporaryDirectory(prefix="pippy_xla_stacks_") as stacks:
        procs = [
            ctx.Process(
                target=_worker,
                args=(r, world_size, port, fn, args, results, pg_timeout, backend, forked, stacks),
            )
            for r in range(world_size)
        ]
        for r, p in enumerate(procs):
            _start_with_env(p, (rank_env or {}).get(r, {}))
        outs: dict[int, tuple[str, Any]] = {}
        try:
            _collect(procs, results, outs, time.monotonic() + timeout)
        finally:
            _stop(procs, outs)
        problems = [
            text + _stacks(stacks, r)
            for r in range(world_size)
            if (text := _problem(r, procs[r], outs, may_exit, timeout))
        ]
    if problems:
        raise AssertionError("multi-rank test failed:\n" + "\n".join(problems))
    return [outs[r][1] if outs[r][0] == "ok" else None for r in range(world_size)]


def _start_with_env(p, extra: dict[str, str]) -> None:
    """Starts ``p`` with ``extra`` added to the environment it inherits."""
    saved = {k: os.environ.get(k) for k in extra}
    os.environ.update(extra)
    try:
        p.start()
    finally:
        for k, v in saved.items():
            if v is None:
                del os.environ[k]
            else:
                os.environ[k] = v


def _collect(procs: list, results, outs: dict[int, tuple[str, Any]], deadline: float) -> None:
    """Fills ``outs`` with each rank's ``(status, value)`` until every rank reported, one failed
    (its peers get a moment to report their side), or ``deadline`` passed."""
    world_size = len(procs)
    while len(outs) < world_size:
        try:
            rank, status, value = results.get(timeout=0.5)
            outs[rank] = (status, value)
            if status == "error":
                # Give peers a moment to report their side of the failure, then stop.
                end = time.monotonic() + 10
                while len(outs) < world_size and time.monotonic() < end:
                    try:
                        r2, s2, v2 = results.get(timeout=0.5)
                        outs[r2] = (s2, v2)
                    except queue.Empty:
                        pass
                return
        except queue.Empty:
            pass
        for r, p in enumerate(procs):
            if r not in outs and not p.is_alive() and p.exitcode is not None:
                _drain(results, outs)  # what it may have put just before exiting
                if r not in outs:
                    outs[r] = ("exited", p.exitcode)
        if time.monotonic() > deadline:
            return


def _drain(results, outs: dict[int, tuple[str, Any]]) -> None:
    try:
        while True:
            rank, status, value = results.get(timeout=0.2)
            outs[rank] = (status, value)
    except queue.Empty:
        pass


def _stop(procs: list, outs: dict[int, tuple[str, Any]]) -> None:
    """Ends every rank's process."""
    # Ranks that returned their result must also exit by themselves, cleanly: a crash or a
    # hang at teardown fails a job under torchrun just as an error does.
    if all(outs.get(r, ("",))[0] in ("ok", "exited") for r in range(len(procs))):
        end = time.monotonic() + EXIT_TIMEOUT_S
        for p in procs:
            p.join(timeout=max(0.1, end - time.monotonic()))
    # A rank still running past the deadline hangs: SIGABRT makes faulthandler (enabled in
    # every rank) write all its threads' Python stacks before it dies.
    hung = [p for r, p in enumerate(procs) if r not in outs and p.is_alive()]
    for p in hung:
        os.kill(p.pid, signal.SIGABRT)
    for p in hung:
        p.join(timeout=5)
    for p in procs:
        if p.is_alive():
            p.kill()
    for p in procs:
        p.join(timeout=10)


def _stacks(stacks: str, rank: int) -> str:
    """What rank ``rank``'s faulthandler wrote (its threads' stacks, if a signal ended it)."""
    try:
        with open(os.path.join(stacks, f"rank{rank}")) as f:
            text = f.read()
    except OSError:
        return ""
    return f"\n    its threads' Python stacks when it ended:\n{text}" if text else ""


def _problem(
    r: int, p, outs: dict[int, tuple[str, Any]], may_exit: tuple[int, ...], timeout: float
) -> str:
    """What went wrong on rank ``r``, or ``""``."""
    status, value = outs.get(r, ("timeout", None))
    if status == "ok" and p.exitcode != 0:
        code = p.exitcode
        how = f"signal {signal.Signals(-code).name}" if code < 0 else f"exit code {code}"
        if code == -signal.SIGKILL:
            how = f"no exit within {EXIT_TIMEOUT_S:.0f} s (killed)"
        return f"--- rank {r} returned its result, then its process ended: {how}"
    if status == "ok" or (status == "exited" and r in may_exit):
        return ""
    if status == "error":
        return f"--- rank {r} raised:\n{value}"
    if status == "exited":
        return f"--- rank {r} exited with code {value} without reporting"
    return f"--- rank {r} did not finish within {timeout:.0f} s (killed)"
