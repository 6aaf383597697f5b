"""Generation: :class:`Generator` runs ``PipelineModel.generate`` on one rank.

[Note: generation data flow]

Every rank calls ``generate`` with the same prompts. After one handshake (the prompts, the mask
and the call's generation options, compared as a step's batch is), the batch is split into
``groups`` groups of rows (``generate(..., groups=G)``, by default one per rank of the pipeline,
at most one per row), each with its own
cache on every stage (see [Note: per-stage generation graphs] in ``split/generation.py``), and
the C++ engine runs two kinds of forward-only schedules over them, a group per microbatch; hidden
states cross the stage boundaries on the same engine and transports as in training, and each
cache is updated in place by its stage's own layers.

- The prefill: one run of a forward schedule with the whole prompts, pipelined by groups like a
  training forward; with HF's ``prefill_chunk_size`` each group's prompt goes in chunks as HF's
  chunked prefill sends them (the mask up to the chunk's end, the chunk's positions), each chunk
  a microbatch, chunk-major so that each group's chunks reach a stage in order: ``groups x
  chunks`` microbatches fill the pipeline where ``groups`` alone leave ``stages - 1`` of
  ``groups + stages - 1`` slots idle. The last stage keeps the last position's logits of each
  group (of its last chunk) and samples each group's first token; the first tokens and a stop
  flag per group are broadcast from the last rank.
- Decoding, in windows of up to ``DECODE_WINDOW`` tokens: one run of a decode schedule per
  window ([Note: decode schedules] in ``csrc/schedule/schedule.h``), a ring of the stages in
  which the last stage's forward of group ``g``'s token ``t`` samples the group's next token ids
  and sends them, point to point, to the first stage, whose forward of the group's token
  ``t + 1`` starts as soon as they arrive. Each rank runs its forwards in wavefront order, so
  group ``g``'s token ``t`` runs on stage ``s`` while group ``g + 1``'s runs on stage ``s - 1``:
  with ``groups >= stages`` every stage has a group to work on at every step, while one group
  leaves the stages taking turns. At the end of a window the last rank broadcasts the window's
  tokens and, per group, the step at which all its rows had finished, so that every rank extends
  its copy of the sequences and returns HF's result.

Sampling is HF's (:class:`_Sampler`: its logits processors, sampling and stopping criteria), one
sampler per group on the last rank, called in the order ``(token, group)``: greedy decoding is
HF's token for token, and so is seeded sampling while every group is in the schedule, since
``torch.multinomial`` draws a batch's rows in row order from the generator (one group: always
HF's; several: reproducible). Only token ids and the per-group stop steps travel; logits never
leave the last stage, so the stages after the first get zeros of the input ids' shape: their
graphs recompute masks, positions and rotary tables from the batch inputs (some embed the ids for
a dtype), which need the shape, not the tokens; a model whose later stage reads the tokens'
values is refused by ``generation_stages`` (``split/generation.py``) with an error naming the
node. A group whose rows have all finished (with an end-of-sequence token, after which HF pads
them with ``pad_token_id``) leaves the schedule at the next window and costs no
more work; the sequences end where HF's do (the step at which the last row finished), even
inside a window. Finished rows of a group that still has unfinished rows are still computed, as
in HF's one-process loop.

[Note: generation on a mesh]

On a ``(dp, pp)`` or ``(dp, pp, tp)`` mesh every rank passes the whole batch of prompts, as to
``run_train``. The handshake compares them within each pipeline, across the replicas (a replica
given other prompts would return another batch's rows) and across the tp ranks of each stage: every
rank raises or none does. Replica ``i`` then generates, as above and over its own pipeline group,
for the ``i``-th of ``dp`` equal contiguous shares of the rows (``replica_rows``, the rule that
splits a training batch). Its stage modules are wrapped by FSDP2, whose forward hooks the
generation graphs do not run: the parameters are gathered once before the generation (``unshard``,
a collective over the replicas under ``"shard"``; a swap of ``replicate``'s replicated DTensors for
their local tensors) and resharded after it, so replicas whose rows finish earlier need not keep
stepping. Each replica's sequences end where its own rows' do; the replicas' lengths are gathered,
each pads its rows with ``pad_token_id`` to the longest (HF pads a finished row so while others go
on) and one sum over the replicas gives every rank the whole batch: greedy decoding equals HF's on
the whole batch. Sampling is reproducible, but each replica draws its rows from its own generator,
so its tokens are not HF's. With tensor parallelism each tp rank of a stage is in its own pipeline
group (``(pp=i, tp=j)`` to ``(pp=i+1, tp=j)``), and the tp ranks of a stage run the same forwards
in the same order, as their layers' collectives need: the same rows (a replica's share), the same
schedules, and the same tokens, which each tp rank of the last stage samples from the same
(replicated) logits: before a sampling generation every tp rank takes its tp rank 0's random state
(the CPU generator's: tensor parallelism runs on the CPU), so that they draw alike whatever seeds
they were given. Each tp rank's cache holds its key/value heads only (HF's caches take their
shape from the first keys).

[Note: compiled generation]

With ``PipelineModel(..., compile=True)`` each local stage's generation graph is compiled with
``torch.compile`` and the pipeline's ``compile_options`` (at the first ``generate``, beside the
training graphs, which stay as they are: a ``generate`` neither recompiles nor re-traces them),
twice: a prefill graph and a decode graph, two copies of the stage's graph sharing its modules,
each with code of its own, so that dynamo keeps their graphs apart (and
:meth:`Generator.compiled_graphs` counts them). The decode graph follows what HF does to compile
its decode step over a ``StaticCache`` (``generation/utils.py``: a compilable cache, a mask of
the cache's length, inputs cloned to contiguous strides):

- Every input has one shape and stride at every token. The cache is HF's ``StaticCache``,
  allocated before the prefill (HF's early initialization of a cache, this stage's layers only)
  with ``mark_static_address`` on its tensors; the position it writes next is its
  ``cumulative_length``, a tensor updated in place, and the positions are tensors too, so no
  Python number changes from token to token. The 2-D mask, which grows by a column per token in
  the eager decode, is padded with zeros to the cache's length, as HF's mask code pads it anyway
  (same masks, same results); the token ids are cloned to contiguous strides (the window's first
  token is a column slice of the last window's). So the decode graph of a full-attention model
  is one static graph (per group size) for every token.
- Sliding-window layers are HF's ``StaticSlidingWindowLayer``, which counts the tokens seen in
  a Python int as well (``cumulative_length_int``) and branches on it (window full or not): a
  number that changes at every token. The decode graph is therefore compiled with dynamo's
  default ``dynamic=None``, whose automatic dynamic shapes make that int symbolic when it first
  changes: a static graph for the first token, a symbolic one for the others, and one more once
  the window is full; a bounded number of graphs (Mistral: 3 per group size) however many
  tokens follow. With
  ``dynamic=False`` dynamo compiled a graph per token until its recompile limit (8) and then ran
  the stage eagerly.
- Generations of different lengths share graphs: the cache's length is ``COMPILED_CACHE_MIN``
  or the power of two at or above the generation's, so generations up to 64 tokens share one
  static graph; the first generation of another cache length compiles once more, with the
  length symbolic, and that graph serves every length after it (4, 70, 140 and then 300 new
  tokens: 2 decode graphs). A longer cache attends over more (masked) positions.
- The prefill graph takes the prompts' length, so a second length recompiles it once with that
  length dynamic, and one more graph for a group of one row, which dynamo specializes (a size of
  1); so does the decode graph for a second group size. The chunks of HF's
  ``prefill_chunk_size`` compile it at most twice more: the first chunk's ids and mask, of one
  length, make both lengths dynamic and equal; a later chunk's, of two, sets them apart. HF
  leaves its prefill eager; compiling it here costs a compile per stage at the first call.
- A graph compiled again for a run of the same group sizes and lengths as an earlier one (a
  recompile that these rules should have prevented) is logged and recorded in
  ``pipe.recompiles`` with dynamo's guard failures, as a training step's.
- Without an early-initializable static cache (``cache_implementation="dynamic"``, the default
  under autocast, or a model HF cannot early-initialize), the graphs run eagerly: a dynamic
  cache grows by a token per step, which would recompile at every token.
- On a mesh (data or tensor parallel, where ``compile=True`` compiles the training stages too)
  the generation graphs run eagerly for now: compiled generation around FSDP2's gathered
  parameters and DTensor layers is not tested yet.

Greedy tokens stay HF's, up to inductor's reordered sums, which could flip an argmax only on a
near-tie of the top logits (see ``tests/test_generate.py``).
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from torch import fx, nn

from pippy_xla._native import _C
from pippy_xla.runtime._batch import (
    agree_on_step,
    cut_ragged,
    digest64,
    replica_rows,
    step_key,
)
from pippy_xla.runtime._recompile import RecompileWatch
from pippy_xla.runtime.failures import FailureState
from pippy_xla.runtime.tensor_parallel import whole_tensor
from pippy_xla.split import hf
from pippy_xla.split.emit import StageGraph
from pippy_xla.split.generation import (
    POSITION_INPUTS,
    PROMPT_INPUTS,
    GenerationSettings,
    check_can_generate,
    early_init,
    generation_stages,
    prepare_generation,
    stage_cache,
)
from pippy_xla.split.partition import LayerCls

if TYPE_CHECKING:
    from pippy_xla.runtime._step import StepRunner

__all__ = ["COMPILED_CACHE_MIN", "DECODE_WINDOW", "Generator", "cache_bytes"]

logger = logging.getLogger(__name__)

DECODE_WINDOW = 16
"""Tokens per decode-schedule run (see [Note: generation data flow]): the stages drain once per
window (``stages - 1`` forwards of each rank's time, and a broadcast of the window's tokens), and
a group whose rows have all finished leaves at the end of a window."""

COMPILED_CACHE_MIN = 64
"""The shortest cache of a generation with compiled graphs: its length is this or the power of
two at or above the generation's length (see [Note: compiled generation])."""


