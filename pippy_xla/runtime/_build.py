"""Building a pipeline: :func:`build` turns a model and a :class:`~pippy_xla.config.PipelineConfig`
into this rank's :class:`BuiltPipeline` (its stages, ready to run), one decision per function.

Order: the placement (:func:`resolve_placement`: process groups, ranks, device) -> the stage
layout (:func:`resolve_layout`) -> the schedule -> tracing and partitioning -> the handshake that
every rank built the same pipeline (:func:`check_ranks_agree`) -> the pipeline's own group
(:func:`own_group`) -> the transport (:func:`attach_transport`) -> materializing the local
stages -> tied weights across ranks -> data parallelism (with a mesh) -> engines and compiled
stages.
"""

from __future__ import annotations

import datetime
import hashlib
import inspect
import logging
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch import nn

from pippy_xla._native import _C
from pippy_xla.runtime import context_parallel
from pippy_xla.runtime._batch import RowShares, digest64
from pippy_xla.runtime._recompile import RecompileWatch
from pippy_xla.runtime._state import params_named
from pippy_xla.runtime._ties import Tie, combine_among, local_ties, tied_names, untie_local_copies
from pippy_xla.runtime.context_parallel import ContextParallel
from pippy_xla.runtime.data_parallel import DataParallel, MeshGroups, dims_text, mesh_groups
from pippy_xla.runtime.expert_parallel import ExpertParallel, layer_ep_plan
from pippy_xla.runtime.failures import AbortChannel, check_mesh_usable
from pippy_xla.runtime.ops import group_name_of
from pippy_xla.runtime.tensor_parallel import TensorParallel, layer_tp_plan
from pippy_xla.split._split_compile import split_backward_backend
from pippy_xla.split.hf import loss_owner, ragged_inputs, text_vocab_size
from pippy_xla.split.materialize import materialize
from pippy_xla.split.partition import (
    LayerCls,
    StageGraph,
    UnsupportedModelError,
    find_layers,
    layer_classes,
    partition,
)

if TYPE_CHECKING:  # the runtime reads the config it is given; config.py sits above the wings
    from torch.distributed.device_mesh import DeviceMesh

    from pippy_xla.config import LossFn, PipelineConfig

__all__ = [
    "BuiltPipeline",
    "attach_transport",
    "Placement",
    "build",
    "check_ranks_agree",
    "own_group",
    "default_loss",
    "resolve_device",
    "resolve_placement",
    "resolve_layout",
]

logger = logging.getLogger(__name__)

# Pipelines built so far per process group: the same count on every rank (building is
# collective), so it names one pipeline in the shared store. See [Note: failing fast].
_INSTANCES: dict[str, int] = {}


@dataclass(kw_only=True, eq=False)  # no slots, identity hash: the exit hook keeps a weakref
class Placement:
    """Where a pipeline runs: its process groups, this rank's place in them, its device."""

    group: dist.ProcessGroup | None
    """The pipeline's process group (with a mesh: its pipeline dimension); ``None`` once the exit
    hook let go of it (see [Note: releasing the group at exit])."""
    group_name: str
    """``group``'s name, by which the C++ side resolves it."""
    mesh: MeshGroups | None
    """The mesh's groups and this rank's coordinates on it, with a mesh."""
    rank: int
    """This rank in ``group``."""
    num_ranks: int
    """Ranks in ``group``."""
    device: torch.device
    """Where the local stages and every buffer the runtime allocates live."""
    timeout_ms: int
    """How long any single wait on a peer may take."""
    in_order: _C.InOrderGroups | None = None
    """The up, down and header groups where transfers are matched in posting order (see
    :func:`in_order_groups`); ``None`` where they are matched by tag."""
    cp: ContextParallel | None = None
    """The tokens' shares over the mesh's context-parallel dimension, on a mesh with one
    (``mesh`` is then ``None``: see [Note: pipeline x context parallel])."""

    def engine(self, schedule: _C.Schedule) -> _C.Engine:
        """A C++ engine running ``schedule`` on this placement."""
        return _C.Engine(
            schedule, self.group_name, self.timeout_ms, str(self.device), in_order=self.in_order
        )

    @property
    def handshake(self) -> _C.HeaderChannel:
        """The group and device of the step's handshake: those of the engine's boundary headers
        (``_C.header_channel``, which decides them)."""
        return _C.header_channel(self.group_name, str(self.device), self.in_order)

    @property
    def nccl(self) -> bool:
        """Whether the pipeline's group runs NCCL (which matches transfers by order, not tag)."""
        return "nccl" in dist.get_backend(self.group or dist.group.WORLD)

    @property
    def dp_rank(self) -> int:
        return self.mesh.dp_rank if self.mesh is not None else 0

    @property
    def dp_size(self) -> int:
        return self.mesh.dp_size if self.mesh is not None else 1

    @property
    def tp_rank(self) -> int:
        return self.mesh.tp_rank if self.mesh is not None else 0

    @property
    def tp_size(self) -> int:
        return self.mesh.tp_size if self.mesh is not None else 1


