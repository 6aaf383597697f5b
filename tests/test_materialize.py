"""Models built on ``meta``: every local tensor initialized as the model's own initialization
would, checked against HF's own initialization of the same config; no tensor left unwritten;
ties and real tensors kept. See [Note: materialization through the model's own modules]."""

from __future__ import annotations

import contextlib
import io
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from models import INPUT_NAMES, MODELS, VOCAB, family_batch, make_batch
from torch import nn
from transformers.models.llama.modeling_llama import LlamaRMSNorm

import pippy_xla as px
from pippy_xla.split import hf
from pippy_xla.split.materialize import UninitializedTensorError, materialize
from pippy_xla.split.partition import partition
from pippy_xla.testing import run_ranks

ROOT = Path(__file__).resolve().parents[1]

# Random tensors are compared by their statistics: a tiny model's weight matrix has a few thousand
# elements, so its sample mean and std are within a few percent of the distribution's; 30% of
# the reference std tells a right distribution from a wrong one (GPT-2's scaled c_proj init is
# 1/sqrt(2 n_layer) = 0.35x the plain std; garbage or an all-ones norm is off by orders).
STAT_TOL = 0.3
# Small tensors (a linear-attention layer's 4 decay rates, a 32-wide class embedding, a 64-wide
# gate) have sample statistics that wander by about std / sqrt(n): four such standard errors are
# allowed on top.
NOISE_SE = 4


def _local_tensors(pipe: px.PipelineModel) -> dict[str, torch.Tensor]:
    """Every local parameter and buffer (persistent or not) under its original name."""
    out = {}
    for st in pipe.local_stages:
        for stage_name, t in [
            *st.module.named_parameters(remove_duplicate=False),
            *st.module.named_buffers(remove_duplicate=False),
        ]:
            out[st.param_names[stage_name]] = t
    return out


def _compare_to_hf_init(name: str, t: torch.Tensor, ref: torch.Tensor) -> str | None:
    """``None`` if ``t`` looks initialized like ``ref`` (HF's own init of the same config)."""
    exact = not isinstance(ref, nn.Parameter)  # buffers (rotary tables) come from the config
    t, ref = t.detach(), ref.detach()
    if t.shape != ref.shape or t.dtype != ref.dtype:
        return f"{name}: {t.dtype}{list(t.shape)} vs reference {ref.dtype}{list(ref.shape)}"
    if exact or not t.is_floating_point() or ref.numel() < 2 or float(ref.float().std()) == 0.0:
        # Buffers and constant-initialized parameters (norm weights, biases): exactly HF's.
        return None if torch.equal(t, ref) else f"{name}: differs from the constant reference"
    mean, std = float(t.float().mean()), float(t.float().std())
    ref_mean, ref_std = float(ref.float().mean()), float(ref.float().std())
    tol = (STAT_TOL + NOISE_SE / math.sqrt(ref.numel())) * ref_std
    if abs(mean - ref_mean) > tol or abs(std - ref_std) > tol:
        return (
            f"{name}: mean {mean:.4g} std {std:.4g}, "
            f"reference mean {ref_mean:.4g} std {ref_std:.4g}"
        )
    return None


def _meta_init(rank, world, family):
    torch.manual_seed(1)
    ref, layer_cls = MODELS[family]()  # HF's own initialization (from the config)
    ref_tensors = {
        **dict(ref.named_parameters(remove_duplicate=False)),
        **dict(ref.named_buffers(remove_duplicate=False)),
    }
    with torch.device("meta"):
        model, _ = MODELS[family]()
    torch.manual_seed(100 + rank)
    inputs = INPUT_NAMES.get(family, ("input_ids", "attention_mask"))
    pipe = px.PipelineModel(
        model, layer_cls=layer_cls, num_microbatches=2, timeout=60, input_names=inputs
    )
    local = _local_tensors(pipe)
    problems = [
        p for name, t in local.items() if (p := _compare_to_hf_init(name, t, ref_tensors[name]))
    ]
    assert all(t.device.type == "cpu" for t in local.values())
    loss = float(pipe.run_train(**family_batch(family, seed=0)))
    return sorted(local), problems, loss


