"""``PipelineModel``: wrap an unmodified model and train it pipeline-parallel.

Every rank of the process group traces and partitions the whole model (on whatever device it
lives, ``meta`` included), keeps only its own stage, and hands that stage to the C++ engine
(``pippy_xla._C.Engine``), which runs the schedule's actions every step.

``PipelineModel`` is a facade. The data flows one way:

- :class:`~pippy_xla.config.PipelineConfig`: what the user asked for, validated once;
- :func:`pippy_xla.runtime._build.build`: the stages of this rank, ready to run (placement,
  layout, partition, handshake, materialization, tied weights, data parallelism, engines);
- then one object per job: :class:`~pippy_xla.runtime._state.StageState` (parameters and state
  dicts), :class:`~pippy_xla.runtime._step.StepRunner` (running a step),
  :class:`~pippy_xla.runtime.failures.FailureState` (failure handling) and
  :class:`~pippy_xla._report.Report` (timings, timelines, stash counts);
  :mod:`pippy_xla.checkpoint` saves and loads through the facade.
"""

from __future__ import annotations

import functools
import logging
import os
import sys
from collections.abc import Iterator, Mapping
from pathlib import Path
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn

from pippy_xla import checkpoint
from pippy_xla._native import _C
from pippy_xla._report import Report
from pippy_xla.config import LossFn, PipelineConfig
from pippy_xla.hf_compat import checkpoint_conversion, warn_if_untested
from pippy_xla.runtime._build import build
from pippy_xla.runtime._exit import release_at_exit
from pippy_xla.runtime._generate import Generator
from pippy_xla.runtime._state import StageState
from pippy_xla.runtime._step import EvalOutput, StepRunner, TokenSum
from pippy_xla.runtime.failures import FailureState
from pippy_xla.split.partition import LayerCls, StageGraph

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

__all__ = ["EvalOutput", "PipelineModel", "balanced_ranges"]

logger = logging.getLogger(__name__)

balanced_ranges = _C.balanced_ranges
"""``balanced_ranges(num_layers, num_stages)``: contiguous layer ranges whose sizes differ by at
most one (earlier stages get more)."""


