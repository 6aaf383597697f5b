"""Every training schedule of pippy_xla side by side: activation memory per rank and step time.

    python benchmarks/schedules.py [--memory-ranks 4 --memory-mbs 8] [--speed-ranks 2
        --speed-mbs 4 --steps 8 --warmup 2] [--schedules 1f1b,zbv,...]

- ``memory``: on ``--memory-ranks`` CPU ranks with ``--memory-mbs`` microbatches, one untimed
  training step per schedule of an 8-layer Llama (``compare.py``'s compute-regime model and
  batch); per rank, the peak of the bytes autograd keeps for backward (``compare._SavedBytes``:
  unique storages, parameters excluded, released when autograd frees them) and the peak of the
  engine's stash. The zero-bubble papers' claim checked here: ZB-V's and DualPipeV's peak per rank
  at or below 1F1B's first rank's (the largest of 1F1B's ranks).
- ``speed``: on ``--speed-ranks`` ranks (one core each) with ``--speed-mbs`` microbatches, the same
  model and batch; every schedule's pipeline is built in the same processes and their timed steps
  interleave (step k of every schedule, then step k+1), so that the slow and fast spells of a shared
  machine fall on all of them alike. A step is ``run_train`` + AdamW ``step`` + ``zero_grad``; the
  slower rank's time counts; ranks start each step from ``_common.SpinBarrier`` (not gloo's
  barrier, which released ranks up to 2.5 ms apart and let them sleep). Reported: the median
  step, its ratio to 1F1B's (> 1 is faster), the schedule's simulated makespan from the run's own
  F / B / W durations (engine timings) and the efficiency (that makespan over the measured step).
- ``--compile``: the speed part with ``compile=True`` stages (results under ``speed_compiled``).
  Under a split-backward schedule each compiled stage has an input-gradient and a weight-gradient
  graph ([Note: compiled W]), so W is real work there too; the claim checked: compiled ``zbh1`` and
  ``zbv`` faster than compiled ``1f1b``. The first steps compile: use ``--warmup 3`` or more.
- ``<name>:tuned`` speed rows (unless ``--no-tuned``): each list-scheduled schedule once more,
  reordered after the last warm-up step for the costs measured in it
  (``PipelineModel.tune_schedule``, [Note: list scheduling at costs]); the ideal and efficiency
  are those of the order that ran.

Results: ``benchmarks/results/schedules.json`` (``--skip`` keeps the skipped part's last results).
"""

from __future__ import annotations

import argparse
import copy
import json
import time

from _common import RESULTS, SpinBarrier, run_ranks, save, summarize
from compare import REGIMES, _build, _SavedBytes

TUNED = ":tuned"
"""A schedule name with this suffix: the schedule reordered for the costs measured in the last
warm-up step (``PipelineModel.tune_schedule``, [Note: list scheduling at costs])."""


def _pipes(regime: dict, schedules: list[str], m: int, compile: bool = False) -> dict:
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    import pippy_xla as px

    base, batch = _build(regime)
    pipes = {
        name: px.PipelineModel(
            copy.deepcopy(base),
            layer_cls=LlamaDecoderLayer,
            num_microbatches=m,
            schedule=name.removesuffix(TUNED),
            compile=compile,
        )
        for name in schedules
    }
    return {"pipes": pipes, "batch": batch}


def _memory(rank, world, regime, schedules, m) -> dict:
    import torch.distributed as dist

    made = _pipes(regime, schedules, m)
    out = {}
    for name, pipe in made["pipes"].items():
        modules = [st.module for st in pipe.local_stages]
        saved = _SavedBytes(modules)
        handles = [h for mod in modules for h in saved.attach(mod)]
        pipe.reset_stash_peak()
        dist.barrier()
        pipe.run_train(**made["batch"])
        for h in handles:
            h.remove()
        out[name] = {"saved_peak_bytes": int(saved.peak), "stash_peak_bytes": pipe.stash_peak_bytes}
    return out


def _speed(rank, world, regime, schedules, m, steps, warmup, compile) -> dict:
    import torch

    made = _pipes(regime, schedules, m, compile)
    opts = {n: torch.optim.AdamW(p.parameters(), lr=1e-3) for n, p in made["pipes"].items()}
    times: dict[str, list[float]] = {n: [] for n in schedules}
    losses: dict[str, list[float]] = {n: [] for n in schedules}
    barrier = SpinBarrier(rank, world)
    for k in range(warmup + steps):
        for name, pipe in made["pipes"].items():
            barrier.wait()
            t0 = time.perf_counter()
            loss = pipe.run_train(**made["batch"])
            opts[name].step()
            opts[name].zero_grad(set_to_none=True)
            if k >= warmup:
                times[name].append(time.perf_counter() - t0)
            losses[name].append(float(loss))
            if k == warmup - 1 and name.endswith(TUNED):
                pipe.tune_schedule()
    # Every stage's mean F / B / W of the last step (a collective), as tune_schedule reads them.
    costs = {}
    for n, p in made["pipes"].items():
        c = p.stage_costs()
        costs[n] = {"F": c["forward"], "B": c["backward"], "W": c["weight"]}
    orders = {n: p.engine.schedule.to_csv() for n, p in made["pipes"].items()}
    return {"times": times, "losses": losses, "costs": costs, "orders": orders}


