"""The stage forward the engine calls for every forward action of a step."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from pippy_xla._recompile import RecompileWatch
from pippy_xla.partition import StageGraph

__all__ = ["StageForward", "stage_forward"]

StageForward = Callable[[int, int, list[torch.Tensor]], list[torch.Tensor]]
"""``forward(stage, microbatch, boundary_inputs) -> outputs``, as ``_C.Engine.run`` calls it."""


def stage_forward(
    stages: Sequence[StageGraph],
    modules: dict[int, Callable],
    *,
    microbatches: dict[str, tuple[torch.Tensor, ...]],
    labels: tuple[torch.Tensor, ...] | None,
    num_items: torch.Tensor | None,
    loss_fn: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor],
    losses: dict[int, torch.Tensor],
    logits: dict[int, torch.Tensor] | None,
    watch: RecompileWatch | None = None,
) -> StageForward:
    """The callable the engine runs for each forward action of one step.

    Args:
        stages: every stage of the pipeline (for their batch inputs).
        modules: what runs each local stage (its graph module, or the compiled one).
        microbatches: the step's batch inputs, split into microbatches.
        labels: the labels' microbatches, if the step has labels.
        num_items: the batch's count of valid tokens (``loss_fn``'s divisor).
        loss_fn: the loss of one microbatch.
        losses: filled on the last stage with the detached microbatch losses.
        logits: filled on the last stage with each microbatch's logits, when not ``None``.
        watch: told every stage's inputs (compiled stages).
    """
    last = len(stages) - 1

    def forward(stage: int, mb: int, inputs: list[torch.Tensor]) -> list[torch.Tensor]:
        args = [*[microbatches[n][mb] for n in stages[stage].batch_inputs], *inputs]
        if watch is not None:
            watch.see(stage, args)
        out = modules[stage](*args)
        if stage != last:
            return list(out)
        if logits is not None:
            logits[mb] = out[0]
        if labels is None:
            return []
        loss = loss_fn(out[0], labels[mb], num_items)
        losses[mb] = loss.detach()
        return [loss]

    return forward
