"""Timelines of pipeline steps: Chrome/Perfetto trace JSON and PNG Gantt charts.

One event format serves measured and simulated steps: ``(rank, op, stage, microbatch, start,
end)`` with times in seconds. :meth:`pippy_xla.PipelineModel.timeline` gathers the engine's
measured actions from every rank; ``pippy-xla simulate`` draws a schedule's predicted timeline.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pippy_xla._native import _C

__all__ = ["Event", "write_chrome_trace", "draw_timeline", "simulated_events"]

Event = tuple[int, str, int, int, float, float]
"""``(rank, op, stage, microbatch, start_s, end_s)``."""

# Compute in saturated colours, communication posts in light grey, data-parallel gradient
# reductions (DP) in purple, the step's own work before and after the engine (PRE, POST) in dark
# grey.
_COLORS = {
    "F": "#3b78c4",
    "B": "#e0843a",
    "W": "#4f9d4f",
    "SF": "#c8c8c8",
    "RF": "#dedede",
    "SB": "#b8b8b8",
    "RB": "#d0d0d0",
    "DP": "#8e5bb5",
    "PRE": "#6e6e6e",
    "POST": "#5a5a5a",
}


def write_chrome_trace(events: Sequence[Event], path: str | Path) -> Path:
    """Writes ``events`` as a Chrome trace (open in Perfetto or chrome://tracing): one process
    row per rank, complete events ("X") in microseconds from the earliest start, named
    ``F3.0`` (op, stage, microbatch) or, for a step's own spans, ``PRE`` / ``POST``."""
    t0 = min((e[4] for e in events), default=0.0)
    trace = [
        {
            "name": f"{op}{stage}.{mb}" if stage >= 0 else op,
            "cat": op,
            "ph": "X",
            "pid": rank,
            "tid": 0,
            "ts": (start - t0) * 1e6,
            "dur": max(end - start, 0.0) * 1e6,
            "args": {"stage": stage, "microbatch": mb},
        }
        for rank, op, stage, mb, start, end in events
    ]
    ranks = sorted({e[0] for e in events})
    trace += [
        {"name": "process_name", "ph": "M", "pid": r, "args": {"name": f"rank {r}"}} for r in ranks
    ]
    path = Path(path)
    path.write_text(json.dumps({"traceEvents": trace, "displayTimeUnit": "ms"}))
    return path


def draw_timeline(
    events: Sequence[Event], path: str | Path, title: str = "", unit: str = "ms"
) -> Path:
    """Draws a Gantt chart: ranks as rows, F/B/W coloured, communication posts grey, each
    compute box labelled with its microbatch."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    scale = {"s": 1.0, "ms": 1e3, "us": 1e6, "units": 1.0}[unit]
    t0 = min((e[4] for e in events), default=0.0)
    ranks = sorted({e[0] for e in events})
    fig, ax = plt.subplots(figsize=(12, 0.6 + 0.6 * len(ranks)))
    for rank, op, _stage, mb, start, end in events:
        x, w = (start - t0) * scale, max(end - start, 0.0) * scale
        compute = op in ("F", "B", "W")
        height = 0.8 if compute else 0.3
        ax.broken_barh([(x, w)], (rank - height / 2, height), color=_COLORS.get(op, "#888"))
        if compute:
            ax.text(x + w / 2, rank, f"{mb}", ha="center", va="center", fontsize=7, color="white")
    ax.set_yticks(ranks, [f"rank {r}" for r in ranks])
    ax.invert_yaxis()
    ax.set_xlabel(f"time ({unit})")
    ax.set_title(title)
    ops_seen = sorted({e[1] for e in events}, key=list(_COLORS).index)
    ax.legend(
        handles=[Patch(color=_COLORS[o], label=o) for o in ops_seen],
        loc="center left",
        bbox_to_anchor=(1.0, 0.5),
        fontsize=8,
    )
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def simulated_events(sim: _C.SimResult) -> list[Event]:
    """The events of a ``Schedule.simulate(...)`` result."""
    return [(t.rank, t.op, t.stage, t.mb, t.start, t.end) for t in sim.timeline]
