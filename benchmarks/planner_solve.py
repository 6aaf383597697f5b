"""Planner solve time: 128 identical layers on 16 stages (and a heterogeneous 64 x 8 case).

Prints the times and saves them to ``benchmarks/results/planner_solve.json``.
"""

from __future__ import annotations

import json
import pathlib
import random
import time

from pippy_xla.planner import LayerCost, PlanProblem, StageExtra, inflight_counts, solve


def _problem(layers: list[LayerCost], stages: int, microbatches: int, limit: int) -> PlanProblem:
    extras = [StageExtra() for _ in range(stages)]
    extras[0] = StageExtra(fwd=0.5, bwd=0.5, saved_bytes=1000, static_bytes=50_000)
    extras[-1] = StageExtra(fwd=2.0, bwd=3.0, saved_bytes=20_000, static_bytes=50_000)
    return PlanProblem(
        layers=layers,
        extras=extras,
        inflight=inflight_counts("1f1b", stages, microbatches),
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
        fwd=1.0, bwd=2.0, saved_bytes=10_000, saved_bytes_ckpt=1_000, static_bytes=40_000
    )
    p = _problem([layer] * 128, 16, 32, 1_000_000)
    t, out = _time(p)
    results["identical_128x16"] = dict(
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
    path = pathlib.Path(__file__).parent / "results" / "planner_solve.json"
    path.parent.mkdir(exist_ok=True)
    path.write_text(json.dumps(results, indent=1))
    print(f"saved {path}")


if __name__ == "__main__":
    main()
