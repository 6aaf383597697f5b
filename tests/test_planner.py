"""Planner: exact solver (against brute force and the ColossalAI #5509 instance), infeasibility
errors, saved-bytes predictions on the tiny models, and plans applied to a 2-rank pipeline."""

from __future__ import annotations

import copy
import itertools
import math
import random

import pytest
import torch
from models import MODELS, make_batch, tiny

import pippy_xla as px
from pippy_xla.plan.planner import (
    LayerCost,
    PlanInfeasibleError,
    PlanProblem,
    StageExtra,
    evaluate,
    inflight_counts,
    limit_range,
    profile_model,
    solve,
)
from pippy_xla.plan.profiler import SavedBytes
from pippy_xla.split.partition import find_layers, layer_classes, partition
from pippy_xla.testing import run_ranks

# Same tolerances as tests/test_pipeline.py (fp32; microbatch sums vs whole-batch reference;
# checkpointing recomputes the same ops, so it adds no difference).
LOSS_TOL = dict(rtol=1e-5, atol=1e-6)
GRAD_TOL = dict(rtol=1e-5, atol=1e-6)


# ----------------------------------------------------------------------------- solver


def test_inflight_counts():
    assert inflight_counts("1f1b", 4, 8) == [4, 3, 2, 1]
    assert inflight_counts("1f1b", 4, 2) == [2, 2, 2, 1]
    assert inflight_counts("gpipe", 3, 5) == [5, 5, 5]


def _single_states(counts) -> list:
    """Live states of one stage per device holding ``counts[d]`` microbatches (1F1B, GPipe)."""
    return [[[[c, 0, 0]]] for c in counts]


def _colossal(limit: int) -> PlanProblem:
    # ColossalAI issue #5509, in units of 1/1000: per layer per microbatch activation 1.25,
    # 0.125 checkpointed; time 3 per layer (fwd 1 + bwd 2), +1 (a forward) when checkpointed;
    # 1F1B with 4 stages holds 4/3/2/1 microbatches.
    layer = LayerCost(fwd=1.0, bwd=2.0, saved_bytes=1250, saved_bytes_ckpt=125, static_bytes=0)
    return PlanProblem(
        layers=[layer] * 32,
        extras=[StageExtra() for _ in range(4)],
        live_states=_single_states(inflight_counts("1f1b", 4, 8)),
        memory_limit=[limit] * 4,
    )


def test_colossalai_5509_instance():
    free = solve(_colossal(10**9))
    assert free.bottleneck == 24.0
    assert [st.range for st in free.stages] == [(0, 8), (8, 16), (16, 24), (24, 32)]
    out = solve(_colossal(20_000))
    ranges = [st.range for st in out.stages]
    ckpt = [len(st.checkpoint) for st in out.stages]
    print(
        "ColossalAI #5509 plan:",
        ranges,
        "checkpointed",
        ckpt,
        "bottleneck",
        out.bottleneck,
        "ratio",
        out.bottleneck / free.bottleneck,
    )
    # A stage with checkpointed layers also holds one layer's recomputed activations during
    # its backward (1250 - 125): 7/8/8/9 layers with 4/4/0/0 checkpointed (without that term the
    # issue's own model allows 4/3/0/0 and 27.0).
    assert out.bottleneck <= 1.17 * free.bottleneck
    assert out.bottleneck == _colossal_best_bottleneck(20_000) == 28.0
    assert ckpt == [4, 4, 0, 0] and ranges == [(0, 7), (7, 15), (15, 23), (23, 32)]
    for d, st in enumerate(out.stages):
        n = st.range[1] - st.range[0]
        assert st.memory == _colossal_memory(d, n, len(st.checkpoint)) <= 20_000


def _stage_cost(problem: PlanProblem, s: int, rng: range, ck: set[int]):
    """[Note: planner cost model] for stage ``s`` with layers ``rng``, ``ck`` checkpointed:
    (time, saved, kept, recorded, fixed, transient, split transient), written out independently
    of the C++ code."""
    e = problem.extras[s]
    split = e.split_backward
    t, saved, fixed = e.fwd + e.bwd, e.saved_bytes, e.static_bytes + e.buffer_bytes
    kept, recorded = e.weight_bytes, e.recorded_bytes
    for k in rng:
        ly = problem.layers[k]
        c = k in ck
        t += (
            ly.fwd
            + ly.bwd
            + (ly.recompute + (ly.weight_ckpt - ly.weight if split else 0) if c else 0)
        )
        saved += ly.saved_bytes_ckpt if c else ly.saved_bytes
        kept += ly.weight_bytes_ckpt if c else ly.weight_bytes
        recorded += ly.recorded_bytes
        fixed += ly.static_bytes
    lays = [problem.layers[k] for k in rng]
    recompute = max(
        max(0, ly.saved_bytes - ly.saved_bytes_ckpt) + ly.transient_bytes for ly in lays
    )
    any_ck = any(k in ck for k in rng)
    trans = max(e.transient_bytes, *(ly.transient_bytes for ly in lays), recompute if any_ck else 0)
    split_trans = max(
        e.split_transient_bytes,
        *(ly.split_transient_bytes for ly in lays),
        recompute if any_ck else 0,
    )
    if not split:
        kept, recorded = saved, 0
    return t, saved, kept, recorded, fixed, trans, split_trans


def _device_memory(problem: PlanProblem, d: int, costs: dict[int, tuple]) -> int:
    """A device's peak: its stages' fixed bytes, plus the worst live state (weighted bytes and
    the acting stage's working set)."""
    mine = sorted(costs)
    fixed = sum(costs[s][4] for s in mine)
    worst = 0
    for t, states in enumerate(problem.live_states[d]):
        for x in states:
            in_b = x[3 * t + 2]
            v = costs[mine[t]][6] if in_b else costs[mine[t]][5]
            for k, s in enumerate(mine):
                v += (
                    x[3 * k] * costs[s][1] + x[3 * k + 1] * costs[s][2] + x[3 * k + 2] * costs[s][3]
                )
            worst = max(worst, v)
    return fixed + worst


def _device_of(problem: PlanProblem, s: int) -> int:
    return problem.stage_device[s] if problem.stage_device else s


