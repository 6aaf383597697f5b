"""Pipeline x context parallel on 4 gloo ranks: every row's tokens shared head-tail over the
``cp`` ranks of a stage, attention exact across the shares (all-to-all over heads through HF's
attention interface), against one process on the whole batch: the loss, every gradient and the
parameters after AdamW steps, with padding in the batch; and the refusals. One spawn of the
ranks runs every case."""

from __future__ import annotations

import copy

import pytest
import torch
from models import (
    full,
    grads_of,
    llama,
    make_batch,
    mistral,
    on_first_rank,
    params_of,
    qwen2,
    reference_step,
    tiny,
)
from test_moe import TOL
from test_trainer import (
    LOGGED,
    SFT_METRICS,
    _args,
    _documents,
    _logs,
    _mesh_trainer,
    _metrics_options,
    _options,
    _pipelined_sft,
    _reference,
    _Rows,
    _sft_config,
    _sft_reference,
)

import pippy_xla as px
from pippy_xla.runtime.context_parallel import zigzag_index
from pippy_xla.testing import run_ranks

SEQ = 16  # 2 x cp = 4 chunks of 4 tokens at cp=2, 8 chunks of 2 at cp=4


def _mesh(shape, names):
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", shape, mesh_dim_names=names)


def _close(actual, expected, kind, msg, worst):
    torch.testing.assert_close(actual, expected, **TOL[kind], msg=msg)
    worst[kind] = max(worst.get(kind, 0.0), float((actual - expected).abs().max()))


def _packed(seed: int) -> dict:
    """Rows of several documents each (positions restart at 0), no attention mask: HF's mask
    factories find the documents from the positions."""
    batch = make_batch(seed=seed, batch=4, seq=SEQ, pad=False)
    del batch["attention_mask"]
    starts = ([0, 5, 11], [0, 9], [0], [0, 2, 3, 12])
    positions = torch.zeros(4, SEQ, dtype=torch.long)
    for row, cuts in enumerate(starts):
        for a, b in zip(cuts, [*cuts[1:], SEQ], strict=False):
            positions[row, a:b] = torch.arange(b - a)
    return {**batch, "position_ids": positions}


def _padded(seed: int) -> dict:
    batch = make_batch(seed=seed, batch=4, seq=SEQ)  # rows 0 and 3 right-padded
    assert (batch["attention_mask"] == 0).any()
    return batch


def _reference_step(ref, batch, mbs, opt, clip):
    """One process's step on rank 0 for every rank: the loss, the gradient norm (clipped to
    ``clip``, if any), the gradients, and the parameters after ``opt``'s step."""

    def step():
        loss, _ = reference_step(ref, batch, mbs)
        norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), clip) if clip else None
        grads = grads_of(ref)
        opt.step()
        opt.zero_grad()
        return loss, norm, grads, params_of(ref)

    return on_first_rank(step)


