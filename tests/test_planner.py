"""Planner: exact solver (against brute force and the ColossalAI #5509 instance), infeasibility
errors, saved-bytes predictions on the tiny models, and plans applied to a 2-rank pipeline."""

from __future__ import annotations

import copy
import itertools
import random

import pytest
import torch
from models import MODELS, make_batch

import pippy_xla as px
from pippy_xla.partition import partition
from pippy_xla.planner import (
    LayerCost,
    PlanInfeasibleError,
    PlanProblem,
    StageExtra,
    evaluate,
    inflight_counts,
    profile_model,
    solve,
)
from pippy_xla.profiler import SavedBytes
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


def _colossal(limit: int) -> PlanProblem:
    # ColossalAI issue #5509, in units of 1/1000: per layer per microbatch activation 1.25,
    # 0.125 checkpointed; time 3 per layer (fwd 1 + bwd 2), +1 (a forward) when checkpointed;
    # 1F1B with 4 stages holds 4/3/2/1 microbatches.
    layer = LayerCost(fwd=1.0, bwd=2.0, saved_bytes=1250, saved_bytes_ckpt=125, static_bytes=0)
    return PlanProblem(
        layers=[layer] * 32,
        extras=[StageExtra() for _ in range(4)],
        inflight=inflight_counts("1f1b", 4, 8),
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
    assert out.bottleneck == 28.0
    assert ckpt == [4, 4, 0, 0] and ranges == [(0, 7), (7, 15), (15, 23), (23, 32)]
    assert all(st.memory <= 20_000 for st in out.stages)


def _transient(extra: StageExtra, layers: list[LayerCost], any_checkpointed: bool) -> int:
    """[Note: planner cost model]: the largest working set, and with checkpointed layers one
    layer's recomputation (the max over the stage's layers)."""
    recompute = max(
        max(0, ly.saved_bytes - ly.saved_bytes_ckpt) + ly.transient_bytes for ly in layers
    )
    return max(
        extra.transient_bytes,
        max(ly.transient_bytes for ly in layers),
        recompute if any_checkpointed else 0,
    )


def _brute(problem: PlanProblem):
    """Every composition into stages and every subset of checkpointed layers."""
    n, S = len(problem.layers), len(problem.memory_limit)
    best, best_excess = float("inf"), None
    for cuts in itertools.combinations(range(1, n), S - 1):
        bounds = [0, *cuts, n]
        for mask in range(1 << n):
            times, excess = [], []
            for s in range(S):
                e = problem.extras[s]
                t, act, stat = e.fwd + e.bwd, e.saved_bytes, e.static_bytes + e.buffer_bytes
                stage = range(bounds[s], bounds[s + 1])
                for k in stage:
                    lay = problem.layers[k]
                    ck = mask >> k & 1
                    t += lay.fwd + lay.bwd + (lay.fwd if ck else 0)
                    act += lay.saved_bytes_ckpt if ck else lay.saved_bytes
                    stat += lay.static_bytes
                layers = [problem.layers[k] for k in stage]
                stat += _transient(e, layers, any(mask >> k & 1 for k in stage))
                times.append(t)
                excess.append(problem.inflight[s] * act + stat - problem.memory_limit[s])
            if best_excess is None or max(excess) < best_excess:
                best_excess = max(excess)
            if max(excess) <= 0:
                best = min(best, max(times))
    return best, best_excess


def _random_problem(rng: random.Random) -> PlanProblem:
    n = rng.randint(1, 8)
    S = rng.randint(1, min(3, n))
    layers = [
        LayerCost(
            fwd=rng.uniform(0.1, 3),
            bwd=rng.uniform(0.1, 5),
            saved_bytes=rng.randint(0, 100),
            saved_bytes_ckpt=rng.randint(0, 40),
            static_bytes=rng.randint(0, 50),
            transient_bytes=rng.choice([0, rng.randint(0, 60)]),
        )
        for _ in range(n)
    ]
    extras = [
        StageExtra(
            fwd=rng.uniform(0, 2),
            bwd=rng.uniform(0, 2),
            saved_bytes=rng.randint(0, 30),
            static_bytes=rng.randint(0, 30),
            transient_bytes=rng.choice([0, rng.randint(0, 80)]),
            buffer_bytes=rng.randint(0, 20),
        )
        for _ in range(S)
    ]
    inflight = [rng.randint(1, 4) for _ in range(S)]
    limits = [rng.randint(50, 900) for _ in range(S)]
    if rng.random() < 0.5:
        limits = [limits[0]] * S
    return PlanProblem(layers=layers, extras=extras, inflight=inflight, memory_limit=limits)


def test_solver_matches_brute_force():
    rng = random.Random(1234)
    feasible = 0
    for _ in range(150):
        problem = _random_problem(rng)
        best, best_excess = _brute(problem)
        if best == float("inf"):
            with pytest.raises(PlanInfeasibleError) as err:
                solve(problem)
            assert err.value.min_memory_limit == [x + best_excess for x in problem.memory_limit]
            continue
        feasible += 1
        out = solve(problem)
        assert out.bottleneck == pytest.approx(best, rel=1e-9)
        # The returned plan is feasible and its objective is what the solver says.
        ranges = [st.range for st in out.stages]
        assert ranges[0][0] == 0 and ranges[-1][1] == len(problem.layers)
        for s, st in enumerate(out.stages):
            assert st.memory <= problem.memory_limit[s]
            lay = problem.layers[st.range[0] : st.range[1]]
            ck = set(st.checkpoint)
            act = problem.extras[s].saved_bytes + sum(
                ly.saved_bytes_ckpt if st.range[0] + i in ck else ly.saved_bytes
                for i, ly in enumerate(lay)
            )
            mem = (
                problem.inflight[s] * act
                + problem.extras[s].static_bytes
                + sum(ly.static_bytes for ly in lay)
                + problem.extras[s].buffer_bytes
                + _transient(problem.extras[s], lay, bool(ck))
            )
            assert mem == st.memory
    assert feasible > 50


def test_infeasible_reports_smallest_limit():
    with pytest.raises(PlanInfeasibleError, match="smallest memory limit that fits") as err:
        solve(_colossal(1_000))
    need = err.value.min_memory_limit[0]
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
        with counter.hooks():
            res = st.module(*[mb[n] for n in st.batch_inputs], *inputs)
            if st.index == len(stages) - 1:
                model.loss_function(
                    logits=res[0], labels=mb["labels"], vocab_size=model.config.vocab_size
                )
        out.append(counter.total())
        boundary = list(res)
    return out


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
    for schedule, mbs in (("gpipe", m), ("1f1b", 2 * m)):  # not what the plan was made for
        with pytest.raises(ValueError) as e:
            px.PipelineModel(
                model, layer_cls=layer_cls, num_microbatches=mbs, schedule=schedule, plan=plan
            )
        assert f"made for schedule '1f1b' with {m} microbatches" in str(e.value)
        assert f"runs '{schedule}' with {mbs}" in str(e.value)
    pipe = px.PipelineModel(
        model, layer_cls=layer_cls, num_microbatches=plan.num_microbatches, plan=plan, timeout=60
    )
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
    """Each plan on its ranks, on a meta-built model: the most live CPU tensor bytes (the
    counting allocator, installed before the model is built) during a training step after a
    warm-up step with an AdamW step (so gradients and optimizer state exist)."""
    import gc

    from pippy_xla import _C

    _C.memory_tracker_install()
    peaks = []
    for plan_json in plan_jsons:
        plan = px.Plan.from_json(plan_json)
        with torch.device("meta"):
            model, layer_cls = _activation_heavy_llama(plan.layer_ranges[-1][1])
        pipe = px.PipelineModel(
            model,
            layer_cls=layer_cls,
            num_microbatches=plan.num_microbatches,
            schedule=plan.schedule,
            plan=plan,
            timeout=60,
        )
        del model
        opt = torch.optim.AdamW(pipe.parameters())
        g = torch.Generator().manual_seed(0)
        ids = torch.randint(0, 2048, (8, seq), generator=g)
        batch = {"input_ids": ids, "labels": ids}
        pipe.run_train(**batch)
        opt.step()
        _C.memory_reset_peak()
        pipe.run_train(**batch)
        peaks.append(_C.memory_stats()["peak_bytes"])
        del pipe, opt
        gc.collect()  # the next plan's peak must not count this one's tensors
    return peaks


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


@pytest.mark.parametrize("ranks,layers", [(2, 4), (4, 8)])
def test_planned_runs_stay_under_random_limits(ranks, layers):
    """For 1F1B and GPipe, 10 random limits each between the smallest feasible limit and the
    unconstrained peak: every planned run's measured peak (each stage) is within 10% of the
    prediction and under its limit."""
    torch.manual_seed(0)
    model, layer_cls = _activation_heavy_llama(layers)
    seq, batch, mbs = 128, 8, 4
    prof = profile_model(model, layer_cls, microbatch_size=batch // mbs, seq_len=seq, repeats=1)
    rng = random.Random(ranks)
    plans = []
    for schedule in ("1f1b", "gpipe"):
        kw = dict(
            layer_cls=layer_cls,
            num_stages=ranks,
            num_microbatches=mbs,
            batch_size=batch,
            seq_len=seq,
            schedule=schedule,
            profile=prof,
        )
        with pytest.raises(PlanInfeasibleError) as info:
            px.plan(model, memory_limit=0, **kw)
        low = info.value.min_memory_limit[0]
        high = max(st.memory_bytes for st in px.plan(model, memory_limit=2**40, **kw).stages)
        assert low < high
        limits = sorted(rng.randint(low, high) for _ in range(10))
        plans += [px.plan(model, memory_limit=limit, **kw) for limit in limits]
    measured = run_ranks(ranks, _measured_peaks, [p.to_json() for p in plans], seq, timeout=600)
    for i, plan in enumerate(plans):
        for st in plan.stages:
            got = measured[st.index][i]
            where = (
                f"{plan.schedule} limit {st.memory_limit} ranges {plan.layer_ranges} "
                f"ckpt {plan.checkpoint_layers} stage {st.index}"
            )
            print(f"{where}: predicted {st.memory_bytes} measured {got}")
            assert st.memory_bytes <= st.memory_limit, where
            assert got <= st.memory_limit, (where, got)
            assert abs(got - st.memory_bytes) <= 0.10 * st.memory_bytes, (where, got)
