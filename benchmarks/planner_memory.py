"""The planner's predicted peak memory per rank against the measured peak of live CPU tensor
bytes, for each schedule the planner models (1F1B, GPipe, interleaved with 2 stages per rank,
ZB-H1), on 2 CPU ranks (gloo).

A seeded Llama is profiled once in this process (``profile_model``); for each schedule and each
layout (layer ranges from the balanced split; no layer, half of them, or every layer
checkpointed) the cost model's prediction comes from ``planner.evaluate``. Then 2 ranks build the
model on ``meta``, wrap it with that plan, and run ``--warmup`` steps (``run_train`` and an AdamW
step, so gradients and optimizer state exist) and one measured step. Each rank counts its live
CPU tensor bytes with the counting allocator (``_C.memory_stats``, see [Note: counting CPU
allocator] in csrc/runtime/memory.h), installed before the model is built:

- ``static_measured``: live bytes before the measured step (parameters, gradients, AdamW state,
  buffers, and whatever else the rank keeps between steps);
- ``peak_measured``: the most live bytes during the measured step's ``run_train``;
- ``peak_optimizer``: the most live bytes during its AdamW step (torch's foreach AdamW allocates
  temporaries the size of the parameters), reported apart;
- the prediction's parts: ``static`` (parameters, gradients, AdamW state), ``activations``
  (microbatches in flight times saved bytes, and under ZB-H1 microbatches between B and W times
  what they keep), ``buffers`` (receives posted ahead, sends in
  flight), ``transient`` (the largest working set, see
  [Note: planner cost model] in csrc/plan/planner.h) and their sum ``predicted``. With interleaved a
  rank runs 2 stages: each stage's row has its own static bytes and activations, and the rank's
  buffers, transient, prediction and measurement.

Run: ``python benchmarks/planner_memory.py``; results in
``benchmarks/results/planner_memory.json``.
"""

from __future__ import annotations

import argparse

from _common import llama_config, planned_pipeline, run_ranks, save, token_batch


def _measure(rank, world, args, plan_json):
    import torch
    from transformers import LlamaForCausalLM
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    from pippy_xla import _C

    _C.memory_tracker_install()
    with torch.device("meta"):
        model = LlamaForCausalLM(llama_config(args.layers, args.hidden, args.vocab))
    pipe = planned_pipeline(plan_json, model, LlamaDecoderLayer)
    del model
    opt = torch.optim.AdamW(pipe.parameters(), lr=1e-4)
    batch = token_batch(args.batch, args.seq, args.vocab)

    def step():
        pipe.run_train(**batch)
        opt.step()
        opt.zero_grad(set_to_none=False)

    for _ in range(args.warmup):
        step()
    static = _C.memory_stats().live_bytes
    _C.memory_reset_peak()
    pipe.run_train(**batch)
    peak = _C.memory_stats().peak_bytes
    _C.memory_reset_peak()
    opt.step()
    peak_optimizer = _C.memory_stats().peak_bytes
    return {"static_measured": static, "peak_measured": peak, "peak_optimizer": peak_optimizer}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--vocab", type=int, default=2048)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--warmup", type=int, default=2)
    args = parser.parse_args()

    import torch
    from transformers import LlamaForCausalLM
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    from pippy_xla import _C
    from pippy_xla.pipeline import balanced_ranges
    from pippy_xla.plan.cost_model import PLANNED_SCHEDULES
    from pippy_xla.plan.planner import evaluate, profile_model

    torch.manual_seed(0)
    torch.set_num_threads(1)
    model = LlamaForCausalLM(llama_config(args.layers, args.hidden, args.vocab))
    prof = profile_model(
        model,
        LlamaDecoderLayer,
        microbatch_size=args.batch // args.microbatches,
        seq_len=args.seq,
        repeats=2,
    )
    rows = []
    for schedule in PLANNED_SCHEDULES:
        ranges = balanced_ranges(args.layers, 2 * _C.default_chunks(schedule))
        layouts = {
            "none": [],
            "half": [k for a, b in ranges for k in range(a, a + (b - a) // 2)],
            "all": list(range(args.layers)),
        }
        for name, ckpt in layouts.items():
            plan = evaluate(
                prof,
                layer_ranges=ranges,
                checkpoint_layers=ckpt,
                num_microbatches=args.microbatches,
                schedule=schedule,
            )
            measured = run_ranks(2, _measure, args, plan.to_json(), timeout=600)
            for st in plan.stages:
                m = measured[st.rank]
                row = {
                    "schedule": schedule,
                    "checkpointed": name,
                    "stage": st.index,
                    "rank": st.rank,
                    "inflight": st.inflight,
                    "pending_weight": st.pending_weight,
                    "static": st.static_bytes,
                    "activations": st.activation_bytes,
                    "buffers": st.buffer_bytes,
                    "transient": st.transient_bytes,
                    "predicted": st.memory_bytes,
                    **m,
                    "measured_over_predicted": m["peak_measured"] / st.memory_bytes,
                }
                rows.append(row)
                print(
                    f"{schedule:11s} ckpt={name:4s} stage {st.index} rank {st.rank}: predicted "
                    f"{st.memory_bytes / 2**20:7.2f} MiB (static {st.static_bytes / 2**20:.2f} + "
                    f"activations {st.activation_bytes / 2**20:.2f} + buffers "
                    f"{st.buffer_bytes / 2**20:.2f} + transient "
                    f"{st.transient_bytes / 2**20:.2f}), measured peak "
                    f"{m['peak_measured'] / 2**20:7.2f} MiB (between steps "
                    f"{m['static_measured'] / 2**20:.2f}, optimizer step "
                    f"{m['peak_optimizer'] / 2**20:.2f}), ratio "
                    f"{row['measured_over_predicted']:.2f}"
                )
    path = save("planner_memory", {"config": vars(args), "rows": rows})
    print(f"saved {path}")


if __name__ == "__main__":
    main()
