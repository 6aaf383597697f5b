"""PEFT adapters in and out of the pipeline (see [Note: PEFT models in the pipeline] in
pippy_xla/integrations/peft.py): training equal to PEFT in one process, the adapter written as
PEFT writes it and loaded by PEFT, the merged export loaded by HF, a meta-built base, errors."""

from __future__ import annotations

import copy
import json

import pytest
import torch
from models import llama, make_batch
from test_pipeline import ADAM, GRAD_TOL, LOSS_TOL, PARAM_TOL

import pippy_xla as px
from pippy_xla.testing import run_ranks

# Each adapter method with the schedule (and checkpointed layers) it is trained under.
METHODS = {
    "lora": ("zbh1", {}),  # zero-bubble: adapters' weight gradients in W
    "dora": ("1f1b", {"checkpoint_layers": [1, 2]}),
    "loha": ("interleaved", {}),
    "ia3": ("1f1b", {}),
}


def _config(method: str):
    from peft import IA3Config, LoHaConfig, LoraConfig

    if method == "lora":
        return LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    if method == "dora":
        return LoraConfig(
            r=4, target_modules=["q_proj", "down_proj"], use_dora=True, init_lora_weights=False
        )
    if method == "loha":
        return LoHaConfig(r=4, target_modules=["q_proj", "o_proj"], init_weights=False)
    return IA3Config(
        target_modules=["k_proj", "down_proj"],
        feedforward_modules=["down_proj"],
        init_ia3_weights=False,
    )


def _same_adapter_files(ours: str, ref, theirs: str, **tol) -> None:
    """``ref`` (the ``PeftModel`` in one process) saved by PEFT to ``theirs`` writes the adapter
    file(s) the pipeline wrote to ``ours``: the same keys (not none), values within ``tol``
    (default: equal), for every adapter (the others in subdirectories)."""
    from safetensors.torch import load_file

    ref.save_pretrained(theirs)
    for name in ref.peft_config:
        sub = "" if name == "default" else f"{name}/"
        mine, peft_own = (load_file(f"{d}/{sub}adapter_model.safetensors") for d in (ours, theirs))
        assert mine.keys() == peft_own.keys() and mine, (name, sorted(mine), sorted(peft_own))
        for key in mine:
            torch.testing.assert_close(mine[key], peft_own[key], **(tol or {"rtol": 0, "atol": 0}))


def _logits(model, batch):
    with torch.no_grad():
        return model(**batch, use_cache=False).logits


