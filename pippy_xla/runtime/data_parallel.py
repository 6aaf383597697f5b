"""Pipeline x data parallel on a ``DeviceMesh``: stage replicas reduced by torch's FSDP2.

[Note: pipeline x data parallel]

A 2-D mesh ``(dp, pp)`` holds ``dp`` replicas of one pipeline (HSDP's two dp dims: below).
Each replica is an ordinary pipeline over its ``pp`` group; the ranks that run the same stage in
different replicas form a ``dp`` group. Every rank is given the *global* batch; replica ``i``
trains on the ``i``-th of ``dp`` equal contiguous slices of it, split into microbatches as usual.

- Gradients: each stage module is wrapped with torch's own data-parallel machinery over the ``dp``
  dimension: ``fully_shard`` (FSDP2: parameters, gradients and optimizer state sharded over the
  replicas) or ``replicate`` (the FSDP2-based replicate: every replica holds everything). During a
  step's microbatches FSDP neither reduces nor reshards (``set_requires_gradient_sync(False)``,
  ``set_reshard_after_backward(False)``): gradients accumulate locally, as torch.distributed.
  pipelining does. When a stage's last backward (or weight-gradient step, for ZB-H1) of the step
  is done, the engine calls back (see [Note: gradients ready] in csrc/runtime/schedule_analysis.cpp)
  and this module runs FSDP's post-backward for that stage: one reduce-scatter (or all-reduce) of
  its gradients, while earlier stages still run their cooldown.
- Scale: every microbatch loss is divided by the *global* batch's count of valid tokens, so the
  replicas' losses add up to the global mean and their gradients add up to its gradient. FSDP's
  averaging is therefore turned off (divide factor 1, plain sums), and the reported loss is the
  sum over replicas: the global batch mean, on every rank.
- Start: the replicas' values are made equal (copied from the first replica) before wrapping, as
  DDP does, so a model initialized differently per rank (a seed per rank, ``meta`` init) still
  trains as one model.
- HSDP: the data-parallel dimension may be two mesh dims, ``dp_dim=(replicate, shard)`` (named
  ``("dp_replicate", "dp_shard")`` as torchtitan does, in the mesh's order), on a mesh
  ``(dp_replicate, dp_shard, pp)`` or ``(dp_replicate, dp_shard, pp, tp)``. The replicas are
  every rank of both: everything above that speaks of "the replicas" (the batch's rows, the
  loss's sum, the start's copy, the build handshake, generation's rows, checkpoints, failures)
  uses the two dims flattened into one group (``DeviceMesh._flatten``, :attr:`MeshGroups.dp_mesh`),
  and a replica's index is ``replicate_index * dp_shard + shard_index``. Only FSDP2 sees the 2-D
  submesh (:attr:`MeshGroups.fsdp_mesh`): ``"shard"`` is FSDP2's HSDP (``fully_shard`` over the
  2-D mesh: parameters, gradients and optimizer state sharded over ``dp_shard``, replicated over
  ``dp_replicate``; a reduce-scatter within ``dp_shard`` then an all-reduce across
  ``dp_replicate``); ``"replicate"`` replicates over every replica (the flattened 1-D mesh), as a
  single ``dp`` dim of the same size would. The global gradient norm counts a shard on the first
  ``dp_replicate`` replica only (the others hold the same shard; see [Note: global gradient
  clipping] in ``_grads.py``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
import torch.distributed as dist
from torch import nn

from pippy_xla._native import _C

__all__ = [
    "DATA_PARALLEL_MODES",
    "DataParallel",
    "MeshGroups",
    "assign",
    "dims_text",
    "local_tensor",
    "mesh_groups",
]

DATA_PARALLEL_MODES = ("replicate", "shard")


def _dims_of(dp_dim: str | Sequence[str]) -> tuple[str, ...]:
    """``dp_dim`` as a tuple of mesh dims: one, or ``(replicate, shard)`` for HSDP."""
    return (dp_dim,) if isinstance(dp_dim, str) else tuple(dp_dim)


class MeshGroups:
    """The process groups and coordinates a rank has on a ``(dp, pp)`` or ``(dp, pp, tp)`` mesh,
    where ``dp`` may be two dims ``(replicate, shard)`` (HSDP)."""

    def __init__(
        self, mesh, pp_dim: str, dp_dim: str | Sequence[str], tp_dim: str | None = None
    ) -> None:
        self.mesh = mesh
        self.pp_group: dist.ProcessGroup = mesh.get_group(pp_dim)
        dp_dims = _dims_of(dp_dim)
        self.fsdp_mesh = mesh[dp_dims]
        """The data-parallel submesh FSDP2 shards over: 1-D, or 2-D ``(replicate, shard)``."""
        self.dp_mesh = self.fsdp_mesh if len(dp_dims) == 1 else self.fsdp_mesh._flatten()
        """The replicas: the data-parallel dims flattened into one (see [Note: pipeline x data
        parallel])."""
        self.dp_group: dist.ProcessGroup = self.dp_mesh.get_group()
        self.dp_rank: int = self.dp_mesh.get_local_rank()
        self.dp_size: int = self.dp_mesh.size()
        self.dp_replicate_rank: int = self.fsdp_mesh.get_local_rank(0) if len(dp_dims) > 1 else 0
        """This rank's coordinate on the replicate dim of an HSDP mesh (else 0)."""
        self.tp_mesh = mesh[tp_dim] if tp_dim is not None else None
        """The tensor-parallel dimension's 1-D mesh (``None`` on a 2-D mesh): the ranks that run
        this rank's stages together, each with its shard of their decoder layers."""
        self.tp_group: dist.ProcessGroup | None = (
            mesh.get_group(tp_dim) if tp_dim is not None else None
        )
        self.tp_rank: int = self.tp_mesh.get_local_rank() if self.tp_mesh is not None else 0
        self.tp_size: int = self.tp_mesh.size() if self.tp_mesh is not None else 1


