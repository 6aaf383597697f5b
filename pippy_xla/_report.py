"""Reporting on a pipeline's last step: measured action timings, the merged timeline of every
rank (Chrome trace, Gantt chart), and the activation stash's byte counts."""

from __future__ import annotations

import torch.distributed as dist

from pippy_xla.runtime._step import StepRunner

__all__ = ["Report"]

Timing = tuple[str, int, int, int, int]
"""``(op, stage, microbatch, start_ns, end_ns)``."""


class Report:
    """What one rank's last step did, read from its engines and the step runner."""

    def __init__(self, runner: StepRunner) -> None:
        self._runner = runner

    def timings(self) -> list[Timing]:
        """The last step's actions on this rank: ``(op, stage, microbatch, start_ns, end_ns)``,
        in system-clock nanoseconds. With a mesh, each stage's data-parallel gradient reduction
        is there too, as op ``"DP"`` with microbatch -1; and the step's own work before and after
        the engine, as ops ``"PRE"`` and ``"POST"`` with stage and microbatch -1 (see [Note: step
        spans] in ``_step.py``)."""
        runner = self._runner
        engine = runner.last_engine
        measured = [(t.op, t.stage, t.mb, t.start_ns, t.end_ns) for t in engine.timings()]
        return measured + runner.reduce_spans + runner.step_spans

    def timeline(self, json_path: str | None = None, png_path: str | None = None) -> list:
        """Gathers the last step's measured actions of every rank (a collective over the
        pipeline's group) and, on its first rank, writes a Chrome/Perfetto trace (``json_path``)
        and a Gantt chart (``png_path``). Returns the merged events ``(rank, op, stage,
        microbatch, start_s, end_s)`` on every rank."""
        from pippy_xla.plan import viz

        place, config = self._runner.place, self._runner.config
        mine = [(place.rank, op, s, mb, t0 / 1e9, t1 / 1e9) for op, s, mb, t0, t1 in self.timings()]
        everyone: list = [None] * place.num_ranks
        dist.all_gather_object(everyone, mine, group=place.group)
        events = sorted((e for rank_events in everyone for e in rank_events), key=lambda e: e[4])
        if place.rank == 0:
            title = (
                f"{config.schedule_name}: {place.num_ranks} ranks, {config.num_microbatches} "
                "microbatches"
            )
            if json_path:
                viz.write_chrome_trace(events, json_path)
            if png_path:
                viz.draw_timeline(events, png_path, title=title)
        return events

    def stage_costs(self) -> dict[str, list[float]]:
        """Every stage's mean F, B and W duration in seconds in the last training step, each
        measured on its stage's rank; a collective over the pipeline's group (it gathers the
        :meth:`timeline`). ``{"forward": [...], "backward": [...], "weight": [...]}`` with one
        entry per stage (``weight`` zeros without a split backward), as
        :func:`pippy_xla.make_schedule` and ``Schedule.simulate`` take them. Raises
        ``RuntimeError`` unless the last step trained with the current schedule."""
        runner = self._runner
        engine = runner.train_engine
        if runner.last_engine is not engine or not engine.timings():
            raise RuntimeError(
                f"[rank {runner.place.rank}] stage costs are measured in a training step: run "
                "run_train with the current schedule first"
            )
        n = engine.schedule.num_stages
        sums = {op: [0.0] * n for op in "FBW"}
        counts = {op: [0] * n for op in "FBW"}
        for _, op, stage, _, start, end in self.timeline():
            if op in sums:
                sums[op][stage] += end - start
                counts[op][stage] += 1
        mean = {
            op: [t / max(c, 1) for t, c in zip(sums[op], counts[op], strict=True)] for op in sums
        }
        return {"forward": mean["F"], "backward": mean["B"], "weight": mean["W"]}

    @property
    def stash_peak_bytes(self) -> int:
        """Most bytes the activation stash held at once since the last :meth:`reset_stash_peak`."""
        return self._runner.train_engine.stash_peak_bytes

    @property
    def stash_live_bytes(self) -> int:
        """Bytes the activation stash holds now (0 between steps)."""
        return self._runner.train_engine.stash_live_bytes

    def reset_stash_peak(self) -> None:
        """Sets :attr:`stash_peak_bytes` to the bytes held now."""
        self._runner.train_engine.reset_stash_peak()
