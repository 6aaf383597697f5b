"""What hiding expert parallelism's all-to-all under another microbatch's compute would buy
(issue 71, item 4), predicted with pippy_xla's own schedule simulator (``_C.make_schedule(...)
.simulate``) before anything is built.

The model: a MoE decoder layer's forward computes for ``c_F`` and exchanges its routed tokens
(dispatch and combine) for ``a_F``; its backward computes for ``c_B = 2 c_F`` and exchanges for
``a_B = a_F`` (the gradients of the same tokens); with a split backward (ZB-H1, DualPipeV) the
all-to-all's backward runs in B (input gradients, ``c_B / 2``) and W (weight gradients,
``c_B / 2``) communicates nothing. Without overlap every exchange is on the rank's critical path:
F = ``c_F + a_F``, B = ``c_B + a_B`` per layer. With overlap as DualPipeV's and Megatron's
combined 1F1B do it (one microbatch's forward beside another's backward on the same rank, each
one's exchange under the other's compute), an action exposes only what the partner's compute
cannot hide: F = ``c_F + max(0, a_F - c_B)``, B = ``c_B + max(0, a_B - c_F)``. That is the best
case: the warm-up's and cool-down's lone forwards and backwards have no partner, so the gain a
real overlap reaches lies between 0 and the predicted one.

The ratio ``r = a_F / c_F`` decides it. For Qwen3-30B-A3B (hidden 2048, 48 layers, 128 experts of
768, 8 per token, 32 query and 4 key/value heads of 128) on 8 GPUs as pp=2 x ep=4, one microbatch
of 4096 tokens in bf16: a layer's forward is about 147 MFLOP per token (attention projections 38,
causal attention at 4096 tokens 34, experts 75), 0.60 TFLOP per microbatch; its exchange sends
each token to its 8 experts and back, 2 x 8 x 2048 x 2 bytes, 3/4 of it to other ranks: 201 MB
per microbatch and direction. At 400 TFLOP/s and the all-to-all bandwidth ``bw`` per GPU,
``r = 201 MB / bw / 1.5 ms``: about 0.45 at 300 GB/s (NVLink inside a node), 2.7 at 50 GB/s (one
400 Gb/s NIC per GPU between nodes). Those are the hardware's published rates, not measured
here: a GPU run must replace them with the all-to-all time it measures. The script prints the
predicted step time with and without overlap for ``r`` in :data:`RATIOS`, per schedule.

Run: ``python benchmarks/ep_overlap_model.py``; results in
``benchmarks/results/ep_overlap_model.json``.
"""

from __future__ import annotations

from _common import save

from pippy_xla import _C

LAYERS = 48
RANKS = 2
MICROBATCHES = 8
RATIOS = (0.0, 0.25, 0.45, 1.0, 2.0, 2.7)
SCHEDULES = {"1f1b": 1, "interleaved": 2, "zbh1": 1, "dualpipev": 2}
"""The schedules compared, with their stages per rank."""


def _costs(schedule: str, r: float, overlap: bool) -> dict[str, list[float]]:
    """Per-stage forward, backward (and weight) times, in units of one layer's forward compute."""
    sched = _C.make_schedule(schedule, RANKS, MICROBATCHES, SCHEDULES[schedule])
    per_stage = LAYERS / sched.num_stages
    c_f, c_b, a = 1.0, 2.0, r
    f = c_f + (max(0.0, a - c_b) if overlap else a)
    b_comm = max(0.0, a - c_f) if overlap else a
    if sched.split_backward:
        costs = {"forward": f, "backward": c_b / 2 + b_comm, "weight": c_b / 2}
    else:
        costs = {"forward": f, "backward": c_b + b_comm}
    return {k: [v * per_stage] * sched.num_stages for k, v in costs.items()}


def _step(schedule: str, r: float, overlap: bool) -> float:
    sched = _C.make_schedule(schedule, RANKS, MICROBATCHES, SCHEDULES[schedule])
    return sched.simulate(**_costs(schedule, r, overlap)).makespan


def main() -> None:
    rows = {}
    print(f"{'schedule':12s} " + " ".join(f"r={r:<5}" for r in RATIOS) + "  (overlap's gain)")
    for schedule in SCHEDULES:
        row = {}
        for r in RATIOS:
            plain, hidden = _step(schedule, r, False), _step(schedule, r, True)
            row[str(r)] = {"step": plain, "step_overlapped": hidden, "gain": 1 - hidden / plain}
        rows[schedule] = row
        print(f"{schedule:12s} " + " ".join(f"{row[str(r)]['gain']:7.1%}" for r in RATIOS))
    payload = {
        "model": {"layers": LAYERS, "ranks": RANKS, "microbatches": MICROBATCHES},
        "ratios": list(RATIOS),
        "schedules": rows,
    }
    print(f"saved {save('ep_overlap_model', payload)}")


if __name__ == "__main__":
    main()
