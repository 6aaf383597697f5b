"""pippy_xla side by side with torch.distributed.pipelining (and a single process).

    python benchmarks/compare.py [--steps 8] [--warmup 2] [--regimes REGIME,...]
        [--schedules NAME,...] [--no-tuned] [--out NAME] [--transport auto|process_group]
        [--device cpu|cuda]

For every schedule both libraries have (pippy_xla's ``_C.train_schedule_names()`` read at run time,
kept if ``PipelineModel(schedule=...)`` accepts it and ``TORCH_SCHEDULES`` names torch's
counterpart), the same Llama and the same batch run through (a) one process, (b)
``pippy_xla.PipelineModel`` and (c) ``torch.distributed.pipelining``, on 2 CPU ranks with one thread
each (``pippy_xla.testing.run_ranks`` sets ``torch.set_num_threads(1)``). Three regimes: ``compute``
(a step of about a second), ``overhead`` (tiny layers, 32 microbatches of batch 1, so per-action
runtime cost dominates) and ``overhead-compiled`` (the same with every stage module compiled in both
libraries, which shrinks the stage's own Python and dispatch cost). torch's
``ScheduleInterleavedZeroBubble`` refuses compiled stage modules; that row then runs pippy_xla alone
and the refusal is recorded in ``torch_failures``.

Same computation in both libraries:

- The stage modules are the SAME fx GraphModules: every run partitions a ``copy.deepcopy`` of one
  seeded model with ``PipelineModel`` and torch's ``PipelineStage`` wraps ``pipe.stage.module``
  (of its own deepcopy) in ``_TorchStage``, a thin adapter. torch pipelining passes only the
  previous stage's outputs positionally, so the batch inputs a stage needs (``input_ids``,
  ``attention_mask``: its replicated prologue recomputes masks, positions and rotary tables from
  them) are passed as ``step(**kwargs)``, which torch chunks per microbatch and hands to every
  stage. The adapter calls ``module(*[kwargs[n] for n in batch_inputs], *boundary)``, exactly the
  call pippy_xla's forward callback makes.
- Same loss: the HF model's ``loss_function`` with ``num_items_in_batch`` = valid-token count of
  the whole batch, so microbatch losses sum to the batch mean. torch's schedule divides gradients
  by the microbatch count when ``scale_grads=True`` (``perform_reduce_grad``); our microbatch
  losses are already scaled, so ``scale_grads=False`` and the reported loss is the sum of the
  per-microbatch ``losses``, broadcast from the last rank (pippy_xla's ``run_train`` returns the
  loss on every rank; the torch step does the same broadcast so both steps deliver the same).
- Same microbatches (``chunk`` along dim 0), same AdamW (fused: :func:`_optimizer`), same
  initial weights.
- A timed step is ``run_train`` / ``schedule.step`` + ``optimizer.step()`` + ``zero_grad()``;
  ranks meet at a barrier before each step (``_common.SpinBarrier``, not timed); the step time is
  the slower rank's.
- Both libraries run in the same two processes, their steps interleaved (pippy_xla, torch,
  then torch, pippy_xla, ...), so that the slow and fast spells of a shared machine fall on
  both alike. Run one after the other, the same configuration differed by up to 30% between
  runs on the 2-core machine of the table in docs/benchmarks.md.

Before any time is reported the losses of every step are compared: pippy_xla against torch
(``LIB_RTOL``) and both against the single process (``REF_RTOL``); a mismatch is printed and the
script exits with status 1.

Reported per run (``benchmarks/results/compare.json``, ``compare.png``):

- ``step_s``: median, min, max, IQR of the step time over ``--steps`` steps after ``--warmup``.
- ``vs_torch``: torch's median step time / this run's (throughput ratio; > 1 is faster).
- ``speedup_vs_single``: single-process median step time (whole batch, one thread) / this run's.
- ``efficiency``: the median over the timed steps of ``ideal / measured step``, where a step's
  ``ideal`` is the makespan of the same schedule simulated by ``_C.Schedule.simulate`` with zero
  communication cost and per-stage F, B and W costs equal to the library's own measured mean
  durations on that stage in that step (``efficiency_per_step`` lists every step's). 100% means
  the runtime adds nothing to the schedule's compute and inherent bubble; the variation of
  single actions (a slow F here and there delays its peers) counts against it.
  pippy_xla's F/B durations are its engine's ``timings()`` actions ``F`` / ``B``; torch's are
  ``forward_one_chunk`` (+ the loss on the last stage) and ``backward_one_chunk``, timed by
  wrapping those methods of the stage instance (pippy_xla's engine starts an F or B's clock once
  its receives are complete, so waiting is not counted as compute). ``busy_ratio`` is the plainer
  ``max over ranks of (sum of F + B) / measured step`` (last timed step; it includes the
  schedule's bubble, so it is at most m / (m + p - 1)).
- ``pipeline_efficiency`` ("efficiency of run_train"): the same, each step's ideal over that
  step's pipeline call alone (median over the timed steps): ``run_train`` (torch:
  ``schedule.step`` and the loss broadcast), without the ``optimizer.step()`` and ``zero_grad()``
  that both libraries run after it (0.16 ms of fused AdamW over a stage's parameters in the
  overhead regimes; 0.65 ms with the default implementation).
- ``replay_efficiency`` ("replay / step", pippy_xla only: torch's clocks do not record the
  order or the microbatch of an action): every timed step's F, B and W actions replayed in the
  order each rank ran them, each with its own measured duration, starting as soon as its rank
  and its input are free, with free transfers and nothing between actions; that makespan over
  the step's time, median over the timed steps. Unlike ``efficiency`` it keeps the variation of
  single actions out of the runtime's account: the rest is what the runtime itself added (gaps,
  transfer actions, waking, the step's checks and collectives) and the optimizer step.
- Memory, peak per rank, in one extra untimed step:
  ``stash_peak_bytes``: tensors the runtime itself keeps between a microbatch's forward and its
  backward: pippy_xla's stash (stage inputs and outputs, ``pipe.stash_peak_bytes``) and torch's
  ``fwd_cache`` (stage outputs and flattened inputs, summed after every forward), unique storages.
  ``saved_peak_bytes``: bytes autograd keeps for backward (``saved_tensors_hooks`` around the
  stage module's forward, unique storages, parameters excluded, released when autograd frees
  them) - the same instrument for both libraries.
- ``per_action_us``: the time between engine actions: mean F / B duration minus the stage
  module's own forward (measured with forward hooks in the analysis step), and, for pippy_xla,
  the mean duration of the communication actions and of the gaps between consecutive actions.
  ``loss_per_F``: pippy_xla's F on the last stage includes the loss (the model's, which the
  single process computes too); its time in the same analysis step, per F action of the rank,
  so that "F outside the module and the loss" is what the runtime itself adds to a forward.
  ``PRE`` / ``POST`` (pippy_xla): the step's own work before the engine's first action (batch
  checks and split, the step handshake, with the wait for the other rank there) and after its
  last (the loss reduction; on a rank whose engine ends before the last stage's, with the wait
  for the loss), medians over the timed steps, from the step's timings ([Note: step spans]).

- ``pippy_xla:tuned`` rows (unless ``--no-tuned``), for the list-scheduled schedules (``zbh1``,
  ``interleaved_zb``, ``zbv``): a third pipeline in the same processes, steps interleaved with the
  other two, reordered after the last warm-up step for the costs measured in it
  (``PipelineModel.tune_schedule``); its losses are checked like the others' and its efficiency
  is that of the order that ran. torch runs its published orders.
- ``--out NAME`` writes ``benchmarks/results/NAME.json`` / ``NAME.png`` (default ``compare``, the
  table in docs/benchmarks.md), so that a partial run does not replace the full one.
- ``--transport``: pippy_xla's ``transport`` (each regime's ``config`` records it). ``auto``, the
  default, moves the two ranks' transfers and the step's small collectives through shared memory
  ([Note: same-host transport]); ``process_group`` keeps gloo, the wire torch's schedules use, on
  a group of its own, to compare the runtimes alone.

- ``--device cuda`` (the GPU machine): the two ranks share one GPU over NCCL (``run_ranks``
  gives each its own ``NCCL_HOSTID``), the single process runs there too, and every timed step
  ends with ``torch.cuda.synchronize()``. Default regimes ``gpu-compute`` (a model whose stages
  take milliseconds of GPU time) and ``overhead``. The efficiency, replay and busy columns stay
  empty: the engine's and the wrapped methods' clocks are the host's, which on a GPU time the
  launches, not the work. A run cut short leaves ``NAME_partial.json`` (rewritten after every
  schedule); a loss mismatch leaves ``NAME_rejected.json``.

Targets (reported, never asserted): throughput >= 1.05x torch compute-bound, >= 1.5x
overhead-bound; efficiency >= 95%.
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import subprocess
import sys
import time

from _common import RESULTS, SpinBarrier, machine, run_ranks, save, summarize

from pippy_xla.units import format_bytes

PIPPY = "pippy_xla"
TUNED = "pippy_xla:tuned"
"""pippy_xla with a list-scheduled schedule reordered after the warm-up for the costs measured in
its last step (``PipelineModel.tune_schedule``, [Note: list scheduling at costs])."""

# pippy_xla schedule name -> torch.distributed.pipelining class name. Interleaved and
# zero-bubble names are listed so their rows appear as soon as pippy_xla grows them.
TORCH_SCHEDULES = {
    "gpipe": "ScheduleGPipe",
    "1f1b": "Schedule1F1B",
    "interleaved": "ScheduleInterleaved1F1B",
    "zbh1": "ScheduleInterleavedZeroBubble",
    "looped_bfs": "ScheduleLoopedBFS",
    "interleaved_zb": "ScheduleInterleavedZeroBubble",
    "zbv": "ScheduleZBVZeroBubble",
    "dualpipev": "ScheduleDualPipeV",
}
# Different microbatch accumulation (a sum of microbatch losses vs one batch mean) moves the loss
# by float32 rounding, amplified a little by AdamW over the steps; 1e-4 relative is far below
# what a wrong mask, microbatch or scaling would give (percent level).
REF_RTOL = 1e-4
# Same modules, same microbatches, same accumulation order: the libraries should agree to
# rounding of the final loss sum.
LIB_RTOL = 1e-5

REGIMES = {
    # About a second per pipelined step with one thread per rank on this machine.
    "compute": dict(
        model=dict(
            vocab_size=2048,
            hidden_size=256,
            intermediate_size=1024,
            num_hidden_layers=8,
            num_attention_heads=4,
            num_key_value_heads=2,
        ),
        batch=8,
        seq=256,
        microbatches=8,
    ),
    # Tiny layers, many microbatches: the runtime's per-action cost dominates.
    "overhead": dict(
        model=dict(
            vocab_size=128,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=4,
            num_attention_heads=2,
            num_key_value_heads=1,
        ),
        batch=32,
        seq=16,
        microbatches=32,
    ),
}
# The overhead regime with every stage module compiled (``torch.compile``, inductor) in both
# libraries (pippy_xla's ``compile=True``; torch's stages wrap the compiled module), and the
# single process compiled too: a stage's own work shrinks, so the runtime's share grows. The
# hook-based analyses (module clock, autograd-saved bytes) would make dynamo recompile, so this
# regime reports neither.
REGIMES["overhead-compiled"] = dict(REGIMES["overhead"], compile=True)
# ``--device cuda``: two ranks sharing one GPU over NCCL (their own ``NCCL_HOSTID`` each, see
# ``pippy_xla.testing.run_ranks``), the stages' matmuls large enough that a step is mostly GPU
# work (float32, a few ms per forward of a stage).
REGIMES["gpu-compute"] = dict(
    model=dict(
        vocab_size=32000,
        hidden_size=1024,
        intermediate_size=4096,
        num_hidden_layers=8,
        num_attention_heads=16,
        num_key_value_heads=4,
    ),
    batch=16,
    seq=512,
    microbatches=8,
)


def _device(regime: dict):
    """The regime's device: every rank on ``cuda:0`` with ``--device cuda`` (the one GPU that
    the ranks share), else the CPU."""
    import torch

    return torch.device("cuda", 0) if regime.get("device") == "cuda" else torch.device("cpu")


def _sync(regime: dict) -> None:
    """Waits for the GPU's queued work (a step's time is the GPU's, not its launches')."""
    if regime.get("device") == "cuda":
        import torch

        torch.cuda.synchronize()


# ------------------------------------------------------------------------------ shared helpers


def _build(regime: dict):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**regime["model"], use_cache=False))
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(
        0, regime["model"]["vocab_size"], (regime["batch"], regime["seq"]), generator=g
    )
    mask = torch.ones_like(ids)
    mask[0, -3:] = 0  # a little padding, so the valid-token count matters
    labels = ids.masked_fill(mask == 0, -100)
    device = _device(regime)
    batch = {"input_ids": ids, "attention_mask": mask, "labels": labels}
    return model, {k: v.to(device) for k, v in batch.items()}


def _storage_key(t):
    return t.untyped_storage().data_ptr()


def _unique_bytes(tensors) -> int:
    import torch

    seen, n = set(), 0
    for t in tensors:
        if isinstance(t, torch.Tensor):
            k = _storage_key(t)
            if k not in seen:
                seen.add(k)
                n += t.untyped_storage().nbytes()
    return n


class _SavedBytes:
    """Live bytes of tensors autograd saved for backward (unique storages, parameters
    excluded) and their peak. Packed tensors are wrapped in handles whose ``__del__`` runs
    when autograd frees them. (``pippy_xla.plan.profiler.SavedBytes`` counts something else: the
    bytes still saved when a forward ends, by region, for the planner's per-layer costs.)"""

    def __init__(self, modules) -> None:
        import torch

        self.exclude = {_storage_key(p) for mod in modules for p in mod.parameters()}
        self.exclude |= {_storage_key(b) for mod in modules for b in mod.buffers()}
        self.refs: dict[int, list[int]] = {}
        self.live = 0
        self.peak = 0
        self._ctx = None
        self._torch = torch

    class _Handle:
        __slots__ = ("owner", "t", "key")

        def __init__(self, owner, t, key):
            # Detached: holding a saved output itself would tie it to its own grad_fn in a
            # cycle that outlives the graph (and would count its bytes until the end).
            self.owner, self.t, self.key = owner, t.detach(), key

        def __del__(self):
            r = self.owner.refs[self.key]
            r[0] -= 1
            if r[0] == 0:
                self.owner.live -= r[1]
                del self.owner.refs[self.key]

    def _pack(self, t):
        try:
            key = _storage_key(t)
        except Exception:  # noqa: BLE001  (tensors without storage)
            return t
        if key in self.exclude or key == 0:
            return t
        r = self.refs.get(key)
        if r is None:
            r = self.refs[key] = [0, t.untyped_storage().nbytes()]
            self.live += r[1]
            self.peak = max(self.peak, self.live)
        r[0] += 1
        return _SavedBytes._Handle(self, t, key)

    @staticmethod
    def _unpack(h):
        return h.t if isinstance(h, _SavedBytes._Handle) else h

    def attach(self, module):
        def pre(mod, args, kwargs=None):
            self._ctx = self._torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
            self._ctx.__enter__()

        def post(mod, args, out):
            self._ctx.__exit__(None, None, None)
            self._ctx = None

        return [module.register_forward_pre_hook(pre), module.register_forward_hook(post)]


class _ModuleClock:
    """Total and count of a module's forward time, for the overhead analysis. It wraps the
    module's ``forward`` (an instance attribute over the class's) instead of registering forward
    hooks: a module with hooks takes ``nn.Module``'s slow call path, which cost 5-10 us per call
    that the analysis would have counted as the runtime's ("F outside the module")."""

    def __init__(self) -> None:
        self.total_ns = 0
        self.count = 0

    def attach(self, module):
        module.forward = _timed(module.forward, self._add)
        return [_Unwrap(module)]

    def _add(self, ns: int) -> None:
        self.total_ns += ns
        self.count += 1


def _timed(fn, record):
    """``fn``, wrapped to pass each call's duration (ns) to ``record``."""

    def wrapper(*args, **kwargs):
        t0 = time.perf_counter_ns()
        try:
            return fn(*args, **kwargs)
        finally:
            record(time.perf_counter_ns() - t0)

    return wrapper


class _Unwrap:
    """Removes :class:`_ModuleClock`'s wrapper (a hook handle's ``remove``)."""

    def __init__(self, module) -> None:
        self.module = module

    def remove(self) -> None:
        del self.module.forward


def _local_stages(pipe) -> list:
    """This rank's stage graphs (several with interleaved schedules)."""
    return list(getattr(pipe, "local_stages", None) or [pipe.stage])


def _simulated_ideal(schedule_name, num_ranks, m, chunks, costs, order=None) -> float | None:
    """Makespan of the schedule (``order``: its CSV, else the generated one) with the given
    per-stage F, B, W costs and free communication."""
    try:
        from pippy_xla import _C

        if order is not None:
            s = _C.Schedule.from_csv(order, schedule_name)
        else:
            s = _C.make_schedule(schedule_name, num_ranks, m, chunks)
        r = s.simulate(forward=costs["F"], backward=costs["B"], weight=costs["W"], comm=0.0)
        return float(r.makespan)
    except Exception:  # noqa: BLE001  (a schedule the simulator cannot cost)
        return None


# ------------------------------------------------------------------------------ single process


def _optimizer(params):
    """Every run's optimizer: AdamW in its fused implementation (what torchtitan's configurations
    use; on this machine 0.16 ms per step over a stage of the overhead regime against 0.65 ms for
    the default for-loop one, time that both libraries spend outside their pipelines)."""
    import torch

    return torch.optim.AdamW(params, lr=1e-3, fused=True)


def _single(rank, world, regime, steps, warmup):
    import torch

    model, batch = _build(regime)
    model.to(_device(regime))
    opt = _optimizer(model.parameters())
    run = torch.compile(model) if regime.get("compile") else model
    losses, times = [], []
    for _ in range(warmup + steps):
        t0 = time.perf_counter()
        out = run(**batch, use_cache=False)
        out.loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        _sync(regime)
        times.append(time.perf_counter() - t0)
        losses.append(float(out.loss.detach()))
    return {"losses": losses, "step_times": times[warmup:]}


# ------------------------------------------------------------------------------ pippy_xla


def _attach_all(modules, *instruments):
    return [h for mod in modules for ins in instruments for h in ins.attach(mod)]


def _analysis(
    regime, modules, step, f_durations_us, reset_stash_peak, stash_peak, loss_us=None
) -> dict:
    """The untimed analysis steps of either library: (1) the stage modules' own forward time
    next to the runtime's F durations (``f_durations_us()``) of the same step, and the time its
    F actions spent in the loss (``loss_us()``: the step's loss calls, us; ``None`` where F does
    not include the loss); (2) stash and autograd-saved peaks. Compiled stages get no hooks
    (dynamo would recompile)."""
    hooks = not regime.get("compile")
    clock, saved = _ModuleClock(), _SavedBytes(modules)

    def instrumented(instrument):
        handles = _attach_all(modules, instrument) if hooks else []
        _spin_barrier().wait()  # as before a timed step
        step()
        for h in handles:
            h.remove()

    out = {}
    if hooks:
        instrumented(clock)
        fs = f_durations_us()
        out["clock_step_f_us"] = statistics.fmean(fs)
        out["clock_step_loss_per_f_us"] = sum(loss_us()) / len(fs) if loss_us else 0.0
    reset_stash_peak()
    instrumented(saved)
    out["stash_peak_bytes"] = int(stash_peak())
    out["saved_peak_bytes"] = int(saved.peak) if hooks else None
    out["module_forward_us"] = clock.total_ns / clock.count / 1e3 if hooks else None
    return out


def _pipeline(regime, schedule):
    """The regime's model and batch, and a PipelineModel over a copy of the model (or a
    ``{"skipped": reason}`` row if pippy_xla refuses the schedule), with the regime's
    ``transport`` (``--transport``)."""
    import torch.distributed as dist
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    import pippy_xla as px

    base, batch = _build(regime)
    m = regime["microbatches"]
    transport = regime.get("transport", "auto")
    # The world group carries shared memory once a pipeline attached it: gloo needs its own.
    group = dist.new_group([0, 1]) if transport == "process_group" else None
    try:
        pipe = px.PipelineModel(
            copy.deepcopy(base),
            layer_cls=LlamaDecoderLayer,
            num_microbatches=m,
            schedule=schedule,
            compile=regime.get("compile", False),
            transport=transport,
            group=group,
        )
    except ValueError as e:
        if "schedule" not in str(e):
            raise
        pipe = {"skipped": f"PipelineModel refuses schedule={schedule!r}: {e}"}
    return base, batch, m, pipe


def _pippy(regime, schedule, tuned=False):
    """pippy_xla on this rank: ``(step, report)`` (see ``_paired``) or a ``{"skipped": why}``;
    ``tuned``: ``(step, report, tune)``, where ``tune`` reorders the schedule for the costs of the
    step before (``PipelineModel.tune_schedule``)."""

    base, batch, m, pipe = _pipeline(regime, schedule)
    if isinstance(pipe, dict):
        return pipe
    opt = _optimizer(pipe.parameters())
    pipeline_times = []
    loss_calls_us = []
    runner = pipe._runner  # the loss the pipeline's F calls, timed in the analysis steps
    own_loss = runner.loss_fn

    timed_loss = _timed(own_loss, lambda ns: loss_calls_us.append(ns / 1e3))

    def step():
        t0 = time.perf_counter()
        loss = pipe.run_train(**batch)
        _sync(regime)
        pipeline_times.append(time.perf_counter() - t0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        _sync(regime)
        return loss

    step_actions, step_orders, step_spans = [], [], []

    def snapshot():
        timings = pipe.timings()
        actions = _engine_actions(timings)
        step_actions.append(_action_us(actions))
        step_orders.append(_compute_order(actions))
        step_spans.append({op: (e - s) / 1e3 for op, st, _, s, e in timings if st < 0})

    step.snapshot = snapshot

    def report(losses, times):
        timings = _engine_actions(pipe.timings())  # of the last timed step

        def clock_step_losses():
            calls = list(loss_calls_us)
            runner.loss_fn = own_loss
            return calls

        def untimed_step():
            pipe.run_train(**batch)
            opt.zero_grad(set_to_none=True)

        out = {"losses": losses, "step_times": times, "timings": [list(t) for t in timings]}
        out["pipeline_times"] = pipeline_times[-len(times) :]
        out["step_actions"] = step_actions[-len(times) :]
        out["step_orders"] = step_orders[-len(times) :]
        out["step_spans_us"] = step_spans[-len(times) :]
        if not regime.get("compile"):  # timed in the clock step; clock_step_losses() undoes it
            runner.loss_fn = timed_loss
        out["num_stages"] = len(pipe.stages)
        out["order"] = pipe.engine.schedule.to_csv()
        out |= _analysis(
            regime,
            [st.module for st in _local_stages(pipe)],
            untimed_step,
            lambda: [(e - s) / 1e3 for op, _, _, s, e in pipe.timings() if op == "F"],
            pipe.reset_stash_peak,
            lambda: pipe.stash_peak_bytes,
            clock_step_losses,
        )
        return out

    if tuned:
        return step, report, pipe.tune_schedule
    return step, report


# ------------------------------------------------------------------------------ torch pipelining


def _torch_stage_module(gm, batch_inputs, is_last):
    from torch import nn

    class _TorchStage(nn.Module):
        """torch pipelining's view of a pippy_xla stage graph: boundary tensors positional,
        batch inputs as keyword arguments, a bare tensor (the logits) from the last stage."""

        def __init__(self) -> None:
            super().__init__()
            self.gm = gm

        def forward(self, *boundary, **batch):
            out = self.gm(*[batch[n] for n in batch_inputs], *boundary)
            return out[0] if is_last else out

    return _TorchStage()


def _torch(regime, schedule):
    """torch.distributed.pipelining on this rank: ``(step, report)`` (see ``_paired``) or a
    ``{"skipped": why}``."""
    import torch
    import torch.distributed as dist
    import torch.distributed.pipelining as tpp
    from torch.distributed.pipelining.schedules import PipelineScheduleMulti

    # The partition (and nothing else) of a PipelineModel: its stage graphs are what torch runs.
    base, batch, m, pipe = _pipeline(regime, schedule)
    if isinstance(pipe, dict):
        return pipe
    num_stages = len(pipe.stages)
    local = _local_stages(pipe)
    loss_function, vocab = base.loss_function, base.config.vocab_size
    num_items = (batch["labels"][..., 1:] != -100).sum()

    # Per-action clocks: wrap each stage instance's methods (and the loss) with timers.
    clocks: dict[tuple[str, int], list[int]] = {}

    def timed(kind, index, fn):
        return _timed(fn, lambda ns: clocks.setdefault((kind, index), []).append(ns))

    def loss_fn(logits, labels):
        return loss_function(
            logits=logits, labels=labels, vocab_size=vocab, num_items_in_batch=num_items
        )

    # Timed as "L": added to the last stage's F, as pippy_xla's F includes the loss.
    timed_loss = timed("L", num_stages - 1, loss_fn)

    track_cache = [False]
    fwd_cache_peak = [0]
    stages, modules = [], []
    for st in local:
        gm = torch.compile(st.module) if regime.get("compile") else st.module
        module = _torch_stage_module(gm, st.batch_inputs, st.index == num_stages - 1)
        stage = tpp.PipelineStage(module, st.index, num_stages, _device(regime))

        def forward_and_measure(*a, _fwd=stage.forward_one_chunk, **k):
            out = _fwd(*a, **k)
            if track_cache[0]:
                ts = [
                    t for s in stages for out_t, ins in s.fwd_cache.values() for t in (*out_t, *ins)
                ]
                fwd_cache_peak[0] = max(fwd_cache_peak[0], _unique_bytes(ts))
            return out

        stage.forward_one_chunk = timed("F", st.index, forward_and_measure)
        stage.backward_one_chunk = timed("B", st.index, stage.backward_one_chunk)
        stage.backward_weight_one_chunk = timed("W", st.index, stage.backward_weight_one_chunk)
        stages.append(stage)
        modules.append(module)

    cls = getattr(tpp, TORCH_SCHEDULES[schedule])
    if issubclass(cls, PipelineScheduleMulti):
        sched = cls(stages, m, loss_fn=timed_loss, scale_grads=False)
    else:
        sched = cls(stages[0], m, loss_fn=timed_loss, scale_grads=False)
    params = [p for mod in modules for p in mod.parameters()]
    opt = _optimizer(params)
    kwargs = {n: batch[n] for n in pipe.input_names}
    holds_last = any(st.index == num_stages - 1 for st in local)
    last_rank = pipe.engine.schedule.stage_rank[-1]  # a V puts the last stage on rank 0
    pipeline_times = []

    def step():
        clocks.clear()
        mb_losses: list = []
        t0 = time.perf_counter()
        sched.step(
            target=batch["labels"] if holds_last else None,
            losses=mb_losses if holds_last else None,
            return_outputs=False,
            **kwargs,
        )
        total = torch.zeros((), dtype=torch.float32, device=_device(regime))
        if holds_last:
            total = torch.stack([x.detach().float() for x in mb_losses]).sum()
        dist.broadcast(total, src=last_rank)
        _sync(regime)
        pipeline_times.append(time.perf_counter() - t0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        _sync(regime)
        return total

    def clock_us():
        return {f"{k}{i}": [x / 1e3 for x in v] for (k, i), v in clocks.items()}

    step_actions = []
    step.snapshot = lambda: step_actions.append(clock_us())

    def report(losses, times):
        out = {"losses": losses, "step_times": times, "action_us": clock_us()}
        out["pipeline_times"] = pipeline_times[-len(times) :]
        out["step_actions"] = step_actions[-len(times) :]
        out["num_stages"] = num_stages
        out |= _analysis(
            regime,
            [st.module for st in local],
            step,
            lambda: [x / 1e3 for (k, _), v in clocks.items() if k == "F" for x in v],
            lambda: track_cache.__setitem__(0, True),
            lambda: fwd_cache_peak[0],
        )
        return out

    return step, report


# ------------------------------------------------------------------------------ both, interleaved

LIBRARIES = {
    PIPPY: _pippy,
    "torch": _torch,
    TUNED: lambda regime, schedule: _pippy(regime, schedule, tuned=True),
}


_SPIN: SpinBarrier | None = None


def _spin_barrier() -> SpinBarrier:
    """This process's :class:`SpinBarrier` (made collectively by the ranks at first use), which
    the timed steps and the analysis steps start from."""
    global _SPIN
    if _SPIN is None:
        import torch.distributed as dist

        _SPIN = SpinBarrier(dist.get_rank(), dist.get_world_size())
    return _SPIN


def _paired(rank, world, regime, schedule, steps, warmup, libs):
    """Runs the libraries ``libs`` side by side in the same processes, alternating their steps
    (ABAB..., the order flipped every step), so that a slower or faster spell of a shared
    machine falls on both alike. A step is timed from a barrier (:class:`SpinBarrier`) to the
    end of the optimizer step. Returns ``{lib: report}``, or ``{lib: {"skipped": why}}`` if a
    library refuses."""
    runs = {}
    for lib in libs:
        made = LIBRARIES[lib](regime, schedule)
        if isinstance(made, dict):
            return {lib: made}
        runs[lib] = made
    losses = {lib: [] for lib in libs}
    times = {lib: [] for lib in libs}
    barrier = _spin_barrier()
    for i in range(warmup + steps):
        for lib in libs if i % 2 == 0 else libs[::-1]:
            step = runs[lib][0]
            barrier.wait()
            t0 = time.perf_counter()
            loss = step()
            times[lib].append(time.perf_counter() - t0)
            losses[lib].append(float(loss))
            step.snapshot()  # this step's action durations, untimed
            if i == warmup - 1 and len(runs[lib]) > 2:
                runs[lib][2]()  # tune after the last warm-up step (untimed)
    return {lib: runs[lib][1](losses[lib], times[lib][warmup:]) for lib in libs}


# ------------------------------------------------------------------------------ analysis


def _engine_actions(timings) -> list:
    """A step's timings without the step's own spans around the engine (``PRE`` / ``POST``,
    stage -1: [Note: step spans])."""
    return [t for t in timings if t[1] >= 0]


def _action_us(timings) -> dict[str, list[float]]:
    """``{"F3": [us, ...], ...}``: the durations of one step's engine actions per op and stage."""
    out: dict[str, list[float]] = {}
    for op, stage, _, s, e in timings:
        out.setdefault(f"{op}{stage}", []).append((e - s) / 1e3)
    return out


def _compute_order(timings) -> list[tuple[str, int, int, float]]:
    """One step's F, B and W actions of a rank in the order they ran: ``(op, stage, mb, us)``."""
    return [
        (op, stage, mb, (e - s) / 1e3)
        for op, stage, mb, s, e in sorted(timings, key=lambda t: t[3])
        if op in ("F", "B", "W")
    ]


def _replay_makespan(orders: list[list[tuple[str, int, int, float]]], num_stages: int) -> float:
    """Seconds the step would take if every F, B and W took exactly its measured time and the
    runtime cost nothing else: each rank runs its actions in the order they ran, each as soon as
    its rank is free and its input is there (F after the previous stage's F of the microbatch,
    B after the next stage's B), transfers free."""
    done: dict[tuple[str, int, int], float] = {}
    clock = [0.0] * len(orders)
    pos = [0] * len(orders)
    progress = True
    while progress:
        progress = False
        for r, order in enumerate(orders):
            while pos[r] < len(order):
                op, stage, mb, us = order[pos[r]]
                dep = None
                if op == "F" and stage > 0:
                    dep = ("F", stage - 1, mb)
                elif op == "B" and stage < num_stages - 1:
                    dep = ("B", stage + 1, mb)
                if dep is not None and dep not in done:
                    break
                clock[r] = max(clock[r], done[dep] if dep else 0.0) + us / 1e6
                done[(op, stage, mb)] = clock[r]
                pos[r] += 1
                progress = True
    if any(p < len(o) for p, o in zip(pos, orders, strict=True)):
        raise RuntimeError("replay deadlocked: the recorded orders do not form a schedule")
    return max(clock)


def _pippy_actions(ranks):
    """Per rank: per-(op, stage) mean durations (us), communication actions and gaps."""
    out = []
    for r in ranks:
        tl = sorted(r["timings"], key=lambda t: t[3])
        by_key = _action_us(tl)
        by_op: dict[str, list[float]] = {}
        for key, v in by_key.items():
            by_op.setdefault(_split_key(key)[0], []).extend(v)
        gaps = [(tl[i + 1][3] - tl[i][4]) / 1e3 for i in range(len(tl) - 1)]
        span = (tl[-1][4] - tl[0][3]) / 1e3 if tl else 0.0
        out.append(
            {
                "action_us": by_key,
                "mean_us": {op: statistics.fmean(v) for op, v in by_op.items()},
                "median_us": {op: statistics.median(v) for op, v in by_op.items()},
                "gap_median_us": statistics.median(gaps) if gaps else 0.0,
                "count": {op: len(v) for op, v in by_op.items()},
                "total_us": {op: sum(v) for op, v in by_op.items()},
                "gap_mean_us": statistics.fmean(gaps) if gaps else 0.0,
                "gap_total_us": sum(gaps),
                "engine_span_us": span,
            }
        )
    return out


def _split_key(key: str) -> tuple[str, int]:
    """``"RF3"`` -> ``("RF", 3)``."""
    op = key.rstrip("0123456789")
    return op, int(key[len(op) :])


def _stage_costs(per_rank_action_us: list[dict], num_stages: int) -> dict[str, list[float]]:
    """Mean F / B / W seconds per stage from ``{"F3": [us, ...], ...}`` of every rank."""
    costs = {k: [0.0] * num_stages for k in ("F", "B", "W")}
    for acts in per_rank_action_us:
        for key, v in acts.items():
            op, stage = _split_key(key)
            if op in costs and v:
                costs[op][stage] += statistics.fmean(v) / 1e6
            elif op == "L" and v:  # torch: the loss, outside forward_one_chunk
                costs["F"][stage] += statistics.fmean(v) / 1e6
    if not any(costs["W"]):
        costs["W"] = []
    return costs


def _step_series(ranks):
    return [max(ts) for ts in zip(*(r["step_times"] for r in ranks), strict=True)]


def _summarize_run(lib, schedule, regime, ranks, single_median):
    step = summarize(_step_series(ranks))
    m = regime["microbatches"]
    p = len(ranks)
    num_stages = ranks[0]["num_stages"]
    row = {
        "library": lib,
        "schedule": schedule,
        "step_s": step,
        "losses": ranks[0]["losses"],
        "stash_peak_bytes": [r["stash_peak_bytes"] for r in ranks],
        "saved_peak_bytes": [r["saved_peak_bytes"] for r in ranks],
        "module_forward_us": [r["module_forward_us"] for r in ranks],
        "speedup_vs_single": single_median / step["median"],
    }
    if lib in (PIPPY, TUNED):
        engine = _pippy_actions(ranks)
        per_rank = [a["action_us"] for a in engine]
        row["actions"] = engine
    else:
        per_rank = [r["action_us"] for r in ranks]
    costs = _stage_costs(per_rank, num_stages)
    busy = [
        sum(sum(v) for k, v in acts.items() if _split_key(k)[0] in ("F", "B", "W", "L")) / 1e6
        for acts in per_rank
    ]
    row["per_action_us"] = []
    for r, acts in zip(ranks, per_rank, strict=True):
        f = [x for k, v in acts.items() if _split_key(k)[0] == "F" for x in v]
        b = [x for k, v in acts.items() if _split_key(k)[0] == "B" for x in v]
        entry = {
            "F": statistics.fmean(f) if f else None,
            "B": statistics.fmean(b) if b else None,
            # Same (untimed) step: F action minus the stage module's own forward.
            "F_minus_module_forward": r["clock_step_f_us"] - r["module_forward_us"]
            if r["module_forward_us"] is not None
            else None,
            "loss_per_F": r.get("clock_step_loss_per_f_us"),
        }
        row["per_action_us"].append(entry)
    if lib in (PIPPY, TUNED):
        for entry, a, r in zip(row["per_action_us"], engine, ranks, strict=True):
            entry["comm_actions"] = {
                op: a["mean_us"][op] for op in ("RF", "SF", "RB", "SB") if op in a["mean_us"]
            }
            entry["gap_between_actions"] = a["gap_mean_us"]
            for op in ("PRE", "POST"):  # the step's own work around the engine, timed steps
                entry[op] = statistics.median(spans[op] for spans in r["step_spans_us"])
    chunks = num_stages // p
    order = ranks[0].get("order")  # pippy_xla: the order that ran (a tuned one's own)
    row["stage_costs_s"] = costs
    row["stage_busy_s"] = busy
    # Every timed step against its own ideal (its own measured costs); the median is reported.
    steps = _step_series(ranks)
    calls = [max(ts) for ts in zip(*(r["pipeline_times"] for r in ranks), strict=True)]
    ideals = [
        _simulated_ideal(schedule, p, m, chunks, _stage_costs(list(acts), num_stages), order)
        for acts in zip(*(r["step_actions"] for r in ranks), strict=True)
    ]
    row["ideal_s"] = ideals
    # On a GPU the actions' clocks are the host's (an F ends when its kernels are queued), so no
    # ideal made from them says anything about the GPU's step: no efficiency there.
    host_clocks = regime.get("device") == "cuda"
    if all(ideals) and not host_clocks:
        row["efficiency_per_step"] = [i / t for i, t in zip(ideals, steps, strict=True)]
        # The same ideal over the pipeline call alone (run_train; torch: schedule.step and the
        # loss broadcast), without the optimizer step both libraries run after it.
        row["pipeline_efficiency_per_step"] = [i / t for i, t in zip(ideals, calls, strict=True)]
        row["efficiency"] = statistics.median(row["efficiency_per_step"])
        row["pipeline_efficiency"] = statistics.median(row["pipeline_efficiency_per_step"])
    else:
        row["efficiency"] = row["pipeline_efficiency"] = None
    if "step_orders" in ranks[0] and not host_clocks:  # pippy_xla: each step replayed, see above
        replays = [
            _replay_makespan(list(orders), num_stages)
            for orders in zip(*(r["step_orders"] for r in ranks), strict=True)
        ]
        row["replay_s"] = replays
        row["replay_efficiency"] = statistics.median(
            [x / t for x, t in zip(replays, steps, strict=True)]
        )
    else:
        row["replay_efficiency"] = None
    # The last step's, like the per-action costs.
    row["busy_ratio"] = None if host_clocks else max(busy) / steps[-1]
    return row


def _check_losses(name, rows, single_losses) -> list[str]:
    problems = []
    for row in rows:
        for i, (a, ref) in enumerate(zip(row["losses"], single_losses, strict=True)):
            if abs(a - ref) > REF_RTOL * abs(ref):
                problems.append(
                    f"{name}/{row['schedule']}/{row['library']}: step {i} loss {a:.7f} vs single "
                    f"process {ref:.7f} (rel {abs(a - ref) / abs(ref):.2e} > {REF_RTOL})"
                )
    by_sched: dict[str, dict] = {}
    for row in rows:
        by_sched.setdefault(row["schedule"], {})[row["library"]] = row
    for sched, libs in by_sched.items():
        if "torch" not in libs:
            continue
        for lib in (PIPPY, TUNED):
            if lib not in libs:
                continue
            pairs = zip(libs[lib]["losses"], libs["torch"]["losses"], strict=True)
            for i, (a, b) in enumerate(pairs):
                if abs(a - b) > LIB_RTOL * abs(b):
                    problems.append(
                        f"{name}/{sched}: step {i} {lib} loss {a:.7f} vs torch {b:.7f} "
                        f"(rel {abs(a - b) / abs(b):.2e} > {LIB_RTOL})"
                    )
    return problems


# ------------------------------------------------------------------------------ output


def _fmt_bytes(n: int | None) -> str:
    return "n/a" if n is None else format_bytes(n)


def _us(x: float | None) -> str:
    return "-" if x is None else f"{x:.1f}"


def _overhead_table(results) -> str:
    """pippy_xla's per-action costs (medians over the last timed step, us) per rank: the gap
    between consecutive actions, each transfer action, and the F action minus the stage module's
    own forward (the runtime's cost around a forward; eager stages only); and the step's own
    work before and after the engine (medians over the timed steps)."""
    lines = [
        "| regime | schedule | rank | gap | RF | SF | RB | SB | F outside the module "
        "| loss per F | F outside the module and the loss | step before the engine (PRE) "
        "| step after the engine (POST) |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, reg in results.items():
        for row in reg["rows"]:
            if row["library"] != PIPPY:
                continue
            for rank, (a, per) in enumerate(zip(row["actions"], row["per_action_us"], strict=True)):
                med = a["median_us"]
                cells = [f"{med[op]:.1f}" if op in med else "-" for op in ("RF", "SF", "RB", "SB")]
                outside, loss = per["F_minus_module_forward"], per.get("loss_per_F")
                runtime = None if outside is None or loss is None else outside - loss
                lines.append(
                    f"| {name} | {row['schedule']} | {rank} | {a['gap_median_us']:.1f} | "
                    + " | ".join(cells)
                    + f" | {_us(outside)} | {_us(None if outside is None else loss)} "
                    f"| {_us(runtime)} | {_us(per.get('PRE'))} | {_us(per.get('POST'))} |"
                )
    return "\n".join(lines)


def _table(results) -> str:
    lines = [
        "| regime | schedule | library | step s (median, min-max) | vs torch | vs 1 process "
        "| efficiency | efficiency of run_train | replay / step | busy / step "
        "| stash peak (rank 0, 1) | autograd saved peak (rank 0, 1) |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, reg in results.items():
        s = reg["single"]["step_s"]
        lines.append(
            f"| {name} | - | single process | {s['median']:.4f} ({s['min']:.4f}-{s['max']:.4f}) "
            "| | 1.00x | | | | | | |"
        )
        for row in reg["rows"]:
            st = row["step_s"]
            eff = f"{row['efficiency'] * 100:.1f}%" if row["efficiency"] else "n/a"
            call = row.get("pipeline_efficiency")
            eff_call = f"{call * 100:.1f}%" if call else "n/a"
            replay = row.get("replay_efficiency")
            eff_replay = f"{replay * 100:.1f}%" if replay else "n/a"
            vs = f"{row['vs_torch']:.2f}x" if row.get("vs_torch") else "-"
            busy = f"{row['busy_ratio'] * 100:.1f}%" if row["busy_ratio"] else "n/a"
            lines.append(
                f"| {name} | {row['schedule']} | {row['library']} | {st['median']:.4f} "
                f"({st['min']:.4f}-{st['max']:.4f}) | {vs} | {row['speedup_vs_single']:.2f}x "
                f"| {eff} | {eff_call} | {eff_replay} | {busy} "
                f"| {', '.join(_fmt_bytes(b) for b in row['stash_peak_bytes'])} "
                f"| {', '.join(_fmt_bytes(b) for b in row['saved_peak_bytes'])} |"
            )
    return "\n".join(lines)


def _chart(results, path, where: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(results) * 2, figsize=(7.5 * len(results), 4.2))
    for k, (name, reg) in enumerate(results.items()):
        ax, ax2 = axes[2 * k], axes[2 * k + 1]
        scheds = sorted({r["schedule"] for r in reg["rows"]})
        libs = [
            lib for lib in (PIPPY, TUNED, "torch") if any(r["library"] == lib for r in reg["rows"])
        ]
        colors = {PIPPY: "tab:blue", TUNED: "tab:green", "torch": "tab:orange"}
        width = 0.76 / len(libs)
        for j, lib in enumerate(libs):
            xs, meds, lo, hi, effs = [], [], [], [], []
            for i, s in enumerate(scheds):
                row = next(
                    (r for r in reg["rows"] if r["schedule"] == s and r["library"] == lib), None
                )
                if row is None:
                    continue
                st = row["step_s"]
                xs.append(i + (j - (len(libs) - 1) / 2) * width)
                meds.append(st["median"])
                lo.append(st["median"] - st["min"])
                hi.append(st["max"] - st["median"])
                effs.append((row["efficiency"] or 0) * 100)
            ax.bar(xs, meds, width, yerr=[lo, hi], capsize=3, label=lib, color=colors[lib])
            ax2.bar(xs, effs, width, label=lib, color=colors[lib])
        single = reg["single"]["step_s"]["median"]
        ax.axhline(single, color="gray", ls="--", lw=1, label="single process")
        ax.axhline(single / 2, color="gray", ls=":", lw=1, label="single / 2")
        ax.set_xticks(range(len(scheds)), scheds, fontsize=8)
        ax.set_ylabel("step time, s (median, min-max)")
        ax.set_title(f"{name}: step time")
        ax.legend(fontsize=7)
        ax2.axhline(95, color="gray", ls=":", lw=1)
        ax2.set_xticks(range(len(scheds)), scheds, fontsize=8)
        ax2.set_ylim(0, 105)
        ax2.set_ylabel("efficiency % (simulated ideal / step)")
        ax2.set_title(f"{name}: pipeline efficiency")
    fig.suptitle(f"pippy_xla vs torch.distributed.pipelining, {where}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _load() -> dict:
    out = subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
    return {"uptime": out, "loadavg": list(os.getloadavg())}


def _profile(rank, world, regime, lib, schedule, steps, warmup):
    """cProfile of one library's timed steps on the last rank; returns the top of the report."""
    import cProfile
    import io
    import pstats

    import torch.distributed.pipelining  # noqa: F401  (imports outside the profile)
    import transformers.models.llama.modeling_llama  # noqa: F401

    import pippy_xla  # noqa: F401

    _build(regime)
    prof = cProfile.Profile()
    if rank == world - 1:
        prof.enable()
    _paired(rank, world, regime, schedule, steps, warmup, (lib,))
    prof.disable()
    if rank != world - 1:
        return None
    out = io.StringIO()
    st = pstats.Stats(prof, stream=out)
    st.sort_stats("tottime").print_stats(25)
    st.sort_stats("cumulative").print_stats(35)
    return out.getvalue()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument(
        "--regimes",
        default="",
        help="default: compute,overhead,overhead-compiled (cpu); gpu-compute,overhead (cuda)",
    )
    p.add_argument(
        "--device",
        default="cpu",
        choices=("cpu", "cuda"),
        help="cuda: the two ranks share one GPU over NCCL (pippy_xla's transport then 'auto', "
        "which is in-order NCCL transfers); no efficiency columns there (host clocks)",
    )
    p.add_argument("--schedules", default="", help="comma list; default: every shared schedule")
    p.add_argument(
        "--no-tuned",
        action="store_true",
        help=f"no '{TUNED}' rows (list-scheduled schedules reordered for measured costs)",
    )
    p.add_argument("--out", default="compare", help="results name under benchmarks/results/")
    p.add_argument(
        "--transport",
        default="auto",
        choices=("auto", "process_group"),
        help="pippy_xla's transport: 'auto' (shared memory between the two ranks) or "
        "'process_group' (gloo, the wire torch.distributed.pipelining uses)",
    )
    p.add_argument(
        "--profile",
        default="",
        help="LIB:SCHEDULE:REGIME, e.g. pippy_xla:1f1b:overhead: cProfile the last rank and write "
        "benchmarks/results/compare_profile_LIB.txt instead of comparing",
    )
    args = p.parse_args()
    cuda = args.device == "cuda"
    if cuda and args.transport != "auto":
        p.error("--device cuda runs pippy_xla's 'auto' transport (in-order NCCL transfers)")
    regimes = args.regimes or (
        "gpu-compute,overhead" if cuda else "compute,overhead,overhead-compiled"
    )
    # Every rank on cuda:0 with its own NCCL host id (run_ranks), the single process too.
    ranks_kw = {"timeout": 1800, "backend": "nccl" if cuda else "gloo"}
    where = "2 ranks sharing one GPU (NCCL)" if cuda else "2 CPU ranks x 1 thread"
    if args.profile:
        lib, sched, regime = args.profile.split(":")
        report = run_ranks(
            2, _profile, REGIMES[regime], lib, sched, args.steps, args.warmup, timeout=1800
        )[-1]
        path = RESULTS / f"compare_profile_{lib}.txt"
        path.write_text(report)
        print(report[:6000])
        print(f"saved {path}")
        return

    from pippy_xla import _C

    names = _C.train_schedule_names()
    if args.schedules:
        names = [n for n in names if n in args.schedules.split(",")]
    no_torch = [n for n in names if n not in TORCH_SCHEDULES]
    names = [n for n in names if n in TORCH_SCHEDULES]
    load_before = _load()
    print(f"schedules: {names} (no torch counterpart: {no_torch}); {load_before['uptime']}")

    results, problems, failures = {}, [], []
    for name in regimes.split(","):
        regime = dict(REGIMES[name], transport=args.transport, device=args.device)
        t0 = time.perf_counter()
        single = run_ranks(1, _single, regime, args.steps, args.warmup, **ranks_kw)[0]
        single_step = summarize(single["step_times"])
        rows = []
        for sched in names:
            tune = not args.no_tuned and _C.schedule_info(sched).list_scheduled
            libs = (PIPPY, "torch", TUNED) if tune else (PIPPY, "torch")
            try:
                ranks = run_ranks(
                    2, _paired, regime, sched, args.steps, args.warmup, libs, **ranks_kw
                )
            except AssertionError as e:
                # torch cannot run this schedule on these stages: say so, run pippy_xla alone.
                failures.append(f"{name}/{sched}: the paired run failed: {str(e)[-1500:]}")
                print(failures[-1])
                libs = (PIPPY, TUNED) if tune else (PIPPY,)
                ranks = run_ranks(
                    2, _paired, regime, sched, args.steps, args.warmup, libs, **ranks_kw
                )
            skipped = [r[lib]["skipped"] for r in ranks for lib in r if "skipped" in r[lib]]
            if skipped:
                print(f"{name}/{sched}: {skipped[0]}")
                continue
            for lib in libs:
                rows.append(
                    _summarize_run(
                        lib, sched, regime, [r[lib] for r in ranks], single_step["median"]
                    )
                )
                print(f"{name}/{sched}/{lib}: median {rows[-1]['step_s']['median']:.4f} s")
            # What has run so far, should the run be cut short (a device call's time limit).
            progress = {**results, name: {"config": regime, "single": single, "rows": rows}}
            save(f"{args.out}_partial", {"config": vars(args), "results": progress})
        for row in rows:
            ref = next(
                (r for r in rows if r["schedule"] == row["schedule"] and r["library"] == "torch"),
                None,
            )
            row["vs_torch"] = ref["step_s"]["median"] / row["step_s"]["median"] if ref else None
        problems += _check_losses(name, rows, single["losses"])
        results[name] = {
            "config": regime,
            "single": {"step_s": single_step, "losses": single["losses"]},
            "rows": rows,
            "wall_s": time.perf_counter() - t0,
        }

    if problems:
        print("LOSSES DISAGREE - no times reported:")
        for pr in problems:
            print("  " + pr)
        # Kept for the diagnosis (a GPU run cannot simply be rerun), never as the results.
        kept = save(
            f"{args.out}_rejected", {"config": vars(args), "problems": problems, "results": results}
        )
        print(f"saved {kept}")
        sys.exit(1)
    print(
        f"losses agree (pippy_xla vs torch rtol {LIB_RTOL:g}, vs single process rtol {REF_RTOL:g})"
    )
    table = _table(results)
    print(table)
    overhead = _overhead_table(results)
    print("\nper-action costs of pippy_xla (medians over the last timed step, us)")
    print(overhead)
    for name, reg in results.items():
        for row in reg["rows"]:
            print(
                f"{name}/{row['schedule']}/{row['library']} per-action us (rank 0, 1): "
                f"{row['per_action_us']}"
            )
    payload = {
        "command": "python benchmarks/compare.py " + " ".join(sys.argv[1:]),
        "config": vars(args),
        "load_before": load_before,
        "load_after": _load(),
        "loss_tolerance": {"vs_single_rtol": REF_RTOL, "pippy_vs_torch_rtol": LIB_RTOL},
        "schedules": names,
        "schedules_without_torch_counterpart": no_torch,
        "torch_failures": failures,
        "results": results,
        "table_markdown": table,
        "per_action_markdown": overhead,
    }
    path = save(args.out, payload)
    (RESULTS / f"{args.out}_partial.json").unlink(missing_ok=True)
    _chart(results, RESULTS / f"{args.out}.png", where)
    print(f"saved {path} and {RESULTS / f'{args.out}.png'}")
    print(f"machine: {machine()}")


if __name__ == "__main__":
    main()
