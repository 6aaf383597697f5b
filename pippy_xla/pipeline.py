"""``PipelineModel``: wrap an unmodified model and train it pipeline-parallel.

Every rank of the process group traces and partitions the whole model (on whatever device it
lives, ``meta`` included), keeps only its own stage, and hands that stage to the C++ engine
(``pippy_xla._C.Engine``), which runs the schedule's actions every step.
"""

from __future__ import annotations

import atexit
import hashlib
import logging
import os
import sys
import time
import types
import weakref
import zlib
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch import nn

from pippy_xla import _C, checkpoint, ops
from pippy_xla.data_parallel import DataParallel, assign, local_tensor, mesh_groups
from pippy_xla.errors import AbortChannel, BatchMismatchError, PipelineError
from pippy_xla.materialize import materialize
from pippy_xla.ops import group_name_of
from pippy_xla.partition import StageGraph, find_layers, partition
from pippy_xla.planner import Plan

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

__all__ = ["PipelineModel", "EvalOutput", "balanced_ranges"]

logger = logging.getLogger(__name__)

LossFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]

_MAX_DIMS = 8
# PipelineModels built so far per process group: the same count on every rank (building is
# collective), so it names one pipeline in the shared store. See [Note: failing fast].
_INSTANCES: dict[str, int] = {}
# Tags of tied-weight transfers: above every engine tag (see Engine::tag in csrc/engine.cpp).
_TIE_TAG = 1 << 30
# Every PipelineModel alive in this process, for _release_groups_at_exit.
_LIVE: weakref.WeakSet = weakref.WeakSet()


@atexit.register
def _release_groups_at_exit() -> None:
    """[Note: releasing the group at exit] A pipeline alive at exit (a global, or a local kept by
    an exception's traceback) keeps its process group, and with it gloo's worker threads, alive
    into interpreter finalization even after ``destroy_process_group``. A worker thread that then
    lets go of a Python tensor from an earlier collective (the user's own ``all_gather_object``,
    say) takes the GIL during finalization and the process dies with SIGABRT (see [Note:
    collectives on C++-owned buffers] in csrc/ops/p2p.h). Dropping the pipelines' references
    here, while the interpreter is still whole, lets a destroyed group's threads finish and
    exit now. A group the program never destroyed stays alive; that one is torch's to tear down."""
    for pipe in list(_LIVE):
        pipe.group = None
        pipe.mesh = pipe._dp = None  # a mesh holds its dimensions' groups
    _release_stale_default_groups()


def _release_stale_default_groups() -> None:
    """[Note: groups bound as default arguments] Some ``torch.distributed`` modules bind the
    default group as a default argument (``def all_reduce(tensor, ..., group=group.WORLD)`` in
    ``torch.distributed.nn.functional``, which ``transformers`` imports through FSDP's sharded
    tensors). Imported after ``init_process_group``, each such default holds the group, so
    ``destroy_process_group`` frees nothing and the group, with gloo's worker threads, lives into
    interpreter finalization: the [Note: releasing the group at exit] crash, with no pipeline
    involved. A group held this way that is no longer the default one is replaced by ``None``
    (which those functions read as the default group), so it is freed here, before
    finalization."""
    if not dist.is_available():
        return
    world = dist.group.WORLD if dist.is_initialized() else None

    def stale(value) -> bool:
        return isinstance(value, dist.ProcessGroup) and value is not world

    def fix(fn) -> None:
        if type(fn) in (staticmethod, classmethod):
            fn = fn.__func__
        if type(fn) is not types.FunctionType:  # type(), not isinstance: no __getattribute__
            return
        if fn.__defaults__ and any(stale(d) for d in fn.__defaults__):
            fn.__defaults__ = tuple(None if stale(d) else d for d in fn.__defaults__)
        if fn.__kwdefaults__ and any(stale(d) for d in fn.__kwdefaults__.values()):
            fn.__kwdefaults__ = {k: None if stale(d) else d for k, d in fn.__kwdefaults__.items()}

    for name, module in list(sys.modules.items()):
        if module is None or not name.startswith("torch.distributed"):
            continue
        for value in list(vars(module).values()):
            if issubclass(type(value), type):
                for attr in list(vars(value).values()):
                    fix(attr)
            else:
                fix(value)


