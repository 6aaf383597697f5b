"""A trainer's own loss on the pipeline: :class:`ModelCalls`, the model's forward as a trainer's
code calls it, in two passes of the pipeline.

[Note: a trainer's own loss on the pipeline] Trainers such as TRL's ``GRPOTrainer`` compute their
loss outside the model: they call it (``model(**inputs, labels=..., fused_lm_head=True)`` for
TRL's per-token log-probabilities and entropies, or ``model(**inputs)`` for the logits), combine
what it returns with what the model never sees (advantages, old log-probabilities, masks) into
one loss over the batch, and call ``backward``. That loss is not a sum of per-microbatch losses
in general (GRPO's ``bnpo`` divides by the batch's token count, its entropy mask takes a quantile
over the batch) and its code gathers across processes, so a call runs in two passes:

1. Forward, without autograd: the pipeline's eval engine over the batch, where the last stage
   turns each microbatch's logits into what the call asks for (:func:`per_token`: TRL's fused
   head's fields at the trainer's sampling temperature; or the logits), which go to every rank
   of the pipeline. The call returns them as leaves that require grad: every rank then runs the
   trainer's loss and its backward as one process does, on the same numbers.
2. After the trainer's backward (:meth:`ModelCalls.flush`, once the step returned), the leaves
   hold ``d loss / d outputs``. The pipeline's training engine runs the batch again with the
   loss ``sum(outputs(logits) * grads)``, whose gradient with respect to the parameters is the
   trainer's loss's (the chain rule through the outputs), microbatch by microbatch. The random
   state is rewound to the first pass's start and the first pass's autocast restored, so dropout
   and mixed precision are the same in both.

The cost: one more forward of the batch than one process (the first pass keeps no activations),
and a broadcast of the outputs (``(rows, tokens)`` floats per field; the whole ``(rows, tokens,
vocab)`` logits for a plain call, whose gradients then travel as the second pass's labels).

[Note: a trainer's own loss on replicas] On a mesh with ``dp`` data-parallel replicas, each
replica runs the trainer's training step as DDP process ``r`` of ``dp`` runs it in HF's Trainer:

- Its batch is its share of the global batch: the loader's global batch (the same seeded order
  as one process's) cut into ``dp`` contiguous shares, the rows HF's sharded loader gives DDP
  process ``r``, collated alone (padded to its own longest row, as each DDP process pads; an
  epoch's short last batch completed with its first examples, as accelerate's
  ``even_batches`` does: ``_ReplicaShare`` in ``trainer.py``). HF's token count for the window
  is counted as DDP counts it (with ``average_tokens_across_devices``, HF's default, summed
  over the replicas).
- accelerate's state during the step is DDP process ``r``'s (``num_processes=dp``,
  ``process_index=r``), and ``torch.distributed``'s collectives called without a group
  (accelerate's ``gather``, ``gather_for_metrics``, ``reduce``, ``broadcast``; TRL's own) run
  over this rank's ``dp`` group, the ranks of the other replicas at the same place in theirs
  (``_as_processes``, ``_collectives_over``): the metrics TRL gathers are the global batch's, on
  every rank.
- A call of the model runs on the replica's own pipeline: the pipeline's step takes a global
  batch and runs replica ``r``'s contiguous share of it, so a call's rows go in as ``dp`` copies
  of themselves, of which each replica runs its own (:func:`_copies`). The replicas' calls may
  differ in length (their batches are padded apart), not in number: each call is a step of
  every replica's pipeline together, as DDP's processes call their models alike.
- Gradients: the second pass takes each output's gradient divided by ``dp``, and the pipeline
  sums the replicas' parameter gradients (FSDP2's reduction, divide factor 1): DDP's mean.
  HF's logged loss is its mean over the job's processes (every rank of every replica: each
  replica's loss counted equally), the grad norm the reduced gradient's, as under DDP.
- Generation (TRL's GRPO completions) in a replica's step: the replicas' prompts, left-padded
  to the longest, make the global batch of ``pipe.generate``, which has each replica generate
  its own share from its own random state (seeded per replica as TRL seeds per process); each
  replica keeps its rows, cut to what a DDP process's ``generate`` returns (its own prompt
  padding, its rows' length: ``_Stages._generate_share`` in ``trainer.py``). So the sampled
  tokens are those of TRL as ``dp`` DDP processes with the same seeds, not those of one process
  (which draws every row from one generator).
- Evaluation is one process's on every replica (``_one_process``: each replica's pipeline runs
  the whole global batch, ``dp`` copies of it going in; ``pipe.generate`` still samples each
  replica's share from its own state), so the eval loss and metrics are the trainer's in one
  process (GRPO's: DDP's); it costs each replica a forward of every row.

So a loss that DDP makes the global batch's (a token sum over HF's count of every process's
tokens times the processes, as HF's and TRL's SFT losses and label smoothing are; a mean over
the process's rows, equal in number, as DPO's; GRPO's over the gathered token count) trains as
one process with the global batch, or for GRPO as TRL under DDP; any other trains as DDP's mean
of the replicas' losses.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["SFT_SUMS", "ModelCalls", "per_token", "random_state", "set_random_state"]

FIELDS = ("log_probs", "entropy", "is_top1", "log_sum_sq_probs", "mean_logits")
"""TRL's fused head's per-token fields (``FusedCausalLMOutput``), all computed."""
DIFFERENTIABLE = ("log_probs", "entropy", "logits")
"""The outputs a trainer's loss may take gradients through."""


