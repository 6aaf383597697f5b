"""Pipeline x tensor parallel on 4 CPU ranks (gloo), one model and one global batch: pp=4
(pipeline only), pp=2 x tp=2 (``tensor_parallel="auto"`` on a 3-D mesh: the head sharded by
the vocabulary; and the same with the head whole, ``{"lm_head": "replicate"}``) and HF's own tensor
parallel alone (tp=4: ``from_pretrained(dir, distributed_config=DistributedConfig(tp_size=4))``,
the whole batch on every rank, HF's plan including its row-sharded embedding and gathered head).

Every layout starts from the same random Llama, saved once with ``save_pretrained`` (the
pipelines build on ``meta`` and read their stage with ``load_pretrained``; HF's loads its shards),
and trains ``--warmup`` + ``--steps`` steps (the training step and an AdamW step) on the same
global batch, in 4 fresh processes of one thread each (the layouts one after the other). Every
step's loss of every layout is checked equal to pp=4's (``LOSS_RTOL_FIRST``,
``LOSS_RTOL_PER_STEP``) before any time is reported. Reported per layout:

- ``step_s``: median over the timed steps of the slowest rank's step time (a barrier starts each);
- per rank, ``anon_mib``: the peak of its anonymous resident memory (``RssAnon``, sampled every
  2 ms) during the timed steps, minus its value before the model was built (parameters,
  gradients, AdamW state, activations, communication buffers, as the OS sees them);
  ``tracked_peak_mib``: the peak of the bytes live in torch's CPU allocator during the timed
  steps (pippy_xla's counting allocator, installed before the model is built: exact, and free of
  what the C library keeps after a free);
  ``state_mib``: the exact bytes of its local parameters, gradients and AdamW state.

The 4 ranks share the machine's cores: step times include contention and compare layouts on this
machine only. HF's tensor parallel needs the ``accelerate`` package (``from_pretrained`` with a
``distributed_config`` refuses to run without it): ``pip install -e .[bench]``, or, as for the
recorded run, a venv over the system packages (``python -m venv --system-site-packages
/tmp/tpb_venv && /tmp/tpb_venv/bin/pip install accelerate``). Run: ``python
benchmarks/tensor_parallel.py`` (``--hidden 512 --out tensor_parallel_h512`` for the larger
model); results in ``benchmarks/results/<out>.json``.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

from _common import (
    Phase,
    check_losses,
    llama_config,
    proc_memory,
    run_ranks,
    save,
    state_bytes,
    token_batch,
)

# (name, pp, tp, runner): runner "pippy_xla" or "hf".
LAYOUTS = [
    ("pp=4", 4, 1, "pippy_xla"),
    ("pp=2 x tp=2", 2, 2, "pippy_xla"),
    ("pp=2 x tp=2, head whole", 2, 2, "pippy_xla"),
    ("HF tp=4", 1, 4, "hf"),
]
RULES = {"pp=2 x tp=2, head whole": {"lm_head": "replicate"}}
"""A layout's ``tensor_parallel`` rules merged over the model's plan (else ``"auto"``): HF's
``"replicate"`` keeps the head whole on every tp rank, for the vocabulary-parallel head's
comparison."""

# Before the first optimizer step the layouts' losses differ by float rounding only: fp32 sums
# of the same products in another order (tp's all-reduces, microbatch losses summed), ~1e-7
# relative, so rtol 1e-5 as the tests' LOSS_TOL. Each AdamW step then moves an element whose
# gradient nearly cancels by up to lr whatever the rounding (Adam divides by sqrt(v)), so later
# losses drift apart by more: rtol 1e-4 per step after the first (measured: see the results'
# ``loss_max_rel_diff``); a lost or doubled microbatch, a wrong shard or a missed reduction
# moves the loss by percents.
LOSS_RTOL_FIRST = 1e-5
LOSS_RTOL_PER_STEP = 1e-4


def _config(args):
    # tp=4 divides the key/value heads only with 4 of them (llama_config has 2).
    config = llama_config(args.layers, args.hidden, args.vocab)
    config.num_key_value_heads = 4
    return config


def _build(args, path: str, name: str, pp: int, tp: int, runner: str):
    """The layout's model on this rank and a function computing the loss with gradients."""
    import torch
    from transformers import LlamaForCausalLM

    if runner == "hf":
        from transformers.distributed import DistributedConfig

        model = LlamaForCausalLM.from_pretrained(
            path, distributed_config=DistributedConfig(tp_size=tp)
        )
        model.train()

        def train(batch):
            loss = model(**batch, use_cache=False).loss
            loss.backward()
            return loss.detach()

        return model, train
    from torch.distributed.device_mesh import init_device_mesh
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    import pippy_xla as px

    with torch.device("meta"):
        model = LlamaForCausalLM(_config(args))
    mesh = None
    if tp > 1:
        mesh = init_device_mesh("cpu", (1, pp, tp), mesh_dim_names=("dp", "pp", "tp"))
    pipe = px.PipelineModel(
        model,
        layer_cls=LlamaDecoderLayer,
        num_microbatches=args.microbatches,
        mesh=mesh,
        tensor_parallel=RULES.get(name, "auto") if tp > 1 else None,
    )
    pipe.load_pretrained(path)
    return pipe, lambda batch: pipe.run_train(**batch)


