"""Where a MoE model's experts live, on 4 CPU ranks (gloo): one Mixtral, one global batch, four
layouts of 2 pipeline stages:

- ``replicated``: dp=2 x pp=2, every expert whole on both replicas of its stage
  (``data_parallel="replicate"``);
- ``fsdp``: dp=2 x pp=2, every weight sharded over the replicas by FSDP2
  (``data_parallel="shard"``), gathered for each microbatch;
- ``expert parallel``: dp=2 x pp=2, ``expert_parallel=2``: each replica holds half of its
  stage's experts, whole, and the routed tokens go to them and back by all-to-all
  (docs/expert_parallel.md);
- ``tensor parallel``: pp=2 x tp=2, ``tensor_parallel="auto"``: attention sharded by HF's tp
  plan; the experts, which the MoE configs' tp plans of transformers 5.25 leave whole, sharded
  by the model's expert plan over the tp ranks (each token computed once, docs/tensor_parallel.md).

Every layout builds on ``meta`` and reads its stage from one ``save_pretrained`` of the same
random model, then trains ``--warmup`` + ``--steps`` steps (the step and an AdamW step) on the same
global batch, in 4 fresh processes of one thread each. The router's auxiliary loss is on, and
every layout cuts the global batch into the same 4 microbatches (2 per replica with dp=2), so
every step's loss of every layout is checked equal to ``replicated``'s before anything is
reported. Per layout:

- ``step_s``: median over the timed steps of the slowest rank's step time (a barrier starts each);
- per rank: ``tracked_peak_mib``, the peak of the bytes live in torch's CPU allocator during the
  timed steps (pippy_xla's counting allocator, installed before the model is built);
  ``state_mib``, the exact bytes of its local parameters, gradients and AdamW state;
  ``collective_mib``, the bytes it hands to collectives in one step (an extra step, untimed):
  every ``torch.distributed`` collective and every functional collective (DTensor's, HF's
  all-to-all), counted by the input tensor's bytes; the pipeline's own stage-to-stage
  transfers are not counted (the same activations in every layout: pp=2 in all).

The 4 ranks share the machine's cores: step times include contention and compare layouts on this
machine only. Run: ``python benchmarks/expert_parallel.py``; results in
``benchmarks/results/<out>.json``.
"""

from __future__ import annotations

import argparse
import functools
import statistics
import sys
import tempfile

from _common import check_losses, run_ranks, save, state_bytes, timed_step, token_batch

# (name, mesh shape, mesh dim names, options).
LAYOUTS = [
    ("replicated", (2, 2), ("dp", "pp"), {}),
    ("fsdp", (2, 2), ("dp", "pp"), {"data_parallel": "shard"}),
    ("expert parallel", (2, 2), ("dp", "pp"), {"expert_parallel": 2}),
    ("tensor parallel", (1, 2, 2), ("dp", "pp", "tp"), {"tensor_parallel": "auto"}),
]
# Before the first optimizer step the layouts' losses differ by float rounding only (sums in
# another order), then each AdamW step lets them drift by up to 1e-4 relative (as in
# benchmarks/tensor_parallel.py); a lost token or a missed reduction moves the loss by percents.
LOSS_RTOL_FIRST = 1e-5
LOSS_RTOL_PER_STEP = 1e-4
COLLECTIVES = {
    "all_to_all_single": "input",
    "all_reduce": "tensor",
    "all_gather_into_tensor": "input_tensor",
    "all_gather_single": "input_tensor",
    "reduce_scatter_tensor": "input",
    "reduce_scatter_single": "input",
    "all_gather": "tensor",
    "broadcast": "tensor",
}
"""The ``torch.distributed`` collectives counted, with the argument that holds what a rank sends
(FSDP2 calls the ``_single`` ones)."""


def _config(args):
    from transformers import MixtralConfig

    return MixtralConfig(
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        intermediate_size=args.expert_size,
        num_hidden_layers=args.layers,
        num_attention_heads=args.hidden // 32,
        num_key_value_heads=2,
        num_local_experts=args.experts,
        num_experts_per_tok=2,
        output_router_logits=True,
        router_aux_loss_coef=0.01,
    )


