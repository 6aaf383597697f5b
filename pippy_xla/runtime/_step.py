"""Running a step: :class:`StepRunner` checks and splits a batch, agrees on its signature with
every rank, runs the C++ engine with :func:`stage_forward` as the stage's forward, sums tied-weight
gradients and reduces the loss.

A step: ``_batch.check_batch`` -> ``_batch.step_key`` -> ``_batch.agree_on_step`` (the step
handshake) -> ``_batch.split_batch`` -> ``_C.Engine.run`` (which calls the forward of
:func:`stage_forward` for every forward action, and with a mesh the replicas' reduction of each
stage as soon as its gradients are complete) -> tied-gradient sums -> loss broadcast.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from contextlib import nullcontext
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.modules.module as _module

from pippy_xla._native import _C
from pippy_xla.errors import BatchMismatchError
from pippy_xla.runtime._batch import agree_on_step, check_batch, digest64, split_batch, step_key
from pippy_xla.runtime._build import BuiltPipeline
from pippy_xla.runtime._grads import clip_, global_norm, local_gradients
from pippy_xla.runtime._recompile import RecompileWatch
from pippy_xla.runtime._ties import add_back_grads, combine_among, set_aside_grads
from pippy_xla.runtime.data_parallel import local_tensor
from pippy_xla.runtime.failures import FailureState
from pippy_xla.runtime.tensor_parallel import vocabulary_parallel_loss, whole_tensor
from pippy_xla.split import hf
from pippy_xla.split.partition import StageGraph

if TYPE_CHECKING:  # the runtime reads the config it is given; config.py sits above the wings
    from pippy_xla.config import PipelineConfig

__all__ = [
    "EvalOutput",
    "StageForward",
    "StepRunner",
    "TokenSum",
    "direct_forward",
    "stage_forward",
]

logger = logging.getLogger(__name__)

StageForward = Callable[[int, int, list[torch.Tensor]], Sequence[torch.Tensor]]
"""``forward(stage, microbatch, boundary_inputs) -> outputs``, as ``_C.Engine.run`` calls it."""


def stage_forward(
    stages: Sequence[StageGraph],
    modules: dict[int, Callable],
    *,
    microbatches: dict[str, tuple[torch.Tensor, ...]],
    labels: tuple[torch.Tensor, ...] | None,
    num_items: torch.Tensor | None,
    loss_fn: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor],
    losses: dict[int, torch.Tensor],
    logits: dict[int, torch.Tensor] | None,
    watch: RecompileWatch | None = None,
    added_losses: dict[int, torch.Tensor] | None = None,
    added_scale: float = 1.0,
    added_grad_scale: float | None = None,
) -> StageForward:
    """The callable the engine runs for each forward action of one step.

    Args:
        stages: every stage of the pipeline (for their batch inputs).
        modules: what runs each local stage (its graph module, or the compiled one).
        microbatches: the step's batch inputs, split into microbatches.
        labels: the labels' microbatches, if the step has labels.
        num_items: the batch's count of valid tokens (``loss_fn``'s divisor).
        loss_fn: the loss of one microbatch.
        losses: filled on the last stage with the detached microbatch losses.
        logits: filled on the last stage with each microbatch's logits, when not ``None``.
        watch: told every stage's inputs (compiled stages).
        added_losses: filled on the last stage with the detached terms the model adds to its
            loss, scaled (see [Note: added loss terms per microbatch]).
        added_scale: the added terms' weight in a microbatch's loss.
        added_grad_scale: the weight of their gradient, where it is not ``added_scale`` (see
            [Note: added terms over the whole batch] in ``split/hf.py``).
    """
    last = len(stages) - 1
    # Each local stage's batch arguments, per microbatch, made in one pass before the step (see
    # [Note: calling a stage's forward]); empty for a stage that reads no batch input.
    batch_args = {
        s: list(zip(*(microbatches[n] for n in stages[s].batch_inputs), strict=True))
        for s in modules
    }

    def forward(stage: int, mb: int, inputs: list[torch.Tensor]) -> Sequence[torch.Tensor]:
        own = batch_args[stage]
        if watch is not None:
            watch.see(stage, [*own[mb], *inputs] if own else inputs)
        out = modules[stage](*own[mb], *inputs) if own else modules[stage](*inputs)
        if stage != last:
            return out
        if logits is not None:  # whole: see [Note: the vocabulary-parallel head]
            logits[mb] = whole_tensor(out[0])
        if labels is None:
            return []
        loss = loss_fn(out[0], labels[mb], num_items)
        if stages[last].added_loss:
            loss = loss + _added(out[1], added_scale, added_grad_scale, added_losses, mb)
        losses[mb] = loss.detach()
        return [loss]

    return forward


def _added(
    term: torch.Tensor,
    scale: float,
    grad_scale: float | None,
    added_losses: dict[int, torch.Tensor] | None,
    mb: int,
) -> torch.Tensor:
    """The model's added ``term`` weighted ``scale`` in microbatch ``mb``'s loss, its gradient
    weighted ``grad_scale`` where given (see :func:`stage_forward`), recorded detached in
    ``added_losses``."""
    added = term * scale
    if grad_scale is not None:  # the value's weight, the gradient's own
        added = added + (term - term.detach()) * (grad_scale - scale)
    if added_losses is not None:
        added_losses[mb] = added.detach()
    return added


TokenSum = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
"""``fn(logits, next_labels) -> sum`` over one microbatch's tokens (see [Note: token sums beside
the loss])."""


def _token_sums(
    fns: dict[str, TokenSum], logits: torch.Tensor, labels: torch.Tensor, shifted: bool
) -> torch.Tensor:
    """Each of ``fns`` on one microbatch's logits (whole, detached) and next-token labels
    (aligned: ``logits[:, t]`` predicts ``labels[:, t]``), stacked in float32."""
    with torch.no_grad():
        logits = whole_tensor(logits).detach()
        if not shifted:  # HF's causal-LM shift: position t predicts token t + 1
            logits, labels = logits[:, :-1], labels[:, 1:]
        return torch.stack([fn(logits, labels).float() for fn in fns.values()])


"""[Note: token sums beside the loss]

