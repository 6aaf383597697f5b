"""Pipeline x data parallel on 4 CPU ranks (gloo), one global batch: 2 (dp) x 2 (pp) against
1 x 4 (pipeline only) and 4 x 1 (data parallel only), replicated and sharded (FSDP2).

For each layout, in 4 fresh processes: the model is built on ``meta`` and wrapped (each rank
materializes its stage), then ``--warmup`` and ``--steps`` timed training steps (``run_train``
and an AdamW step) run on the same global batch. Reported per layout:

- ``step_s``: median over the timed steps of the slowest rank's step time (a barrier starts each);
- per rank, ``anon_bytes``: the peak of its anonymous resident memory (``RssAnon``, sampled every
  2 ms) during the timed steps, minus its value before the model was built: the stage's
  parameters, gradients, optimizer state, activations and communication buffers, as the OS sees
  them; ``state_bytes``: the exact bytes of its local parameters, gradients and AdamW state;
- ``reduce``: per rank, the seconds spent in the data-parallel gradient reduction of the last
  timed step and how much of it ran while another rank of its pipeline was still computing (the
  reduction overlapping the pipeline's cooldown).

The 4 ranks share 2 cores: step times include contention and compare layouts on this machine
only. Run: ``python benchmarks/data_parallel.py``; results in
``benchmarks/results/data_parallel.json``.
"""

from __future__ import annotations

import argparse
import statistics

from _common import (
    Phase,
    llama_config,
    proc_memory,
    run_ranks,
    save,
    state_bytes,
    timed_step,
    token_batch,
)

LAYOUTS = [
    ("1x4", 1, 4, None),
    ("2x2 replicate", 2, 2, "replicate"),
    ("2x2 shard", 2, 2, "shard"),
    ("4x1 replicate", 4, 1, "replicate"),
    ("4x1 shard", 4, 1, "shard"),
]


def _layout(args, batch, dp: int, pp: int, mode: str | None) -> dict:
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from transformers import LlamaForCausalLM
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    import pippy_xla as px

    base = proc_memory()["RssAnon"]
    with torch.device("meta"):
        model = LlamaForCausalLM(llama_config(args.layers, args.hidden, args.vocab))
    mesh = init_device_mesh("cpu", (dp, pp), mesh_dim_names=("dp", "pp")) if dp > 1 else None
    pipe = px.PipelineModel(
        model,
        layer_cls=LlamaDecoderLayer,
        num_microbatches=args.microbatches,
        mesh=mesh,
        data_parallel=mode or "replicate",
    )
    del model
    opt = torch.optim.AdamW(pipe.parameters(), lr=1e-4)

    def step():
        return timed_step(pipe, opt, batch)

    for _ in range(args.warmup):
        step()
    memory: dict = {}
    with Phase("steps", memory):
        times, losses = zip(*(step() for _ in range(args.steps)), strict=True)
    # Overlap: the reduction's time while another rank of this pipeline still computed.
    timings = pipe.timings()
    reduce_spans = [(t0, t1) for op, _, _, t0, t1 in timings if op == "DP"]
    mine = [(t0, t1) for op, _, _, t0, t1 in timings if op in ("F", "B", "W")]
    everyone: list = [None] * pipe.num_ranks
    dist.all_gather_object(everyone, mine, group=pipe.group)
    others = [s for r, spans in enumerate(everyone) if r != pipe.rank for s in spans]
    reduce_s = sum(b - a for a, b in reduce_spans) / 1e9
    overlap_s = sum(max(0, min(b, d) - max(a, c)) for a, b in reduce_spans for c, d in others)
    return {
        "step_s": list(times),
        "losses": list(losses),
        "anon_bytes": memory["steps"]["anon_peak_bytes"] - base,
        "state_bytes": state_bytes(pipe.parameters(), opt),
        "reduce_s": reduce_s,
        "reduce_overlapping_s": min(overlap_s / 1e9, reduce_s),
    }


def _rank(rank, world, args, layout):
    batch = token_batch(args.batch, args.seq, args.vocab)
    _, dp, pp, mode = layout
    return _layout(args, batch, dp, pp, mode)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--steps", type=int, default=5)
    args = parser.parse_args()
    layouts = {}
    for layout in LAYOUTS:
        name, dp, pp, mode = layout
        per_rank = run_ranks(4, _rank, args, layout, timeout=1800, pg_timeout=300)
        steps = [max(r["step_s"][i] for r in per_rank) for i in range(args.steps)]
        layouts[name] = {
            "dp": dp,
            "pp": pp,
            "data_parallel": mode,
            "step_s_median": statistics.median(steps),
            "step_s": steps,
            "loss_last": per_rank[0]["losses"][-1],
            "anon_mib_per_rank": [round(r["anon_bytes"] / 2**20, 1) for r in per_rank],
            "state_mib_per_rank": [round(r["state_bytes"] / 2**20, 1) for r in per_rank],
            "reduce_s_per_rank": [round(r["reduce_s"], 4) for r in per_rank],
            "reduce_overlapping_s_per_rank": [
                round(r["reduce_overlapping_s"], 4) for r in per_rank
            ],
        }
        row = layouts[name]
        print(
            f"{name:14s} step {row['step_s_median']:.3f} s  loss {row['loss_last']:.4f}  "
            f"peak anon MiB {row['anon_mib_per_rank']}  state MiB {row['state_mib_per_rank']}  "
            f"reduce s {row['reduce_s_per_rank']} "
            f"(overlapping {row['reduce_overlapping_s_per_rank']})"
        )
    config = {k: getattr(args, k) for k in vars(args)}
    path = save("data_parallel", {"config": config, "layouts": layouts})
    print(f"saved {path}")


if __name__ == "__main__":
    main()
