"""Generation: :class:`Generator` runs ``PipelineModel.generate`` on one rank.

[Note: generation data flow]

Every rank calls ``generate`` with the same prompts. After one handshake (the prompts, the mask
and the call's generation options, compared as a step's batch is), each step of the decoding loop
is one run of a forward-only engine over the generation graphs (see [Note: per-stage generation
graphs] in ``split/generation.py``): the prefill step with the whole prompt, then one step per
new token with the last token of each row. The batch is split into ``groups`` groups of rows
(``generate(..., groups=G)``, at most one per row), one per microbatch, each group with its own
cache on every stage: the engine runs them in a forward schedule, so the prefill is pipelined by
microbatches like a training forward, and within a token step the stages work on different
groups. Hidden states cross the stage boundaries on the same C++ engine and transports as in
training; each cache is updated in place by its stage's own layers. The last stage keeps the last
position's logits of each group, and HF's logits processors, sampling and stopping criteria
(:class:`_Sampler`) turn the whole batch's into one token per row and a stop flag, as HF does in
one process (so seeded sampling draws what HF draws); only those ``batch + 1`` integers travel,
broadcast from the last rank, so every rank extends its copy of the sequences and returns HF's
result. Logits never leave the last rank. One group is the default (the stages take turns on
the whole batch): while token steps end together, each more group adds a forward action per
stage and step, and on the shared 2-core VM two groups were not faster than one
(``benchmarks/generate.py``, docs/benchmarks.md).

Not yet: token steps still end together (group ``g``'s step ``t + 1`` waits for every group's
step ``t``), and finished rows are still computed. Decoding pipelined across steps (issue 50,
item 3) keeps these groups and caches and changes the schedule: group ``g``'s step ``t + 1``
starts on the first stage as soon as its own tokens of step ``t`` arrive (a per-group token send
from the last stage to the first instead of the broadcast, decode actions in the C++ schedule),
and a group whose rows have all finished leaves the schedule.
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
from pippy_xla.split.partition import LayerCls

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

    def __init__(self, model: nn.Module, layer_cls: LayerCls, runner: StepRunner) -> None:
        self.model = model
        self.layer_cls = layer_cls
        self.runner = runner
        self.place = runner.place
        self.failures: FailureState = runner.failures
        self.stages: list[StageGraph] | None = None
        self.engines: dict[int, _C.Engine] = {}
        """The forward-only engine of each group count."""
        self.caches: dict[int, list[Any]] = {}
        """The last generation's caches of each local stage, one per group (until the next
        call)."""

    def _setup(self) -> None:
        if self.stages is not None:
            return
        check_can_generate(self.model)
        layer_ranges = [(st.layers[0], st.layers[-1] + 1) for st in self.runner.stages]
        self.stages = generation_stages(
            self.model, self.layer_cls, layer_ranges, self.place.device.type
        )

    def generate(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None,
        generation_config: Any,
        kwargs: dict[str, Any],
        groups: int = 1,
    ) -> torch.Tensor:
        """HF's ``model.generate(input_ids, attention_mask=..., generation_config, **kwargs)``
        for the whole pipeline, on every rank, the batch in ``groups`` groups of rows (see
        [Note: generation data flow])."""
        if not isinstance(groups, int) or isinstance(groups, bool) or groups < 1:
            raise ValueError(f"groups must be a positive int, got {groups!r}")
        self.failures.check_usable()
        check_can_generate(self.model)
        if self.place.mesh is not None:
            raise NotImplementedError(
                "generate on a data-parallel mesh is not supported yet (issue 50); generate with "
                "a pipeline built without mesh=..."
            )
        self.caches = {}
        ids, mask = _check_prompts(input_ids, attention_mask)
        self._agree(ids, mask, generation_config, {**kwargs, "groups": groups})  # on the CPU
        ids, mask = ids.to(self.place.device), mask.to(self.place.device)
        settings = prepare_generation(self.model, ids, generation_config, kwargs)
        self._setup()
        positions = self.model._prepare_position_ids_for_generation(ids, {"attention_mask": mask})
        rows = self._groups(ids.shape[0], groups)
        caches = self.caches = self._caches(settings, len(rows))
        sampler = None
        if self.place.rank == self.runner.last_rank:
            sampler = _Sampler(settings, ids.shape[0], self.place.device)
        inputs = {"input_ids": ids, "attention_mask": mask, "position_ids": positions}
        while True:
            out = self._step(inputs, rows, caches, ids, sampler)
            tokens, stop = out[:-1], bool(out[-1])
            ids = torch.cat([ids, tokens[:, None]], dim=-1)
            mask = torch.cat([mask, mask.new_ones(mask.shape[0], 1)], dim=-1)
            positions = positions[:, -1:] + 1
            inputs = {"input_ids": tokens[:, None], "attention_mask": mask}
            inputs["position_ids"] = positions
            if stop:
                return ids

    def _groups(self, batch: int, groups: int) -> list[int]:
        """The rows of each of ``groups`` groups (at most one per row), and the engine of that
        many groups, made once."""
        rows = [len(r) for r in torch.arange(batch).tensor_split(min(groups, batch))]
        if len(rows) not in self.engines:
            stage_rank = self.runner.train_engine.schedule.stage_rank
            schedule = _C.forward_schedule(stage_rank, self.place.num_ranks, len(rows))
            self.engines[len(rows)] = self.place.engine(schedule)
        return rows

    def _caches(self, settings: GenerationSettings, groups: int) -> dict[int, list[Any]]:
        """Every local stage's cache of each group."""
        kind = settings.config.cache_implementation
        if kind is None and torch.is_autocast_enabled(self.place.device.type):
            kind = "dynamic"  # HF's static cache refuses autocast's mixed key dtypes
        length = settings.max_length - 1
        return {
            s: [
                stage_cache(self.model.config, self.stages[s].layers, length, kind)
                for _ in range(groups)
            ]
            for s in self.runner.runners
        }

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
        agree_on_step(key, contents, batch, self.place.rank, self.runner.gather_ints)

    def _step(
        self,
        inputs: dict[str, torch.Tensor],
        rows: list[int],
        caches: dict[int, list[Any]],
        ids: torch.Tensor,
        sampler: _Sampler | None,
    ) -> torch.Tensor:
        """One engine run over ``inputs``, a microbatch per group of ``rows``; the broadcast
        ``[tokens..., stop]``."""
        logits: dict[int, torch.Tensor] = {}
        forward = self._forward({k: v.split(rows) for k, v in inputs.items()}, caches, logits)
        batch, length = inputs["input_ids"].shape
        device = self.place.device.type  # autocast changes the boundary dtype: another key
        cast = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else None
        signature = digest64(repr(("generate", rows, length, cast)).encode())
        self.failures.run_step(self.engines[len(rows)], signature, forward, None)
        if sampler is not None:
            out = sampler.next(ids, torch.cat([logits[g] for g in range(len(rows))]))
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
        self, groups: dict[str, tuple[torch.Tensor, ...]], caches: dict[int, list], logits: dict
    ) -> Callable:
        """The engine's forward: microbatch ``mb`` is group ``mb``'s rows, with its cache."""
        stages = self.stages
        last = len(stages) - 1

        def forward(stage: int, mb: int, received: list[torch.Tensor]):
            st = stages[stage]
            own = (groups[n][mb] for n in st.batch_inputs)
            out = st.module(*own, *received, caches[stage][mb])
            if stage != last:
                return out
            logits[mb] = out[0][:, -1]
            return []

        return forward


def cache_bytes(caches: dict[int, list[Any]]) -> int:
    """Bytes of key and value tensors that ``caches`` (each stage's, one per group) allocated,
    each layer object once."""
    seen: dict[int, Any] = {}
    for group_caches in caches.values():
        for layer in (la for cache in group_caches for la in cache.layers):
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
