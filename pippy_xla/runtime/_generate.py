"""Generation: :class:`Generator` runs ``PipelineModel.generate`` on one rank.

[Note: generation data flow]

Every rank calls ``generate`` with the same prompts. After one handshake (the prompts, the mask
and the call's generation options, compared as a step's batch is), each step of the decoding loop
is one run of a forward-only engine over the generation graphs (see [Note: per-stage generation
graphs] in ``split/generation.py``): the prefill step with the whole prompt, then one step per
new token with the last token of each row. Hidden states cross the stage boundaries as in a
training forward, on the same C++ engine and transports; each stage's cache is updated in place
by its own layers. The last stage keeps the last position's logits, and HF's logits processors,
sampling and stopping criteria (:class:`_Sampler`) turn them into one token per row and a stop
flag; only those ``batch + 1`` integers travel, broadcast from the last rank, so every rank
extends its copy of the sequences and returns HF's result. Logits never leave the last rank.

Stages take turns on the whole batch: the engine runs a one-microbatch forward schedule. Decoding
pipelined across groups is the same engine with ``G`` microbatches (groups of rows), one cache per
group on each stage (the forward indexes ``caches[stage][mb]``), and the token broadcast per group:
group ``g``'s token step ``t + 1`` may start on the first stage as soon as its tokens of step
``t`` arrive, which a schedule with decode steps expresses (issue 50, item 3).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from pippy_xla._native import _C
from pippy_xla.runtime._batch import agree_on_step, digest64, step_key
from pippy_xla.runtime.failures import FailureState
from pippy_xla.split.emit import StageGraph
from pippy_xla.split.generation import (
    GenerationSettings,
    check_can_generate,
    generation_stages,
    prepare_generation,
    stage_cache,
)

if TYPE_CHECKING:
    from pippy_xla.runtime._step import StepRunner

__all__ = ["Generator", "cache_bytes"]

logger = logging.getLogger(__name__)


class _Sampler:
    """The last rank's part of HF's ``_sample`` loop: logits -> tokens and whether to stop."""

    def __init__(self, settings: GenerationSettings, batch: int, device: torch.device) -> None:
        self.settings = settings
        self.unfinished = torch.ones(batch, dtype=torch.long, device=device)
        self.pad = settings.pad.to(device) if settings.pad is not None else None

    def next(self, ids: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
        """``[tokens..., stop]`` for the sequences ``ids`` and their last position's logits."""
        s = self.settings
        scores = s.processors(ids, logits.to(copy=True, dtype=torch.float32))
        if s.config.do_sample:
            probs = nn.functional.softmax(scores, dim=-1)
            tokens = torch.multinomial(probs, num_samples=1).squeeze(1)
        else:
            tokens = torch.argmax(scores, dim=-1)
        if s.has_eos:
            tokens = tokens * self.unfinished + self.pad * (1 - self.unfinished)
        extended = torch.cat([ids, tokens[:, None]], dim=-1)
        self.unfinished = self.unfinished & ~s.stopping(extended, None)
        stop = (self.unfinished.max() == 0).to(torch.long)
        return torch.cat([tokens.to(torch.long), stop[None]])


