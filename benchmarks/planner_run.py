"""Real step time and peak memory of a planned pipeline against uniform layer splits, at one
memory limit, on CPU gloo ranks (one thread each).

Variants, all under 1F1B at the same limit:

- ``plan``: :func:`pippy_xla.plan` (layer ranges and checkpointed layers per stage);
- ``uniform_checkpoint_all``: balanced ranges, every layer checkpointed;
- ``uniform_best_count``: balanced ranges, the same number ``c`` of checkpointed layers on every
  stage (each stage's upper ``c`` layers), the smallest ``c`` whose prediction fits (fewer
  checkpoints are faster);
- ``uniform_no_checkpoint``: for reference (usually over the limit).

The limit is ``--fraction`` of the way from the smallest limit any plan fits to the unconstrained
plan's peak. Each rank measures its peak of live tensor bytes during a step with the counting
allocator (``_C.memory_stats``), one variant at a time; ``fits_measured`` compares the largest
with the limit. Step times are then taken with all variants built, one step of each in turn for
``--steps`` rounds (after a warm-up round), and their medians compared: load on the machine drifts
alike for every variant.

``python benchmarks/planner_run.py [--ranks 4] [--layers 16] [--hidden 128]``; prints a table and
saves ``benchmarks/results/planner_run.json`` with the machine and versions.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import time

import torch
import torch.distributed as dist
from _common import planned_pipeline, run_ranks, save


def _model(layers: int, hidden: int):
    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=256,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
    )
    return LlamaForCausalLM(cfg), LlamaDecoderLayer


def _worker(rank, world, args, variants):
    """Peak memory of each variant alone (one at a time, so no other variant's tensors count),
    then step times with every variant built and their steps taken in turn, round after round,
    so that the machine's load drifts alike for all of them."""
    from pippy_xla import _C

    _C.memory_tracker_install()

    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 256, (args.batch, args.seq), generator=g)
    batch = dict(input_ids=ids, attention_mask=torch.ones_like(ids), labels=ids)

    def build(spec):
        with torch.device("meta"):  # as users do: no rank holds more than its stage
            model, layer_cls = _model(args.layers, args.hidden)
        pipe = planned_pipeline(spec, model, layer_cls, timeout=120)
        return pipe, torch.optim.AdamW(pipe.parameters())  # its state is part of the plan

    def step(pipe, opt) -> float:
        dist.barrier()
        t = time.perf_counter()
        pipe.run_train(**batch)
        dist.barrier()
        seconds = time.perf_counter() - t
        opt.step()
        opt.zero_grad(set_to_none=False)  # gradients stay allocated (the plan counts them)
        return seconds

    results = {}
    for name, spec in variants.items():
        pipe, opt = build(spec)
        step(pipe, opt)  # warm-up: gradients and optimizer state now exist
        _C.memory_reset_peak()
        step(pipe, opt)
        per_rank = [torch.zeros(1, dtype=torch.long) for _ in range(world)]
        dist.all_gather(per_rank, torch.tensor([_C.memory_stats().peak_bytes]))
        results[name] = dict(peak_bytes=[int(x) for x in per_rank])
        del pipe, opt
        gc.collect()  # the next variant's peak must not count this one's tensors
    built = {name: build(spec) for name, spec in variants.items()}
    times: dict[str, list[float]] = {name: [] for name in variants}
    for round_ in range(args.steps + 1):
        for name, (pipe, opt) in built.items():
            seconds = step(pipe, opt)
            if round_:  # the first round warms up
                times[name].append(seconds)
    for name in variants:
        results[name]["step_s"] = statistics.median(times[name])
        results[name]["step_samples_s"] = times[name]
    return results


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--microbatches", type=int, default=8)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--fraction", type=float, default=0.3)
    args = ap.parse_args()

    import pippy_xla as px
    from pippy_xla.plan.planner import evaluate, limit_range, profile_model

    torch.set_num_threads(1)
    model, layer_cls = _model(args.layers, args.hidden)
    prof = profile_model(
        model, layer_cls, microbatch_size=args.batch // args.microbatches, seq_len=args.seq
    )
    kw = dict(
        layer_cls=layer_cls,
        num_stages=args.ranks,
        num_microbatches=args.microbatches,
        batch_size=args.batch,
        seq_len=args.seq,
        profile=prof,
    )
    low, high = limit_range(model, **kw)
    limit = int(low + args.fraction * (high - low))
    plan = px.plan(model, memory_limit=limit, **kw)
    print(plan.table())

    uniform = px.balanced_ranges(args.layers, args.ranks)

    def on_uniform(count: int):
        ckpt = [k for a, b in uniform for k in range(max(a, b - count), b)]
        return evaluate(
            prof,
            layer_ranges=uniform,
            checkpoint_layers=ckpt,
            num_microbatches=args.microbatches,
            memory_limit=limit,
        )

    per_stage = max(b - a for a, b in uniform)
    counts = [
        c
        for c in range(per_stage + 1)
        if max(s.memory_bytes for s in on_uniform(c).stages) <= limit
    ]
    variants = {
        "plan": plan,
        "uniform_checkpoint_all": on_uniform(per_stage),
        "uniform_no_checkpoint": on_uniform(0),
    }
    if counts:
        variants["uniform_best_count"] = on_uniform(counts[0])
    specs = {name: p.to_json() for name, p in variants.items()}
    measured = run_ranks(args.ranks, _worker, args, specs, timeout=1200)[0]
    out = {
        "args": vars(args),
        "memory_limit": limit,
        "smallest_feasible_limit": low,
        "unconstrained_peak": high,
    }
    for name, p in variants.items():
        m = measured[name]
        out[name] = dict(
            measured_step_s=m["step_s"],
            measured_step_samples_s=m["step_samples_s"],
            predicted_step_s=p.step_time,
            measured_peak_bytes=m["peak_bytes"],
            predicted_peak_bytes=[s.memory_bytes for s in p.stages],
            fits_predicted=all(s.memory_bytes <= limit for s in p.stages),
            fits_measured=max(m["peak_bytes"]) <= limit,
            checkpoint_layers=p.checkpoint_layers,
            layer_ranges=p.layer_ranges,
        )
        print(
            f"{name:>24}: measured {m['step_s'] * 1e3:8.1f} ms/step (predicted "
            f"{p.step_time * 1e3:7.1f}), peak per stage "
            f"{[round(b / 2**20, 2) for b in m['peak_bytes']]} MiB (predicted "
            f"{[round(s.memory_bytes / 2**20, 2) for s in p.stages]}, limit {limit / 2**20:.2f}), "
            f"checkpointed {len(p.checkpoint_layers)}, ranges {p.layer_ranges}"
        )
    for base in ("uniform_checkpoint_all", "uniform_best_count"):
        if base in out:
            speedup = out[base]["measured_step_s"] / out["plan"]["measured_step_s"]
            out[f"plan_speedup_over_{base}"] = speedup
            print(f"plan vs {base}: {speedup:.2f}x")
    path = save("planner_run", out)
    print(f"saved {path}")


if __name__ == "__main__":
    main()