@dataclass(kw_only=True, slots=True)
class EvalOutput:
    """What :meth:`PipelineModel.run_eval` returns."""

    loss: torch.Tensor | None
    """The batch's mean loss on every rank, if labels were given."""
    logits: torch.Tensor | None
    """The whole batch's logits on the last stage's rank, ``None`` elsewhere (with a mesh: the
    logits of this replica's share of the batch)."""


def balanced_ranges(num_layers: int, num_stages: int) -> list[tuple[int, int]]:
    """Contiguous layer ranges whose sizes differ by at most one (earlier stages get more)."""
    if num_stages > num_layers:
        raise ValueError(
            f"cannot split {num_layers} decoder layers into {num_stages} stages: every stage "
            f"needs at least one layer; use at most {num_layers} ranks"
        )
    base, extra = divmod(num_layers, num_stages)
    ranges, start = [], 0
    for s in range(num_stages):
        stop = start + base + (1 if s < extra else 0)
        ranges.append((start, stop))
        start = stop
    return ranges


def _hf_causal_lm_loss(model: nn.Module) -> LossFn:
    loss_function = model.loss_function
    vocab_size = model.config.vocab_size

    def loss_fn(logits: torch.Tensor, labels: torch.Tensor, num_items: torch.Tensor):
        return loss_function(
            logits=logits, labels=labels, vocab_size=vocab_size, num_items_in_batch=num_items
        )

    return loss_fn


