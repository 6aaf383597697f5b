"""The recompile watch of compiled stages (``PipelineModel(compile=True)``)."""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["RecompileWatch"]


class RecompileWatch:
    """Notices recompilations of a compiled stage after the first step of each mode and says
    why: dynamo's guard failures plus which stage input changed shape, dtype or grad mode.

    It counts dynamo's cache entries of the stage graphs' own ``forward`` code (each fx
    GraphModule has its own), so other compiled code in the process does not count, after every
    step during which dynamo started a compilation anywhere in the process (its compile-start
    callbacks; counting every step cost about 30 us, on the step's critical path). Entries that
    appear during a mode's first step are that mode's graphs (evaluation compiles its own, grad
    mode off); entries that appear during a later step are its recompilations. It reads private
    dynamo helpers (``_debug_get_cache_entry_list``, ``guard_failures``, ``callback_handler``);
    this class is the only place that does."""

    def __init__(self, modules: list[nn.Module]) -> None:
        self._codes = [m.forward.__code__ for m in modules]
        self._count = 0
        """The stage graphs' cache entries when last counted."""
        self._compiles_seen = -1
        """:func:`_compiles` when they were last counted (-1: never)."""
        self._first_args: dict[str, dict[int, list]] = {}
        self._step_args: dict[int, list] = {}

    def graphs(self) -> int:
        """How many graphs dynamo holds for the watched modules' code (their cache entries)."""
        return self._graph_count()

    def _graph_count(self) -> int:
        from torch._dynamo.eval_frame import _debug_get_cache_entry_list

        return sum(len(_debug_get_cache_entry_list(code)) for code in self._codes)

    def see(self, stage: int, args: list) -> None:
        """Records what dynamo guards on of a stage's inputs, once per stage and step (on a
        step's first forward: described in words only for a report)."""
        if stage in self._step_args:
            return
        self._step_args[stage] = [
            (a.dtype, a.shape, a.requires_grad) if isinstance(a, torch.Tensor) else repr(a)
            for a in args
        ]

    def step_done(self, mode: str) -> str | None:
        """After a step of ``mode`` (``"train"`` or ``"eval"``): why dynamo compiled a new graph
        since that mode's first step, or ``None`` if it did not."""
        args, self._step_args = self._step_args, {}
        first_step = mode not in self._first_args
        if first_step:
            self._first_args[mode] = args
        compiles = _compiles()
        if compiles == self._compiles_seen:
            return None  # dynamo compiled nothing since the last count
        self._compiles_seen = compiles
        count = self._graph_count()
        grew, self._count = count != self._count, count
        if first_step or not grew:
            return None
        first = self._first_args[mode]
        changed = [
            f"stage {s} input {i}: {_describe(a)} -> {_describe(b)}"
            for s in sorted(args)
            for i, (a, b) in enumerate(zip(first.get(s, []), args[s], strict=False))
            if a != b
        ]
        from torch._dynamo.utils import guard_failures

        reasons = [r for rs in guard_failures.values() for r in rs][-3:]
        parts = []
        if changed:
            parts.append("stage inputs changed since the first step (" + "; ".join(changed) + ")")
        if reasons:
            parts.append("guard failures: " + " | ".join(str(r) for r in reasons))
        return "; ".join(parts) or "dynamo compiled a new graph (no guard failure recorded)"


def _describe(seen: tuple | str) -> str:
    """An input as :meth:`RecompileWatch.see` recorded it, in words: ``int64[2, 16]``."""
    if isinstance(seen, str):
        return seen
    dtype, shape, requires_grad = seen
    words = f"{str(dtype).removeprefix('torch.')}{list(shape)}"
    return words + (" requires_grad" if requires_grad else "")


_COMPILES = 0
"""How many compilations dynamo started in this process since :func:`_compiles` registered its
callback."""


def _count_compile(_args: object) -> None:
    global _COMPILES
    _COMPILES += 1


def _compiles() -> int:
    """:data:`_COMPILES`, with the counting callback registered: again after a
    ``torch._dynamo.reset()``, which drops callbacks (the number then moves, so the graphs are
    counted once more). Without dynamo's callbacks (another torch), a number that always moves."""
    global _COMPILES
    try:
        from torch._dynamo.callback import callback_handler
    except ImportError:
        _COMPILES += 1
        return _COMPILES
    if _count_compile not in callback_handler.start_callbacks:
        callback_handler.register_start_callback(_count_compile)
        _COMPILES += 1
    return _COMPILES
