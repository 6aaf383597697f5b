"""Generation throughput: ``PipelineModel.generate`` on 2 CPU ranks against HF's own pipeline
(``DistributedConfig(pp_size=2)``: ``from_pretrained`` splits the layers over the ranks, every
rank runs ``generate`` and the last rank broadcasts the logits) on the same ranks, and HF's
``generate`` on the unsplit model in one process (its default dynamic cache and its static
cache); greedy, the same random Llama, prompts and lengths; the pipeline with the batch in 1 and
2 groups of rows (``groups``). One thread per process (a rank or the single process).

Tokens per second are new tokens (batch x ``--new``) over the wall time of one call, the median
of ``--repeats`` calls after a warm-up call; for a pipeline the slowest rank's time. For
``pipe.generate`` also each rank's decode busy share: the time its decode-schedule runs spent in
forwards over their span, in the last call (from the engine's action timings). Every
call's tokens are checked equal to HF's one-process tokens before any time is reported. The
pipeline decodes pipelined across ranks (``[Note: generation data flow]`` in
``pippy_xla/runtime/_generate.py``): with one group the stages take turns, with two (as many as
stages) each rank works on one group while the other works on the other. A last row runs the
pipeline with ``compile=True`` (one group): compiled prefill and decode graphs (``[Note: compiled
generation]``), compiled by the warm-up call.
Run: ``python benchmarks/generate.py``.
"""

from __future__ import annotations

import argparse
import tempfile
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


def _pipeline(rank, world, args, groups: int, compile: bool = False):
    import torch

    import pippy_xla as px

    torch.set_num_threads(1)
    model, prompts = _model(args)
    layer_cls = type(model.model.layers[0])
    pipe = px.PipelineModel(model, layer_cls=layer_cls, num_microbatches=1, compile=compile)
    opts = {"max_new_tokens": args.new, "do_sample": False}
    mask = torch.ones_like(prompts)
    times, tokens = _timed(
        lambda: pipe.generate(prompts, attention_mask=mask, groups=groups, **opts), args.repeats
    )
    return times, tokens.tolist(), _decode_busy(pipe)


def _decode_busy(pipe) -> float:
    """The share of the last call's decode-schedule runs that this rank spent in forwards (each
    engine keeps its last run's timings; a forward's time starts once its inputs were there)."""
    busy = span = 0
    for key, engine in pipe._generator.engines.items():
        timings = engine.timings()
        if key[0] != "decode" or not timings:
            continue
        busy += sum(t.end_ns - t.start_ns for t in timings if t.op == "F")
        span += timings[-1].end_ns - timings[0].start_ns
    return busy / span


def _hf_pipeline(rank, world, args, path: str):
    import torch
    from transformers import LlamaForCausalLM
    from transformers.distributed import DistributedConfig

    torch.set_num_threads(1)
    _, prompts = _model(args)
    config = DistributedConfig(pp_size=world)
    model = LlamaForCausalLM.from_pretrained(path, distributed_config=config).eval()
    opts = {"max_new_tokens": args.new, "do_sample": False}
    mask = torch.ones_like(prompts)
    times, tokens = _timed(
        lambda: model.generate(prompts, attention_mask=mask, **opts), args.repeats
    )
    return times, tokens.tolist()


def _slowest(ranks, want, what: str) -> list[float]:
    """The slowest rank's time of each call, once every rank's tokens are ``want``."""
    assert all(r[1] == want for r in ranks), f"{what}: tokens differ from HF's"
    return [max(ts) for ts in zip(*(r[0] for r in ranks), strict=True)]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--prompt", type=int, default=32)
    p.add_argument("--new", type=int, default=32)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", default="generate", help="results/<out>.json")
    args = p.parse_args()
    new_tokens = args.batch * args.new
    single = _one_process(args)
    results = {
        "hf_one_process_dynamic": summarize([new_tokens / t for t in single["dynamic"][0]]),
        "hf_one_process_static": summarize([new_tokens / t for t in single["static"][0]]),
    }
    want = single["dynamic"][1].tolist()
    busy = {}
    with tempfile.TemporaryDirectory() as path:
        model, _ = _model(args)
        model.save_pretrained(path)
        ranks = run_ranks(2, _hf_pipeline, args, path, timeout=900)
    slowest = _slowest(ranks, want, "HF's pipeline")
    results["hf_pipeline_2_ranks"] = summarize([new_tokens / t for t in slowest])
    runs = [(1, False), (2, False), (1, True)]  # compiled: the warm-up call compiles
    for groups, compiled in runs:
        ranks = run_ranks(2, _pipeline, args, groups, compiled, timeout=1800)
        name = f"pippy_xla_2_ranks_{groups}_groups" + ("_compiled" if compiled else "")
        slowest = _slowest(ranks, want, name)
        results[name] = summarize([new_tokens / t for t in slowest])
        busy[name] = [round(r[2], 3) for r in ranks]
    for name, r in results.items():
        print(
            f"{name:37s} {r['median']:8.1f} new tokens/s (min {r['min']:.1f}, max {r['max']:.1f})"
        )
    for name, shares in busy.items():
        print(f"{name:37s} decode busy share per rank {shares}")
    payload = {"args": vars(args), "unit": "new tokens/s", "results": results}
    payload["decode_busy_share"] = busy
    path = save(args.out, payload)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
