"""End-to-end: PipelineModel on 2 and 4 gloo ranks against a single-process reference."""

from __future__ import annotations

import copy
import json

import pytest
import torch
from models import MODELS, full, grads_of, make_batch, on_first_rank, params_of

import pippy_xla as px
from pippy_xla.testing import run_ranks

# Tolerances (fp32): the pipeline sums per-microbatch losses and gradients that the reference
# computes over the whole batch at once, so results differ by float rounding only (~1e-7
# relative): losses and gradients are compared at rtol 1e-5, atol 1e-6. AdamW normalizes each
# element's update by sqrt(v) + eps: for an element whose gradient nearly cancels (|g| ~ 1e-8),
# a rounding-level difference in g moves the update by a sizeable fraction of lr. The tests use
# eps = 1e-6 (ADAM) so that such elements stay in Adam's linear regime, and compare parameters
# after optimizer steps at atol 2e-5 (2% of one step of lr = 1e-3).
LOSS_TOL = {"rtol": 1e-5, "atol": 1e-6}
GRAD_TOL = {"rtol": 1e-5, "atol": 1e-6}
PARAM_TOL = {"rtol": 1e-5, "atol": 2e-5}
ADAM = {"lr": 1e-3, "eps": 1e-6}


def _build(family, seed=0, **kw):
    torch.manual_seed(seed)
    model, layer_cls = MODELS[family](**kw)
    return model, layer_cls


def check_grads(named, ref, where, tol=GRAD_TOL):
    """Every ``(name, parameter)`` of ``named`` has a gradient equal to ``ref``'s (a model, or
    its gradients by name: :func:`models.grads_of`), gathered if a DTensor (a data- or
    tensor-parallel shard); at least one is checked."""
    n = 0
    for name, p in named:
        assert p.grad is not None, f"{where}: {name} got no gradient"
        torch.testing.assert_close(
            full(p.grad),
            ref[name] if isinstance(ref, dict) else ref.get_parameter(name).grad,
            **tol,
            msg=lambda m, name=name: f"{where}: grad {name}\n{m}",
        )
        n += 1
    assert n > 0


def _train_equal(
    rank, world, family, schedule, mb_counts, steps=3, layers=4, tune_after=None, transport="auto"
):
    """Per step: loss and every local gradient equal the reference's; after AdamW steps the
    parameters still match (with ``tune_after``: after that step the schedule is reordered for
    the measured costs). Returns what each rank checked, for the parent to assert on."""
    checked = []
    for mbs in mb_counts:
        model, layer_cls = _build(family, layers=layers)
        ref = copy.deepcopy(model)
        pipe = px.PipelineModel(
            model,
            layer_cls=layer_cls,
            num_microbatches=mbs,
            schedule=schedule,
            timeout=60,
            transport=transport,
        )
        assert (pipe._place.in_order is not None) == (transport == "in_order")
        opt = torch.optim.AdamW(pipe.parameters(), **ADAM)
        ref_opt = torch.optim.AdamW(ref.parameters(), **ADAM)
        for step in range(steps):
            batch = make_batch(seed=step)
            loss = pipe.run_train(**batch)
            ref_loss, grads, values = on_first_rank(whole_batch_step, ref, batch, ref_opt)
            where = f"{family} {schedule} ranks={world} mbs={mbs} step={step} rank={rank}"
            torch.testing.assert_close(loss, ref_loss, **LOSS_TOL, msg=where)
            check_grads(pipe.named_parameters(), grads, where)
            assert pipe.stash_live_bytes == 0, where
            opt.step()
            opt.zero_grad()
            for name, p in pipe.named_parameters():
                torch.testing.assert_close(
                    p,
                    values[name],
                    **PARAM_TOL,
                    msg=lambda m, name=name, where=where: f"{where}: param {name}\n{m}",
                )
            if step == tune_after:
                _tune(pipe, schedule, world, mbs)
        checked.append((mbs, sorted(n for n, _ in pipe.named_parameters())))
    return checked


def whole_batch_step(ref, batch: dict, opt) -> tuple:
    """One process's step on the whole batch, run on the first rank for every rank: the loss,
    the gradients, and the values after ``opt``'s step ([Note: one reference per multi-rank
    test] in ``models.py``)."""
    loss = ref(**batch, use_cache=False).loss
    loss.backward()
    grads = grads_of(ref)
    opt.step()
    opt.zero_grad()
    return loss.detach(), grads, params_of(ref)