def _brute(problem: PlanProblem):
    """Every composition into stages (or the given ranges) and every subset of checkpointed
    layers: (best bottleneck device time, smallest max excess over the limits)."""
    n, S = len(problem.layers), len(problem.extras)
    best, best_excess = float("inf"), None
    if problem.ranges:
        compositions = [[r[1] for r in problem.ranges[:-1]]]
    else:
        compositions = itertools.combinations(range(1, n), S - 1)
    masks = range(1 << n) if problem.allow_checkpoint else [0]
    for cuts in compositions:
        bounds = [0, *cuts, n]
        for mask in masks:
            ck = {k for k in range(n) if mask >> k & 1}
            per_device: dict[int, dict[int, tuple]] = {}
            for s in range(S):
                c = _stage_cost(problem, s, range(bounds[s], bounds[s + 1]), ck)
                per_device.setdefault(_device_of(problem, s), {})[s] = c
            times = [sum(c[0] for c in costs.values()) for costs in per_device.values()]
            excess = max(
                _device_memory(problem, d, costs) - problem.memory_limit[d]
                for d, costs in per_device.items()
            )
            if best_excess is None or excess < best_excess:
                best_excess = excess
            if excess <= 0:
                best = min(best, max(times))
    return best, best_excess


def _random_layer(rng: random.Random, split: bool) -> LayerCost:
    bwd = rng.uniform(0.1, 5)
    weight = rng.uniform(0, bwd) if split else 0.0
    return LayerCost(
        fwd=rng.uniform(0.1, 3),
        bwd=bwd,
        recompute=rng.uniform(0.1, 3),
        saved_bytes=rng.randint(0, 100),
        saved_bytes_ckpt=rng.randint(0, 40),
        static_bytes=rng.randint(0, 50),
        transient_bytes=rng.choice([0, rng.randint(0, 60)]),
        weight=weight,
        weight_ckpt=weight + rng.uniform(0, 3) if split else 0.0,
        weight_bytes=rng.randint(0, 120) if split else 0,
        weight_bytes_ckpt=rng.randint(0, 60) if split else 0,
        recorded_bytes=rng.randint(0, 40) if split else 0,
        split_transient_bytes=rng.choice([0, rng.randint(0, 60)]) if split else 0,
    )


def _random_extra(rng: random.Random, split: bool) -> StageExtra:
    bwd = rng.uniform(0, 2)
    return StageExtra(
        fwd=rng.uniform(0, 2),
        bwd=bwd,
        saved_bytes=rng.randint(0, 30),
        static_bytes=rng.randint(0, 30),
        transient_bytes=rng.choice([0, rng.randint(0, 80)]),
        buffer_bytes=rng.randint(0, 20),
        weight=rng.uniform(0, bwd) if split else 0.0,
        weight_bytes=rng.randint(0, 40) if split else 0,
        recorded_bytes=rng.randint(0, 20) if split else 0,
        split_transient_bytes=rng.choice([0, rng.randint(0, 80)]) if split else 0,
        split_backward=split and rng.random() < 0.7,
    )


def _random_states(rng: random.Random, stages: int, split: bool) -> list:
    """Per stage of a device, 1-3 random live states (running-B count 0 or 1)."""
    return [
        [
            [
                c
                for _ in range(stages)
                for c in (
                    rng.randint(0, 4),
                    rng.randint(0, 4) if split else 0,
                    rng.randint(0, 1) if split else 0,
                )
            ]
            for _ in range(rng.randint(1, 3))
        ]
        for _ in range(stages)
    ]