@dataclass(kw_only=True, slots=True)
class BuiltPipeline:
    """What :func:`build` returns: this rank's stages of the pipeline, ready to run."""

    place: Placement
    """The process groups, ranks and device."""
    layer_ranges: list[tuple[int, int]]
    """Every stage's decoder-layer range."""
    stages: list[StageGraph]
    """Every stage's graph (only the local ones' tensors are materialized)."""
    local_stages: list[StageGraph]
    """This rank's stages, ascending."""
    runners: dict[int, Callable]
    """What runs each local stage: its graph module, or the compiled one."""
    train_engine: _C.Engine
    """The C++ engine of training steps."""
    eval_engine: _C.Engine
    """The C++ engine of forward-only steps."""
    ties: list[tuple[Tie, list[nn.Parameter]]]
    """Tied weights held by this rank and another, with this rank's parameters of each."""
    aliases: dict[str, list[str]]
    """Every name of a tied tensor -> all its names, in model order."""
    dp: DataParallel | None
    """The stage replicas' gradient reduction, with a mesh (``None`` under tensor parallelism
    with one replica)."""
    tp: TensorParallel | None
    """The local decoder layers' sharding over the mesh's tensor-parallel dimension (``None``
    without one, or of size 1)."""
    ep: ExpertParallel | None
    """The local experts' sharding over their expert group (``None`` without
    ``expert_parallel``)."""
    loss_fn: LossFn
    """The loss of one microbatch."""
    num_items_fn: Callable[[torch.Tensor], torch.Tensor]
    """The whole batch's count of what ``loss_fn`` averages over."""
    label_rows: int | None
    """The vocabulary the model's own loss reads the labels against (``None`` with a user
    ``loss_fn``): the step checks the labels against it."""
    ragged: RowShares | None
    """The rows' shares of the batch inputs whose dim 0 is not the rows (see [Note: images
    concatenated over a batch] in ``split/hf.py``); ``None`` for a model that takes none."""
    abort: AbortChannel
    """This pipeline's abort record in the job's store (see [Note: failing fast])."""
    compile_watch: RecompileWatch | None
    """Explains recompilations of compiled stages."""


def build(
    model: nn.Module,
    layer_cls: LayerCls,
    config: PipelineConfig,
    *,
    group: dist.ProcessGroup | None = None,
    mesh: DeviceMesh | None = None,
) -> BuiltPipeline:
    """Partitions ``model`` and builds this rank's stages of it; a collective over the pipeline's
    ranks (and the replicas, with a mesh). A configuration that does not fit the model or the
    process groups is a ``ValueError`` before any stage is materialized."""
    place = resolve_placement(config, group, mesh)
    check_plan_tp(config, place)
    loss_fn = config.loss_fn if config.loss_fn is not None else default_loss(model)
    num_items_fn = config.num_items_fn or default_num_items(model)
    layer_names = find_layers(model, layer_classes(model, layer_cls))
    tp_plan, ep_plan = _plans(model, layer_names, config, place)
    layer_ranges, stages, train_schedule = _partition(model, layer_cls, config, place)
    local_stages = [stages[s] for s in train_schedule.stages_of(place.rank)]
    build_key = check_ranks_agree(stages, config, place, tp_plan, ep_plan)
    own_group(place)
    attach_transport(config, place)
    place.in_order = in_order_groups(config, place, train_schedule.stage_rank)
    tied = tied_names(model)  # before materializing replaces meta parameters
    materialize(model, local_stages, place.device)
    if place.mesh is not None:  # [Note: a copy per stage on a mesh]
        untie_local_copies(tied, local_stages)
    ties = _tie_weights(tied, stages, local_stages, train_schedule.stage_rank, place)
    modules = {st.index: st.module for st in local_stages}
    experts = [k for k, v in (ep_plan or {}).items() if v == "ep_dispatch_experts"]
    tp = _tensor_parallel(model, tp_plan, layer_names, local_stages, place, build_key, experts)
    ep = _expert_parallel(model, ep_plan, layer_names, local_stages, config, place, build_key)
    # Under tp, replicas only where there are several (FSDP2 over the tp-sharded layers).
    dp = None
    if tp is None or place.dp_size > 1:
        ignored = ep.params if ep is not None else ()
        dp = _replicas(modules, config, place, build_key, ignored)
    runners, watch = _runners(modules, config, split=train_schedule.split_backward)
    eval_schedule = _schedule("forward", place.num_ranks, config, train_schedule)
    return BuiltPipeline(
        place=place,
        layer_ranges=layer_ranges,
        stages=stages,
        local_stages=local_stages,
        runners=runners,
        train_engine=place.engine(train_schedule),
        eval_engine=place.engine(eval_schedule),
        # After wrapping: FSDP replaces the parameters with its own (DTensors).
        ties=[(tie, params_named(local_stages, tie.names)) for tie in ties],
        aliases={n: names for names in tied for n in names},
        dp=dp,
        tp=tp,
        ep=ep,
        loss_fn=loss_fn if place.cp is None else place.cp.loss_fn,
        num_items_fn=num_items_fn,
        label_rows=text_vocab_size(model.config) if config.loss_fn is None else None,
        ragged=ragged_inputs(model, config.input_names),
        abort=_abort_channel(place),
        compile_watch=watch,
    )


