"""HF's ``Trainer`` on the pipeline: :func:`PipelineTrainer`; :func:`pipelined` for a subclass.

[Note: the Trainer's loop on a pipeline] ``pipelined(trainer_cls)`` is ``trainer_cls`` (HF's
``Trainer`` or a subclass) with the steps of its loop that touch the model replaced, and nothing
else: HF's loop, logging, callbacks, learning-rate schedules, accumulation windows and seeds stay
HF's; ``PipelineTrainer`` is ``pipelined(Trainer)``.

- The pipeline is built at the end of the constructor from the model the wrapped class's own
  constructor ends with (PEFT-wrapped by TRL's ``peft_config=``, say; it may be on ``meta``); the
  Trainer keeps that model as ``self.model`` (it reads its config, forward signature and
  parameter names) and runs its loop on a handle whose parameters are this rank's stages
  (``_wrap_model``), so accelerate prepares the optimizer only (no DDP) and moves nothing
  (``_move_model_to_device``).
- A trainer whose loss is the model's own (HF's ``Trainer``, TRL's ``SFTTrainer`` with its
  negative log-likelihood; :func:`_own_loss`) trains in one pass: ``training_step`` runs
  ``pipe.run_train`` on the batch (below). Any other (TRL's ``GRPOTrainer``, ``SFTTrainer`` with
  ``loss_type="dft"``, a subclass with its own ``compute_loss``, a ``compute_loss_func``, label
  smoothing) runs its own step, in which
  calling the model (the loop's handle, or ``self.model``) runs the pipeline, in two passes
  (:class:`~pippy_xla.integrations.model_calls.ModelCalls`, see [Note: a trainer's own loss on
  the pipeline]); its ``generate`` is ``pipe.generate`` on the same pipeline (TRL's GRPO
  completions: one copy of the weights, nothing to synchronize). During such a step
  accelerate's state is one process's (``_one_process``: its gathers and process index are the
  pipeline's ranks', which hold the same data), after ``generate`` every rank takes the sampling
  rank's random state (the trainer draws from it next: TRL shuffles the completions), a trainer
  that seeded per process (TRL's ``set_seed(seed, device_specific=True)``) is seeded per replica
  (``_seed_per_replica``), and TRL's generation batch is counted over the replicas
  (``_generation_batch_per_replica``). On a mesh with data-parallel replicas each replica runs
  the step as one of ``dp`` DDP processes (``_as_processes``, ``_ReplicaShare``; its
  ``generate``, ``_Stages._generate_share``: see [Note: a trainer's own loss on replicas]).
- TRL's ``SFTTrainer`` with the model's own loss logs TRL's metrics (``entropy``,
  ``mean_token_accuracy``, ``num_tokens``) from sums its pipeline's last stage computes beside
  the loss (``_sft_sums``, ``_log_sft_metrics``; see [Note: token sums beside the loss]).
- ``training_step`` runs ``pipe.run_train`` on the batch; the loss's divisor is HF's
  ``num_items_in_batch``, the label tokens of the whole accumulation window (the pipeline's
  ``num_items_fn`` is set to it for the step), so a window's summed step losses, the logged loss
  and the gradients are HF's.
- Clipping and the logged ``grad_norm`` go through ``pipe.clip_grad_norm_`` (the whole model's
  norm, a collective).
- Mixed precision: accelerate's autocast (``bf16=True``, TRL's ``SFTConfig`` default) wraps the
  model's ``forward``, which the stages never call; the steps run the pipeline under
  ``accelerator.autocast()`` instead (without it they trained in fp32, silently: seen against
  TRL's ``SFTTrainer``, whose losses differed by 1e-5 relative until then).
- The optimizer is HF's (``TrainingArguments.optim``, its weight-decay groups by HF's rule on the
  model's names) over this rank's parameters that require grad, each group split by device mesh
  (see [Note: optimizer groups by mesh]); where the parameters are DTensors (``tp`` or ``dp``
  above 1) an ``optim`` not tested there is refused at construction (:func:`_check_optimizer`).
- Every rank is given the same batches: accelerate's data loaders are prepared as for one
  process (no ``BatchSamplerShard``), with the same seeded sampler, so the ranks see what one
  process with the same seed sees. On a mesh (``mesh=``, as ``PipelineModel`` takes it) each
  loader's batch is the global one, ``per_device_*_batch_size`` rows per data-parallel replica,
  of which ``run_train`` gives each replica its share: replica ``r`` trains on the rows that HF's
  sharded loader gives DDP rank ``r`` (the same seeded order, cut the same way), and the loss,
  the token count and the gradients are the global batch's. For a trainer's own loss on
  replicas the training loader's batch is the replica's share itself (``_ReplicaShare``: see
  [Note: a trainer's own loss on replicas]).
- ``evaluate`` runs ``pipe.run_eval`` per batch (the loss of the whole global batch on every
  rank, divided by HF's count); the loop gathers as one process does, without communication
  (every rank already holds every batch's result; accelerate's gather across all the processes
  counted each batch once per rank but the last, which it cuts to the dataset's remainder: a
  wrong mean when the last batch is short), the loss one copy per replica (HF repeats it
  ``per_device_eval_batch_size`` times: a row each). ``save_model`` writes
  ``pipe.save_pretrained`` (HF's format, PEFT's for a PEFT model) from every rank together.
- A subclass's override of a step the pipeline replaces (``EXTENDED``: checkpoint saving and
  loading, ``save_model``) still runs, its ``super()`` call reaching the pipeline's version
  (``_extended``): what TRL's ``GRPOTrainer`` adds when it resumes is kept.
- Checkpoints (``save_strategy``): HF's checkpoint directory, with the model and optimizer state
  in a pipeline checkpoint of its own (``pipeline/``: ``pipe.save``, every rank's part) instead
  of ``optimizer.pt``; HF's scheduler, RNG (per rank) and trainer-state files as HF writes them.
  ``train(resume_from_checkpoint=...)`` reads them back (``pipe.load``) at the point where HF
  loads the optimizer.
- Packed sequences (TRL's ``packing=True``): TRL's padding-free collator flattens a batch into
  one row, which cannot be cut into microbatches. Its batches are given as rows instead
  (``_PackedRows``): each packed example a padded row whose ``position_ids`` restart at every
  document and without an ``attention_mask``, so that HF's mask factories build one causal block
  per document on every stage (they detect packing from the positions when there is no mask;
  padding, at position 0, is a document of its own token, which no label reads); the pipeline
  takes ``position_ids`` in place of ``attention_mask``. The tokens, labels, positions and
  masks are the padding-free batch's, so the loss and the token count are TRL's.
- ``gradient_checkpointing=True`` (TRL's ``SFTConfig`` default) checkpoints every decoder layer in
  the pipeline (``checkpoint_layers``), unless the ``PipelineConfig`` names its own.
- A batch with too few rows for the microbatches (an epoch's short last batch, a packed
  dataset's) gets rows that copy its last one, every label ignored (``_batch``): nothing changes
  in the loss or the gradients (an MoE router's loss would see the extra rows).
- On a mesh with context parallelism (``cp``: every row's tokens shared head-tail over the cp
  ranks, see [Note: pipeline x context parallel]) a batch's rows are lengthened at their end to
  a multiple of ``2 cp`` tokens (``_whole_chunks``: labels ignored, attention mask 0, positions
  going on), which under the causal mask changes no other token's output, the loss or the token
  count; packed rows keep their per-document masks, which HF's mask factories build from the
  whole row's positions on every cp rank. ``evaluate``'s logits are every token's (gathered
  over ``cp`` by ``run_eval``), cut back to the batch's length.
- What the pipeline cannot honour is refused at construction, in one line: DeepSpeed, FSDP,
  ``torch_compile`` (``compile=True`` there), a batch size not divisible by the microbatches,
  fp16, ``model_init``, ``save_only_model``, a loss of the trainer's own on a cp mesh.
- ``compute_metrics`` gets the batch's logits and labels on every rank: each replica's last
  stage runs ``preprocess_logits_for_metrics`` on its share (HF's loop would run it on every
  rank, after the logits left the last stage), which goes to the replica's ranks, then to every
  replica.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import sys
from typing import Any

import torch
from torch import nn

from pippy_xla.integrations.model_calls import random_state, set_random_state

__all__ = ["PipelineTrainer", "pipelined"]


class _Stages(nn.Module):
    """What the Trainer's loop holds as its model: this rank's stages of the pipeline. Called
    (by a trainer's own loss: ``calls``), it runs the pipeline; ``generate`` is the pipeline's;
    ``train`` and ``eval`` set the pipeline's mode and the HF model's flag, which trainers read."""

    is_gradient_checkpointing = False  # the pipeline's own checkpointing, not HF's (TRL reads it)
    replica_step = False
    """Whether a replica's own step runs (``_as_processes`` on a mesh with replicas): its
    ``generate`` calls bring the replica's own prompts, not the global batch."""

    def __init__(self, pipe, model, calls) -> None:
        super().__init__()
        # Not submodules: the parameters are the pipeline's, listed below.
        for name, value in (("pipe", pipe), ("model", model), ("calls", calls)):
            object.__setattr__(self, name, value)

    def parameters(self, recurse: bool = True):
        return self.pipe.parameters()

    def named_parameters(self, *args: Any, **kwargs: Any):
        return self.pipe.named_parameters()

    def train(self, mode: bool = True) -> _Stages:
        self.pipe.train(mode)
        self.model.train(mode)
        return self

    def _get_name(self) -> str:
        """The HF model's class name, which HF's Trainer reads (it shifts the labels of a causal
        LM for label smoothing)."""
        model = self.model.get_base_model() if hasattr(self.model, "get_base_model") else self.model
        return model._get_name()

    def forward(self, *args: Any, **kwargs: Any):
        if self.calls is None:
            raise RuntimeError("the pipelined model is called by a trainer's own loss only")
        return self.calls(*args, **kwargs)

    def generate(self, input_ids, attention_mask=None, generation_config=None, **kwargs):
        """``pipe.generate``; then every rank of the pipeline takes the random state of the rank
        that sampled (the last), which is one process's: a trainer draws from it next (TRL
        shuffles the completions), the same on every rank."""
        import torch.distributed as dist

        if self.replica_step:
            out = self._generate_share(input_ids, attention_mask, generation_config, **kwargs)
        else:
            out = self.pipe.generate(input_ids, attention_mask, generation_config, **kwargs)
        state = [random_state(self.pipe.device)]
        dist.broadcast_object_list(state, group_src=self.pipe.last_rank, group=self.pipe.group)
        set_random_state(self.pipe.device, state[0])
        return out

    def _generate_share(self, input_ids, attention_mask, generation_config, **kwargs):
        """``pipe.generate`` of a replica's own prompts, as a DDP process's ``generate`` returns
        them: the replicas' prompts, left-padded to the longest, make the global batch (in
        replica order: each replica generates its own share, from its own random state), and
        of the whole batch each replica keeps its rows, without the padding it did not add and
        ending where its rows' sequences end (HF's ``generate`` stops when every row has
        reached an end-of-sequence token, or at its length limit)."""
        import torch.distributed as dist
        import torch.nn.functional as F

        pipe, group = self.pipe, self.pipe._place.mesh.dp_group
        mask = torch.ones_like(input_ids) if attention_mask is None else attention_mask
        config = (
            generation_config if generation_config is not None else self.model.generation_config
        )
        pad = kwargs.get("pad_token_id", config.pad_token_id)
        pad = pad if pad is not None else 0
        rows, length = input_ids.shape
        shares: list = [None] * pipe.dp_size
        mine = (input_ids.detach().cpu(), mask.detach().cpu())
        dist.all_gather_object(shares, mine, group=group)
        if len({ids.shape[0] for ids, _ in shares}) > 1:  # every rank alike
            raise ValueError(
                f"the replicas generated for {[ids.shape[0] for ids, _ in shares]} prompts: "
                "pipe.generate gives each replica an equal share of the rows (a dataset whose "
                "size is a multiple of the global batch, or dataloader_drop_last=True)"
            )
        longest = max(ids.shape[1] for ids, _ in shares)
        ids = torch.cat([F.pad(i, (longest - i.shape[1], 0), value=pad) for i, _ in shares])
        masks = torch.cat([F.pad(m, (longest - m.shape[1], 0), value=0) for _, m in shares])
        device = input_ids.device
        out = pipe.generate(ids.to(device), masks.to(device), generation_config, **kwargs)
        start = sum(i.shape[0] for i, _ in shares[: pipe.dp_rank])
        out = out[start : start + rows, longest - length :]
        eos = kwargs.get("eos_token_id", config.eos_token_id)
        if eos is None:
            return out
        new = out[:, length:]
        ends = torch.isin(new, torch.as_tensor(eos, device=new.device).reshape(-1))
        if not bool(ends.any(1).all()):
            return out  # a row went on to the length limit
        return out[:, : length + int(ends.int().argmax(1).max()) + 1]

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p in self.pipe.parameters():
            p.grad = None


def _check_args(trainer, config, mesh) -> None:
    """One line for each option the pipeline cannot honour (see the note above)."""
    args, problems = trainer.args, []
    if config.cp_dim in _dims(mesh) and not _own_loss(trainer):
        problems.append(
            "a loss of its own (its compute_loss, compute_loss_func or label smoothing) on a "
            f"mesh with context parallelism ({config.cp_dim!r}; not supported yet: the "
            "model's own causal-LM loss only)"
        )
    if getattr(args, "deepspeed", None):
        problems.append("deepspeed (the pipeline partitions the model itself)")
    if getattr(args, "fsdp", None):
        problems.append("fsdp (use mesh= with data_parallel='shard' in the PipelineConfig)")
    if getattr(args, "torch_compile", False):
        problems.append("torch_compile=True (pass compile=True in the PipelineConfig)")
    if getattr(args, "fp16", False):
        problems.append("fp16=True (use bf16=True)")
    if getattr(args, "save_only_model", False):
        problems.append("save_only_model=True (a checkpoint keeps the optimizer's state)")
    if getattr(trainer, "model_init", None) is not None:
        problems.append("model_init= (the pipeline is built from model=)")
    if args.per_device_train_batch_size % config.num_microbatches:
        problems.append(
            f"per_device_train_batch_size={args.per_device_train_batch_size}, not divisible by "
            f"num_microbatches={config.num_microbatches}"
        )
    if problems:
        raise ValueError(f"{type(trainer).__name__} cannot run " + "; ".join(problems))


ON_DTENSORS = ("adamw_torch_fused", "adamw_torch", "sgd", "adagrad", "rmsprop")
"""HF's ``optim`` names tested on a pipeline whose parameters are DTensors (tensor parallel,
data-parallel replicas, expert parallel): torch's optimizers, over HF's groups split by mesh
(see [Note: optimizer groups by mesh]). Any other ``optim`` is refused there."""


def _check_optimizer(trainer) -> None:
    """One line, on every rank alike, for an ``optim`` not known to run on this pipeline's
    DTensor parameters (a mesh with ``tp`` or ``dp`` above 1): HF's Adafactor keeps its factored
    state in plain tensors of a parameter's whole shape, which DTensor's ops refuse beside a
    DTensor gradient; the others (bitsandbytes', GaLore's, LOMO's, ...) are untested there. An
    optimizer of the caller's own (``optimizers=``, ``optimizer_cls_and_kwargs=``) is theirs."""
    pipe, args = trainer.pipe, trainer.args
    if pipe.tp_size == 1 and pipe.dp_size == 1:
        return
    if trainer.optimizer is not None or getattr(trainer, "optimizer_cls_and_kwargs", None):
        return
    optim = str(getattr(args.optim, "value", args.optim))
    if optim in ON_DTENSORS:
        return
    why = (
        "HF's Adafactor keeps its factored state in plain tensors of the whole shape, which "
        "DTensor's ops refuse beside a DTensor gradient"
        if optim == "adafactor"
        else "untested on DTensor parameters"
    )
    raise ValueError(
        f"{type(trainer).__name__} cannot run optim={optim!r} on a mesh whose parameters are "
        f"DTensors (tp={pipe.tp_size}, dp={pipe.dp_size}): {why}; use one of "
        f"{', '.join(ON_DTENSORS)}"
    )


def PipelineTrainer(*args: Any, **kwargs: Any):  # noqa: N802  (a class, made on first use)
    """``transformers.Trainer`` whose steps run on a :class:`~pippy_xla.PipelineModel` built from
    ``model``: ``PipelineTrainer(model=hf_model, args=TrainingArguments(...), train_dataset=...,
    layer_cls=..., pipeline=px.PipelineConfig(num_microbatches=...), mesh=None,
    **trainer_kwargs)``; then ``train()`` as usual, under torchrun. ``mesh``: a data x pipeline
    (x tensor) ``DeviceMesh``, as ``PipelineModel`` takes it. See [Note: the Trainer's loop on a
    pipeline]."""
    from transformers import Trainer

    return pipelined(Trainer)(*args, **kwargs)


_CLASSES: dict[type, type] = {}


def pipelined(trainer_cls: type) -> type:
    """``trainer_cls`` (``transformers.Trainer`` or a subclass of it, such as TRL's
    ``SFTTrainer``) with its steps on a pipeline: its constructor takes ``trainer_cls``'s
    arguments and ``layer_cls=``, ``pipeline=`` (a :class:`~pippy_xla.PipelineConfig`) and
    ``mesh=``. The pipeline is built from the model ``trainer_cls.__init__`` ends with
    (PEFT-wrapped by ``SFTTrainer``'s ``peft_config=``, say). Made once per class; importing the
    Trainer costs 2.4 s (measured), which only its users pay."""
    if trainer_cls not in _CLASSES:
        methods = {
            "__init__": _init,
            "_prepare_loaders_unsharded": _prepare_loaders_unsharded,
            "_get_dataloader": _get_dataloader,
            "get_total_train_batch_size": _get_total_train_batch_size,
            "_get_num_items_in_batch": _get_num_items_in_batch,
            "_move_model_to_device": _move_model_to_device,
            "_wrap_model": _wrap_model,
            "create_optimizer": _create_optimizer,
            "training_step": _training_step,
            "prediction_step": _prediction_step,
            "save_model": _save_model,
            "_clip_grad_norm": _clip_grad_norm,
            "_get_grad_norm": _get_grad_norm,
            "_save_optimizer_and_scheduler": _save_optimizer_and_scheduler,
            "_load_from_checkpoint": _load_from_checkpoint,
            "_load_optimizer_and_scheduler": _load_optimizer_and_scheduler,
        }
        for method in EXTENDED:
            methods[method] = _extended(trainer_cls, method, methods[method])
        base = trainer_cls.__name__
        name = "PipelineTrainer" if base == "Trainer" else f"Pipelined{base}"
        namespace = {"__module__": __name__, "_pipelined": trainer_cls, **methods}
        _CLASSES[trainer_cls] = type(name, (trainer_cls,), namespace)
    return _CLASSES[trainer_cls]


EXTENDED = ("_save_optimizer_and_scheduler", "_load_optimizer_and_scheduler", "save_model")
"""The Trainer's steps the pipeline replaces that a subclass may extend (TRL's ``GRPOTrainer``
restores its entropy controller's state after HF's ``_load_optimizer_and_scheduler``)."""


def _extended(trainer_cls: type, name: str, ours: Any) -> Any:
    """``ours`` (the pipeline's version of the Trainer's ``name``), or where ``trainer_cls``
    overrides ``name``: its override, whose ``super()`` call runs ``ours`` instead of HF's (the
    Trainer's attribute is swapped for the call): what it adds before and after runs too."""
    from transformers import Trainer

    if getattr(trainer_cls, name) is getattr(Trainer, name):
        return ours

    @functools.wraps(ours)
    def method(self, *args: Any, **kwargs: Any) -> Any:
        hf = vars(Trainer)[name]
        setattr(Trainer, name, ours)
        try:
            return getattr(trainer_cls, name)(self, *args, **kwargs)
        finally:
            setattr(Trainer, name, hf)

    return method


def _init(self, *args, layer_cls=None, pipeline=None, mesh=None, **kwargs) -> None:
    from pippy_xla.config import PipelineConfig
    from pippy_xla.integrations.model_calls import ModelCalls
    from pippy_xla.pipeline import PipelineModel

    if pipeline is None:
        raise ValueError(f"{type(self).__name__} needs pipeline=px.PipelineConfig(...)")
    config = PipelineConfig.from_options(pipeline, {})
    self.pipe = None  # built below, from the model the wrapped class's constructor ends with
    _generation_batch_per_replica(_argument(self._pipelined, "args", args, kwargs), mesh)
    self._pipelined.__init__(self, *args, **kwargs)  # the wrapped class's own
    _check_args(self, config, mesh)
    # Run on the last stage, before the logits leave it (HF's loop would run it on every rank).
    self._preprocess_on_last, self.preprocess_logits_for_metrics = (
        self.preprocess_logits_for_metrics,
        None,
    )
    if self.args.gradient_checkpointing:  # TRL's SFTConfig turns it on by default
        config = _checkpoint_every_layer(self.model, layer_cls, config)
        self.args.gradient_checkpointing = False  # the pipeline's, not HF's on the whole model
    self._average_tokens = self.args.average_tokens_across_devices  # HF's, for a step on replicas
    self.args.average_tokens_across_devices = False  # the ranks hold one batch, not shards of it
    if getattr(self.data_collator, "padding_free", False):  # TRL's packing
        self.data_collator = _PackedRows(self.data_collator)
        names = tuple(n for n in config.input_names if n != "attention_mask")
        config = dataclasses.replace(config, input_names=(*names, "position_ids"))
    if not _own_loss(self) and config.loss_fn is None:
        # The trainer's loss is computed from the model's outputs, each step's through
        # ModelCalls: the model's own loss is never the pipeline's, so a model whose own loss the
        # pipeline does not take (a sequence classifier's: TRL's RewardTrainer) builds too.
        config = dataclasses.replace(config, loss_fn=_no_loss, num_items_fn=_no_loss)
    self.pipe = PipelineModel(self.model, layer_cls=layer_cls, config=config, mesh=mesh)
    # HF's Trainer adds the model's own extra terms (an MoE router's loss) over each batch.
    self.pipe.added_over_batch = _own_loss(self)
    _check_optimizer(self)
    self._calls = None
    self._sft_metrics = _own_loss(self) and _is_sft(type(self).compute_loss)
    if not _own_loss(self):  # the trainer calls the model: see [Note: a trainer's own loss ...]
        self._calls = ModelCalls(self.pipe, self.model, getattr(self, "temperature", 1.0))
        _route_forward(self.model, self._calls)
    self._stages = _Stages(self.pipe, self.model, self._calls)
    self._prepare_loaders_unsharded()
    _seed_per_replica(self)


def _no_loss(*_: Any) -> torch.Tensor:
    """The pipeline's loss for a trainer whose loss is its own: never run (each step's loss is
    the one :class:`ModelCalls` sets)."""
    raise RuntimeError("a trainer with its own loss ran the pipeline without ModelCalls' loss")


def _own_loss(trainer) -> bool:
    """Whether the trainer's loss is the model's own, which the pipeline computes per
    microbatch in one pass: HF's ``Trainer``'s, and TRL's ``SFTTrainer``'s negative
    log-likelihood (``loss_type="nll"``, which is the model's loss computed by TRL's fused
    head), without a ``compute_loss_func`` or label smoothing. Any other ``compute_loss`` calls
    the model: :class:`ModelCalls`."""
    from transformers import Trainer

    if trainer.compute_loss_func is not None or trainer.label_smoother is not None:
        return False
    compute_loss = type(trainer).compute_loss
    if compute_loss is Trainer.compute_loss:
        return True
    nll = getattr(trainer.args, "loss_type", "nll") == "nll"
    return _is_sft(compute_loss) and nll


def _is_sft(compute_loss) -> bool:
    """Whether ``compute_loss`` is TRL's ``SFTTrainer``'s (without importing TRL)."""
    sft = getattr(sys.modules.get("trl"), "SFTTrainer", None)  # TRL's, if the trainer is
    return sft is not None and compute_loss is sft.compute_loss


def _route_forward(model, calls) -> None:
    """``model(...)``, called by the trainer's own code (TRL's old log-probabilities come from
    ``self.model``), runs on the pipeline: the model's forward on this rank holds only its
    stage's trained weights. HF's signature is kept (``generate`` checks keywords against it),
    and the forward the pipeline traces (its generation stages, built at the first
    ``generate``) is the model's."""
    import types

    from torch.fx._symbolic_trace import is_fx_symbolic_tracing

    traced = model.forward

    @functools.wraps(type(model).forward)
    def forward(_model, *args: Any, **kwargs: Any):
        return traced(*args, **kwargs) if is_fx_symbolic_tracing() else calls(*args, **kwargs)

    model.forward = types.MethodType(forward, model)


def _argument(trainer_cls: type, name: str, args: tuple, kwargs: dict) -> Any:
    """The constructor argument ``name`` of ``trainer_cls`` in a call's ``args`` and ``kwargs``
    (``None`` if the call does not pass it)."""
    import inspect

    bound = inspect.signature(trainer_cls.__init__).bind_partial(None, *args, **kwargs)
    return bound.arguments.get(name)


def _generation_batch_per_replica(args, mesh) -> None:
    """TRL's online trainers (``GRPOConfig``) count their generation batch over the job's
    processes (``per_device_train_batch_size * world_size * steps_per_generation``); a pipeline's
    ranks are one process: the count is made over the replicas."""
    gen, steps = (getattr(args, k, None) for k in ("generation_batch_size", "steps_per_generation"))
    if gen is None or steps is None:
        return
    per_process = args.per_device_train_batch_size * steps
    if gen == per_process * args.world_size:
        args.generation_batch_size = per_process * _replicas(mesh)


def _dims(mesh) -> tuple[str, ...]:
    """A ``PipelineModel`` mesh's dimension names (none without a mesh)."""
    return () if mesh is None else tuple(mesh.mesh_dim_names or ())


def _replicas(mesh) -> int:
    """The data-parallel replicas of a ``PipelineModel`` mesh (its ``"dp"`` dimension)."""
    return mesh["dp"].size() if "dp" in _dims(mesh) else 1


def _seed_per_replica(trainer) -> None:
    """A trainer that seeded per process (TRL's ``set_seed(seed, device_specific=True)``: the
    seed plus the process's index) is seeded per replica: the seed plus the replica's index,
    as in one process (the ranks of a pipeline are one process). Any other random state is
    left as it was."""
    import random

    import numpy as np
    from accelerate.utils import set_seed

    device = trainer.pipe.device
    saved = (random.getstate(), np.random.get_state(), random_state(device))
    set_seed(trainer.args.seed + trainer.accelerator.process_index)
    if torch.equal(torch.get_rng_state(), saved[2][0]):
        set_seed(trainer.args.seed + trainer.pipe.dp_rank)
        return
    random.setstate(saved[0])
    np.random.set_state(saved[1])
    set_random_state(device, saved[2])


@contextlib.contextmanager
def _one_process(trainer):
    """accelerate's state made one process's while a trainer's own code runs on the whole batch
    (its gathers and reductions over the job, its process index in the generation batch): the
    pipeline's ranks, and on a mesh every replica, hold one process's data."""
    from accelerate.utils import DistributedType

    one = dict(
        distributed_type=DistributedType.NO, num_processes=1, process_index=0, local_process_index=0
    )
    with _accelerate_state(one):
        yield


@contextlib.contextmanager
def _as_processes(trainer):
    """accelerate's state made that of the processes a trainer's own step code would run in
    under DDP, while it runs: without replicas one process (:func:`_one_process`); with ``dp``
    replicas, replica ``r`` is DDP process ``r`` of ``dp`` (``num_processes``,
    ``process_index``), its collectives (accelerate's ``gather``, ``reduce``, ``broadcast``,
    TRL's own) run over the replicas (:func:`_collectives_over` this rank's ``dp`` group: the
    ranks of the other replicas at the same place in theirs), and HF's
    ``average_tokens_across_devices`` is the caller's (the pipeline turns it off for its own
    loss, whose ranks hold one batch). See [Note: a trainer's own loss on replicas]."""
    pipe = trainer.pipe
    if pipe.dp_size == 1:
        with _one_process(trainer):
            yield
        return
    replica = dict(
        num_processes=pipe.dp_size, process_index=pipe.dp_rank, local_process_index=pipe.dp_rank
    )
    args, average = trainer.args, trainer.args.average_tokens_across_devices
    args.average_tokens_across_devices = trainer._average_tokens
    trainer._stages.replica_step = True
    try:
        with _accelerate_state(replica), _collectives_over(pipe._place.mesh.dp_group):
            yield
    finally:
        args.average_tokens_across_devices = average
        trainer._stages.replica_step = False


@contextlib.contextmanager
def _accelerate_state(values: dict):
    """accelerate's shared state (``PartialState``'s and ``AcceleratorState``'s) with
    ``values``, restored after."""
    from accelerate.state import AcceleratorState, PartialState

    states = [PartialState._shared_state, AcceleratorState._shared_state]
    saved = [{k: s[k] for k in values if k in s} for s in states]
    for s in states:
        s.update(values)
    try:
        yield
    finally:
        for s, old in zip(states, saved, strict=True):
            s.update(old)


COLLECTIVES = (
    "all_gather",
    "all_gather_into_tensor",
    "all_gather_single",
    "all_gather_object",
    "all_reduce",
    "all_to_all_single",
    "barrier",
    "broadcast",
    "broadcast_object_list",
    "gather",
    "gather_object",
    "reduce",
    "reduce_scatter_tensor",
    "scatter",
    "scatter_object_list",
)
"""``torch.distributed``'s collectives that :func:`_collectives_over` sends to a group."""


@functools.cache
def _signature(fn):
    """``inspect.signature(fn)``, once per function (``_collectives_over`` runs every step)."""
    import inspect

    return inspect.signature(fn)


@contextlib.contextmanager
def _collectives_over(group):
    """``torch.distributed``'s collectives called without a group (accelerate's and TRL's: the
    job's processes) run over ``group`` instead, a source or destination rank read as an index
    in it (accelerate passes process indices); a call that names its group is left as it is
    (the pipeline's, FSDP's)."""
    import torch.distributed as dist

    saved = {name: getattr(dist, name) for name in COLLECTIVES if hasattr(dist, name)}

    def over(fn):
        signature = _signature(fn)

        @functools.wraps(fn)
        def call(*args: Any, **kwargs: Any) -> Any:
            bound = signature.bind(*args, **kwargs)
            given = bound.arguments
            if given.get("group") is None:
                given["group"] = group
                for end in ("src", "dst"):
                    if given.get(end) is not None:
                        given[f"group_{end}"], given[end] = given[end], None
            return fn(*bound.args, **bound.kwargs)

        return call

    for name, fn in saved.items():
        setattr(dist, name, over(fn))
    try:
        yield
    finally:
        for name, fn in saved.items():
            setattr(dist, name, fn)


class _PackedRows:
    """TRL's padding-free collator (``packing=True``) made to give rows (see [Note: the
    Trainer's loop on a pipeline]): each example a row, padded, with its ``position_ids``
    restarting at every packed document, no ``attention_mask``, and the label of every
    document's first token ignored, as the padding-free batch has them."""

    def __init__(self, collator) -> None:
        if not dataclasses.is_dataclass(collator) or not hasattr(collator, "return_position_ids"):
            raise ValueError(
                f"the pipeline cannot split the padding-free batches of {type(collator).__name__} "
                "(one row for the whole batch) into microbatches; use TRL's "
                "DataCollatorForLanguageModeling or padding_free=False"
            )
        self.collator = dataclasses.replace(collator, padding_free=False, return_position_ids=True)

    def __call__(self, examples: list) -> dict:
        batch = self.collator(examples)
        del batch["attention_mask"]  # HF's masks then follow the positions: one block per document
        batch["labels"][batch["position_ids"] == 0] = -100
        return batch

    def tokens(self, batch: dict) -> int:
        """The count of a batch's tokens (the padding-free row's length, which TRL logs): each
        row's up to its last that is not padding (at position 0, the pad token; a row's last
        document, were it one pad token, would not count)."""
        pad = self.collator.pad_token_id
        real = (batch["position_ids"] != 0) | (batch["input_ids"] != pad)
        ends = real * torch.arange(1, real.shape[1] + 1, device=real.device)
        return int(ends.amax(1).sum())


def _checkpoint_every_layer(model, layer_cls, config):
    """``config`` with every decoder layer checkpointed (what ``gradient_checkpointing=True``
    asks of HF's model), unless it already names checkpointed layers or a plan."""
    from pippy_xla.split.partition import find_layers, layer_classes

    if config.checkpoint_layers or config.plan is not None:
        return config
    layers = len(find_layers(model, layer_classes(model, layer_cls)))
    return dataclasses.replace(config, checkpoint_layers=tuple(range(layers)))


def _prepare_loaders_unsharded(self) -> None:
    """Every rank of the pipeline gets the whole batch: the data loaders are prepared as for one
    process (accelerate's sharding, ``BatchSamplerShard``, left out)."""
    from accelerate.data_loader import prepare_data_loader

    acc = self.accelerator

    def one_process(loader, device_placement=None):
        prepared = prepare_data_loader(
            loader,
            acc.device,
            num_processes=1,
            process_index=0,
            put_on_device=True,
            dispatch_batches=False,
            rng_types=[],
            use_seedable_sampler=acc.use_seedable_sampler,
            data_seed=self.args.data_seed,
            even_batches=acc.even_batches,
            non_blocking=acc.non_blocking,
            split_batches=acc.split_batches,
        )
        acc._dataloaders.append(prepared)
        return prepared

    acc.prepare_data_loader = one_process


def _get_dataloader(self, dataset, description, batch_size, *args, **kwargs):
    """The wrapped class's loader, of the global batch: ``batch_size`` rows per replica; for a
    trainer's own loss on replicas, the training loader's batch is this replica's share of it,
    collated alone (``_ReplicaShare``), as HF's sharded loader gives a DDP process its rows."""
    dp = self.pipe.dp_size if self.pipe is not None else 1
    collator = self.data_collator
    if dp > 1 and getattr(self, "_calls", None) is not None and kwargs.get("is_training"):
        self.data_collator = _ReplicaShare(collator, self.pipe.dp_rank, dp, batch_size)
    try:
        return self._pipelined._get_dataloader(
            self, dataset, description, batch_size * dp, *args, **kwargs
        )
    finally:
        self.data_collator = collator


class _ReplicaShare:
    """A collator that collates replica ``rank``'s share of the examples of a global batch (the
    ``rank``-th of ``replicas`` contiguous runs of ``rows``: what HF's sharded loader gives DDP
    process ``rank``, from the same seeded order), alone: padded to its own longest row, as each
    DDP process pads its batch. An epoch's short last batch is completed as accelerate's
    ``BatchSamplerShard`` completes it (``even_batches``, its default): with the epoch's first
    examples, cycled, so that every replica gets ``rows``. It keeps the epoch's first batch for
    that: a loader with workers (``dataloader_num_workers``), each with its own copy, or a run
    resumed in the middle of an epoch (HF skips the batches before it) would complete it from
    another batch."""

    def __init__(self, collator, rank: int, replicas: int, rows: int) -> None:
        self.collator, self.rank, self.replicas, self.rows = collator, rank, replicas, rows
        self.first: list | None = None
        """The epoch's first batch of examples (``None`` before an epoch starts)."""

    def __call__(self, examples: list):
        examples = list(examples)
        if self.first is None:
            self.first = examples
        if len(examples) < self.rows * self.replicas:  # the epoch's last batch
            first, self.first = self.first, None
            while len(first) < self.rows * self.replicas:
                first = first + first
            examples = examples + first[: self.rows * self.replicas - len(examples)]
        rows = self.rows
        return self.collator(examples[rows * self.rank : rows * (self.rank + 1)])


def _get_num_items_in_batch(self, batch_samples: list, device):
    """HF's count of the window's label tokens. For a trainer's own loss on replicas each
    replica's batches are its shares: counted as a DDP process counts them (with
    ``average_tokens_across_devices``, summed over the replicas)."""
    if getattr(self, "_calls", None) is None or self.pipe.dp_size == 1:
        return self._pipelined._get_num_items_in_batch(self, batch_samples, device)
    with _as_processes(self):
        return self._pipelined._get_num_items_in_batch(self, batch_samples, device)


def _get_total_train_batch_size(self, args) -> int:
    """Rows per optimizer step: the replicas' batches over the window (HF's count multiplies
    by the job's processes, which here include the pipeline's ranks)."""
    return self._train_batch_size * args.gradient_accumulation_steps * self.pipe.dp_size


def _move_model_to_device(self, model, device) -> None:
    return None  # each rank's stages live where the pipeline put them


def _wrap_model(self, model, training=True, dataloader=None) -> nn.Module:
    return self._stages


def _create_optimizer(self, model=None):
    """HF's optimizer (``args.optim``, or the trainer's ``optimizer_cls_and_kwargs``) and
    weight-decay rule over this rank's parameters that require grad, each of HF's groups split by
    the parameters' device mesh: see [Note: optimizer groups by mesh]."""
    if self.optimizer is None:
        decay = set(self.get_decay_parameter_names(self.model))
        named = [(n, p) for n, p in self.pipe.named_parameters() if p.requires_grad]
        groups = [
            {"params": [p for n, p in named if n in decay], "weight_decay": self.args.weight_decay},
            {"params": [p for n, p in named if n not in decay], "weight_decay": 0.0},
        ]
        cls, kwargs = getattr(self, "optimizer_cls_and_kwargs", None) or (
            self.get_optimizer_cls_and_kwargs(self.args, self.model)
        )
        self.optimizer = cls(_by_mesh(groups), **kwargs)
    return self.optimizer


def _by_mesh(groups: list[dict]) -> list[dict]:
    """[Note: optimizer groups by mesh] torch's fused and foreach optimizers (HF's default
    ``adamw_torch_fused``; ``adamw_torch``, ``sgd``, ``adagrad`` and ``rmsprop`` wherever torch
    picks foreach: on GPUs, or with ``foreach=True``) sort a param group's tensors by device and
    dtype only (``Optimizer._group_tensors_by_device_and_dtype``) and update each such list in one
    call (``torch._fused_adamw_``, ``torch._foreach_*``). DTensor's dispatch refuses a call whose
    lists mix DTensors with plain tensors of more than one element ("got mixed torch.Tensor and
    DTensor", ``OpDispatcher._try_replicate_spec_for_scalar_tensor``). On a tensor-parallel mesh
    without replicas a stage's parameters are DTensors where the plan shards them (projections,
    their biases, an untied embedding and head) and plain tensors where it leaves them whole
    (norms, a tied embedding), and HF's two weight-decay groups mix them as soon as one group
    holds both kinds: Qwen2's sharded q/k/v biases beside its norms in the group without decay,
    a tied (whole) embedding beside sharded projections in the group with it (Qwen3; OLMo 2's and
    Llama's groups each hold one kind, by chance). Each group is split by mesh (``None``: plain
    tensors), HF's own rule in its ``create_optimizer`` (transformers 5.25, for expert
    parallelism). The update is the same: each of these optimizers updates a parameter from its
    own gradient and state, the split groups keep HF's options, and HF's learning-rate schedules
    set every group alike. With replicas every parameter is already a DTensor (FSDP2: the whole
    ones on the ``dp`` mesh, the sharded ones on ``(dp, tp)``), which torch 2.13's fused step
    took in one group too; split by mesh all the same. Empty groups are dropped."""
    from torch.distributed.tensor import DTensor

    out = []
    for group in groups:
        by_mesh: dict = {}
        for p in group["params"]:
            by_mesh.setdefault(p.device_mesh if isinstance(p, DTensor) else None, []).append(p)
        out.extend({**group, "params": params} for params in by_mesh.values())
    return out


def _batch(self, inputs: dict) -> dict:
    """The loader's batch as the pipeline takes it: its inputs and labels, and where it has too
    few rows to cut into the replicas' microbatches (an epoch's last batch, a packed dataset's),
    rows added that copy its last one with every label ignored: they add nothing to the loss,
    the token count or the gradients."""
    inputs = self._prepare_inputs(inputs)
    names = (*self.pipe.pipeline_config.input_names, "labels")
    batch = {k: v for k, v in inputs.items() if k in names}
    first = batch[names[0]]
    extra = -first.shape[0] % (self.pipe.pipeline_config.num_microbatches * self.pipe.dp_size)
    if extra and "labels" in batch:
        batch = {k: torch.cat([v, v[-1:].expand(extra, *v.shape[1:])]) for k, v in batch.items()}
        batch["labels"][-extra:] = -100
    return _whole_chunks(batch, self.pipe.cp_size)


def _whole_chunks(batch: dict, cp: int) -> dict:
    """Under context parallelism over ``cp`` ranks, the rows lengthened at their end to a
    multiple of ``2 cp`` tokens, which the head-tail layout cuts them into (see [Note: pipeline
    x context parallel]): labels -100, attention mask 0, positions going on from each row's
    last, any other input its last token repeated. Under the causal mask no earlier token
    attends to the added ones and their labels are ignored (the last token's shifted label is
    -100 as before): the loss, the token count and the gradients are the batch's."""
    length = batch["input_ids"].shape[1] if cp > 1 and "input_ids" in batch else 0
    extra = -length % (2 * cp)
    if not extra:
        return batch

    def lengthened(key: str, v: torch.Tensor) -> torch.Tensor:
        if key == "position_ids":
            added = v[:, -1:] + torch.arange(1, extra + 1, device=v.device)
        elif key in ("labels", "attention_mask"):
            added = v.new_full((v.shape[0], extra), -100 if key == "labels" else 0)
        else:
            added = v[:, -1:].expand(v.shape[0], extra)
        return torch.cat([v, added], dim=1)

    return {
        k: lengthened(k, v) if v.dim() == 2 and v.shape[1] == length else v
        for k, v in batch.items()
    }


@contextlib.contextmanager
def _divided_by(self, num_items, steps: int):
    """The pipeline's loss divided as HF divides the Trainer's: by HF's token count
    ``num_items`` where HF passes one to the model, else by the pipeline's own count times
    ``steps`` (the accumulation window's batches: HF divides a mean loss by them)."""
    runner = self.pipe._runner
    own = runner.num_items_fn
    if num_items is not None:
        count = torch.as_tensor(num_items).detach().cpu()
        runner.num_items_fn = lambda labels: count
    else:
        runner.num_items_fn = lambda labels: own(labels) * steps
    try:
        yield
    finally:
        runner.num_items_fn = own


def _check_inputs(self, inputs, first: str) -> None:
    """One line for a loader's batch that is not the model's inputs and labels, where the
    trainer's loss is the model's own (a trainer with its own ``compute_loss`` takes any
    batch: its step runs)."""
    keys = sorted(inputs) if isinstance(inputs, dict) else type(inputs).__name__
    if not isinstance(inputs, dict) or first not in inputs or "labels" not in inputs:
        raise ValueError(
            f"{type(self).__name__}: a step's batch is {keys}, not the model's inputs ({first!r}, "
            "...) and 'labels', from which the pipeline trains the model's own loss (a data "
            "collator that gives labels, or a Trainer subclass with its own compute_loss)"
        )


def _training_step(self, model, inputs, num_items_in_batch=None) -> torch.Tensor:
    """``pipe.run_train`` over the batch, its loss divided by HF's count for the window; for a
    trainer's own loss, the wrapped class's step, then its gradients through the pipeline."""
    if self._calls is not None:
        with _as_processes(self):
            loss = self._pipelined.training_step(self, model, inputs, num_items_in_batch)
        self._calls.flush()
        return loss
    self.pipe.train()
    _check_inputs(self, inputs, self.pipe.pipeline_config.input_names[0])
    batch = _batch(self, inputs)
    # accelerate's autocast (bf16=True) wraps the model's forward, which the stages skip
    with (
        _divided_by(self, num_items_in_batch, self.current_gradient_accumulation_steps),
        _sft_sums(self),
        self.compute_loss_context_manager(),
        self.accelerator.autocast(),
    ):
        loss = self.pipe.run_train(**batch)
    if self._sft_metrics:
        _log_sft_metrics(self, "train", inputs)
    return loss.detach().to(self.args.device)


@contextlib.contextmanager
def _sft_sums(self):
    """For TRL's ``SFTTrainer`` with the model's own loss: the pipeline's step computes the sums
    of TRL's metrics beside the loss (``pipe.token_sums``, see [Note: token sums beside the
    loss]); nothing otherwise."""
    if not self._sft_metrics:
        yield
        return
    from pippy_xla.integrations.model_calls import SFT_SUMS

    self.pipe.token_sums = SFT_SUMS
    try:
        yield
    finally:
        self.pipe.token_sums = None


def _log_sft_metrics(self, mode: str, inputs: dict) -> None:
    """What TRL's ``SFTTrainer.compute_loss`` adds to its metrics from a step, made from the
    step's token sums (the global batch's, on every rank): ``entropy`` and
    ``mean_token_accuracy`` over the label tokens, and in training the running count of input
    tokens ``num_tokens`` (the attention mask's, or a packed batch's: ``_PackedRows.tokens``)."""
    sums, metrics = self.pipe.last_token_sums, self._metrics[mode]
    valid = sums["label_mask"]
    metrics["entropy"].append(sums["entropy"] / valid if valid > 0 else 0.0)
    metrics["mean_token_accuracy"].append(sums["is_top1"] / valid if valid > 0 else 0.0)
    if mode == "train":
        packed = isinstance(self.data_collator, _PackedRows)
        tokens = (
            self.data_collator.tokens(inputs) if packed else int(inputs["attention_mask"].sum())
        )
        self._total_train_tokens += tokens // self._tp_size
    metrics["num_tokens"] = [self._total_train_tokens]


def _prediction_step(self, model, inputs, prediction_loss_only, ignore_keys=None):
    """``pipe.run_eval``'s loss, divided by the count HF divides it by (HF's quirks included:
    for a model without a ``loss_type``, GPT-2's, it counts every label, the first too); for
    ``compute_metrics``, the batch's logits (after ``preprocess_logits_for_metrics``, run on the
    last stage) and labels, on every rank."""
    # Every rank holds the whole global batch's results: the loop's gather is one process's
    # (HF resets gather_function after each loop, so it is set at every step), and the loss is
    # one copy per replica, which HF repeats per_device_eval_batch_size times: a row each.
    self.gather_function = functools.partial(_one_process_gather, self.accelerator.gradient_state)
    if self._calls is not None:  # the whole batch on every replica, as one process runs it
        with _one_process(self):
            loss, logits, labels = self._pipelined.prediction_step(
                self, model, inputs, prediction_loss_only, ignore_keys=ignore_keys
            )
        return None if loss is None else loss.expand(self.pipe.dp_size), logits, labels
    count = self._get_num_items_in_batch([inputs], self.args.device) if "labels" in inputs else None
    batch = _batch(self, inputs)
    with _divided_by(self, count, 1), _sft_sums(self), self.accelerator.autocast():
        # pipe.run_eval's, keeping the logits only where they are returned (under context
        # parallelism they are gathered: every token's on each cp rank's last stage)
        out = self.pipe._runner.evaluate(batch, keep_logits=not prediction_loss_only)
    if self._sft_metrics and out.loss is not None:
        _log_sft_metrics(self, "eval", inputs)
    loss = None if out.loss is None else out.loss.detach().to(self.args.device)
    loss = None if loss is None else loss.expand(self.pipe.dp_size)
    if prediction_loss_only:
        return loss, None, None
    first = inputs[self.pipe.pipeline_config.input_names[0]]
    rows, length = first.shape[0], first.shape[1] if self.pipe.cp_size > 1 else None
    labels = inputs.get("labels")
    return loss, _logits_everywhere(self, out.logits, batch.get("labels"), rows, length), labels


def _logits_everywhere(self, logits, labels, rows: int, length: int | None):
    """The batch's logits on every rank: each replica's last stage holds those of its share of
    the rows (every token's, with context parallelism), which go through
    ``preprocess_logits_for_metrics`` there, to the replica's ranks, then from every replica to
    every other; the rows and tokens (``length``: under context parallelism) ``_batch`` added
    are dropped."""
    import torch.distributed as dist

    pipe = self.pipe
    if pipe.is_last:
        if length is not None:  # the tokens _whole_chunks added, dropped
            logits, labels = logits[:, :length], None if labels is None else labels[:, :length]
        if self._preprocess_on_last is not None:
            share = labels.chunk(pipe.dp_size)[pipe.dp_rank] if labels is not None else None
            logits = self._preprocess_on_last(logits, share)
        logits = logits.detach().cpu()
    sent = [logits if pipe.is_last else None]
    dist.broadcast_object_list(sent, group_src=pipe.last_rank, group=pipe.group)
    shares = sent
    if pipe.dp_size > 1:
        shares = [None] * pipe.dp_size
        dist.all_gather_object(shares, sent[0], group=pipe._place.mesh.dp_group)
    return torch.cat(shares)[:rows].to(self.args.device)


def _one_process_gather(gradient_state, data, *args: Any, **kwargs: Any):
    """accelerate's ``gather_for_metrics`` in one process: ``data`` as it is, the last batch's
    cut to the dataset's remainder."""
    from accelerate.utils import recursively_apply

    if gradient_state.end_of_dataloader and gradient_state.remainder > 0:
        return recursively_apply(lambda t: t[: gradient_state.remainder], data)
    return data


def _save_model(self, output_dir=None, _internal_call=False) -> None:
    """Every stage's tensors in HF's format (PEFT's for a PEFT model), written by every rank
    together; the tokenizer or processor by the first."""
    output_dir = output_dir or self.args.output_dir
    self.pipe.save_pretrained(output_dir)
    if self.args.should_save and self.processing_class is not None:
        self.processing_class.save_pretrained(output_dir)


def _clip_grad_norm(self, model):
    return self.pipe.clip_grad_norm_(self.args.max_grad_norm)


def _get_grad_norm(self, model, grad_norm=None):
    if grad_norm is None:
        grad_norm = self.pipe.clip_grad_norm_(float("inf"))
    return grad_norm


PIPELINE_DIR = "pipeline"
"""The subdirectory of a Trainer checkpoint that holds the pipeline's DCP checkpoint (the model's
trained tensors and the optimizer's state, every rank's)."""


def _torch_optimizer(self):
    return getattr(self.optimizer, "optimizer", self.optimizer)  # accelerate's wrapper, unwrapped


def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
    """The model's and the optimizer's state through the pipeline's checkpoint (every rank
    writes its part: DCP), the learning-rate scheduler's as HF writes it."""
    import os

    from transformers.trainer import SCHEDULER_NAME

    self.pipe.save(os.path.join(output_dir, PIPELINE_DIR), _torch_optimizer(self))
    if self.args.should_save:
        torch.save(self.lr_scheduler.state_dict(), os.path.join(output_dir, SCHEDULER_NAME))


def _load_from_checkpoint(self, resume_from_checkpoint: str, model=None) -> None:
    """Nothing yet: the model's tensors load with the optimizer's, once it exists
    (:func:`_load_optimizer_and_scheduler`)."""
    import os

    if not os.path.isdir(os.path.join(resume_from_checkpoint, PIPELINE_DIR)):
        raise FileNotFoundError(
            f"{resume_from_checkpoint} holds no {PIPELINE_DIR}/ checkpoint: resume a "
            "PipelineTrainer from a checkpoint a PipelineTrainer saved"
        )


def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
    import os

    from transformers.trainer import SCHEDULER_NAME

    if checkpoint is None:
        return
    self.pipe.load(os.path.join(checkpoint, PIPELINE_DIR), _torch_optimizer(self))
    state = torch.load(os.path.join(checkpoint, SCHEDULER_NAME), weights_only=True)
    self.lr_scheduler.load_state_dict(state)