def _random_problem(rng: random.Random) -> PlanProblem:
    """One stage per device and free ranges, or (a third of the time) 2 stages per device on
    given ranges, like interleaved; half of the problems split their backward (ZB-H1)."""
    split = rng.random() < 0.5
    n = rng.randint(2, 8)
    interleaved = n >= 4 and rng.random() < 0.33
    if interleaved:
        n = min(n, 6)  # keep the brute force small
        D = rng.randint(1, 2)
        S = 2 * D
        bounds = [0, *sorted(rng.sample(range(1, n), S - 1)), n]
        ranges = [(bounds[s], bounds[s + 1]) for s in range(S)]
        stage_device = [s % D for s in range(S)]
    else:
        S = D = rng.randint(1, min(3, n))
        ranges, stage_device = [], []
    layers = [_random_layer(rng, split) for _ in range(n)]
    extras = [_random_extra(rng, split) for _ in range(S)]
    limits = [rng.randint(50, 1500) for _ in range(D)]
    if rng.random() < 0.5:
        limits = [limits[0]] * D
    return PlanProblem(
        layers=layers,
        extras=extras,
        stage_device=stage_device,
        live_states=[_random_states(rng, S // D, split) for _ in range(D)],
        memory_limit=limits,
        ranges=ranges,
        allow_checkpoint=rng.random() < 0.9,
    )


def test_solver_matches_brute_force():
    """The solver against every composition and checkpoint subset, with random costs, live
    states (split backward or not), and one or two stages per device."""
    rng = random.Random(1234)
    feasible = interleaved = 0
    for _ in range(200):
        problem = _random_problem(rng)
        best, best_excess = _brute(problem)
        if best == float("inf"):
            with pytest.raises(PlanInfeasibleError) as err:
                solve(problem)
            assert err.value.min_memory_limit == [x + best_excess for x in problem.memory_limit]
            continue
        feasible += 1
        interleaved += bool(problem.ranges)
        out = solve(problem)
        assert out.bottleneck == pytest.approx(best, rel=1e-9)
        # The returned plan is feasible and its objective and memory are the model's.
        ranges = [st.range for st in out.stages]
        assert ranges[0][0] == 0 and ranges[-1][1] == len(problem.layers)
        if problem.ranges:
            assert ranges == [tuple(r) for r in problem.ranges]
        ck = {k for st in out.stages for k in st.checkpoint}
        per_device: dict[int, dict[int, tuple]] = {}
        for s, st in enumerate(out.stages):
            c = _stage_cost(problem, s, range(*st.range), ck)
            assert st.time == pytest.approx(c[0], rel=1e-9)
            per_device.setdefault(_device_of(problem, s), {})[s] = c
        for s, st in enumerate(out.stages):
            d = _device_of(problem, s)
            assert st.device == d
            assert st.memory == _device_memory(problem, d, per_device[d])
            assert st.memory <= problem.memory_limit[d]
    assert feasible > 60 and interleaved > 10, (feasible, interleaved)


def _colossal_memory(d: int, n: int, c: int) -> int:
    """:func:`_colossal` by hand: device ``d`` holds ``4 - d`` microbatches; ``n`` layers with
    ``c`` checkpointed keep ``125 c + 1250 (n - c)`` each, plus one layer's recomputed
    activations (1250 - 125) while a checkpointed layer's backward runs."""
    return (4 - d) * (125 * c + 1250 * (n - c)) + (1125 if c else 0)


def _colossal_splits():
    return (
        (a, b, c, 32 - a - b - c)
        for a in range(1, 30)
        for b in range(1, 31 - a)
        for c in range(1, 32 - a - b)
    )


def _colossal_smallest_limit() -> int:
    """The least over every split of the 32 layers of the largest device's least memory."""
    return min(
        max(min(_colossal_memory(d, n, c) for c in range(n + 1)) for d, n in enumerate(split))
        for split in _colossal_splits()
    )


def _colossal_best_bottleneck(limit: int) -> float:
    """The least bottleneck time under ``limit`` by exhaustive search: a stage of ``n`` layers,
    ``c`` checkpointed, takes ``3 n + c`` (a recomputed forward per checkpointed layer)."""
    best = math.inf
    for split in _colossal_splits():
        times = []
        for d, n in enumerate(split):
            fits = [c for c in range(n + 1) if _colossal_memory(d, n, c) <= limit]
            if not fits:
                break
            times.append(3 * n + min(fits))
        else:
            best = min(best, max(times))
    return best


def test_infeasible_reports_smallest_limit():
    with pytest.raises(PlanInfeasibleError, match="smallest memory limit that fits") as err:
        solve(_colossal(1_000))
    need = err.value.min_memory_limit[0]
    # Everything checkpointed, 3125 admits 4 + 5 + 8 + 16 >= 32 layers; 3124 only 3 + 5 + 7 + 15.
    assert need == _colossal_smallest_limit() == 3_125
    assert str(need) in str(err.value)
    solve(_colossal(need))  # fits
    with pytest.raises(PlanInfeasibleError):
        solve(_colossal(need - 1))


def test_layer_ranges_only():
    problem = _colossal(18_000)  # without checkpointing at most 3 + 4 + 7 + 14 layers fit
    problem.allow_checkpoint = False
    with pytest.raises(PlanInfeasibleError):
        solve(problem)
    problem.memory_limit = [40_000] * 4
    out = solve(problem)
    assert all(not st.checkpoint for st in out.stages)


# ----------------------------------------------------------------------------- profiler + plan


def _stage_saved_bytes(model, layer_cls, ranges, ckpt, batch, m):
    """Saved-for-backward bytes of one microbatch per stage, measured by running the real stage
    graphs one after another in this process under saved_tensors_hooks."""
    stages = partition(model, layer_cls, ranges, checkpoint_layers=ckpt)
    mb = {k: v[: v.shape[0] // m].clone() for k, v in batch.items()}  # own storage
    exclude = list(model.parameters()) + list(model.buffers())
    out, boundary = [], []
    for st in stages:
        counter = SavedBytes(exclude)
        inputs = [b.detach().requires_grad_() for b in boundary]
        with counter.hooks():  # what is saved counts while its outputs are held
            res = st.module(*[mb[n] for n in st.batch_inputs], *inputs)
            if st.index == len(stages) - 1:
                loss = model.loss_function(
                    logits=res[0], labels=mb["labels"], vocab_size=model.config.vocab_size
                )
        out.append(counter.total())
        boundary = list(res)
    del loss
    return out


def test_saved_bytes_forget_a_tensor_saved_by_a_dropped_graph():
    """A graph dropped during forward (a recurrent layer's chunked kernel does this) frees what it
    saved: those bytes are not held until backward, and the allocator may hand their address to
    the next tensor of the same size, which must count (CI's allocator did, and one of three
    identical OLMo-hybrid layers counted 24,576 bytes fewer than the others)."""
    x = torch.randn(1000, requires_grad=True)
    for _ in range(20):  # the allocator reuses the freed block on most tries
        counter = SavedBytes([x])
        with counter.hooks():
            counter.region = "dropped"
            (x + 1).sin()  # sin saves its input, which dies with the graph
            counter.region = "kept"
            y = (x + 1).sin()
        assert counter.by_region() == {"kept": 4000}
        del y


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_saved_bytes_prediction(family):
    torch.manual_seed(0)
    model, layer_cls = MODELS[family](layers=4)
    batch = make_batch(0, batch=8, seq=16, pad=False)
    m = 4
    prof = profile_model(model, layer_cls, microbatch_size=2, seq_len=16, repeats=1)
    for ranges, ckpt in [
        ([(0, 2), (2, 4)], []),
        ([(0, 1), (1, 4)], [0, 2]),
        ([(0, 3), (3, 4)], [1, 2]),
        ([(0, 2), (2, 3), (3, 4)], [0, 1, 2]),
    ]:
        measured = _stage_saved_bytes(model, layer_cls, ranges, ckpt, batch, m)
        for s, r in enumerate(ranges):
            predicted = prof.predict_saved_bytes(r, ckpt, s == 0, s == len(ranges) - 1)
            err = abs(predicted - measured[s]) / measured[s]
            print(
                f"{family} ranges={ranges} ckpt={ckpt} stage {s}: predicted {predicted} "
                f"measured {measured[s]} error {err:.1%}"
            )
            assert err <= 0.15, (family, ranges, ckpt, s, predicted, measured[s])
    # Checkpointing really drops saved bytes.
    plain = _stage_saved_bytes(model, layer_cls, [(0, 2), (2, 4)], [], batch, m)
    ck = _stage_saved_bytes(model, layer_cls, [(0, 2), (2, 4)], [0, 1, 2, 3], batch, m)
    assert all(c < p / 2 for c, p in zip(ck, plain, strict=True)), (ck, plain)


def test_plan_beats_checkpoint_everything():
    torch.manual_seed(0)
    model, layer_cls = MODELS["llama"](layers=8)
    prof = profile_model(model, layer_cls, microbatch_size=2, seq_len=16, repeats=3)
    m, S = 8, 4
    uniform = px.balanced_ranges(8, S)
    plain = evaluate(prof, layer_ranges=uniform, num_microbatches=m)
    everything = evaluate(
        prof, layer_ranges=uniform, checkpoint_layers=range(8), num_microbatches=m
    )
    peak = max(st.memory_bytes for st in plain.stages)
    limit = int(0.8 * peak)  # the uniform, uncheckpointed split does not fit
    assert max(st.memory_bytes for st in everything.stages) <= limit
    p = px.plan(
        model,
        layer_cls=layer_cls,
        num_stages=S,
        num_microbatches=m,
        batch_size=16,
        seq_len=16,
        memory_limit=limit,
        profile=prof,
    )
    print(p.table())
    assert all(st.memory_bytes <= limit for st in p.stages)
    assert 0 < len(p.checkpoint_layers) < 8
    assert p.step_time < everything.step_time
    assert p.bottleneck_time < everything.bottleneck_time
    again = px.Plan.from_json(p.to_json())
    assert again == p and again.table() == p.table()


def _train_with_plan(rank, world, plan_json, steps=2):
    torch.manual_seed(0)
    model, layer_cls = MODELS["llama"](layers=4)
    ref = copy.deepcopy(model)
    plan = px.Plan.from_json(plan_json)
    m = plan.num_microbatches
    # Not what the plan was made for: another schedule, microbatch count or stages per rank.
    for options, named in (
        ({"schedule": "gpipe"}, "schedule='gpipe'"),
        ({"num_microbatches": 2 * m}, f"num_microbatches={2 * m}"),
        ({"schedule": "interleaved", "chunks": 2}, "schedule='interleaved', chunks=2"),
    ):
        with pytest.raises(ValueError) as e:
            px.PipelineModel(model, layer_cls=layer_cls, plan=plan, **options)
        assert f"made for schedule '1f1b' with {m} microbatches and 1 stage(s) per rank" in str(
            e.value
        )
        assert f"drop {named}, or make a plan" in str(e.value)
    # The plan's schedule, microbatch count and chunks go in once: with the plan.
    pipe = px.PipelineModel(model, layer_cls=layer_cls, plan=plan, timeout=60)
    cfg = pipe.pipeline_config
    assert (cfg.schedule, cfg.num_microbatches, cfg.chunks) == ("1f1b", m, 1)
    mine = plan.stages[rank].checkpoint_layers
    code = pipe.stage.code
    for k in pipe.layers_of_stage(rank):
        call = f"model_model_layers_{k} = torch.utils.checkpoint.checkpoint("
        assert (call in code) == (k in mine), (k, mine, code)
    assert code.count("torch.utils.checkpoint.checkpoint(") == len(mine)
    for step in range(steps):
        batch = make_batch(seed=step)
        loss = pipe.run_train(**batch)
        ref_loss = ref(**batch, use_cache=False).loss
        ref_loss.backward()
        torch.testing.assert_close(loss, ref_loss.detach(), **LOSS_TOL)
        for name, p in pipe.named_parameters():
            torch.testing.assert_close(
                p.grad,
                ref.get_parameter(name).grad,
                **GRAD_TOL,
                msg=f"rank {rank} step {step} grad {name}",
            )
        for p in list(pipe.parameters()) + list(ref.parameters()):
            p.grad = None
    return mine


def test_plan_applied_on_two_ranks():
    torch.manual_seed(0)
    model, layer_cls = MODELS["llama"](layers=4)
    prof = profile_model(model, layer_cls, microbatch_size=2, seq_len=16, repeats=1)
    m = 4
    plain = evaluate(prof, layer_ranges=[(0, 2), (2, 4)], num_microbatches=m)
    every = evaluate(
        prof, layer_ranges=[(0, 2), (2, 4)], checkpoint_layers=range(4), num_microbatches=m
    )
    # Between "every layer checkpointed" and "none" (static bytes dominate the tiny model).
    limit = (
        max(st.memory_bytes for st in plain.stages) + max(st.memory_bytes for st in every.stages)
    ) // 2
    plan = px.plan(
        model,
        layer_cls=layer_cls,
        num_stages=2,
        num_microbatches=m,
        batch_size=8,
        seq_len=16,
        memory_limit=limit,
        profile=prof,
    )
    assert plan.checkpoint_layers, plan.table()
    out = run_ranks(2, _train_with_plan, plan.to_json())
    assert sorted(out[0] + out[1]) == plan.checkpoint_layers


def _train_router_losses_with_plan(rank, world, plan_json):
    """One step of Mixtral with router losses under ``plan`` (ZB-H1, a split backward): loss and
    every gradient equal one process's (``reference_step``: router losses per microbatch)."""
    from models import reference_step
    from test_pipeline import check_grads

    torch.manual_seed(0)
    model, layer_cls = MODELS["mixtral_router_loss"]()
    ref = copy.deepcopy(model)
    plan = px.Plan.from_json(plan_json)
    pipe = px.PipelineModel(model, layer_cls=layer_cls, plan=plan, timeout=60)
    batch = make_batch(seed=0)
    loss = pipe.run_train(**batch)
    ref_loss, _ = reference_step(ref, batch, plan.num_microbatches)
    torch.testing.assert_close(loss, ref_loss.detach(), **LOSS_TOL)
    check_grads(pipe.named_parameters(), ref, f"rank {rank}")
    return pipe.layers_of_stage(rank)


def test_a_model_with_router_losses_is_planned_for_a_split_backward():
    """The profiler's split backward (ZB-H1's B and W per layer) of a model whose loss adds terms
    that read inside the layers (Mixtral's router losses, from router logits that hooks record):
    it used to run the epilogue's W through the layers' graphs and fail; the plan now trains like
    one process."""
    torch.manual_seed(0)
    model, layer_cls = MODELS["mixtral_router_loss"]()
    kw = dict(layer_cls=layer_cls, num_stages=2, num_microbatches=4, batch_size=8, seq_len=16)
    plan = px.plan(model, memory_limit="1GiB", schedule="zbh1", repeats=1, **kw)
    assert plan.stages[-1].weight_time > 0 and plan.stages[-1].weight_bytes > 0, plan.table()
    out = run_ranks(2, _train_router_losses_with_plan, plan.to_json())
    assert [list(range(a, b)) for a, b in plan.layer_ranges] == out


def test_plan_validation():
    torch.manual_seed(0)
    model, layer_cls = MODELS["llama"](layers=4)
    with pytest.raises(ValueError, match="divisible"):
        px.plan(
            model,
            layer_cls=layer_cls,
            num_stages=2,
            num_microbatches=3,
            batch_size=8,
            seq_len=16,
            memory_limit="1GiB",
        )
    with pytest.raises(PlanInfeasibleError, match="smallest memory limit"):
        px.plan(
            model,
            layer_cls=layer_cls,
            num_stages=2,
            num_microbatches=2,
            batch_size=4,
            seq_len=16,
            memory_limit="1KiB",
            repeats=1,
        )


def test_cli_plan(capsys, tmp_path):
    from pippy_xla.cli import main

    out_json = tmp_path / "plan.json"
    rc = main(
        [
            "plan",
            "--model",
            "llama",
            "--layers",
            "4",
            "--hidden",
            "64",
            "--stages",
            "2",
            "--microbatches",
            "2",
            "--seq-len",
            "16",
            "--memory-limit",
            "64MiB",
            "--repeats",
            "1",
            "--json",
            str(out_json),
        ]
    )
    assert rc == 0
    text = capsys.readouterr().out
    header = next(line for line in text.splitlines() if line.startswith("stage"))
    # The predicted peak per stage and its parts.
    parts = ("static", "activations", "buffers", "transient", "peak", "limit")
    assert all(w in header for w in parts)
    assert "simulated step" in text
    assert px.Plan.from_json(out_json.read_text()).num_stages == 2
    assert (
        main(
            [
                "plan",
                "--model",
                "gpt2",
                "--layers",
                "2",
                "--stages",
                "2",
                "--microbatches",
                "2",
                "--seq-len",
                "16",
                "--memory-limit",
                "1KiB",
                "--repeats",
                "1",
            ]
        )
        == 2
    )
    assert "smallest memory limit" in capsys.readouterr().err


# ----------------------------------------------------------------------------- measured peaks


def _activation_heavy_llama(layers: int = 4):
    """A Llama whose activations, not its parameters, dominate a step's memory at seq 128."""
    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    cfg = LlamaConfig(
        vocab_size=2048,
        hidden_size=128,
        intermediate_size=512,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
    )
    return LlamaForCausalLM(cfg), LlamaDecoderLayer


def _measured_peaks(rank, world, plan_jsons, seq):
    """Each plan on its ranks: :func:`_measured_peak` (the counting allocator installed before
    the model is built)."""
    import gc

    from pippy_xla import _C

    _C.memory_tracker_install()
    peaks = []
    for plan_json in plan_jsons:
        peaks.append(_measured_peak(px.Plan.from_json(plan_json), seq))
        gc.collect()  # the next plan's peak must not count this one's tensors
    return peaks


def _measured_peak(plan, seq, **options) -> int:
    """The most live CPU tensor bytes (the counting allocator, installed by the caller) during a
    training step of ``plan`` on a meta-built model, after a warm-up step with an AdamW step (so
    gradients and optimizer state exist); ``options`` go to the pipeline (a mesh)."""
    from pippy_xla import _C

    with torch.device("meta"):
        model, layer_cls = _activation_heavy_llama(plan.layer_ranges[-1][1])
    pipe = px.PipelineModel(model, layer_cls=layer_cls, plan=plan, timeout=60, **options)
    del model
    opt = torch.optim.AdamW(pipe.parameters())
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 2048, (8, seq), generator=g)
    batch = {"input_ids": ids, "labels": ids}
    pipe.run_train(**batch)
    opt.step()
    _C.memory_reset_peak()
    pipe.run_train(**batch)
    return _C.memory_stats().peak_bytes


def test_predicted_peak_memory_matches_the_measured_peak():
    """1F1B and GPipe on 2 ranks, with no layer, half and every layer checkpointed: each
    stage's measured peak is within 10% of the planner's prediction (static + activations +
    transient), and the activations and transient are a large part of it."""
    torch.manual_seed(0)
    model, layer_cls = _activation_heavy_llama()
    seq = 128
    prof = profile_model(model, layer_cls, microbatch_size=2, seq_len=seq, repeats=1)
    plans = [
        evaluate(
            prof,
            layer_ranges=[(0, 2), (2, 4)],
            checkpoint_layers=ckpt,
            num_microbatches=4,
            schedule=schedule,
        )
        for schedule in ("1f1b", "gpipe")
        # [1, 3]: the stage's upper layer checkpointed. With the lower one checkpointed ([0, 2])
        # the model over-predicts by up to 10% here: that layer recomputes after the upper
        # layer's activations were freed, and the model adds the recomputation on top of them.
        for ckpt in ([], [1, 3], [0, 1, 2, 3])
    ]
    measured = run_ranks(2, _measured_peaks, [p.to_json() for p in plans], seq)
    for i, plan in enumerate(plans):
        for st in plan.stages:
            got = measured[st.index][i]
            where = f"{plan.schedule} ckpt={plan.checkpoint_layers} stage {st.index}"
            print(f"{where}: predicted {st.memory_bytes} measured {got}")
            if not plan.checkpoint_layers:  # activations are a large part of the peak
                assert st.activation_bytes + st.transient_bytes > 0.4 * st.memory_bytes, where
            assert abs(got - st.memory_bytes) <= 0.10 * st.memory_bytes, (where, got, st)


SCHEDULES = [("1f1b", 1), ("gpipe", 1), ("zbh1", 1), ("interleaved", 2)]
# Every other schedule, with its own stages per rank; DualPipeV needs 2 x ranks microbatches.
MORE_SCHEDULES = [("looped_bfs", 2), ("interleaved_zb", 2), ("zbv", 2), ("dualpipev", 2)]


@pytest.mark.parametrize("ranks,layers", [(2, 4), (4, 8)])
def test_planned_runs_stay_under_random_limits(ranks, layers):
    """For every schedule (multi-stage ones with 2 stages per rank), 10 random limits each between
    the smallest feasible limit and the unconstrained peak: every planned run's measured peak
    (each rank) is within 10% of the prediction and under its limit. Plans with the same layout
    are run once."""
    torch.manual_seed(0)
    model, layer_cls = _activation_heavy_llama(layers)
    seq, batch, mbs = 128, 8, 4
    prof = profile_model(model, layer_cls, microbatch_size=batch // mbs, seq_len=seq, repeats=1)
    rng = random.Random(ranks)
    plans = []
    for schedule, chunks in SCHEDULES + MORE_SCHEDULES:
        if schedule == "dualpipev" and mbs < 2 * ranks:
            continue
        kw = dict(
            layer_cls=layer_cls,
            num_stages=ranks * chunks,
            num_microbatches=mbs,
            batch_size=batch,
            seq_len=seq,
            schedule=schedule,
            chunks=chunks,
            profile=prof,
        )
        low, high = limit_range(model, **kw)
        assert 0 < low < high
        limits = sorted(rng.randint(low, high) for _ in range(10))
        plans += [px.plan(model, memory_limit=limit, **kw) for limit in limits]

    def layout(p):
        return p.schedule, tuple(p.layer_ranges), tuple(p.checkpoint_layers)

    runs = {}
    for p in plans:
        runs.setdefault(layout(p), p)
    order = list(runs)
    measured = run_ranks(
        ranks, _measured_peaks, [runs[k].to_json() for k in order], seq, timeout=600
    )
    for plan in plans:
        i = order.index(layout(plan))
        for st in plan.stages:
            got = measured[st.rank][i]
            where = (
                f"{plan.schedule} limit {st.memory_limit} ranges {plan.layer_ranges} "
                f"ckpt {plan.checkpoint_layers} stage {st.index} rank {st.rank}"
            )
            print(f"{where}: predicted {st.memory_bytes} measured {got}")
            assert st.memory_bytes <= st.memory_limit, where
            assert got <= st.memory_limit, (where, got)
            assert abs(got - st.memory_bytes) <= 0.10 * st.memory_bytes, (where, got)


BYTE_FIELDS = (
    "saved_bytes",
    "saved_bytes_ckpt",
    "static_bytes",
    "transient_bytes",
    "weight_bytes",
    "weight_bytes_ckpt",
    "recorded_bytes",
    "split_transient_bytes",
)


@pytest.mark.parametrize("family", ["qwen2", "gpt2"])  # two layer kinds; tied weights
def test_a_meta_model_profiles_like_the_real_one(family):
    """A model built on ``meta`` is profiled through a stand-in that holds one layer per kind
    ([Note: profiling a meta model]): every byte the planner uses equals the real model's."""
    from pippy_xla.plan.profiler import _stand_in

    torch.manual_seed(0)
    real, layer_cls = MODELS[family](layers=6)
    with torch.device("meta"):
        meta, _ = MODELS[family](layers=6)
    kw = dict(microbatch_size=2, seq_len=16, repeats=1, cache=False)
    want = profile_model(real, layer_cls, **kw)
    got = profile_model(meta, layer_cls, **kw)
    for k, (a, b) in enumerate(zip(want.layers, got.layers, strict=True)):
        for f in BYTE_FIELDS:
            assert getattr(a, f) == getattr(b, f), (family, k, f)
    for part in ("prologue", "epilogue"):
        a, b = getattr(want, part), getattr(got, part)
        for f in ("saved_bytes", "static_bytes", "transient_bytes", "weight_bytes"):
            assert getattr(a, f) == getattr(b, f), (family, part, f)
    assert (want.shared_saved_bytes, want.boundary_bytes) == (
        got.shared_saved_bytes,
        got.boundary_bytes,
    )
    assert all(p.device.type == "meta" for p in meta.parameters())  # the model is untouched
    stand_in, sharing = _stand_in(meta, layer_cls, torch.device("cpu"))
    kinds = len(set(sharing.values()))
    per_layer = sum(
        p.numel() for p in real.get_submodule(find_layers(real, layer_cls)[0]).parameters()
    )
    held = sum(p.numel() for p in stand_in.parameters())  # each Parameter once
    assert held == sum(p.numel() for p in real.parameters()) - (6 - kinds) * per_layer
    assert kinds == (2 if family == "qwen2" else 1)


def test_layers_of_two_classes_cost_apart():
    """OLMo-hybrid keeps attention and linear-attention layers in one list (``layer_cls=None``
    finds both classes): the profiler holds and times one layer per class, so the cost model
    gives each class its own costs and layers of one class the same."""
    from pippy_xla.plan.profiler import _stand_in

    with torch.device("meta"):
        meta, _ = MODELS["olmo_hybrid"](layers=4)
    classes = layer_classes(meta, None)
    assert len(classes) == 2
    _, sharing = _stand_in(meta, classes, torch.device("cpu"))
    assert len(set(sharing.values())) == 2
    prof = profile_model(meta, None, microbatch_size=2, seq_len=16, repeats=1, cache=False)
    kinds = meta.config.layer_types
    assert len(set(kinds)) == 2, kinds

    def costs(k):
        c = prof.layers[k]
        times = (c.fwd, c.bwd, c.recompute)
        sets = (c.saved_bytes, c.transient_bytes, c.static_bytes, c.weight_bytes)
        return times, sets

    for i, j in itertools.combinations(range(4), 2):
        (times_i, sets_i), (times_j, sets_j) = costs(i), costs(j)
        if kinds[i] == kinds[j]:  # the same measured layer: every cost equal
            assert (times_i, sets_i) == (times_j, sets_j), (i, j, kinds)
        else:  # each kind's own: times and every working set apart
            assert all(a != b for a, b in zip(times_i, times_j, strict=True)), (i, j, kinds)
            assert all(a != b for a, b in zip(sets_i, sets_j, strict=True)), (i, j, kinds)


def test_a_model_with_image_inputs_is_refused_by_the_profiler():
    from models import INPUT_NAMES, llava

    model, _ = llava()
    kw = dict(microbatch_size=2, seq_len=16, repeats=1, cache=False)
    with pytest.raises(px.UnsupportedModelError, match=r"takes \['pixel_values'\], which the"):
        profile_model(model, None, input_names=INPUT_NAMES["llava"], **kw)
    with pytest.raises(px.UnsupportedModelError, match="plan\\(\\) and profile_model"):
        px.plan(
            model,
            num_stages=2,
            num_microbatches=2,
            batch_size=4,
            seq_len=16,
            memory_limit="1GiB",
            repeats=1,
            input_names=INPUT_NAMES["llava"],
        )


def test_a_profile_leaves_no_tensor_alive():
    """After profiling, the process holds what it held before: a plan made on a rank that then
    trains (the first rank, or the first stage's tp ranks) must not add the profile's tensors to
    that rank's peak. Layer 0's input once stayed alive (with the embedding behind its graph)
    through a cycle gc cannot see."""
    import gc

    from pippy_xla import _C

    _C.memory_tracker_install()
    with torch.device("meta"):
        meta, layer_cls = MODELS["llama"](layers=2)
    gc.collect()
    before = _C.memory_stats().live_bytes
    profile_model(meta, layer_cls, microbatch_size=2, seq_len=16, repeats=1, cache=False)
    gc.collect()
    assert _C.memory_stats().live_bytes == before


def test_a_meta_model_can_be_planned():
    torch.manual_seed(0)
    real, layer_cls = MODELS["llama"](layers=4)
    with torch.device("meta"):
        meta, _ = MODELS["llama"](layers=4)
    kw = dict(layer_cls=layer_cls, num_stages=2, num_microbatches=2, batch_size=4, seq_len=16)
    plan = px.plan(meta, memory_limit="1GiB", repeats=1, **kw)
    prof = profile_model(real, layer_cls, microbatch_size=2, seq_len=16, repeats=1, cache=False)
    same = evaluate(
        prof,
        layer_ranges=plan.layer_ranges,
        checkpoint_layers=plan.checkpoint_layers,
        num_microbatches=2,
    )
    assert [st.memory_bytes for st in plan.stages] == [st.memory_bytes for st in same.stages]


# ----------------------------------------------------------------------------- tensor parallel


TP_SCHEDULES = ("1f1b", "zbh1")  # ZB-H1: B and W apart, what B keeps for W, under tp


def _plan_under_tp(rank, world, seq):
    """pp=2 x tp=2, on a meta-built model: the tp ranks of the first stage profile together and,
    per schedule, the first rank plans under a limit a third of the way from the smallest
    feasible one to the unconstrained peak (forcing another layout than the unconstrained one);
    every rank gets the plans. Returns them and, on the profiling ranks, layer 0's profiled
    static bytes."""
    import torch.distributed as dist
    from test_tensor_parallel import _mesh

    sharding = px.LayerSharding(_mesh(1, 2, 2), timeout=60)
    assert sharding.profiles == (rank < 2) and (sharding.size, sharding.first_rank) == (2, 0)
    with torch.device("meta"):
        model, layer_cls = _activation_heavy_llama()
    kw = dict(layer_cls=layer_cls, num_stages=2, num_microbatches=4, batch_size=8, seq_len=seq)
    prof = None
    if sharding.profiles:
        prof = profile_model(
            model, layer_cls, microbatch_size=2, seq_len=seq, repeats=1, tensor_parallel=sharding
        )
    plans = []
    for schedule in TP_SCHEDULES:
        kw["schedule"] = schedule
        shared = [None, None]
        if prof is not None:
            low, high = limit_range(model, profile=prof, **kw)
            free = px.plan(model, memory_limit=2**62, profile=prof, **kw)  # this rank's alone
            shared = [low + (high - low) // 3, (free.layer_ranges, free.checkpoint_layers)]
        dist.broadcast_object_list(shared, src=0)
        # The profiling ranks' profile is the plan's (profiled once); the first rank's plan wins.
        plan = px.plan(model, memory_limit=shared[0], profile=prof, tensor_parallel=sharding, **kw)
        assert (plan.layer_ranges, plan.checkpoint_layers) != shared[1], plan.table()
        plans.append(plan.to_json())
    # Nothing fits: the first rank's error, raised on every rank (none left waiting).
    with pytest.raises(PlanInfeasibleError, match="smallest memory limit that fits") as e:
        px.plan(model, memory_limit="1MiB", profile=prof, tensor_parallel=sharding, **kw)
    assert e.value.min_memory_limit[0] > 2**20
    # profile= on the first rank only: a ValueError on every rank, no rank waiting for tp peers
    # that do not profile.
    one = prof if rank == 0 else None
    with pytest.raises(
        ValueError, match=r"given on tp ranks \[0\] of the first stage but not on \[1\]"
    ):
        px.plan(model, memory_limit="1GiB", profile=one, tensor_parallel=sharding, **kw)
    return plans, prof.layers[0].static_bytes if prof is not None else None


def _layer_bytes_under_tp(model, pipe) -> tuple[int, int]:
    """What this rank holds of layer 0's parameters (the pipeline's local shards), and what it
    should: half of each sharded projection and the whole (replicated) norms."""
    from pippy_xla.runtime.data_parallel import local_tensor

    held = sum(
        local_tensor(p).numel() * p.element_size()
        for name, p in pipe.named_parameters()
        if name.startswith("model.layers.0.")
    )
    layer = model.model.layers[0]
    want = sum(
        p.numel() * p.element_size() // (2 if name.endswith("_proj.weight") else 1)
        for name, p in layer.named_parameters()
    )
    return held, want


def _run_plan_under_tp(rank, world, plan_jsons, seq):
    """The plans on pp=2 x tp=2: each one's measured peak on a meta-built pipeline (as
    :func:`_measured_peaks`), then the first one's two AdamW steps on a real pipeline against one
    process (loss and every gradient); and (pp=0 ranks) layer 0's bytes held and expected."""
    import gc

    from test_pipeline import check_grads
    from test_tensor_parallel import GRAD_TOL as TP_GRAD_TOL
    from test_tensor_parallel import _mesh

    from pippy_xla import _C

    _C.memory_tracker_install()
    plans = [px.Plan.from_json(p) for p in plan_jsons]
    tp = {"mesh": _mesh(1, 2, 2), "tensor_parallel": "auto"}
    peaks = []
    for plan in plans:
        peaks.append(_measured_peak(plan, seq, **tp))
        gc.collect()
    torch.manual_seed(0)
    model, layer_cls = _activation_heavy_llama()
    ref = copy.deepcopy(model)
    pipe = px.PipelineModel(model, layer_cls=layer_cls, plan=plans[0], timeout=60, **tp)
    held = _layer_bytes_under_tp(ref, pipe) if rank < 2 else None
    opt = torch.optim.AdamW(pipe.parameters())
    ref_opt = torch.optim.AdamW(ref.parameters())
    for step in range(2):
        batch = make_batch(seed=step)
        loss = pipe.run_train(**batch)
        ref_loss = ref(**batch, use_cache=False).loss
        ref_loss.backward()
        where = f"rank {rank} step {step}"
        torch.testing.assert_close(loss, ref_loss.detach(), **LOSS_TOL, msg=where)
        check_grads(pipe.named_parameters(), ref, where, TP_GRAD_TOL)
        for o in (opt, ref_opt):
            o.step()
            o.zero_grad()
    return peaks, held


def test_a_plan_under_tensor_parallelism_predicts_its_peak_and_trains_like_one_process():
    """pp=2 x tp=2 on 4 ranks: the first rank's plans are every rank's; a decoder layer's
    profiled static bytes are 4x (parameters, gradients, AdamW) what a rank holds of it, half of
    each projection and the whole norms; under 1F1B and ZB-H1 each rank's measured peak is under
    the limit and within 10% of the prediction (as without tp); training with the 1F1B plan
    equals one process. Planned and run in separate ranks, as a job would (plan once, train
    many times)."""
    seq = 128
    planned = run_ranks(4, _plan_under_tp, seq)
    plans = [px.Plan.from_json(p) for p in planned[0][0]]
    assert all([px.Plan.from_json(p) for p in other] == plans for other, _ in planned)
    assert [p.schedule for p in plans] == list(TP_SCHEDULES)
    out = run_ranks(4, _run_plan_under_tp, [p.to_json() for p in plans], seq, timeout=300)
    for i, plan in enumerate(plans):
        print(plan.table())
        assert plan.tp_size == 2 and "per tp rank of 2" in plan.table()
        for rank, (peaks, _) in enumerate(out):
            st = plan.stages[rank // 2]  # ranks 0, 1: pp=0; 2, 3: pp=1
            where = f"{plan.schedule} rank {rank} {plan.layer_ranges} {plan.checkpoint_layers}"
            print(f"{where}: predicted {st.memory_bytes} measured {peaks[i]}")
            assert st.memory_bytes <= st.memory_limit, where
            assert peaks[i] <= st.memory_limit, (where, peaks[i])
            assert abs(peaks[i] - st.memory_bytes) <= 0.10 * st.memory_bytes, (where, peaks[i])
    for rank in (0, 1):  # pp=0: profiled layer 0, holds its shards
        got, want = out[rank][1]
        assert got == want and planned[rank][1] == 4 * got, (rank, got, want, planned[rank][1])


_TP_FAMILIES = {
    "qwen3": lambda: tiny("qwen3", layers=2),  # per-head q/k norms: replicated over tp
    "mixtral": lambda: MODELS["mixtral"](),  # experts sharded, router replicated
}


def _profiled_and_held_under_tp(rank, world):
    """tp=2 (one stage): per family, layer 0's profiled static bytes of a meta-built model and of
    a real one, what the pipeline's rank holds of layer 0's parameters, and what it should (half
    of each sharded projection, the rest whole)."""
    from test_tensor_parallel import _is_proj, _mesh

    from pippy_xla.runtime.data_parallel import local_tensor

    mesh = _mesh(1, 1, 2)
    sharding = px.LayerSharding(mesh, timeout=60)
    out = {}
    for family, build in _TP_FAMILIES.items():
        torch.manual_seed(0)
        model, layer_cls = build()
        with torch.device("meta"):
            meta, _ = build()
        kw = dict(microbatch_size=2, seq_len=16, repeats=1, tensor_parallel=sharding)
        profiles = [profile_model(m, layer_cls, **kw) for m in (meta, model)]
        static = [p.layers[0].static_bytes for p in profiles]
        # The prologue (the embedding): sharded by the vocabulary where untied (Mixtral), its
        # gradient whole as the step holds it; whole where the head shares it (Qwen3).
        whole = model.get_input_embeddings().weight
        tied = model.get_output_embeddings().weight is whole
        shard = whole.numel() * whole.element_size() // (1 if tied else 2)
        prologue = [p.prologue.static_bytes for p in profiles]
        assert prologue == [3 * shard + shard * (1 if tied else 2)] * 2, (family, prologue, shard)
        want = sum(
            p.numel() * p.element_size() // (2 if _is_proj(name) else 1)
            for name, p in model.named_parameters()
            if name.startswith("model.layers.0.")
        )
        pipe = px.PipelineModel(
            model, layer_cls=layer_cls, num_microbatches=2, mesh=mesh, tensor_parallel="auto"
        )
        held = sum(
            local_tensor(p).numel() * p.element_size()
            for name, p in pipe.named_parameters()
            if name.startswith("model.layers.0.")
        )
        out[family] = (*static, held, want)
    return out


def test_a_layer_profiled_under_tp_costs_a_ranks_share():
    """Qwen3 and Mixtral at tp=2: a decoder layer's profiled static bytes, meta-built or real,
    are 4x (parameters, gradients, AdamW) what a rank of the pipeline holds of it: half of each
    sharded projection (experts included), the rest (norms, router) whole; the prologue's are
    the embedding's: half of it 3x and its whole gradient where it is sharded (untied)."""
    out = run_ranks(2, _profiled_and_held_under_tp)
    for rank, per_family in enumerate(out):
        for family, (meta, real, held, want) in per_family.items():
            assert meta == real == 4 * held and held == want, (rank, family, meta, real, held, want)


def _expert_heavy_mixtral(layers: int = 4):
    """A Mixtral whose experts are most of its decoder layers' bytes (8 of 256 each, 2 per
    token), the router's loss off."""
    from transformers import MixtralConfig, MixtralForCausalLM

    cfg = MixtralConfig(
        vocab_size=512,
        hidden_size=64,
        intermediate_size=256,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_local_experts=8,
        num_experts_per_tok=2,
        router_jitter_noise=0.0,
    )
    return MixtralForCausalLM(cfg)


def _plan_and_run_under_ep(rank, world, seq):
    """dp=2 x pp=2 with ``expert_parallel=2`` on a meta-built Mixtral: stage 0's two replicas
    profile together (each layer's experts sharded over them), the first rank's 1F1B plan is
    every rank's; then the plan's pipeline trains a step (a replica's 4 rows in 2 microbatches)
    after a warm-up step and AdamW step; a pipeline without expert parallelism refuses the plan.
    Returns the plan, this rank's measured peak, and (stage 0) layer 0's profiled static bytes
    and what the pipeline holds of layer 0."""
    import gc

    from torch.distributed.device_mesh import init_device_mesh

    from pippy_xla import _C
    from pippy_xla.runtime.data_parallel import local_tensor

    _C.memory_tracker_install()
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "pp"))
    sharding = px.ExpertSharding(mesh, 2, timeout=60)
    assert sharding.profiles == (rank in (0, 2)) and sharding.first_rank == 0
    with torch.device("meta"):
        model = _expert_heavy_mixtral()
    kw = dict(num_stages=2, num_microbatches=2, batch_size=4, seq_len=seq, schedule="1f1b")
    prof = None
    if sharding.profiles:
        prof = profile_model(
            model, None, microbatch_size=2, seq_len=seq, repeats=1, tensor_parallel=sharding
        )
    plan = px.plan(model, memory_limit=2**40, profile=prof, expert_parallel=sharding, **kw)
    profiled = prof.layers[0].static_bytes if prof is not None else None
    del prof
    gc.collect()
    pipe = px.PipelineModel(model, plan=plan, mesh=mesh, expert_parallel=2, timeout=60)
    held = sum(local_tensor(p).numel() * 4 for n, p in pipe.named_parameters() if ".0." in n)
    opt = torch.optim.AdamW(pipe.parameters())
    ids = torch.randint(0, 512, (8, seq), generator=torch.Generator().manual_seed(0))
    pipe.run_train(input_ids=ids, labels=ids)
    opt.step()
    _C.memory_reset_peak()
    pipe.run_train(input_ids=ids, labels=ids)
    peak = _C.memory_stats().peak_bytes
    with torch.device("meta"):
        other = _expert_heavy_mixtral()
    with pytest.raises(ValueError, match=r"made for expert_parallel=2 but .* expert_parallel=1"):
        px.PipelineModel(other, plan=plan, mesh=mesh, timeout=60)
    return plan.to_json(), peak, profiled, held


def test_a_plan_under_expert_parallelism_predicts_its_peak():
    """The planner under expert parallelism (``px.ExpertSharding``) on 4 ranks: a MoE layer's
    profiled static bytes are 4x (parameters, gradients, AdamW) what a rank of the pipeline
    holds of it, half of its experts and the rest whole; per stage, the busier expert rank's
    measured peak (the router favours some experts: the plan is the busiest rank's) is within
    10% of the prediction, as without experts, and no rank is more than 10% over it."""
    seq = 64
    out = run_ranks(4, _plan_and_run_under_ep, seq, timeout=300)
    plans = [px.Plan.from_json(p) for p, *_ in out]
    assert all(p == plans[0] for p in plans)
    plan = plans[0]
    print(plan.table())
    assert plan.ep_size == 2 and "experts over 2 ranks" in plan.table()
    for stage, st in enumerate(plan.stages):
        peaks = [out[rank][1] for rank in (stage, stage + 2)]  # (dp, pp) mesh: its replicas
        print(f"stage {stage}: predicted {st.memory_bytes} measured {peaks}")
        assert abs(max(peaks) - st.memory_bytes) <= 0.10 * st.memory_bytes, (stage, peaks, st)
        assert max(peaks) <= 1.10 * st.memory_bytes, (stage, peaks, st)
    for rank in (0, 2):
        _, _, profiled, held = out[rank]
        assert profiled == 4 * held, (rank, profiled, held)
    whole = _expert_heavy_mixtral(1)
    experts = sum(p.numel() for n, p in whole.named_parameters() if ".experts." in n)
    dense = sum(p.numel() for n, p in whole.model.layers[0].named_parameters()) - experts
    assert out[0][3] == 4 * (dense + experts // 2), (out[0][3], dense, experts)
