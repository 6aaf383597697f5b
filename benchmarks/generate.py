"""Generation throughput: ``PipelineModel.generate`` on ``--ranks`` CPU ranks (2 or 4) against
HF's own pipeline (``DistributedConfig(pp_size=ranks)``: ``from_pretrained`` splits the layers over
the ranks, every rank runs ``generate`` and the last rank broadcasts the logits) on the same ranks,
and HF's ``generate`` on the unsplit model in one process (its default dynamic cache and its
static cache); greedy, the same random Llama, prompts and lengths; the pipeline with the batch in
1 group of rows and in as many groups as stages (``groups``). One thread per process (a rank or
the single process). ``--groups`` names the group counts run eagerly (default 1 and ``--ranks``).

Each method is timed twice per repeat: a call for ``--new`` tokens (the whole generation) and one
for a single token (the prefill of the prompts and the first token). Reported: whole-call new
tokens per second (batch x ``--new`` over the call's time), prefill prompt tokens per second
(batch x ``--prompt`` over the one-token call's time) and decode tokens per second (batch x
(``--new`` - 1) over the difference of the two), medians of ``--repeats`` after a warm-up; for a
pipeline the slowest rank's time. For ``pipe.generate`` also each rank's decode busy share (the
time its decode-schedule runs spent in forwards over their span, in the last call, from the
engine's action timings) and each rank's KV cache bytes against the one-process cache's. Every
call's tokens are checked equal to HF's one-process tokens before any time is reported. The
pipeline decodes pipelined across ranks (``[Note: generation data flow]`` in
``pippy_xla/runtime/_generate.py``): with one group the stages take turns, with one group per
stage every rank works on a group while the others work on theirs. A last row runs the pipeline
with ``compile=True`` (one group; ``--compiled-groups G``: G): compiled prefill and decode
graphs (``[Note: compiled generation]``), compiled by the warm-up call (``--no-compiled`` leaves
it out). ``--prefill-chunk K`` passes HF's ``prefill_chunk_size=K`` (HF's chunked prefill) to
HF's one process and to the pipeline, whose prefill is then pipelined by groups and chunks, but
not to HF's pipeline: its chunked prefill returned other tokens than HF's one process does (seen
with transformers 5.23), and chunks cannot shorten a pipeline whose stages take turns; HF's
pipeline is then checked against an unchunked one-process run
(``hf_one_process_dynamic_unchunked``). ``--rounds R`` runs HF's pipeline and every pipeline run
``R`` times, alternated (HF's pipeline, then each run, per round), prints each run's whole-call
rate over HF's pipeline's of the same round, and reports each run's round of median rate: on a
shared VM whose speed drifts between minutes, ratios within a round are what compare.
Run: ``python benchmarks/generate.py [--ranks 4]``.
"""

from __future__ import annotations

import argparse
import tempfile
import time

from _common import llama_config, run_ranks, save, summarize


def _options(args, chunked: bool = True) -> dict:
    """A method's generation options besides the lengths: greedy, and ``--prefill-chunk``."""
    return {"do_sample": False, "prefill_chunk_size": args.prefill_chunk if chunked else None}


def _model(args):
    import torch
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(llama_config(args.layers, args.hidden)).eval()
    g = torch.Generator().manual_seed(1)
    prompts = torch.randint(1, 512, (args.batch, args.prompt), generator=g)
    return model, prompts


def _timed(generate, args):
    """``generate(max_new_tokens)`` timed for ``--new`` tokens and for one, ``--repeats`` times
    each after a warm-up of each: (whole-call times, one-token times, the whole call's tokens)."""
    generate(args.new)  # warm-up
    generate(1)
    full, first, out = [], [], None
    for _ in range(args.repeats):
        start = time.perf_counter()
        out = generate(args.new)
        full.append(time.perf_counter() - start)
        start = time.perf_counter()
        generate(1)
        first.append(time.perf_counter() - start)
    return full, first, out.tolist()


def _one_process(args) -> dict:
    import torch

    torch.set_num_threads(1)
    model, prompts = _model(args)
    out, mask = {}, torch.ones_like(prompts)
    runs = {"dynamic": _options(args), "static": _options(args)}
    runs["static"]["cache_implementation"] = "static"
    if args.prefill_chunk:  # HF's pipeline's reference (see the module's docstring)
        runs["dynamic_unchunked"] = _options(args, chunked=False)
    for cache, opts in runs.items():

        def generate(new, o=opts):
            return model.generate(prompts, attention_mask=mask, max_new_tokens=new, **o)

        out[cache] = _timed(generate, args)
    # The one-process cache, for the ranks' share: 2 (keys, values) x layers x batch x kv heads x
    # positions x head dim x 4 bytes, as HF's static cache allocates it for the generation.
    config = model.config
    head_dim = config.hidden_size // config.num_attention_heads
    positions = args.prompt + args.new
    kv = 2 * config.num_hidden_layers * args.batch * config.num_key_value_heads * head_dim
    return out, kv * positions * 4