def _train_save_load(rank, world, method, directory):
    """Two AdamW steps of the pipeline against PEFT in one process; then the adapter and the
    merged model written by the pipeline, read back in one process (on rank 0)."""
    from peft import PeftModel, get_peft_model
    from transformers import AutoModelForCausalLM

    schedule, options = METHODS[method]
    torch.manual_seed(0)
    model, layer_cls = llama()
    if rank == 0:
        model.save_pretrained(f"{directory}/base")
    peft_model = get_peft_model(model, _config(method))
    ref = copy.deepcopy(peft_model)
    pipe = px.PipelineModel(
        peft_model,
        layer_cls=layer_cls,
        num_microbatches=4,
        schedule=schedule,
        timeout=60,
        **options,
    )
    trainable = [p for p in pipe.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(trainable, **ADAM)
    ref_opt = torch.optim.AdamW([p for p in ref.parameters() if p.requires_grad], **ADAM)
    for step in range(2):
        batch = make_batch(seed=step)
        loss = pipe.run_train(**batch)
        ref_loss = ref(**batch, use_cache=False).loss
        ref_loss.backward()
        where = f"{method} step {step} rank {rank}"
        torch.testing.assert_close(loss, ref_loss.detach(), **LOSS_TOL, msg=where)
        for name, p in pipe.named_parameters():
            if not p.requires_grad:
                assert p.grad is None, f"{where}: frozen {name} got a gradient"
                continue
            torch.testing.assert_close(p.grad, ref.get_parameter(name).grad, **GRAD_TOL, msg=name)
        opt.step()
        ref_opt.step()
        opt.zero_grad()
        ref_opt.zero_grad()
    # Frozen weights keep no optimizer state; every local adapter tensor trains.
    assert len(opt.state) == len(trainable) > 0
    pipe.save_pretrained(f"{directory}/adapter")
    pipe.save_pretrained(f"{directory}/merged", merge_adapters=True)
    # Trained as PEFT trains, and the merged export left the pipeline's layers as they were.
    for name, p in pipe.named_parameters():
        torch.testing.assert_close(p, ref.get_parameter(name), **PARAM_TOL, msg=name)
    if rank != 0:
        return None
    _same_adapter_files(f"{directory}/adapter", ref, f"{directory}/peft", **PARAM_TOL)
    config = json.loads((directory / "adapter" / "adapter_config.json").read_text())
    assert config["peft_type"] == ref.peft_config["default"].peft_type.value
    batch = make_batch(seed=7)
    want = _logits(ref, batch)
    base = AutoModelForCausalLM.from_pretrained(f"{directory}/base")
    loaded = _logits(PeftModel.from_pretrained(base, f"{directory}/adapter"), batch)
    torch.testing.assert_close(loaded, want, **LOSS_TOL)
    merged_model = AutoModelForCausalLM.from_pretrained(f"{directory}/merged")
    assert not any("lora" in n or "base_layer" in n for n in merged_model.state_dict())
    torch.testing.assert_close(_logits(merged_model, batch), want, rtol=1e-5, atol=1e-5)
    return sorted(merged_model.state_dict())


@pytest.mark.compat
@pytest.mark.parametrize("method", sorted(METHODS))
def test_peft_pipeline_trains_saves_and_merges_as_peft_does(method, tmp_path):
    out = run_ranks(2, _train_save_load, method, tmp_path, timeout=200)
    assert out[0]  # rank 0 compared the adapter files


def _meta_base(rank, world, directory):
    """A base built on meta: a new adapter starts as PEFT starts one (LoRA's B zero: the
    pipeline's outputs are the base's), and a saved adapter loaded after the base gives PEFT's
    outputs in one process; PeftModel.from_pretrained on meta is refused in one line."""
    from peft import LoraConfig, PeftModel, get_peft_model
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    model, _ = llama()
    config = LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    saved = get_peft_model(copy.deepcopy(model), config)
    if rank == 0:
        model.save_pretrained(f"{directory}/base")
        saved.save_pretrained(f"{directory}/adapter")
    torch.distributed.barrier()
    hf_config = AutoConfig.from_pretrained(f"{directory}/base")

    def meta_base():
        with torch.device("meta"):
            return AutoModelForCausalLM.from_config(hf_config)

    batch = make_batch(seed=3)
    out = {}
    fresh = px.PipelineModel(
        get_peft_model(meta_base(), LoraConfig(r=4, target_modules=["q_proj", "v_proj"])),
        num_microbatches=2,
    )
    fresh.load_pretrained(f"{directory}/base")
    zero_b = [float(t.abs().max()) for n, t in fresh.state_dict().items() if "lora_B" in n]
    assert zero_b and max(zero_b) == 0.0
    torch.testing.assert_close(fresh.run_eval(**batch).loss, model(**batch).loss, **LOSS_TOL)

    pipe = px.PipelineModel(get_peft_model(meta_base(), copy.deepcopy(config)), num_microbatches=2)
    pipe.load_pretrained(f"{directory}/base")
    pipe.load_adapter(f"{directory}/adapter")
    want = saved(**batch, use_cache=False).loss
    torch.testing.assert_close(pipe.run_eval(**batch).loss, want.detach(), **LOSS_TOL)

    with pytest.raises(ValueError, match="PeftModel.from_pretrained on a meta-built base") as e:
        px.PipelineModel(
            PeftModel.from_pretrained(meta_base(), f"{directory}/adapter"), num_microbatches=2
        )
    out["from_pretrained"] = str(e.value)
    other = LoraConfig(r=8, target_modules=["q_proj", "v_proj"])
    mismatched = px.PipelineModel(get_peft_model(meta_base(), other), num_microbatches=2)
    with pytest.raises(ValueError, match="was saved with") as e:
        mismatched.load_adapter(f"{directory}/adapter")
    out["mismatch"] = str(e.value)
    frozen = PeftModel.from_pretrained(llama()[0], f"{directory}/adapter")  # inference mode
    nothing = px.PipelineModel(frozen, num_microbatches=2)
    with pytest.raises(ValueError, match="nothing of the model trains") as e:
        nothing.run_train(**batch)
    out["nothing to train"] = str(e.value)
    nothing.run_eval(**batch)  # evaluation and generation stay
    untrained = get_peft_model(llama()[0], copy.deepcopy(config)).requires_grad_(False)
    with pytest.raises(ValueError, match="in training mode but no parameter requires grad") as e:
        px.PipelineModel(untrained, num_microbatches=2)
    out["frozen by hand"] = str(e.value)
    plain = px.PipelineModel(llama()[0], num_microbatches=2)
    with pytest.raises(ValueError, match="needs a pipeline of a PEFT model"):
        plain.load_adapter(f"{directory}/adapter")
    with pytest.raises(ValueError, match="merge_adapters=True needs a pipeline of a PEFT model"):
        plain.save_pretrained(f"{directory}/plain", merge_adapters=True)
    return out


@pytest.mark.compat
def test_peft_pipeline_of_a_meta_base_loads_the_base_then_the_adapter(tmp_path):
    out = run_ranks(2, _meta_base, tmp_path, timeout=200)
    for o in out:
        assert all("\n" not in text for text in o.values()), o


def _around_the_layers(rank, world, directory):
    """Adapters outside the decoder layers too (LoRA on the embedding and the head, a full
    trainable copy of the head: ``modules_to_save``): equal to PEFT in one process, with the
    gradients clipped to the whole model's norm; the adapter saved as PEFT saves it; and
    ``generate`` with the adapters equal to the ``PeftModel``'s."""
    from peft import LoraConfig, get_peft_model

    out = []
    for targets, save in ((["q_proj", "embed_tokens", "lm_head"], None), (["v_proj"], ["lm_head"])):
        torch.manual_seed(0)
        model, layer_cls = llama()
        config = LoraConfig(
            r=4, target_modules=targets, modules_to_save=save, init_lora_weights=False
        )
        peft_model = get_peft_model(model, config)
        ref = copy.deepcopy(peft_model)
        pipe = px.PipelineModel(peft_model, layer_cls=layer_cls, num_microbatches=2, timeout=60)
        batch = make_batch(seed=1)
        loss = pipe.run_train(**batch)
        ref_loss = ref(**batch, use_cache=False).loss
        ref_loss.backward()
        torch.testing.assert_close(loss, ref_loss.detach(), **LOSS_TOL)
        norm = pipe.clip_grad_norm_(0.5)
        trainable = [p for p in ref.parameters() if p.requires_grad]
        torch.testing.assert_close(norm, torch.nn.utils.clip_grad_norm_(trainable, 0.5))
        named = [(n, p) for n, p in pipe.named_parameters() if p.requires_grad]
        assert named and all(p.grad is None for p in pipe.parameters() if not p.requires_grad)
        for name, p in named:
            torch.testing.assert_close(p.grad, ref.get_parameter(name).grad, **GRAD_TOL, msg=name)
        where = f"{directory}/{len(out)}"
        pipe.save_pretrained(f"{where}/ours")
        if rank == 0:
            _same_adapter_files(f"{where}/ours", ref, f"{where}/peft")
        ids = batch["input_ids"][:2, :6]
        got = pipe.generate(ids, max_new_tokens=5, do_sample=False)
        want = ref.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=5)
        assert torch.equal(got, want), (got, want)
        out.append(" ".join(n for n, _ in named))
    return out