def _import_all(runner: str) -> None:
    """Imports what the layout's build imports, so that the memory baseline includes the
    libraries (HF's tensor parallel imports ``accelerate`` on ``from_pretrained``)."""
    import torch.distributed.tensor  # noqa: F401
    from transformers.distributed import DistributedConfig  # noqa: F401
    from transformers.distributed.tensor_parallel import apply_tensor_parallelism  # noqa: F401

    import pippy_xla  # noqa: F401

    if runner == "hf":
        import accelerate  # noqa: F401


def _rank(rank, world, args, path: str, layout):
    import torch
    import torch.distributed as dist

    from pippy_xla import _C

    name, pp, tp, runner = layout
    batch = token_batch(args.batch, args.seq, args.vocab)
    _import_all(runner)
    _C.memory_tracker_install()
    base = proc_memory()["RssAnon"]
    model, train = _build(args, path, name, pp, tp, runner)
    params = list(model.parameters())
    opt = torch.optim.AdamW(params, lr=args.lr)

    def step():
        dist.barrier()
        t0 = time.perf_counter()
        loss = train(batch)
        opt.step()
        opt.zero_grad(set_to_none=False)
        dist.barrier()
        return time.perf_counter() - t0, float(loss)

    warm = [step() for _ in range(args.warmup)]
    memory: dict = {}
    _C.memory_reset_peak()
    with Phase("steps", memory):
        timed = [step() for _ in range(args.steps)]
    tracked = _C.memory_stats()
    return {
        "step_s": [t for t, _ in timed],
        "losses": [loss for _, loss in warm + timed],
        "anon_bytes": memory["steps"]["anon_peak_bytes"] - base,
        "tracked_peak_bytes": tracked.peak_bytes,
        "state_bytes": state_bytes(params, opt),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--vocab", type=int, default=2048)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--lr", type=float, default=1e-4)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--out", default="tensor_parallel", help="results/<out>.json")
    args = parser.parse_args()
    import torch
    from transformers import LlamaForCausalLM

    layouts = {}
    with tempfile.TemporaryDirectory() as path:
        torch.manual_seed(0)
        LlamaForCausalLM(_config(args)).save_pretrained(path)
        for layout in LAYOUTS:
            name, pp, tp, runner = layout
            per_rank = run_ranks(4, _rank, args, path, layout, timeout=1800, pg_timeout=300)
            steps = [max(r["step_s"][i] for r in per_rank) for i in range(args.steps)]
            layouts[name] = {
                "pp": pp,
                "tp": tp,
                "runner": runner,
                "step_s_median": statistics.median(steps),
                "step_s": steps,
                "losses": per_rank[0]["losses"],
                "anon_mib_per_rank": [round(r["anon_bytes"] / 2**20, 1) for r in per_rank],
                "state_mib_per_rank": [round(r["state_bytes"] / 2**20, 1) for r in per_rank],
                "tracked_peak_mib_per_rank": [
                    round(r["tracked_peak_bytes"] / 2**20, 1) for r in per_rank
                ],
            }
            # Every rank of a layout reports the same loss (a pipeline's from its last stage).
            for r in per_rank:
                assert r["losses"] == per_rank[0]["losses"], f"{name}: ranks' losses differ"
    worst = check_losses(layouts, "pp=4", LOSS_RTOL_FIRST, LOSS_RTOL_PER_STEP)
    print(f"losses equal over {args.warmup + args.steps} steps (max rel diff {worst:.2e})")
    for name, row in layouts.items():
        print(
            f"{name:12s} step {row['step_s_median']:.3f} s  loss {row['losses'][-1]:.5f}  "
            f"peak anon MiB {row['anon_mib_per_rank']}  tracked peak MiB "
            f"{row['tracked_peak_mib_per_rank']}  state MiB {row['state_mib_per_rank']}"
        )
    import accelerate
    import transformers

    config = {k: getattr(args, k) for k in vars(args)}
    versions = {"transformers": transformers.__version__, "accelerate": accelerate.__version__}
    payload = {"config": config, "versions": versions, "layouts": layouts}
    payload["loss_max_rel_diff"] = worst
    path = save(args.out, payload)
    print(f"saved {path}")


if __name__ == "__main__":
    main()
