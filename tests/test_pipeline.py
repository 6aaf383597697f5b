"""End-to-end: PipelineModel on 2 and 4 gloo ranks against a single-process reference."""

from __future__ import annotations

import copy

import pytest
import torch
from models import MODELS, make_batch

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


def _check_grads(pipe, ref, where):
    n = 0
    for name, p in pipe.named_parameters():
        ref_p = ref.get_parameter(name)
        assert p.grad is not None, f"{where}: {name} got no gradient"
        torch.testing.assert_close(
            p.grad, ref_p.grad, **GRAD_TOL, msg=lambda m, name=name: f"{where}: grad {name}\n{m}"
        )
        n += 1
    assert n > 0


def _train_equal(rank, world, family, schedule, mb_counts, steps=3, layers=4):
    """Per step: loss and every local gradient equal the reference's; after AdamW steps the
    parameters still match. Returns what each rank checked, for the parent to assert on."""
    checked = []
    for mbs in mb_counts:
        model, layer_cls = _build(family, layers=layers)
        ref = copy.deepcopy(model)
        pipe = px.PipelineModel(
            model, layer_cls=layer_cls, num_microbatches=mbs, schedule=schedule, timeout=60
        )
        opt = torch.optim.AdamW(pipe.parameters(), **ADAM)
        ref_opt = torch.optim.AdamW(ref.parameters(), **ADAM)
        for step in range(steps):
            batch = make_batch(seed=step)
            loss = pipe.run_train(**batch)
            ref_loss = ref(**batch, use_cache=False).loss
            ref_loss.backward()
            where = f"{family} {schedule} ranks={world} mbs={mbs} step={step} rank={rank}"
            torch.testing.assert_close(loss, ref_loss.detach(), **LOSS_TOL, msg=where)
            _check_grads(pipe, ref, where)
            assert pipe.stash_live_bytes == 0, where
            opt.step()
            ref_opt.step()
            opt.zero_grad()
            ref_opt.zero_grad()
            for name, p in pipe.named_parameters():
                torch.testing.assert_close(
                    p,
                    ref.get_parameter(name),
                    **PARAM_TOL,
                    msg=lambda m, name=name, where=where: f"{where}: param {name}\n{m}",
                )
        checked.append((mbs, sorted(n for n, _ in pipe.named_parameters())))
    return checked


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


def _schedules_equal(rank, world, schedule):
    # Both families in one process group (one spawn); 8 layers so 4 ranks x 2 chunks fit.
    for family in ("llama", "gpt2"):
        _train_equal(rank, world, family, schedule, [world, 2 * world], 2, 8)


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("schedule", ["interleaved", "zbh1"])
def test_interleaved_and_zero_bubble_match_single_process(schedule, world):
    run_ranks(world, _schedules_equal, schedule)


def _saved_peak_and_hooks(rank, world, schedule):
    """Peak bytes autograd keeps saved on this rank during one step, and how often each
    parameter's post-accumulate-grad hook ran."""
    model, layer_cls = _build("llama")
    pipe = px.PipelineModel(model, layer_cls=layer_cls, num_microbatches=8, schedule=schedule)
    live, peak = [0], [0]

    class Saved:
        def __init__(self, t):
            # Detached: holding a saved output itself would tie it to its own grad_fn in a
            # cycle that outlives the graph.
            self.t, self.n = t.detach(), t.untyped_storage().nbytes()
            live[0] += self.n
            peak[0] = max(peak[0], live[0])

        def __del__(self):
            live[0] -= self.n

    params = {id(p) for p in pipe.parameters()}
    calls = {name: 0 for name, _ in pipe.named_parameters()}
    for name, p in pipe.named_parameters():
        p.register_post_accumulate_grad_hook(lambda _, n=name: calls.__setitem__(n, calls[n] + 1))
    hooks = torch.autograd.graph.saved_tensors_hooks(
        lambda t: t if id(t) in params else Saved(t), lambda s: s if torch.is_tensor(s) else s.t
    )
    with hooks:
        pipe.run_train(**make_batch(seed=0))
    assert live[0] == 0  # everything autograd saved is freed by the end of the step
    return peak[0], set(calls.values())


