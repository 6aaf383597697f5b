"""Long rows on 4 CPU ranks (gloo): one 8-layer Llama, one row of ``S`` tokens, three layouts of the
4 ranks: ``pp=4`` (the pipeline alone, every stage the whole row), ``cp=2 x pp=2`` and ``cp=4``
(one stage, the row's tokens shared over 4 ranks; docs/context_parallel.md). Every layout trains
``--warmup`` + ``--steps`` steps (the step and an AdamW step) from the same random model and row,
in 4 fresh processes of one thread each, every step's loss checked equal to ``pp=4``'s before
anything is reported. Per layout and length:

- ``step_s``: median over the timed steps of the slowest rank's step time (a barrier starts each);
- per rank, ``tracked_peak_mib``: the peak of the bytes live in torch's CPU allocator during the
  timed steps (pippy_xla's counting allocator, installed before the model is built), and
  ``state_mib``, the exact bytes of its parameters, gradients and AdamW state;
- ``longest_fitting``: for ``--limit``, the longest tested length whose largest per-rank peak
  fits under it, per layout.

The model is narrow (hidden 64, 4 heads of 16, MLP 128) so that a CPU step at tens of thousands
of tokens takes seconds, with a vocabulary of 8192 so that the head's logits (``S x V``) weigh as
a real model's do at long lengths. On 4 ranks every layout holds ``8 / pp`` layers of ``S / cp``
tokens per rank, the same layer activations; what ``cp`` divides that ``pp`` cannot is what one
stage holds of the whole row: the head's logits, their log-softmax and gradient on the last
stage, the embedding's output on the first, one layer's attention over ``S``. The 4 ranks share
the machine's cores: step times compare layouts on this machine only. Run: ``python
benchmarks/context_parallel.py [--lengths 8192 16384 32768]``; results in
``benchmarks/results/<out>.json``.
"""

from __future__ import annotations

import argparse
import functools
import statistics

from _common import check_losses, run_ranks, save, state_bytes, timed_step, token_batch

# (name, mesh shape, mesh dim names); the ranks of every layout: 4.
LAYOUTS = [
    ("pp=4", (4,), ("pp",)),
    ("cp=2 x pp=2", (2, 2), ("cp", "pp")),
    ("cp=4", (4,), ("cp",)),
]
# Losses: float rounding before the first AdamW step (the attention and the loss summed in
# another order over the shares), then AdamW's drift per step, as benchmarks/tensor_parallel.py.
LOSS_RTOL_FIRST = 1e-5
LOSS_RTOL_PER_STEP = 1e-4


def _model(args):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=args.vocab,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=args.layers,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=max(args.lengths),
    )
    return LlamaForCausalLM(config)


def _rank(rank, world, args, seq: int, layout):
    import torch
    from torch.distributed.device_mesh import init_device_mesh

    import pippy_xla as px
    from pippy_xla import _C

    _, shape, names = layout
    _C.memory_tracker_install()
    torch.manual_seed(0)
    model = _model(args)
    mesh = init_device_mesh("cpu", shape, mesh_dim_names=names) if "cp" in names else None
    pipe = px.PipelineModel(model, num_microbatches=1, mesh=mesh, timeout=600)
    del model
    params = list(pipe.parameters())
    opt = torch.optim.AdamW(params, lr=1e-3)
    batch = token_batch(1, seq, args.vocab)

    step = functools.partial(timed_step, pipe, opt, batch)
    warm = [step() for _ in range(args.warmup)]
    _C.memory_reset_peak()
    timed = [step() for _ in range(args.steps)]
    return {
        "step_s": [t for t, _ in timed],
        "losses": [loss for _, loss in warm + timed],
        "tracked_peak_bytes": _C.memory_stats().peak_bytes,
        "state_bytes": state_bytes(params, opt),
    }


def _row(per_rank: list[dict], steps: int) -> dict:
    mib = lambda key: [round(r[key] / 2**20, 2) for r in per_rank]  # noqa: E731
    for r in per_rank:  # every rank reports the step's loss
        assert r["losses"] == per_rank[0]["losses"], "ranks' losses differ"
    timed = [max(r["step_s"][i] for r in per_rank) for i in range(steps)]
    return {
        "step_s_median": statistics.median(timed),
        "step_s": timed,
        "losses": per_rank[0]["losses"],
        "tracked_peak_mib_per_rank": mib("tracked_peak_bytes"),
        "state_mib_per_rank": mib("state_bytes"),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--lengths", type=int, nargs="+", default=[8192, 16384, 32768])
    parser.add_argument("--limit", type=float, default=512.0, help="MiB per rank")
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--steps", type=int, default=1)
    parser.add_argument("--out", default="context_parallel", help="results/<out>.json")
    args = parser.parse_args()
    import transformers

    results: dict = {}
    for seq in args.lengths:
        rows = {}
        for layout in LAYOUTS:
            per_rank = run_ranks(4, _rank, args, seq, layout, timeout=3600, pg_timeout=900)
            rows[layout[0]] = _row(per_rank, args.steps)
            print(
                f"S={seq:6d} {layout[0]:12s} step {rows[layout[0]]['step_s_median']:8.2f} s  "
                f"tracked peak MiB {rows[layout[0]]['tracked_peak_mib_per_rank']}",
                flush=True,
            )
        worst = check_losses(rows, "pp=4", LOSS_RTOL_FIRST, LOSS_RTOL_PER_STEP)
        print(f"S={seq}: losses equal (max rel diff {worst:.2e})")
        results[str(seq)] = {"layouts": rows, "loss_max_rel_diff": worst}
    fitting = {
        name: max(
            (
                s
                for s in args.lengths
                if max(results[str(s)]["layouts"][name]["tracked_peak_mib_per_rank"]) <= args.limit
            ),
            default=None,
        )
        for name, _, _ in LAYOUTS
    }
    print(f"longest tested length under {args.limit} MiB per rank: {fitting}")
    payload = {
        "config": {k: getattr(args, k) for k in vars(args)},
        "versions": {"transformers": transformers.__version__},
        "lengths": results,
        "longest_fitting": fitting,
    }
    print(f"saved {save(args.out, payload)}")


if __name__ == "__main__":
    main()