class _Sampler:
    """The last rank's part of HF's ``_sample`` loop for one group of rows: logits -> tokens, and
    whether all its rows have finished."""

    def __init__(self, settings: GenerationSettings, ids: torch.Tensor) -> None:
        self.settings = settings
        self.ids = ids
        """The group's sequences so far (its prompts and the tokens sampled)."""
        self.unfinished = torch.ones(ids.shape[0], dtype=torch.long, device=ids.device)
        self.pad = settings.pad.to(ids.device) if settings.pad is not None else None

    def next(self, logits: torch.Tensor) -> tuple[torch.Tensor, bool]:
        """The group's next tokens from its last position's ``logits``, and whether every row of
        the group has finished."""
        s = self.settings
        scores = s.processors(self.ids, logits.to(copy=True, dtype=torch.float32))
        if s.config.do_sample:
            probs = nn.functional.softmax(scores, dim=-1)
            tokens = torch.multinomial(probs, num_samples=1).squeeze(1)
        else:
            tokens = torch.argmax(scores, dim=-1)
        if s.has_eos:
            tokens = tokens * self.unfinished + self.pad * (1 - self.unfinished)
        tokens = tokens.to(torch.long)
        self.ids = torch.cat([self.ids, tokens[:, None]], dim=-1)
        self.unfinished = self.unfinished & ~s.stopping(self.ids, None)
        return tokens, bool(self.unfinished.max() == 0)


