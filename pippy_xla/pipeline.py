"""``PipelineModel``: wrap an unmodified model and train it pipeline-parallel.

Every rank of the process group traces and partitions the whole model (on whatever device it
lives, ``meta`` included), keeps only its own stage, and hands that stage to the C++ engine
(``pippy_xla._C.Engine``), which runs the schedule's actions every step.

``PipelineModel`` is a facade: each part of building and running a pipeline is a function of
its own module, with explicit inputs and outputs, called here in order.

- Building: ``_build`` (device, stage layout, loss, the handshake that every rank built the same
  pipeline), ``partition``, ``materialize``, ``_ties`` (tied weights across ranks),
  ``data_parallel`` (with a mesh), ``_recompile`` (compiled stages), ``_exit`` (the exit hook).
- A step: ``_batch.split_batch`` -> ``_batch.batch_signature`` -> ``_batch.gather_signatures``
  -> ``_batch.check_same_signature`` -> ``_C.Engine.run`` with the forward of
  ``_step.stage_forward`` -> tied-gradient sums -> loss broadcast.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch import nn

from pippy_xla import _step, checkpoint
from pippy_xla._batch import (
    batch_signature,
    check_same_signature,
    gather_signatures,
    split_batch,
)
from pippy_xla._build import (
    LossFn,
    balanced_ranges,
    causal_lm_num_items,
    check_ranks_agree,
    default_loss,
    resolve_device,
    resolve_layout,
)
from pippy_xla._exit import release_at_exit
from pippy_xla._native import _C
from pippy_xla._recompile import RecompileWatch
from pippy_xla._ties import combine_among, local_ties, tied_names
from pippy_xla.data_parallel import DataParallel, assign, local_tensor, mesh_groups
from pippy_xla.errors import AbortChannel, PipelineError
from pippy_xla.materialize import materialize
from pippy_xla.ops import group_name_of
from pippy_xla.partition import StageGraph, find_layers, partition
from pippy_xla.planner import Plan

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

__all__ = ["PipelineModel", "EvalOutput", "balanced_ranges"]

logger = logging.getLogger(__name__)

# PipelineModels built so far per process group: the same count on every rank (building is
# collective), so it names one pipeline in the shared store. See [Note: failing fast].
_INSTANCES: dict[str, int] = {}


@dataclass(kw_only=True, slots=True)
class EvalOutput:
    """What :meth:`PipelineModel.run_eval` returns."""

    loss: torch.Tensor | None
    """The batch's mean loss on every rank, if labels were given."""
    logits: torch.Tensor | None
    """The whole batch's logits on the last stage's rank, ``None`` elsewhere (with a mesh: the
    logits of this replica's share of the batch)."""