def _plans(
    model: nn.Module, layer_names: list[str], config: PipelineConfig, place: Placement
) -> tuple[dict[str, str] | None, dict[str, str] | None]:
    """The decoder layers' tensor-parallel rules (under tp) and expert-parallel rules (under
    ``expert_parallel``), each checked against the model and the mesh; ``None`` where unused.
    With a cp dim, the model is checked for context parallelism first."""
    _context_parallel(model, layer_names, config, place)
    tp_plan = ep_plan = None
    if place.tp_size > 1:
        tp_plan = layer_tp_plan(
            model,
            layer_names,
            place.tp_size,
            config.tensor_parallel,
            place.dp_size == 1,
            experts=expert_degree(config) == 1,
        )
    if expert_degree(config) > 1:
        ep_plan = layer_ep_plan(
            model,
            layer_names,
            config.expert_parallel,
            place.dp_size * place.tp_size,
            place.tp_size,
        )
    return tp_plan, ep_plan


def _context_parallel(
    model: nn.Module, layer_names: list[str], config: PipelineConfig, place: Placement
) -> None:
    """With a cp dim: the model checked for context parallelism, ``position_ids`` made a stage
    input (the tokens' global positions) and the loss over labels shifted before the split
    made ready, to replace the model's own (see [Note: pipeline x context parallel])."""
    if place.cp is None:
        return
    place.cp.prepare(model, [model.get_submodule(n) for n in layer_names])
    if "position_ids" not in config.input_names:
        config.input_names = (*config.input_names, "position_ids")


def _expert_parallel(
    model: nn.Module,
    ep_plan: dict[str, str] | None,
    layer_names: list[str],
    local_stages: list,
    config: PipelineConfig,
    place: Placement,
    build_key: int,
) -> ExpertParallel | None:
    """This rank's experts sharded over its expert group ([Note: pipeline x expert parallel]);
    ``None`` without ``expert_parallel``."""
    if ep_plan is None:
        return None
    local_layers = {st.index: [layer_names[i] for i in st.layers] for st in local_stages}
    return ExpertParallel(
        place.mesh,
        config.expert_parallel,
        model,
        ep_plan,
        local_layers,
        place.timeout_ms,
        place.device,
        build_key,
    )


def _partition(
    model: nn.Module, layer_cls: LayerCls, config: PipelineConfig, place: Placement
) -> tuple[list[tuple[int, int]], list[StageGraph], _C.Schedule]:
    """The stage layout, every stage's graph, and the training schedule."""
    layer_cls = layer_classes(model, layer_cls)
    layer_ranges, checkpoint_layers = resolve_layout(
        config, num_layers=len(find_layers(model, layer_cls)), num_ranks=place.num_ranks
    )
    schedule = _schedule(config.schedule, place.num_ranks, config)
    if schedule.num_ranks != place.num_ranks:
        raise ValueError(
            f"schedule {schedule.name!r} is for {schedule.num_ranks} ranks but the pipeline's "
            f"group has {place.num_ranks}"
        )
    stages = partition(
        model,
        layer_cls,
        layer_ranges,
        config.input_names,
        checkpoint_layers=checkpoint_layers,
        device_type=place.device.type,
    )
    return layer_ranges, stages, schedule


def _schedule(
    name: str | _C.Schedule,
    num_ranks: int,
    config: PipelineConfig,
    like: _C.Schedule | None = None,
) -> _C.Schedule:
    """Schedule ``name`` (or the schedule itself); "forward" on the stages where ``like``
    (training) put them."""
    if isinstance(name, _C.Schedule):
        return name
    try:
        if like is not None:
            return _C.forward_schedule(like.stage_rank, num_ranks, config.num_microbatches)
        return _C.make_schedule(name, num_ranks, config.num_microbatches, config.chunks)
    except RuntimeError as e:
        raise ValueError(str(e)) from None


