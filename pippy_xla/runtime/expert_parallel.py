"""Pipeline x expert parallel on a ``DeviceMesh``: each stage's MoE experts sharded over ranks
that run that stage, whole experts per rank, by the model's own HF expert plan; routed tokens
exchanged by HF's all-to-all.

[Note: pipeline x expert parallel]

``PipelineModel(model, mesh=mesh, expert_parallel=ep)`` on a ``(dp, pp)`` mesh (or ``(dp, pp,
tp)``) shards every MoE layer's experts of a stage over ``ep`` of the ranks that run that stage.
The mesh names no expert dim: as HF's ``DistributedConfig(ep_size=...)`` and torchtitan do, the
expert ranks are borrowed from the dense ones.

- Layout (HF's rule, ``DistributedConfig``: ``ep`` a multiple of ``tp`` dividing ``dp x tp``):
  the ``dp x tp`` ranks of a stage, flattened with ``tp`` inner (the dense group), are cut into
  ``efsdp = dp x tp / ep`` expert groups of ``ep`` consecutive ranks (each a whole number of tp
  groups); rank ``i`` of an expert group holds experts ``[i E/ep, (i+1) E/ep)`` of every MoE
  layer of its stages; the ranks at the same place of each expert group (the efsdp group) hold
  the same experts: ``efsdp`` copies of each. On a ``(2, 2)`` mesh with ``ep=2``, ranks 0 and 2
  (stage 0 of replicas 0 and 1) are one expert group and hold experts 0-1 and 2-3 of stage 0's
  layers. The meshes are made once per mesh and ``ep`` by torch's ``DeviceMesh._unflatten``
  (:func:`expert_layout`).
- Applying: the plan's rules inside this rank's decoder layers (``grouped_gemm`` on the experts'
  parameters, ``ep_dispatch_experts`` on the experts module: :data:`EXPERT_STYLES`, from
  ``model.ep_plan``, :func:`expert_rules`) go to HF's ``apply_expert_parallelism`` with
  ``ep_implementation="all_to_all"`` (``hf_compat.expert_parallel_api``): the experts'
  parameters become DTensors ``Shard(0)`` on the expert mesh (their local tensor the rank's
  experts), and the experts module's forward sends each (token, expert) pair to the expert's
  rank and the output back (``AllToAllEP``, whose ``tp_mesh`` is the ranks sharing one batch:
  the tp ranks, or one rank). The router, the shared experts and every other weight stay dense.
  The same function shards experts over tp ranks under tensor parallelism (its ``all_reduce``
  implementation, [Note: pipeline x tensor parallel]): one mechanism, two groups.
- Start: the experts are copied whole from the first replica (a broadcast over ``dp``) before
  sharding, so each rank cuts its experts out of the same tensors.
- Schedules: every replica runs the same schedule, so the ranks of an expert group (same stage,
  other replicas or tp ranks) reach each layer's two all-to-alls (forward) and their two
  backward ones in the same order, microbatch by microbatch; the backward all-to-alls lie on
  the input-gradient path, so a split backward (zero-bubble) runs them in B, and W, which only
  accumulates weight gradients from what B recorded, communicates nothing (see [Note: split
  backward] in ``csrc/runtime/split_backward.cpp``).
- Gradients: an expert's gradient on its rank is complete over its expert group (the
  all-to-all's backward brings every token's contribution; losses are already divided by the
  global token count, [Note: pipeline x data parallel]), so FSDP2 ignores the expert parameters
  (``ignored_params``: neither sharded nor reduced); with ``efsdp`` > 1 they are summed over the
  efsdp group after the stage's last backward (:meth:`ExpertParallel.reduce`). The optimizer
  sees the local experts only, so its state is theirs. The global norm counts each expert once:
  the first copy's share summed over the stage's ranks (:meth:`ExpertParallel.norm_part`;
  [Note: global gradient clipping] in ``_grads.py``).
- Refused at build, on every rank alike, in one line: ``expert_parallel`` without a mesh, a mesh
  whose dense group it does not divide, a model without an expert plan (or none that dispatches
  experts inside its decoder layers), a style of the plan the pipeline does not apply, a number
  of experts it does not divide, HSDP and compiled stages (not yet), a ``tp`` dim beside a
  parameter left dense (not yet), PEFT's tuner layers on an experts module the plan shards
  (:func:`_refuse_adapted_experts`), and a transformers release without HF's all-to-all expert
  parallelism (before 5.23).
- Failures: HF's all-to-alls (the split sizes' exchange, the tokens' dispatch and combine, and
  their backward) run on the expert group's process group, inside a stage's forward and
  backward, where the engine's abort of [Note: failing fast] cannot reach them and gloo has no
  abort that ends a pending collective (``ProcessGroup.abort`` and ``shutdown`` leave its
  sockets open: a peer waits until the failed rank's process exits). So the expert group and
  the tp ranks sharing a batch wait at most the pipeline's ``timeout``
  (``ProcessGroup.set_timeout``), as every other wait of the pipeline, not the process group's
  (30 minutes by default): a peer that raised before its all-to-all and lives on fails the
  waiting ranks' step within ``timeout``, the engine's record naming their rank, stage,
  microbatch and action; a peer that dies fails them at once (its sockets close).
- PEFT: a ``PeftModel`` forwards ``ep_plan`` to the HF model inside it, whose names the plan's
  keys are; the rules are expanded on that model and prefixed with its path
  (:func:`plan_owner`), so that they name the pipelined model's modules.
- Parameters of an experts module that the plan keeps whole (:data:`LEFT_DENSE`) stay dense:
  data parallelism holds them and sums their gradients over ``dp``, which is the sum over every
  rank that computed some of the stage's (token, expert) pairs. Under a ``tp`` dim HF's dispatch
  slices the batch over the tp ranks too, so their gradients would need a sum over ``tp`` that
  the tp ranks' check skips inside experts modules: refused there.
- Tensor parallelism beside it: the tp plan keeps no rule on the experts modules (HF drops tp
  rules on what its ep plan covers), the tp ranks' partial-gradient check skips them, and HF's
  dispatch slices each tp group's shared batch over its ranks before the all-to-all (a token is
  computed once) and gathers the outputs back. The global norm counts each expert once: the
  experts' part is summed over ``dp`` first, and over ``tp`` with the tp-replicated rest.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import timedelta

import torch
from torch import nn

from pippy_xla._native import _C
from pippy_xla.hf_compat import expert_parallel_api
from pippy_xla.runtime.data_parallel import copy_from_first, local_tensor
from pippy_xla.split.partition import UnsupportedModelError

__all__ = [
    "EXPERT_STYLES",
    "ExpertLayout",
    "ExpertParallel",
    "expert_layout",
    "expert_rules",
    "layer_ep_plan",
]

_DISPATCH = "ep_dispatch_experts"
EXPERT_STYLES = ("grouped_gemm", _DISPATCH)
"""HF's expert-parallel styles the pipeline applies (from the model's ``ep_plan``): the experts'
parameters sharded by expert (dim 0), the experts module reached through HF's dispatch."""
LEFT_DENSE = ("replicated_with_grad_allreduce",)
"""HF's expert-parallel styles the pipeline leaves to data parallelism: a parameter of an experts
module kept whole on every rank (MuseSpark's ``post_expert_norm``, applied on the expert's rank
to the expert outputs of the tokens it received), whose gradient on a rank covers the (token,
expert) pairs that rank computed. Each pair is computed on exactly one rank of the stage's dense
group, so the sum over ``dp`` that data parallelism makes of every dense gradient is HF's
all-reduce (see [Note: pipeline x expert parallel]); HF's own style, which all-reduces over the
expert group, is not installed."""


