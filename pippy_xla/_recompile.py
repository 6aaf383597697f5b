"""The recompile watch of compiled stages (``PipelineModel(compile=True)``)."""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["RecompileWatch"]


class RecompileWatch:
    """Notices recompilations of a compiled stage after the first step of each mode and says
    why: dynamo's guard failures plus which stage input changed shape, dtype or grad mode.

    It counts dynamo's cache entries of the stage graphs' own ``forward`` code (each fx
    GraphModule has its own), so other compiled code in the process does not count. It reads
    two private dynamo helpers (``_debug_get_cache_entry_list`` and ``guard_failures``); this
    class is the only place that does."""

    def __init__(self, modules: list[nn.Module]) -> None:
        self._codes = [m.forward.__code__ for m in modules]
        self._graphs: dict[str, int] = {}
        self._first_args: dict[str, dict[int, list[str]]] = {}
        self._step_args: dict[int, list[str]] = {}

    def _graph_count(self) -> int:
        from torch._dynamo.eval_frame import _debug_get_cache_entry_list

        return sum(len(_debug_get_cache_entry_list(code)) for code in self._codes)

    def see(self, stage: int, args: list) -> None:
        """Records a stage's inputs, once per stage and step."""
        if stage in self._step_args:
            return
        self._step_args[stage] = [
            f"{str(a.dtype).removeprefix('torch.')}{list(a.shape)}"
            + (" requires_grad" if a.requires_grad else "")
            if isinstance(a, torch.Tensor)
            else repr(a)
            for a in args
        ]

    def step_done(self, mode: str) -> str | None:
        """After a step of ``mode`` (``"train"`` or ``"eval"``): why dynamo compiled a new graph
        since that mode's first step, or ``None`` if it did not."""
        args, self._step_args = self._step_args, {}
        count = self._graph_count()
        if mode not in self._graphs:
            self._graphs[mode] = count
            self._first_args[mode] = args
            return None
        if count == self._graphs[mode]:
            return None
        self._graphs[mode] = count
        first = self._first_args[mode]
        changed = [
            f"stage {s} input {i}: {a} -> {b}"
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