class Generator:
    """Generation on one rank of a built pipeline; its graphs and engine are made at the first
    call and kept (see [Note: per-stage generation graphs])."""

    def __init__(self, model: nn.Module, layer_cls: type[nn.Module], runner: StepRunner) -> None:
        self.model = model
        self.layer_cls = layer_cls
        self.runner = runner
        self.place = runner.place
        self.failures: FailureState = runner.failures
        self.stages: list[StageGraph] | None = None
        self.engine: _C.Engine | None = None
        self.caches: dict[int, Any] = {}
        """The last generation's cache of each local stage (until the next call)."""

    def _setup(self) -> None:
        if self.stages is not None:
            return
        check_can_generate(self.model)
        layer_ranges = [(st.layers[0], st.layers[-1] + 1) for st in self.runner.stages]
        self.stages = generation_stages(
            self.model, self.layer_cls, layer_ranges, self.place.device.type
        )
        stage_rank = self.runner.train_engine.schedule.stage_rank
        schedule = _C.forward_schedule(stage_rank, self.place.num_ranks, 1)
        self.engine = self.place.engine(schedule)

    def generate(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None,
        generation_config: Any,
        kwargs: dict[str, Any],
    ) -> torch.Tensor:
        """HF's ``model.generate(input_ids, attention_mask=..., generation_config, **kwargs)``
        for the whole pipeline, on every rank (see [Note: generation data flow])."""
        self.failures.check_usable()
        check_can_generate(self.model)
        if self.place.mesh is not None:
            raise NotImplementedError(
                "generate on a data-parallel mesh is not supported yet (issue 50); generate with "
                "a pipeline built without mesh=..."
            )
        self.caches = {}
        ids, mask = _check_prompts(input_ids, attention_mask)
        self._agree(ids, mask, generation_config, kwargs)  # on the CPU, as a step's batch
        ids, mask = ids.to(self.place.device), mask.to(self.place.device)
        settings = prepare_generation(self.model, ids, generation_config, kwargs)
        self._setup()
        positions = self.model._prepare_position_ids_for_generation(ids, {"attention_mask": mask})
        kind = settings.config.cache_implementation
        if kind is None and torch.is_autocast_enabled(self.place.device.type):
            kind = "dynamic"  # HF's static cache refuses autocast's mixed key dtypes
        caches = {
            s: stage_cache(self.model.config, self.stages[s].layers, settings.max_length - 1, kind)
            for s in self.runner.runners
        }
        self.caches = caches
        sampler = None
        if self.place.rank == self.runner.last_rank:
            sampler = _Sampler(settings, ids.shape[0], self.place.device)
        inputs = {"input_ids": ids, "attention_mask": mask, "position_ids": positions}
        while True:
            out = self._step(inputs, caches, ids, sampler)
            tokens, stop = out[:-1], bool(out[-1])
            ids = torch.cat([ids, tokens[:, None]], dim=-1)
            mask = torch.cat([mask, mask.new_ones(mask.shape[0], 1)], dim=-1)
            positions = positions[:, -1:] + 1
            inputs = {"input_ids": tokens[:, None], "attention_mask": mask}
            inputs["position_ids"] = positions
            if stop:
                return ids

    def _agree(self, ids, mask, generation_config, kwargs) -> None:
        """The step handshake for a ``generate`` call: prompts, mask and options."""
        options = repr(generation_config.to_dict() if generation_config is not None else None)
        options += repr(sorted(kwargs.items()))
        batch = {
            "input_ids": ids,
            "attention_mask": mask,
            "generation_options": torch.tensor([digest64(options.encode())]),
        }
        key, contents = step_key("generate", batch, True)
        place = self.place
        handshake = place.handshake

        def gather(values, what: str) -> list[list[int]]:
            return self.failures.watched(
                what,
                _C.all_gather_int64,
                values,
                handshake.group_name,
                handshake.device,
                place.timeout_ms,
                f"[rank {place.rank}] {what}",
                abortable=self.runner._abortable,
            )

        agree_on_step(key, contents, batch, place.rank, gather)

    def _step(
        self,
        inputs: dict[str, torch.Tensor],
        caches: dict[int, Any],
        ids: torch.Tensor,
        sampler: _Sampler | None,
    ) -> torch.Tensor:
        """One engine run over ``inputs``; the broadcast ``[tokens..., stop]``."""
        logits: dict[int, torch.Tensor] = {}
        forward = self._forward(inputs, caches, logits)
        batch, length = inputs["input_ids"].shape
        device = self.place.device.type  # autocast changes the boundary dtype: another key
        cast = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else None
        signature = digest64(repr(("generate", batch, length, cast)).encode())
        self.failures.run_step(self.engine, signature, forward, None)
        if sampler is not None:
            out = sampler.next(ids, logits[0])
        else:
            out = torch.zeros(batch + 1, dtype=torch.long, device=self.place.device)
        place = self.place
        what = f"[rank {place.rank}] generated tokens broadcast"
        return self.failures.watched(
            "generated tokens broadcast",
            _C.broadcast_copy,
            out,
            self.runner.last_rank,
            place.group_name,
            place.timeout_ms,
            what,
            abortable=self.runner._abortable,
        )

    def _forward(
        self, inputs: dict[str, torch.Tensor], caches: dict[int, Any], logits: dict
    ) -> Callable:
        stages = self.stages
        last = len(stages) - 1

        def forward(stage: int, mb: int, received: list[torch.Tensor]):
            st = stages[stage]
            out = st.module(*(inputs[n] for n in st.batch_inputs), *received, caches[stage])
            if stage != last:
                return out
            logits[mb] = out[0][:, -1]
            return []

        return forward


def cache_bytes(caches: dict[int, Any]) -> int:
    """Bytes of key and value tensors that ``caches`` allocated (each layer object once)."""
    seen: dict[int, Any] = {}
    for cache in caches.values():
        for layer in cache.layers:
            if getattr(layer, "is_initialized", False):
                seen[id(layer)] = layer
    return sum(t.numel() * t.element_size() for la in seen.values() for t in (la.keys, la.values))


def _check_prompts(
    input_ids: torch.Tensor, attention_mask: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """The prompts and their mask (int64, on the CPU); ``TypeError`` / ``ValueError`` naming what
    is wrong."""
    if not isinstance(input_ids, torch.Tensor) or input_ids.ndim != 2:
        raise ValueError("generate needs input_ids as a 2-D [batch, length] tensor of token ids")
    if input_ids.dtype != torch.long:
        raise TypeError(f"input_ids must be int64 token ids, got {input_ids.dtype}")
    if attention_mask is None:
        attention_mask = torch.ones_like(input_ids)
    if attention_mask.shape != input_ids.shape:
        raise ValueError(
            f"attention_mask has shape {tuple(attention_mask.shape)} but input_ids "
            f"{tuple(input_ids.shape)}; pass the prompts' 2-D mask (left padding 0)"
        )
    return input_ids.cpu(), attention_mask.to(device="cpu", dtype=torch.long)