def plan_owner(model: nn.Module) -> tuple[nn.Module, str]:
    """The module whose class defines HF's ``ep_plan`` (the outermost), whose names the plan's
    keys are, and the prefix of its names in ``model``: ``(model, "")``, or the HF model inside a
    wrapper (PEFT's ``PeftModel``, which only forwards the attribute: ``"base_model.model."``)."""
    for name, module in model.named_modules():
        if any("ep_plan" in vars(c) for c in type(module).__mro__):
            return module, f"{name}." if name else ""
    return model, ""


def expert_rules(
    model: nn.Module, prefixes: tuple[str, ...], skip: Sequence[str] = ()
) -> dict[str, str]:
    """The model's expert-parallel rules (``model.ep_plan``, expanded, named in ``model``: see
    :func:`plan_owner`) inside the decoder layers (``prefixes``) that belong to an experts
    module (an ``ep_dispatch_experts`` rule) on which no key of ``skip`` (another plan's keys,
    with ``*``) sets a rule: none at the module, under it or above it. Their styles are not
    checked here."""
    hf = expert_parallel_api()
    owner, at = plan_owner(model)
    ep = hf.ep_plan(owner)

    def related(key: str, root: str) -> bool:
        return key == root or key.startswith(f"{root}.") or root.startswith(f"{key}.")

    roots = [k for k, v in ep.items() if v == _DISPATCH]
    free = [r for r in roots if not any(related(k, r) for k in skip)]
    rules = {k: v for k, v in ep.items() if any(k == r or k.startswith(f"{r}.") for r in free)}
    if not rules:
        return {}
    expanded = {f"{at}{k}": v for k, v in hf.expand_plan(owner, rules).items()}
    return {k: v for k, v in expanded.items() if k.startswith(prefixes)}