def _tune(pipe, schedule, world, mbs):
    # The order for this step's measured costs, the same on every rank (the reorder checks that
    # the ranks agree), runs from the next step on.
    costs = pipe.stage_costs()
    assert sorted(costs) == ["backward", "forward", "weight"]
    assert all(len(v) == pipe.num_stages and min(v) > 0 for v in costs.values()), costs
    engine = pipe.engine
    tuned = pipe.tune_schedule()
    assert pipe.engine is not engine and pipe.engine.schedule.table() == tuned.table()
    assert tuned.table() == px.make_schedule(schedule, world, mbs, **costs).table()
    with pytest.raises(RuntimeError, match="run run_train with the current schedule first"):
        pipe.stage_costs()  # the new order has not run yet


def _hooks_between_steps(rank, world):
    """A step calls a stage's forward directly only while calling the module would do nothing
    else ([Note: calling a stage's forward]): hooks registered between steps run in the next."""
    model, layer_cls = _build("llama")
    pipe = px.PipelineModel(model, layer_cls=layer_cls, num_microbatches=4, timeout=60)
    module = pipe.module
    calls = {"own": 0, "global": 0, "scaled": 0}

    def scale(mod, args, out):  # a hook that changes the stage's outputs, and so the loss
        calls["scaled"] += 1
        return tuple(o * 0.5 for o in out)

    losses = [float(pipe.run_train(**make_batch(seed=0)))]
    own = module.register_forward_pre_hook(
        lambda mod, args: calls.__setitem__("own", calls["own"] + 1)
    )
    glob = torch.nn.modules.module.register_module_forward_pre_hook(
        lambda mod, args: calls.__setitem__("global", calls["global"] + (mod is module))
    )
    out = module.register_forward_hook(scale)
    losses.append(float(pipe.run_train(**make_batch(seed=0))))
    counted = dict(calls)
    for handle in (own, glob, out):
        handle.remove()
    losses.append(float(pipe.run_train(**make_batch(seed=0))))
    return counted, calls, losses


def test_hooks_registered_between_steps_run():
    for counted, after, losses in run_ranks(2, _hooks_between_steps):
        assert counted == {"own": 4, "global": 4, "scaled": 4}  # one per microbatch
        assert after == counted  # removed: the third step called forward directly again
        # No optimizer step: the same batch gives the same loss unless the hook scaled it.
        assert losses[0] == losses[2] != losses[1]


def _step_spans(rank, world, trace_path):
    """[Note: step spans]: each step's timings frame the engine's actions with one PRE and one
    POST span; stage costs and the timeline take them as they are."""
    model, layer_cls = _build("llama")
    pipe = px.PipelineModel(model, layer_cls=layer_cls, num_microbatches=4, timeout=60)
    checked = []
    for kind in ("train", "eval", "train"):
        batch = make_batch(seed=0)
        pipe.run_train(**batch) if kind == "train" else pipe.run_eval(**batch)
        timings = pipe.timings()
        spans = {op: [t for t in timings if t[0] == op] for op in ("PRE", "POST")}
        assert [len(v) for v in spans.values()] == [1, 1], (kind, timings)
        (_, *pre_at, pre_start, pre_end), (_, *post_at, post_start, post_end) = (
            spans["PRE"][0],
            spans["POST"][0],
        )
        actions = [t for t in timings if t[0] not in spans]
        assert {op for op, *_ in actions} >= ({"F", "B"} if kind == "train" else {"F"}), kind
        assert pre_at == post_at == [-1, -1]
        assert pre_start <= pre_end <= min(t[3] for t in actions), kind
        assert max(t[4] for t in actions) <= post_start <= post_end, kind
        checked.append((kind, (pre_end - pre_start) / 1e9, (post_end - post_start) / 1e9))
    costs = pipe.stage_costs()  # engine actions only
    assert all(len(v) == 2 and min(v) > 0 for v in (costs["forward"], costs["backward"])), costs
    events = pipe.timeline(json_path=trace_path if rank == 0 else None)  # a collective
    assert sorted((r, op) for r, op, *_ in events if op in ("PRE", "POST")) == [
        (0, "POST"),
        (0, "PRE"),
        (1, "POST"),
        (1, "PRE"),
    ]
    return checked