Metrics a trainer logs from the logits of a step it trains in one pass (TRL's ``SFTTrainer``
logs the entropy and the accuracy of the next-token distribution over the label tokens) need the
logits, which only the last stage holds, microbatch by microbatch. ``StepRunner.token_sums``
(``PipelineModel.token_sums``; ``None`` by default) names functions of one microbatch's logits and
its next-token labels, each a sum over the microbatch's tokens; the last stage computes them
with each microbatch's loss (its ``loss_fn`` wrapped), without autograd, on the whole logits (a
vocabulary-parallel head's gathered), with HF's causal shift (or the labels context parallelism
shifted on the whole row). Their sums over the microbatches travel with the loss in its
broadcast and are summed with it over the cp ranks and the replicas, so every rank reads the
global batch's sums (``last_token_sums``) after ``run_train`` or ``run_eval``. Sums, not
means: they add up over microbatches, cp shares and replicas; a trainer divides them as it
defines its metric. Without ``token_sums`` the step computes nothing more and the broadcast is
the loss's alone.
"""


"""[Note: calling a stage's forward]

Calling an fx ``GraphModule`` runs three Python frames before its ``forward``: fx's
``_WrappedCall`` and ``nn.Module``'s ``_wrapped_call_impl`` and ``_call_impl``, which only look for
hooks. Once per forward action that cost 13-14 us in the overhead regime of
``benchmarks/compare.py`` and 40-65 us in its compute regime (the same frames, run after a forward
whose tensors pushed the interpreter's own code and data out of the caches), time the F action
spends outside the stage's work. So a step calls ``module.forward`` directly where calling the
module would do nothing else (:func:`direct_forward`): a ``GraphModule`` of the usual class, with no
hooks of its own or global ones and no ``Module.compile``. That is decided at every step, so hooks
registered between steps are honoured; a compiled stage (dynamo's ``OptimizedModule``) is always
called as a module.

For the same reason the microbatch's batch arguments of each local stage are made before the
engine starts, in one ``zip`` over the split inputs, and the forward calls the stage with them and
the received tensors as they are (a tuple of outputs goes back to the engine without a copy into
a list): in the compute regime the F action spent 22 us between entering the step's forward and
calling the module, building that list cold.
"""

_TP_CAUSE = (
    "a rank on the mesh's tensor-parallel dimension was given another batch (or another kind "
    "of step) than its tp peers; every rank must get the same whole batch"
)

_CP_CAUSE = (
    "a rank on the mesh's context-parallel dimension was given another batch (or another kind "
    "of step) than its cp peers; every rank must get the same whole batch"
)

_HOOKS = ("_backward_hooks", "_backward_pre_hooks", "_forward_hooks", "_forward_pre_hooks")


def direct_forward(module: Callable) -> Callable:
    """``module.forward`` where calling ``module`` would only call it, else ``module`` (see
    [Note: calling a stage's forward])."""
    if not isinstance(module, torch.fx.GraphModule):
        return module
    wrapped = getattr(type(module), "_wrapped_call", None)
    if getattr(wrapped, "cls_call", True) is not None:  # a class with its own __call__
        return module
    try:
        hooked = any(getattr(module, n) for n in _HOOKS) or any(
            getattr(_module, f"_global{n}") for n in _HOOKS
        )
        hooked = hooked or module._compiled_call_impl is not None
    except AttributeError:  # an nn.Module of another torch than the one this was written for
        return module
    return module if hooked else module.forward


@dataclass(kw_only=True, slots=True)
class EvalOutput:
    """What :meth:`PipelineModel.run_eval` returns."""

    loss: torch.Tensor | None
    """The batch's mean loss on every rank, if labels were given."""
    logits: torch.Tensor | None
    """The whole batch's logits on the last stage's rank, ``None`` elsewhere (with a mesh: the
    logits of this replica's share of the batch; with context parallelism, of every token of
    its rows, on each cp rank's last stage)."""


"""[Note: added loss terms per microbatch]

A microbatch's loss is HF's loss of that microbatch: ``loss_fn`` (its tokens' summed loss over the
whole batch's token count, so that the microbatches' losses add up to the batch's mean) plus the
terms the model adds to its loss (MoE load balancing over every layer's router statistics, see
[Note: terms added to the loss]), computed over the microbatch and weighted by one over the
number of microbatches in the step (times the replicas, on a mesh): the step's loss adds up to the
mean of HF's losses of the microbatches. With one microbatch and one replica it is HF's loss of
the batch.
"""


"""[Note: step spans]

A step's timings (:meth:`pippy_xla._report.Report.timings`) hold, besides the engine's actions, the
step's own work around the engine as two spans with stage and microbatch -1: ``PRE``, from the
call of ``run_train`` / ``run_eval`` to the engine's start (the batch's checks and split, the step
handshake, the forward's setup), and ``POST``, from the engine's end to the return (the recompile
check of compiled stages, tied-weight gradient sums, the loss reduction). They are the per-step
cost that no schedule hides, and they are drawn in the timeline. ``PRE`` includes the wait for the
last rank to reach the handshake, and ``POST`` on a rank whose engine ends before the last stage's
the wait for the loss. A step that fails records what it reached.
"""


"""[Note: a step's own time]

What a step does around its engine runs once per step, but on the pipeline's critical path: the
first rank's ``PRE`` delays every stage's first forward and the last rank's ``POST`` the step's
end (see [Note: step spans]). It runs cold: after a step's compute the interpreter's code and
data are out of the caches, and the same Python costs 3-5 times what a loop of it costs
(measured in the overhead-compiled regime of ``benchmarks/compare.py``: the step key 51 us
against 7-12 in a loop, the handshake 65 against 14). So the path is kept short in lines and
objects rather than tuned call by call: the step key is one C++ call (``_C.batch_key``), the
engine's run and the watched collectives pair their abort watch in ``try`` / ``finally`` instead
of generator context managers (2-3 us each hot, about 10 cold), tied-gradient bookkeeping is
skipped without ties, and the loss sums stack the microbatch losses once.
"""


class _BatchTerms:
    """One step's handler of :func:`hf.batch_term` (see [Note: added terms over the whole
    batch]): first it keeps each marked value per stage and microbatch, then, after
    :meth:`gather`, it puts the running microbatch's value among every replica's others."""

    def __init__(self, num_microbatches: int, replica: int) -> None:
        self.num_microbatches, self.replica = num_microbatches, replica
        self.at = (0, 0)
        """The running forward's ``(stage, microbatch)``."""
        self.kept: dict[tuple[int, str], dict[int, torch.Tensor]] = {}
        self.whole: dict[tuple[int, str], list[torch.Tensor]] | None = None
        """Per marked value, every replica's microbatches' values, replica by replica."""

    def tracking(self, forward: StageForward) -> StageForward:
        """``forward``, telling this handler which stage and microbatch run."""

        def tracked(stage: int, mb: int, inputs: list[torch.Tensor]):
            self.at = (stage, mb)
            return forward(stage, mb, inputs)

        return tracked

    def __call__(self, value: torch.Tensor, key: str) -> torch.Tensor:
        stage, mb = self.at
        if self.whole is None:
            self.kept.setdefault((stage, key), {})[mb] = value.detach()
            return value
        parts = list(self.whole[(stage, key)])
        parts[self.replica * self.num_microbatches + mb] = value
        return torch.cat(parts)

    def gather(self, dp) -> None:
        """Every replica's kept values (``dp``: the replicas, or ``None``): one all_gather of
        their row counts, then one all_reduce per dtype, of every value of that dtype placed at
        its replica's rows in zeros (a sum with zeros: exact)."""
        keys = sorted(self.kept)
        mine = {k: [self.kept[k][mb] for mb in range(self.num_microbatches)] for k in keys}
        if dp is None:
            self.whole = mine
            return
        what = "added-loss inputs"
        rows = dp.all_gather_ints([int(v.shape[0]) for k in keys for v in mine[k]], what)
        mbs = self.num_microbatches
        counts = {k: [r[i * mbs : (i + 1) * mbs] for r in rows] for i, k in enumerate(keys)}
        self.whole = {}
        for dtype in sorted({mine[k][0].dtype for k in keys}, key=str):
            group = [k for k in keys if mine[k][0].dtype == dtype]
            parts = []  # per key: its whole [rows, ...] buffer, this replica's rows filled
            for k in group:
                local = torch.cat(mine[k])
                local = local.to(torch.int64) if dtype == torch.bool else local
                at = sum(sum(c) for c in counts[k][: self.replica])
                whole = local.new_zeros((sum(map(sum, counts[k])), *local.shape[1:]))
                whole[at : at + local.shape[0]] = local
                parts.append(whole)
            summed = dp.all_reduce_sum(torch.cat([t.reshape(-1) for t in parts]), what)
            flats = summed.split([t.numel() for t in parts])
            for k, t, flat in zip(group, parts, flats, strict=True):
                whole = flat.view(t.shape).to(dtype)
                self.whole[k] = list(whole.split([r for c in counts[k] for r in c]))


class StepRunner:
    """Runs one rank's training and evaluation steps of a built pipeline."""

    _last_sum_names: tuple[str, ...] = ()
    """The names of the last step's token sums (``_last_parts[2:]``)."""

    def __init__(
        self, built: BuiltPipeline, config: PipelineConfig, failures: FailureState
    ) -> None:
        self.place, self.config, self.failures = built.place, config, failures
        self.stages, self.runners, self.ties = built.stages, built.runners, built.ties
        self.train_engine, self.eval_engine = built.train_engine, built.eval_engine
        self.dp, self.tp, self.ep, self.cp = built.dp, built.tp, built.ep, built.place.cp
        if self.cp is not None:  # [Note: pipeline x context parallel]
            self.cp.attach([self.stages[i].module for i in self.runners])
        self.watch = built.compile_watch
        self.loss_fn = built.loss_fn
        """The loss of one microbatch (assignable between steps)."""
        self.num_items_fn = built.num_items_fn
        """The whole batch's count of what ``loss_fn`` averages over (assignable between
        steps)."""
        self.token_sums: dict[str, TokenSum] | None = None
        """See [Note: token sums beside the loss] (assignable between steps)."""
        self.added_weight = 1.0
        """The weight of what the model adds to ``loss_fn``'s loss (an MoE router's loss):
        0 where a loss of one's own leaves it out (assignable between steps)."""
        self.added_over_batch = False
        """Whether what the model adds to its loss is computed over the whole (global) batch, as
        one process computes it on that batch, rather than per microbatch: see [Note: added
        terms over the whole batch] in ``split/hf.py`` (assignable between steps; the model's
        terms must allow it, :meth:`check_added_over_batch`)."""
        self.ragged = built.ragged
        """The rows' shares of the batch inputs whose dim 0 is not the rows (or ``None``)."""
        self._own_loss = built.loss_fn if built.label_rows is not None else None
        """The model's own loss, while the labels are checked against its vocabulary."""
        self._label_rows = built.label_rows
        self.last_rank = built.train_engine.schedule.stage_rank[-1]
        self.last_engine = built.train_engine
        """The engine of the last step."""
        self.reduce_spans: list[tuple[str, int, int, int, int]] = []
        """The last step's data-parallel reductions, as timings."""
        self.step_spans: list[tuple[str, int, int, int, int]] = []
        """The last step's work outside the engine, as timings (see [Note: step spans])."""
        self.recompiles: list[str] = []
        """Explanations of the recompilations seen after each mode's first step."""
        self._last_parts: torch.Tensor | None = None
        """The last step's ``[total, aux, *token sums]`` (read on demand: no device sync)."""
        self._sharded_head = self.tp is not None and self.tp.sharded_head
        """Whether this rank's steps run under :func:`vocabulary_parallel_loss` (see [Note: the
        vocabulary-parallel head])."""
        self._holds_last = len(self.stages) - 1 in self.runners
        """Whether this rank runs the last stage (the loss, and the only use of the labels)."""
        self._reads = {n for i in self.runners for n in self.stages[i].batch_inputs}
        """The batch inputs this rank's stages read (the only ones it splits into microbatches),
        with the labels where the last stage is."""
        if self._holds_last:
            self._reads.add("labels")
        self._abortable = self.place.device.type == "cpu" and _C.shm_whole_group(
            self.place.group_name
        )
        """Whether the step's collectives over the pipeline's group run over shared memory,
        where a peer's failure can abort them on this thread (see [Note: watched
        collectives])."""

    def train(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """Forward and backward of every microbatch; the batch's mean loss on every rank."""
        start = self._begin_step()
        batch, microbatches, signature = self._prepare(batch, "train")
        losses: dict[int, torch.Tensor] = {}
        added: dict[int, torch.Tensor] = {}
        sums: list[torch.Tensor] = []
        terms = self._batch_terms(batch, microbatches, signature)
        forward = self._forward(batch, microbatches, losses, added, sums, None, terms)
        earlier = set_aside_grads(self.ties)  # [Note: tied gradients accumulate once]
        partial = self.tp.set_aside_partial() if self.tp is not None else None
        if self.cp is not None:  # summed over cp without the window's earlier steps'
            local = (p for i in self.runners for p in self.stages[i].module.parameters())
            params = list({id(p): p for p in local}.values())
            cp_earlier = self.cp.set_aside_grads(params)
        try:
            with hf.batch_terms_handled(terms) if terms is not None else nullcontext():
                end = self._run(self.train_engine, forward, signature, start)
            if partial is not None:  # [Note: pipeline x tensor parallel]
                self.failures.watched(
                    "tensor-parallel gradient sum", self.tp.reduce_partial_grads, partial
                )
            if self.ties:
                self.failures.watched("tied-weight gradient sum", self._sum_tied_grads)
            if self.cp is not None:  # [Note: pipeline x context parallel]
                self.failures.watched(
                    "context-parallel gradient sum", self.cp.reduce_grads, params, cp_earlier
                )
        finally:
            add_back_grads(self.ties, earlier)
        loss = self._reduce_loss(losses, added, sums)
        self.step_spans.append(("POST", -1, -1, end, time.time_ns()))
        return loss

    @torch.no_grad()  # the eval engine's boundary specs are agreed without requires_grad
    def evaluate(self, batch: dict[str, torch.Tensor], keep_logits: bool = True) -> EvalOutput:
        """Forward only, without autograd: the logits on the last stage's rank (unless not
        ``keep_logits``: the loss function then sees each microbatch's and nothing keeps them)
        and, given labels, the loss."""
        start = self._begin_step()
        batch, microbatches, signature = self._prepare(batch, "eval")
        losses: dict[int, torch.Tensor] = {}
        added: dict[int, torch.Tensor] = {}
        sums: list[torch.Tensor] = []
        logits: dict[int, torch.Tensor] | None = {} if keep_logits else None
        terms = self._batch_terms(batch, microbatches, signature) if "labels" in batch else None
        forward = self._forward(batch, microbatches, losses, added, sums, logits, terms)
        with hf.batch_terms_handled(terms) if terms is not None else nullcontext():
            end = self._run(self.eval_engine, forward, signature, start)
        if self.dp is not None:
            self.dp.after_eval()
        is_last = self.place.rank == self.last_rank
        keep = is_last and logits is not None
        all_logits = torch.cat([logits[mb] for mb in sorted(logits)]) if keep else None
        if keep and self.cp is not None:  # every token's, from the cp ranks' last stages
            what = f"[rank {self.place.rank}] context-parallel logits"
            all_logits = self.failures.watched(what, self.cp.whole_tokens, all_logits, what)
        loss = self._reduce_loss(losses, added, sums) if "labels" in batch else None
        self.step_spans.append(("POST", -1, -1, end, time.time_ns()))
        return EvalOutput(loss=loss, logits=all_logits)

    def _begin_step(self) -> int:
        """Starts a step's :attr:`step_spans`; returns the step's start (system clock ns)."""
        self.step_spans.clear()
        return time.time_ns()

    def clip_grad_norm_(
        self,
        params: Sequence[torch.nn.Parameter],
        max_norm: float,
        norm_type: float,
        error_if_nonfinite: bool,
    ) -> torch.Tensor:
        """Clips this rank's gradients by the global gradient norm, which it returns (see
        [Note: global gradient clipping])."""
        self.failures.check_usable()
        place, norm_type = self.place, float(norm_type)
        scaled, counted = local_gradients(params, self.ties, place.rank)
        experts = {id(p) for p in self.ep.params} if self.ep is not None else set()
        dense = [p for p in params if id(p) not in experts]
        if self.tp is not None:  # a tensor replicated over tp counts once: on tp rank 0
            dense = [p for p in dense if self.tp.counts_in_norm(p)]
        _, counted = local_gradients(dense, self.ties, place.rank)

        sharded = self.dp is not None and self.dp.sharded
        if sharded and place.mesh.dp_replicate_rank != 0:  # HSDP: a shard counts on one replica
            counted = []

        def norm(abortable: _C.Abortable | None = None) -> torch.Tensor:
            def pipeline_sum(t: torch.Tensor, what: str) -> torch.Tensor:
                where = f"[rank {place.rank}] {what}"
                return _C.all_reduce_sum_copy(
                    t, place.group_name, place.timeout_ms, where, abortable=abortable
                )

            first = [(self.dp.all_reduce_sum, place.dp_rank, place.dp_size)] if sharded else []
            parts = [(counted, first)]
            if self.ep is not None:  # [Note: pipeline x expert parallel]
                parts.append(self.ep.norm_part())
            reductions = [(pipeline_sum, place.rank, place.num_ranks)]
            if self.tp is not None:
                reductions.append((self.tp.all_reduce_sum, self.tp.rank, self.tp.size))
            return global_norm(parts, norm_type, place.device, reductions)

        total = self.failures.watched(
            "gradient norm all_reduce",
            norm,
            abortable=self._abortable and not sharded and self.tp is None and self.ep is None,
        )
        clip_(
            scaled,
            total,
            max_norm=max_norm,
            norm_type=norm_type,
            error_if_nonfinite=error_if_nonfinite,
        )
        return total

    def tune_schedule(self, measure: Callable[[], dict[str, list[float]]]) -> _C.Schedule:
        """Generates the training schedule again at the costs ``measure`` returns (a collective:
        every stage's ``forward`` / ``backward`` / ``weight`` seconds, as
        :meth:`pippy_xla._report.Report.stage_costs` measures them) and runs later training steps
        with it: the same stages on the same ranks, in another order. A collective over the
        pipeline's ranks (and, with a mesh, the replicas, whose costs are averaged so that every
        replica runs one order). A schedule whose order does not depend on costs is a
        ``ValueError`` before anything is measured."""
        place, config = self.place, self.config
        name = config.schedule
        if not isinstance(name, str) or not _C.schedule_info(name).list_scheduled:
            listed = [i.name for i in _C.schedule_table() if i.list_scheduled]
            raise ValueError(
                f"schedule {config.schedule_name!r} has a fixed order; tune_schedule reorders the "
                f"list-scheduled schedules {listed}"
            )
        costs = measure()
        # Every replica and every tp rank of a stage must run one order (a tp rank's layers
        # run collectives with its peers'): their costs are averaged.
        for group, what in ((self.dp, "replicas"), (self.tp, "tensor-parallel ranks")):
            if group is not None:
                costs = self._mean_costs(costs, group, what)
        schedule = _C.make_schedule(
            config.schedule_name, place.num_ranks, config.num_microbatches, config.chunks, **costs
        )
        key = digest64(schedule.table().encode())
        what = f"[rank {place.rank}] schedule agreement"
        everyone = self.failures.watched(
            what,
            _C.all_gather_int64,
            [key],
            place.group_name,
            str(place.device),
            place.timeout_ms,
            what,
        )
        agreed = all(k == [key] for k in everyone)
        for group in (self.dp, self.tp):
            if group is not None:
                agreed = self.failures.watched(what, group.agree, key, what) and agreed
        if not agreed:
            raise RuntimeError(f"{what}: the ranks generated different orders from their costs")
        self.train_engine = place.engine(schedule)
        logger.info("[rank %d] %r reordered for the measured costs", place.rank, schedule.name)
        logger.debug("[rank %d] %s", place.rank, schedule.table())
        return schedule

    def _mean_costs(self, costs: dict[str, list[float]], group, what: str) -> dict:
        """``costs`` averaged over ``group`` (the replicas' :class:`DataParallel` or the tp
        ranks' :class:`TensorParallel`: an ``all_reduce_sum`` over them)."""
        place = self.place
        flat = torch.tensor(
            [c for k in ("forward", "backward", "weight") for c in costs[k]],
            dtype=torch.float64,
            device=place.device,
        )
        where = f"[rank {place.rank}] schedule costs all_reduce over {what}"
        total = self.failures.watched(where, group.all_reduce_sum, flat, where)
        size = place.dp_size if group is self.dp else place.tp_size
        n = len(costs["forward"])
        mean = (total / size).tolist()
        return {
            k: mean[i * n : (i + 1) * n] for i, k in enumerate(("forward", "backward", "weight"))
        }

    def _sum_tied_grads(self) -> None:
        """Sums each tied weight's gradient over its owners."""
        for tie, params in self.ties:
            grads = [local_tensor(p.grad) for p in params if p.grad is not None]
            combine_among(tie, grads, add=True, **self._transport())

    def _transport(self) -> dict:
        place = self.place
        return {"rank": place.rank, "group_name": place.group_name, "timeout_ms": place.timeout_ms}

    def gather_ints(self, values: Sequence[int], what: str) -> list[list[int]]:
        """Every rank's ``values`` over the handshake group, watched as ``what`` (a peer's
        failure or death is a ``PipelineError`` here, not a hang)."""
        place = self.place
        handshake = place.handshake
        return self.failures.watched(
            what,
            _C.all_gather_int64,
            values,
            handshake.group_name,
            handshake.device,
            place.timeout_ms,
            f"[rank {place.rank}] {what}",
            abortable=self._abortable,
        )

    def _prepare(self, batch: dict[str, torch.Tensor], kind: str):
        """A step's batch checked and split, and its signature, after every rank agreed on the
        step (see [Note: step handshake]). The split comes after the handshake: a rank that
        splits more inputs (the last stage's, with the labels) does not hold the others back."""
        self.failures.check_usable()
        place = self.place
        if self.cp is not None:  # the tokens' positions; see [Note: pipeline x context parallel]
            batch = self.cp.complete(batch)
        batch = check_batch(
            batch,
            input_names=self.config.input_names,
            num_microbatches=self.config.num_microbatches,
            need_labels=kind == "train",
            dp_size=place.dp_size,
            index_limits=self.stages[0].index_limits,
            label_rows=self._label_rows if self.loss_fn is self._own_loss else None,
            ragged=self.ragged,
        )
        key, contents = step_key(kind, batch, self.config.check_batch_content)

        # A mismatch leaves the pipeline usable: no transfer of the step has started.
        gather = self.gather_ints
        if self.tp is not None:
            gather = self.checked_gather(key, [self.tp_check])
        if self.cp is not None:
            gather = self.checked_gather(key, [(self.cp, "context-parallel", _CP_CAUSE)])
        agree_on_step(key, contents, batch, place.rank, gather)
        with self.failures.guard("batch split"):  # its peers are on their way to the engine
            microbatches = split_batch(
                batch,
                num_microbatches=self.config.num_microbatches,
                device=place.device,
                dp_rank=place.dp_rank,
                dp_size=place.dp_size,
                split=self._reads,
                ragged=self.ragged,
            )
            if self.cp is not None:
                self.cp.shard(microbatches, batch, place.dp_rank, place.dp_size)
        return batch, microbatches, key.signature

    def checked_gather(
        self, key, checks: Sequence[tuple[Any, str, str]]
    ) -> Callable[[Sequence[int], str], list[list[int]]]:
        """The step handshake's gather when other ranks than the pipeline's must get the same
        batch: per check ``(peers, kind, cause)`` (``peers``: the tp ranks of this stage or the
        replicas, a :class:`TensorParallel` or :class:`DataParallel`, with ``agree``), first
        they compare their step keys (a tp rank given other rows would otherwise mix two
        batches in its layers' collectives without any error), then the pipeline's handshake
        carries each rank's verdicts, so that every rank of the mesh raises the first failed
        check's ``cause`` or none does (see [Note: pipeline x tensor parallel]: every pipeline
        group holds a rank of every stage)."""
        place = self.place
        mine = digest64(repr(key.words()).encode())
        oks = []
        for peers, kind, _ in checks:
            what = f"[rank {place.rank}] {kind} step handshake"
            oks.append(int(self.failures.watched(what, peers.agree, mine, what)))
        first = [True]

        def gather(values: Sequence[int], what: str) -> list[list[int]]:
            if not first[0]:
                return self.gather_ints(values, what)
            first[0] = False
            everyone = self.gather_ints([*values, *oks], what)
            for i, (_, kind, cause) in enumerate(checks):
                if not all(words[len(values) + i] for words in everyone):
                    raise BatchMismatchError(
                        rank=place.rank,
                        failed_rank=place.rank,
                        action=f"{kind} step handshake",
                        cause=cause,
                    )
            return [words[: len(values)] for words in everyone]

        return gather

    @property
    def tp_check(self) -> tuple[Any, str, str]:
        """The :meth:`checked_gather` check of the tp ranks of this rank's stages."""
        return (self.tp, "tensor-parallel", _TP_CAUSE)

    def check_added_over_batch(self) -> None:
        """Raises ``ValueError`` where :attr:`added_over_batch` cannot hold (see [Note: added
        terms over the whole batch])."""
        last = self.stages[-1]
        if last.added_loss and not last.added_over_batch:
            raise ValueError(
                "the terms this model adds to its loss read a value of its parameters alone, so "
                "they cannot be computed over the whole batch: only per microbatch"
            )
        if last.added_loss and self.cp is not None:
            raise ValueError(
                "the terms the model adds to its loss (an MoE router's loss) cannot be computed "
                "over the whole batch under context parallelism yet: only per microbatch"
            )

    def _batch_terms(self, batch, microbatches, signature) -> _BatchTerms | None:
        """Where :attr:`added_over_batch` asks for it, the batch's forward without gradients and
        without labels, keeping what enters the added terms; then every replica's, gathered:
        the handler of the step's own forward. See [Note: added terms over the whole batch]."""
        mbs, place = self.config.num_microbatches, self.place
        if not (
            self.added_over_batch
            and self.added_weight
            and self.stages[-1].added_loss
            and mbs * place.dp_size > 1
        ):
            return None
        self.check_added_over_batch()
        terms = _BatchTerms(mbs, place.dp_rank)
        no_labels = {k: v for k, v in microbatches.items() if k != "labels"}
        forward = terms.tracking(self._forward(batch, no_labels, {}, {}, [], None))
        if self.dp is not None and self.dp.sharded:
            self.failures.watched("data-parallel all-gather", self.dp.unshard)
        with torch.no_grad(), hf.batch_terms_handled(terms):
            self.failures.run_step(self.eval_engine, signature, forward)
        what = "added-loss inputs all_gather over replicas"
        self.failures.watched(what, terms.gather, self.dp)
        return terms

    def _forward(
        self, batch, microbatches, losses, added, sums, logits, terms=None
    ) -> StageForward:
        labels = batch.get("labels")
        num_items = None
        if labels is not None and self._holds_last:  # only the loss needs the token count
            num_items = self.num_items_fn(labels).to(self.place.device)
        forward = stage_forward(
            self.stages,
            {s: direct_forward(m) for s, m in self.runners.items()},
            microbatches=microbatches,
            labels=microbatches.get("labels"),
            num_items=num_items,
            loss_fn=self._summing(
                self._vocabulary_loss() if self._sharded_head else self.loss_fn, sums
            ),
            losses=losses,
            logits=logits,
            watch=self.watch,
            added_losses=added,
            added_scale=self.added_weight / (self.config.num_microbatches * self.place.dp_size),
            added_grad_scale=None if terms is None else self.added_weight,
        )
        if terms is not None:
            forward = terms.tracking(forward)
        if self.cp is None:
            return forward
        cp = self.cp

        def forward_on_shares(stage: int, mb: int, inputs: list[torch.Tensor]):
            cp.microbatch = mb  # whose whole mask the stage's mask leaves read
            return forward(stage, mb, inputs)

        return forward_on_shares

    def _summing(self, loss_fn: Callable, sums: list[torch.Tensor]) -> Callable:
        """``loss_fn``, which also appends each microbatch's :attr:`token_sums` to ``sums``
        (``loss_fn`` itself without them): see [Note: token sums beside the loss]."""
        fns, shifted = self.token_sums, self.cp is not None  # cp shifts on the whole row
        if not fns:
            return loss_fn

        def loss_and_sums(logits: torch.Tensor, labels: torch.Tensor, num_items) -> torch.Tensor:
            sums.append(_token_sums(fns, logits, labels, shifted))
            return loss_fn(logits, labels, num_items)

        return loss_and_sums

    def _vocabulary_loss(self) -> Callable:
        """``loss_fn`` given a vocabulary-parallel head's logits (a DTensor): the model's own loss
        takes them sharded (the step runs under ``loss_parallel``), its replicated loss made a
        plain tensor; a loss of one's own gets them whole (see [Note: the vocabulary-parallel
        head])."""
        loss_fn = self.loss_fn
        if loss_fn is self._own_loss:
            return lambda logits, labels, n: local_tensor(loss_fn(logits, labels, n))
        return lambda logits, labels, n: loss_fn(whole_tensor(logits), labels, n)

    def _run(self, engine: _C.Engine, forward: StageForward, signature: int, start: int) -> int:
        """Runs one step of ``engine`` for the batch of ``signature``, in a step that began at
        ``start``; returns when the engine's run ended (system clock ns)."""
        # A split backward (B with retain_graph, then W) cannot use the buffers AOTAutograd
        # donates to a compiled backward: compile those stages without donation.
        split = self.watch is not None and engine.schedule.split_backward
        donation = torch._functorch.config.patch(donated_buffer=False) if split else nullcontext()
        grads_ready = None
        self.reduce_spans.clear()
        if self.dp is not None and engine.schedule.backward:
            self.dp.before_step()
            grads_ready = self._reduce_stage
        if self.dp is not None and self.dp.sharded:
            self.failures.watched("data-parallel all-gather", self.dp.unshard)
        loss_parallel = vocabulary_parallel_loss() if self._sharded_head else nullcontext()
        with donation, loss_parallel:
            self.step_spans.append(("PRE", -1, -1, start, time.time_ns()))
            self.failures.run_step(engine, signature, forward, grads_ready)
        end = time.time_ns()
        self.last_engine = engine
        if self.watch is not None:
            mode = "train" if engine is self.train_engine else "eval"
            why = self.watch.step_done(mode)
            if why:
                msg = f"[rank {self.place.rank}] stage recompiled: {why}"
                logger.warning("%s", msg)
                self.recompiles.append(msg)
        return end

    def _reduce_stage(self, stage: int) -> None:
        """The engine's ``grads_ready`` callback: reduces ``stage``'s gradients over the
        replicas (a watched collective: see [Note: watched collectives]), timed for the step's
        timings."""
        start = time.time_ns()  # the engine's clock (system time)
        if self.ep is not None:  # [Note: pipeline x expert parallel]
            self.failures.watched(f"expert gradient sum of stage {stage}", self.ep.reduce, stage)
        self.failures.watched(f"data-parallel reduction of stage {stage}", self.dp.reduce, stage)
        self.reduce_spans.append(("DP", stage, -1, start, time.time_ns()))

    def _reduce_loss(
        self,
        losses: dict[int, torch.Tensor],
        added: dict[int, torch.Tensor],
        sums: list[torch.Tensor],
    ) -> torch.Tensor:
        """The sum of the last stage's microbatch losses, on every rank (and, with a mesh, over
        the replicas: their shares add up to the global mean); kept for :attr:`last_losses`,
        with the token sums (see [Note: token sums beside the loss])."""
        place = self.place
        names = tuple(self.token_sums or ())
        if place.rank == self.last_rank:
            # One dtype per part: stacked, then widened once (exact), then summed in float32.
            main = torch.stack([losses[mb] for mb in sorted(losses)]).float().sum()
            aux = torch.stack([added[mb] for mb in sorted(added)]).float().sum() if added else None
            total = torch.stack([main, main.new_zeros(()) if aux is None else aux])
            if names:
                total = torch.cat([total, torch.stack(sums).sum(0)])
        else:
            total = torch.zeros(2 + len(names), dtype=torch.float32, device=place.device)
        total = self.failures.watched(
            "loss broadcast",
            _C.broadcast_copy,
            total,
            self.last_rank,
            place.group_name,
            place.timeout_ms,
            f"[rank {place.rank}] loss broadcast",
            abortable=self._abortable,
        )
        if self.cp is not None:  # each cp rank's loss is its tokens' share
            total = self.failures.watched(
                "loss all_reduce over cp ranks",
                self.cp.all_reduce_sum,
                total,
                f"[rank {place.rank}] loss all_reduce over cp",
            )
        if self.dp is not None:
            total = self.failures.watched(
                "loss all_reduce over replicas",
                self.dp.all_reduce_sum,
                total,
                f"[rank {place.rank}] loss all_reduce",
            )
        self._last_parts, self._last_sum_names = total, names
        return total[0].clone()

    @property
    def last_losses(self) -> dict[str, float]:
        """The last step's loss (``total``) and its parts: ``main`` (``loss_fn``'s) and ``aux``
        (what the model adds, see [Note: added loss terms per microbatch]); empty before the
        first step."""
        if self._last_parts is None:
            return {}
        total, aux = (float(v) for v in self._last_parts[:2])
        return {"total": total, "main": total - aux, "aux": aux}

    @property
    def last_token_sums(self) -> dict[str, float]:
        """The last step's :attr:`token_sums` over the whole (global) batch, on every rank; empty
        before the first step or without them (see [Note: token sums beside the loss])."""
        if self._last_parts is None:
            return {}
        values = self._last_parts[2:].tolist()
        return dict(zip(self._last_sum_names, values, strict=True))