@pytest.mark.compat
def test_adapters_on_the_embedding_and_head_train_save_and_generate_as_peft_does(tmp_path):
    out = run_ranks(2, _around_the_layers, str(tmp_path), timeout=200)
    # The first rank holds the embedding's adapter, the last the head's and its copy.
    assert "embed_tokens.lora_embedding_A" in out[0][0] and "lm_head.lora_A" in out[1][0]
    assert "lm_head.modules_to_save.default.weight" in out[1][1]


def _mesh(rank, world, directory):
    """A data x pipeline mesh (FSDP2 over stages of frozen and trainable tensors) trains LoRA
    equal to one process and exports the merged model as PEFT merges it; tensor parallelism is
    refused in one line naming the module."""
    from models import full
    from peft import LoraConfig, get_peft_model
    from torch.distributed.device_mesh import init_device_mesh
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model, layer_cls = llama()
    config = LoraConfig(r=4, target_modules=["q_proj", "o_proj"], init_lora_weights=False)
    peft_model = get_peft_model(model, config)
    ref = copy.deepcopy(peft_model)
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "pp"))
    pipe = px.PipelineModel(
        peft_model, layer_cls=layer_cls, num_microbatches=2, mesh=mesh, data_parallel="shard"
    )
    batch = make_batch(seed=2)
    loss = pipe.run_train(**batch)
    ref_loss = ref(**batch, use_cache=False).loss
    ref_loss.backward()
    torch.testing.assert_close(loss, ref_loss.detach(), **LOSS_TOL)
    for name, p in pipe.named_parameters():
        if p.requires_grad:
            torch.testing.assert_close(full(p.grad), ref.get_parameter(name).grad, **GRAD_TOL)
        else:
            assert p.grad is None, name
    pipe.save_pretrained(f"{directory}/merged", merge_adapters=True)
    if rank == 0:
        merged = AutoModelForCausalLM.from_pretrained(f"{directory}/merged")
        want = ref.merge_and_unload()(**batch, use_cache=False).logits
        torch.testing.assert_close(merged(**batch).logits, want, atol=1e-5, rtol=1e-5)
    tp_mesh = init_device_mesh("cpu", (1, 2, 2), mesh_dim_names=("dp2", "pp2", "tp2"))
    with pytest.raises(NotImplementedError) as e:
        px.PipelineModel(
            get_peft_model(llama()[0], copy.deepcopy(config)),
            num_microbatches=2,
            mesh=tp_mesh,
            dp_dim="dp2",
            pp_dim="pp2",
            tp_dim="tp2",
            tensor_parallel="auto",
        )
    return str(e.value)


