"""Full fine-tuning against LoRA (PEFT) on the same model and ranks: step time and memory per rank.

For each arm and schedule, in 2 fresh CPU processes (gloo, one thread each): a Llama is built,
wrapped (LoRA: ``get_peft_model`` with r=16 on every projection of the decoder layers first), and
``--warmup`` then ``--steps`` timed training steps (``run_train`` and an AdamW step over the
parameters that require grad) run. Reported per arm and rank:

- ``step_s``: the median over the timed steps of the slowest rank's step time (a spin barrier
  starts each step);
- ``anon_bytes``: the peak of the rank's anonymous resident memory (``RssAnon``, sampled every
  2 ms) during the timed steps minus its value before the model was built;
- ``state_bytes``: the exact bytes of its local parameters, gradients and AdamW state;
- ``trainable``: its parameters that require grad, and ``w_s``: under ``zbh1``, the seconds its
  W actions (the deferred weight gradients) took in the last step: with LoRA they compute the
  adapters' gradients only (frozen weights have no gradient edge in autograd's graph).

Run: ``python benchmarks/lora.py``; results in ``benchmarks/results/lora.json``.
"""

from __future__ import annotations

import argparse
import statistics
import time

from _common import Phase, SpinBarrier, llama_config, run_ranks, save, state_bytes, token_batch

PROJECTIONS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def _arm(rank, world, args, arm: str, schedule: str) -> dict:
    import torch
    from transformers import LlamaForCausalLM

    import pippy_xla as px

    torch.set_num_threads(1)
    results: dict = {}
    barrier = SpinBarrier(rank, world)
    with Phase("build", results):
        torch.manual_seed(0)
        model = LlamaForCausalLM(llama_config(args.layers, args.hidden))
        if arm == "lora":
            from peft import LoraConfig, get_peft_model

            model = get_peft_model(model, LoraConfig(r=16, target_modules=PROJECTIONS))
        pipe = px.PipelineModel(model, num_microbatches=args.microbatches, schedule=schedule)
        params = [p for p in pipe.parameters() if p.requires_grad]
        opt = torch.optim.AdamW(params, lr=1e-4)
    batch = token_batch(args.batch, args.seq, 512)
    times = []
    for i in range(args.warmup + args.steps):
        if i == args.warmup:
            phase = Phase("steps", results)
            phase.__enter__()
        barrier.wait()
        t0 = time.perf_counter()
        pipe.run_train(**batch)
        opt.step()
        opt.zero_grad(set_to_none=False)
        times.append(time.perf_counter() - t0)
    phase.__exit__(None, None, None)
    w = sum(end - start for op, _, _, start, end in pipe.timings() if op == "W") / 1e9
    before = results["build"]["anon_peak_bytes"] - results["build"]["anon_bytes"]
    return {
        "times": times[args.warmup :],
        "anon_bytes": results["steps"]["anon_peak_bytes"] - before,
        "state_bytes": state_bytes(list(pipe.parameters()), opt),
        "trainable": sum(p.numel() for p in params),
        "parameters": sum(p.numel() for p in pipe.parameters()),
        "w_s": w,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--steps", type=int, default=8)
    args = parser.parse_args()
    out = {"args": vars(args), "arms": {}}
    for schedule in ("1f1b", "zbh1"):
        for arm in ("full", "lora"):
            ranks = run_ranks(2, _arm, args, arm, schedule, timeout=900)
            step = statistics.median(max(r["times"][i] for r in ranks) for i in range(args.steps))
            out["arms"][f"{arm} {schedule}"] = {"step_s": step, "ranks": ranks}
            mib = [r["anon_bytes"] / 2**20 for r in ranks]
            state = [r["state_bytes"] / 2**20 for r in ranks]
            w = [r["w_s"] * 1e3 for r in ranks]
            print(
                f"{arm:5s} {schedule:5s} step {step * 1e3:7.1f} ms  memory per rank (MiB) "
                f"{' / '.join(f'{m:.0f}' for m in mib)}  state "
                f"{' / '.join(f'{s:.1f}' for s in state)}  trainable "
                f"{ranks[0]['trainable']:,} of {ranks[0]['parameters']:,} (rank 0)  W "
                f"{' / '.join(f'{x:.1f}' for x in w)} ms",
                flush=True,
            )
    print(save("lora", out))


if __name__ == "__main__":
    main()