def mesh_groups(
    mesh,
    pp_dim: str,
    dp_dim: str | Sequence[str],
    group: dist.ProcessGroup | None,
    tp_dim: str | None = None,
) -> MeshGroups:
    """Checks ``mesh`` (a ``DeviceMesh`` with dims ``dp_dim`` (one, or two for HSDP) and
    ``pp_dim``, and ``tp_dim`` if it has one) and ``group`` (``None``, or the mesh's pipeline
    group) and returns this rank's groups."""
    from torch.distributed.device_mesh import DeviceMesh

    if not isinstance(mesh, DeviceMesh):
        raise TypeError(
            f"mesh must be a torch.distributed.device_mesh.DeviceMesh, got {type(mesh).__name__}"
        )
    names, dp_dims = mesh.mesh_dim_names, _dims_of(dp_dim)
    _check_dims(names, dp_dims, pp_dim, tp_dim)
    has_tp = tp_dim is not None and tp_dim in names
    if mesh.ndim != len(dp_dims) + 1 + has_tp:
        raise ValueError(
            f"the mesh has {mesh.ndim} dims {names}; PipelineModel supports meshes with dims "
            f"({dims_text(dp_dims)}, {pp_dim!r}) and ({dims_text(dp_dims)}, {pp_dim!r}, "
            f"{tp_dim or 'tp'!r}) (data x pipeline [x tensor])"
        )
    if mesh.size() != dist.get_world_size():
        raise ValueError(
            f"the mesh spans {mesh.size()} ranks but the job has {dist.get_world_size()}; "
            "PipelineModel needs a mesh over every rank of the job"
        )
    groups = MeshGroups(mesh, pp_dim, dp_dims, tp_dim if has_tp else None)
    if group is not None and group is not groups.pp_group:
        raise ValueError(
            f"group= is not the mesh's pipeline dimension {pp_dim!r} (its ranks are "
            f"{dist.get_process_group_ranks(group)}, the pipeline dim's are "
            f"{dist.get_process_group_ranks(groups.pp_group)}); pass mesh=... alone, the "
            "pipeline group is taken from it"
        )
    return groups