def _tie_weights(
    tied: list[list[str]],
    stages: Sequence[StageGraph],
    local_stages: Sequence[StageGraph],
    stage_rank: Sequence[int],
    place: Placement,
) -> list[Tie]:
    """The ties this rank shares with other ranks (on a mesh: with other stages); the owners start
    from the first owner's values."""
    ties = local_ties(tied, stages, stage_rank, place.rank, per_stage=place.mesh is not None)
    for tie in ties:
        params = params_named(local_stages, tie.names)
        combine_among(
            tie,
            [p.data for p in params],
            add=False,
            rank=place.rank,
            group_name=place.group_name,
            timeout_ms=place.timeout_ms,
        )
    return ties


def _tensor_parallel(
    model: nn.Module,
    plan: dict[str, str] | None,
    layer_names: Sequence[str],
    local_stages: Sequence[StageGraph],
    place: Placement,
    build_key: int,
    experts: Sequence[str] = (),
) -> TensorParallel | None:
    """With a tensor-parallel plan: the local decoder layers sharded over the mesh's ``tp``
    dimension (see [Note: pipeline x tensor parallel] in ``tensor_parallel.py``), but the
    ``experts`` modules, which expert parallelism shards."""
    if plan is None:
        return None
    return TensorParallel(
        place.mesh,
        model,
        plan,
        [layer_names[i] for st in local_stages for i in st.layers],
        [st.module for st in local_stages],
        place.timeout_ms,
        place.device,
        build_key,
        apart=experts,
    )


def _replicas(
    modules: dict[int, nn.Module],
    config: PipelineConfig,
    place: Placement,
    build_key: int,
    ignored: Sequence[nn.Parameter] = (),
) -> DataParallel | None:
    """With a mesh: the local stages wrapped for data parallelism over the replicas (but the
    ``ignored`` parameters: experts sharded over them)."""
    if place.mesh is None:
        return None
    return DataParallel(
        place.mesh,
        config.data_parallel,
        modules,
        place.timeout_ms,
        place.device,
        build_key,
        ignored=ignored,
    )


def _abort_channel(place: Placement) -> AbortChannel:
    """The abort record of the next pipeline built on ``place``'s group; on a mesh, one record
    for every replica, naming ranks by job rank (see [Note: watched collectives])."""
    group = place.group or dist.group.WORLD
    members = [dist.get_global_rank(group, r) for r in range(place.num_ranks)]
    if place.mesh is None:
        scope, rank, ranks, peers = place.group_name, place.rank, members, None
    else:
        world = dist.get_world_size()
        scope, rank, ranks, peers = "mesh", dist.get_rank(), list(range(world)), members
    _INSTANCES[scope] = _INSTANCES.get(scope, 0) + 1
    return AbortChannel(scope, _INSTANCES[scope], rank, ranks, peers)


def _runners(
    modules: dict[int, nn.Module], config: PipelineConfig, *, split: bool
) -> tuple[dict[int, Callable], RecompileWatch | None]:
    """What runs each local stage, and the recompile watch when the stages are compiled. Under a
    schedule that splits the backward, inductor-compiled stages keep input and weight gradients
    in separate graphs ([Note: compiled W])."""
    if not config.compile:
        return dict(modules), None
    options = dict(config.compile_options or {})
    if split and options.get("backend", "inductor") == "inductor":
        options["backend"] = split_backward_backend(
            mode=options.pop("mode", None), options=options.pop("options", None)
        )
    runners = {s: torch.compile(m, **options) for s, m in modules.items()}
    return runners, RecompileWatch(list(modules.values()))


