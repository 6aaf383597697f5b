"""The cost of the step handshake's batch-content check (``check_batch_content``, see [Note: step
handshake] in pippy_xla/runtime/_batch.py), per step.

- ``digest``: :func:`pippy_xla.runtime._batch.step_key` with and without the content digests
  (one pass over the batch's bytes in C++), in one process, for the README main job's batch
  (16 x 64 tokens) and for 8 x 4096 tokens (``input_ids``, ``attention_mask``, ``labels``, int64).
- ``steps``: the README main job's model and batch on 2 CPU ranks, training steps with the check
  on and off, interleaved, so that the check's share of a real step is measured, not assumed.

Run: ``python benchmarks/batch_digest.py``; writes ``benchmarks/results/batch_digest.json``.
"""

from __future__ import annotations

import argparse
import time

from _common import llama_config, run_ranks, save, summarize, token_batch


def _digest_us(batch: int, seq: int, repeats: int) -> dict:
    from pippy_xla.runtime._batch import step_key

    tokens = token_batch(batch, seq, vocab=512)
    out = {}
    for check in (False, True):
        samples = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            step_key("train", tokens, check)
            samples.append((time.perf_counter() - t0) * 1e6)
        out["with_content" if check else "shapes_only"] = summarize(samples)
    out["content_us"] = out["with_content"]["median"] - out["shapes_only"]["median"]
    out["bytes"] = sum(t.numel() * t.element_size() for t in tokens.values())
    return out


def _steps(rank, world, steps):
    import torch
    from transformers import LlamaForCausalLM
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    import pippy_xla as px

    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = LlamaForCausalLM(llama_config(layers=8, hidden=256))
    batch = token_batch(16, 64, vocab=512)
    pipes = {
        check: px.PipelineModel(
            model if check else LlamaForCausalLM(llama_config(layers=8, hidden=256)),
            layer_cls=LlamaDecoderLayer,
            num_microbatches=4,
            check_batch_content=check,
        )
        for check in (True, False)
    }
    times: dict[bool, list[float]] = {True: [], False: []}
    for step in range(steps + 1):
        for check, pipe in pipes.items():
            t0 = time.perf_counter()
            pipe.run_train(**batch)
            if step:  # the first step of each warms up
                times[check].append((time.perf_counter() - t0) * 1e3)
    return {"on_ms": summarize(times[True]), "off_ms": summarize(times[False])}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--repeats", type=int, default=200)
    p.add_argument("--steps", type=int, default=20)
    args = p.parse_args()
    digest = {
        "16x64 (README main job)": _digest_us(16, 64, args.repeats),
        "8x4096": _digest_us(8, 4096, args.repeats),
    }
    for size, d in digest.items():
        print(
            f"{size:>24}: handshake key {d['shapes_only']['median']:8.1f} us without content, "
            f"{d['with_content']['median']:8.1f} us with ({d['content_us']:.1f} us for "
            f"{d['bytes'] / 2**20:.2f} MiB)"
        )
    ranks = run_ranks(2, _steps, args.steps, timeout=900)
    slowest = max(ranks, key=lambda r: r["on_ms"]["median"])
    on, off = slowest["on_ms"]["median"], slowest["off_ms"]["median"]
    print(
        f"README main job on 2 CPU ranks: {on:.1f} ms per step with the check, {off:.1f} ms "
        f"without ({(on - off) / off:+.1%}; medians of {args.steps} interleaved steps)"
    )
    path = save("batch_digest", {"digest_us": digest, "steps_2_ranks": ranks})
    print(f"saved {path}")


if __name__ == "__main__":
    main()