def _case(
    mesh, make, schedule, worst, steps=2, mbs=2, batches=_padded, options=None, clip=None, **kw
):
    """``steps`` AdamW steps of the pipeline on ``mesh`` (``options`` for ``PipelineModel``; the
    gradients clipped to the global norm ``clip``, if any) against one process on the whole
    batch (``mbs`` microbatches of rows in both), then ``run_eval``'s loss; returns the
    losses."""
    torch.manual_seed(0)
    model, layer_cls = make(**kw)
    ref = copy.deepcopy(model)
    options = options or {}
    pipe = px.PipelineModel(
        model,
        layer_cls=layer_cls,
        num_microbatches=mbs,
        schedule=schedule,
        mesh=mesh,
        timeout=60,
        **options,
    )
    seen = set()  # the tokens per row each local decoder layer is given: this rank's share
    for st in pipe.local_stages:
        for m in st.module.modules():
            if isinstance(m, layer_cls):
                m.register_forward_hook(lambda m, args, out: seen.add(args[0].shape[1]))
    opt = torch.optim.AdamW(pipe.parameters(), lr=1e-3, eps=1e-6)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-3, eps=1e-6)
    losses = []
    for step in range(steps):
        where = f"{type(model).__name__} {schedule} {mesh.mesh_dim_names} step={step}"
        batch = batches(step)
        loss = pipe.run_train(**batch)
        ref_loss, ref_norm, ref_grads, ref_params = _reference_step(ref, batch, mbs, ref_opt, clip)
        _close(loss, ref_loss, "loss", where, worst)
        if clip:  # whole gradients on every cp rank: each counted once
            assert float(ref_norm) > 2 * clip, where  # the clipping scales
            _close(pipe.clip_grad_norm_(clip), ref_norm, "loss", f"{where}: norm", worst)
        named = dict(pipe.named_parameters())
        for name, p in named.items():
            _close(full(p.grad), ref_grads[name], "grad", f"{where}: {name}", worst)
        opt.step()
        opt.zero_grad()
        for name, p in named.items():
            _close(full(p.detach()), ref_params[name], "param", f"{where}: {name}", worst)
        losses.append(round(float(loss), 5))
    assert seen == {SEQ // pipe.cp_size}, (where, seen)
    batch = batches(steps)
    ref_eval = on_first_rank(lambda: ref(**batch, use_cache=False).loss.detach())
    _close(pipe.run_eval(**batch).loss, ref_eval, "loss", f"{where}: run_eval", worst)
    return losses


def _refusal(fn) -> str:
    try:
        fn()
    except (ValueError, NotImplementedError) as e:
        return f"{type(e).__name__}: {e}"
    raise AssertionError("not refused")


def _refusals(cp_pp):
    """Each refusal's first line, the same on every rank."""

    def build(make, mesh=cp_pp, **kw):
        torch.manual_seed(0)
        model, layer_cls = make()
        return px.PipelineModel(
            model, layer_cls=layer_cls, num_microbatches=2, mesh=mesh, timeout=60, **kw
        )

    pipe = build(llama)
    odd = make_batch(seed=0, batch=4, seq=SEQ + 2)  # 18 tokens: no 4 equal chunks
    four = _mesh((4,), ("cp",))
    return [
        _refusal(lambda: pipe.run_train(**odd)),
        _refusal(lambda: build(llama, mesh=four)),  # 2 key/value heads over cp=4
        _refusal(lambda: build(lambda: tiny("mamba", layers=2))),
        _refusal(lambda: build(llama, loss_fn=lambda logits, labels, n: logits.sum())),
        _refusal(lambda: pipe.generate(odd["input_ids"][:, :4], max_new_tokens=2)),
        _refusal(lambda: build(llama, mesh=_mesh((2, 2), ("cp", "tp")))),
    ]


def _checkpoint_case(cp_pp, directory, worst):
    """A step at cp=2 x pp=2 saved (``pipe.save``, AdamW's state too) and loaded into the same
    layout and into dp=2 x pp=2 without cp (pipelines of a model zeroed first): the next step's
    loss and parameters equal to one process's."""
    torch.manual_seed(0)
    model, layer_cls = llama(layers=2)
    ref, blank = copy.deepcopy(model), copy.deepcopy(model)
    with torch.no_grad():
        for p in blank.parameters():
            p.zero_()
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-3, eps=1e-6)

    def pipeline(model, mesh):
        pipe = px.PipelineModel(
            model, layer_cls=layer_cls, num_microbatches=2, mesh=mesh, timeout=60
        )
        return pipe, torch.optim.AdamW(pipe.parameters(), lr=1e-3, eps=1e-6)

    pipe, opt = pipeline(model, cp_pp)
    pipe.run_train(**_padded(0))
    opt.step()
    opt.zero_grad()
    pipe.save(directory, opt, step=1)
    _reference_step(ref, _padded(0), 2, ref_opt, None)
    ref_loss, _, _, ref_params = _reference_step(ref, _padded(1), 2, ref_opt, None)
    steps = []
    for mesh in (cp_pp, _mesh((2, 2), ("dp", "pp"))):
        where = f"loaded on {mesh.mesh_dim_names}"
        pipe, opt = pipeline(copy.deepcopy(blank), mesh)
        steps.append(pipe.load(directory, opt))
        _close(pipe.run_train(**_padded(1)), ref_loss, "loss", where, worst)
        opt.step()
        for name, p in pipe.named_parameters():
            _close(full(p.detach()), ref_params[name], "param", f"{where}: {name}", worst)
    return steps