@pytest.mark.parametrize("family", list(MODELS))
def test_meta_built_model_is_initialized_like_hf(family):
    out = run_ranks(2, _meta_init, family)
    ref, _ = MODELS[family]()
    covered = set(out[0][0]) | set(out[1][0])
    # Together the ranks materialized the whole model (every parameter and buffer).
    assert {n for n, _ in ref.named_parameters()} <= covered
    assert {n for n, _ in ref.named_buffers()} <= covered
    has_rotary = any(hf.is_rotary_module(m) for m in ref.modules())
    assert any("inv_freq" in n for n in covered) == has_rotary  # rotary tables checked
    for rank, (_, problems, _) in enumerate(out):
        assert not problems, f"{family} rank {rank}: " + "; ".join(problems)
    first_loss = out[0][2]
    assert out[1][2] == first_loss
    assert abs(first_loss - math.log(VOCAB)) < 0.2 * math.log(VOCAB), first_loss


def _stages_on_meta(family, ranges, **kw):
    with torch.device("meta"):
        model, layer_cls = MODELS[family](**kw)
    return model, partition(model, layer_cls, ranges)


def test_uninitialized_parameter_is_an_error_naming_it():
    model, stages = _stages_on_meta("llama", [(0, 2), (2, 4)])

    def skip_norms(module):  # a model whose _init_weights forgets its RMSNorms
        if not isinstance(module, LlamaRMSNorm):
            type(model)._init_weights(model, module)

    model._init_weights = skip_norms
    model.model._init_weights = skip_norms
    with pytest.raises(UninitializedTensorError) as e:
        materialize(model, stages[1:], torch.device("cpu"))
    # Stage 1 holds layers 2-3 (two norms each) and the final norm: all five are named.
    msg = str(e.value)
    assert msg.startswith("5 tensor(s)"), msg
    for name in ("model.norm.weight", "model.layers.2.input_layernorm.weight"):
        assert f"'{name}' (a parameter of LlamaRMSNorm: 64 of its 64 elements" in msg, msg


