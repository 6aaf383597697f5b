"""Checkpoints: HF safetensors loaded and written stage by stage, distributed checkpoints that
resume exactly, reshard, and survive a rank killed while saving."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch
from models import INPUT_NAMES, MODELS, family_batch, make_batch, warmup_cosine

import pippy_xla as px
from pippy_xla.checkpoint import latest_checkpoint, load_into_module
from pippy_xla.runtime._ties import tied_names
from pippy_xla.split.hf import checkpoint_key_renamer
from pippy_xla.testing import run_ranks

# fp32; see test_pipeline.py for why these tolerances.
LOSS_TOL = {"rtol": 1e-5, "atol": 1e-6}
ADAM = {"lr": 1e-3, "eps": 1e-6}


def _hf_reference(family, seed=0):
    torch.manual_seed(seed)
    model, _ = MODELS[family]()
    return model


def _meta_pipe(family, **kw):
    with torch.device("meta"):
        model, layer_cls = MODELS[family]()
    kw.setdefault("input_names", INPUT_NAMES.get(family, ("input_ids", "attention_mask")))
    return px.PipelineModel(model, layer_cls=layer_cls, timeout=60, **kw)


# ----------------------------------------------------------------------------- HF safetensors


def _load_and_compare(rank, world, family, path):
    pipe = _meta_pipe(family, num_microbatches=2)
    pipe.load_pretrained(path)
    batch = family_batch(family, seed=3)
    out = pipe.run_eval(**batch)
    if pipe.is_last:
        with torch.device("meta"):
            cls = type(MODELS[family]()[0])
        hf = cls.from_pretrained(path)
        ref = hf(**batch, use_cache=False)
        torch.testing.assert_close(out.logits, ref.logits, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(out.loss, ref.loss, **LOSS_TOL)
    return sorted(pipe.state_dict())


@pytest.mark.parametrize(
    ("family", "world"), [("llama", 2), ("llama", 4), ("gpt2", 2), ("gpt2", 4), ("llava", 2)]
)
def test_load_pretrained_from_hf_shards_equals_from_pretrained(tmp_path, family, world):
    # Llava is saved in HF's older layout (language_model.model.*): its keys are renamed as
    # from_pretrained renames them.
    model = _hf_reference(family)
    model.save_pretrained(tmp_path, max_shard_size="40KB")
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 2  # really several shards
    out = run_ranks(world, _load_and_compare, family, str(tmp_path))
    # Every rank read only its own stage; together they cover the checkpoint.
    rename = checkpoint_key_renamer(model) or str
    assert {rename(k) for k in index["weight_map"]} <= set().union(*map(set, out))
    assert all(len(names) < len(index["weight_map"]) for names in out)


def _load_experts(rank, world, family, path):
    pipe = _meta_pipe(family, num_microbatches=2)
    pipe.load_pretrained(path)
    with torch.device("meta"):
        cls = type(MODELS[family]()[0])
    hf = cls.from_pretrained(path).state_dict()
    for name, t in pipe.state_dict().items():
        assert torch.equal(t, hf[name]), name
    return sorted(pipe.state_dict())


@pytest.mark.compat
@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe"])
def test_load_pretrained_merges_experts_as_from_pretrained(tmp_path, family):
    # HF keeps an MoE's experts fused in memory (experts.gate_up_proj, [E, 2I, H]) but writes a
    # key per expert (experts.0.w1.weight), as checkpoints on the Hub hold them: the pipeline
    # merges them with HF's own converters, across shard files.
    from safetensors import safe_open

    model = _hf_reference(family)
    model.save_pretrained(tmp_path, max_shard_size="40KB")
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    keys = set(index["weight_map"])
    assert any(".experts.3." in k for k in keys) and not any(".experts.gate" in k for k in keys)
    files = {f for k, f in index["weight_map"].items() if ".layers.0." in k and ".experts." in k}
    assert len(files) > 1  # one layer's experts in several files
    with safe_open(tmp_path / next(iter(files)), "pt") as f:
        assert any(".experts." in k for k in f.keys())
    out = run_ranks(2, _load_experts, family, str(tmp_path))
    fused = {k for k in model.state_dict() if k.endswith(".experts.gate_up_proj")}
    assert fused and fused <= set().union(*map(set, out))


def _bad_experts(rank, world, paths):
    pipe = _meta_pipe("mixtral", num_microbatches=2)
    before = {k: v.clone() for k, v in pipe.state_dict().items()}
    errors = {}
    for what, path in paths.items():
        with pytest.raises(ValueError) as e:
            pipe.load_pretrained(path)
        errors[what] = str(e.value)
        assert all(torch.equal(v, before[k]) for k, v in pipe.state_dict().items()), what
    return errors


@pytest.mark.compat
def test_load_pretrained_refuses_experts_that_do_not_merge(tmp_path):
    # An expert missing or mis-shaped: HF's conversion (run on meta tensors while checking)
    # does not make the model's shape, and nothing is loaded on any rank.
    from safetensors.torch import load_file, save_file

    _hf_reference("mixtral").save_pretrained(tmp_path / "hf")
    sd = load_file(tmp_path / "hf" / "model.safetensors")
    paths = {}
    for what in ("missing", "shape"):
        bad = dict(sd)
        if what == "missing":
            del bad["model.layers.3.block_sparse_moe.experts.2.w2.weight"]  # rank 1's stage
        else:
            bad["model.layers.0.block_sparse_moe.experts.1.w1.weight"] = torch.zeros(3, 64)
        (tmp_path / what).mkdir()
        save_file(bad, str(tmp_path / what / "model.safetensors"), metadata={"format": "pt"})
        paths[what] = str(tmp_path / what)
    out = run_ranks(2, _bad_experts, paths)
    assert "'model.layers.3.mlp.experts.down_proj' has shape (3, 64, 64)" in out[1]["missing"]
    assert "nothing loaded: rank 1 of the pipeline" in out[0]["missing"]
    assert (
        "cannot convert 8 checkpoint key(s) into 'model.layers.0.mlp.experts.gate_up_proj'"
        in (out[0]["shape"])
    )
    assert "nothing loaded: rank 0 of the pipeline" in out[1]["shape"]


def _bad_checkpoints(rank, world, paths):
    pipe = _meta_pipe("llama", num_microbatches=2)
    before = {k: v.clone() for k, v in pipe.state_dict().items()}
    errors = {}
    for what, path in paths.items():
        try:
            pipe.load_pretrained(path)
            errors[what] = "loaded"
        except (KeyError, ValueError, FileNotFoundError) as e:
            errors[what] = f"{type(e).__name__}: {e}"
        # Nothing half-loaded: a refused checkpoint wrote no tensor on any rank.
        assert all(torch.equal(v, before[k]) for k, v in pipe.state_dict().items()), what
    return errors


def test_load_pretrained_errors_name_key_and_file(tmp_path):
    from safetensors.torch import save_file

    sd = {k: v.contiguous() for k, v in _hf_reference("llama").state_dict().items()}
    paths = {}
    for what in ("missing", "unexpected", "shape", "truncated"):
        d = tmp_path / what
        d.mkdir()
        bad = dict(sd)
        if what == "missing":
            del bad["model.layers.3.mlp.up_proj.weight"]  # a tensor of rank 1's stage
        elif what == "unexpected":
            bad["model.layers.9.mlp.up_proj.weight"] = torch.zeros(2)
        else:
            bad["model.layers.0.mlp.up_proj.weight"] = torch.zeros(3, 3)
        save_file(bad, str(d / "model.safetensors"), metadata={"format": "pt"})
        if what == "truncated":  # a copy cut short (a full disk, an interrupted download)
            with open(d / "model.safetensors", "r+b") as f:
                f.truncate((d / "model.safetensors").stat().st_size - 4096)
        paths[what] = str(d)
    paths["empty"] = str(tmp_path)
    out = run_ranks(2, _bad_checkpoints, paths)
    # The rank whose stage holds the missing tensor names it; the other refuses too, naming it.
    for rank in (0, 1):
        assert out[rank]["missing"].startswith("KeyError"), out[rank]["missing"]
        assert "no tensor 'model.layers.3.mlp.up_proj.weight'" in out[rank]["missing"]
        assert "model.safetensors" in out[rank]["missing"]
        assert (
            "cannot read" in out[rank]["truncated"]
            and "model.safetensors" in (out[rank]["truncated"])
        )
    assert "nothing loaded: rank 1 of the pipeline" in out[0]["missing"]
    assert "nothing loaded: rank 0 of the pipeline" in out[1]["shape"]
    for rank in (0, 1):
        assert (
            "'model.layers.9.mlp.up_proj.weight' (in model.safetensors)" in out[rank]["unexpected"]
        )
        assert "neither" in out[rank]["empty"]
    assert (
        "'model.layers.0.mlp.up_proj.weight' in model.safetensors has shape (3, 3)"
        in out[0]["shape"]
    )


def _train_and_export(rank, world, family, path):
    torch.manual_seed(0)
    model, layer_cls = MODELS[family]()
    pipe = px.PipelineModel(model, layer_cls=layer_cls, num_microbatches=2, timeout=60)
    opt = torch.optim.AdamW(pipe.parameters(), **ADAM)
    for step in range(2):
        pipe.run_train(**make_batch(seed=step))
        opt.step()
        opt.zero_grad()
    pipe.save_pretrained(path, max_shard_size="40KB")
    out = pipe.run_eval(**make_batch(seed=5))
    return None if out.logits is None else out.logits.numpy()


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_save_pretrained_round_trips_through_from_pretrained(tmp_path, family):
    from transformers import AutoModelForCausalLM

    logits = run_ranks(2, _train_and_export, family, str(tmp_path))[1]
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    files = set(index["weight_map"].values())
    assert files == {p.name for p in tmp_path.glob("model-*.safetensors")} and len(files) > 2
    hf = AutoModelForCausalLM.from_pretrained(tmp_path)
    # Everything HF expects is there (a tied head is stored once, as HF stores it).
    assert set(index["weight_map"]) == set(hf.state_dict()) - {
        k for names in tied_names(hf) for k in names[1:]
    }
    ref = hf(**make_batch(seed=5), use_cache=False).logits
    torch.testing.assert_close(torch.from_numpy(logits), ref, rtol=1e-5, atol=1e-5)


# ----------------------------------------------------------------------------- DCP


def _snapshot(pipe):
    # Plain arrays: tensors sent through the result queue would share memory with a process
    # that has exited.
    return {k: v.detach().numpy().copy() for k, v in pipe.state_dict().items()}


def _train(rank, world, schedule, steps, directory, save_at=None, resume=False, family="gpt2"):
    """Trains ``steps`` (global step numbers) with a warmup + cosine learning rate and returns
    per-step losses and the final local state; saves after step ``save_at``; with ``resume``,
    starts from the latest checkpoint of a model built on meta (everything it trains with,
    the scheduler's position included, comes from the checkpoint)."""
    if resume:
        pipe = _meta_pipe(family, num_microbatches=2, schedule=schedule)
    else:
        torch.manual_seed(0)
        model, layer_cls = MODELS[family]()
        pipe = px.PipelineModel(
            model, layer_cls=layer_cls, num_microbatches=2, schedule=schedule, timeout=60
        )
    opt = torch.optim.AdamW(pipe.parameters(), **ADAM)
    sched = warmup_cosine(opt)
    if resume:
        assert pipe.load(directory, optimizer=opt, scheduler=sched) == steps[0]
    losses = {}
    for step in steps:
        assert sched.last_epoch == step  # the curve continues where the saved run was
        losses[step] = float(pipe.run_train(**make_batch(seed=step)))  # exact: fp32 in a float
        opt.step()
        sched.step()
        opt.zero_grad()
        if step + 1 == save_at:
            pipe.save(directory, optimizer=opt, step=step + 1, scheduler=sched)
    return losses, _snapshot(pipe)


@pytest.fixture(scope="module")
def gpt2_run(tmp_path_factory):
    """Six 1F1B steps of GPT-2 (tied across the 2 ranks), saved after step 3."""
    directory = tmp_path_factory.mktemp("ckpt")
    out = run_ranks(2, _train, "1f1b", list(range(6)), str(directory), 3)
    return directory, out


@pytest.mark.compat
@pytest.mark.parametrize("schedule", ["1f1b", "zbh1"])
def test_resume_is_exact(tmp_path, gpt2_run, schedule):
    if schedule == "1f1b":
        directory, full = gpt2_run
    else:
        directory = tmp_path
        full = run_ranks(2, _train, schedule, list(range(6)), str(directory), 3)
    assert latest_checkpoint(directory) == directory / "step-00000003"
    resumed = run_ranks(2, _train, schedule, [3, 4, 5], str(directory), None, True)
    for rank in range(2):
        for step in (3, 4, 5):
            assert resumed[rank][0][step] == full[rank][0][step], (rank, step)
        assert resumed[rank][1].keys() == full[rank][1].keys()
        for name, value in full[rank][1].items():
            assert (resumed[rank][1][name] == value).all(), (rank, name)


def test_checkpoint_reshards_to_four_ranks_and_another_schedule(gpt2_run):
    directory, full = gpt2_run
    out = run_ranks(4, _train, "gpipe", [3, 4, 5], str(directory), None, True)
    for step in (3, 4, 5):
        assert out[0][0][step] == pytest.approx(full[0][0][step], rel=1e-5, abs=1e-6)


def test_checkpoint_loads_into_a_plain_model(gpt2_run):
    directory, full = gpt2_run
    with torch.device("meta"):
        model, _ = MODELS["gpt2"]()
    model.to_empty(device="cpu")
    model.tie_weights()
    opt = torch.optim.AdamW(model.parameters(), **ADAM)
    sched = warmup_cosine(opt)
    assert load_into_module(model, directory, optimizer=opt, scheduler=sched) == 3
    for step in (3, 4, 5):
        assert sched.last_epoch == step
        loss = model(**make_batch(seed=step), use_cache=False).loss
        loss.backward()
        opt.step()
        sched.step()
        opt.zero_grad()
        assert float(loss) == pytest.approx(full[0][0][step], rel=1e-5, abs=1e-6)
    final = {**full[0][1], **full[1][1]}
    for name, p in model.state_dict().items():
        # AdamW amplifies rounding differences of near-zero gradients; see test_pipeline.py.
        want = torch.from_numpy(final[name])
        torch.testing.assert_close(p, want, rtol=1e-5, atol=2e-5, msg=name)


def _save_then_die(rank, world, directory):
    import torch.distributed.checkpoint.filesystem as fs

    torch.manual_seed(0)
    model, layer_cls = MODELS["llama"]()
    pipe = px.PipelineModel(model, layer_cls=layer_cls, num_microbatches=2, timeout=60)
    opt = torch.optim.AdamW(pipe.parameters(), **ADAM)
    pipe.run_train(**make_batch(seed=0))
    opt.step()
    pipe.save(directory, optimizer=opt, step=1)
    pipe.run_train(**make_batch(seed=1))
    opt.step()
    if rank == 1:
        write_data = fs._FileSystemWriter.write_data

        def die_mid_write(self, plan, planner):
            write_data(self, plan, planner)  # its files are written, the checkpoint is not
            os._exit(1)

        fs._FileSystemWriter.write_data = die_mid_write
    try:
        pipe.save(directory, optimizer=opt, step=2)
    except Exception as e:  # noqa: BLE001
        return type(e).__name__
    return "saved"


def test_save_interrupted_by_a_killed_rank_keeps_the_previous_checkpoint(tmp_path):
    out = run_ranks(2, _save_then_die, str(tmp_path), may_exit=(1,), timeout=180)
    assert out[0] != "saved" and out[1] is None
    assert latest_checkpoint(tmp_path) == tmp_path / "step-00000001"
    assert (tmp_path / ".step-00000002.partial").is_dir()
    assert not (tmp_path / "step-00000002").exists()
    model = _hf_reference("llama", seed=1)
    assert load_into_module(model, tmp_path) == 1


def test_a_checkpoint_without_a_scheduler_refuses_one(gpt2_run, tmp_path):
    directory, _ = gpt2_run
    torch.manual_seed(0)
    model, _ = MODELS["gpt2"]()
    opt = torch.optim.AdamW(model.parameters(), **ADAM)
    load_into_module(model, directory, optimizer=opt, scheduler=warmup_cosine(opt))
    step = tmp_path / "no-scheduler"
    shutil.copytree(latest_checkpoint(directory), step)
    (step / "scheduler.pt").unlink()
    with pytest.raises(FileNotFoundError, match="holds no learning-rate scheduler state"):
        load_into_module(model, step, optimizer=opt, scheduler=warmup_cosine(opt))


def test_no_checkpoint_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="no complete checkpoint"):
        load_into_module(_hf_reference("llama"), Path(tmp_path))