class _Groups:
    """One generation's groups of rows, as every rank knows them."""

    def __init__(self, rows: list[int], mask: torch.Tensor, positions: torch.Tensor) -> None:
        self.rows = rows
        self.mask = list(mask.split(rows))
        """Each group's attention mask, up to its last sampled token."""
        self.next_position = list(positions[..., -1:].split(rows, dim=-2))
        """Each group's position of its last token (the next forward's input ids)."""
        self.tokens: list[torch.Tensor] = []
        """Each group's last sampled tokens, ``[rows, 1]``: the next forward's input ids."""
        self.stopped = [False] * len(rows)
        """Whether all of a group's rows have finished."""

    def live(self, has_eos: bool) -> list[int]:
        """The groups the next window runs: those with unfinished rows; all groups while
        finished rows are not padded (without end-of-sequence tokens HF computes them on)."""
        if all(self.stopped):
            return []
        return [g for g in range(len(self.rows)) if not (has_eos and self.stopped[g])]


class Generator:
    """Generation on one rank of a built pipeline; its graphs and engines are made at the first
    call and kept (see [Note: per-stage generation graphs])."""

    def __init__(self, model: nn.Module, layer_cls: LayerCls, runner: StepRunner) -> None:
        self.model = model
        self.layer_cls = layer_cls
        self.runner = runner
        self.place = runner.place
        self.failures: FailureState = runner.failures
        self.stages: list[StageGraph] | None = None
        self.image_stages: dict[tuple[str, ...], list[StageGraph]] = {}
        """The prefill's generation graphs for each set of image inputs (see [Note: images in
        the prefill])."""
        self.engines: dict[tuple, _C.Engine] = {}
        """The prefill engine of each group count and the decode engine of each (group sizes,
        window); see [Note: generation data flow]."""
        self.caches: dict[int, list[Any]] = {}
        """The last generation's caches of each local stage, one per group (until the next
        call)."""
        self.window = DECODE_WINDOW
        """Tokens per decode-schedule run (tests set fewer)."""
        self.decode_runs: list[tuple[int, ...]] = []
        """The last generation's decode-schedule runs: each one's live groups."""
        self.compiled: dict[str, dict[int, Callable]] = {}
        """With ``compile=True``: each local stage's compiled ``"prefill"`` and ``"decode"``
        graph (see [Note: compiled generation])."""
        self.graph_watch: dict[str, RecompileWatch] = {}
        """Counts dynamo's graphs of the compiled ``"prefill"`` and ``"decode"`` graphs."""
        self.mask_length: int | None = None
        """The cache's length, to which decode pads the mask, while the compiled graphs
        generate; ``None`` while the eager ones do."""

    def _setup(self) -> None:
        if self.stages is not None:
            return
        check_can_generate(self.model)
        self.stages = self._generation_stages(())
        if self.runner.config.compile and self.runner.dp is None and self.runner.tp is None:
            self._compile()  # on a mesh: eager, see [Note: compiled generation]

    def _compile(self) -> None:
        """Each local stage's prefill and decode graphs, compiled (see [Note: compiled
        generation]): two copies of its generation graph that share its modules, each with code
        of its own, whose graphs dynamo keeps (and :attr:`graph_watch` counts) apart."""
        options = dict(self.runner.config.compile_options or {})
        for kind in ("prefill", "decode"):
            copies = {
                s: fx.GraphModule(self.stages[s].module, copy.deepcopy(self.stages[s].module.graph))
                for s in self.runner.runners
            }
            self.compiled[kind] = {s: torch.compile(m, **options) for s, m in copies.items()}
            self.graph_watch[kind] = RecompileWatch(list(copies.values()))

    def _module(self, kind: str, stage: int) -> Callable:
        """What runs local ``stage``'s ``kind`` (``"prefill"`` or ``"decode"``) forwards."""
        if self.mask_length is None:
            return self.stages[stage].module
        return self.compiled[kind][stage]

    def _recompiled(self, kind: str, shapes: tuple) -> None:
        """After a run of the compiled ``kind`` graphs: a graph that dynamo compiled although a
        run of the same ``shapes`` (group sizes and lengths) came before is logged and recorded
        in ``pipe.recompiles``, as a training step's (see [Note: compiled generation])."""
        watch = self.graph_watch.get(kind)
        if watch is None or self.mask_length is None:
            return
        why = watch.step_done(f"{kind} {shapes}")
        if why:
            msg = f"[rank {self.place.rank}] {kind} graph recompiled: {why}"
            logger.warning("%s", msg)
            self.runner.recompiles.append(msg)

    def compiled_graphs(self) -> dict[str, int]:
        """How many graphs dynamo compiled of this rank's ``"prefill"`` and ``"decode"`` graphs
        (none without ``compile=True``)."""
        return {kind: watch.graphs() for kind, watch in self.graph_watch.items()}

    def generate(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None,
        generation_config: Any,
        kwargs: dict[str, Any],
        groups: int | None = None,
    ) -> torch.Tensor:
        """HF's ``model.generate(input_ids, attention_mask=..., generation_config, **kwargs)``
        for the whole pipeline, on every rank, the batch in ``groups`` groups of rows (``None``:
        one per rank of the pipeline; see [Note: generation data flow])."""
        if groups is None:
            groups = self.place.num_ranks
        if not isinstance(groups, int) or isinstance(groups, bool) or groups < 1:
            raise ValueError(f"groups must be a positive int, got {groups!r}")
        self.failures.check_usable()
        check_can_generate(self.model)
        if self.runner.ep is not None:
            raise NotImplementedError(
                f"generate with expert_parallel={self.runner.ep.size} is not supported yet "
                "(issue 71): each replica's decode steps end with its own rows, and the experts' "
                "all-to-alls need every replica of a stage at each step; generate with a "
                "pipeline built without expert_parallel"
            )
        place = self.place
        self.caches = {}
        self.decode_runs = []
        ids, mask = _check_prompts(input_ids, attention_mask)
        kwargs, images, shares = _prompt_images(self.model, kwargs, ids)
        if ids.shape[0] % place.dp_size:
            raise ValueError(
                f"generate got {ids.shape[0]} prompts, not a multiple of the data-parallel size "
                f"{place.dp_size}: each replica generates for an equal share of the rows; pass "
                f"a multiple of {place.dp_size} prompts"
            )
        options = {**kwargs, "groups": groups}
        self._agree(ids, mask, generation_config, options, images)  # on the CPU
        rows = replica_rows(ids.shape[0], place.dp_rank, place.dp_size)
        ids, mask = ids[rows].to(place.device), mask[rows].to(place.device)
        images = {k: v.to(place.device) for k, v in _take_rows(images, shares, rows).items()}
        settings = prepare_generation(self.model, ids, generation_config, kwargs)
        if images and settings.config.prefill_chunk_size is not None:
            raise ValueError(
                "generate with images takes no prefill_chunk_size: the images cannot be cut into "
                "the prompt's chunks (HF's generate refuses it alike)"
            )
        if self.runner.tp is not None and settings.config.do_sample:
            self._same_random_state()
        self._setup()
        dp = self.runner.dp
        if dp is None:
            return self._generate(ids, mask, settings, groups, images)
        # See [Note: generation on a mesh].
        self.failures.watched("data-parallel all-gather", dp.unshard)
        try:
            out = self._generate(ids, mask, settings, groups, images)
        finally:
            dp.after_eval()
        return self._gather(out, rows, input_ids.shape[0], settings)

    def _prefill_stages(self, names: tuple[str, ...]) -> list[StageGraph]:
        """The generation graphs whose prefill takes the prompts' images ``names`` too (see
        [Note: images in the prefill]), made at the first ``generate`` with them."""
        if not names:
            return self.stages
        if names not in self.image_stages:
            self.image_stages[names] = self._generation_stages(names)
        return self.image_stages[names]

    def _generation_stages(self, inputs: tuple[str, ...]) -> list[StageGraph]:
        """Generation graphs of the training layout's stages, with ``inputs`` besides the
        token ids."""
        layer_ranges = [(st.layers[0], st.layers[-1] + 1) for st in self.runner.stages]
        device = self.place.device.type
        return generation_stages(self.model, self.layer_cls, layer_ranges, device, inputs)

    def _generate(
        self,
        ids: torch.Tensor,
        mask: torch.Tensor,
        settings: GenerationSettings,
        groups: int,
        images: dict[str, torch.Tensor],
    ) -> torch.Tensor:
        """The sequences of prompts ``ids`` (this replica's, with their ``images``), on every
        rank of the pipeline."""
        # HF's positions: M-RoPE's [kinds, rows, length] from the images' grids (see [Note:
        # images in the prefill]); [rows, length] for other models.
        extra = {k: v for k, v in images.items() if k in POSITION_INPUTS}
        prepare = self.model._prepare_position_ids_for_generation
        positions = prepare(ids, {"attention_mask": mask, **extra})
        rows = [len(r) for r in torch.arange(ids.shape[0]).tensor_split(min(groups, ids.shape[0]))]
        caches = self.caches = self._caches(settings, rows)
        samplers = None
        if self.place.rank == self.runner.last_rank:
            samplers = [_Sampler(settings, part) for part in ids.split(rows)]
        state = _Groups(rows, mask, positions)
        inputs = {"input_ids": ids, "attention_mask": mask, "position_ids": positions, **images}
        chunk = settings.config.prefill_chunk_size
        ids = self._prefill(inputs, state, caches, samplers, chunk, tuple(images))
        while ids.shape[1] < settings.max_length:
            live = state.live(settings.has_eos)
            if not live:
                break
            window = min(self.window, settings.max_length - ids.shape[1])
            ids, end = self._decode(ids, live, window, state, caches, samplers, settings)
            if end is not None:
                return ids[:, :end]
        return ids

    def _gather(
        self, out: torch.Tensor, rows: slice, batch: int, settings: GenerationSettings
    ) -> torch.Tensor:
        """The whole batch's sequences on every rank from each replica's ``out`` (its ``rows``),
        the shorter ones padded as HF pads rows that finished early (see [Note: generation on a
        mesh])."""
        dp, failures = self.runner.dp, self.failures
        what = f"[rank {self.place.rank}] generated lengths all_gather over replicas"
        lengths = failures.watched(what, dp.all_gather_ints, [out.shape[1]], what)
        whole = out.new_zeros(batch, max(n for (n,) in lengths))
        whole[rows] = _pad_id(settings)
        whole[rows, : out.shape[1]] = out
        what = f"[rank {self.place.rank}] generated sequences all_reduce over replicas"
        return failures.watched(what, dp.all_reduce_sum, whole, what)

    def _same_random_state(self) -> None:
        """Tp rank 0's random state on every tp rank: the tp ranks of the last stage draw the
        same tokens (see [Note: generation on a mesh])."""
        what = f"[rank {self.place.rank}] tensor-parallel random state broadcast"
        state = self.failures.watched(what, self.runner.tp.from_first, torch.get_rng_state(), what)
        torch.set_rng_state(state)

    def _engine(self, key: tuple, make: Callable[[], _C.Schedule]) -> _C.Engine:
        """The engine of ``key``, of the schedule ``make()`` at its first use."""
        if key not in self.engines:
            self.engines[key] = self.place.engine(make())
        return self.engines[key]

    def _caches(self, settings: GenerationSettings, rows: list[int]) -> dict[int, list[Any]]:
        """Every local stage's cache of each group (of ``rows`` rows each); with compiled graphs,
        allocated here (see [Note: compiled generation])."""
        kind = settings.config.cache_implementation
        if kind is None and torch.is_autocast_enabled(self.place.device.type):
            kind = "dynamic"  # HF's static cache refuses autocast's mixed key dtypes
        length = settings.max_length - 1
        shape = self.model._get_static_cache_init_shape() if self.compiled else None
        self.mask_length = None
        if shape is not None and kind in (None, "static"):
            length = self.mask_length = max(COMPILED_CACHE_MIN, 1 << (length - 1).bit_length())
        caches = {
            s: [stage_cache(self.model.config, self.stages[s].layers, length, kind) for _ in rows]
            for s in self.runner.runners
        }
        if self.mask_length is not None:
            for s, group_caches in caches.items():
                for cache, n in zip(group_caches, rows, strict=True):
                    layers = self.stages[s].layers
                    early_init(cache, layers, n, shape, self.model.dtype, self.place.device)
        return caches

    def _fixed(self, batch: dict[str, torch.Tensor]) -> None:
        """A decode forward's ``batch`` of the same shapes and strides at every token, while the
        compiled graphs generate: the mask padded with zeros to the cache's length (as HF pads
        it) and the token ids in contiguous strides (see [Note: compiled generation])."""
        if self.mask_length is None:
            return
        mask = batch["attention_mask"]
        batch["attention_mask"] = nn.functional.pad(mask, (0, self.mask_length - mask.shape[1]))
        batch["input_ids"] = batch["input_ids"].clone(memory_format=torch.contiguous_format)

    def _agree(self, ids, mask, generation_config, kwargs, images) -> None:
        """The step handshake for a ``generate`` call: prompts, mask, images and options."""
        options = repr(generation_config.to_dict() if generation_config is not None else None)
        options += repr(sorted(kwargs.items()))
        batch = {
            "input_ids": ids,
            "attention_mask": mask,
            **images,
            "generation_options": torch.tensor([digest64(options.encode())]),
        }
        key, contents = step_key("generate", batch, True)
        runner, checks = self.runner, []
        if runner.dp is not None:  # the replicas too: each generates a share of the rows
            checks.append((runner.dp, "data-parallel", _DP_CAUSE))
        if runner.tp is not None:  # and the tp ranks, whose layers run the same rows together
            checks.append(runner.tp_check)
        gather = runner.checked_gather(key, checks) if checks else runner.gather_ints
        agree_on_step(key, contents, batch, self.place.rank, gather)

    def _signature(self, *what: Any) -> int:
        """The engine signature of a run described by ``what``."""
        device = self.place.device.type  # autocast changes the boundary dtype: another key
        cast = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else None
        return digest64(repr((*what, cast)).encode())

    def _broadcast(self, out: torch.Tensor, what: str) -> torch.Tensor:
        """``out`` of the last rank on every rank (a watched collective)."""
        place = self.place
        return self.failures.watched(
            what,
            _C.broadcast_copy,
            out,
            self.runner.last_rank,
            place.group_name,
            place.timeout_ms,
            f"[rank {place.rank}] {what}",
            abortable=self.runner._abortable,
        )

    def _prefill(
        self,
        inputs: dict[str, torch.Tensor],
        state: _Groups,
        caches: dict[int, list[Any]],
        samplers: list[_Sampler] | None,
        chunk: int | None,
        images: tuple[str, ...] = (),
    ) -> torch.Tensor:
        """The prompts through a forward schedule, a microbatch per group and prompt chunk (HF's
        ``prefill_chunk_size``; the whole prompt without one), with the prompts' ``images``
        inputs (in the graphs that take them, eager); the sequences with their first new
        token, on every rank."""
        rows = state.rows
        length = inputs["input_ids"].shape[1]
        ends = list(range(chunk, length, chunk)) + [length] if chunk else [length]
        starts = [0, *ends[:-1]]
        n = len(rows)
        stage_rank = self.runner.train_engine.schedule.stage_rank
        num_ranks = self.place.num_ranks
        engine = self._engine(
            ("prefill", n * len(ends)),
            lambda: _C.forward_schedule(stage_rank, num_ranks, n * len(ends)),
        )
        logits: dict[int, torch.Tensor] = {}
        parts, concatenated = _split_rows(self.model, inputs, rows)
        held = _held_images(parts, concatenated, images)
        stages = [self._prefill_stages(names) for names in held]  # made before the schedule
        last = len(self.stages) - 1

        def forward(stage: int, mb: int, received: list[torch.Tensor]):
            c, g = divmod(mb, n)  # chunk-major: each group's chunks reach a stage in order
            s, e = starts[c], ends[c]
            batch = {
                "input_ids": parts["input_ids"][g][:, s:e],
                "attention_mask": parts["attention_mask"][g][:, :e],  # as HF's chunked prefill
                "position_ids": parts["position_ids"][g][..., s:e],
            }
            graph = stages[g][stage]
            batch.update((k, parts[k][g]) for k in held[g])
            run = graph.module if held[g] else self._module("prefill", stage)
            out = run(*(batch[k] for k in graph.batch_inputs), *received, caches[stage][g])
            if stage != last:
                return out
            if c == len(ends) - 1:
                logits[g] = whole_tensor(out[0][:, -1])
            return []

        signature = self._signature("generate", rows, length, ends)
        self.failures.run_step(engine, signature, forward, None)
        self._recompiled("prefill", (rows, length, tuple(ends), self.mask_length))
        tokens = self._first_tokens(state, samplers, logits)
        return torch.cat([inputs["input_ids"], tokens[:, None]], dim=-1)

    def _first_tokens(
        self, state: _Groups, samplers: list[_Sampler] | None, logits: dict[int, torch.Tensor]
    ) -> torch.Tensor:
        """Each row's first new token, drawn on the last stage's rank from the prefill's
        ``logits`` and broadcast; the groups' ``state`` advanced past it."""
        rows = state.rows
        out = torch.zeros(sum(rows) + len(rows), dtype=torch.long, device=self.place.device)
        if samplers is not None:
            drawn = [samplers[g].next(logits[g]) for g in range(len(rows))]
            out = torch.cat([t for t, _ in drawn] + [out.new_tensor([s for _, s in drawn])])
        out = self._broadcast(out, "generated tokens broadcast")
        tokens, stops = out[: sum(rows)], out[sum(rows) :]
        state.tokens = list(tokens[:, None].split(rows))
        state.stopped = [bool(x) for x in stops]
        state.mask = [torch.cat([m, m.new_ones(m.shape[0], 1)], dim=-1) for m in state.mask]
        state.next_position = [p + 1 for p in state.next_position]
        return tokens

    def _decode(
        self,
        ids: torch.Tensor,
        live: list[int],
        window: int,
        state: _Groups,
        caches: dict[int, list[Any]],
        samplers: list[_Sampler] | None,
        settings: GenerationSettings,
    ) -> tuple[torch.Tensor, int | None]:
        """One decode-schedule run: ``window`` tokens of the ``live`` groups (see [Note:
        generation data flow]). Returns the sequences extended by the window (on every rank) and,
        if every row has finished inside it, their length there (where HF's end)."""
        rows = [state.rows[g] for g in live]
        n = len(live)
        stage_rank = self.runner.train_engine.schedule.stage_rank
        num_ranks = self.place.num_ranks
        engine = self._engine(
            ("decode", tuple(rows), window),
            lambda: _C.decode_schedule(stage_rank, num_ranks, n, window),
        )
        stages, last = self.stages, len(self.stages) - 1
        drawn: list[list[torch.Tensor]] = [[] for _ in live]
        stopped_at = [0] * n  # per live group: tokens of the window until all its rows finished
        ones = [state.mask[g].new_ones(state.mask[g].shape[0], window) for g in live]
        no_ids = [state.tokens[g].new_zeros(state.tokens[g].shape) for g in live]

        def forward(stage: int, mb: int, received: list[torch.Tensor]):
            t, j = divmod(mb, n)
            g = live[j]
            st = stages[stage]
            batch = {"attention_mask": torch.cat([state.mask[g], ones[j][:, :t]], dim=-1)}
            batch["position_ids"] = state.next_position[g] + t
            if stage == 0:  # the group's last tokens: from the last stage, or the window's start
                batch["input_ids"] = received.pop()[:, None] if t else state.tokens[g]
            else:  # see [Note: generation data flow]: the shape matters here, not the ids
                batch["input_ids"] = no_ids[j]
            self._fixed(batch)
            own = (batch[name] for name in st.batch_inputs)
            out = self._module("decode", stage)(*own, *received, caches[stage][g])
            if stage != last:
                return out
            tokens, stop = samplers[g].next(whole_tensor(out[0][:, -1]))
            drawn[j].append(tokens)
            if stop and not stopped_at[j] and not state.stopped[g]:
                stopped_at[j] = t + 1
            return [tokens]

        signature = self._signature("decode", rows, window)
        self.failures.run_step(engine, signature, forward, None)
        self._recompiled("decode", (rows, self.mask_length))
        self.decode_runs.append(tuple(live))
        drawn_here = (drawn, stopped_at) if samplers is not None else None
        return self._extend(ids, live, window, state, drawn_here, settings)

    def _extend(
        self,
        ids: torch.Tensor,
        live: list[int],
        window: int,
        state: _Groups,
        drawn: tuple[list[list[torch.Tensor]], list[int]] | None,
        settings: GenerationSettings,
    ) -> tuple[torch.Tensor, int | None]:
        """After a decode run: the window's tokens and each live group's stop step, ``drawn``
        on the last rank (``None`` elsewhere), broadcast from it; every rank's sequences and
        ``state`` extended by them (see :meth:`_decode`)."""
        rows = [state.rows[g] for g in live]
        n = len(live)
        ones = [state.mask[g].new_ones(state.mask[g].shape[0], window) for g in live]
        total = sum(rows) * window
        out = torch.zeros(total + n, dtype=torch.long, device=self.place.device)
        if drawn is not None:
            flat = [torch.stack(d, dim=1).flatten() for d in drawn[0]]
            out = torch.cat([*flat, out.new_tensor(drawn[1])])
        out = self._broadcast(out, "generated tokens broadcast")
        parts = out[:total].split([r * window for r in rows])
        tokens = [x.view(r, window) for x, r in zip(parts, rows, strict=True)]
        stops = out[total:].tolist()
        new = torch.full(
            (ids.shape[0], window), _pad_id(settings), dtype=torch.long, device=ids.device
        )
        starts = [0, *torch.tensor(state.rows).cumsum(0).tolist()]
        for j, g in enumerate(live):
            new[starts[g] : starts[g + 1]] = tokens[j]
            state.tokens[g] = tokens[j][:, -1:]
            state.mask[g] = torch.cat([state.mask[g], ones[j]], dim=-1)
            state.next_position[g] = state.next_position[g] + window
            if stops[j]:
                state.stopped[g] = True
        ids = torch.cat([ids, new], dim=-1)
        if all(state.stopped):  # where the last group to finish did, as HF's loop ends
            return ids, ids.shape[1] - window + max(stops)
        return ids, None


