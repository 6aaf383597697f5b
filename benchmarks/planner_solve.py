"""Planner solve time: 128 identical layers on 16 stages under 1F1B and ZB-H1 (whose frontier has
a third dimension, the bytes kept from B to W), and a heterogeneous 32 x 8 case.

Prints the times and saves them to ``benchmarks/results/planner_solve.json``.
"""

from __future__ import annotations

import random
import time

from _common import save

from pippy_xla import _C
from pippy_xla.plan.planner import LayerCost, PlanProblem, StageExtra, solve


def _problem(
    layers: list[LayerCost], stages: int, microbatches: int, limit: int, schedule: str = "1f1b"
) -> PlanProblem:
    sched = _C.make_schedule(schedule, stages, microbatches)
    extras = [StageExtra(split_backward=sched.split_backward and s > 0) for s in range(stages)]
    extras[0].fwd, extras[0].bwd, extras[0].saved_bytes = 0.5, 0.5, 1000
    extras[0].static_bytes = 50_000
    extras[-1].fwd, extras[-1].bwd, extras[-1].saved_bytes = 2.0, 3.0, 20_000
    extras[-1].static_bytes, extras[-1].weight, extras[-1].weight_bytes = 50_000, 1.0, 5_000
    return PlanProblem(
        layers=layers,
        extras=extras,
        live_states=sched.simulate().live_states,
        memory_limit=[limit] * stages,
    )


def _time(problem: PlanProblem, repeats: int = 5) -> tuple[float, dict]:
    times, out = [], None
    for _ in range(repeats):
        t = time.perf_counter()
        out = solve(problem)
        times.append(time.perf_counter() - t)
    return min(times), out


def main() -> None:
    results = {}
    layer = LayerCost(
        fwd=1.0,
        bwd=2.0,
        saved_bytes=10_000,
        saved_bytes_ckpt=1_000,
        static_bytes=40_000,
        weight=0.8,
        weight_ckpt=1.8,
        weight_bytes=12_000,
        weight_bytes_ckpt=5_000,
        recorded_bytes=4_000,
    )
    for schedule in ("1f1b", "zbh1"):
        p = _problem([layer] * 128, 16, 32, 1_000_000, schedule)
        t, out = _time(p)
        results[f"identical_128x16_{schedule}"] = dict(
            seconds=t,
            bottleneck=out.bottleneck,
            layers=[st.range[1] - st.range[0] for st in out.stages],
            checkpointed=[len(st.checkpoint) for st in out.stages],
        )
    rng = random.Random(0)
    hetero = [
        LayerCost(
            fwd=rng.uniform(0.5, 1.5),
            bwd=rng.uniform(1, 3),
            saved_bytes=rng.randint(5_000, 15_000),
            saved_bytes_ckpt=rng.randint(500, 1500),
            static_bytes=40_000,
        )
        for _ in range(32)
    ]
    p = _problem(hetero, 8, 16, 1_000_000)
    t, out = _time(p, repeats=1)
    results["heterogeneous_32x8"] = dict(seconds=t, bottleneck=out.bottleneck)
    for name, r in results.items():
        print(f"{name}: {r['seconds'] * 1e3:.1f} ms, bottleneck {r['bottleneck']:.3f}")
    print(f"saved {save('planner_solve', results)}")


if __name__ == "__main__":
    main()