def _load_fresh_or_partly_visible(rank, world, directory):
    torch.manual_seed(0)
    model, layer_cls = MODELS["llama"]()
    pipe = px.PipelineModel(model, layer_cls=layer_cls, num_microbatches=2, timeout=30)
    fresh = Path(directory) / "fresh"
    out = {"fresh": pipe.load(fresh, missing_ok=True)}  # a first run: nothing to resume
    with pytest.raises(FileNotFoundError, match="no complete checkpoint"):
        pipe.load(fresh)
    pipe.save(Path(directory) / "saved", step=3)
    # Rank 1 looks elsewhere (a folder that is not shared): every rank refuses, none hangs.
    mine = Path(directory) / ("saved" if rank == 0 else "elsewhere")
    with pytest.raises(FileNotFoundError, match=r"visible to ranks \[0\] of the 2 ranks"):
        pipe.load(mine, missing_ok=True)
    out["saved"] = pipe.load(Path(directory) / "saved", missing_ok=True)
    return out


def test_missing_ok_resumes_or_starts_fresh_on_every_rank(tmp_path):
    out = run_ranks(2, _load_fresh_or_partly_visible, str(tmp_path), pg_timeout=30)
    assert out == [{"fresh": None, "saved": 3}] * 2


def _refused_checkpoints(rank, world, directory):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model, layer_cls = MODELS["llama"]()
    pipe = px.PipelineModel(model, layer_cls=layer_cls, num_microbatches=2, timeout=30)
    opt = torch.optim.AdamW(pipe.parameters())
    pipe.run_train(**make_batch(seed=0))
    opt.step()
    saved = pipe.save(Path(directory) / "good", optimizer=opt, step=1)
    torch.distributed.barrier()
    if rank == 0:  # a damaged copy: one rank's DCP file deleted, another cut short
        for name, how in (("deleted", "delete"), ("truncated", "truncate")):
            copy = Path(directory) / name
            shutil.copytree(saved, copy)
            victim = sorted(copy.glob("*.distcp"))[-1]
            if how == "delete":
                victim.unlink()
            else:
                with open(victim, "r+b") as f:
                    f.truncate(victim.stat().st_size // 2)
    torch.distributed.barrier()
    pipe.run_train(**make_batch(seed=1))  # the live values now differ from the saved ones
    opt.step()
    before = {k: v.clone() for k, v in pipe.state_dict().items()}
    errors = {}
    for name in ("deleted", "truncated"):
        with pytest.raises(FileNotFoundError) as e:
            pipe.load(Path(directory) / name, optimizer=opt)
        errors[name] = str(e.value)
    # A checkpoint of another configuration (hidden 32, not 64).
    cfg = LlamaConfig(**{**model.config.to_dict(), "hidden_size": 32, "intermediate_size": 64})
    other = px.PipelineModel(
        LlamaForCausalLM(cfg), layer_cls=layer_cls, num_microbatches=2, timeout=30
    )
    with pytest.raises(ValueError) as e:
        other.load(Path(directory) / "good")
    errors["other config"] = str(e.value)
    assert all(torch.equal(v, before[k]) for k, v in pipe.state_dict().items())  # untouched
    return errors


def test_damaged_or_foreign_checkpoints_are_refused_on_every_rank(tmp_path):
    out = run_ranks(2, _refused_checkpoints, str(tmp_path))
    for rank, errors in enumerate(out):
        assert "is damaged: __" in errors["deleted"] and "(missing)" in errors["deleted"], errors
        assert "(truncated)" in errors["truncated"], errors
        assert "nothing was loaded" in errors["deleted"]
        # DCP's error, from the ranks that failed, names the tensor and both sizes.
        assert errors["other config"].startswith(f"[rank {rank}] cannot load"), errors
        assert "rank 0:" in errors["other config"] and "rank 1:" in errors["other config"], errors
        assert "size" in errors["other config"].lower(), errors