def layer_ep_plan(
    model: nn.Module, layer_names: Sequence[str], ep: int, dense_size: int, tp_size: int
) -> dict[str, str]:
    """The expert-parallel plan over the decoder layers ``layer_names`` (every layer of the model,
    so that every rank checks the same): concrete module and parameter names -> HF style.
    ``dense_size``: the ranks that run one stage (``dp x tp``). Raises, in one line naming the
    numbers, ``NotImplementedError`` on a transformers release without HF's all-to-all
    dispatch, ``UnsupportedModelError`` for a model without an expert plan, without a dispatch
    rule inside its decoder layers, or with a style the pipeline does not apply, and
    ``ValueError`` for an ``ep`` that does not fit the ranks or the experts."""
    label = f"expert_parallel={ep}"
    name = type(model).__name__
    expert_parallel_api()  # the release has HF's dispatch
    if ep % tp_size or dense_size % ep:
        raise ValueError(
            f"{label}: the expert ranks are drawn from the {dense_size} ranks that run a stage "
            f"(dp x tp, tp={tp_size}); HF's rule: ep a multiple of tp that divides dp x tp; "
            "choose such an expert_parallel"
        )
    own = expert_parallel_api().ep_plan(plan_owner(model)[0])
    if not own:
        raise UnsupportedModelError(
            f"{label}: {name} has no HF expert-parallel plan (config.base_model_ep_plan is "
            "empty): its experts cannot be sharded; drop expert_parallel"
        )
    prefixes = tuple(f"{n}." for n in layer_names)
    rules = expert_rules(model, prefixes)
    if not any(v == _DISPATCH for v in rules.values()):
        raise UnsupportedModelError(
            f"{label}: {name}'s expert-parallel plan {own} has no {_DISPATCH!r} rule inside its "
            f"decoder layers ({layer_names[0]}, ...): nothing the pipeline can dispatch to; "
            "drop expert_parallel"
        )
    odd = sorted({v for v in rules.values() if v not in (*EXPERT_STYLES, *LEFT_DENSE)})
    if odd:
        where = next(k for k, v in rules.items() if v == odd[0])
        raise UnsupportedModelError(
            f"{label}: {name}'s expert-parallel plan uses style(s) {odd} (e.g. {where}), which "
            f"the pipeline does not apply yet; covered: {[*EXPERT_STYLES, *LEFT_DENSE]}"
        )
    _refuse_adapted_experts(model, rules, label)
    dense = next((k for k, v in rules.items() if v in LEFT_DENSE), None)
    if dense is not None and tp_size > 1:
        raise UnsupportedModelError(
            f"{label}: {name}'s expert-parallel plan keeps {dense} whole "
            f"({rules[dense]}), whose gradient a tp dim of {tp_size} would leave partial: not "
            "supported yet beside tensor parallelism; use a mesh without a 'tp' dim"
        )
    params = dict(model.named_parameters())
    for key, style in rules.items():
        p = params.get(key)
        if style == "grouped_gemm" and p is not None and p.shape[0] % ep:
            raise ValueError(
                f"{label}: {key} holds {p.shape[0]} experts, which do not divide by "
                f"expert_parallel={ep}; choose an expert_parallel that divides the number of "
                "experts"
            )
    return rules