def _pipeline(rank, world, args, groups: int, compile: bool = False):
    import torch

    import pippy_xla as px
    from pippy_xla.runtime._generate import cache_bytes

    torch.set_num_threads(1)
    model, prompts = _model(args)
    layer_cls = type(model.model.layers[0])
    pipe = px.PipelineModel(model, layer_cls=layer_cls, num_microbatches=1, compile=compile)
    mask = torch.ones_like(prompts)

    def generate(new):
        return pipe.generate(
            prompts, attention_mask=mask, groups=groups, max_new_tokens=new, **_options(args)
        )

    full, first, tokens = _timed(generate, args)
    generate(args.new)  # the caches of the whole generation, for their size
    extra = {"busy": _decode_busy(pipe), "cache_bytes": cache_bytes(pipe._generator.caches)}
    return full, first, tokens, extra


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
    mask = torch.ones_like(prompts)

    def generate(new):
        return model.generate(
            prompts, attention_mask=mask, max_new_tokens=new, **_options(args, chunked=False)
        )

    return _timed(generate, args)


def _rates(args, full: list[float], first: list[float]) -> dict:
    """Whole-call, prefill and decode rates of paired timings (see the module's docstring)."""
    decode = [f - p for f, p in zip(full, first, strict=True)]
    return {
        "new_tokens_per_s": summarize([args.batch * args.new / t for t in full]),
        "prefill_tokens_per_s": summarize([args.batch * args.prompt / t for t in first]),
        "decode_tokens_per_s": summarize([args.batch * (args.new - 1) / t for t in decode]),
    }


def _slowest(ranks, want, what: str) -> tuple[list[float], list[float]]:
    """The slowest rank's time of each call (whole, one token), once every rank's tokens are
    ``want``."""
    assert all(r[2] == want for r in ranks), f"{what}: tokens differ from HF's"

    def worst(i):
        return [max(ts) for ts in zip(*(r[i] for r in ranks), strict=True)]

    return worst(0), worst(1)


def _print(results: dict, extra: dict) -> None:
    for name, r in results.items():
        cols = (
            f"{r[k]['median']:8.1f} {k.split('_')[0]}"
            for k in ("new_tokens_per_s", "prefill_tokens_per_s", "decode_tokens_per_s")
        )
        print(f"{name:39s} tokens/s: " + "  ".join(cols))
    for name, e in extra.items():
        print(f"{name:39s} decode busy share {e['busy']}  cache bytes per rank {e['cache_bytes']}")


def _print_rounds(rounds: dict[str, list[dict]], hf_name: str) -> None:
    """Each pipeline run's whole-call rate over HF's pipeline's of the same round."""
    hf = [r["new_tokens_per_s"]["median"] for r in rounds[hf_name]]
    for name, rs in rounds.items():
        rates = [r["new_tokens_per_s"]["median"] for r in rs]
        ratios = " ".join(f"{x / h:.2f}x" for x, h in zip(rates, hf, strict=True))
        print(f"{name:39s} rounds: " + " ".join(f"{x:.1f}" for x in rates) + f"  ({ratios})")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--ranks", type=int, default=2, choices=(2, 4))
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--prompt", type=int, default=32)
    p.add_argument("--new", type=int, default=32)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument(
        "--groups", type=int, nargs="+", default=None, help="group counts (default: 1 and --ranks)"
    )
    p.add_argument("--prefill-chunk", type=int, default=None, help="HF's prefill_chunk_size")
    p.add_argument("--no-compiled", action="store_true", help="leave out the compiled run")
    p.add_argument("--compiled-groups", type=int, default=1, help="the compiled run's groups")
    p.add_argument(
        "--rounds", type=int, default=1, help="HF's pipeline and the pipeline runs, alternated"
    )
    p.add_argument("--out", default=None, help="results/<out>.json (default generate_<ranks>)")
    args = p.parse_args()
    single, one_cache = _one_process(args)
    results = {f"hf_one_process_{c}": _rates(args, *single[c][:2]) for c in single}
    want = single["dynamic"][2]
    hf_want = single.get("dynamic_unchunked", single["dynamic"])[2]
    groups = sorted(set(args.groups or (1, args.ranks)))
    runs = [(g, False) for g in groups] + [(args.compiled_groups, True)] * (not args.no_compiled)
    rounds: dict[str, list[dict]] = {}
    extra = {}
    hf_name = f"hf_pipeline_{args.ranks}_ranks"
    with tempfile.TemporaryDirectory() as path:
        model, _ = _model(args)
        model.save_pretrained(path)
        for _ in range(args.rounds):  # HF's pipeline, then each pipeline run, in every round
            ranks = run_ranks(args.ranks, _hf_pipeline, args, path, timeout=900)
            rounds.setdefault(hf_name, []).append(_rates(args, *_slowest(ranks, hf_want, "HF's")))
            for g, compiled in runs:
                name = f"pippy_xla_{args.ranks}_ranks_{g}_groups" + ("_compiled" * compiled)
                ranks = run_ranks(args.ranks, _pipeline, args, g, compiled, timeout=1800)
                rounds.setdefault(name, []).append(_rates(args, *_slowest(ranks, want, name)))
                extra[name] = {
                    "busy": [round(r[3]["busy"], 3) for r in ranks],
                    "cache_bytes": [r[3]["cache_bytes"] for r in ranks],
                }
    # Each run's round of median whole-call rate (the rounds themselves are saved beside).
    for name, rs in rounds.items():
        results[name] = sorted(rs, key=lambda r: r["new_tokens_per_s"]["median"])[len(rs) // 2]
    if args.rounds > 1:
        _print_rounds(rounds, hf_name)
    _print(results, extra)
    payload = {"args": vars(args), "results": results, "pipeline": extra}
    if args.rounds > 1:
        payload["rounds"] = rounds
    payload["one_process_cache_bytes"] = one_cache
    print(f"one process's cache bytes {one_cache}")
    path = save(args.out or f"generate_{args.ranks}", payload)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