def test_peft_on_a_data_parallel_mesh_trains_and_tensor_parallel_is_refused(tmp_path):
    for message in run_ranks(4, _mesh, str(tmp_path), timeout=200):
        assert "with PEFT adapters is not supported yet" in message and "\n" not in message
        assert "self_attn.q_proj (HF's plan: 'colwise')" in message, message


def _dcp_resume(rank, world, directory, schedule):
    """``save`` keeps the adapters and their optimizer state only; a new pipeline of the same
    base (on ``schedule``: another stage layout, to reshard) loads them and its next step equals
    the uninterrupted run's."""
    import torch.distributed.checkpoint as dcp
    from peft import LoraConfig, get_peft_model

    def new(schedule):
        torch.manual_seed(0)
        model, layer_cls = llama()
        config = LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
        torch.manual_seed(1)  # the adapters' initialization differs from the run saved
        pipe = px.PipelineModel(
            get_peft_model(model, config),
            layer_cls=layer_cls,
            num_microbatches=4,
            schedule=schedule,
        )
        opt = torch.optim.AdamW([p for p in pipe.parameters() if p.requires_grad], **ADAM)
        return pipe, opt

    def step(pipe, opt, seed):
        loss = pipe.run_train(**make_batch(seed=seed))
        opt.step()
        opt.zero_grad()
        return loss

    pipe, opt = new("1f1b")
    step(pipe, opt, 0)
    step(pipe, opt, 1)
    path = pipe.save(f"{directory}/ckpt", opt, step=1)
    want = step(pipe, opt, 2)
    saved = dcp.FileSystemReader(path).read_metadata().state_dict_metadata
    models = [k for k in saved if k.startswith("model.")]
    assert models and all("lora_" in k for k in models), models
    assert any(k.startswith("optim.state.") and "lora_A" in k for k in saved)
    again, opt2 = new(schedule)
    assert again.load(f"{directory}/ckpt", opt2) == 1
    got = step(again, opt2, 2)
    assert torch.equal(got, want), (got, want)
    return len(models)