def _refuse_adapted_experts(model: nn.Module, rules: dict[str, str], label: str) -> None:
    """Refuses, in one line, a PEFT tuner layer on an experts module the plan shards (LoRA's
    ``target_parameters`` on the experts' parameters): PEFT's ``ParamWrapper`` forms the LoRA
    update of every expert and adds it to the whole parameter through a parametrization, and its
    ``lora_B`` holds the experts interleaved in its columns (``r x E``, expert inner), so no shard
    of it holds whole experts as HF's plan shards them."""
    named = dict(model.named_modules())
    for key, style in rules.items():
        module = named.get(key) if style == _DISPATCH else None
        if module is None:
            continue
        adapted = [n for n, m in module.named_modules() if hasattr(m, "get_base_layer")]
        if adapted:
            where = f"{key}.{adapted[0]}".rstrip(".")
            raise NotImplementedError(
                f"{label}: PEFT adapts {where}, an experts module that HF's expert plan shards "
                "by expert (LoRA on the experts' parameters, target_parameters): not supported "
                "beside expert parallelism (PEFT's update covers every expert, its lora_B holds "
                "them interleaved); adapt other modules (target_modules) or drop expert_parallel"
            )


@dataclass(frozen=True, slots=True)
class ExpertLayout:
    """The meshes of one rank's expert groups (see [Note: pipeline x expert parallel])."""

    ep_mesh: object
    """The expert group: ``ep`` ranks running one stage, each with ``E / ep`` experts."""
    batch_mesh: object
    """The ranks of the expert group that share one batch (the tp ranks; one rank without tp):
    HF's ``tp_mesh`` of ``AllToAllEP``."""
    efsdp_mesh: object
    """The ranks holding the same experts (``dp x tp / ep`` of them)."""

    @property
    def ep_rank(self) -> int:
        return self.ep_mesh.get_local_rank()

    @property
    def efsdp_size(self) -> int:
        return self.efsdp_mesh.size()


_LAYOUTS: dict[tuple[int, int], tuple[weakref.ref, ExpertLayout]] = {}
"""Layouts made, by ``(id(dense mesh), ep)``: a second pipeline on the same mesh reuses the
groups of the first (torch's DTensor caches its decisions by mesh equality: equal meshes must
not stand for other groups)."""