class _Scale(nn.Module):
    """A non-HF module without ``reset_parameters``: nothing can initialize it."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.empty(4))
        self.register_buffer("steps", torch.empty(2, dtype=torch.long))


def test_non_hf_modules_reset_or_fail():
    from pippy_xla.split.partition import StageGraph

    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(4, 4), _Scale())

    def stage(names):
        return StageGraph(
            index=0,
            module=model,
            batch_inputs=[],
            num_boundary_inputs=0,
            num_boundary_outputs=0,
            layers=[],
            param_names={n: n for n in names},
            code="",
        )

    materialize(model, [stage(["0.weight", "0.bias"])], torch.device("cpu"))
    assert torch.isfinite(model[0].weight).all() and float(model[0].weight.detach().std()) > 0
    with pytest.raises(UninitializedTensorError, match=r"'1\.scale' .*_Scale"):
        materialize(model, [stage(["1.scale"])], torch.device("cpu"))
    # An integer buffer cannot hold NaN: one that nothing wrote is found by its version counter.
    with pytest.raises(UninitializedTensorError, match=r"'1\.steps' .*never written"):
        materialize(model, [stage(["1.steps"])], torch.device("cpu"))


def test_tied_weights_stay_one_parameter_on_one_rank():
    # GPT-2 ties lm_head.weight to transformer.wte.weight. Stages 0 and 3 on one rank (as with
    # interleaved stages) and a single stage both keep one Parameter under both names.
    for ranges, local in (([(0, 4)], [0]), ([(0, 1), (1, 2), (2, 3), (3, 4)], [0, 3])):
        model, stages = _stages_on_meta("gpt2", ranges)
        mine = [stages[s] for s in local]
        materialize(model, mine, torch.device("cpu"))
        wte, head = model.transformer.wte.weight, model.lm_head.weight
        assert wte is head and wte.device.type == "cpu" and not torch.isnan(wte).any()
        by_name = {
            st.param_names[n]: p
            for st in mine
            for n, p in st.module.named_parameters(remove_duplicate=False)
        }
        assert by_name["transformer.wte.weight"] is wte
        assert by_name["lm_head.weight"] is wte


def _gpt2_one_rank(rank, world, schedule):
    from models import gpt2

    torch.manual_seed(0)
    ref, layer_cls = gpt2()
    with torch.device("meta"):
        model, _ = gpt2()
    pipe = px.PipelineModel(
        model, layer_cls=layer_cls, num_microbatches=2, schedule=schedule, timeout=60
    )
    local = _local_tensors(pipe)
    assert local["lm_head.weight"] is local["transformer.wte.weight"]
    names = [n for n, _ in pipe.named_parameters()]
    assert "transformer.wte.weight" in names and "lm_head.weight" not in names  # listed once
    # Train equal to the reference once both hold the same values.
    pipe.load_state_dict(ref.state_dict())
    batch = make_batch(seed=2)
    loss = pipe.run_train(**batch)
    ref_loss = ref(**batch, use_cache=False).loss
    ref_loss.backward()
    torch.testing.assert_close(loss, ref_loss.detach(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(
        dict(pipe.named_parameters())["transformer.wte.weight"].grad,
        ref.transformer.wte.weight.grad,
        rtol=1e-5,
        atol=1e-6,
    )
    return len(pipe.local_stages)


@pytest.mark.parametrize("schedule", ["1f1b", "interleaved"])
def test_gpt2_on_one_rank_keeps_its_tie(schedule):
    assert run_ranks(1, _gpt2_one_rank, schedule) == [2 if schedule == "interleaved" else 1]


def _gpt2_interleaved_two_ranks(rank, world):
    import torch.distributed as dist

    with torch.device("meta"):
        model, layer_cls = MODELS["gpt2"]()
    pipe = px.PipelineModel(
        model, layer_cls=layer_cls, num_microbatches=2, schedule="interleaved", timeout=60
    )
    local = _local_tensors(pipe)
    # Stage 0 (wte) is on rank 0, stage 3 (lm_head) on rank 1: two copies kept equal.
    mine = local.get("transformer.wte.weight", local.get("lm_head.weight"))
    everyone = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(everyone, mine.detach().contiguous())
    assert torch.equal(everyone[0], everyone[1]) and not torch.isnan(mine).any()
    return sorted(n for n in local if n in ("transformer.wte.weight", "lm_head.weight"))


def test_gpt2_interleaved_on_two_ranks_starts_tied():
    assert run_ranks(2, _gpt2_interleaved_two_ranks) == [
        ["transformer.wte.weight"],
        ["lm_head.weight"],
    ]


def test_partly_meta_model_keeps_its_real_tensors():
    torch.manual_seed(0)
    model, layer_cls = MODELS["llama"]()
    model.model.layers[3].to("meta")
    model.model.norm.to("meta")
    real = {
        n: (t, t.detach().clone())
        for n, t in [*model.named_parameters(), *model.named_buffers()]
        if t.device.type != "meta"
    }
    stages = partition(model, layer_cls, [(0, 2), (2, 4)])
    materialize(model, stages, torch.device("cpu"))
    for n, (t, before) in real.items():
        now = model.get_parameter(n) if n in dict(model.named_parameters()) else model.get_buffer(n)
        assert now is t and torch.equal(now, before), n
        assert not getattr(now, "_is_hf_initialized", False), n  # our temporary flag is gone
    assert torch.equal(model.model.norm.weight, torch.ones(64))
    w = model.model.layers[3].mlp.up_proj.weight
    assert w.device.type == "cpu" and abs(float(w.detach().std()) - 0.02) < 0.3 * 0.02


TINY = ("--layers", "2", "--hidden", "64", "--vocab", "128", "--seq", "32", "--lr", "1e-2")


def run_example(ranks: int, *flags: str, cwd: Path = ROOT, script: str = "train_llama.py") -> str:
    """Runs ``examples/<script>`` under torchrun as the README does; returns its stdout."""
    return torchrun(ranks, ROOT / "examples" / script, *flags, cwd=cwd)


def torchrun(
    ranks: int, script: Path, *flags: str, cwd: Path = ROOT, launcher: tuple[str, ...] = ()
) -> str:
    """Runs ``script`` under torchrun on ``ranks`` CPU ranks (``launcher``: torchrun's own
    flags); returns its stdout."""
    cmd = [
        *(sys.executable, "-m", "torch.distributed.run", "--standalone", *launcher),
        *("--nproc-per-node", str(ranks), str(script), *flags),
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env, cwd=cwd)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-4000:]
    return out.stdout


def _example_main(rank: int, world: int, script: str, flags: tuple[str, ...], cwd: str) -> str:
    """``examples/<script>``'s ``main(flags)`` on this rank, in ``cwd``: its stdout."""
    import importlib

    sys.path.insert(0, str(ROOT / "examples"))
    os.chdir(cwd)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        importlib.import_module(Path(script).stem).main(list(flags))
    return out.getvalue()