class Collectives:
    """Counts the bytes this process hands to collectives while active: the
    ``torch.distributed`` functions of :data:`COLLECTIVES` (wherever a module imported them by
    name) and the functional collectives (``_c10d_functional`` ops, DTensor's and HF's
    all-to-all) through a dispatch mode."""

    def __init__(self) -> None:
        self.bytes = 0
        self._patched: list = []
        self._depth = 0  # a collective that calls another is counted once

    def _count(self, value) -> None:
        import torch

        tensors = value if isinstance(value, (list, tuple)) else [value]
        self.bytes += sum(
            t.numel() * t.element_size() for t in tensors if isinstance(t, torch.Tensor)
        )

    def _wrap(self, fn, name: str):
        import inspect

        signature = inspect.signature(fn)

        def counted(*args, **kwargs):
            if self._depth == 0:
                self._count(signature.bind(*args, **kwargs).arguments[COLLECTIVES[name]])
            self._depth += 1
            try:
                return fn(*args, **kwargs)
            finally:
                self._depth -= 1

        return counted

    def __enter__(self):
        import torch.distributed as dist
        from torch.utils._python_dispatch import TorchDispatchMode

        counter = self

        class Functional(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                name = func.namespace, func.__name__.split(".")[0]
                if name[0].startswith("_c10d_functional") and name[1] != "wait_tensor":
                    counter._count(args[0])
                return func(*args, **(kwargs or {}))

        wrapped = {getattr(dist, n): self._wrap(getattr(dist, n), n) for n in COLLECTIVES}
        for module in list(sys.modules.values()):
            for attr, value in list(getattr(module, "__dict__", {}).items()):
                if attr in COLLECTIVES and callable(value) and value in wrapped:
                    self._patched.append((module, attr, value))
                    setattr(module, attr, wrapped[value])
        self._mode = Functional()
        self._mode.__enter__()
        return self

    def __exit__(self, *exc):
        self._mode.__exit__(*exc)
        for module, attr, value in self._patched:
            setattr(module, attr, value)
        self._patched.clear()


def _build(args, path: str, layout):
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from transformers import MixtralForCausalLM

    import pippy_xla as px

    _, shape, names, options = layout
    with torch.device("meta"):
        model = MixtralForCausalLM(_config(args))
    mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
    # The same 4 microbatches of the global batch in every layout (the router loss is per one).
    per_replica = 4 // shape[0]
    pipe = px.PipelineModel(model, num_microbatches=per_replica, mesh=mesh, **options)
    pipe.load_pretrained(path)
    return pipe


def _rank(rank, world, args, path: str, layout):
    import torch
    import torch.distributed.tensor  # noqa: F401  (imported before the baseline)

    from pippy_xla import _C

    batch = token_batch(args.batch, args.seq, args.vocab)
    _C.memory_tracker_install()
    pipe = _build(args, path, layout)
    params = list(pipe.parameters())
    opt = torch.optim.AdamW(params, lr=args.lr)

    step = functools.partial(timed_step, pipe, opt, batch)
    warm = [step() for _ in range(args.warmup)]
    _C.memory_reset_peak()
    timed = [step() for _ in range(args.steps)]
    tracked = _C.memory_stats()
    with Collectives() as counted:
        last = step()
    return {
        "step_s": [t for t, _ in timed],
        "losses": [loss for _, loss in [*warm, *timed, last]],
        "tracked_peak_bytes": tracked.peak_bytes,
        "state_bytes": state_bytes(params, opt),
        "collective_bytes": counted.bytes,
    }


def _row(layout, per_rank: list[dict], steps: int) -> dict:
    mib = lambda key: [round(r[key] / 2**20, 2) for r in per_rank]  # noqa: E731
    timed = [max(r["step_s"][i] for r in per_rank) for i in range(steps)]
    for r in per_rank:  # every rank reports the step's loss (the last stage's, broadcast)
        assert r["losses"] == per_rank[0]["losses"], f"{layout[0]}: ranks' losses differ"
    return {
        "mesh": dict(zip(layout[2], layout[1], strict=True)),
        "options": layout[3],
        "step_s_median": statistics.median(timed),
        "step_s": timed,
        "losses": per_rank[0]["losses"],
        "tracked_peak_mib_per_rank": mib("tracked_peak_bytes"),
        "state_mib_per_rank": mib("state_bytes"),
        "collective_mib_per_rank": mib("collective_bytes"),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--expert-size", type=int, default=512)
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=2048)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--lr", type=float, default=1e-4)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--out", default="expert_parallel", help="results/<out>.json")
    args = parser.parse_args()
    import torch
    import transformers
    from transformers import MixtralForCausalLM

    layouts = {}
    with tempfile.TemporaryDirectory() as path:
        torch.manual_seed(0)
        MixtralForCausalLM(_config(args)).save_pretrained(path)
        for layout in LAYOUTS:
            per_rank = run_ranks(4, _rank, args, path, layout, timeout=1800, pg_timeout=300)
            layouts[layout[0]] = _row(layout, per_rank, args.steps)
    worst = check_losses(layouts, "replicated", LOSS_RTOL_FIRST, LOSS_RTOL_PER_STEP)
    print(f"losses equal over {args.warmup + args.steps + 1} steps (max rel diff {worst:.2e})")
    for name, row in layouts.items():
        print(
            f"{name:16s} step {row['step_s_median']:.3f} s  state MiB {row['state_mib_per_rank']}"
            f"  tracked peak MiB {row['tracked_peak_mib_per_rank']}  collective MiB/step "
            f"{row['collective_mib_per_rank']}"
        )
    payload = {
        "config": {k: getattr(args, k) for k in vars(args)},
        "versions": {"transformers": transformers.__version__},
        "layouts": layouts,
        "loss_max_rel_diff": worst,
    }
    print(f"saved {save(args.out, payload)}")


if __name__ == "__main__":
    main()