def _trainer_case(cp_pp, dp_cp, directory):
    """``px.PipelineTrainer`` on cp=2 x pp=2 and on dp=2 x cp=2 x pp=1 (2 rows per replica: the
    same global batch) with test_trainer's arguments (padded rows, accumulation over 2
    batches, clipping, a cosine schedule), then ``evaluate`` with ``compute_metrics`` (the
    logits of every token, gathered from the cp ranks), again without it (the loss alone) and
    ``save_model``: the logs and metrics of each, for the Trainer's in one process; a loss of
    the trainer's own, refused."""
    out = {}
    for name, mesh, replicas in (("cp_pp", cp_pp, 1), ("dp_cp", dp_cp, 2)):
        trainer = _mesh_trainer(f"{directory}/{name}", mesh, replicas)
        trainer.train()
        metrics = trainer.evaluate()
        trainer.compute_metrics = None  # the loss alone: no logits kept, none gathered
        metrics["loss_only"] = trainer.evaluate()["eval_loss"]
        trainer.save_model(f"{directory}/{name}-model")
        keep = ("eval_loss", "eval_accuracy", "eval_rows", "loss_only")
        out[name] = _logs(trainer), {k: metrics[k] for k in keep}
    refused = _refusal(
        lambda: px.PipelineTrainer(
            model=llama()[0],
            args=_args(f"{directory}/own", label_smoothing_factor=0.1),
            train_dataset=_Rows(1, seed=0),
            pipeline=px.PipelineConfig(num_microbatches=2),
            mesh=cp_pp,
        )
    )
    return out, refused


def _sft_args(out: str):
    """TRL's packing (rows of up to 14 tokens, lengthened to 16 for cp=2's 4 chunks), fp32,
    with its gradient checkpointing."""
    from trl import SFTConfig

    return SFTConfig(**_options(out, max_steps=2, bf16=False, packing=True, max_length=14))


def _sft_case(cp_pp, directory):
    """TRL's ``SFTTrainer`` with ``packing=True`` and LoRA (``peft_config=``) on cp=2 x pp=2:
    rows of several documents, positions restarting per document and no attention mask, split
    head-tail; the logs, then the adapter ``save_model`` writes and the model merged
    (``save_pretrained(merge_adapters=True)``)."""
    trainer = _pipelined_sft(
        _sft_args(f"{directory}/sft"), _documents(), peft_config=_sft_config(), mesh=cp_pp
    )
    batch = next(iter(trainer.get_train_dataloader()))
    trainer.train()
    trainer.save_model(f"{directory}/sft-adapter")
    trainer.pipe.save_pretrained(f"{directory}/sft-merged", merge_adapters=True)
    return _logs(trainer, (*LOGGED, *SFT_METRICS)), tuple(batch["input_ids"].shape)