class PipelineModel:
    """One rank's stages of a pipeline-parallel model.

    Args:
        model: the full model (an HF ``*ForCausalLM`` or any model the partitioner can split),
            possibly on the ``meta`` device; the local stage's parameters are then materialized on
            the pipeline's device and initialized as the model would initialize them.
        layer_cls: the decoder-layer class, a tuple of classes (a stack of several, e.g.
            attention and linear-attention layers), or ``None`` (the default): the entries of
            the model's layer stack, the text model's ``nn.ModuleList`` or ``nn.Sequential``
            that HF's ``base_model_pp_plan`` names, else the one of modules with parameters
            (see :func:`pippy_xla.split.partition.decoder_stack`). Layers are the stage-cut points.
        config: a :class:`~pippy_xla.config.PipelineConfig`, or ``None`` to pass its fields as
            keyword arguments instead (each is documented there). With ``plan=`` (a
            :class:`~pippy_xla.Plan`) the plan's schedule, microbatch count, stages per rank,
            layer ranges and checkpointed layers are used (see
            :meth:`~pippy_xla.config.PipelineConfig.from_plan`).
        group: the pipeline's process group (default: the world).
        mesh: a 2-D ``DeviceMesh`` (data x pipeline) for several pipeline replicas: the
            pipeline runs over its ``pp_dim`` dimension, replicas over ``dp_dim``. Every rank is
            given the global batch; each replica trains on its share, and stage gradients are
            reduced over the replicas with FSDP2 (see [Note: pipeline x data parallel] in
            runtime/data_parallel.py). Exclusive with ``group``. Or a 3-D ``DeviceMesh``
            ``("dp", "pp", "tp")`` with ``tensor_parallel="auto"``: each stage's decoder layers
            are sharded over the ``tp`` dimension by the model's own HF plan, or with
            ``tensor_parallel={key: style}`` by HF rules merged over it (see [Note:
            pipeline x tensor parallel] in runtime/tensor_parallel.py; replicas over ``dp``
            as above, FSDP2 over the tp-sharded stages). With ``dp_dim=("dp_replicate",
            "dp_shard")`` the mesh's data-parallel dimension is two dims (HSDP:
            ``data_parallel="shard"`` shards over ``dp_shard`` and replicates over
            ``dp_replicate``). With ``expert_parallel=ep`` each stage's MoE experts are
            sharded over ``ep`` of its replicas by the model's own HF expert plan, tokens
            exchanged all-to-all (see [Note: pipeline x expert parallel] in
            runtime/expert_parallel.py). Or a mesh ``("cp", "pp")`` (``("cp",)``, or
            ``("dp", "cp", "pp")`` with replicas): every row's tokens shared over the ``cp``
            ranks of each stage, attention exact across the shares through HF's attention
            interface (see [Note: pipeline x context parallel] in
            runtime/context_parallel.py).
    """

    def __init__(
        self,
        model: nn.Module,
        *,
        layer_cls: LayerCls = None,
        config: PipelineConfig | None = None,
        group: dist.ProcessGroup | None = None,
        mesh: DeviceMesh | None = None,
        **options: Any,
    ) -> None:
        self.pipeline_config = PipelineConfig.from_options(config, options)
        """How this pipeline was configured."""
        if "transformers" in sys.modules:  # an HF model: see hf_compat.warn_if_untested
            warn_if_untested(sys.modules["transformers"].__version__)
        self._wrapper = checkpoint.wrapper_of(model)  # PEFT's PeftModel, say
        # The whole model's, the same on every rank: a rank's own stages may train nothing.
        self._trains = any(p.requires_grad for p in model.parameters())
        fresh = set()
        if self._wrapper is not None:
            self._wrapper.check_options(self.pipeline_config)
            fresh = self._wrapper.fresh_adapters(model)
        built = build(model, layer_cls, self.pipeline_config, group=group, mesh=mesh)
        self._place = built.place
        self.stages: list[StageGraph] = built.stages
        """Every stage's graph (only this rank's hold materialized tensors)."""
        self.local_stages: list[StageGraph] = built.local_stages
        """This rank's stages, ascending."""
        self.layer_ranges: list[tuple[int, int]] = built.layer_ranges
        """Every stage's half-open decoder-layer range."""
        self._state = StageState(built.stages, built.local_stages, built.aliases, built.place.rank)
        self._failures = FailureState(
            built.abort, built.abort.rank, mesh if built.place.mesh is not None else None
        )
        self._runner = StepRunner(built, self.pipeline_config, self._failures)
        self._report = Report(self._runner)
        inner = self._wrapper.inner_model() if self._wrapper is not None else model
        self._generator = Generator(inner, layer_cls, self._runner)
        # See [Note: releasing the group at exit]: these hold the process groups.
        release_at_exit(self._place, "group", "mesh")
        release_at_exit(self._runner, "dp")
        release_at_exit(self._failures, "mesh")
        if fresh:
            self._wrapper.init_fresh(self, fresh)
            if self._place.cp is not None:  # each rank's own draws: cp rank 0's kept
                local = sorted(self.state_dict(keep_vars=True).items())
                self._place.cp.copy_from_first_rank([(n, t) for n, t in local if n in fresh])
        self.config = getattr(model, "config", None)
        """The model's config (written by :meth:`save_pretrained`), if it has one."""
        self.generation_config = getattr(model, "generation_config", None)
        """The model's generation config (written by :meth:`save_pretrained`), if it has one."""
        logger.info(
            "[rank %d] stages %s, layers %s, %d parameters",
            self.rank,
            [st.index for st in self.local_stages],
            [st.layers for st in self.local_stages],
            sum(p.numel() for p in self.parameters()),
        )

    def __repr__(self) -> str:
        cfg = self.pipeline_config
        mine = ", ".join(f"stage {st.index}: layers {st.layers}" for st in self.local_stages)
        return (
            f"PipelineModel(rank {self.rank} of {self.num_ranks}, {self.num_stages} stages, "
            f"schedule {cfg.schedule_name!r}, {cfg.num_microbatches} microbatches; {mine})"
        )

    # ----------------------------------------------------------------------------- layout

    @property
    def group(self) -> dist.ProcessGroup | None:
        """The pipeline's process group (with a mesh: its pipeline dimension)."""
        return self._place.group

    @property
    def mesh(self) -> DeviceMesh | None:
        """The data x pipeline (x tensor) mesh, if the pipeline was built on one."""
        return self._place.mesh.mesh if self._place.mesh is not None else None

    @property
    def checkpoint_group(self) -> dist.ProcessGroup | None:
        """The ranks that save and load checkpoints together: the pipeline's group, or with a
        mesh every rank of the mesh (the job; the cp ranks' equal copies are saved once). A
        property: the exit hook frees the group by dropping it from the placement (see [Note:
        releasing the group at exit])."""
        on_mesh = self._place.mesh is not None or self._place.cp is not None
        return dist.group.WORLD if on_mesh else self._place.group

    @property
    def rank(self) -> int:
        """This rank in the pipeline's group."""
        return self._place.rank

    @property
    def num_ranks(self) -> int:
        """Ranks in the pipeline's group."""
        return self._place.num_ranks

    @property
    def num_stages(self) -> int:
        """Stages of the pipeline: ranks x chunks."""
        return len(self.stages)

    @property
    def dp_rank(self) -> int:
        """This rank's replica (its coordinate on the mesh's data-parallel dimension)."""
        return self._place.dp_rank

    @property
    def dp_size(self) -> int:
        """How many pipeline replicas train together (1 without a mesh)."""
        return self._place.dp_size

    @property
    def cp_rank(self) -> int:
        """This rank's coordinate on the mesh's context-parallel dimension (0 without one): it
        holds chunks ``cp_rank`` and ``2 cp_size - 1 - cp_rank`` of every row's ``2 cp_size``."""
        return self._place.cp.rank if self._place.cp is not None else 0

    @property
    def cp_size(self) -> int:
        """How many ranks share every row's tokens (1 without context parallelism)."""
        return self._place.cp.size if self._place.cp is not None else 1

    @property
    def tp_rank(self) -> int:
        """This rank's coordinate on the mesh's tensor-parallel dimension (0 without one)."""
        return self._place.tp_rank

    @property
    def tp_size(self) -> int:
        """How many ranks run each stage together, each with its shard of the decoder layers
        (1 without tensor parallelism)."""
        return self._place.tp_size

    @property
    def device(self) -> torch.device:
        """Where the local stages and the runtime's buffers live."""
        return self._place.device

    @property
    def schedule(self) -> str:
        """The training schedule's name."""
        return self.pipeline_config.schedule_name

    @property
    def num_microbatches(self) -> int:
        return self.pipeline_config.num_microbatches

    @property
    def input_names(self) -> list[str]:
        return list(self.pipeline_config.input_names)

    @property
    def stage(self) -> StageGraph:
        """The first (with one chunk per rank: the only) stage of this rank."""
        return self.local_stages[0]

    @property
    def module(self) -> torch.fx.GraphModule:
        """The graph module of :attr:`stage`."""
        return self.stage.module

    @property
    def is_last(self) -> bool:
        """Whether this rank runs the last stage (and so holds the logits)."""
        return self.rank == self.last_rank

    @property
    def last_rank(self) -> int:
        """The rank that runs the last stage."""
        return self._runner.last_rank

    @property
    def engine(self) -> _C.Engine:
        """The C++ engine that runs training steps on this rank: its schedule, the last step's
        timings and the activation stash."""
        return self._runner.train_engine

    def stage_of_layer(self, layer: int) -> int:
        """The stage that runs decoder layer ``layer``."""
        for st in self.stages:
            if layer in st.layers:
                return st.index
        raise IndexError(f"layer {layer} out of range: the model has {self.layer_ranges[-1][1]}")

    def layers_of_stage(self, stage: int) -> list[int]:
        """The decoder layers stage ``stage`` runs."""
        return list(self.stages[stage].layers)

    # ----------------------------------------------------------------------------- parameters

    def named_parameters(self) -> Iterator[tuple[str, nn.Parameter]]:
        """The local stages' parameters under the original model's names (each once)."""
        return self._state.named_parameters()

    def parameters(self) -> Iterator[nn.Parameter]:
        """The local stages' parameters (each once): what this rank's optimizer updates."""
        return (p for _, p in self._state.named_parameters())

    def state_dict(self, keep_vars: bool = False) -> dict[str, torch.Tensor]:
        """The local stages' parameters and persistent buffers under the original names (a tied
        weight under each local name)."""
        return self._state.state_dict(keep_vars)

    def load_state_dict(self, state_dict: Mapping[str, torch.Tensor], strict: bool = True) -> None:
        """Loads this rank's entries from a full model's state dict; other stages' keys are
        ignored. A missing or mis-shaped key of this rank is an error naming it; with ``strict``,
        so is a key that belongs to no stage of the model."""
        self._state.load_state_dict(state_dict, strict)

    def aliases(self, name: str) -> list[str]:
        """Every name of the model's tensor ``name`` (several for tied weights), in model order."""
        return self._state.aliases(name)

    def all_state_names(self) -> set[str]:
        """The state-dict keys of the whole model (every stage, every name of a tied weight)."""
        return self._state.all_state_names()

    def checkpoint_name(self, key: str) -> str:
        """The model's name of the HF checkpoint key ``key`` (HF's renamings of older layouts
        and its weight converters' target names applied, as ``from_pretrained`` applies them
        (see :attr:`checkpoint_conversion`); a PEFT model's base checkpoint keys named
        as the ``PeftModel`` names them)."""
        conversion = self.checkpoint_conversion
        key = key if conversion is None else conversion.rename(key)[0]
        if self._wrapper is not None:
            key = self._wrapper.model_name(key, self.all_state_names)
        return key

    def checkpoint_state(self) -> dict[str, torch.Tensor]:
        """What :meth:`save` and :meth:`load` keep of the model: the local state dict, or for a
        PEFT model only what trains and what the adapters add (the frozen base comes from
        :meth:`load_pretrained`, and is not rewritten at every save)."""
        state = self.state_dict()
        if self._wrapper is None:
            return state
        trainable = {n for n, p in self.named_parameters() if p.requires_grad}
        return {
            n: t
            for n, t in state.items()
            if self._wrapper.base_name(n) is None or any(a in trainable for a in self.aliases(n))
        }

    def in_pretrained(self, name: str) -> bool:
        """Whether a pretrained checkpoint of the model holds the tensor ``name`` (not one a
        PEFT adapter added)."""
        return self._wrapper is None or self._wrapper.base_name(name) is not None

    @functools.cached_property
    def checkpoint_conversion(self) -> SimpleNamespace | None:
        """HF's conversion of checkpoint keys and tensors for this model (its renamings of older
        layouts and the converters that merge per-expert tensors into fused experts:
        :func:`pippy_xla.hf_compat.checkpoint_conversion`), looked up when a checkpoint is first
        read: HF builds its conversion table at the first lookup in a process (40-70 ms of
        regular expressions, which every rank of a job that never reads a checkpoint would
        pay)."""
        return checkpoint_conversion(self._generator.model)

    def non_persistent_names(self) -> set[str]:
        """Buffers of the model that state dicts leave out (such as rotary ``inv_freq``)."""
        return self._state.non_persistent_names()

    def train(self, mode: bool = True) -> PipelineModel:
        for st in self.local_stages:
            st.module.train(mode)
        return self

    def eval(self) -> PipelineModel:
        return self.train(False)

    # ----------------------------------------------------------------------------- checkpoints

    def load_pretrained(self, path: str | os.PathLike) -> None:
        """Loads this rank's stage from a HF safetensors checkpoint directory (what
        ``save_pretrained`` writes), reading only the local tensors. See
        :func:`pippy_xla.checkpoint.load_pretrained`."""
        checkpoint.load_pretrained(self, path)

    def save_pretrained(
        self,
        path: str | os.PathLike,
        max_shard_size: int | str | None = None,
        *,
        merge_adapters: bool = False,
    ) -> None:
        """Writes the model as a HF safetensors checkpoint, one shard (or more) per rank and one
        index; a collective. See :func:`pippy_xla.checkpoint.save_pretrained`. A pipeline of a
        PEFT ``PeftModel`` writes what ``PeftModel.save_pretrained`` writes (the adapters only),
        or with ``merge_adapters=True`` the base model with the adapters merged, in HF's layout
        (see [Note: PEFT models in the pipeline] in ``integrations/peft.py``)."""
        if self._wrapper is not None:
            self._wrapper.save(self, path, max_shard_size, merge_adapters)
        elif merge_adapters:
            raise ValueError("merge_adapters=True needs a pipeline of a PEFT model; this has none")
        else:
            checkpoint.save_pretrained(self, path, max_shard_size)

    def load_adapter(self, path: str | os.PathLike, adapter_name: str = "default") -> None:
        """Loads a PEFT adapter that ``save_pretrained`` (or PEFT in one process) wrote into the
        local stages' tensors of the model's adapter ``adapter_name``; a collective. See [Note:
        PEFT models in the pipeline] in ``integrations/peft.py``."""
        if self._wrapper is None:
            raise ValueError(
                "load_adapter needs a pipeline of a PEFT model (PipelineModel(get_peft_model("
                "model, config), ...)); this one has none"
            )
        self._wrapper.load_adapter(self, path, adapter_name)

    def save(
        self,
        directory: str | os.PathLike,
        optimizer: torch.optim.Optimizer | None = None,
        step: int | None = None,
        scheduler: torch.optim.lr_scheduler.LRScheduler | None = None,
    ) -> Path:
        """Saves parameters, buffers, optimizer and learning-rate scheduler state and ``step``
        with ``torch.distributed.checkpoint``, atomically; a collective. See
        :func:`pippy_xla.checkpoint.save`."""
        return checkpoint.save(self, directory, optimizer, step, scheduler)

    def load(
        self,
        directory: str | os.PathLike,
        optimizer: torch.optim.Optimizer | None = None,
        scheduler: torch.optim.lr_scheduler.LRScheduler | None = None,
        missing_ok: bool = False,
    ) -> int | None:
        """Loads the latest checkpoint in ``directory`` (any rank count or schedule saved it)
        into this pipeline, ``optimizer`` and ``scheduler``; returns its step (``None`` with
        ``missing_ok`` when there is none yet); a collective. See
        :func:`pippy_xla.checkpoint.load`."""
        return checkpoint.load(self, directory, optimizer, scheduler, missing_ok)

    # ----------------------------------------------------------------------------- running

    @property
    def loss_fn(self) -> LossFn:
        """The loss of one microbatch (the ``loss_fn`` option or the HF model's own); assignable
        between steps."""
        return self._runner.loss_fn

    @loss_fn.setter
    def loss_fn(self, fn: LossFn) -> None:
        self._runner.loss_fn = fn

    @property
    def token_sums(self) -> dict[str, TokenSum] | None:
        """Sums the last stage computes beside the loss of every microbatch, each
        ``fn(logits, next_labels)`` (the logits whole and detached, ``logits[:, t]`` aligned with
        the label of token ``t + 1``) summed over the microbatch's tokens; read after a step from
        :attr:`last_token_sums`. ``None`` (the default): none. Assignable between steps, on every
        rank alike. See [Note: token sums beside the loss] in ``runtime/_step.py``."""
        return self._runner.token_sums

    @token_sums.setter
    def token_sums(self, fns: dict[str, TokenSum] | None) -> None:
        self._runner.token_sums = dict(fns) if fns else None

    @property
    def added_over_batch(self) -> bool:
        """Whether what the model adds to its loss (an MoE router's load-balancing loss) is
        computed over the whole batch (the global batch, with a mesh), as one process computes
        it on that batch, rather than per microbatch (``False``, the default: see [Note: added
        loss terms per microbatch] in ``runtime/_step.py``). ``True`` costs each step a forward
        of the batch without gradients first (only where there are several microbatches or
        replicas). Assignable between steps, on every rank alike; raises ``ValueError`` where the
        model's terms cannot be so computed. See [Note: added terms over the whole batch] in
        ``split/hf.py``."""
        return self._runner.added_over_batch

    @added_over_batch.setter
    def added_over_batch(self, value: bool) -> None:
        if value:
            self._runner.check_added_over_batch()
        self._runner.added_over_batch = bool(value)

    def run_train(self, **batch: torch.Tensor) -> torch.Tensor:
        """Runs forward and backward over the batch, microbatch by microbatch.

        Accumulates gradients into the local stage's parameters (call ``optimizer.step()`` and
        ``zero_grad()`` as usual) and returns the batch's mean loss on every rank, reduced as the
        unwrapped model reduces it. With a mesh, ``batch`` is the global batch: each replica
        trains on its share, and the loss and gradients are those of the global batch.
        """
        if not torch.is_grad_enabled():
            raise RuntimeError("run_train was called under torch.no_grad(); use run_eval instead")
        if not self._trains:
            raise ValueError(
                "run_train: nothing of the model trains (every parameter had requires_grad=False "
                "when the pipeline was built; a PEFT model in inference mode: get_peft_model, or "
                "PeftModel.from_pretrained(..., is_trainable=True)); use run_eval or generate, or "
                "set requires_grad before building"
            )
        return self._runner.train(batch)

    @torch.no_grad()
    def run_eval(self, **batch: torch.Tensor) -> EvalOutput:
        """Forward only. Returns the batch's logits on the last stage and, given labels, its
        mean loss on every rank."""
        return self._runner.evaluate(batch)

    @torch.no_grad()
    def generate(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        generation_config: Any = None,
        *,
        groups: int | None = None,
        **kwargs: Any,
    ) -> torch.Tensor:
        """What HF's ``model.generate(input_ids, attention_mask=..., generation_config, **kwargs)``
        returns for the unsplit model (the prompts and their new tokens), on every rank; a
        collective: every rank passes the same prompts and options. Greedy and sampled decoding
        through HF's own logits processors and stopping criteria (``max_new_tokens``,
        ``eos_token_id``, ``pad_token_id``, ``do_sample``, ``temperature``, ``top_k``, ``top_p``,
        ``repetition_penalty``...); left-padded prompts. Each stage keeps the key/value cache of
        its own layers, and only the sampled tokens travel back (see [Note: generation data flow]
        in ``runtime/_generate.py``). ``groups``: the batch's rows split into that many groups,
        each a microbatch with its own caches: the prefill is pipelined by groups (and by
        prompt chunks, with HF's ``prefill_chunk_size``), and decoding
        by groups across the ranks (a group's next token starts on the first stage as soon as
        the last stage sent its token ids), so with as many groups as ranks (the default) every
        rank works at every step; a group whose rows all finished leaves the schedule. With
        ``groups=1`` the stages take turns on the whole batch, as HF's pipeline does. Seeded
        sampling draws HF's one-process tokens while no group has left the schedule (always,
        with one group), and is reproducible in any case. Training and evaluation steps may
        come before and after. On a mesh every rank passes the whole batch (a multiple of
        ``dp`` prompts), each replica generates for its share of the rows (the tp ranks of a
        stage for the same rows) and every rank returns the whole batch, padded with
        ``pad_token_id`` as HF pads (see [Note: generation on a mesh])."""
        self._refuse_under_cp("generate")
        return self._generator.generate(
            input_ids, attention_mask, generation_config, kwargs, groups
        )

    def clip_grad_norm_(
        self,
        max_norm: float,
        norm_type: float = 2.0,
        error_if_nonfinite: bool = False,
    ) -> torch.Tensor:
        """Clips the gradients of the whole pipeline by their global norm, and returns that norm
        on every rank: what ``torch.nn.utils.clip_grad_norm_(model.parameters(), ...)`` does in
        one process (every stage, tied weights counted once, data-parallel shards and replicas
        included). A collective: call it on every rank after ``run_train``. Calling torch's own
        function on ``pipe.parameters()`` would clip each stage by its own norm. See [Note:
        global gradient clipping] in ``_grads.py``."""
        return self._runner.clip_grad_norm_(
            list(self.parameters()), max_norm, norm_type, error_if_nonfinite
        )

    # ----------------------------------------------------------------------------- reporting

    @property
    def last_losses(self) -> dict[str, float]:
        """The last step's loss on every rank: ``total`` (what ``run_train`` returned), ``main``
        (``loss_fn``'s part) and ``aux`` (what the model adds to its loss, such as an MoE
        router's load-balancing loss times ``router_aux_loss_coef``; 0 for other models). See
        [Note: added loss terms per microbatch] in ``_step.py``."""
        return self._runner.last_losses

    @property
    def last_token_sums(self) -> dict[str, float]:
        """The last step's :attr:`token_sums` over the whole batch (the global batch, with a
        mesh) on every rank, by name; empty without them."""
        return self._runner.last_token_sums

    @property
    def recompiles(self) -> list[str]:
        """Explanations of the recompilations of compiled stages seen after each mode's first
        step."""
        return self._runner.recompiles

    def stage_costs(self) -> dict[str, list[float]]:
        """Every stage's mean F, B and W seconds in the last training step (a collective). See
        :meth:`pippy_xla._report.Report.stage_costs`."""
        return self._report.stage_costs()

    def tune_schedule(self) -> _C.Schedule:
        """Orders the training schedule for the costs measured in the last training step; a
        collective over every rank of the pipeline (and its replicas).

        The zero-bubble schedules (``"zbh1"``, ``"interleaved_zb"``, ``"zbv"``) are list-scheduled
        ([Note: list scheduling at costs]): generated at unit costs by default, they are generated
        again at every stage's measured mean F, B and W (:meth:`stage_costs`), and later steps run
        that order (or the published one, where the simulator puts it no later at those costs).
        Stages, ranks, memory bound and results stay the same; only the order of the actions
        changes. Call it after a few steps (with ``compile=True``, after the steps that
        compile), and again if the costs change. Returns the new schedule (also
        ``pipe.engine.schedule``).

        Raises:
            ValueError: the schedule's order does not depend on costs (a fixed schedule such as
                ``"1f1b"``, or a :class:`pippy_xla.Schedule` given as is).
            RuntimeError: no training step has run with the current schedule.
        """
        self._refuse_under_cp("tune_schedule")
        return self._runner.tune_schedule(self._report.stage_costs)

    def _refuse_under_cp(self, what: str) -> None:
        """What a context-parallel pipeline does not cover yet (issue 72), refused in one line."""
        if self._place.cp is not None:
            raise NotImplementedError(
                f"{what} is not supported yet under context parallelism (issue 72); save with "
                f"save(), load it into a pipeline without a cp dim and call that one's {what}"
            )

    @property
    def shm_peers(self) -> int:
        """How many ranks of the pipeline this rank reaches through shared memory (``transport``;
        0: every transfer goes through the process group's send and receive)."""
        return _C.shm_peers(self._place.group_name)

    def timings(self) -> list[tuple[str, int, int, int, int]]:
        """The last step's actions on this rank: ``(op, stage, microbatch, start_ns, end_ns)``.
        See :meth:`pippy_xla._report.Report.timings`."""
        return self._report.timings()

    def timeline(self, json_path: str | None = None, png_path: str | None = None) -> list:
        """The last step's actions of every rank, merged (a collective), optionally written as a
        Chrome trace and a Gantt chart. See :meth:`pippy_xla._report.Report.timeline`."""
        return self._report.timeline(json_path, png_path)

    @property
    def stash_peak_bytes(self) -> int:
        """Most bytes the activation stash held at once since the last ``reset_stash_peak``."""
        return self._report.stash_peak_bytes

    @property
    def stash_live_bytes(self) -> int:
        """Bytes the activation stash holds now (0 between steps)."""
        return self._report.stash_live_bytes

    def reset_stash_peak(self) -> None:
        """Sets :attr:`stash_peak_bytes` to the bytes held now."""
        self._report.reset_stash_peak()
