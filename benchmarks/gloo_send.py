"""What a gloo send costs the calling thread on this machine, without pippy_xla in the way.

    python benchmarks/gloo_send.py [--sends 300 --bytes 2048]

Two processes, one thread each; rank 1 posts every receive first, then rank 0 posts its sends
(``dist.isend``, the call timed) in three patterns:

- ``back to back``: one send after the other;
- ``after compute``: 0.8 ms of matmuls before each send (a pipeline's forward, then its send);
- ``after sleep``: 0.8 ms asleep before each send;
- ``both computing``: as ``after compute``, while rank 1 computes too for as long (both cores
  busy, as in a pipeline's steady state).

In the overhead regime of ``compare.py`` a send action's median is 45-106 us and gloo's own call is
most of it; this separates what gloo and the machine charge from what a runtime adds. Results:
``benchmarks/results/gloo_send.json``.
"""

from __future__ import annotations

import argparse
import time

from _common import run_ranks, save, summarize

PATTERNS = ("back to back", "after compute", "after sleep", "both computing")


def _pause(pattern: str, work) -> None:
    if pattern in ("after compute", "both computing"):
        start = time.perf_counter()
        while time.perf_counter() - start < 0.0008:
            work @ work
    elif pattern == "after sleep":
        time.sleep(0.0008)


def _bench(rank, world, sends, nbytes) -> dict:
    import torch
    import torch.distributed as dist

    x = torch.randn(nbytes // 4)
    work = torch.randn(64, 64)
    out = {}
    for pattern in PATTERNS:
        dist.barrier()
        if rank == 1:
            bufs = [torch.empty_like(x) for _ in range(sends)]
            posted = [dist.irecv(b, 0, tag=i) for i, b in enumerate(bufs)]
            dist.barrier()
            start = time.perf_counter()  # about as long as rank 0's sends take
            while pattern == "both computing" and time.perf_counter() - start < sends * 0.0009:
                work @ work
            for w in posted:
                w.wait()
            continue
        dist.barrier()  # every receive is posted
        posts, handles = [], []
        for i in range(sends):
            _pause(pattern, work)
            t0 = time.perf_counter_ns()
            handles.append(dist.isend(x, 1, tag=i))
            posts.append((time.perf_counter_ns() - t0) / 1e3)
        for h in handles:
            h.wait()
        s = sorted(posts)
        out[pattern] = {**summarize(posts), "p90": s[int(0.9 * len(s))]}
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--sends", type=int, default=300)
    p.add_argument("--bytes", type=int, default=2048)
    args = p.parse_args()
    result = run_ranks(2, _bench, args.sends, args.bytes, timeout=600)[0]
    print(f"dist.isend post on rank 0, {args.bytes} bytes, {args.sends} sends (us)")
    for pattern, r in result.items():
        print(f"{pattern:14s} median {r['median']:7.1f}  p90 {r['p90']:7.1f}  max {r['max']:8.1f}")
    print(f"wrote {save('gloo_send', {'config': vars(args), 'send_post_us': result})}")


if __name__ == "__main__":
    main()
