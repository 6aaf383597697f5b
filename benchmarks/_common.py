"""Shared helpers of the benchmarks: models, batches, result files; the spawn helper is
:func:`pippy_xla.testing.run_ranks`, the tests' own."""

from __future__ import annotations

import ctypes
import gc
import json
import platform
import statistics
import threading
import time
from pathlib import Path

from pippy_xla.testing import run_ranks

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"

__all__ = [
    "RESULTS",
    "ROOT",
    "Phase",
    "SpinBarrier",
    "check_losses",
    "llama_and_batch",
    "llama_config",
    "machine",
    "proc_memory",
    "run_ranks",
    "save",
    "state_bytes",
    "summarize",
    "timed_step",
    "token_batch",
]


def llama_config(layers: int, hidden: int, vocab: int = 512):
    """A Llama config with heads of 32 dims and 2 KV heads, MLP 4 x hidden."""
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=4 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=hidden // 32,
        num_key_value_heads=2,
    )


def token_batch(batch: int, seq: int, vocab: int, seed: int = 0) -> dict:
    """A seeded random token batch (no padding; labels are the inputs)."""
    import torch

    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (batch, seq), generator=g)
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids}


def llama_and_batch(layers: int, hidden: int, batch: int, seq: int, vocab: int = 512):
    """A seeded random Llama (:func:`llama_config`) and a random token batch."""
    import torch
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(llama_config(layers, hidden, vocab)), token_batch(batch, seq, vocab)


def planned_pipeline(plan_json: str, model, layer_cls, **kwargs):
    """A ``PipelineModel`` of ``model`` running the plan in ``plan_json`` (``Plan.to_json``) with
    the schedule, microbatch count and stages per rank it was made for."""
    import pippy_xla as px

    return px.PipelineModel(model, layer_cls=layer_cls, plan=px.Plan.from_json(plan_json), **kwargs)


def state_bytes(params, opt) -> int:
    """The exact bytes of this rank's local ``params``, their gradients and ``opt``'s state
    for them (a DTensor counts its local shard)."""
    from pippy_xla.runtime.data_parallel import local_tensor

    total = 0
    for p in params:
        for t in [p, p.grad, *opt.state.get(p, {}).values()]:
            if t is not None and t.dim() > 0:
                t = local_tensor(t)
                total += t.numel() * t.element_size()
    return total


def machine() -> dict:
    import os

    import torch

    return {
        "cpu": platform.processor() or platform.machine(),
        "cores": os.cpu_count(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "threads_per_rank": 1,
        "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
    }


def summarize(samples: list[float]) -> dict:
    """Median and spread (min, max, interquartile range) of repeated measurements."""
    s = sorted(samples)
    q = statistics.quantiles(s, n=4) if len(s) >= 2 else [s[0]] * 3
    return {
        "median": statistics.median(s),
        "min": s[0],
        "max": s[-1],
        "iqr": q[2] - q[0],
        "n": len(s),
    }


def save(name: str, payload: dict) -> Path:
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / f"{name}.json"
    path.write_text(json.dumps({"machine": machine(), **payload}, indent=2) + "\n")
    return path


def proc_memory() -> dict[str, int]:
    """This process's resident memory now, in bytes: ``VmRSS`` (everything resident) and
    ``RssAnon`` (what it allocated, without mapped files)."""
    out = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "RssAnon"):
            out[key] = int(value.split()[0]) * 1024
    return out