def resolve_placement(
    config: PipelineConfig, group: dist.ProcessGroup | None, mesh: DeviceMesh | None
) -> Placement:
    """The pipeline's process group (``group``, the world, or the mesh's pipeline dimension),
    this rank's place in it and the device."""
    if not dist.is_initialized():
        raise RuntimeError(
            "PipelineModel needs torch.distributed: call dist.init_process_group('gloo') "
            "first (torchrun sets the rendezvous)"
        )
    groups, dp = None, dims_text(config.dp_dims)
    if mesh is None and config.tensor_parallel is not None:
        raise ValueError(
            f"tensor_parallel={config.tensor_parallel!r} needs mesh=init_device_mesh(device_type, "
            f"(dp, pp, tp), mesh_dim_names=({dp}, {config.pp_dim!r}, "
            f"{config.tp_dim!r})); got no mesh"
        )
    if mesh is None and expert_degree(config) > 1:
        raise ValueError(
            f"expert_parallel={config.expert_parallel} needs mesh=init_device_mesh(device_type, "
            f"(dp, pp), mesh_dim_names=({dp}, {config.pp_dim!r})): the experts are sharded over "
            "the data-parallel ranks of each stage; got no mesh"
        )
    cp = None
    if mesh is not None and config.cp_dim in (mesh.mesh_dim_names or ()):
        check_mesh_usable(mesh)
        context_parallel.check_options(config)
        group, groups = context_parallel.mesh_groups(mesh, config)
        device = resolve_device(config.device, group)
        cp = ContextParallel(mesh, config.cp_dim, int(config.timeout * 1000), device)
    elif mesh is not None:
        check_mesh_usable(mesh)
        groups = mesh_groups(mesh, config.pp_dim, config.dp_dim, group, config.tp_dim)
        group = groups.pp_group
        _check_tensor_parallel(config, groups)
        _check_expert_parallel(config, groups)
    group = group or dist.group.WORLD
    return Placement(
        group=group,
        group_name=group_name_of(group),
        mesh=groups,
        rank=dist.get_rank(group),
        num_ranks=dist.get_world_size(group),
        device=resolve_device(config.device, group),
        timeout_ms=int(config.timeout * 1000),
        cp=cp,
    )


def _check_tensor_parallel(config: PipelineConfig, groups: MeshGroups) -> None:
    """A mesh's tensor-parallel dimension and ``config.tensor_parallel`` agree."""
    if config.tensor_parallel is None and groups.tp_size > 1:
        raise ValueError(
            f"the mesh's {config.tp_dim!r} dim has size {groups.tp_size} but "
            "tensor_parallel=None; pass tensor_parallel='auto' to shard the decoder layers with "
            "the model's own HF plan"
        )
    if config.tensor_parallel is not None and groups.tp_mesh is None:
        dp = dims_text(config.dp_dims)
        raise ValueError(
            f"tensor_parallel={config.tensor_parallel!r} but the mesh's dims "
            f"{groups.mesh.mesh_dim_names} have no {config.tp_dim!r}; build a mesh "
            f"({dp}, {config.pp_dim!r}, {config.tp_dim!r})"
        )


def expert_degree(config: PipelineConfig) -> int:
    """The expert-parallel degree (1 without expert parallelism)."""
    return config.expert_parallel or 1


def _check_expert_parallel(config: PipelineConfig, groups: MeshGroups) -> None:
    """What a mesh with ``expert_parallel`` does not cover yet is refused (the layout's own rule
    is :func:`~pippy_xla.runtime.expert_parallel.layer_ep_plan`'s)."""
    ep = expert_degree(config)
    if ep == 1:
        return
    if len(config.dp_dims) > 1:
        raise NotImplementedError(
            f"expert_parallel={ep} with two data-parallel dims (HSDP, dp_dim={config.dp_dim!r}) "
            "is not supported yet (issue 71); use one dp dim"
        )
    if config.compile:
        raise NotImplementedError(
            f"expert_parallel={ep} with compile=True is not supported yet (issue 71): HF's "
            "all-to-all dispatch reads its split sizes back to the host in every MoE layer"
        )


def check_plan_tp(config: PipelineConfig, place: Placement) -> None:
    """What a tensor-parallel pipeline does not cover yet is refused, and a plan must have been
    made for the pipeline's tp degree (its costs are a tp rank's: see [Note: planning under
    tensor parallelism] in ``plan/profiler.py``)."""
    if place.tp_size > 1:
        refuse_under_tp(config)
    made_for = config.plan.tp_size if config.plan is not None else place.tp_size
    if made_for != place.tp_size:
        raise ValueError(
            f"the plan was made for tensor-parallel degree tp={made_for} but this pipeline has "
            f"tp={place.tp_size}; plan with tensor_parallel=pippy_xla.LayerSharding(mesh) on "
            "the pipeline's mesh (or without it for tp=1)"
        )
    ep = config.expert_parallel or 1
    made_for = config.plan.ep_size if config.plan is not None else ep
    if made_for != ep:
        raise ValueError(
            f"the plan was made for expert_parallel={made_for} but this pipeline has "
            f"expert_parallel={ep}; plan with expert_parallel=pippy_xla.ExpertSharding(mesh, {ep}) "
            "on the pipeline's mesh (or without it for none)"
        )


def refuse_under_tp(config: PipelineConfig) -> None:
    """Raises ``NotImplementedError`` for what a tensor-parallel pipeline does not cover yet."""
    planned = config.plan.checkpoint_layers if config.plan is not None else []
    if config.compile and (config.checkpoint_layers or planned):
        raise NotImplementedError(
            "compile=True with checkpoint_layers under tensor parallelism is not supported yet "
            "(issue 48): a checkpointed layer saves its DTensor parameters for the recompute, and "
            "AOTAutograd (torch 2.13) accepts plain tensors only there ('expected all "
            "tensors_saved_with_vc_check to be Tensors'); drop checkpoint_layers or compile=True"
        )