def test_step_spans_frame_the_engine_actions(tmp_path):
    trace = tmp_path / "trace.json"
    for checked in run_ranks(2, _step_spans, str(trace)):
        assert [kind for kind, *_ in checked] == ["train", "eval", "train"]
        assert all(pre > 0 and post > 0 for _, pre, post in checked), checked
    names = {e["name"] for e in json.loads(trace.read_text())["traceEvents"]}
    assert {"PRE", "POST", "F0.0", "B1.3"} <= names


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_two_ranks_match_single_process(family):
    out = run_ranks(2, _train_equal, family, "1f1b", [1, 2, 4, 8])
    # The two stages together own every parameter of the model exactly once (tied ones twice).
    model, _ = _build(family)
    all_names = {n for n, _ in model.named_parameters()}
    for i in range(4):  # one entry per microbatch count
        owned = set(out[0][i][1]) | set(out[1][i][1])
        assert all_names <= owned, all_names - owned


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_four_ranks_match_single_process(family):
    run_ranks(4, _train_equal, family, "1f1b", [1, 2, 4, 8], 2)


MULTI_STAGE_SCHEDULES = ["interleaved", "zbh1", "looped_bfs", "interleaved_zb", "zbv", "dualpipev"]


def _schedules_equal(rank, world):
    # Every schedule beyond 1F1B / GPipe, both families (GPT-2 ties its embedding and head: on a
    # V the two sit on rank 0, elsewhere on the first and last ranks), in one process group (one
    # spawn); 8 layers so that 4 ranks x 2 chunks fit; 2 x ranks microbatches (DualPipeV's least).
    for schedule in MULTI_STAGE_SCHEDULES:
        for family in ("llama", "gpt2"):
            _train_equal(rank, world, family, schedule, [2 * world], 2, 8)


@pytest.mark.parametrize("world", [2, 4])
def test_multi_stage_and_zero_bubble_schedules_match_single_process(world):
    run_ranks(world, _schedules_equal, timeout=600)


def _in_order_equal(rank, world):
    # [Note: transfers matched in order]: the NCCL path's transfer order, run over gloo groups
    # with one tag (gloo then matches a source's messages in order, as NCCL does), for every
    # schedule: a receive posted out of the sender's order gets another message (a wrong size, or
    # the wrong microbatch's tensor) and the step fails or its gradients differ. Two steps: the
    # discovery step (headers over the header group) and a step with known shapes.
    for schedule in ["1f1b", "gpipe", *MULTI_STAGE_SCHEDULES]:
        _train_equal(rank, world, "gpt2", schedule, [2 * world], 2, 8, transport="in_order")


@pytest.mark.parametrize("world", [2, 4])
def test_transfers_matched_in_order_match_single_process(world):
    run_ranks(world, _in_order_equal, timeout=600)


def _csv_schedule_trains(rank, world, csv_text):
    # A schedule in torch.distributed.pipelining's CSV format, run as given; it has no costs to
    # reorder for.
    schedule = px.Schedule.from_csv(csv_text, "torch-zbv")
    _train_equal(rank, world, "gpt2", schedule, [schedule.num_microbatches], 2, 4)
    model, layer_cls = _build("gpt2")
    pipe = px.PipelineModel(
        model, layer_cls=layer_cls, num_microbatches=4, schedule=schedule, timeout=60
    )
    with pytest.raises(ValueError, match="'torch-zbv' has a fixed order"):
        pipe.tune_schedule()


def _tuned_schedules_train(rank, world):
    model, layer_cls = _build("llama")
    pipe = px.PipelineModel(copy.deepcopy(model), layer_cls=layer_cls, num_microbatches=4)
    with pytest.raises(ValueError, match="'1f1b' has a fixed order; tune_schedule reorders the "):
        pipe.tune_schedule()
    pipe = px.PipelineModel(model, layer_cls=layer_cls, num_microbatches=4, schedule="zbh1")
    with pytest.raises(RuntimeError, match="measured in a training step"):
        pipe.tune_schedule()  # nothing measured yet
    for schedule in ("zbh1", "zbv"):
        _train_equal(rank, world, "llama", schedule, [4], 3, 4, tune_after=0)


def test_tuned_schedule_runs_and_matches_single_process():
    run_ranks(2, _tuned_schedules_train)


def test_schedule_from_torch_csv_runs_and_matches_single_process():
    import torch.distributed.pipelining.schedules as ts
    from test_schedule import _torch_order

    order = _torch_order(ts.ScheduleZBVZeroBubble, 2, 4, 2)
    text = "".join(",".join("" if a is None else str(a) for a in order[r]) + "\n" for r in (0, 1))
    run_ranks(2, _csv_schedule_trains, text)
    with pytest.raises(ValueError, match="runs 4 microbatches but num_microbatches=2"):
        px.PipelineConfig(num_microbatches=2, schedule=px.Schedule.from_csv(text))