def _causal_lm_num_items(labels: torch.Tensor) -> torch.Tensor:
    # HF causal-LM losses shift labels left by one and ignore -100.
    return (labels[..., 1:] != -100).sum()


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
        num_items_fn: Callable[[torch.Tensor], torch.Tensor] = _causal_lm_num_items,
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
        trainable = [n for n in _C.schedule_names() if n != "forward"]
        if schedule not in trainable:
            raise ValueError(f"schedule must be one of {trainable}, got {schedule!r}")
        if chunks is None:
            chunks = 2 if schedule == "interleaved" else 1
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
        _LIVE.add(self)
        self.rank = dist.get_rank(self.group)
        self.num_ranks = dist.get_world_size(self.group)
        self.num_stages = self.num_ranks * chunks
        self.num_microbatches = num_microbatches
        self.schedule = schedule
        self.input_names = list(input_names)
        self.device = _resolve_device(device, self.group)
        self._num_items_fn = num_items_fn
        self._timeout_ms = int(timeout * 1000)

        num_layers = len(find_layers(model, layer_cls))
        checkpoint_layers: list[int] = []
        if plan is not None:
            if layer_ranges is not None:
                raise ValueError("pass either plan=... or layer_ranges=..., not both")
            made_for = (plan.schedule, plan.num_microbatches)
            if made_for != (schedule, num_microbatches):
                raise ValueError(
                    f"the plan was made for schedule {plan.schedule!r} with "
                    f"{plan.num_microbatches} microbatches, but this pipeline runs {schedule!r} "
                    f"with {num_microbatches}: activations in flight differ, so its memory "
                    f"prediction would not hold; plan with schedule={schedule!r}, "
                    f"num_microbatches={num_microbatches}"
                )
            if plan.num_stages != self.num_stages:
                raise ValueError(
                    f"the plan has {plan.num_stages} stages but this pipeline has "
                    f"{self.num_stages} ({self.num_ranks} ranks x {chunks} chunks); plan for "
                    f"{self.num_stages}"
                )
            layer_ranges = plan.layer_ranges
            checkpoint_layers = plan.checkpoint_layers
        if schedule == "interleaved" and num_layers % self.num_stages:
            raise ValueError(
                f"schedule 'interleaved' with {chunks} chunks on {self.num_ranks} ranks needs the "
                f"{num_layers} decoder layers to divide into {self.num_stages} equal stages; "
                "choose chunks so that ranks x chunks divides the layer count"
            )
        try:
            train_schedule = _C.make_schedule(schedule, self.num_ranks, num_microbatches, chunks)
        except RuntimeError as e:
            raise ValueError(str(e)) from None
        if layer_ranges is None:
            layer_ranges = balanced_ranges(num_layers, self.num_stages)
        elif len(layer_ranges) != self.num_stages:
            raise ValueError(
                f"layer_ranges has {len(layer_ranges)} stages but the process group has "
                f"{self.num_ranks} ranks x {chunks} chunks = {self.num_stages} stages"
            )
        self.layer_ranges = [tuple(r) for r in layer_ranges]
        self.stages: list[StageGraph] = partition(
            model,
            layer_cls,
            self.layer_ranges,
            self.input_names,
            checkpoint_layers=checkpoint_layers,
        )
        self.local_stages = [st for st in self.stages if st.index % self.num_ranks == self.rank]
        build_key = self._check_ranks_agree(schedule)

        if loss_fn is None:
            if not hasattr(model, "loss_function") or not hasattr(model, "config"):
                raise ValueError(
                    f"{type(model).__name__} has no HF loss_function; pass loss_fn=..."
                )
            loss_fn = _hf_causal_lm_loss(model)
        self._loss_fn = loss_fn
        tied_names = _tied_names(model)  # before materializing replaces meta parameters
        materialize(model, self.local_stages, self.device)
        self._aliases = {n: names for names in tied_names for n in names}
        ties = self._tie(tied_names)
        self._dp: DataParallel | None = None
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
        self._ties = [(owners, self._local_params_named(names)) for owners, names in ties]
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
        self._compiled: dict[int, Callable] | None = None
        self.recompiles: list[str] = []
        """Explanations of the recompilations seen after each mode's first step."""
        if compile:
            self._compiled = {
                st.index: torch.compile(st.module, **(compile_options or {}))
                for st in self.local_stages
            }
            self._compile_watch = _RecompileWatch([st.module for st in self.local_stages])
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
        return (self.num_stages - 1) % self.num_ranks

    def _check_ranks_agree(self, schedule: str) -> int:
        """Build-time handshake: every rank must have built the same partition and settings.
        Returns the 64-bit digest of them (a mesh's replicas compare it too)."""
        digest = hashlib.sha256()
        for st in self.stages:
            digest.update(st.code.encode())
            digest.update(repr(sorted(st.param_names.items())).encode())
        mine = (digest.hexdigest(), schedule, self.num_microbatches, self.input_names)
        key = _digest64(repr(mine).encode())
        keys = _C.all_gather_int64(
            key,
            self._group_name,
            str(self.device),
            self._timeout_ms,
            f"[rank {self.rank}] build handshake",
        )
        if all(k == key for k in keys):
            return key
        everyone: list = [None] * self.num_ranks  # only to say what differs
        dist.all_gather_object(everyone, mine, group=self.group)
        for r, theirs in enumerate(everyone):
            if theirs != mine:
                raise RuntimeError(
                    f"[rank {self.rank}] rank {r} built a different pipeline: (graph digest, "
                    f"schedule, microbatches, inputs) = {theirs} here {mine}; every rank must "
                    "wrap the same model with the same arguments"
                )
        return key

    def _tie(self, tied_names: list[list[str]]) -> list[tuple[list[int], list[str]]]:
        """Parameters shared by several stages (tied embeddings): their values start equal (the
        first owner's) and their gradients are summed over the owners every step. Returns the
        (owner ranks, names) of the ties this rank takes part in."""
        ties = []
        for names in tied_names:
            stages = [st.index for st in self.stages if set(names) & set(st.param_names.values())]
            owners = sorted({s % self.num_ranks for s in stages})
            if len(owners) < 2 or self.rank not in owners:
                continue
            ties.append((owners, names))
        for i, (owners, names) in enumerate(ties):
            params = self._local_params_named(names)
            self._combine_among(owners, [p.data for p in params], _TIE_TAG + 2 * i, add=False)
        return ties

    def _combine_among(self, owners: list[int], tensors: list[torch.Tensor], tag: int, add: bool):
        """Makes ``tensors`` equal on all ``owners`` (ranks of this pipeline's group): the first
        owner's values, or with ``add`` their sum, added in owner order so every owner gets the
        same bits. Point-to-point over the pipeline group, through the ``pippy_xla`` ops."""
        name, first = self._group_name, owners[0]
        timeout = self._timeout_ms
        with torch.no_grad():
            for t in tensors:
                if self.rank == first:
                    if add:
                        for r in owners[1:]:
                            t += ops.recv_wait(
                                t.shape, t.dtype, r, tag, name, t.device, None, timeout
                            )
                    for r in owners[1:]:
                        ops.send_wait(t.contiguous(), r, tag + 1, name, timeout)
                else:
                    if add:
                        ops.send_wait(t.contiguous(), first, tag, name, timeout)
                    t.copy_(
                        ops.recv_wait(
                            t.shape, t.dtype, first, tag + 1, name, t.device, None, timeout
                        )
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

    def _run_engine(self, engine, forward) -> None:
        self._check_usable()
        # A split backward (B with retain_graph, then W) cannot use the buffers AOTAutograd
        # donates to a compiled backward: compile those stages without donation.
        split = self._compiled is not None and engine.schedule.split_backward
        donation = torch._functorch.config.patch(donated_buffer=False) if split else nullcontext()
        grads_ready = None
        self._reduce_spans.clear()
        if self._dp is not None and engine.schedule.backward:
            self._dp.before_step()
            grads_ready = self._reduce_stage
        try:
            with donation, self._abort.watch(engine):
                engine.run(self._signature, forward, grads_ready)
        except BaseException as e:
            err = self._failure(e, "step", engine)
            if err is e:
                raise
            raise err from e
        self._last_engine = engine
        if self._compiled is not None:
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

    def _split_batch(self, batch: dict[str, torch.Tensor], need_labels: bool):
        self._check_usable()
        if need_labels and "labels" not in batch:
            raise ValueError("run_train needs labels=...")
        unknown = sorted(k for k in batch if k not in self.input_names and k != "labels")
        if unknown:
            raise ValueError(
                f"unexpected batch inputs {unknown}; this pipeline takes {self.input_names} and "
                "labels (set input_names=... when wrapping the model)"
            )
        batch = {k: v for k, v in batch.items() if v is not None}
        first = self.input_names[0]
        if first not in batch:
            raise ValueError(f"the batch needs '{first}'")
        if "attention_mask" in self.input_names and "attention_mask" not in batch:
            batch["attention_mask"] = torch.ones_like(batch[first])
        missing = [n for n in self.input_names if n not in batch]
        if missing:
            raise ValueError(f"the batch lacks {missing}")
        for k, v in batch.items():
            if not isinstance(v, torch.Tensor):
                raise TypeError(f"batch['{k}'] must be a tensor, got {type(v).__name__}")
        size = batch[first].shape[0]
        for k, v in batch.items():
            if v.dim() == 0 or v.shape[0] != size:
                raise ValueError(
                    f"batch['{k}'] has shape {tuple(v.shape)}; every input needs batch size "
                    f"{size} (that of '{first}') in dim 0"
                )
        m, dp = self.num_microbatches, self.dp_size
        if size % (m * dp) != 0:
            what = f"num_microbatches={m}"
            if dp > 1:
                what = f"data-parallel size {dp} x num_microbatches={m} = {dp * m}"
            raise ValueError(
                f"batch size {size} is not divisible by {what}; use a batch size that is a "
                f"multiple of {m * dp}"
            )
        self._agree_on_signature(batch)
        share = size // dp  # this replica's rows: see [Note: pipeline x data parallel]
        rows = slice(self.dp_rank * share, (self.dp_rank + 1) * share)
        return batch, {k: v[rows].to(self.device).chunk(m) for k, v in batch.items()}

    def _agree_on_signature(self, batch: dict[str, torch.Tensor]) -> None:
        """Per-step handshake: every rank must see the same batch shapes and dtypes, or the
        boundary transfers would disagree. One all_gather of a 64-bit digest of the batch's
        names, shapes and dtypes, before any point-to-point."""
        names = sorted(batch)
        rows = []
        for k in names:
            v = batch[k]
            if v.dim() > _MAX_DIMS:
                raise ValueError(f"batch['{k}'] has {v.dim()} dims; at most {_MAX_DIMS}")
            dims = list(v.shape) + [-1] * (_MAX_DIMS - v.dim())
            rows.append([zlib.crc32(k.encode()), _dtype_code(v.dtype), v.dim(), *dims])
        self._signature = _digest64(torch.tensor(rows, dtype=torch.long).numpy().tobytes())
        with self._step_part("batch signature all_gather"):
            everyone = _C.all_gather_int64(
                self._signature,
                self._group_name,
                str(self.device),
                self._timeout_ms,
                f"[rank {self.rank}] batch signature all_gather",
            )
        for r, theirs in enumerate(everyone):
            if theirs != self._signature:
                describe = {k: (tuple(batch[k].shape), batch[k].dtype) for k in names}
                raise BatchMismatchError(
                    rank=self.rank,
                    failed_rank=self.rank,
                    peer=r,
                    action="batch signature check",
                    cause=(
                        f"rank {r} got a batch with other inputs, shapes or dtypes than this "
                        f"rank's {describe}; every rank must get the same batch shapes (the "
                        "whole batch goes to every rank)"
                    ),
                )

    def _stage_forward(self, mbs, labels, num_items, losses: dict, logits: dict | None):
        """The callable the engine runs for each forward action. The last stage applies the loss
        (when there are labels) and records the detached microbatch losses (and, for
        evaluation, the logits) into ``losses`` / ``logits``."""
        last = self.num_stages - 1
        modules = self._compiled or {st.index: st.module for st in self.local_stages}

        def forward(stage: int, mb: int, inputs: list[torch.Tensor]) -> list[torch.Tensor]:
            st = self.stages[stage]
            args = [*[mbs[n][mb] for n in st.batch_inputs], *inputs]
            if self._compiled is not None:
                self._compile_watch.see(stage, args)
            out = modules[stage](*args)
            if stage != last:
                return list(out)
            if logits is not None:
                logits[mb] = out[0]
            if labels is None:
                return []
            loss = self._loss_fn(out[0], labels[mb], num_items)
            losses[mb] = loss.detach()
            return [loss]

        return forward

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
        batch, mbs = self._split_batch(batch, need_labels=True)
        labels = mbs["labels"]
        num_items = self._num_items_fn(batch["labels"]).to(self.device)
        losses: dict[int, torch.Tensor] = {}
        forward = self._stage_forward(mbs, labels, num_items, losses, None)
        self._run_engine(self._train_engine, forward)
        with self._step_part("tied-weight gradient sum"):
            for i, (owners, params) in enumerate(self._ties):
                grads = [local_tensor(p.grad) for p in params if p.grad is not None]
                self._combine_among(owners, grads, _TIE_TAG + 2 * i, add=True)
        return self._reduce_loss(losses)

    @torch.no_grad()
    def run_eval(self, **batch: torch.Tensor) -> EvalOutput:
        """Forward only. Returns the batch's logits on the last stage and, given labels, its
        mean loss on every rank."""
        batch, mbs = self._split_batch(batch, need_labels=False)
        labels = mbs.get("labels")
        num_items = None
        if labels is not None:
            num_items = self._num_items_fn(batch["labels"]).to(self.device)
        losses: dict[int, torch.Tensor] = {}
        logits: dict[int, torch.Tensor] = {}
        forward = self._stage_forward(mbs, labels, num_items, losses, logits)
        self._run_engine(self._eval_engine, forward)
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
        return self._last_engine.timings() + self._reduce_spans

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
        return self._train_engine.stash_live_bytes

    def reset_stash_peak(self) -> None:
        self._train_engine.reset_stash_peak()


def _digest64(data: bytes) -> int:
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little", signed=True)


class _RecompileWatch:
    """Notices recompilations of a compiled stage after the first step of each mode and says
    why: dynamo's guard failures plus which stage input changed shape, dtype or grad mode.

    It counts dynamo's cache entries of the stage graphs' own ``forward`` code (each fx
    GraphModule has its own), so other compiled code in the process does not count."""

    def __init__(self, modules: list[nn.Module]) -> None:
        self._codes = [m.forward.__code__ for m in modules]
        self._graphs: dict[str, int] = {}
        self._first_args: dict[str, dict[int, list[str]]] = {}
        self._step_args: dict[int, list[str]] = {}

    def _graph_count(self) -> int:
        from torch._dynamo.eval_frame import _debug_get_cache_entry_list

        return sum(len(_debug_get_cache_entry_list(code)) for code in self._codes)

    def see(self, stage: int, args: list) -> None:
        if stage in self._step_args:  # once per stage and step
            return
        self._step_args[stage] = [
            f"{str(a.dtype).removeprefix('torch.')}{list(a.shape)}"
            + (" requires_grad" if a.requires_grad else "")
            if isinstance(a, torch.Tensor)
            else repr(a)
            for a in args
        ]

    def step_done(self, mode: str) -> str | None:
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


def _resolve_device(device: torch.device | str | None, group) -> torch.device:
    """The pipeline's device: checked against the group's backend (gloo moves CPU tensors, NCCL
    CUDA tensors) and the machine."""
    backend = str(dist.get_backend(group)).lower()
    if device is None:
        if "nccl" in backend:
            return _resolve_device(f"cuda:{int(os.environ.get('LOCAL_RANK', 0))}", group)
        return torch.device("cpu")
    device = torch.device(device)
    if device.type == "cuda":
        if "nccl" not in backend:
            raise ValueError(
                f"device={str(device)!r} needs an NCCL process group (the pipeline sends CUDA "
                f"tensors point to point), but the group's backend is {backend!r}; use "
                "dist.init_process_group('nccl') or device='cpu'"
            )
        if not torch.cuda.is_available():
            raise ValueError(f"device={str(device)!r} but CUDA is not available on this machine")
        count = torch.cuda.device_count()
        index = torch.cuda.current_device() if device.index is None else device.index
        if not 0 <= index < count:
            raise ValueError(
                f"device={str(device)!r} does not exist: this machine has {count} CUDA "
                f"device(s), cuda:0 to cuda:{count - 1}; under torchrun use cuda:LOCAL_RANK"
            )
        torch.cuda.set_device(index)
        return torch.device("cuda", index)
    if device.type == "cpu":
        if "gloo" not in backend:
            raise ValueError(
                f"device='cpu' needs a gloo process group, but the group's backend is "
                f"{backend!r} (NCCL moves CUDA tensors only); pass device='cuda:LOCAL_RANK' or "
                "use dist.init_process_group('gloo')"
            )
        return device
    raise ValueError(f"device type {device.type!r} is not supported; use 'cpu' or 'cuda'")


def _tied_names(model: nn.Module) -> list[list[str]]:
    """Groups of names under which one parameter appears more than once, sorted."""
    names_of: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        names_of.setdefault(id(p), []).append(name)
    return sorted(names for names in names_of.values() if len(names) > 1)


def _dtype_code(dtype: torch.dtype) -> int:
    return zlib.crc32(str(dtype).encode())