def test_split_backward_accumulates_like_backward_and_frees_what_it_saved():
    # [Note: split backward]: W is an ordinary autograd run into the parameters, so their
    # post-accumulate-grad hooks run once per microbatch (as with 1F1B and GPipe), and nothing
    # autograd saved outlives the step. Zero bubble holds at most p + 1 microbatches of weight
    # GEMM inputs on the last rank, well under GPipe's all-microbatch peak.
    zb = run_ranks(2, _saved_peak_and_hooks, "zbh1")
    gpipe = run_ranks(2, _saved_peak_and_hooks, "gpipe")
    assert zb[1][0] < 0.6 * gpipe[1][0], (zb, gpipe)
    for _, calls in zb + gpipe:
        assert calls == {8}


def test_gpipe_and_third_family():
    # Nothing is special-cased for Llama / GPT-2: Qwen2 with sliding-window layers, and GPipe.
    run_ranks(2, _train_equal, "qwen2", "gpipe", [2], 2)
    run_ranks(2, _train_equal, "llama", "gpipe", [4], 2)


def _bf16(rank, world):
    model, layer_cls = _build("llama")
    model = model.to(torch.bfloat16)
    ref = copy.deepcopy(model)
    pipe = px.PipelineModel(model, layer_cls=layer_cls, num_microbatches=4, timeout=60)
    opt = torch.optim.AdamW(pipe.parameters(), **ADAM)
    ref_opt = torch.optim.AdamW(ref.parameters(), **ADAM)
    losses = []
    for step in range(3):
        batch = make_batch(seed=step)
        loss = pipe.run_train(**batch)
        ref_loss = ref(**batch, use_cache=False).loss
        ref_loss.backward()
        # bf16 has 8 mantissa bits: per-microbatch vs whole-batch rounding differs by ~1e-2.
        torch.testing.assert_close(loss, ref_loss.detach().float(), rtol=2e-2, atol=2e-2)
        for p in pipe.parameters():
            assert p.dtype == torch.bfloat16 and torch.isfinite(p.grad).all()
        opt.step()
        ref_opt.step()
        opt.zero_grad()
        ref_opt.zero_grad()
        losses.append(float(loss))
    return losses


def test_bf16_trains_close_to_single_process():
    out = run_ranks(2, _bf16)
    assert out[0] == out[1]  # the loss is the same on every rank


def _eval(rank, world):
    model, layer_cls = _build("gpt2")
    ref = copy.deepcopy(model).eval()
    pipe = px.PipelineModel(model, layer_cls=layer_cls, num_microbatches=2, timeout=60).eval()
    batch = make_batch(seed=5)
    out = pipe.run_eval(**batch)
    with torch.no_grad():
        ref_out = ref(**batch, use_cache=False)
    torch.testing.assert_close(out.loss, ref_out.loss, **LOSS_TOL)
    if pipe.is_last:
        torch.testing.assert_close(out.logits, ref_out.logits, rtol=1e-5, atol=1e-5)
    else:
        assert out.logits is None
    without_labels = pipe.run_eval(input_ids=batch["input_ids"])
    assert without_labels.loss is None
    return float(out.loss)


def test_run_eval_matches_single_process():
    out = run_ranks(2, _eval)
    assert out[0] == out[1]


def _timeline(rank, world, out_dir):
    model, layer_cls = _build("llama")
    pipe = px.PipelineModel(model, layer_cls=layer_cls, num_microbatches=4, schedule="zbh1")
    pipe.run_train(**make_batch(seed=0))
    events = pipe.timeline(f"{out_dir}/trace.json", f"{out_dir}/timeline.png")
    return events