@pytest.mark.parametrize("schedule", ["1f1b", "interleaved"])
def test_peft_checkpoints_keep_the_adapters_and_resume_exactly(tmp_path, schedule):
    out = run_ranks(2, _dcp_resume, str(tmp_path), schedule, timeout=200)
    assert all(n > 0 for n in out)


def test_finetune_lora_example_learns_saves_and_peft_reloads(tmp_path):
    """``examples/finetune_lora.py`` under torchrun (2 ranks), with few steps: the loss falls,
    the adapter directory is PEFT's, and PEFT in one process gives the pipeline's held-out loss."""
    import re

    from test_materialize import ROOT, torchrun

    flags = ("--steps", "12", "--out", str(tmp_path), "--max-chars", "60000", "--seq", "64")
    out = torchrun(2, ROOT / "examples" / "finetune_lora.py", *flags, cwd=tmp_path)
    losses = [float(x) for x in re.findall(r"^step +\d+ +loss ([\d.]+)", out, re.M)]
    assert len(losses) >= 2 and losses[-1] < losses[0] - 0.5, out
    assert (tmp_path / "adapter" / "adapter_model.safetensors").is_file()
    assert not (tmp_path / "adapter" / "model.safetensors").exists()
    pipe_loss, peft_loss = map(
        float, re.search(r"pipeline ([\d.]+), PEFT in one process ([\d.]+)", out).groups()
    )
    assert abs(pipe_loss - peft_loss) < 1e-4, out
    assert "greedy continuation" in out


def _named_adapters(rank, world, directory):
    """Two named adapters: saved as PEFT saves them (the second in its own subdirectory, the
    same tensors), and each loads back by name."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(0)
    model, layer_cls = llama()
    peft_model = get_peft_model(
        model, LoraConfig(r=4, target_modules=["q_proj"], init_lora_weights=False)
    )
    peft_model.add_adapter(
        "other", LoraConfig(r=2, target_modules=["v_proj"], init_lora_weights=False)
    )
    ref = copy.deepcopy(peft_model)
    pipe = px.PipelineModel(peft_model, layer_cls=layer_cls, num_microbatches=2)
    pipe.save_pretrained(f"{directory}/ours")
    if rank == 0:
        _same_adapter_files(f"{directory}/ours", ref, f"{directory}/peft")
    torch.distributed.barrier()
    before = {n: t.clone() for n, t in pipe.state_dict().items() if ".other." in n}
    with torch.no_grad():
        for n, t in pipe.state_dict(keep_vars=True).items():
            if ".other." in n:
                t.zero_()
    pipe.load_adapter(f"{directory}/ours/other", adapter_name="other")
    after = pipe.state_dict()
    assert before and all(torch.equal(after[n], t) for n, t in before.items())
    with pytest.raises(KeyError, match="has no adapter 'third'"):
        pipe.load_adapter(f"{directory}/ours/other", adapter_name="third")
    return len(before)


def test_named_adapters_save_and_load_as_peft_does(tmp_path):
    assert all(n > 0 for n in run_ranks(2, _named_adapters, str(tmp_path), timeout=200))


def _router_loss_and_compiled(rank, world, case):
    """LoRA on a mixture of experts whose loss adds the routers' load-balancing loss (the PEFT
    wrapper passes labels to the model that owns the loss), and on compiled stages (AOTAutograd,
    ZB-H1): the loss and every trainable gradient equal PEFT's in one process."""
    from models import mixtral, reference_step
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(0)
    if case == "router loss":
        model, layer_cls = mixtral(router_loss=True)
        targets, options = ["q_proj", "gate"], {}
    else:
        model, layer_cls = llama()
        targets = ["q_proj", "v_proj"]
        options = {"compile": True, "compile_options": {"backend": "aot_eager"}, "schedule": "zbh1"}
    config = LoraConfig(r=4, target_modules=targets, init_lora_weights=False)
    peft_model = get_peft_model(model, config)
    ref = copy.deepcopy(peft_model)
    pipe = px.PipelineModel(
        peft_model, layer_cls=layer_cls, num_microbatches=2, timeout=600, **options
    )
    batch = make_batch(seed=0)
    loss = pipe.run_train(**batch)
    ref_loss, added = reference_step(ref, batch, 2)
    torch.testing.assert_close(loss, ref_loss, **LOSS_TOL)
    named = [(n, p) for n, p in pipe.named_parameters() if p.requires_grad]
    for name, p in named:
        torch.testing.assert_close(p.grad, ref.get_parameter(name).grad, **GRAD_TOL, msg=name)
    return added, len(named)