def dims_text(dims: Sequence[str]) -> str:
    """Mesh dims as a message writes them: ``'dp_replicate', 'dp_shard'``."""
    return ", ".join(repr(d) for d in dims)


def _check_dims(names, dp_dims: tuple[str, ...], pp_dim: str, tp_dim: str | None) -> None:
    """The mesh names the pipeline's dims, and an HSDP mesh its two data-parallel dims in order
    (replicate before shard, as FSDP2 reads a 2-D mesh)."""
    dp, tp = dims_text(dp_dims), tp_dim or "tp"
    hsdp = len(dp_dims) > 1
    how = (
        f"build it with init_device_mesh(device_type, ({'replicate, shard' if hsdp else 'dp'}, "
        f"pp), mesh_dim_names=({dp}, {pp_dim!r})) (with {tp!r} last for tensor parallelism), or "
        "name its dims with dp_dim=..., pp_dim=... and tp_dim=..."
    )
    if not hsdp:
        how += "; for HSDP pass dp_dim=(replicate, shard), e.g. ('dp_replicate', 'dp_shard')"
    missing = [d for d in (*dp_dims, pp_dim) if not names or d not in names]
    if missing:
        raise ValueError(
            f"the mesh's dims are {names}, but the pipeline needs a pipeline dim {pp_dim!r} and "
            f"data-parallel dim{'s' if hsdp else ''} {dp} ({', '.join(map(repr, missing))} "
            f"missing); {how}"
        )
    if hsdp and names.index(dp_dims[0]) > names.index(dp_dims[1]):
        raise ValueError(
            f"dp_dim={dp_dims} names the replicate dim first and the shard dim second, but the "
            f"mesh's dims {names} have {dp_dims[1]!r} before {dp_dims[0]!r}; build the mesh with "
            f"{dp_dims[0]!r} before {dp_dims[1]!r} (or pass dp_dim={dp_dims[::-1]!r} to shard "
            f"over {dp_dims[0]!r})"
        )