def resolve_layout(
    config: PipelineConfig, *, num_layers: int, num_ranks: int
) -> tuple[list[tuple[int, int]], list[int]]:
    """The layer range of every stage and the checkpointed layers: from the plan, from
    ``layer_ranges`` or balanced. Raises ``ValueError`` when they do not fit the pipeline."""
    chunks = config.chunks
    num_stages = num_ranks * chunks
    layer_ranges, checkpoint_layers = config.layer_ranges, list(config.checkpoint_layers)
    if config.plan is not None:
        if config.plan.num_stages != num_stages:
            raise ValueError(
                f"the plan has {config.plan.num_stages} stages but this pipeline has "
                f"{num_stages} ({num_ranks} ranks x {chunks} chunks); plan for {num_stages}"
            )
        layer_ranges = config.plan.layer_ranges
        checkpoint_layers = config.plan.checkpoint_layers
    equal = isinstance(config.schedule, str) and _C.schedule_info(config.schedule).equal_stages
    if equal and num_layers % num_stages:
        raise ValueError(
            f"schedule {config.schedule!r} with {chunks} chunks on {num_ranks} ranks needs the "
            f"{num_layers} decoder layers to divide into {num_stages} equal stages; "
            "choose chunks so that ranks x chunks divides the layer count"
        )
    if layer_ranges is None:
        layer_ranges = _C.balanced_ranges(num_layers, num_stages)
    elif len(layer_ranges) != num_stages:
        raise ValueError(
            f"layer_ranges has {len(layer_ranges)} stages but the process group has "
            f"{num_ranks} ranks x {chunks} chunks = {num_stages} stages"
        )
    return [tuple(r) for r in layer_ranges], checkpoint_layers


def resolve_device(device: torch.device | str | None, group: dist.ProcessGroup) -> torch.device:
    """The pipeline's device: checked against the group's backend (gloo moves CPU tensors, NCCL
    CUDA tensors) and the machine."""
    backend = str(dist.get_backend(group)).lower()
    if device is None:
        if "nccl" in backend:
            return resolve_device(f"cuda:{int(os.environ.get('LOCAL_RANK', 0))}", group)
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


_LOSS_ARGS = ("logits", "labels", "vocab_size", "num_items_in_batch")
"""What the last stage passes to an HF model's ``loss_function``."""


def default_loss(model: nn.Module) -> LossFn:
    """The HF model's own loss as a ``loss_fn(logits, labels, num_items)``."""
    if not hasattr(model, "loss_function") or not hasattr(model, "config"):
        raise ValueError(f"{type(model).__name__} has no HF loss_function; pass loss_fn=...")
    # The model that owns the loss (inside a wrapper such as PEFT's) takes the labels, or none.
    if "labels" not in inspect.signature(loss_owner(model).forward).parameters:
        raise UnsupportedModelError(
            f"{type(model).__name__} takes no labels (a base model, without a head: its output "
            "is its last hidden states), so it has no loss of its own; pass loss_fn=(hidden "
            "states, labels, num_items) -> the microbatch's summed loss / num_items and "
            "num_items_fn=(the whole batch's labels) -> their count"
        )
    loss_function = model.loss_function
    vocab_size = text_vocab_size(model.config)
    if vocab_size is None:
        raise UnsupportedModelError(
            f"{type(model).__name__}'s config ({type(model.config).__name__}) names no "
            "vocab_size, neither at the top nor in a text config, so its own loss cannot be "
            "computed; pass loss_fn=(logits, labels, num_items) -> the microbatch's loss"
        )
    params = inspect.signature(loss_function).parameters.values()
    needs = [
        p.name
        for p in params
        if p.default is p.empty
        and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)
        and p.name not in _LOSS_ARGS
    ]
    if needs:
        name = getattr(loss_function, "__name__", type(loss_function).__name__)
        raise UnsupportedModelError(
            f"{type(model).__name__}'s own loss ({name}) needs {needs}, but the last stage "
            f"computes a microbatch's loss from {list(_LOSS_ARGS)}; pass loss_fn=(logits, "
            "labels, num_items) -> the microbatch's summed loss / num_items, and num_items_fn="
            "(the whole batch's labels) -> their count (for sequence classification: "
            "cross_entropy(logits, labels, reduction='sum') / num_items and labels.numel())"
        )

    def loss_fn(logits: torch.Tensor, labels: torch.Tensor, num_items: torch.Tensor):
        return loss_function(
            logits=logits, labels=labels, vocab_size=vocab_size, num_items_in_batch=num_items
        )

    return loss_fn