def _fresh_adapters_case(mesh, rank: int) -> bool:
    """A PEFT model of a base built on ``meta``, each rank's random state its own: PEFT's new
    adapters, made after the build, are equal on every rank that holds them (the cp ranks take
    cp rank 0's, the replicas the first one's)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from pippy_xla.runtime.data_parallel import local_tensor

    torch.manual_seed(0)
    model, layer_cls = llama(layers=2)
    with torch.device("meta"):
        base = AutoModelForCausalLM.from_config(model.config)
    torch.manual_seed(rank)
    pipe = px.PipelineModel(
        get_peft_model(base, LoraConfig(r=4, target_modules=["q_proj"])),
        layer_cls=layer_cls,
        num_microbatches=2,
        mesh=mesh,
        timeout=60,
    )
    mine = {n: local_tensor(t.detach()) for n, t in pipe.state_dict().items() if "lora_A" in n}
    everyone = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(everyone, mine)
    same = [o for o in everyone if o.keys() == mine.keys()]
    assert len(same) == 4 // pipe.num_ranks, (len(same), pipe.num_ranks)
    return bool(mine) and all(torch.equal(o[n], t) for o in same for n, t in mine.items())


def _cases(rank, world, directory):
    cp_pp = _mesh((2, 2), ("cp", "pp"))
    worst: dict[str, float] = {}
    out = {
        "llama 1f1b, clipped": _case(cp_pp, llama, "1f1b", worst, clip=0.1, layers=2),
        "qwen2 zbh1 (sliding window), checkpointed": _case(
            cp_pp, qwen2, "zbh1", worst, options={"checkpoint_layers": [0, 1]}, layers=2
        ),
        "mistral eager 1f1b": _case(cp_pp, mistral, "1f1b", worst, attn="eager", layers=2),
        "llama packed": _case(
            cp_pp,
            llama,
            "1f1b",
            worst,
            steps=1,
            batches=_packed,
            options={"input_names": ["input_ids"]},
            layers=2,
        ),
    }
    # Two replicas of a one-stage pipeline, each row's tokens over 2 cp ranks (FSDP2 over dp).
    dp_cp = _mesh((2, 2, 1), ("dp", "cp", "pp"))
    out["llama dp=2 x cp=2, shard"] = _case(
        dp_cp, llama, "1f1b", worst, clip=0.1, options={"data_parallel": "shard"}, layers=2
    )
    out["qwen2 dp=2 x cp=2, replicate"] = _case(dp_cp, qwen2, "1f1b", worst, steps=1, layers=2)
    # A ("cp",) mesh: one stage, every token's attention over 4 shares (4 key/value heads).
    cp4 = _mesh((4,), ("cp",))
    out["llama cp=4"] = _case(cp4, _llama_kv4, "1f1b", worst, steps=1)
    out["checkpoint"] = _checkpoint_case(cp_pp, f"{directory}/ckpt", worst)
    out["trainer"] = _trainer_case(cp_pp, dp_cp, directory)
    out["sft"] = _sft_case(cp_pp, directory)
    out["fresh adapters equal"] = [_fresh_adapters_case(m, rank) for m in (cp_pp, dp_cp)]
    out["refused"] = _refusals(cp_pp)
    torch.distributed.barrier()  # no rank leaves (and takes the store with it) before the others
    return out, worst


def _llama_kv4(**kw):
    model, layer_cls = llama(layers=2)
    cfg = copy.deepcopy(model.config)
    cfg.num_key_value_heads = 4
    return type(model)(cfg), layer_cls


def _references(directory):
    """In this process: HF's ``Trainer`` (test_trainer's reference, evaluated) and TRL's
    ``SFTTrainer`` with packing and LoRA (its adapter saved, and its model merged), for
    :func:`_trainer_case` and :func:`_sft_case`."""
    trainer = _reference(f"{directory}/trainer", **_metrics_options())
    metrics = trainer.evaluate()
    sft = _sft_reference(_sft_args(f"{directory}/sft"), _documents(), peft_config=_sft_config())
    sft.train()
    sft.save_model(f"{directory}/sft-adapter")
    merged = copy.deepcopy(sft.model).merge_and_unload().state_dict()
    return trainer, metrics, _logs(sft, (*LOGGED, *SFT_METRICS)), merged


def _logs_close(logs, want, rel, worst):
    """Each step's logged values within ``rel`` of one process's; the largest differences kept."""
    assert len(logs) == len(want) and want
    for step, (got, expected) in enumerate(zip(logs, want, strict=True)):
        for key, value in expected.items():
            assert got[key] == pytest.approx(value, rel=rel, abs=1e-7), (step, key, got, expected)
            worst[key] = max(worst.get(key, 0.0), abs(got[key] - value))


def _weights_close(saved: dict, want: dict, what: str, worst) -> None:
    """Saved tensors against one process's (test_trainer's tolerances)."""
    assert saved.keys() == want.keys() and saved, what
    for name, t in saved.items():
        torch.testing.assert_close(t, want[name], rtol=1e-5, atol=2e-5, msg=name)
        worst[what] = max(worst.get(what, 0.0), float((t - want[name]).abs().max()))


def _trainer_checks(result, reference, directory, worst):
    """The cp runs' Trainers against HF's in one process (test_trainer's tolerances)."""
    from transformers import AutoModelForCausalLM

    runs, refused = result
    ref, ref_metrics = reference
    trained = {k: v.detach() for k, v in ref.model.state_dict().items()}
    for name, (logs, metrics) in runs.items():
        _logs_close(logs, _logs(ref), 2e-6, worst)
        assert len(logs) == 4, name
        assert metrics["eval_loss"] == pytest.approx(ref_metrics["eval_loss"], rel=2e-6), name
        assert metrics["loss_only"] == metrics["eval_loss"], name
        diff = abs(metrics["eval_loss"] - ref_metrics["eval_loss"])
        worst["eval_loss"] = max(worst.get("eval_loss", 0.0), diff)
        assert metrics["eval_rows"] == ref_metrics["eval_rows"] == 12, name
        assert metrics["eval_accuracy"] == ref_metrics["eval_accuracy"] > 0, name
        saved = AutoModelForCausalLM.from_pretrained(f"{directory}/{name}-model").state_dict()
        _weights_close(saved, trained, "saved", worst)
    assert set(runs) == {"cp_pp", "dp_cp"}
    assert "a loss of its own" in refused and "context parallelism ('cp'" in refused


def _sft_checks(result, want, merged, directory, ref_directory, worst):
    """The cp run's packed LoRA SFT against TRL in one process: the logs, the adapter, the
    merged model."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    logs, shape = result
    assert shape[1] % 4, shape  # lengthened to whole chunks by the trainer
    _logs_close(logs, want, 1e-5, worst)
    ours = load_file(f"{directory}/sft-adapter/adapter_model.safetensors")
    theirs = load_file(f"{ref_directory}/sft-adapter/adapter_model.safetensors")
    _weights_close(ours, theirs, "adapter", worst)
    saved = AutoModelForCausalLM.from_pretrained(f"{directory}/sft-merged").state_dict()
    _weights_close(saved, merged, "merged", worst)


def test_context_parallel_equals_one_process(tmp_path):
    """Every case of :func:`_cases` on 4 ranks against one process; the trainers' references
    (HF's ``Trainer``, TRL's ``SFTTrainer``) run here first."""
    trainer, metrics, want_sft, merged = _references(str(tmp_path / "reference"))
    directory = tmp_path / "cp"
    out = run_ranks(4, _cases, str(directory), timeout=300)
    results = [o[0] for o in out]
    assert all(r == results[0] for r in results)  # every rank the same losses and refusals
    worst: dict[str, float] = {}
    _trainer_checks(results[0]["trainer"], (trainer, metrics), directory, worst)
    print("trainer", worst)
    worst = {}
    _sft_checks(results[0]["sft"], want_sft, merged, directory, tmp_path / "reference", worst)
    print("sft", worst)
    assert results[0]["checkpoint"] == [1, 1]
    assert results[0]["fresh adapters equal"] == [True, True]
    refused = results[0]["refused"]
    assert "2 x cp = 4 equal chunks, but the batch's rows have 18 tokens" in refused[0]
    assert "4 query and 2 key/value heads: both must divide by cp" in refused[1]
    assert "state runs along the sequence" in refused[2]
    assert "loss_fn is not supported yet" in refused[3]
    assert "generate is not supported yet under context parallelism" in refused[4]
    assert "cp beside tensor parallelism or HSDP is not supported yet" in refused[5]
    print({k: max(o[1].get(k, 0.0) for o in out) for k in ("loss", "grad", "param")})


def test_zigzag_index():
    # cp=2, 8 tokens: chunks of 2; rank 0 holds chunks 0 and 3, rank 1 chunks 1 and 2.
    assert zigzag_index(8, 0, 2).tolist() == [0, 1, 6, 7]
    assert zigzag_index(8, 1, 2).tolist() == [2, 3, 4, 5]
    every = torch.cat([zigzag_index(16, r, 4) for r in range(4)])
    assert sorted(every.tolist()) == list(range(16))


@pytest.mark.parametrize("bad", [("x", "x")])
def test_cp_dim_must_differ(bad):
    with pytest.raises(ValueError, match="cp_dim too"):
        px.PipelineConfig(num_microbatches=2, pp_dim=bad[0], cp_dim=bad[1])
