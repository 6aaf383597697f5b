"""Generation throughput: ``PipelineModel.generate`` on 2 CPU ranks against HF's ``generate`` on
the unsplit model in one process (its default dynamic cache and its static cache), greedy, the
same random Llama, prompts and lengths; the pipeline with the batch in 1 and 2 groups of rows
(``groups``). One thread per process (a rank or the single process).

Tokens per second are new tokens (batch x ``--new``) over the wall time of one call, the median
of ``--repeats`` calls after a warm-up call; for the pipeline the slowest rank's time. Every
call's tokens are checked equal to HF's. Token steps end together (issue 50's decoding
pipelined across steps is not built yet), so 2 ranks are not expected to beat one process here:
with one group the number is the pipeline's per-token overhead (a forward-only engine run and a
token broadcast per step); two groups overlap the stages within each step. HF's own pipeline
(``DistributedConfig(pp_size=...)``) is not measured yet. Run: ``python benchmarks/generate.py``.
"""

from __future__ import annotations

import argparse
import time

from _common import llama_config, run_ranks, save, summarize


def _model(args):
    import torch
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(llama_config(args.layers, args.hidden)).eval()
    g = torch.Generator().manual_seed(1)
    prompts = torch.randint(1, 512, (args.batch, args.prompt), generator=g)
    return model, prompts


def _timed(fn, repeats: int):
    fn()  # warm-up
    times, out = [], None
    for _ in range(repeats):
        start = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - start)
    return times, out


def _one_process(args) -> dict:
    import torch

    torch.set_num_threads(1)
    model, prompts = _model(args)
    out, mask = {}, torch.ones_like(prompts)
    for cache in ("dynamic", "static"):
        opts = {"max_new_tokens": args.new, "do_sample": False, "cache_implementation": cache}
        times, tokens = _timed(
            lambda o=opts: model.generate(prompts, attention_mask=mask, **o), args.repeats
        )
        out[cache] = (times, tokens)
    return out


def _pipeline(rank, world, args, groups: int):
    import torch

    import pippy_xla as px

    torch.set_num_threads(1)
    model, prompts = _model(args)
    layer_cls = type(model.model.layers[0])
    pipe = px.PipelineModel(model, layer_cls=layer_cls, num_microbatches=1)
    opts = {"max_new_tokens": args.new, "do_sample": False}
    mask = torch.ones_like(prompts)
    times, tokens = _timed(
        lambda: pipe.generate(prompts, attention_mask=mask, groups=groups, **opts), args.repeats
    )
    return times, tokens.tolist()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--prompt", type=int, default=32)
    p.add_argument("--new", type=int, default=32)
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args()
    new_tokens = args.batch * args.new
    single = _one_process(args)
    results = {
        "hf_one_process_dynamic": summarize([new_tokens / t for t in single["dynamic"][0]]),
        "hf_one_process_static": summarize([new_tokens / t for t in single["static"][0]]),
    }
    for groups in (1, 2):
        ranks = run_ranks(2, _pipeline, args, groups, timeout=900)
        want = single["dynamic"][1].tolist()
        assert all(tokens == want for _, tokens in ranks), "the pipeline's tokens differ from HF's"
        slowest = [max(ts) for ts in zip(*(t for t, _ in ranks), strict=True)]
        results[f"pippy_xla_2_ranks_{groups}_groups"] = summarize([new_tokens / t for t in slowest])
    for name, r in results.items():
        print(
            f"{name:28s} {r['median']:8.1f} new tokens/s (min {r['min']:.1f}, max {r['max']:.1f})"
        )
    path = save("generate", {"args": vars(args), "unit": "new tokens/s", "results": results})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