def run_example_forked(
    ranks: int, *flags: str, cwd: Path = ROOT, script: str = "train_llama.py"
) -> str:
    """What :func:`run_example` prints (rank 0's stdout), from ranks forked from the tests'
    preloaded server instead of a torchrun job: for a run that is only another run's reference,
    without the ranks' interpreter start-ups (importing torch and transformers, some 4
    CPU-seconds a rank)."""
    return run_ranks(ranks, _example_main, script, flags, str(cwd), timeout=300)[0]


def _losses(stdout: str) -> dict[int, float]:
    return {
        int(step): float(loss)
        for step, loss in re.findall(r"^step +(\d+) +loss ([\d.]+)", stdout, re.M)
    }


def test_readme_main_job_learns_saves_resumes_on_four_ranks_and_exports(tmp_path):
    """The README's main job, run as the README runs it (torchrun, 2 ranks), with tiny flags: the
    first loss is near ln(vocab) and the last is below 70% of it. Then the checkpoint commands of
    docs/checkpoints.md: that run saved every 10 steps; a 4-rank run resumes from its step-20
    checkpoint and exports; it continues the 2-rank run's losses and HF loads the export. (One
    run for both: each torchrun launch costs its ranks' imports, some 4 CPU-seconds a rank.)"""
    from transformers import AutoModelForCausalLM

    vocab, tiny = 128, (*TINY, "--layers", "4")  # 4 layers: one per rank on 4 ranks
    flags = ("--steps", "30", "--save-every", "10", "--checkpoint-dir", "ck", *tiny)
    full = _losses(run_example(2, *flags, cwd=tmp_path))
    losses = list(full.values())
    assert sorted(full) == [0, 10, 20, 29], full  # printed every 10 steps, and the last
    assert abs(losses[0] - math.log(vocab)) < 0.2 * math.log(vocab), losses
    assert losses[-1] < 0.7 * losses[0], losses
    assert sorted(p.name for p in (tmp_path / "ck").iterdir()) == [
        "latest",
        "step-00000010",
        "step-00000020",
        "step-00000030",
    ]
    resume = ("--resume", "ck/step-00000020", "--export", "hf")
    out = run_example(4, "--steps", "30", *resume, *tiny, cwd=tmp_path)
    assert "resumed from ck/step-00000020 at step 20" in out
    resumed = _losses(out)
    assert sorted(resumed) == [20, 29], resumed  # it started at step 20
    for step in (20, 29):
        assert resumed[step] == pytest.approx(full[step], rel=1e-4), (step, resumed, full)
    model, info = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    assert model.config.num_hidden_layers == 4


def test_main_job_tunes_a_zero_bubble_schedule():
    """The main job with ``--schedule zbv --tune-after 2``: reordered after step 2 for the costs
    measured in it, and its losses are the published order's to the last bit (each stage's W
    still runs in microbatch order, so every gradient sums in the same order)."""
    flags = ("--steps", "6", *TINY, "--layers", "4", "--schedule", "zbv")  # 4 stages on 2 ranks
    tuned = run_example(2, *flags, "--tune-after", "2")
    assert "step    2  zbv reordered for this step's costs" in tuned
    published = run_example_forked(2, *flags)

    def final(out: str) -> str:
        return re.search(r"^final loss (\S+)$", out, re.M).group(1)

    assert final(tuned) == final(published), (tuned, published)