def expert_layout(dense_mesh, ep: int, tp_size: int) -> ExpertLayout:
    """The expert meshes cut out of ``dense_mesh`` (the 1-D mesh of the ranks that run a stage,
    ``tp`` inner): ``(efsdp, ep / tp, tp)`` by torch's ``_unflatten``, the expert mesh its last
    two dims flattened. A collective over every rank of the job (new process groups), made once
    per mesh and ``ep``."""
    key = (id(dense_mesh), ep)
    held = _LAYOUTS.get(key)
    if held is not None and held[0]() is dense_mesh:
        return held[1]
    efsdp = dense_mesh.size() // ep
    cut = dense_mesh._unflatten(
        0, (efsdp, ep // tp_size, tp_size), ("efsdp", "ep_replicas", "ep_batch")
    )
    ep_mesh = cut["ep_replicas", "ep_batch"]._flatten(f"ep{ep}_of_{dense_mesh.mesh_dim_names[0]}")
    layout = ExpertLayout(ep_mesh=ep_mesh, batch_mesh=cut["ep_batch"], efsdp_mesh=cut["efsdp"])
    _LAYOUTS[key] = (weakref.ref(dense_mesh), layout)
    return layout


class ExpertParallel:
    """This rank's experts sharded over its expert group, and their gradients' reduction. See
    [Note: pipeline x expert parallel]."""

    def __init__(
        self,
        groups,
        ep: int,
        model: nn.Module,
        plan: dict[str, str],
        local_layers: Mapping[int, Sequence[str]],
        timeout_ms: int,
        device: torch.device,
        build_key: int,
    ) -> None:
        """``groups``: the rank's :class:`~pippy_xla.runtime.data_parallel.MeshGroups`;
        ``plan``: :func:`layer_ep_plan`'s; ``local_layers``: the decoder layers' names of each
        local stage; ``build_key``: the digest of this rank's pipeline,
        which the replicas must agree on before any expert is exchanged."""
        self.size = ep
        self._timeout_ms = timeout_ms
        self._device = str(device)
        self._dp_group_name = groups.dp_group.group_name
        self._dp_rank, self._dp_size = groups.dp_rank, groups.dp_size
        self._agree_on(build_key)
        dense = groups.dp_mesh
        if groups.tp_mesh is not None:  # the stage's dp x tp ranks, tp inner
            dims = (*groups.dp_mesh.mesh_dim_names, *groups.tp_mesh.mesh_dim_names)
            dense = groups.mesh[dims]._flatten()
        self.layout = expert_layout(dense, ep, groups.tp_size)
        for mesh in (self.layout.ep_mesh, self.layout.batch_mesh):  # see the note's Failures
            set_timeout = getattr(mesh.get_group(), "set_timeout", None)  # torch 2.x has it
            if mesh.size() > 1 and set_timeout is not None:
                set_timeout(timedelta(milliseconds=timeout_ms))
        named = dict(model.named_modules())
        self._experts: dict[int, list[nn.Module]] = {}
        """Each local stage's experts modules."""
        self._sharded: dict[int, list[tuple[nn.Module, str]]] = {}
        """Each local stage's expert parameters sharded by expert: (module, parameter name)."""
        mine: dict[str, str] = {}
        for stage, names in local_layers.items():
            prefixes = tuple(f"{n}." for n in names)
            rules = {k: v for k, v in plan.items() if k.startswith(prefixes)}
            self._experts[stage] = [named[k] for k, v in rules.items() if v == _DISPATCH]
            self._sharded[stage] = [
                (named[k.rpartition(".")[0]], k.rpartition(".")[2])
                for k, v in rules.items()
                if v != _DISPATCH and v not in LEFT_DENSE and k.rpartition(".")[0] in named
            ]
            mine |= {k: v for k, v in rules.items() if v not in LEFT_DENSE}
        self._start([m for ms in self._experts.values() for m in ms])
        if mine:
            expert_parallel_api().apply_experts(
                model, self.layout.ep_mesh, mine, self.layout.batch_mesh
            )
        self._efsdp_name = self.layout.efsdp_mesh.get_group().group_name

    def _agree_on(self, build_key: int) -> None:
        """Checks that every replica built the same pipeline (``build_key``, its digest), before
        any expert is exchanged."""
        everyone = _C.all_gather_int64(
            [build_key],
            self._dp_group_name,
            self._device,
            self._timeout_ms,
            f"[replica {self._dp_rank}] expert-parallel build handshake",
        )
        if any(k != [build_key] for k in everyone):
            raise RuntimeError(
                f"[replica {self._dp_rank}] the pipeline replicas built different pipelines "
                "(model, layer ranges, schedule, microbatches, inputs or expert_parallel "
                "differ); every rank must wrap the same model with the same arguments"
            )

    def _start(self, experts: Sequence[nn.Module]) -> None:
        """Every replica cuts its experts out of the first replica's (see the note's Start): the
        ``experts`` modules' parameters broadcast over ``dp``, before sharding."""
        with torch.no_grad():
            for module in experts:
                for name, t in module.named_parameters():
                    t.copy_(
                        _C.broadcast_copy(
                            t.detach(),
                            0,
                            self._dp_group_name,
                            self._timeout_ms,
                            f"expert-parallel start: broadcast of {name}",
                        )
                    )

    def _params_of(self, stage: int) -> list[nn.Parameter]:
        """Local ``stage``'s expert parameters sharded by expert, now (not those the plan keeps
        whole: :data:`LEFT_DENSE`)."""
        return [
            m._parameters[n] for m, n in self._sharded[stage] if m._parameters.get(n) is not None
        ]

    @property
    def params(self) -> list[nn.Parameter]:
        """This rank's expert parameters (DTensors sharded by expert over the expert group),
        now."""
        return [p for stage in self._sharded for p in self._params_of(stage)]

    def reduce(self, stage: int) -> None:
        """Sums the gradients of local ``stage``'s experts over the ranks holding the same
        experts (the efsdp group; nothing to do when there is one copy of each)."""
        if self.layout.efsdp_size == 1:
            return
        for p in self._params_of(stage):
            if p.grad is not None:
                g = local_tensor(p.grad)
                g.copy_(
                    _C.all_reduce_sum_copy(
                        g, self._efsdp_name, self._timeout_ms, "expert gradient sum over efsdp"
                    )
                )

    def norm_part(self) -> tuple[list[torch.Tensor], list[tuple]]:
        """The local expert gradients this rank counts in the global norm (on the first copy
        of each, efsdp rank 0) and the reduction that combines them over the ranks that run
        the stage (every expert once, every rank the same sum), as
        :func:`~pippy_xla.runtime._grads.global_norm` takes a part."""
        first = self.layout.efsdp_mesh.get_local_rank() == 0
        counted = [local_tensor(p.grad) for p in self.params if p.grad is not None and first]

        def dense_sum(t: torch.Tensor, what: str) -> torch.Tensor:
            where = f"{what} over the experts' ranks"
            return _C.all_reduce_sum_copy(t, self._dp_group_name, self._timeout_ms, where)

        return counted, [(dense_sum, self._dp_rank, self._dp_size)]


class ExpertSharding:
    """[Note: planning under expert parallelism]

    The planner's view of expert parallelism on a ``(dp, pp)`` mesh (``px.plan(...,
    expert_parallel=ExpertSharding(mesh, ep))``), as :class:`~pippy_xla.LayerSharding` is its
    view of tensor parallelism (the same protocol, ``plan/profiler.Sharding``): the ranks of the
    first expert group of the first pipeline position (``dp`` ranks ``0 .. ep - 1`` of stage 0)
    profile together, each decoder layer's experts sharded by the model's expert plan over them
    as the build shards them (:func:`layer_ep_plan`, HF's ``apply_expert_parallelism`` with the
    all-to-all), so a MoE layer's costs are an expert rank's: its static bytes hold ``E / ep`` of
    its experts (with their gradients and optimizer state) and the dense weights whole, its time
    includes the all-to-alls of the routed tokens, its saved and transient bytes those of the
    tokens its experts received. Each profiling rank runs the same profiling batch, a replica's
    microbatch: the plan is a replica's (``batch_size`` its rows), every replica holding the
    same. Those bytes follow the router: the ranks whose experts it favours hold more (measured
    on a tiny Mixtral: 0.78 MB more on one stage's busier rank than on the other, 7% of its
    peak), so each cost is the largest over the profiling ranks (``profiler._worst_over``) and
    the plan holds for the busiest expert rank; the others stay under it. The first rank plans
    and broadcasts its plan to every rank; ``Plan.ep_size`` records the degree, and a pipeline
    with another ``expert_parallel`` refuses the plan. Not modelled: the sum of the copies'
    expert gradients when ``ep < dp`` (once per step, after the last backward), and a router
    that sends the training batches' tokens elsewhere than the profiling batch's."""

    def __init__(
        self,
        mesh,
        expert_parallel: int,
        *,
        dp_dim: str = "dp",
        pp_dim: str = "pp",
        timeout: float = _C.DEFAULT_TIMEOUT_MS / 1000,
    ) -> None:
        """``mesh``: the ``(dp, pp)`` ``DeviceMesh`` the pipeline will be built on;
        ``expert_parallel``: its ``expert_parallel``; ``timeout``: seconds a broadcast of the
        profiled layers' values may take. A collective over the mesh (the expert groups)."""
        import torch.distributed as dist

        from pippy_xla.runtime.data_parallel import mesh_groups

        groups = mesh_groups(mesh, pp_dim, dp_dim, None)
        if groups.dp_mesh is None or groups.dp_mesh.ndim != 1:
            raise ValueError(f"ExpertSharding needs a mesh with one {dp_dim!r} dim; got {mesh}")
        self.layout = expert_layout(groups.dp_mesh, expert_parallel, 1)
        self._dense_size = groups.dp_size
        self._group = self.layout.ep_mesh.get_group()
        self._timeout_ms = int(timeout * 1000)
        self.size: int = 1
        """The tensor-parallel degree (none)."""
        self.expert_parallel: int = expert_parallel
        self.profiles: bool = (
            self.layout.efsdp_mesh.get_local_rank() == 0 and dist.get_rank(groups.pp_group) == 0
        )
        """Whether this rank profiles (the first expert group of the first stage)."""
        self.first_rank: int = int(mesh.mesh.flatten()[0])

    def shard(self, model: nn.Module, layer_names: Sequence[str]) -> None:
        """Shards the experts of ``model``'s decoder layers ``layer_names`` in place over the
        expert group (their values its first rank's), as the build does."""
        plan = layer_ep_plan(model, layer_names, self.expert_parallel, self._dense_size, 1)
        copy_from_first(model, self._group.group_name, self._timeout_ms)
        mine = {k: v for k, v in plan.items() if v not in LEFT_DENSE}
        expert_parallel_api().apply_experts(
            model, self.layout.ep_mesh, mine, self.layout.batch_mesh
        )

    def loss_context(self) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()

    def gather(self, value: object) -> list:
        """``value`` of every profiling rank, in expert-rank order."""
        import torch.distributed as dist

        out: list = [None] * self.expert_parallel
        dist.all_gather_object(out, value, group=self._group)
        return out