class Phase:
    """Times a phase on this rank and samples its peak memory every 2 ms in a background thread;
    on exit, records ``{"seconds", "anon_bytes" (peak RssAnon minus its value at the start),
    "anon_peak_bytes", "rss_peak_bytes"}`` under ``results[name]``. Starts with a barrier over
    ``group``."""

    def __init__(self, name: str, results: dict, group=None) -> None:
        self.name, self.results, self.group = name, results, group

    def __enter__(self):
        import torch.distributed as dist

        gc.collect()
        ctypes.CDLL("libc.so.6").malloc_trim(0)
        dist.barrier(group=self.group)
        self.start = proc_memory()
        self.peak = dict(self.start)
        self.done = threading.Event()

        def sample():
            while not self.done.wait(0.002):
                for k, v in proc_memory().items():
                    self.peak[k] = max(self.peak[k], v)

        self.thread = threading.Thread(target=sample, daemon=True)
        self.thread.start()
        self.t0 = time.perf_counter()
        return self

    def __exit__(self, *exc):
        elapsed = time.perf_counter() - self.t0
        self.done.set()
        self.thread.join()
        for k, v in proc_memory().items():
            self.peak[k] = max(self.peak[k], v)
        self.results[self.name] = {
            "seconds": elapsed,
            "anon_bytes": self.peak["RssAnon"] - self.start["RssAnon"],
            "anon_peak_bytes": self.peak["RssAnon"],
            "rss_peak_bytes": self.peak["VmRSS"],
        }


class SpinBarrier:
    """A barrier of the ranks of one host for timing steps: every rank writes how many barriers
    it has reached into its own byte of a shared page and spins (yielding its core) until every
    rank has reached as many. It releases the ranks within microseconds of each other and keeps
    their cores busy while they wait, as a training loop's back-to-back steps would.

    ``torch.distributed.barrier`` (gloo) is no clock for a step of a few tens of milliseconds:
    on the 2-core machine of docs/benchmarks.md's table its ranks left it up to 2.5 ms apart, and
    the rank that left first counted the difference as step time; and its waiting ranks sleep,
    after which the next step's stage forwards ran slower (rank 1's compiled F about 800 us against
    600 us after this barrier, overhead regime of ``compare.py``). Both libraries are timed through
    the same barrier. Created collectively (rank 0 names the page, every rank maps it)."""

    def __init__(self, rank: int, world: int) -> None:
        import mmap
        import os

        import torch.distributed as dist

        name = [f"/dev/shm/pippy_xla_bench_{os.getpid()}_{time.time_ns()}" if rank == 0 else ""]
        dist.broadcast_object_list(name, src=0)
        path = name[0]
        if rank == 0:
            with open(path, "wb") as f:
                f.write(bytes(world))
        dist.barrier()
        with open(path, "r+b") as f:
            self._page = mmap.mmap(f.fileno(), world)
        dist.barrier()
        if rank == 0:
            os.unlink(path)
        self._rank, self._world, self._count = rank, world, 0

    def wait(self) -> None:
        import os

        # A rank is at most one barrier ahead of another that still waits here, so a byte that
        # is no longer the previous count (mod 256) has reached this one.
        previous = self._count % 256
        self._count += 1
        page = self._page
        page[self._rank] = self._count % 256
        while any(page[r] == previous for r in range(self._world)):
            os.sched_yield()


def check_losses(layouts: dict, baseline: str, rtol_first: float, rtol_per_step: float) -> float:
    """Every layout's per-step ``losses`` against ``baseline``'s: step ``i`` within ``rtol_first
    + i * rtol_per_step`` (float rounding before the first optimizer step, then AdamW's drift
    per step); the largest relative difference."""
    want = layouts[baseline]["losses"]
    worst = 0.0
    for name, row in layouts.items():
        for i, (a, b) in enumerate(zip(row["losses"], want, strict=True)):
            rel = abs(a - b) / abs(b)
            worst = max(worst, rel)
            tol = rtol_first + i * rtol_per_step
            assert rel <= tol, f"{name}: step {i} loss {a} against {baseline}'s {b} ({rel:.2e})"
    return worst


def timed_step(pipe, opt, batch: dict) -> tuple[float, float]:
    """One training step of ``pipe`` and an ``opt`` step between two barriers of every rank:
    its seconds and its loss."""
    import torch.distributed as dist

    dist.barrier()
    t0 = time.perf_counter()
    loss = pipe.run_train(**batch)
    opt.step()
    opt.zero_grad(set_to_none=False)
    dist.barrier()
    return time.perf_counter() - t0, float(loss)