class DataParallel:
    """Wraps this rank's stage modules with FSDP2 over the ``dp`` mesh dimension and reduces
    their gradients once per step. See [Note: pipeline x data parallel]."""

    def __init__(
        self,
        groups: MeshGroups,
        mode: str,
        modules: Mapping[int, nn.Module],
        timeout_ms: int,
        device: torch.device,
        build_key: int,
        ignored: Sequence[nn.Parameter] = (),
    ) -> None:
        """``build_key``: a digest of this rank's pipeline (graphs, schedule, microbatches); the
        replicas must agree on it and on ``mode`` before any of their tensors are exchanged.
        ``ignored``: parameters FSDP2 neither copies from the first replica, shards nor reduces
        (experts sharded over the replicas, see [Note: pipeline x expert parallel])."""
        from torch.distributed._composable.replicate_with_fsdp import replicate
        from torch.distributed.fsdp import fully_shard

        self.groups = groups
        self.mode = mode
        self._group_name = groups.dp_group.group_name
        self._timeout_ms = timeout_ms
        self._device = str(device)
        self._api = fully_shard if mode == "shard" else replicate
        key = build_key ^ DATA_PARALLEL_MODES.index(mode)
        if not self.agree(key, f"[replica {groups.dp_rank}] data-parallel build handshake"):
            raise RuntimeError(
                f"[replica {groups.dp_rank}] the pipeline replicas on the mesh's data-parallel "
                "dimension built different pipelines (model, layer ranges, schedule, "
                "microbatches, inputs or data_parallel mode differ); every rank must wrap the "
                "same model with the same arguments"
            )
        skip = {id(p) for p in ignored}
        for module in modules.values():
            self._sync_from_first_replica(module, skip)
        for module in modules.values():
            # HSDP: the 2-D (replicate, shard) mesh; plain replicate over every replica.
            self._api(
                module,
                mesh=groups.fsdp_mesh if mode == "shard" else groups.dp_mesh,
                ignored_params={p for p in module.parameters() if id(p) in skip} or None,
            )
            # The losses are already divided by the global token count: sum, never average.
            module.set_gradient_divide_factor(1.0)
            module.set_force_sum_reduction_for_comms(True)
        self.modules = dict(modules)

    def _sync_from_first_replica(self, module: nn.Module, skip: set[int]) -> None:
        with torch.no_grad():
            for name, t in [*module.named_parameters(), *module.named_buffers()]:
                if id(t) in skip:
                    continue
                t = local_tensor(t.detach())  # a tensor-parallel shard: this tp rank's part
                t.copy_(
                    _C.broadcast_copy(
                        t,
                        0,
                        self._group_name,
                        self._timeout_ms,
                        f"data-parallel start: broadcast of {name}",
                    )
                )

    def before_step(self) -> None:
        """Microbatch backwards accumulate locally; nothing is reduced or resharded yet."""
        for module in self.modules.values():
            module.set_is_last_backward(False)
            module.set_reshard_after_backward(False)
            module.set_requires_gradient_sync(False)

    def unshard(self) -> None:
        """All-gathers the local stages' sharded parameters before a step, so that no collective
        runs inside a stage's forward, where a peer's failure could not end it (this call is a
        watched collective instead, see [Note: watched collectives]). The stages stay unsharded
        until their reduction (each is a root module: not resharded after forward)."""
        for module in self.modules.values():
            module.unshard()

    def reduce(self, stage: int) -> None:
        """Reduces ``stage``'s accumulated gradients over the replicas (the engine's
        ``grads_ready`` callback) and reshards its parameters."""
        module = self.modules[stage]
        module.set_is_last_backward(True)
        module.set_reshard_after_backward(True)
        module.set_requires_gradient_sync(True)
        state = self._api.state(module)
        for s in state._state_ctx.all_states:
            for param_group in s._fsdp_param_groups:
                param_group.post_backward()
        state._root_post_backward_final_callback()

    def after_eval(self) -> None:
        """A forward-only step leaves the root modules' parameters unsharded: reshard them."""
        for module in self.modules.values():
            module.reshard()

    @property
    def sharded(self) -> bool:
        """Whether each replica holds a shard of every gradient (``"shard"``), not all of it."""
        return self.mode == "shard"

    def all_reduce_sum(self, tensor: torch.Tensor, what: str) -> torch.Tensor:
        return _C.all_reduce_sum_copy(tensor, self._group_name, self._timeout_ms, what)

    def all_gather_ints(self, values: list[int], what: str) -> list[list[int]]:
        """Every replica's ``values`` (int64s), in replica order."""
        return _C.all_gather_int64(values, self._group_name, self._device, self._timeout_ms, what)

    def agree(self, key: int, what: str) -> bool:
        """Whether every replica passed the same 64-bit ``key``."""
        return all(k == [key] for k in self.all_gather_ints([key], what))


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """This rank's part of ``t``: its local shard if ``t`` is a DTensor, else ``t``."""
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t


def assign(target: torch.Tensor, source: torch.Tensor, from_first: bool = False) -> None:
    """Copies the full tensor ``source`` into ``target``, which may be a DTensor: its local
    shard gets the matching slice (no communication). ``from_first``: where each rank's
    ``source`` may differ (a random draw), a DTensor takes the first rank's on each dimension
    of its mesh instead (torch's broadcast or scatter from it: a collective over the mesh)."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    if isinstance(target, DTensor):
        part = distribute_tensor(
            source.to(target.device, target.dtype),
            target.device_mesh,
            target.placements,
            src_data_rank=0 if from_first else None,
        )
        target.to_local().copy_(part.to_local())
    else:
        target.copy_(source)


def copy_from_first(module: nn.Module, group_name: str, timeout_ms: int) -> None:
    """Copies the first rank's values of the group ``group_name`` (tensor parallelism's tp group,
    the planner's expert group) into ``module``'s parameters and buffers (those not on
    ``meta``), a broadcast over it."""
    with torch.no_grad():
        for name, t in [*module.named_parameters(), *module.named_buffers()]:
            if t.device.type == "meta":
                continue
            what = f"start: broadcast of {name} from the group's first rank"
            t.copy_(_C.broadcast_copy(t.detach(), 0, group_name, timeout_ms, what))