class PipelineModel:
    """One rank's stage of a pipeline-parallel model.

    Args:
        model: the full model (an HF ``*ForCausalLM`` or any model the partitioner can split),
            possibly on the ``meta`` device; the local stage's parameters are then materialized on
            ``device`` and initialized as the model would initialize them.
        layer_cls: the decoder-layer class; layers are the stage-cut points.
        num_microbatches: microbatches per step; the batch size must be divisible by it.
        schedule: ``"1f1b"``, ``"gpipe"``, ``"interleaved"`` (interleaved 1F1B: ``chunks``
            stages per rank, stage ``s`` on rank ``s % ranks``) or ``"zbh1"`` (zero-bubble ZB-H1:
            backward split into input- and weight-gradient steps; the weight steps fill the
            bubble).
        chunks: stages per rank for ``"interleaved"`` (default 2); 1 for the others.
        group: the pipeline's process group (default: the world).
        layer_ranges: explicit ``(start, stop)`` layer range per stage (default: balanced).
        plan: a :class:`~pippy_xla.planner.Plan` (from :func:`pippy_xla.plan`): its layer
            ranges, and its checkpointed layers run under activation checkpointing. Exclusive
            with ``layer_ranges``.
        input_names: the model keyword inputs a batch provides (besides ``labels``).
        loss_fn: ``loss_fn(logits, labels, num_items) -> loss`` of one microbatch, summed over
            its tokens and divided by ``num_items`` (the batch's count of valid tokens), so the
            microbatch losses add up to the batch mean. Default: the HF model's own loss.
        num_items_fn: counts the valid tokens of the whole batch's labels (default: causal-LM
            labels other than -100 after the shift).
        timeout: seconds any single wait on a peer may take before the step fails.
        device: where the local stage and every buffer the runtime allocates live. Default:
            ``cuda:LOCAL_RANK`` when the group's backend is NCCL, else the CPU (gloo).
        compile: compile the local stage with ``torch.compile`` (inductor by default). The
            stage graph is stable (see [Note: stable stage graphs]), so steps after the first
            reuse the compiled code; a recompilation is logged with its cause and recorded in
            :attr:`recompiles`.
        compile_options: keyword arguments for ``torch.compile``.
        mesh: a 2-D ``DeviceMesh`` (data x pipeline) for several pipeline replicas: the
            pipeline runs over its ``pp_dim`` dimension, replicas over ``dp_dim``. Every rank is
            given the global batch; each replica trains on its share, and stage gradients are
            reduced over the replicas with FSDP2 (see [Note: pipeline x data parallel] in
            data_parallel.py). Exclusive with ``group``.
        pp_dim, dp_dim: the mesh's pipeline and data-parallel dimension names.
        data_parallel: with a mesh, ``"replicate"`` (every replica holds its stage whole:
            torch's FSDP2-based ``replicate``) or ``"shard"`` (``fully_shard``: parameters,
            gradients and optimizer state sharded over the replicas).
    """

    def __init__(
        self,
        model: nn.Module,
        *,
        layer_cls: type[nn.Module],
        num_microbatches: int,
        schedule: str = "1f1b",
        chunks: int | None = None,
        group: dist.ProcessGroup | None = None,
        layer_ranges: Sequence[tuple[int, int]] | None = None,
        plan: Plan | None = None,
        input_names: Sequence[str] = ("input_ids", "attention_mask"),
        loss_fn: LossFn | None = None,
        num_items_fn: Callable[[torch.Tensor], torch.Tensor] = causal_lm_num_items,
        timeout: float = 300.0,
        device: torch.device | str | None = None,
        compile: bool = False,
        compile_options: dict | None = None,
        mesh: DeviceMesh | None = None,
        pp_dim: str = "pp",
        dp_dim: str = "dp",
        data_parallel: str = "replicate",
    ) -> None:
        if not dist.is_initialized():
            raise RuntimeError(
                "PipelineModel needs torch.distributed: call dist.init_process_group('gloo') "
                "first (torchrun sets the rendezvous)"
            )
        if not isinstance(num_microbatches, int) or num_microbatches < 1:
            raise ValueError(f"num_microbatches must be a positive int, got {num_microbatches!r}")
        trainable = _C.train_schedule_names()
        if schedule not in trainable:
            raise ValueError(f"schedule must be one of {trainable}, got {schedule!r}")
        if chunks is None:
            chunks = _C.default_chunks(schedule)
        if timeout <= 0:
            raise ValueError(f"timeout must be positive seconds, got {timeout}")
        self.mesh = mesh
        mesh_info = None
        if mesh is not None:
            mesh_info = mesh_groups(mesh, pp_dim, dp_dim, group)
            group = mesh_info.pp_group
            if compile:
                raise ValueError(
                    "compile=True with a data-parallel mesh is not supported yet; compile a "
                    "pipeline without mesh=..."
                )
        self.dp_rank = mesh_info.dp_rank if mesh_info else 0
        """This rank's replica (its coordinate on the mesh's data-parallel dimension)."""
        self.dp_size = mesh_info.dp_size if mesh_info else 1
        """How many pipeline replicas train together (1 without a mesh)."""
        self.group = group or dist.group.WORLD
        self._group_name = group_name_of(self.group)
        self._dp: DataParallel | None = None
        # See [Note: releasing the group at exit]: a mesh holds its dimensions' groups.
        release_at_exit(self, "group", "mesh", "_dp")
        self.rank = dist.get_rank(self.group)
        self.num_ranks = dist.get_world_size(self.group)
        self.num_stages = self.num_ranks * chunks
        self.num_microbatches = num_microbatches
        self.schedule = schedule
        self.input_names = list(input_names)
        self.device = resolve_device(device, self.group)
        self._num_items_fn = num_items_fn
        self._timeout_ms = int(timeout * 1000)

        self.layer_ranges, checkpoint_layers = resolve_layout(
            num_layers=len(find_layers(model, layer_cls)),
            num_ranks=self.num_ranks,
            chunks=chunks,
            schedule=schedule,
            num_microbatches=num_microbatches,
            layer_ranges=layer_ranges,
            plan=plan,
        )
        try:
            train_schedule = _C.make_schedule(schedule, self.num_ranks, num_microbatches, chunks)
        except RuntimeError as e:
            raise ValueError(str(e)) from None
        self.stages: list[StageGraph] = partition(
            model,
            layer_cls,
            self.layer_ranges,
            self.input_names,
            checkpoint_layers=checkpoint_layers,
        )
        self.local_stages = [self.stages[s] for s in train_schedule.stages_of(self.rank)]
        build_key = check_ranks_agree(
            self.stages,
            (schedule, num_microbatches, self.input_names),
            rank=self.rank,
            group=self.group,
            group_name=self._group_name,
            device=self.device,
            timeout_ms=self._timeout_ms,
        )

        self.loss_fn: LossFn = loss_fn if loss_fn is not None else default_loss(model)
        """The loss of one microbatch (the ``loss_fn`` argument or the HF model's own)."""
        tied = tied_names(model)  # before materializing replaces meta parameters
        materialize(model, self.local_stages, self.device)
        self._aliases = {n: names for names in tied for n in names}
        ties = local_ties(tied, self.stages, self.num_ranks, self.rank)
        for tie in ties:  # the owners start from the first owner's values
            params = self._local_params_named(tie.names)
            self._combine(tie, [p.data for p in params], add=False)
        if mesh_info is not None:
            self._dp = DataParallel(
                mesh_info,
                data_parallel,
                {st.index: st.module for st in self.local_stages},
                self._timeout_ms,
                self.device,
                build_key=build_key,
            )
        # After wrapping: FSDP replaces the parameters with its own (DTensors).
        self._ties = [(tie, self._local_params_named(tie.names)) for tie in ties]
        self.config = getattr(model, "config", None)
        """The model's config (written by :meth:`save_pretrained`), if it has one."""
        self.generation_config = getattr(model, "generation_config", None)

        name = self._group_name
        _INSTANCES[name] = _INSTANCES.get(name, 0) + 1
        self._abort = AbortChannel(name, _INSTANCES[name], self.rank)
        self._train_engine = _C.Engine(train_schedule, name, self._timeout_ms, str(self.device))
        self._eval_engine = _C.Engine(
            _C.make_schedule("forward", self.num_ranks, num_microbatches, chunks),
            name,
            self._timeout_ms,
            str(self.device),
        )
        self._last_engine = self._train_engine
        self._reduce_spans: list[tuple[str, int, int, int, int]] = []
        self._failed: PipelineError | None = None
        self._modules: dict[int, Callable] = {st.index: st.module for st in self.local_stages}
        self._compile_watch: RecompileWatch | None = None
        self.recompiles: list[str] = []
        """Explanations of the recompilations seen after each mode's first step."""
        if compile:
            self._modules = {
                st.index: torch.compile(st.module, **(compile_options or {}))
                for st in self.local_stages
            }
            self._compile_watch = RecompileWatch([st.module for st in self.local_stages])
        logger.info(
            "[rank %d] stages %s, layers %s, %d parameters",
            self.rank,
            [st.index for st in self.local_stages],
            [st.layers for st in self.local_stages],
            sum(p.numel() for _, p in self.named_parameters()),
        )

    # ----------------------------------------------------------------------------- building

    @property
    def stage(self) -> StageGraph:
        """The first (with one chunk per rank: the only) stage of this rank."""
        return self.local_stages[0]

    @property
    def module(self) -> torch.fx.GraphModule:
        """The graph module of :attr:`stage`."""
        return self.stage.module

    @property
    def checkpoint_group(self) -> dist.ProcessGroup:
        """The ranks that save and load checkpoints together: the pipeline's group, or with a
        mesh every rank of the mesh (the job). A property, not an attribute: the exit hook frees
        the group by dropping :attr:`group` (see [Note: releasing the group at exit])."""
        return dist.group.WORLD if self.mesh is not None else self.group

    @property
    def is_last(self) -> bool:
        """Whether this rank runs the last stage (and so holds the logits)."""
        return self.rank == self.last_rank

    @property
    def last_rank(self) -> int:
        """The rank that runs the last stage."""
        return _C.stage_rank(self.num_stages - 1, self.num_ranks)

    @property
    def engine(self) -> _C.Engine:
        """The C++ engine that runs training steps on this rank: its schedule, the last step's
        timings and the activation stash."""
        return self._train_engine

    def _combine(self, tie, tensors: list[torch.Tensor], add: bool) -> None:
        combine_among(
            tie,
            tensors,
            add=add,
            rank=self.rank,
            group_name=self._group_name,
            timeout_ms=self._timeout_ms,
        )

    def _local_params_named(self, names: Sequence[str]) -> list[nn.Parameter]:
        wanted = set(names)
        return [p for name, p in self.named_parameters() if name in wanted]

    # ----------------------------------------------------------------------------- parameters

    def named_parameters(self) -> Iterator[tuple[str, nn.Parameter]]:
        """The local stages' parameters under the original model's names (each once)."""
        seen = set()
        for st in self.local_stages:
            for stage_name, p in st.module.named_parameters(remove_duplicate=False):
                if id(p) in seen:
                    continue
                seen.add(id(p))
                yield st.param_names[stage_name], p

    def parameters(self) -> Iterator[nn.Parameter]:
        for _, p in self.named_parameters():
            yield p

    def state_dict(self, keep_vars: bool = False) -> dict[str, torch.Tensor]:
        """The local stage's parameters and persistent buffers under the original names (a tied
        weight under each local name)."""
        return {
            st.param_names[k]: v
            for st in self.local_stages
            for k, v in st.module.state_dict(keep_vars=keep_vars).items()
        }

    def aliases(self, name: str) -> list[str]:
        """Every name of the model's tensor ``name`` (several for tied weights), in model order:
        the first is the name HF checkpoints and plain models store it under."""
        return self._aliases.get(name, [name])

    def all_state_names(self) -> set[str]:
        """The state-dict keys of the whole model (every stage, every name of a tied weight)."""
        names = {st.param_names[k] for st in self.stages for k in st.module.state_dict()}
        return names | {a for n in list(names) for a in self.aliases(n)}

    def non_persistent_names(self) -> set[str]:
        """Buffers of the model that state dicts leave out (such as rotary ``inv_freq``)."""
        return {n for st in self.stages for n in st.param_names.values()} - self.all_state_names()

    def load_state_dict(self, state_dict: Mapping[str, torch.Tensor], strict: bool = True) -> None:
        """Loads this stage's entries from a full model's state dict; other stages' keys are
        ignored. A missing or mis-shaped key of this stage is an error naming it; with
        ``strict``, so is a key that belongs to no stage of the model."""
        if strict:
            known = self.all_state_names() | self.non_persistent_names()
            unknown = sorted(k for k in state_dict if k not in known)
            if unknown:
                raise KeyError(f"state_dict keys belong to no stage of this model: {unknown[:8]}")
        with torch.no_grad():
            for name, target in self.state_dict(keep_vars=True).items():
                source = next((state_dict[a] for a in self.aliases(name) if a in state_dict), None)
                if source is None:
                    raise KeyError(f"[rank {self.rank}] state_dict has no key '{name}'")
                if tuple(source.shape) != tuple(target.shape):
                    raise ValueError(
                        f"[rank {self.rank}] state_dict['{name}'] has shape "
                        f"{tuple(source.shape)}, the model expects {tuple(target.shape)}"
                    )
                assign(target, source)

    # ----------------------------------------------------------------------------- checkpoints

    def load_pretrained(self, path: str | os.PathLike) -> None:
        """Loads this rank's stage from a HF safetensors checkpoint directory (what
        ``save_pretrained`` writes), reading only the local tensors. See
        :func:`pippy_xla.checkpoint.load_pretrained`."""
        checkpoint.load_pretrained(self, path)

    def save_pretrained(
        self, path: str | os.PathLike, max_shard_size: int | str | None = None
    ) -> None:
        """Writes the model as a HF safetensors checkpoint, one shard (or more) per rank and one
        index; a collective. See :func:`pippy_xla.checkpoint.save_pretrained`."""
        checkpoint.save_pretrained(self, path, max_shard_size)

    def save(
        self,
        directory: str | os.PathLike,
        optimizer: torch.optim.Optimizer | None = None,
        step: int | None = None,
    ) -> Path:
        """Saves parameters, buffers, optimizer state and ``step`` with
        ``torch.distributed.checkpoint``, atomically; a collective. See
        :func:`pippy_xla.checkpoint.save`."""
        return checkpoint.save(self, directory, optimizer, step)

    def load(
        self, directory: str | os.PathLike, optimizer: torch.optim.Optimizer | None = None
    ) -> int | None:
        """Loads the latest checkpoint in ``directory`` (any rank count or schedule saved it);
        returns its step; a collective. See :func:`pippy_xla.checkpoint.load`."""
        return checkpoint.load(self, directory, optimizer)

    def train(self, mode: bool = True) -> PipelineModel:
        for st in self.local_stages:
            st.module.train(mode)
        return self

    def eval(self) -> PipelineModel:
        return self.train(False)

    def stage_of_layer(self, layer: int) -> int:
        """The stage that runs decoder layer ``layer``."""
        for st in self.stages:
            if layer in st.layers:
                return st.index
        raise IndexError(f"layer {layer} out of range: the model has {self.layer_ranges[-1][1]}")

    def layers_of_stage(self, stage: int) -> list[int]:
        return list(self.stages[stage].layers)

    # ----------------------------------------------------------------------------- running

    def _check_usable(self) -> None:
        if self._failed is not None:
            raise PipelineError(
                rank=self.rank,
                failed_rank=self._failed.failed_rank,
                action="step",
                cause=(
                    f"the pipeline failed in an earlier step and its peers were left mid-step "
                    f"({self._failed}); restart the job"
                ),
            )

    def _failure(self, exc: BaseException, action: str, engine=None) -> BaseException:
        """The error to raise for ``exc`` (see [Note: failing fast]); the pipeline is then
        unusable. Non-``Exception`` errors (``KeyboardInterrupt``) keep their type."""
        err = self._abort.error(exc, action, engine.failure() if engine is not None else None)
        self._failed = err
        if not isinstance(exc, Exception):
            return exc
        logger.error("%s", err)
        return err

    @contextmanager
    def _step_part(self, action: str):
        """Communication of a step outside the engine (collectives, tied weights): a failure is a
        :class:`PipelineError` like the engine's. (A peer's failure reaches a collective through
        the transport or the process group's timeout; only engine steps are aborted early.)"""
        try:
            yield
        except BaseException as e:
            err = self._failure(e, action)
            if err is e:
                raise
            raise err from e

    def _run_engine(self, engine, forward: _step.StageForward, signature: int) -> None:
        """Runs one step of ``engine`` for the batch of ``signature``."""
        # A split backward (B with retain_graph, then W) cannot use the buffers AOTAutograd
        # donates to a compiled backward: compile those stages without donation.
        split = self._compile_watch is not None and engine.schedule.split_backward
        donation = torch._functorch.config.patch(donated_buffer=False) if split else nullcontext()
        grads_ready = None
        self._reduce_spans.clear()
        if self._dp is not None and engine.schedule.backward:
            self._dp.before_step()
            grads_ready = self._reduce_stage
        try:
            with donation, self._abort.watch(engine):
                engine.run(signature, forward, grads_ready)
        except BaseException as e:
            err = self._failure(e, "step", engine)
            if err is e:
                raise
            raise err from e
        self._last_engine = engine
        if self._compile_watch is not None:
            mode = "train" if engine is self._train_engine else "eval"
            why = self._compile_watch.step_done(mode)
            if why:
                msg = f"[rank {self.rank}] stage recompiled: {why}"
                logger.warning("%s", msg)
                self.recompiles.append(msg)

    def _reduce_stage(self, stage: int) -> None:
        """The engine's ``grads_ready`` callback: reduces ``stage``'s gradients over the
        replicas, timed for :meth:`timings`."""
        start = time.time_ns()  # the engine's clock (system time)
        self._dp.reduce(stage)
        self._reduce_spans.append(("DP", stage, -1, start, time.time_ns()))

    def _prepare(self, batch: dict[str, torch.Tensor], need_labels: bool):
        """A step's batch checked and split, and its signature, agreed by every rank."""
        self._check_usable()
        batch, microbatches = split_batch(
            batch,
            input_names=self.input_names,
            num_microbatches=self.num_microbatches,
            need_labels=need_labels,
            device=self.device,
            dp_rank=self.dp_rank,
            dp_size=self.dp_size,
        )
        signature = batch_signature(batch)
        with self._step_part("batch signature all_gather"):
            everyone = gather_signatures(
                signature,
                rank=self.rank,
                group_name=self._group_name,
                device=self.device,
                timeout_ms=self._timeout_ms,
            )
        # A mismatch leaves the pipeline usable: no transfer of the step has started.
        check_same_signature(signature, everyone, batch, self.rank)
        return batch, microbatches, signature

    def _reduce_loss(self, losses: dict[int, torch.Tensor]) -> torch.Tensor:
        total = torch.zeros((), dtype=torch.float32, device=self.device)
        if self.is_last:
            total = torch.stack([losses[mb].float() for mb in sorted(losses)]).sum()
        with self._step_part("loss broadcast"):
            total = _C.broadcast_copy(
                total,
                self.last_rank,
                self._group_name,
                self._timeout_ms,
                f"[rank {self.rank}] loss broadcast",
            )
        if self._dp is not None:  # the replicas' shares add up to the global mean
            with self._step_part("loss all_reduce over replicas"):
                total = self._dp.all_reduce_sum(total, f"[rank {self.rank}] loss all_reduce")
        return total

    def run_train(self, **batch: torch.Tensor) -> torch.Tensor:
        """Runs forward and backward over the batch, microbatch by microbatch.

        Accumulates gradients into the local stage's parameters (call ``optimizer.step()`` and
        ``zero_grad()`` as usual) and returns the batch's mean loss on every rank, reduced as the
        unwrapped model reduces it. With a mesh, ``batch`` is the global batch: each replica
        trains on its share, and the loss and gradients are those of the global batch.
        """
        if not torch.is_grad_enabled():
            raise RuntimeError("run_train was called under torch.no_grad(); use run_eval instead")
        batch, microbatches, signature = self._prepare(batch, need_labels=True)
        losses: dict[int, torch.Tensor] = {}
        forward = _step.stage_forward(
            self.stages,
            self._modules,
            microbatches=microbatches,
            labels=microbatches["labels"],
            num_items=self._num_items_fn(batch["labels"]).to(self.device),
            loss_fn=self.loss_fn,
            losses=losses,
            logits=None,
            watch=self._compile_watch,
        )
        self._run_engine(self._train_engine, forward, signature)
        with self._step_part("tied-weight gradient sum"):
            for tie, params in self._ties:
                grads = [local_tensor(p.grad) for p in params if p.grad is not None]
                self._combine(tie, grads, add=True)
        return self._reduce_loss(losses)

    @torch.no_grad()
    def run_eval(self, **batch: torch.Tensor) -> EvalOutput:
        """Forward only. Returns the batch's logits on the last stage and, given labels, its
        mean loss on every rank."""
        batch, microbatches, signature = self._prepare(batch, need_labels=False)
        labels = microbatches.get("labels")
        num_items = None
        if labels is not None:
            num_items = self._num_items_fn(batch["labels"]).to(self.device)
        losses: dict[int, torch.Tensor] = {}
        logits: dict[int, torch.Tensor] = {}
        forward = _step.stage_forward(
            self.stages,
            self._modules,
            microbatches=microbatches,
            labels=labels,
            num_items=num_items,
            loss_fn=self.loss_fn,
            losses=losses,
            logits=logits,
            watch=self._compile_watch,
        )
        self._run_engine(self._eval_engine, forward, signature)
        if self._dp is not None:
            self._dp.after_eval()
        all_logits = torch.cat([logits[mb] for mb in sorted(logits)]) if self.is_last else None
        loss = self._reduce_loss(losses) if labels is not None else None
        return EvalOutput(loss=loss, logits=all_logits)

    # ----------------------------------------------------------------------------- introspection

    def timings(self) -> list[tuple[str, int, int, int, int]]:
        """The last step's actions on this rank: ``(op, stage, microbatch, start_ns, end_ns)``,
        in system-clock nanoseconds. With a mesh, each stage's data-parallel gradient reduction
        is there too, as op ``"DP"`` with microbatch -1."""
        measured = [
            (t.op, t.stage, t.mb, t.start_ns, t.end_ns) for t in self._last_engine.timings()
        ]
        return measured + self._reduce_spans

    def timeline(self, json_path: str | None = None, png_path: str | None = None) -> list:
        """Gathers the last step's measured actions of every rank (a collective: call it on all
        ranks) and, on the pipeline's first rank, writes a Chrome/Perfetto trace (``json_path``)
        and a Gantt chart (``png_path``). Returns the merged events
        ``(rank, op, stage, microbatch, start_s, end_s)`` on every rank."""
        from pippy_xla import viz

        mine = [(self.rank, op, s, mb, t0 / 1e9, t1 / 1e9) for op, s, mb, t0, t1 in self.timings()]
        everyone: list = [None] * self.num_ranks
        dist.all_gather_object(everyone, mine, group=self.group)
        events = sorted((e for rank_events in everyone for e in rank_events), key=lambda e: e[4])
        if self.rank == 0:
            title = f"{self.schedule}: {self.num_ranks} ranks, {self.num_microbatches} microbatches"
            if json_path:
                viz.write_chrome_trace(events, json_path)
            if png_path:
                viz.draw_timeline(events, png_path, title=title)
        return events

    @property
    def stash_peak_bytes(self) -> int:
        """Most bytes the activation stash held at once since the last ``reset_stash_peak``."""
        return self._train_engine.stash_peak_bytes

    @property
    def stash_live_bytes(self) -> int:
        """Bytes the activation stash holds now (0 between steps)."""
        return self._train_engine.stash_live_bytes

    def reset_stash_peak(self) -> None:
        """Sets :attr:`stash_peak_bytes` to the bytes held now."""
        self._train_engine.reset_stash_peak()