def test_timeline_merges_ranks_into_trace_and_chart(tmp_path):
    import json

    events = run_ranks(2, _timeline, str(tmp_path))
    assert events[0] == events[1]  # every rank gets the merged timeline
    ops = {(e[0], e[1]) for e in events[0]}
    for rank in (0, 1):
        assert {(rank, "F"), (rank, "B"), (rank, "W")} <= ops
    assert all(e[5] >= e[4] for e in events[0])
    trace = json.loads((tmp_path / "trace.json").read_text())["traceEvents"]
    spans = [t for t in trace if t["ph"] == "X"]
    assert len(spans) == len(events[0]) and {t["pid"] for t in spans} == {0, 1}
    assert (tmp_path / "timeline.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def _meta_load(rank, world, family):
    ref, layer_cls = _build(family)
    with torch.device("meta"):
        model, _ = MODELS[family]()
    pipe = px.PipelineModel(model, layer_cls=layer_cls, num_microbatches=2, timeout=60)
    for _, p in pipe.named_parameters():
        assert p.device.type == "cpu" and torch.isfinite(p).all()
    # Materialized locally only: this rank holds no parameter of the other stage's layers.
    other = 1 - rank
    assert not any(
        f".{i}." in n for n, _ in pipe.named_parameters() for i in pipe.layers_of_stage(other)
    )
    pipe.load_state_dict(ref.state_dict())
    batch = make_batch(seed=1)
    loss = pipe.run_train(**batch)
    ref_loss = ref(**batch, use_cache=False).loss
    ref_loss.backward()
    torch.testing.assert_close(loss, ref_loss.detach(), **LOSS_TOL)
    _check_grads(pipe, ref, f"meta {family} rank {rank}")
    # A missing or mis-shaped key of this stage is an error naming the key (a layer's key: a
    # tied weight may legitimately be found under its alias).
    layer = pipe.layers_of_stage(rank)[0]
    mine = next(k for k in pipe.state_dict() if f".{layer}." in k)
    sd = dict(ref.state_dict())
    del sd[mine]
    with pytest.raises(KeyError, match=mine.replace(".", r"\.")):
        pipe.load_state_dict(sd)
    sd = dict(ref.state_dict())
    sd[mine] = torch.zeros(3)
    with pytest.raises(ValueError, match=mine.replace(".", r"\.")):
        pipe.load_state_dict(sd)
    with pytest.raises(KeyError, match="no stage"):
        pipe.load_state_dict({**ref.state_dict(), "bogus.weight": torch.zeros(1)})
    return sorted(pipe.state_dict())


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_meta_model_loads_reference_state_dict_and_trains_equal(family):
    out = run_ranks(2, _meta_load, family)
    ref, _ = _build(family)
    # Together the ranks' state dicts cover the full model's state dict.
    assert set(ref.state_dict()) <= set(out[0]) | set(out[1])


def _two_pipelines(rank, world):
    # Data parallelism composes: 4 ranks form two independent 2-stage pipelines over subgroups.
    import torch.distributed as dist

    groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    group = groups[rank // 2]
    model, layer_cls = _build("gpt2")
    ref = copy.deepcopy(model)
    pipe = px.PipelineModel(model, layer_cls=layer_cls, num_microbatches=2, group=group, timeout=60)
    batch = make_batch(seed=rank // 2)  # each pipeline gets its own data
    loss = pipe.run_train(**batch)
    ref_loss = ref(**batch, use_cache=False).loss
    ref_loss.backward()
    torch.testing.assert_close(loss, ref_loss.detach(), **LOSS_TOL)
    _check_grads(pipe, ref, f"subgroup rank {rank}")
    return pipe.rank, float(loss)


def test_pipeline_on_a_subgroup():
    out = run_ranks(4, _two_pipelines)
    assert [r for r, _ in out] == [0, 1, 0, 1]
    assert out[0][1] == out[1][1] and out[2][1] == out[3][1] and out[0][1] != out[2][1]
