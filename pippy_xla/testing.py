"""The one spawn helper for multi-rank runs: the tests' and the benchmarks'.

``run_ranks(world_size, fn, *args)`` starts ``world_size`` fresh processes, gives each a gloo
process group with a short timeout, runs ``fn(rank, world_size, *args)`` in each and returns the
ranks' return values. A rank that raises, dies or outlives ``timeout`` fails the test with every
rank's traceback, and all ranks are killed: a bug fails fast instead of hanging CI.

``backend="nccl"`` (GPU tests) puts every rank on ``cuda:0`` with its own ``NCCL_HOSTID``: NCCL
refuses two ranks on one GPU of one host, and with distinct host ids it treats them as two hosts
and carries the traffic over its socket transport. Such runs test correctness, not scaling.
"""

from __future__ import annotations

import datetime
import faulthandler
import multiprocessing as mp
import os
import queue
import signal
import socket
import time
import traceback
from collections.abc import Callable
from typing import Any

__all__ = ["EXIT_TIMEOUT_S", "PG_TIMEOUT_S", "run_ranks"]

# Long enough for a slow CI machine to finish one collective, short enough to fail fast.
PG_TIMEOUT_S = 60.0
# How long a rank that returned its result may take to tear down and exit.
EXIT_TIMEOUT_S = 30.0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank, world_size, port, fn, args, results, pg_timeout, backend):
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
    # A rank that dies by a signal (a teardown abort) prints every thread's Python stack.
    faulthandler.enable(all_threads=True)
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
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


def run_ranks(
    world_size: int,
    fn: Callable[..., Any],
    *args: Any,
    timeout: float = 240.0,
    pg_timeout: float = PG_TIMEOUT_S,
    may_exit: tuple[int, ...] = (),
    backend: str = "gloo",
    rank_env: dict[int, dict[str, str]] | None = None,
) -> list[Any]:
    """Runs ``fn(rank, world_size, *args)`` on ``world_size`` ranks; returns their results.

    Ranks listed in ``may_exit`` may end their process without reporting (tests of dead
    peers); their result is ``None``. ``rank_env[r]`` is added to rank ``r``'s environment
    before its interpreter starts (``PYTHONHASHSEED``, as torchrun's ranks each have their own).
    """
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = _free_port()
    procs = [
        ctx.Process(
            target=_worker, args=(r, world_size, port, fn, args, results, pg_timeout, backend)
        )
        for r in range(world_size)
    ]
    for r, p in enumerate(procs):
        extra = (rank_env or {}).get(r, {})
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
    outs: dict[int, tuple[str, Any]] = {}
    deadline = time.monotonic() + timeout
    try:
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
                    break
            except queue.Empty:
                pass
            for r, p in enumerate(procs):
                if r not in outs and not p.is_alive() and p.exitcode is not None:
                    # Drain what it may have put just before exiting.
                    try:
                        while True:
                            rank, status, value = results.get(timeout=0.2)
                            outs[rank] = (status, value)
                    except queue.Empty:
                        pass
                    if r not in outs:
                        outs[r] = ("exited", p.exitcode)
            if time.monotonic() > deadline:
                break
    finally:
        # Ranks that returned their result must also exit by themselves, cleanly: a crash or a
        # hang at teardown fails a job under torchrun just as an error does.
        if all(outs.get(r, ("",))[0] in ("ok", "exited") for r in range(world_size)):
            end = time.monotonic() + EXIT_TIMEOUT_S
            for p in procs:
                p.join(timeout=max(0.1, end - time.monotonic()))
        for p in procs:
            if p.is_alive():
                p.kill()
        for p in procs:
            p.join(timeout=10)
    problems = []
    for r in range(world_size):
        status, value = outs.get(r, ("timeout", None))
        if status == "ok" and procs[r].exitcode != 0:
            code = procs[r].exitcode
            how = f"signal {signal.Signals(-code).name}" if code < 0 else f"exit code {code}"
            if code == -signal.SIGKILL:
                how = f"no exit within {EXIT_TIMEOUT_S:.0f} s (killed)"
            problems.append(f"--- rank {r} returned its result, then its process ended: {how}")
            continue
        if status == "ok" or (status == "exited" and r in may_exit):
            continue
        if status == "error":
            problems.append(f"--- rank {r} raised:\n{value}")
        elif status == "exited":
            problems.append(f"--- rank {r} exited with code {value} without reporting")
        else:
            problems.append(f"--- rank {r} did not finish within {timeout:.0f} s (killed)")
    if problems:
        raise AssertionError("multi-rank test failed:\n" + "\n".join(problems))
    return [outs[r][1] if outs[r][0] == "ok" else None for r in range(world_size)]