def causal_lm_num_items(labels: torch.Tensor) -> torch.Tensor:
    """The valid tokens of causal-LM labels: HF's losses shift labels left by one and ignore
    -100."""
    return (labels[..., 1:] != -100).sum()


def default_num_items(model: nn.Module) -> Callable[[torch.Tensor], torch.Tensor]:
    """The causal-LM token count for a model whose own HF loss is the causal-LM loss (HF's
    fallback for a model without a loss type too); for any other model, an error asking for
    ``num_items_fn``: a count that does not fit the labels scales the loss silently."""
    try:
        from transformers.loss.loss_utils import ForCausalLMLoss
    except ImportError:  # pragma: no cover - transformers is optional for non-HF models
        ForCausalLMLoss = None  # noqa: N806
    own = getattr(model, "loss_function", None) if hasattr(model, "config") else None
    if own is not None and own is ForCausalLMLoss:
        return causal_lm_num_items
    raise ValueError(
        f"{type(model).__name__} is not a causal LM (its own loss is not HF's causal-LM loss), "
        "so the pipeline cannot count what its loss averages over: pass num_items_fn=(the "
        "whole batch's labels) -> their count, e.g. lambda labels: torch.tensor(labels.shape[0]) "
        "for a loss averaged over rows, or torch.tensor(labels.numel()) over every label"
    )


"""[Note: a pipeline's own groups]

A step that fails part-way leaves transfers in flight: messages sent and never received (in
shared-memory slots, or gloo sends waiting for their receive), receives posted and never matched,
a collective that one rank entered and its peer never did. A transfer is matched by its group,
peer and tag, and two pipelines of the same shape use the same tags, so a pipeline built later
over the same group would take the failed step's messages for its own data (silently wrong), or
the failed step's receives would take its messages (a hang). So every pipeline moves its traffic
over a process group of its own, made at build over the same ranks with the same backend
(:func:`own_group`: ``dist.new_group(..., use_local_synchronization=True)``, 1-4 ms on 2-4 CPU
ranks): every transfer, boundary header, step handshake, small collective, tied-weight sum and
checkpoint collective of the pipeline runs on it, its shared-memory channels are attached to it,
and with transfers matched in order its up, down and header groups are made from it. The group
the user passed carries only the build's handshake and the making of that group, both complete
when the build returns. A failed pipeline's group, with whatever its step left in flight, is
never used again: a pipeline built afterwards over the same processes starts on a group of its
own, whatever the transport (the group is the pipeline's epoch). A failed pipeline itself keeps
refusing steps (:meth:`~pippy_xla.runtime.failures.FailureState.check_usable`).

A mesh's data- and tensor-parallel groups (FSDP's collectives, the tensor-parallel layers') are
the user's ``DeviceMesh``'s and cannot be replaced that way, nor by a new mesh of the same layout
and dim names: torch's DTensor caches its sharding decisions by mesh equality, and a pipeline
built on such a new mesh went on to gather its gradients over the old mesh's groups (measured,
torch 2.13). So a pipeline on a mesh whose step failed marks the mesh's layout, and a pipeline
built on a mesh equal to it is refused at once (every rank of the mesh raised that failure, so
every rank refuses) with what to do: a mesh with other dim names, or a new job
(:func:`~pippy_xla.runtime.failures.check_mesh_usable`).
"""


def own_group(place: Placement) -> None:
    """Moves ``place`` onto a process group of the pipeline's own over the same ranks (a
    collective over them). See [Note: a pipeline's own groups]."""
    group = place.group or dist.group.WORLD
    own = dist.new_group(
        dist.get_process_group_ranks(group),
        backend=dist.get_backend(group),
        timeout=datetime.timedelta(milliseconds=place.timeout_ms),
        use_local_synchronization=True,
    )
    place.group, place.group_name = own, group_name_of(own)


