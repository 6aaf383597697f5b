"""The ``pippy-xla`` command line.

``pippy-xla plan --model llama --layers 8 --hidden 64 --stages 4 --microbatches 8
--memory-limit 20MiB`` builds the model on ``meta``, profiles it on the CPU (holding one layer of
each kind) and prints the plan table with predicted memory and time per stage. ``--config
path.json`` takes an HF config file instead of ``--model`` and its size flags. ``pippy-xla
simulate`` prints a schedule's predicted step, and draws it with ``--png PATH``. Also ``python -m
pippy_xla``.

A mistake (a bad size, a plan that cannot be made, an output folder that cannot be written) is one
line on stderr and exit status 2, not a traceback.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence

__all__ = ["main"]

_FAMILIES = ("llama", "gpt2", "qwen2")


def _build_model(args: argparse.Namespace):
    import torch
    import transformers

    if args.config:
        with open(args.config) as f:
            cfg_dict = json.load(f)
        model_type = cfg_dict.pop("model_type", None)
        if model_type is None:
            raise SystemExit(f"{args.config} has no 'model_type'")
        cfg = transformers.AutoConfig.for_model(model_type, **cfg_dict)
    else:
        common = dict(vocab_size=args.vocab)
        if args.model == "gpt2":
            cfg = transformers.GPT2Config(
                n_embd=args.hidden,
                n_layer=args.layers,
                n_head=args.heads,
                n_positions=max(args.seq_len, 128),
                resid_pdrop=0,
                embd_pdrop=0,
                attn_pdrop=0,
                bos_token_id=0,
                eos_token_id=0,
                **common,
            )
        else:
            cls = transformers.LlamaConfig if args.model == "llama" else transformers.Qwen2Config
            cfg = cls(
                hidden_size=args.hidden,
                intermediate_size=args.intermediate or 2 * args.hidden,
                num_hidden_layers=args.layers,
                num_attention_heads=args.heads,
                num_key_value_heads=args.kv_heads or args.heads,
                **common,
            )
    dtype = getattr(torch, args.dtype)
    torch.manual_seed(0)
    # On meta: the planner profiles one layer per kind (see [Note: profiling a meta model]), so
    # a model larger than this machine can be planned.
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(cfg).to(dtype)
    names = list(getattr(model, "_no_split_modules", None) or [])
    layer_cls = next((type(m) for m in model.modules() if type(m).__name__ in names), None)
    if layer_cls is None:
        raise SystemExit(f"cannot find the decoder-layer class of {type(model).__name__}")
    return model, layer_cls


def _plan(args: argparse.Namespace) -> int:
    import pippy_xla as px
    from pippy_xla.plan.planner import PlanInfeasibleError

    model, layer_cls = _build_model(args)
    batch = args.batch_size or args.microbatches
    limit = args.memory_limit if len(args.memory_limit) > 1 else args.memory_limit[0]
    try:
        plan = px.plan(
            model,
            layer_cls=layer_cls,
            num_stages=args.stages,
            num_microbatches=args.microbatches,
            batch_size=batch,
            seq_len=args.seq_len,
            memory_limit=limit,
            schedule=args.schedule,
            chunks=args.chunks,
            allow_checkpoint=not args.no_checkpoint,
            repeats=args.repeats,
        )
    except PlanInfeasibleError as e:
        print(f"pippy-xla plan: error: {e}", file=sys.stderr)
        return 2
    print(
        f"{type(model).__name__}, {len(px.find_layers(model, layer_cls))} layers, batch "
        f"{batch} x {args.seq_len}, {args.dtype}"
    )
    print(plan.table())
    if args.json:
        with open(_output(args.json), "w") as f:
            f.write(plan.to_json())
        print(f"plan saved to {args.json} (load with pippy_xla.Plan.from_json)")
    return 0


def _parser() -> argparse.ArgumentParser:
    from pippy_xla._native import _C
    from pippy_xla._version import __version__
    from pippy_xla.plan.cost_model import PLANNED_SCHEDULES

    parser = argparse.ArgumentParser(prog="pippy-xla", description=__doc__.splitlines()[0])
    parser.add_argument("--version", action="version", version=f"pippy_xla {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("plan", help="layers and checkpointed layers per stage under a memory limit")
    src = p.add_mutually_exclusive_group()
    src.add_argument("--model", choices=_FAMILIES, default="llama")
    src.add_argument("--config", help="an HF config.json (with model_type)")
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--intermediate", type=int, default=None, help="default: 2 x hidden")
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=None, help="default: heads")
    p.add_argument("--vocab", type=int, default=256)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--stages", type=int, required=True, help="pipeline stages: ranks x chunks")
    p.add_argument("--microbatches", type=int, required=True)
    p.add_argument("--batch-size", type=int, default=None, help="default: one row per microbatch")
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument(
        "--memory-limit",
        required=True,
        type=_memory_limits,
        help="memory per device with a unit, e.g. 20GiB or 512MiB; comma-separated for one per "
        "rank",
    )
    p.add_argument("--schedule", choices=PLANNED_SCHEDULES, default="1f1b")
    p.add_argument(
        "--chunks", type=int, default=None, help="stages per rank (default: the schedule's)"
    )
    p.add_argument("--no-checkpoint", action="store_true", help="plan layer ranges only")
    p.add_argument("--repeats", type=int, default=5, help="profiler timing runs")
    p.add_argument("--json", help="also save the plan as JSON to this path")
    p.set_defaults(func=_plan)

    p = sub.add_parser("simulate", help="predicted timeline of a schedule, without a model")
    p.add_argument("--schedule", choices=_C.schedule_names(), default="1f1b")
    p.add_argument("--ranks", type=int, default=4)
    p.add_argument("--microbatches", type=int, default=8)
    p.add_argument(
        "--chunks", type=int, default=None, help="stages per rank (default: the schedule's)"
    )
    p.add_argument("--forward", type=float, default=1.0, help="cost of F, per stage")
    p.add_argument("--backward", type=float, default=2.0, help="cost of a full backward")
    p.add_argument(
        "--weight", type=float, default=None, help="split backward: W cost (default: half of B)"
    )
    p.add_argument("--comm", type=float, default=0.0, help="transfer latency")
    p.add_argument("--send", type=float, default=0.0, help="a rank's time to post one send")
    p.add_argument("--recv", type=float, default=0.0, help="a rank's time to post one receive")
    p.add_argument(
        "--tune",
        action="store_true",
        help="list-scheduled schedules (zbh1, interleaved_zb, zbv): the order for these costs, "
        "as PipelineModel.tune_schedule runs it (default: the published order, unit costs)",
    )
    p.add_argument("--png", default=None, help="draw the Gantt chart to this PNG file")
    p.add_argument("--trace", default=None, help="also write a Chrome/Perfetto trace JSON")
    p.set_defaults(func=_simulate)
    return parser


def _simulate(args: argparse.Namespace) -> int:
    from pippy_xla._native import _C
    from pippy_xla.plan import viz

    chunks = args.chunks or _C.default_chunks(args.schedule)
    sched = _C.make_schedule(args.schedule, args.ranks, args.microbatches, chunks)
    n = sched.num_stages
    backward, weight = args.backward, []
    if sched.split_backward:
        # B is the input-gradient part: the full backward minus W.
        w = args.backward / 2 if args.weight is None else args.weight
        backward, weight = args.backward - w, [w] * n
    if args.tune:  # a fixed-order schedule refuses costs (one line, exit status 2)
        costs = {"forward": [args.forward] * n, "backward": [backward] * n, "weight": weight}
        sched = _C.make_schedule(args.schedule, args.ranks, args.microbatches, chunks, **costs)
    sim = sched.simulate(
        forward=[args.forward] * n,
        backward=[backward] * n,
        weight=weight,
        comm=args.comm,
        send=args.send,
        recv=args.recv,
    )
    print(
        f"{args.schedule}: {args.ranks} ranks x {chunks} chunks, {args.microbatches} "
        f"microbatches: step {sim.makespan:g}, bubble {sim.bubble:.1%}, "
        f"peak in-flight microbatches per stage {sim.peak_inflight}"
    )
    events = viz.simulated_events(sim)
    title = f"{args.schedule} (simulated), {args.ranks} ranks, {args.microbatches} microbatches"
    if args.png:
        drawn = viz.draw_timeline(events, _output(args.png), title=title, unit="units")
        print(f"timeline drawn to {drawn}")
    if args.trace:
        print(f"trace written to {viz.write_chrome_trace(events, _output(args.trace))}")
    return 0


def _memory_limits(text: str) -> list[int]:
    """``--memory-limit``: sizes with units, comma-separated; a bare number is bytes and must be
    at least 1 MiB (``20`` meaning 20 bytes is a mistake, not a limit)."""
    from pippy_xla.units import parse_bytes

    limits = []
    for part in text.split(","):
        try:
            n = parse_bytes(part)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None
        if part.strip().replace(".", "", 1).isdigit() and n < 2**20:
            raise argparse.ArgumentTypeError(
                f"{part.strip()!r} would be {n} bytes; give a unit, e.g. {part.strip()}GiB or "
                f"{part.strip()}MiB"
            )
        limits.append(n)
    return limits


def _output(path: str) -> str:
    """An output path whose folder exists (created if missing)."""
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    return path


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        return args.func(args)
    except (ValueError, TypeError, RuntimeError, OSError) as e:
        # A user's mistake: one line, no traceback (PIPPY_XLA_TRACEBACK=1 shows it).
        if os.environ.get("PIPPY_XLA_TRACEBACK") == "1":
            raise
        print(f"pippy-xla {args.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