@pytest.mark.parametrize("case", ["router loss", "compiled"])
def test_lora_with_a_router_loss_and_on_compiled_stages_equals_peft(case):
    for added, trained in run_ranks(2, _router_loss_and_compiled, case, timeout=600):
        assert trained > 0
        assert (added > 0) == (case == "router loss"), added  # the router loss was added


LORA_TARGETS = ["q_proj", "v_proj", "down_proj"]


def _lora(model):
    from peft import LoraConfig, get_peft_model

    return get_peft_model(model, LoraConfig(r=8, target_modules=LORA_TARGETS))


def _measured_lora_peak(rank, world, plan_json, seq):
    """The most live CPU tensor bytes during a training step of the LoRA ``plan`` on a
    meta-built model, after a warm-up step with an AdamW step over the adapters."""
    from test_planner import _activation_heavy_llama

    from pippy_xla import _C

    _C.memory_tracker_install()
    plan = px.Plan.from_json(plan_json)
    with torch.device("meta"):
        model, layer_cls = _activation_heavy_llama(plan.layer_ranges[-1][1])
    pipe = px.PipelineModel(_lora(model), layer_cls=layer_cls, plan=plan, timeout=60)
    del model
    opt = torch.optim.AdamW([p for p in pipe.parameters() if p.requires_grad])
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 2048, (8, seq), generator=g)
    pipe.run_train(input_ids=ids, labels=ids)
    opt.step()
    _C.memory_reset_peak()
    pipe.run_train(input_ids=ids, labels=ids)
    return _C.memory_stats().peak_bytes


def test_lora_plan_checkpoints_less_than_full_fine_tuning_and_its_peak_is_measured():
    """The planner counts gradients and AdamW state for the trainable parameters only: under the
    limit that LoRA meets with no layer checkpointed, a full fine-tune of the same model must
    checkpoint layers or cannot fit at all; the LoRA plan's predicted peak is within 10% of the
    measured one."""
    from test_planner import _activation_heavy_llama

    from pippy_xla.plan.planner import PlanInfeasibleError, limit_range, profile_model

    seq, batch, mbs = 128, 8, 4
    arms = {}
    for arm in ("full", "lora"):
        torch.manual_seed(0)
        model, layer_cls = _activation_heavy_llama()
        model = _lora(model) if arm == "lora" else model
        prof = profile_model(model, layer_cls, microbatch_size=batch // mbs, seq_len=seq, repeats=1)
        kw = dict(
            layer_cls=layer_cls,
            num_stages=2,
            num_microbatches=mbs,
            batch_size=batch,
            seq_len=seq,
            profile=prof,
        )
        arms[arm] = (model, kw)
    limit = limit_range(arms["lora"][0], **arms["lora"][1])[1]  # LoRA's unconstrained peak
    lora = px.plan(arms["lora"][0], memory_limit=limit, **arms["lora"][1])
    assert lora.checkpoint_layers == [], lora
    try:
        full = px.plan(arms["full"][0], memory_limit=limit, **arms["full"][1])
        assert full.checkpoint_layers, full
        print(f"limit {limit}: full fine-tuning checkpoints layers {full.checkpoint_layers}")
    except PlanInfeasibleError as e:
        print(f"limit {limit}: full fine-tuning does not fit: {e}")
    measured = run_ranks(2, _measured_lora_peak, lora.to_json(), seq, timeout=200)
    for st in lora.stages:
        got = measured[st.rank]
        print(f"LoRA stage {st.index}: predicted {st.memory_bytes} measured {got}")
        assert abs(got - st.memory_bytes) <= 0.10 * st.memory_bytes, (st, got)
