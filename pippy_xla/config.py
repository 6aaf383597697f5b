"""``PipelineConfig``: how a model is pipelined, validated once.

Everything :class:`~pippy_xla.PipelineModel` takes besides the model, its decoder-layer class and
the process groups is a field here, with its default and its meaning in one place. ``PipelineModel``
accepts either a config (``config=PipelineConfig(...)``) or the same fields as keyword arguments.
What can be checked without the process group is checked in ``__post_init__``; what needs the
group or the model (the stage count, the layer count, the device) is checked by
:func:`pippy_xla.runtime._build.build`.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Any

import torch

from pippy_xla._native import _C
from pippy_xla.runtime.data_parallel import DATA_PARALLEL_MODES

if TYPE_CHECKING:
    from pippy_xla.plan.planner import Plan

__all__ = ["LossFn", "PipelineConfig"]

LossFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
"""``loss_fn(logits, labels, num_items) -> loss`` of one microbatch."""


TRANSPORTS = ("auto", "shm", "process_group", "in_order")
"""The values of :attr:`PipelineConfig.transport`."""


@dataclass(kw_only=True, slots=True)
class PipelineConfig:
    """How a model is pipelined: schedule, microbatches, stage layout, checkpointing, loss,
    timeouts, device, compilation, data, tensor and expert parallelism."""

    num_microbatches: int
    """Microbatches per step; the batch size must be divisible by it (on a mesh: by it times the
    number of replicas)."""
    schedule: str | _C.Schedule = "1f1b"
    """``"1f1b"``, ``"gpipe"``, ``"interleaved"`` (``chunks`` stages per rank, stage ``s`` on rank
    ``s % ranks``), ``"zbh1"`` (zero-bubble ZB-H1: backward split into input- and weight-gradient
    steps), ``"looped_bfs"``, ``"interleaved_zb"``, ``"zbv"`` or ``"dualpipev"`` (two stages per
    rank in a V: rank ``r`` runs stages ``r`` and ``2 * ranks - 1 - r``). The C++ schedule table
    lists them with their facts (``_C.schedule_table()``). Or a :class:`pippy_xla.Schedule` of
    one's own, e.g. ``Schedule.from_csv(text)`` (torch.distributed.pipelining's CSV format) for the
    pipeline's ranks and ``num_microbatches``, with the same number of stages on every rank."""
    chunks: int | None = None
    """Stages per rank; ``None`` means the schedule's default (2 for the schedules with several
    stages per rank, else 1)."""
    layer_ranges: Sequence[tuple[int, int]] | None = None
    """An explicit half-open ``(start, stop)`` decoder-layer range per stage (default: balanced,
    earlier stages get the extra layers). Exclusive with ``plan``."""
    plan: Plan | None = None
    """A :class:`~pippy_xla.plan.planner.Plan` (from :func:`pippy_xla.plan`) made for this schedule,
    microbatch count and chunk count: its layer ranges and its checkpointed layers.
    ``PipelineModel(model, plan=plan, ...)`` (or :meth:`from_plan`) takes the schedule, microbatch
    count and chunk count from the plan."""
    checkpoint_layers: Sequence[int] = ()
    """Decoder layers (global indices) run under activation checkpointing: their activations are
    recomputed in backward instead of kept. Exclusive with ``plan``, which chooses its own."""
    input_names: Sequence[str] = ("input_ids", "attention_mask")
    """The model keyword inputs a batch provides (besides ``labels``)."""
    loss_fn: LossFn | None = None
    """``loss_fn(logits, labels, num_items) -> loss`` of one microbatch, summed over its tokens and
    divided by ``num_items`` (the batch's count of valid tokens), so that the microbatch losses add
    up to the batch mean. ``None``: the HF model's own loss."""
    num_items_fn: Callable[[torch.Tensor], torch.Tensor] | None = None
    """Counts the items ``loss_fn`` averages over in the whole batch's labels. ``None``: for a
    model whose own HF loss is the causal-LM loss, the labels other than -100 after the shift
    (``(labels[..., 1:] != -100).sum()``); any other model must name its count (an error at
    construction otherwise), e.g. ``lambda labels: torch.tensor(labels.shape[0])`` for a loss
    averaged over rows."""
    transport: str = "auto"
    """How the ranks exchange activations and gradients: ``"auto"`` moves CPU tensors between
    ranks of one host through shared memory (no socket, no helper thread; see [Note: same-host
    transport] in ``csrc/transport/shm.h``) and uses the process group's send and receive otherwise
    (between hosts, on CUDA, or where ``/dev/shm`` is unusable); ``"shm"`` is the same but an
    error unless every pair of CPU ranks shares the host; ``"process_group"`` always uses the
    group's send and receive (gloo on CPU); ``"in_order"`` uses send and receive matched in
    posting order, over two groups of the pipeline's ranks (one per direction) with the boundary
    headers over a gloo group: what NCCL needs, and so what ``"auto"`` does on CUDA; on the CPU it
    runs that path over gloo (see [Note: transfers matched in order] in
    ``csrc/runtime/engine.h``)."""
    transport_spin_us: int | None = None
    """How many microseconds a same-host wait polls for its message before it sleeps (a sleeping
    receiver costs each transfer 20-50 us to wake). ``None``: ``_C.SHM_SPIN_US`` (2000) where
    every rank of the host, with its intra-op threads, has a CPU of its own (ranks counted by the
    group and by torchrun's ``LOCAL_WORLD_SIZE``), else 0; set 0 where other jobs share the
    cores. A setting of the group's transport: the last pipeline built on the group that sets it
    wins. See [Note: spinning before sleeping] in ``csrc/transport/shm.cpp``."""
    timeout: float = _C.DEFAULT_TIMEOUT_MS / 1000
    """Seconds any single wait on a peer may take before the step fails."""
    check_batch_content: bool = True
    """Before each step, compare a 64-bit digest of the batch's values between the ranks (besides
    its shapes and the kind of step), so that ranks given other rows fail at once instead of
    training on mismatched inputs and labels (see [Note: step handshake]). Costs one pass over
    the batch's bytes per step (``benchmarks/batch_digest.py``); ``False`` turns it off."""
    device: torch.device | str | None = None
    """Where the local stage and every buffer the runtime allocates live. ``None``:
    ``cuda:LOCAL_RANK`` when the group's backend is NCCL, else the CPU (gloo)."""
    compile: bool = False
    """Compile each local stage with ``torch.compile``; steps after the first reuse the compiled
    code, and a recompilation is logged with its cause (see [Note: stable stage graphs])."""
    compile_options: dict | None = None
    """Keyword arguments for ``torch.compile`` (used with ``compile=True``). Under a schedule that
    splits the backward, the default backend (inductor) is pippy_xla's split backend, which gives
    W a graph of its own; ``mode`` and ``options`` configure its inductor ([Note: compiled W])."""
    data_parallel: str = "replicate"
    """With a mesh: ``"replicate"`` (every replica holds its stage whole) or ``"shard"`` (FSDP2's
    ``fully_shard``: parameters, gradients and optimizer state sharded over the replicas; with
    two data-parallel dims, FSDP2's HSDP: sharded over the second, replicated over the
    first)."""
    pp_dim: str = "pp"
    """The mesh's pipeline dimension."""
    dp_dim: str | tuple[str, str] = "dp"
    """The mesh's data-parallel dimension, or two of them ``(replicate, shard)`` for hybrid
    sharding (HSDP), e.g. ``("dp_replicate", "dp_shard")`` as torchtitan names them, in the
    mesh's order: the replicas are every rank of both (see [Note: pipeline x data parallel])."""
    tp_dim: str = "tp"
    """The mesh's tensor-parallel dimension (a 3-D mesh ``(dp, pp, tp)``)."""
    cp_dim: str = "cp"
    """The mesh's context-parallel dimension: a mesh ``(cp, pp)``, ``(cp,)`` or ``(dp, cp, pp)``
    shares every row's tokens over its ``cp`` ranks, attention exact across the shares (see
    [Note: pipeline x context parallel] in ``runtime/context_parallel.py``)."""
    tensor_parallel: str | dict[str, str] | None = None
    """With a mesh that has a ``tp_dim``: ``"auto"`` applies the model's own HF tensor-parallel
    plan (``model.tp_plan``: ``config.base_model_tp_plan`` and the model class's own) to each
    stage's decoder layers over the mesh's tensor-parallel dimension, through transformers' and
    torch's DTensor machinery (see [Note: pipeline x tensor parallel] in
    ``runtime/tensor_parallel.py``). A dict of rules ``{key: style}`` is merged over that plan as
    HF merges ``DistributedConfig(tp_plan={...})``: keys name modules relative to the model
    passed, like ``model.tp_plan``'s, or to its base model, like ``config.base_model_tp_plan``'s,
    with ``*`` for the layer index (``"model.layers.*.mlp.up_proj"``, ``"layers.*.mlp.up_proj"``);
    a key of the model's plan is overridden, a new one added (a model without a plan takes the
    dict alone), ``"replicate"`` keeps a module whole, ``{}`` applies no rule.
    ``None``: no tensor parallelism (a mesh's ``tp_dim``, if any, must then have size 1)."""
    expert_parallel: int | None = None
    """With a mesh: the expert-parallel degree ``ep``. Each stage's MoE experts are sharded over
    ``ep`` of the ranks that run that stage (drawn from its data-parallel, and tensor-parallel,
    ranks: HF's layout, ``ep`` a multiple of ``tp`` dividing ``dp x tp``), each holding ``E / ep``
    experts of every MoE layer whole, by the model's own HF expert plan (``model.ep_plan``);
    routed tokens travel to their experts' rank and back by all-to-all (see [Note: pipeline x
    expert parallel] in ``runtime/expert_parallel.py``). ``None`` (or 1): experts are held like
    the other weights."""

    def __post_init__(self) -> None:
        m = self.num_microbatches
        if isinstance(m, bool) or not isinstance(m, int) or m < 1:
            raise ValueError(f"num_microbatches must be a positive int, got {m!r}")
        if isinstance(self.schedule, _C.Schedule):
            self._check_own_schedule()
        elif self.schedule not in _C.train_schedule_names():
            raise ValueError(
                f"schedule must be one of {_C.train_schedule_names()} or a pippy_xla.Schedule, "
                f"got {self.schedule!r}"
            )
        if self.chunks is None:
            self.chunks = _C.default_chunks(self.schedule)
        if isinstance(self.chunks, bool) or not isinstance(self.chunks, int) or self.chunks < 1:
            raise ValueError(f"chunks must be a positive int, got {self.chunks!r}")
        if self.transport not in TRANSPORTS:
            raise ValueError(f"transport must be one of {TRANSPORTS}, got {self.transport!r}")
        spin = self.transport_spin_us
        if spin is not None and (isinstance(spin, bool) or not isinstance(spin, int) or spin < 0):
            raise ValueError(f"transport_spin_us must be None or an int >= 0, got {spin!r}")
        if not (isinstance(self.timeout, int | float) and 0 < self.timeout < math.inf):
            raise ValueError(f"timeout must be a positive number of seconds, got {self.timeout!r}")
        if isinstance(self.input_names, str) or not self.input_names:
            raise ValueError(
                f"input_names must be a non-empty list of names, got {self.input_names!r}"
            )
        self.input_names = tuple(self.input_names)
        self.checkpoint_layers = tuple(self.checkpoint_layers)
        if self.layer_ranges is not None:
            self.layer_ranges = tuple(tuple(r) for r in self.layer_ranges)
        if self.plan is not None:
            self._check_plan()
        for name in ("loss_fn", "num_items_fn"):
            fn = getattr(self, name)
            if fn is not None and not callable(fn):
                raise TypeError(f"{name} must be callable, got {type(fn).__name__}")
        if self.data_parallel not in DATA_PARALLEL_MODES:
            raise ValueError(
                f"data_parallel must be one of {DATA_PARALLEL_MODES}, got {self.data_parallel!r}"
            )
        self._check_dp_dim()
        dims = (*self.dp_dims, self.pp_dim, self.tp_dim, self.cp_dim)
        if len(set(dims)) != len(dims):
            raise ValueError(f"dp_dim, pp_dim and tp_dim must differ, and cp_dim too; got {dims}")
        self._check_tensor_parallel()
        ep = self.expert_parallel
        if ep is not None and (isinstance(ep, bool) or not isinstance(ep, int) or ep < 1):
            raise ValueError(f"expert_parallel must be None or a positive int, got {ep!r}")

    @property
    def schedule_name(self) -> str:
        """The schedule's name (a :class:`pippy_xla.Schedule`'s own)."""
        return self.schedule if isinstance(self.schedule, str) else self.schedule.name

    @property
    def dp_dims(self) -> tuple[str, ...]:
        """The mesh's data-parallel dims: ``(dp_dim,)``, or ``(replicate, shard)`` for HSDP."""
        return (self.dp_dim,) if isinstance(self.dp_dim, str) else self.dp_dim

    def _check_dp_dim(self) -> None:
        dims = self.dp_dim
        if not isinstance(dims, str):
            dims = tuple(dims) if isinstance(dims, list | tuple) else (dims,)
            if len(dims) == 1:
                dims = dims[0]
        names = (dims,) if isinstance(dims, str) else dims
        if len(names) > 2 or not all(isinstance(n, str) for n in names):
            raise ValueError(
                "dp_dim must be a mesh dim's name, or two names (replicate, shard) for hybrid "
                f"sharding such as ('dp_replicate', 'dp_shard'); got {self.dp_dim!r}"
            )
        self.dp_dim = dims

    def _check_tensor_parallel(self) -> None:
        rules = self.tensor_parallel
        if isinstance(rules, dict):
            bad = [k for k in rules if not isinstance(k, str)]
            if bad:
                raise TypeError(
                    f"tensor_parallel's keys must be module names (str), got {bad[0]!r}"
                )
            self.tensor_parallel = dict(rules)  # the caller's dict may change later
        elif rules not in (None, "auto"):
            raise ValueError(
                "tensor_parallel must be None, 'auto' or a dict of HF rules {key: style}, "
                f"got {rules!r}"
            )

    def _check_own_schedule(self) -> None:
        s = self.schedule
        if not s.backward:
            raise ValueError(f"schedule {s.name!r} has no backward actions: it cannot train")
        if s.num_microbatches != self.num_microbatches:
            raise ValueError(
                f"schedule {s.name!r} runs {s.num_microbatches} microbatches but "
                f"num_microbatches={self.num_microbatches}"
            )
        if s.num_stages % s.num_ranks:
            raise ValueError(
                f"schedule {s.name!r} puts {s.num_stages} stages on {s.num_ranks} ranks; every "
                "rank must run the same number of stages"
            )
        per_rank = s.num_stages // s.num_ranks
        if self.chunks not in (None, per_rank):
            raise ValueError(
                f"chunks={self.chunks} but schedule {s.name!r} runs {per_rank} stages per rank"
            )
        self.chunks = per_rank

    def _check_plan(self) -> None:
        plan = self.plan
        if self.layer_ranges is not None:
            raise ValueError("pass either plan=... or layer_ranges=..., not both")
        if self.checkpoint_layers:
            raise ValueError(
                "pass either plan=... or checkpoint_layers=..., not both (the plan chooses the "
                "checkpointed layers)"
            )
        made_for = (plan.schedule, plan.num_microbatches, plan.chunks)
        if made_for != (self.schedule, self.num_microbatches, self.chunks):
            raise ValueError(
                f"the plan was made for schedule {plan.schedule!r} with "
                f"{plan.num_microbatches} microbatches and {plan.chunks} stage(s) per rank, but "
                f"this pipeline runs {self.schedule!r} with {self.num_microbatches} and "
                f"{self.chunks}: what each rank holds when differs, so its memory prediction "
                f"would not hold; plan with schedule={self.schedule!r}, "
                f"num_microbatches={self.num_microbatches}, chunks={self.chunks}"
            )

    @classmethod
    def from_plan(cls, plan: Plan, **options: Any) -> PipelineConfig:
        """A config that runs ``plan``: the schedule, microbatch count and stages per rank it was
        made for, and (at build) its layer ranges and checkpointed layers; ``options`` are the
        other fields. An option that sets one of the plan's own to another value is an error."""
        made_for = {
            "schedule": plan.schedule,
            "num_microbatches": plan.num_microbatches,
            "chunks": plan.chunks,
        }
        conflicts = [
            f"{k}={options[k]!r}"
            for k, v in made_for.items()
            if options.get(k) is not None and options[k] != v
        ]
        if conflicts:
            raise ValueError(
                f"the plan was made for schedule {plan.schedule!r} with "
                f"{plan.num_microbatches} microbatches and {plan.chunks} stage(s) per rank, and a "
                f"pipeline built from it runs those; drop {', '.join(conflicts)}, or make a plan "
                "for them with pippy_xla.plan(...)"
            )
        given = dict(options)
        for k in made_for:
            if given.get(k, "") is None:
                del given[k]
        return cls(**{**made_for, **given, "plan": plan})

    @classmethod
    def from_options(cls, config: PipelineConfig | None, options: dict) -> PipelineConfig:
        """``config``, or a config made from keyword ``options`` (``PipelineModel``'s keyword
        arguments); both, or an option that is no field, is an error naming the fields."""
        names = [f.name for f in fields(cls)]
        unknown = sorted(set(options) - set(names))
        if unknown:
            raise TypeError(
                f"PipelineModel got unexpected keyword argument(s) {unknown}; the options are "
                f"{names} (the fields of PipelineConfig)"
            )
        if config is None:
            if options.get("plan") is not None:
                return cls.from_plan(**options)
            if "num_microbatches" not in options:
                raise TypeError(
                    "PipelineModel needs num_microbatches=... (or plan=..., or config=...)"
                )
            return cls(**options)
        if options:
            raise TypeError(
                f"pass either config=PipelineConfig(...) or keyword options, not both (got "
                f"config and {sorted(options)})"
            )
        if not isinstance(config, cls):
            raise TypeError(f"config must be a PipelineConfig, got {type(config).__name__}")
        return config