def per_token(logits: torch.Tensor, labels: torch.Tensor, temperature: float) -> dict:
    """TRL's fused LM head's fields (``add_fused_lm_head``) from one batch's ``logits``: for
    each next-token label, its log-probability under ``softmax(logits / temperature)``, the
    distribution's entropy, whether the label is its argmax, ``log(sum p^2)`` and the mean
    scaled logit; zero where the label is -100. In fp32, as TRL's kernel accumulates."""
    scaled = logits[:, :-1].float() / temperature
    targets = labels[:, 1:]
    mask = targets != -100
    logp = torch.log_softmax(scaled, dim=-1)
    picked = logp.gather(-1, targets.clamp(min=0).unsqueeze(-1)).squeeze(-1)
    fields = {
        "log_probs": picked,
        "entropy": -(logp.exp() * logp).sum(-1),
        "is_top1": scaled.argmax(-1) == targets,
        "log_sum_sq_probs": torch.logsumexp(2 * logp, dim=-1),
        "mean_logits": scaled.mean(-1),
    }
    return {
        k: v.masked_fill(~mask, False if v.dtype == torch.bool else 0) for k, v in fields.items()
    }


def _entropy_sum(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    logp = torch.log_softmax(logits[labels != -100].float(), dim=-1)
    return -(logp.exp() * logp).sum()


def _top1_sum(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return (logits.argmax(-1) == labels).logical_and(labels != -100).sum()


SFT_SUMS = {
    "entropy": _entropy_sum,
    "is_top1": _top1_sum,
    "label_mask": lambda logits, labels: (labels != -100).sum(),
}
"""The sums over a batch of TRL's fused head's fields (at temperature 1) that TRL's
``SFTTrainer`` logs as ``entropy`` and ``mean_token_accuracy`` (:func:`per_token`'s
definitions: zero where the label is -100), as pipeline token sums (``pipe.token_sums``: the
last stage computes them beside the loss, see [Note: token sums beside the loss])."""


class ModelCalls:
    """The model's forward for a trainer whose loss is its own (see [Note: a trainer's own loss
    on the pipeline]): ``calls(**inputs, labels=..., fused_lm_head=...)`` on every rank of the
    pipeline, then :meth:`flush` after the trainer's backward."""

    def __init__(self, pipe, model, temperature: float) -> None:
        self.pipe = pipe
        """The pipeline; on a mesh with replicas, each replica's calls are its own (see [Note: a
        trainer's own loss on replicas])."""
        self.model = model
        """The HF model (its ``loss_function`` for a plain call given labels)."""
        self.temperature = temperature
        self.pending: list[tuple] = []
        """Each call made with autograd on, whose gradients :meth:`flush` sends to the pipeline."""

    def __call__(self, *args: Any, fused_lm_head: bool = False, labels=None, **kwargs: Any):
        batch, count = self._inputs(args, kwargs, fused_lm_head, labels)
        device = self.pipe.device
        mixed = (torch.is_autocast_enabled(device.type), torch.get_autocast_dtype(device.type))
        rng = random_state(device)
        outputs = self._forward(batch, labels, fused_lm_head)
        if torch.is_grad_enabled():
            leaves = {k: v.requires_grad_() for k, v in outputs.items() if k in DIFFERENTIABLE}
            self.pending.append((batch, labels, fused_lm_head, leaves, rng, mixed))
        return self._output(outputs, labels, fused_lm_head, count)

    def _inputs(self, args, kwargs, fused: bool, labels) -> tuple[dict, Any]:
        """The call's pipeline inputs, and the count a fused loss divides by."""
        names = self.pipe.pipeline_config.input_names
        count = kwargs.pop("num_items_in_batch", None)
        for ignored in ("use_cache", "return_dict", "logits_to_keep"):
            kwargs.pop(ignored, None)
        given = {k: v for k, v in kwargs.items() if v is not None and v is not False}
        unknown = sorted(k for k in given if k not in names)
        if args or unknown or (fused and labels is None):
            what = "positional inputs" if args else unknown or "fused_lm_head without labels"
            raise ValueError(
                f"the pipelined model was called with {what}: it takes the keyword inputs "
                f"{list(names)} (PipelineConfig.input_names) and labels"
            )
        return given, count

    def _forward(self, batch: dict, labels, fused: bool) -> dict[str, torch.Tensor]:
        """The first pass: the outputs of every row, on every rank of the pipeline."""
        pipe, runner = self.pipe, self.pipe._runner
        rows = batch[pipe.pipeline_config.input_names[0]].shape[0]
        got: dict[int, dict[str, torch.Tensor]] = {}

        def collect(logits, tagged, num_items):
            outs = per_token(logits, tagged[:, :-1], self.temperature) if fused else {}
            outs = outs or {"logits": logits.detach()}
            for i, row in enumerate(tagged[:, -1].tolist()):
                got[row] = {k: v[i] for k, v in outs.items()}
            return logits.new_zeros(())

        # Each row's labels carry its index (the last column): the rows land where they belong
        # whatever order the last stage runs the microbatches in.
        index = torch.arange(rows).unsqueeze(1)
        tagged = torch.cat([labels.cpu() if fused else index, index], dim=1)
        with _loss(runner, collect), torch.no_grad():
            runner.evaluate(_copies({**batch, "labels": tagged}, pipe.dp_size), keep_logits=False)
        outputs = None
        if pipe.is_last:
            outputs = {k: torch.stack([got[r][k] for r in range(rows)]) for k in got[0]}
        return _from_last(pipe, outputs)

    def _output(self, outputs: dict, labels, fused: bool, count):
        """What the unsplit model's forward returns for the call."""
        if fused:
            from trl.trainer.utils import FusedCausalLMOutput

            mask = labels[:, 1:] != -100
            divisor = mask.sum().clamp(min=1) if count is None else count
            loss = -outputs["log_probs"].sum() / divisor
            return FusedCausalLMOutput(loss=loss, label_mask=mask, **outputs)
        from transformers.modeling_outputs import CausalLMOutputWithPast

        logits, loss = outputs["logits"], None
        if labels is not None:
            vocab = logits.shape[-1]
            loss = self.model.loss_function(logits, labels, vocab, num_items_in_batch=count)
        return CausalLMOutputWithPast(loss=loss, logits=logits)

    def flush(self) -> None:
        """The second pass of every call since the last flush (see [Note: a trainer's own loss
        on the pipeline]): the gradients the trainer's backward left on the outputs, through
        the pipeline into its parameters."""
        pending, self.pending = self.pending, []
        replicas = self.pipe.dp_size
        for batch, labels, fused, leaves, rng, (autocast, dtype) in pending:
            # DDP's mean over the replicas: the pipeline sums their gradients.
            grads = {k: leaf.grad / replicas for k, leaf in leaves.items() if leaf.grad is not None}
            if not grads:
                continue
            packed, loss_fn = self._surrogate(labels, fused, grads)
            set_random_state(self.pipe.device, rng)
            device = self.pipe.device.type
            inputs = _copies({**batch, "labels": packed.to(self.pipe.device)}, replicas)
            with _loss(self.pipe._runner, loss_fn), torch.autocast(device, dtype, autocast):
                self.pipe.run_train(**inputs)

    def _surrogate(self, labels, fused: bool, grads: dict[str, torch.Tensor]):
        """The second pass's labels and loss: ``sum(outputs(logits) * grads)`` per microbatch.
        For the fused head's fields the labels carry the call's labels, then each field's
        gradient (aligned with the labels: a field's token ``t`` predicts label ``t + 1``)."""
        if not fused:
            return grads["logits"], lambda logits, g, n: (logits.float() * g.float()).sum()
        names = sorted(grads)
        parts = [labels.double()]
        parts += [torch.nn.functional.pad(grads[k].double(), (1, 0)) for k in names]

        def loss_fn(logits, packed, num_items):
            outs = per_token(logits, packed[..., 0].long(), self.temperature)
            return sum((outs[k] * packed[:, 1:, 1 + i].float()).sum() for i, k in enumerate(names))

        return torch.stack(parts, dim=-1), loss_fn


def _copies(batch: dict[str, torch.Tensor], replicas: int) -> dict[str, torch.Tensor]:
    """``batch`` as the pipeline's step takes a replica's rows: a global batch of ``replicas``
    copies of it, of which each replica runs its own (the copy at its place). See [Note: a
    trainer's own loss on replicas]."""
    if replicas == 1:
        return batch
    return {k: torch.cat([v] * replicas) for k, v in batch.items()}


@contextlib.contextmanager
def _loss(runner, loss_fn):
    """``runner``'s loss for one step: ``loss_fn``, over a count of 1, without what the model
    adds to its loss (an MoE router's loss: not the trainer's, which is computed from the
    outputs)."""
    own = runner.loss_fn, runner.num_items_fn, runner.added_weight
    runner.loss_fn, runner.num_items_fn = loss_fn, lambda labels: torch.ones(())
    runner.added_weight = 0.0
    try:
        yield
    finally:
        runner.loss_fn, runner.num_items_fn, runner.added_weight = own


def _from_last(pipe, outputs: dict | None) -> dict[str, torch.Tensor]:
    """The last stage's ``outputs`` on every rank of the pipeline: their shapes and dtypes,
    then each tensor, broadcast from the last rank (flags as bytes)."""
    header = [None if outputs is None else {k: (v.shape, v.dtype) for k, v in outputs.items()}]
    dist.broadcast_object_list(header, group_src=pipe.last_rank, group=pipe.group)
    result = {}
    for name, (shape, dtype) in header[0].items():
        wire = torch.uint8 if dtype == torch.bool else dtype
        t = outputs[name] if outputs is not None else torch.empty(shape, dtype=wire)
        t = t.detach().to(pipe.device, wire).contiguous()
        dist.broadcast(t, group_src=pipe.last_rank, group=pipe.group)
        result[name] = t.to(dtype)
    return result


def random_state(device: torch.device) -> tuple:
    """Torch's random state on the CPU and, on a GPU, ``device``'s."""
    cuda = torch.cuda.get_rng_state(device) if device.type == "cuda" else None
    return torch.get_rng_state(), cuda


def set_random_state(device: torch.device, state: tuple) -> None:
    torch.set_rng_state(state[0])
    if state[1] is not None:
        torch.cuda.set_rng_state(state[1], device)