_DP_CAUSE = (
    "a pipeline replica on the mesh's data-parallel dimension was given other prompts or "
    "generation options than the others; every rank must pass the same whole batch of prompts"
)


def _pad_id(settings: GenerationSettings) -> int:
    """The token of a row whose group left the schedule: HF's padding of finished rows."""
    return int(settings.pad) if settings.pad is not None else 0


def cache_bytes(caches: dict[int, list[Any]]) -> int:
    """Bytes of key and value tensors that ``caches`` (each stage's, one per group) allocated,
    each layer object once."""
    seen: dict[int, Any] = {}
    for group_caches in caches.values():
        for layer in (la for cache in group_caches for la in cache.layers):
            if getattr(layer, "is_initialized", False):
                seen[id(layer)] = layer
    return sum(t.numel() * t.element_size() for la in seen.values() for t in (la.keys, la.values))


def _prompt_images(
    model: nn.Module, kwargs: dict[str, Any], ids: torch.Tensor
) -> tuple[dict, dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """``generate``'s keyword arguments without the prompts' images, the images (see [Note:
    images in the prefill]), and each ragged image input's shares of the prompts (images
    concatenated over the batch: its rows per prompt, from the prompts' image tokens; see [Note:
    images concatenated over a batch] in ``split/hf.py``); the other images are tensors of a
    row each. Raises ``ValueError`` naming the input that is neither."""
    rows = ids.shape[0]
    kwargs = dict(kwargs)
    images = {k: kwargs.pop(k) for k in PROMPT_INPUTS if kwargs.get(k) is not None}
    for name, value in images.items():
        if not isinstance(value, torch.Tensor) or value.ndim == 0:
            raise ValueError(f"generate's {name} must be a tensor, got {type(value).__name__}")
    if "token_type_ids" in images and not any(
        hasattr(m, "get_image_features") for m in model.modules()
    ):
        raise ValueError(
            f"generate takes token_type_ids for a vision-language model's prefill mask (Gemma 3, "
            f"PaliGemma); {type(model).__name__} has no images, and token types of every decode "
            "step (GPT-2's) are not supported yet"
        )
    ragged = hf.ragged_inputs(model, tuple(images))
    shares = ragged({"input_ids": ids, **images}) if ragged else {}
    for name, value in images.items():
        if name not in shares and value.shape[0] != rows:
            raise ValueError(
                f"generate's {name} must be a tensor with a row per prompt ({rows}), got "
                f"{tuple(value.shape)}"
            )
    return kwargs, images, shares


def _take_rows(
    images: dict[str, torch.Tensor], shares: dict[str, torch.Tensor], rows: slice
) -> dict[str, torch.Tensor]:
    """The prompts ``rows``' images: their rows, or their shares of a ragged input."""
    return {
        k: cut_ragged(v, shares[k], rows)[0] if k in shares else v[rows] for k, v in images.items()
    }


def _held_images(
    parts: dict[str, tuple[torch.Tensor, ...]], concatenated: set[str], images: tuple[str, ...]
) -> list[tuple[str, ...]]:
    """Each group's image inputs (of its ``parts``): a row input always; one ``concatenated`` over
    the prompts (see [Note: images in the prefill]) where the group's rows hold some of it
    (images but no video, say), and none where they hold none of those, as HF's ``generate``
    would be called."""
    held = []
    for g in range(len(parts["input_ids"])):
        names = tuple(k for k in images if k not in concatenated or parts[k][g].shape[0])
        held.append(names if not concatenated or concatenated & set(names) else ())
    return held


def _split_rows(
    model: nn.Module, inputs: dict[str, torch.Tensor], rows: list[int]
) -> tuple[dict[str, tuple[torch.Tensor, ...]], set[str]]:
    """``inputs`` split into groups of ``rows`` prompts: position ids on their rows' dim (M-RoPE's
    is the second), a ragged image input by its rows' shares, the rest by rows; and the names of
    the ragged inputs."""
    ragged = hf.ragged_inputs(model, tuple(inputs))
    shares = ragged(inputs) if ragged else {}
    out = {}
    for name, value in inputs.items():
        if name == "position_ids":
            out[name] = value.split(rows, dim=-2)
        elif name in shares:
            sizes = [int(part.sum()) for part in shares[name].split(rows)]
            out[name] = value.split(sizes)
        else:
            out[name] = value.split(rows)
    return out, set(shares)


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