def attach_transport(config: PipelineConfig, place: Placement) -> int:
    """Moves the pipeline's CPU transfers between ranks of this host onto shared memory unless
    ``config.transport`` is ``"process_group"`` (a collective over the pipeline's group; see
    [Note: same-host transport] in ``csrc/transport/shm.h``). Returns how many peers this rank
    reaches that way. ``transport="shm"`` raises ``RuntimeError`` on every rank unless every pair of
    ranks does."""
    if place.nccl and config.transport not in ("auto", "in_order"):
        raise ValueError(
            f"transport={config.transport!r} with an NCCL group: NCCL matches transfers in "
            "posting order, not by tag; use transport='auto' (see [Note: transfers matched in "
            "order] in csrc/runtime/engine.h)"
        )
    if config.transport in ("in_order", "process_group"):
        return 0
    if place.device.type != "cpu":
        if config.transport == "shm":
            raise ValueError(
                f"transport='shm' moves CPU tensors, but the pipeline's device is {place.device}; "
                "use transport='auto' (NCCL moves CUDA tensors)"
            )
        return 0
    spin = -1 if config.transport_spin_us is None else config.transport_spin_us
    peers = _C.shm_attach(place.group_name, place.timeout_ms, spin)
    if config.transport == "shm":
        what = f"[rank {place.rank}] transport check"
        counts = _C.all_gather_int64([peers], place.group_name, "cpu", place.timeout_ms, what)
        short = [r for r, (n,) in enumerate(counts) if n != place.num_ranks - 1]
        if short:
            raise RuntimeError(
                f"[rank {place.rank}] transport='shm' but ranks {short} cannot reach every other "
                "rank through shared memory (another host, or /dev/shm unusable); use "
                "transport='auto'"
            )
    return peers


def in_order_groups(
    config: PipelineConfig, place: Placement, stage_rank: Sequence[int]
) -> _C.InOrderGroups | None:
    """The up, down and header groups of an engine whose transfers are matched in posting order
    (an NCCL pipeline of several ranks, or ``transport="in_order"``), made over the pipeline's
    ranks; ``None`` otherwise. See [Note: transfers matched in order] in ``csrc/runtime/engine.h``.

    Collective over the pipeline's ranks only (``use_local_synchronization``). Each pair of ranks
    that exchanges transfers then sends one message each way over its group, pairs in one order
    on every rank: NCCL creates a pair's communicator at its first transfer and both ranks must
    take part, which a receive posted early during a step could otherwise wait on for as long as
    the peer is busy elsewhere."""
    if place.num_ranks == 1 or (config.transport != "in_order" and not place.nccl):
        return None  # one rank transfers nothing
    group = place.group or dist.group.WORLD
    backend = dist.get_backend(group)
    ranks = dist.get_process_group_ranks(group)

    def make(backend: str) -> dist.ProcessGroup:
        return dist.new_group(ranks, backend=backend, use_local_synchronization=True)

    up, down, header = make(backend), make(backend), make("gloo")
    pairs = {(a, b) for a, b in zip(stage_rank, stage_rank[1:], strict=False) if a != b}
    pairs |= {(b, a) for a, b in pairs}
    token = torch.zeros(1, device=place.device)
    for src, dst in sorted(pairs, key=lambda p: (min(p), max(p), p[0] > p[1])):
        g = up if src < dst else down
        if place.rank == src:
            dist.send(token, dist.get_global_rank(g, dst), group=g)
        elif place.rank == dst:
            dist.recv(token, dist.get_global_rank(g, src), group=g)
    return _C.InOrderGroups(
        up_group=group_name_of(up),
        down_group=group_name_of(down),
        header_group=group_name_of(header),
    )


def check_ranks_agree(
    stages: Sequence[StageGraph],
    config: PipelineConfig,
    place: Placement,
    tp_plan: dict[str, str] | None = None,
    ep_plan: dict[str, str] | None = None,
) -> int:
    """Build-time handshake: every rank of the group must have built the same stage graphs with
    the same schedule, microbatch count, inputs and tensor-parallel rules. Returns the 64-bit
    digest of them (a mesh's replicas compare it too); raises ``RuntimeError`` saying what
    differs."""
    digest = hashlib.sha256()
    for st in stages:
        digest.update(st.code.encode())
        digest.update(repr(sorted(st.param_names.items())).encode())
    schedule = config.schedule if isinstance(config.schedule, str) else config.schedule.table()
    mine = (
        digest.hexdigest(),
        schedule,
        config.num_microbatches,
        list(config.input_names),
        config.transport,
        digest64(repr(tp_plan).encode()) if tp_plan else None,
        (config.expert_parallel, digest64(repr(ep_plan).encode())) if ep_plan else None,
    )
    key = digest64(repr(mine).encode())
    rank = place.rank
    what = f"[rank {rank}] build handshake"
    keys = _C.all_gather_int64([key], place.group_name, str(place.device), place.timeout_ms, what)
    if all(k == [key] for k in keys):
        return key
    everyone: list = [None] * len(keys)  # only to say what differs
    dist.all_gather_object(everyone, mine, group=place.group)
    for r, theirs in enumerate(everyone):
        if theirs != mine:
            raise RuntimeError(
                f"[rank {rank}] rank {r} built a different pipeline: (graph digest, schedule, "
                "microbatches, inputs, transport, tp rules, expert parallel) = "
                f"{theirs} here {mine}; every rank must wrap the same model with the same "
                "arguments"
            )
    return key
