"""Eager vs compiled (torch.compile, inductor) stages: step time per stage and recompilations.

    python benchmarks/compile_stages.py [--steps 12] [--warmup 2]

Runs a small Llama on 2 CPU ranks (one thread each), once eager and once with
``PipelineModel(..., compile=True)``, and reports per rank: median step time, the stage's busy time
(sum of its F and B actions from the engine's timings), compile time of the first step, and the
number of dynamo graphs compiled after the first step (recompilations; expected 0). Results go to
``benchmarks/results/compile_stages.json``.
"""

from __future__ import annotations

import argparse
import time

from _common import llama_and_batch, run_ranks, save, summarize


def _bench(rank, world, compile, steps, warmup):
    from torch._dynamo.utils import counters
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    import pippy_xla as px

    model, batch = llama_and_batch(layers=4, hidden=128, batch=8, seq=128)
    pipe = px.PipelineModel(model, layer_cls=LlamaDecoderLayer, num_microbatches=4, compile=compile)
    step_times, busy = [], []
    first = None
    graphs_after_first = None
    for step in range(warmup + steps):
        start = time.perf_counter()
        pipe.run_train(**batch)
        elapsed = time.perf_counter() - start
        if step == 0:
            first = elapsed
            graphs_after_first = int(counters["stats"]["unique_graphs"])
        if step >= warmup:
            step_times.append(elapsed)
            busy.append(sum(e - s for op, _, _, s, e in pipe.timings() if op in ("F", "B")) / 1e9)
        for p in pipe.parameters():
            p.grad = None
    recompiles = int(counters["stats"]["unique_graphs"]) - graphs_after_first
    return {
        "rank": rank,
        "first_step_s": first,
        "step_s": summarize(step_times),
        "stage_busy_s": summarize(busy),
        "recompiles_after_first_step": recompiles,
        "reported_recompiles": pipe.recompiles,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--warmup", type=int, default=2)
    args = p.parse_args()
    results = {}
    for mode, compile in (("eager", False), ("compiled", True)):
        results[mode] = run_ranks(2, _bench, compile, args.steps, args.warmup, timeout=1800)
    print(
        f"{'mode':<9} {'rank':>4} {'first step s':>12} {'step s (median)':>16} "
        f"{'stage busy s':>13} {'recompiles':>10}"
    )
    for mode, ranks in results.items():
        for r in ranks:
            print(
                f"{mode:<9} {r['rank']:>4} {r['first_step_s']:>12.3f} "
                f"{r['step_s']['median']:>16.4f} {r['stage_busy_s']['median']:>13.4f} "
                f"{r['recompiles_after_first_step']:>10}"
            )
    for e, c in zip(results["eager"], results["compiled"], strict=True):
        print(
            f"rank {e['rank']}: compiled/eager step time "
            f"{c['step_s']['median'] / e['step_s']['median']:.3f}"
        )
    path = save("compile_stages", {"config": vars(args), "results": results})
    print(f"saved {path}")


if __name__ == "__main__":
    main()