def main() -> None:
    from pippy_xla import _C

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--schedules", default=",".join(_C.train_schedule_names()))
    p.add_argument("--memory-ranks", type=int, default=4)
    p.add_argument("--memory-mbs", type=int, default=8)
    p.add_argument("--speed-ranks", type=int, default=2)
    p.add_argument("--speed-mbs", type=int, default=4)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--skip", default="", help="memory or speed")
    p.add_argument(
        "--compile",
        action="store_true",
        help="speed of compiled stages only (results under speed_compiled; implies --skip memory)",
    )
    p.add_argument(
        "--no-tuned",
        action="store_true",
        help=f"speed: no '<name>{TUNED}' rows (list-scheduled ones reordered for measured costs)",
    )
    args = p.parse_args()
    names = args.schedules.split(",")
    speed_names = names + [
        n + TUNED for n in ([] if args.no_tuned else names) if _C.schedule_info(n).list_scheduled
    ]
    regime = REGIMES["compute"]
    # A part skipped keeps its results from the last run.
    previous = RESULTS / "schedules.json"
    result: dict = json.loads(previous.read_text()) if previous.exists() else {}
    result.pop("machine", None)
    config = {**vars(args), "model": regime["model"], "batch": regime["batch"]}
    result["config_compiled" if args.compile else "config"] = config

    if args.compile:
        args.skip = "memory"
    if args.skip != "memory":
        world, m = args.memory_ranks, args.memory_mbs
        per_rank = run_ranks(world, _memory, regime, names, m, timeout=1800)
        memory = {n: [r[n] for r in per_rank] for n in names}
        result["memory"] = memory
        onef = max(r["saved_peak_bytes"] for r in memory.get("1f1b", [{"saved_peak_bytes": 0}]))
        print(f"\nactivation peak per rank (MiB), {world} ranks, {m} microbatches")
        print(f"{'schedule':16s} " + " ".join(f"rank {r:<6d}" for r in range(world)) + " max/1f1b")
        for n in names:
            peaks = [r["saved_peak_bytes"] for r in memory[n]]
            ratio = f"{max(peaks) / onef:.2f}" if onef else "-"
            print(f"{n:16s} " + " ".join(f"{b / 2**20:<11.2f}" for b in peaks) + f" {ratio}")

    if args.skip != "speed":
        world, m = args.speed_ranks, args.speed_mbs
        per_rank = run_ranks(
            world, _speed, regime, speed_names, m, args.steps, args.warmup, args.compile,
            timeout=3600,
        )  # fmt: skip
        speed = {}
        for n in speed_names:
            steps = [max(ts) for ts in zip(*(r["times"][n] for r in per_rank), strict=True)]
            costs = per_rank[0]["costs"][n]
            # The order that ran, simulated at the last step's own costs.
            order = _C.Schedule.from_csv(per_rank[0]["orders"][n], n)
            w = costs["W"] if order.split_backward else []
            ideal = order.simulate(forward=costs["F"], backward=costs["B"], weight=w).makespan
            speed[n] = {
                "step_s": summarize(steps),
                "losses": per_rank[0]["losses"][n],
                "stage_costs_s": costs,
                "ideal_s": ideal,
                "efficiency": ideal / steps[-1] if ideal else None,
                "order": per_rank[0]["orders"][n],
            }
        base = speed.get("1f1b", {}).get("step_s", {}).get("median")
        kind = "compiled stages" if args.compile else "eager stages"
        print(f"\nstep time, {kind}, {world} ranks, {m} microbatches, {args.steps} steps")
        for n in speed_names:
            med = speed[n]["step_s"]["median"]
            speed[n]["vs_1f1b"] = base / med if base else None
            eff = speed[n]["efficiency"]
            print(
                f"{n:16s} median {med:.4f} s  vs 1f1b {base / med if base else float('nan'):.3f}x"
                f"  efficiency {eff:.1%}"
                if eff
                else f"{n:16s} median {med:.4f} s"
            )
        result["speed_compiled" if args.compile else "speed"] = speed
    print(f"wrote {save('schedules', result)}")


if __name__ == "__main__":
    main()
