"""``px.PipelineTrainer`` (HF's ``Trainer`` on the pipeline) against ``transformers.Trainer`` in one
process with the same arguments: every step's logged loss, grad norm and learning rate, the eval
loss and the saved weights. See [Note: the Trainer's loop on a pipeline] in
pippy_xla/integrations/trainer.py."""

from __future__ import annotations

import re

import pytest
import torch
from models import llama, make_batch, mixtral, needs_hf_tensor_parallel

import pippy_xla as px
from pippy_xla.testing import run_ranks

LOGGED = ("loss", "grad_norm", "learning_rate")


class _Rows(torch.utils.data.Dataset):
    """Rows of padded token batches (labels -100 on the padding)."""

    def __init__(self, batches: int, seed: int) -> None:
        self.rows = [
            {k: v[r] for k, v in b.items()}
            for b in (make_batch(seed=seed + i) for i in range(batches))
            for r in range(8)
        ]

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> dict:
        return self.rows[i]


def _options(out: str, **overrides) -> dict:
    """Padding in every batch, accumulation 2, cosine schedule with warm-up, clipping."""
    options = dict(
        output_dir=out,
        per_device_train_batch_size=4,
        per_device_eval_batch_size=8,
        gradient_accumulation_steps=2,
        max_steps=4,
        learning_rate=1e-3,
        lr_scheduler_type="cosine",
        warmup_steps=1,
        max_grad_norm=0.5,
        weight_decay=0.01,
        adam_epsilon=1e-6,
        logging_steps=1,
        report_to=[],
        save_strategy="no",
        seed=0,
        use_cpu=True,
        disable_tqdm=True,
    )
    return {**options, **overrides}


def _args(out: str, **overrides):
    from transformers import TrainingArguments

    return TrainingArguments(**_options(out, **overrides))


def _logs(trainer, keys=LOGGED) -> list[dict]:
    """Each logged step's ``keys`` (``None`` where a step logged no such value)."""
    return [{k: h.get(k) for k in keys} for h in trainer.state.log_history if "loss" in h]


def _eval_rows():
    """12 rows: evaluated in batches of 8 and 4 (accelerate trims the last batch's gather)."""
    return torch.utils.data.Subset(_Rows(2, seed=200), range(12))


def _accuracy(prediction) -> dict:
    """Next-token accuracy over the labelled tokens (``compute_metrics``)."""
    predicted, labels = prediction.predictions[:, :-1], prediction.label_ids[:, 1:]
    mask = labels != -100
    return {"accuracy": float((predicted[mask] == labels[mask]).mean()), "rows": len(labels)}


def _argmax(logits, labels):
    return logits.argmax(-1)


def _metrics_options() -> dict:
    return dict(compute_metrics=_accuracy, preprocess_logits_for_metrics=_argmax)


def _reference(out: str, **options):
    """``transformers.Trainer`` in this process on the tiny Llama and the tests' data and
    arguments, trained."""
    from transformers import Trainer

    torch.manual_seed(0)
    model, _ = llama()
    reference = Trainer(
        model=model,
        args=_args(out),
        train_dataset=_Rows(4, seed=100),
        eval_dataset=_eval_rows(),
        **options,
    )
    reference.train()
    return reference


def _pipeline_run(rank, world, directory):
    torch.manual_seed(0)
    model, layer_cls = llama()
    trainer = px.PipelineTrainer(
        model=model,
        args=_args(f"{directory}/run"),
        train_dataset=_Rows(4, seed=100),
        eval_dataset=_eval_rows(),
        layer_cls=layer_cls,
        pipeline=px.PipelineConfig(num_microbatches=2),
        **_metrics_options(),
    )
    trainer.train()
    metrics = trainer.evaluate()
    trainer.save_model(f"{directory}/model")
    refused = {}
    for name, overrides, extra in (
        ("batch", {"per_device_train_batch_size": 3}, {}),
        ("compile", {"torch_compile": True}, {}),
        ("saves", {"save_only_model": True}, {}),
    ):
        with pytest.raises(ValueError, match="PipelineTrainer cannot run") as e:
            px.PipelineTrainer(
                model=llama()[0],
                args=_args(f"{directory}/refused", **overrides),
                train_dataset=_Rows(1, seed=0),
                pipeline=px.PipelineConfig(num_microbatches=2),
                **extra,
            )
        refused[name] = str(e.value)
    torch.manual_seed(0)
    moe, moe_layer = mixtral(router_loss=True)
    smoothed = px.PipelineTrainer(
        model=moe,
        args=_args(f"{directory}/smoothed", label_smoothing_factor=0.1),
        train_dataset=_Rows(4, seed=100),
        layer_cls=moe_layer,
        pipeline=px.PipelineConfig(num_microbatches=2),
    )
    smoothed.train()
    return _logs(trainer), metrics, refused, _logs(smoothed)


@pytest.mark.compat
def test_pipeline_trainer_logs_evaluates_and_saves_as_the_trainer_in_one_process(tmp_path):
    """The logs, the eval loss and ``compute_metrics`` (next-token accuracy from
    ``preprocess_logits_for_metrics``'s argmax; batches of 8 and 4 rows), the saved weights;
    with label smoothing on a Mixtral with its router loss (the Trainer's loss, not the model's:
    computed from the pipeline's logits, without the router's loss; see [Note: a trainer's own
    loss on the pipeline]), the logs."""
    from transformers import AutoModelForCausalLM, Trainer

    reference = _reference(str(tmp_path / "reference"), **_metrics_options())
    want_metrics = reference.evaluate()
    want_eval = want_metrics["eval_loss"]
    want = _logs(reference)
    torch.manual_seed(0)
    smoothed = Trainer(
        model=mixtral(router_loss=True)[0],
        args=_args(str(tmp_path / "smoothed"), label_smoothing_factor=0.1),
        train_dataset=_Rows(4, seed=100),
    )
    smoothed.train()
    out = run_ranks(2, _pipeline_run, str(tmp_path), timeout=300)
    assert len(want) == 4
    for logs, metrics, refused, smoothed_logs in out:
        for run, ref_run in ((logs, want), (smoothed_logs, _logs(smoothed))):
            assert len(run) == len(ref_run) == 4
            for step, (got, ref) in enumerate(zip(run, ref_run, strict=True)):
                for key in LOGGED:
                    assert got[key] == pytest.approx(ref[key], rel=2e-6, abs=1e-7), (step, key)
        assert metrics["eval_loss"] == pytest.approx(want_eval, rel=2e-6)
        assert metrics["eval_rows"] == want_metrics["eval_rows"] == 12
        assert metrics["eval_accuracy"] == want_metrics["eval_accuracy"] > 0
        assert "not divisible by num_microbatches=2" in refused["batch"]
        assert "compile=True in the PipelineConfig" in refused["compile"]
        assert "save_only_model" in refused["saves"]
        assert all("\n" not in text for text in refused.values())
    saved = AutoModelForCausalLM.from_pretrained(tmp_path / "model")
    trained = dict(reference.model.named_parameters())
    for name, p in saved.named_parameters():
        torch.testing.assert_close(p, trained[name], rtol=1e-5, atol=2e-5, msg=name)


def _mesh_run(rank, world, directory):
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "pp"))
    trainer = _mesh_trainer(f"{directory}/mesh", mesh, replicas=2)
    trainer.train()
    metrics = trainer.evaluate()
    trainer.save_model(f"{directory}/mesh-model")
    sft = _pipelined_sft(
        _mesh_sft_args(f"{directory}/mesh-sft", 2), _sft_data(), eval_dataset=_sft_eval(), mesh=mesh
    )
    sft.train()
    sft_logs = _logs(sft, (*LOGGED, *SFT_METRICS)), sft.evaluate()
    return _logs(trainer), metrics, trainer.state.train_batch_size, sft_logs


def _mesh_trainer(out: str, mesh, replicas: int):
    """``px.PipelineTrainer`` on ``mesh`` with :func:`_reference`'s model, data and arguments,
    its global batch of 4 rows (eval 8) over ``replicas``, with ``compute_metrics``."""
    torch.manual_seed(0)
    model, layer_cls = llama()
    rows = dict(per_device_train_batch_size=4 // replicas, per_device_eval_batch_size=8 // replicas)
    return px.PipelineTrainer(
        model=model,
        args=_args(out, **rows),
        train_dataset=_Rows(4, seed=100),
        eval_dataset=_eval_rows(),
        layer_cls=layer_cls,
        pipeline=px.PipelineConfig(num_microbatches=2),
        mesh=mesh,
        **_metrics_options(),
    )


def _mesh_sft_args(out: str, replicas: int):
    """TRL's ``SFTConfig`` for 1 step in fp32 without checkpointing, the global batch of 4 rows
    (eval 8) over ``replicas``."""
    from trl import SFTConfig

    rows = dict(per_device_train_batch_size=4 // replicas, per_device_eval_batch_size=8 // replicas)
    steps = dict(max_steps=1, warmup_steps=0, gradient_checkpointing=False)
    return SFTConfig(**_options(out, bf16=False, **steps, **rows))


def _sft_eval():
    """12 rows for TRL's evaluation: batches of 8 and 4."""
    return _sft_data().select(range(20, 32))


def test_pipeline_trainer_on_a_data_x_pipeline_mesh_trains_as_one_process_with_the_global_batch(
    tmp_path,
):
    """dp=2 x pp=2: each replica takes the share of the global batch that HF's sharded loader
    gives a DDP rank; the logs, the eval loss and ``compute_metrics`` (batches of 8 and 4 rows,
    each replica's logits gathered) and the saved weights equal the Trainer's in one process with
    the global batch (2 rows per replica: 4). TRL's ``SFTTrainer`` (fp32, 1 step) on the same
    mesh logs
    TRL's losses and metrics (``entropy``, ``mean_token_accuracy``, ``num_tokens``: the replicas'
    token sums added up), in training and evaluation."""
    from transformers import AutoModelForCausalLM

    reference = _reference(str(tmp_path / "reference"), **_metrics_options())
    want_metrics = reference.evaluate()
    want = _logs(reference)
    sft = _sft_reference(
        _mesh_sft_args(str(tmp_path / "sft"), 1), _sft_data(), eval_dataset=_sft_eval()
    )
    sft.train()
    want_sft, want_sft_eval = _logs(sft, (*LOGGED, *SFT_METRICS)), sft.evaluate()
    assert want_sft_eval["eval_mean_token_accuracy"] > 0  # some label is the argmax
    for logs, metrics, per_device, (sft_logs, sft_eval) in run_ranks(
        4, _mesh_run, str(tmp_path), timeout=300
    ):
        for got, ref in zip(sft_logs, want_sft, strict=True):
            for key in (*LOGGED, *SFT_METRICS):
                assert got[key] == pytest.approx(ref[key], rel=1e-5, abs=1e-7), (key, got, ref)
        for key in ("loss", *SFT_METRICS):
            got, ref = sft_eval[f"eval_{key}"], want_sft_eval[f"eval_{key}"]
            assert got == pytest.approx(ref, rel=1e-5, abs=1e-7), (key, got, ref)
        assert per_device == 2 and len(logs) == len(want) == 4
        for step, (got, ref) in enumerate(zip(logs, want, strict=True)):
            for key in LOGGED:
                assert got[key] == pytest.approx(ref[key], rel=2e-6, abs=1e-7), (step, key)
        assert metrics["eval_loss"] == pytest.approx(want_metrics["eval_loss"], rel=2e-6)
        assert metrics["eval_rows"] == want_metrics["eval_rows"] == 12
        assert metrics["eval_accuracy"] == want_metrics["eval_accuracy"] > 0
    saved = AutoModelForCausalLM.from_pretrained(tmp_path / "mesh-model")
    trained = dict(reference.model.named_parameters())
    for name, p in saved.named_parameters():
        torch.testing.assert_close(p, trained[name], rtol=1e-5, atol=2e-5, msg=name)


TENSOR_PARALLEL = {
    # name: family, mesh (dp, pp, tp), HF's optim ("foreach": torch's AdamW with foreach=True
    # through optimizer_cls_and_kwargs, the path torch takes on GPUs for "adamw_torch" and forced
    # here on CPU, where it would take its per-tensor loop), learning rate (SGD's large enough
    # that its step shows in the saved weights)
    "qwen2": ("qwen2", (1, 2, 2), "adamw_torch_fused", 1e-3),
    "qwen2-adamw": ("qwen2", (1, 2, 2), "adamw_torch", 1e-3),
    "qwen2-foreach": ("qwen2", (1, 2, 2), "foreach", 1e-3),
    "qwen2-sgd": ("qwen2", (1, 2, 2), "sgd", 1.0),
    "qwen3-tied": ("qwen3_tied", (1, 2, 2), "adamw_torch_fused", 1e-3),
    "llama": ("llama", (1, 2, 2), "adamw_torch_fused", 1e-3),
    "llama-adagrad": ("llama", (1, 2, 2), "adagrad", 1e-3),
    "llama-rmsprop": ("llama", (1, 2, 2), "rmsprop", 1e-3),
    "qwen2-dp": ("qwen2", (2, 1, 2), "adamw_torch_fused", 1e-3),
    "qwen2-dp-foreach": ("qwen2", (2, 1, 2), "foreach", 1e-3),
}
"""The Trainer on tensor-parallel meshes with each optimizer (see [Note: optimizer groups by
mesh]): Qwen2's sharded q/k/v biases sit beside its whole norms in HF's group without weight
decay, a tied Qwen3's whole embedding (2 layers) beside its sharded projections in the group with
it; Llama's groups each hold one kind."""


def _tp_case(directory: str, name: str, replicas: int = 1) -> tuple:
    """``TENSOR_PARALLEL[name]``'s model, ``TrainingArguments`` (2 steps without warm-up: both
    update the weights, the second's logs read the first's update; ``replicas`` data-parallel
    replicas share the global batch of 4 rows) and Trainer keywords."""
    import models

    family, shape, optim, lr = TENSOR_PARALLEL[name]
    rows = 4 // replicas
    options = dict(max_steps=2, warmup_steps=0, learning_rate=lr, per_device_train_batch_size=rows)
    kwargs = {}
    if optim == "foreach":
        adamw = dict(lr=lr, betas=(0.9, 0.999), eps=1e-6, foreach=True)
        kwargs["optimizer_cls_and_kwargs"] = (torch.optim.AdamW, adamw)
    else:
        options["optim"] = optim
    torch.manual_seed(0)
    if family == "qwen3_tied":
        model, layer_cls = models.tiny("qwen3", layers=2, tie_word_embeddings=True)
    else:
        model, layer_cls = getattr(models, family)()
    return model, layer_cls, _args(f"{directory}/{name}", **options), kwargs


def _tensor_parallel_run(rank, world, directory):
    from torch.distributed.device_mesh import init_device_mesh

    logs, metrics = {}, None
    for name, (_, shape, _, _) in TENSOR_PARALLEL.items():
        model, layer_cls, args, kwargs = _tp_case(directory, name, shape[0])
        trainer = px.PipelineTrainer(
            model=model,
            args=args,
            train_dataset=_Rows(2, seed=100),
            eval_dataset=_eval_rows() if name == "qwen2" else None,
            layer_cls=layer_cls,
            pipeline=px.PipelineConfig(num_microbatches=2, tensor_parallel="auto"),
            mesh=init_device_mesh("cpu", shape, mesh_dim_names=("dp", "pp", "tp")),
            **kwargs,
        )
        trainer.train()
        logs[name] = _logs(trainer)
        metrics = trainer.evaluate() if name == "qwen2" else metrics
        trainer.save_model(f"{directory}/{name}-model")
    with pytest.raises(ValueError, match="PipelineTrainer cannot run") as refused:
        px.PipelineTrainer(
            model=llama()[0],
            args=_args(f"{directory}/adafactor", optim="adafactor"),
            train_dataset=_Rows(1, seed=0),
            pipeline=px.PipelineConfig(num_microbatches=2, tensor_parallel="auto"),
            mesh=init_device_mesh("cpu", (1, 2, 2), mesh_dim_names=("dp", "pp", "tp")),
        )
    return logs, metrics["eval_loss"], str(refused.value)


@needs_hf_tensor_parallel
def test_pipeline_trainer_on_tensor_parallel_meshes_with_each_optimizer_trains_as_one_process(
    tmp_path,
):
    """pp=2 x tp=2 and dp=2 x tp=2 (4 ranks, ``tensor_parallel="auto"``) with HF's default fused
    AdamW, ``adamw_torch``, foreach AdamW, SGD, Adagrad and RMSprop: the logs (loss, clipped
    gradient norm, learning rate), the eval loss and the saved weights equal the Trainer's in one
    process on the global batch, for Qwen2 (its sharded biases and whole norms in one of HF's
    groups: the fused step failed on DTensors mixed with tensors before), a tied Qwen3 (its whole
    embedding beside sharded projections: failed alike) and Llama (no bias).
    Adafactor is refused on such a mesh, in one line."""
    from transformers import AutoModelForCausalLM, Trainer

    want, trained, want_eval = {}, {}, None
    for name in TENSOR_PARALLEL:
        model, _, args, kwargs = _tp_case(str(tmp_path / "reference"), name)
        eval_rows = _eval_rows() if name == "qwen2" else None
        reference = Trainer(
            model=model,
            args=args,
            train_dataset=_Rows(2, seed=100),
            eval_dataset=eval_rows,
            **kwargs,
        )
        reference.train()
        want[name], trained[name] = _logs(reference), dict(reference.model.named_parameters())
        want_eval = reference.evaluate()["eval_loss"] if name == "qwen2" else want_eval
    for logs, eval_loss, refused in run_ranks(4, _tensor_parallel_run, str(tmp_path), timeout=300):
        for name, ref_logs in want.items():
            assert len(logs[name]) == len(ref_logs) == 2, name
            for step, (got, ref) in enumerate(zip(logs[name], ref_logs, strict=True)):
                for key in LOGGED:
                    where = f"{name} step {step} {key}"
                    assert got[key] == pytest.approx(ref[key], rel=1e-5, abs=1e-7), where
        assert eval_loss == pytest.approx(want_eval, rel=2e-6)
        assert "optim='adafactor'" in refused and "plain tensors" in refused, refused
        assert "\n" not in refused
    for name, (_, _, optim, _) in TENSOR_PARALLEL.items():
        # Adagrad's first step is lr * g / (|g| + eps) per element, RMSprop's lr * g / (0.1 |g| +
        # eps): a fixed size whatever the gradient's, so an element whose gradient is within a
        # few eps of zero moves with the last bits of its gradient, which the tp ranks sum in
        # another order. Measured up to 2.8e-5 (a step is 1e-3 or 1e-2); the AdamWs and SGD on
        # Qwen2 and Llama within 1.5e-6.
        atol = 1e-4 if optim in ("adagrad", "rmsprop") else 2e-5
        saved = AutoModelForCausalLM.from_pretrained(tmp_path / f"{name}-model")
        for key, p in saved.named_parameters():
            where = f"{name} {key}"
            torch.testing.assert_close(
                p, trained[name][key], rtol=1e-5, atol=atol, msg=lambda m, w=where: f"{w}: {m}"
            )


def _family(name: str):
    import models

    return models.mixtral(router_loss=True) if name == "mixtral" else getattr(models, name)()


def _family_run(rank, world, directory, family, schedule, microbatches):
    torch.manual_seed(0)
    model, layer_cls = _family(family)
    trainer = px.PipelineTrainer(
        model=model,
        args=_args(f"{directory}/{family}", max_steps=2),
        train_dataset=_Rows(2, seed=100),
        eval_dataset=_eval_rows(),
        layer_cls=layer_cls,
        pipeline=px.PipelineConfig(num_microbatches=microbatches, schedule=schedule),
    )
    trainer.train()
    return _logs(trainer), trainer.evaluate()["eval_loss"]


@pytest.mark.parametrize(
    "family, schedule, microbatches",
    [("gpt2", "zbh1", 2), ("qwen2", "interleaved", 2), ("mixtral", "gpipe", 1)],
)
def test_pipeline_trainer_equals_the_trainer_for_other_families_and_schedules(
    tmp_path, family, schedule, microbatches
):
    """GPT-2 (tied head, learned positions, no ``loss_type``: HF counts its labels its own way)
    under ZB-H1, Qwen2 under interleaved 1F1B, Mixtral with its router loss under GPipe: the
    Trainer's logs and eval loss. Mixtral in one microbatch: the pipeline adds a router loss per
    microbatch (see [Note: added loss terms per microbatch]), the Trainer one per batch."""
    from transformers import Trainer

    torch.manual_seed(0)
    model, _ = _family(family)
    reference = Trainer(
        model=model,
        args=_args(str(tmp_path / "reference"), max_steps=2),
        train_dataset=_Rows(2, seed=100),
        eval_dataset=_eval_rows(),
    )
    reference.train()
    want, want_eval = _logs(reference), reference.evaluate()["eval_loss"]
    out = run_ranks(2, _family_run, str(tmp_path), family, schedule, microbatches, timeout=300)
    for logs, eval_loss in out:
        assert len(logs) == len(want) == 2 and all(g["grad_norm"] for g in logs)
        for step, (got, ref) in enumerate(zip(logs, want, strict=True)):
            for key in LOGGED:
                assert got[key] == pytest.approx(ref[key], rel=1e-5, abs=1e-7), (step, key)
        assert eval_loss == pytest.approx(want_eval, rel=2e-6)


def _with_a_counter():
    """A ``Trainer`` that saves a counter of its own in its checkpoints and reads it back, each
    time after the Trainer's own saving and loading (as TRL's ``GRPOTrainer`` extends them)."""
    import json
    import os

    from transformers import Trainer

    class Counting(Trainer):
        counter = 0

        def _save_optimizer_and_scheduler(self, output_dir):
            super()._save_optimizer_and_scheduler(output_dir)
            self.counter += 1
            with open(os.path.join(output_dir, "counter.json"), "w") as f:
                json.dump(self.counter, f)

        def _load_optimizer_and_scheduler(self, checkpoint):
            super()._load_optimizer_and_scheduler(checkpoint)
            if checkpoint is not None:
                with open(os.path.join(checkpoint, "counter.json")) as f:
                    self.counter = json.load(f)

    return Counting


def _resumed(rank, world, directory):
    """Four steps saving every two, then a new trainer resumed from the checkpoint of step 2:
    its steps 3 and 4 log what the uninterrupted run logged, bit for bit, and it ends with the
    same weights; a subclass's own saving and loading ran besides the pipeline's."""

    def trainer(out):
        torch.manual_seed(0)
        model, layer_cls = llama()
        return px.pipelined(_with_a_counter())(
            model=model,
            args=_args(out, save_strategy="steps", save_steps=2),
            train_dataset=_Rows(4, seed=100),
            layer_cls=layer_cls,
            pipeline=px.PipelineConfig(num_microbatches=2),
        )

    whole = trainer(f"{directory}/whole")
    whole.train()
    again = trainer(f"{directory}/again")
    again.train(resume_from_checkpoint=f"{directory}/whole/checkpoint-2")
    ends = [dict(t.pipe.named_parameters()) for t in (whole, again)]
    assert ends[0].keys() == ends[1].keys()
    for name, p in ends[0].items():
        assert torch.equal(p, ends[1][name]), name
    assert (whole.counter, again.counter) == (2, 2)  # saved at steps 2 and 4; 1 read back, +1
    return _logs(whole), _logs(again)


def test_pipeline_trainer_resumes_from_its_checkpoint_exactly(tmp_path):
    for whole, again in run_ranks(2, _resumed, str(tmp_path), timeout=300):
        # The resumed history: steps 1-2 from the checkpoint's trainer state, 3-4 run again.
        assert len(whole) == 4 and again == whole, (whole, again)


def _lora(model):
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    return get_peft_model(model, config)


def _lora_run(rank, world, directory):
    torch.manual_seed(0)
    model, layer_cls = llama()
    trainer = px.PipelineTrainer(
        model=_lora(model),
        args=_args(f"{directory}/lora-run", max_steps=2),
        train_dataset=_Rows(2, seed=100),
        layer_cls=layer_cls,
        pipeline=px.PipelineConfig(num_microbatches=2),
    )
    trainer.train()
    trainer.save_model(f"{directory}/lora")
    return _logs(trainer)


def test_pipeline_trainer_fine_tunes_lora_as_the_trainer_does(tmp_path):
    """A PEFT model: the same logs as the Trainer in one process, and ``save_model`` writes the
    adapter PEFT writes (every stage's adapter tensors, equal to the reference's)."""
    from safetensors.torch import load_file
    from transformers import Trainer

    torch.manual_seed(0)
    model, _ = llama()
    reference = Trainer(
        model=_lora(model),
        args=_args(str(tmp_path / "reference"), max_steps=2),
        train_dataset=_Rows(2, seed=100),
    )
    reference.train()
    reference.save_model(str(tmp_path / "reference-adapter"))
    want = _logs(reference)
    for logs in run_ranks(2, _lora_run, str(tmp_path), timeout=300):
        assert len(logs) == len(want) == 2
        for got, ref in zip(logs, want, strict=True):
            for key in LOGGED:
                assert got[key] == pytest.approx(ref[key], rel=2e-6, abs=1e-7), key
    ours = load_file(tmp_path / "lora" / "adapter_model.safetensors")
    theirs = load_file(tmp_path / "reference-adapter" / "adapter_model.safetensors")
    assert ours.keys() == theirs.keys() and ours
    for key in ours:
        torch.testing.assert_close(ours[key], theirs[key], rtol=1e-5, atol=2e-5, msg=key)


def _bf16_run(rank, world, directory):
    torch.manual_seed(0)
    model, layer_cls = llama()
    trainer = px.PipelineTrainer(
        model=model,
        args=_args(f"{directory}/bf16", max_steps=2, bf16=True),
        train_dataset=_Rows(2, seed=100),
        layer_cls=layer_cls,
        pipeline=px.PipelineConfig(num_microbatches=2),
    )
    seen = []
    for stage in trainer.pipe.local_stages:
        layer = next(m for m in stage.module.modules() if isinstance(m, layer_cls))
        layer.register_forward_hook(
            lambda *_: seen.append(
                torch.is_autocast_enabled("cpu") and torch.get_autocast_dtype("cpu")
            )
        )
    trainer.train()
    return _logs(trainer), set(seen)


def test_pipeline_trainer_runs_the_stages_under_the_trainers_bf16_autocast(tmp_path):
    """``bf16=True``: accelerate's autocast wraps the model's forward, which the stages never
    call; the stages run under it all the same, and the logs agree with the Trainer in one
    process within bf16's rounding (the microbatches' products round differently)."""
    from transformers import Trainer

    torch.manual_seed(0)
    model, _ = llama()
    reference = Trainer(
        model=model,
        args=_args(str(tmp_path / "reference"), max_steps=2, bf16=True),
        train_dataset=_Rows(2, seed=100),
    )
    reference.train()
    want = _logs(reference)
    for logs, autocast in run_ranks(2, _bf16_run, str(tmp_path), timeout=300):
        assert autocast == {torch.bfloat16}, autocast
        for got, ref in zip(logs, want, strict=True):
            assert got["loss"] == pytest.approx(ref["loss"], rel=1e-3)
            assert got["grad_norm"] == pytest.approx(ref["grad_norm"], rel=1e-2)


def _tokenizer():
    """A word-level tokenizer of the tiny models' 256 ids, made here: ``<pad>``, ``<unk>``,
    ``</s>``, then ``t3`` ... ``t255`` (words, also where TRL joins texts without a space)."""
    from tokenizers import Regex, Tokenizer
    from tokenizers import pre_tokenizers as pre
    from tokenizers.models import WordLevel
    from transformers import PreTrainedTokenizerFast

    special = ["<pad>", "<unk>", "</s>"]
    vocab = {**{t: i for i, t in enumerate(special)}, **{f"t{i}": i for i in range(3, 256)}}
    tokenizer = Tokenizer(WordLevel(vocab, unk_token="<unk>"))
    words = pre.Split(Regex(r"t\d+"), "isolated")
    tokenizer.pre_tokenizer = pre.Sequence([pre.WhitespaceSplit(), words])
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, pad_token="<pad>", unk_token="<unk>", eos_token="</s>"
    )


def _sft_args(out: str):
    from trl import SFTConfig

    return SFTConfig(**_options(out, max_steps=3))


def _sft_data():
    """Pre-tokenized rows of 6-15 tokens (TRL pads each batch to its longest row)."""
    from datasets import Dataset

    g = torch.Generator().manual_seed(0)
    lengths = torch.randint(6, 16, (32,), generator=g).tolist()
    return Dataset.from_dict(
        {"input_ids": [torch.randint(3, 256, (n,), generator=g).tolist() for n in lengths]}
    )


def _sft_config():
    from peft import LoraConfig

    return LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False)


def _pipelined_sft(args, dataset, **options):
    """TRL's ``SFTTrainer`` through ``px.pipelined`` on the tiny Llama (2 microbatches)."""
    from trl import SFTTrainer

    torch.manual_seed(0)
    model, layer_cls = llama()
    return px.pipelined(SFTTrainer)(
        model=model,
        args=args,
        train_dataset=dataset,
        processing_class=_tokenizer(),
        layer_cls=layer_cls,
        pipeline=px.PipelineConfig(num_microbatches=2),
        **options,
    )


def _sft_reference(args, dataset, **options):
    """TRL's ``SFTTrainer`` in this process on the tiny Llama: the reference."""
    from trl import SFTTrainer

    torch.manual_seed(0)
    model, _ = llama()
    return SFTTrainer(
        model=model, args=args, train_dataset=dataset, processing_class=_tokenizer(), **options
    )


SFT_METRICS = ("entropy", "mean_token_accuracy", "num_tokens")
"""What TRL's ``SFTTrainer`` logs besides the Trainer's: on the pipeline, from the sums its last
stage computes beside the loss (see [Note: token sums beside the loss])."""


def _sft_run(rank, world, directory):
    trainer = _pipelined_sft(_sft_args(f"{directory}/sft"), _sft_data(), peft_config=_sft_config())
    trainer.train()
    return _logs(trainer, (*LOGGED, *SFT_METRICS))


@pytest.mark.compat
def test_trl_sft_trainer_with_lora_on_the_pipeline_logs_as_trl_does(tmp_path):
    """TRL's ``SFTTrainer`` with ``peft_config=`` (LoRA), its defaults (bf16 autocast, gradient
    checkpointing) and dynamically padded batches, through ``px.pipelined``: the same logged
    losses, grad norms and TRL's metrics (entropy, token accuracy, token count) as TRL in one
    process, within bf16's rounding."""
    reference = _sft_reference(
        _sft_args(str(tmp_path / "reference")), _sft_data(), peft_config=_sft_config()
    )
    reference.train()
    want = _logs(reference, (*LOGGED, *SFT_METRICS))
    assert any(h["mean_token_accuracy"] > 0 for h in want)  # some label is the argmax
    for logs in run_ranks(2, _sft_run, str(tmp_path), timeout=300):
        assert len(logs) == len(want) == 3
        for got, ref in zip(logs, want, strict=True):
            assert got["loss"] == pytest.approx(ref["loss"], rel=1e-4), (got, ref)
            assert got["grad_norm"] == pytest.approx(ref["grad_norm"], rel=1e-2), (got, ref)
            assert got["learning_rate"] == pytest.approx(ref["learning_rate"], rel=1e-6)
            assert got["num_tokens"] == ref["num_tokens"]
            for key in ("entropy", "mean_token_accuracy"):
                assert got[key] == pytest.approx(ref[key], rel=1e-5), (key, got, ref)


def _documents():
    """Prompt-completion texts of 1-3 and 1-4 words: TRL's completion-only loss (labels on the
    completions), packed by TRL into rows of up to 16 tokens, several documents a row."""
    from datasets import Dataset

    g = torch.Generator().manual_seed(0)

    def text(most: int) -> str:
        n = int(torch.randint(1, most + 1, (1,), generator=g))
        return " ".join(f"t{int(i)}" for i in torch.randint(3, 256, (n,), generator=g))

    return Dataset.from_list([{"prompt": text(3), "completion": text(4)} for _ in range(64)])


def _packed_args(out: str):
    from trl import SFTConfig

    options = _options(out, max_steps=3, bf16=False, packing=True, max_length=16)
    return SFTConfig(**options)


def _packed_run(rank, world, directory):
    trainer = _pipelined_sft(_packed_args(f"{directory}/packed"), _documents())
    batch = next(iter(trainer.get_train_dataloader()))
    trainer.train()
    return _logs(trainer, (*LOGGED, *SFT_METRICS)), batch, trainer.pipe.pipeline_config.input_names


@pytest.mark.compat
def test_trl_packed_completion_only_sft_on_the_pipeline_logs_as_trl_does(tmp_path):
    """TRL's ``packing=True`` with a prompt-completion dataset (completion-only loss): TRL's
    padding-free batch is one row, which the pipeline takes as rows (each packed example a row,
    positions restarting at every document, one causal block per document); the logged losses,
    grad norms and TRL's metrics (entropy, token accuracy, token count) equal TRL's in one
    process, whose batch is the single flattened row."""
    reference = _sft_reference(_packed_args(str(tmp_path / "reference")), _documents())
    flat = next(iter(reference.get_train_dataloader()))
    reference.train()
    want = _logs(reference, (*LOGGED, *SFT_METRICS))
    assert any(h["mean_token_accuracy"] > 0 for h in want)  # some label is the argmax
    for logs, batch, names in run_ranks(2, _packed_run, str(tmp_path), timeout=300):
        assert names == ("input_ids", "position_ids") and "attention_mask" not in batch
        # The rows hold the flattened row's tokens, labels and positions, several documents each.
        rows = batch["input_ids"].shape[0]
        assert rows == 4 and flat["input_ids"].shape[0] == 1
        real = batch["labels"] != -100
        assert torch.equal(batch["input_ids"][batch["input_ids"] != 0], flat["input_ids"][0])
        assert torch.equal(batch["labels"][real], flat["labels"][flat["labels"] != -100])
        assert int((batch["position_ids"][:, 1:] == 0).logical_and(real[:, 1:]).sum()) == 0
        assert (flat["position_ids"] == 0).sum() > 2 * rows  # documents restart inside rows
        assert len(logs) == len(want) == 3
        for got, ref in zip(logs, want, strict=True):
            for key in (*LOGGED, *SFT_METRICS):
                assert got[key] == pytest.approx(ref[key], rel=1e-5, abs=1e-7), (key, got, ref)


def test_sft_example_learns_saves_hf_reloads_and_resumes_bit_for_bit(tmp_path, monkeypatch):
    """``examples/sft.py`` under torchrun (2 ranks), with few steps, checkpointing every 12: the
    loss falls, the model directory is HF's, and HF's model loaded from it in one process gives
    the pipeline's loss. Then the same run with its last rank killed after step 13 and the job
    restarted by torchrun (``--max-restarts 1``): it resumes from ``checkpoint-12`` and ends with
    the uninterrupted run's eval loss and saved weights, bit for bit. (The first run is the
    second's reference: each torchrun launch costs its ranks' imports, TRL's among them.)"""
    from safetensors.torch import load_file
    from test_materialize import ROOT, torchrun

    # A new store per attempt, as docs/checkpoints.md launches it. Without it the agent's store
    # keeps the killed attempt's keys, the restarted ranks read a dead rank's gloo address and
    # the restart fails ([Note: torchrun's store across restarts]).
    monkeypatch.setenv("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
    script = ROOT / "examples" / "sft.py"
    flags = ("--steps", "16", "--save-every", "12", "--max-chars", "60000", "--seq", "64")
    whole = torchrun(2, script, *flags, "--out", str(tmp_path / "whole"), cwd=tmp_path)
    losses = [float(x) for x in re.findall(r"^step +\d+ +loss ([\d.]+)", whole, re.M)]
    assert len(losses) >= 2 and losses[-1] < losses[0] - 0.3, whole
    assert (tmp_path / "whole" / "model" / "model.safetensors.index.json").is_file()
    pipe_loss, hf_loss = map(
        float, re.search(r"pipeline ([\d.]+), HF in one process ([\d.]+)", whole).groups()
    )
    assert abs(pipe_loss - hf_loss) < 1e-4, whole
    assert "greedy continuation" in whole

    killed = torchrun(
        2,
        script,
        *(*flags, "--out", str(tmp_path / "killed"), "--die-at-step", "13"),
        cwd=tmp_path,
        launcher=("--max-restarts", "1"),
    )
    assert "killing itself after step 13" in killed and "resuming from" not in whole
    assert re.search(r"resuming from \S+checkpoint-12$", killed, re.M), killed[-2000:]
    evals = [re.search(r"^eval loss (\S+);", out, re.M).group(1) for out in (whole, killed)]
    assert evals[0] == evals[1], evals  # every bit of the float's repr
    for name in ("model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"):
        ours, theirs = (load_file(tmp_path / run / "model" / name) for run in ("killed", "whole"))
        assert ours.keys() == theirs.keys()
        assert all(torch.equal(ours[k], theirs[k]) for k in ours), name


def _even_tokens(completions, **_):
    """GRPO's reward: the share of a completion's words that are even token ids (``t12``)."""
    return [
        sum(int(w[1:]) % 2 == 0 for w in c.split()) / max(len(c.split()), 1) for c in completions
    ]


def _prompts():
    from datasets import Dataset

    g = torch.Generator().manual_seed(0)
    words = torch.randint(3, 256, (24, 4), generator=g).tolist()
    return Dataset.from_list([{"prompt": " ".join(f"t{t}" for t in row)} for row in words])


def _grpo(trainer_cls, out: str, lora: bool, replicas: int = 1, **options):
    """TRL's ``GRPOTrainer`` (or its pipelined class) on the tiny Llama in fp32: 4 prompts a
    step, 2 completions each (sampled at temperature 0.8), accumulation 2. The whole model with
    two optimizer iterations per generation (the old log-probabilities come from
    ``self.model``) and ``bnpo`` (divided by the batch's tokens); or LoRA (``peft_config=``,
    adapters not zero at the start) with a KL term to the reference, the base model (PEFT's
    adapters disabled), and TRL's default ``dapo`` loss. ``replicas``: processes or replicas
    sharing those rows."""
    from trl import GRPOConfig

    variant = dict(num_iterations=2, loss_type="bnpo")
    if lora:
        variant = dict(beta=0.1)
        options["peft_config"] = _sft_config()
    rows = _rows(4 // replicas, 4 // replicas)
    options["eval_dataset"] = _prompts().select(range(4))
    return _sampling(trainer_cls, GRPOConfig(**_sampled(out, rows), **variant), **options)


def _sampled(out: str, rows: dict) -> dict:
    """The arguments of :func:`_grpo` and :func:`_rloo`: 3 steps in fp32, 2 completions of 5
    tokens per prompt, sampled at temperature 0.8."""
    options = _options(out, max_steps=3, bf16=False, **rows)
    return dict(options, num_generations=2, max_completion_length=5, temperature=0.8)


def _sampling(trainer_cls, args, **options):
    """``trainer_cls`` (TRL's ``GRPOTrainer`` or ``RLOOTrainer``, or its pipelined class) on the
    tiny Llama, rewarded by :func:`_even_tokens` on :func:`_prompts`."""
    torch.manual_seed(0)
    model, _ = llama()
    return trainer_cls(
        model=model,
        reward_funcs=_even_tokens,
        args=args,
        train_dataset=_prompts(),
        processing_class=_tokenizer(),
        **options,
    )


def _rows(train: int, evaluation: int) -> dict:
    return dict(per_device_train_batch_size=train, per_device_eval_batch_size=evaluation)


GRPO_LOGGED = ("loss", "grad_norm", "learning_rate", "reward", "reward_std", "entropy", "kl")


def _rloo(trainer_cls, out: str, **options):
    """TRL's ``RLOOTrainer`` (or its pipelined class) on the tiny Llama in fp32, as
    :func:`_grpo`'s whole model: 4 prompts a step, 2 completions each, accumulation 2; without
    a KL term (``beta=0``: TRL would load the reference from the model's hub id)."""
    from trl import RLOOConfig

    return _sampling(trainer_cls, RLOOConfig(**_sampled(out, _rows(4, 4)), beta=0.0), **options)


def _grpo_run(rank, world, directory):
    from trl import GRPOTrainer, RLOOTrainer

    runs = {}
    for lora in (False, True):
        trainer = _grpo(
            px.pipelined(GRPOTrainer),
            f"{directory}/grpo{lora}",
            lora,
            layer_cls=llama()[1],
            pipeline=px.PipelineConfig(num_microbatches=2),
        )
        trainer.train()
        metrics = trainer.evaluate()
        trainer.save_model(f"{directory}/model{lora}")
        runs[lora] = _logs(trainer, GRPO_LOGGED), metrics
    options = dict(layer_cls=llama()[1], pipeline=px.PipelineConfig(num_microbatches=2))
    rloo = _rloo(px.pipelined(RLOOTrainer), f"{directory}/rloo", **options)
    rloo.train()
    return runs, _logs(rloo, GRPO_LOGGED[:5])


def _saved(directory) -> dict:
    from safetensors.torch import load_file

    saved = {}
    for part in sorted(directory.glob("*.safetensors")):  # each stage's tensors
        saved.update(load_file(part))
    return saved


@pytest.mark.compat
def test_trl_grpo_generates_on_the_pipeline_and_trains_as_trl_in_one_process(tmp_path):
    """TRL's ``GRPOTrainer`` through ``px.pipelined``: completions sampled by ``pipe.generate``
    on the pipeline that trains, rewarded, and its loss (computed outside the model) trained
    through the pipeline in a second pass (see [Note: a trainer's own loss on the pipeline]):
    the same rewards (the same sampled tokens), losses, grad norms, KL to the reference, eval
    loss and saved weights (or adapter) as TRL in one process with the same seed. TRL's
    ``RLOOTrainer`` too (issue 73 item 5), in the same ranks: its rewards, losses and grad
    norms."""
    from trl import GRPOTrainer, RLOOTrainer

    want = {}
    for lora in (False, True):
        reference = _grpo(GRPOTrainer, str(tmp_path / f"reference{lora}"), lora)
        reference.train()
        want[lora] = _logs(reference, GRPO_LOGGED), reference.evaluate()
        reference.save_model(str(tmp_path / f"reference{lora}"))
    rloo = _rloo(RLOOTrainer, str(tmp_path / "rloo_reference"))
    rloo.train()
    rloo_want = _logs(rloo, GRPO_LOGGED[:5])
    assert len(rloo_want) == 3 and all(ref["grad_norm"] > 0 for ref in rloo_want)
    for runs, rloo_logs in run_ranks(2, _grpo_run, str(tmp_path), timeout=300):
        assert [got["reward"] for got in rloo_logs] == [ref["reward"] for ref in rloo_want]
        for got, ref in zip(rloo_logs, rloo_want, strict=True):
            for k in ("loss", "grad_norm", "learning_rate", "reward_std"):
                assert got[k] == pytest.approx(ref[k], rel=1e-4, abs=1e-7), (k, got, ref)
        for lora, (logs, metrics) in runs.items():
            ref_logs, ref_metrics = want[lora]
            assert len(logs) == len(ref_logs) == 3
            assert all(ref["grad_norm"] > 0 for ref in ref_logs)  # rewards that differ
            assert [got["reward"] for got in logs] == [ref["reward"] for ref in ref_logs]
            assert all((ref["kl"] or 0) > 0 for ref in ref_logs) == lora
            for got, ref in zip(logs, ref_logs, strict=True):
                assert got["reward_std"] == ref["reward_std"]
                for k in ("loss", "grad_norm", "entropy", "kl", "learning_rate"):
                    want_k = ref[k] if ref[k] is None else pytest.approx(ref[k], rel=1e-4, abs=1e-7)
                    assert got[k] == want_k, (lora, k, got, ref)
            assert metrics["eval_reward"] == ref_metrics["eval_reward"]
            eval_loss = pytest.approx(ref_metrics["eval_loss"], rel=1e-4, abs=1e-7)
            assert metrics["eval_loss"] == eval_loss
    for lora in (False, True):
        saved, weights = (_saved(tmp_path / f"{d}{lora}") for d in ("model", "reference"))
        assert saved.keys() == weights.keys() and len(saved) == (16 if lora else 39)
        for name, tensor in saved.items():
            torch.testing.assert_close(tensor, weights[name], rtol=1e-4, atol=1e-5, msg=name)


def _dft_args(out: str):
    from trl import SFTConfig

    options = _options(out, max_steps=3, bf16=False)
    return SFTConfig(**options, loss_type="dft", gradient_checkpointing=False)


def _preferences():
    """Prompts of 4 words, chosen completions of 3 and rejected ones of 2 (DPO)."""
    from datasets import Dataset

    g = torch.Generator().manual_seed(0)

    def words(n: int) -> str:
        return " ".join(f"t{t}" for t in torch.randint(3, 256, (n,), generator=g).tolist())

    rows = [{"prompt": words(4), "chosen": words(3), "rejected": words(2)} for _ in range(16)]
    return Dataset.from_list(rows)


def _dpo(trainer_cls, out: str, **options):
    """TRL's ``DPOTrainer`` with LoRA (the reference: the base, PEFT's adapters disabled)."""
    from trl import DPOConfig

    torch.manual_seed(0)
    model, _ = llama()
    return trainer_cls(
        model=model,
        args=DPOConfig(**_options(out, max_steps=3, bf16=False)),
        train_dataset=_preferences(),
        processing_class=_tokenizer(),
        peft_config=_sft_config(),
        **options,
    )


def _kto(trainer_cls, out: str, **options):
    """TRL's ``KTOTrainer`` with LoRA: :func:`_preferences`' completions unpaired, each chosen
    one desirable and each rejected one not."""
    from datasets import Dataset
    from trl import KTOConfig

    torch.manual_seed(0)
    model, _ = llama()
    rows = [
        {"prompt": r["prompt"], "completion": r[kind], "label": kind == "chosen"}
        for r in _preferences()
        for kind in ("chosen", "rejected")
    ]
    return trainer_cls(
        model=model,
        args=KTOConfig(**_options(out, max_steps=3, bf16=False)),
        train_dataset=Dataset.from_list(rows),
        processing_class=_tokenizer(),
        peft_config=_sft_config(),
        **options,
    )


def _reward(trainer_cls, out: str, **options):
    """TRL's ``RewardTrainer`` on the tiny Llama as a sequence classifier of one label (its
    own loss, HF's, is not the pipeline's: the trainer's is computed from the rewards)."""
    from transformers import LlamaForSequenceClassification
    from trl import RewardConfig

    config = llama()[0].config
    config.num_labels, config.pad_token_id = 1, _tokenizer().pad_token_id
    torch.manual_seed(0)
    return trainer_cls(
        model=LlamaForSequenceClassification(config),
        args=RewardConfig(**_options(out, max_steps=3, bf16=False)),
        train_dataset=_preferences(),
        processing_class=_tokenizer(),
        **options,
    )


OWN_LOGGED = {
    "dft": ("loss", "grad_norm", "entropy", "mean_token_accuracy"),
    "dpo": ("loss", "grad_norm", "rewards/margins", "rewards/accuracies", "logps/chosen"),
    "kto": ("loss", "grad_norm", "learning_rate"),
    "reward": ("loss", "grad_norm", "learning_rate"),
}
TRAINERS = {
    "dpo": (_dpo, "DPOTrainer"),
    "kto": (_kto, "KTOTrainer"),
    "reward": (_reward, "RewardTrainer"),
}
"""TRL's trainers with their own losses that the test runs beside SFT's ``dft``."""


def _own_losses_run(rank, world, directory):
    import trl

    trainers = {"dft": _pipelined_sft(_dft_args(f"{directory}/dft"), _sft_data())}
    for kind, (make, name) in TRAINERS.items():
        trainers[kind] = make(
            px.pipelined(getattr(trl, name)),
            f"{directory}/{kind}",
            layer_cls=llama()[1],
            pipeline=px.PipelineConfig(num_microbatches=2),
        )
    for trainer in trainers.values():
        trainer.train()
    return {kind: _logs(trainer, OWN_LOGGED[kind]) for kind, trainer in trainers.items()}


def test_trl_trainers_with_their_own_losses_log_as_trl_does(tmp_path):
    """TRL's ``SFTTrainer`` with ``loss_type="dft"`` (each token's negative log-likelihood
    weighted by its probability) and ``DPOTrainer`` with LoRA run TRL's ``compute_loss`` on the
    pipeline's outputs (see [Note: a trainer's own loss on the pipeline]): the same losses,
    grad norms and TRL's metrics (entropy, token accuracy; DPO's reward margins and accuracies,
    the chosen completions' log-probabilities) as TRL in one process. TRL's ``KTOTrainer`` with
    LoRA and ``RewardTrainer`` (a sequence classifier) too (issue 73 item 5): losses and grad
    norms."""
    import trl

    references = {"dft": _sft_reference(_dft_args(str(tmp_path / "dft")), _sft_data())}
    for kind, (make, name) in TRAINERS.items():
        references[kind] = make(getattr(trl, name), str(tmp_path / kind))
    for reference in references.values():
        reference.train()
    want = {kind: _logs(ref, OWN_LOGGED[kind]) for kind, ref in references.items()}
    assert any(h["rewards/margins"] != 0 for h in want["dpo"])
    assert all(h["grad_norm"] > 0 for kind in ("kto", "reward") for h in want[kind])
    for runs in run_ranks(2, _own_losses_run, str(tmp_path), timeout=300):
        for kind, logs in runs.items():
            assert len(logs) == len(want[kind]) == 3
            for got, ref in zip(logs, want[kind], strict=True):
                for k in OWN_LOGGED[kind]:
                    assert got[k] == pytest.approx(ref[k], rel=1e-5, abs=1e-6), (kind, k, got, ref)


def _own_loss_class():
    """A ``Trainer`` with a ``compute_loss`` of its own, written for DDP as HF's is: the label
    tokens' cross-entropy over HF's count of the window's tokens (every process's) times the
    processes (DDP averages the gradients), plus a per-row mean of a z-loss (each row's mean of
    ``logsumexp(logits)^2`` over its labelled tokens: a mean over the process's rows, which
    DDP's mean over processes of equal rows makes the global batch's)."""
    from transformers import Trainer

    class OwnLoss(Trainer):
        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            labels = inputs.pop("labels")[:, 1:]
            outputs = model(**inputs)
            logits = outputs.logits[:, :-1].float()
            mask = labels != -100
            nll = torch.nn.functional.cross_entropy(
                logits.flatten(0, 1), labels.flatten(), reduction="sum"
            )
            nll = nll / num_items_in_batch * self.accelerator.num_processes
            z = logits.logsumexp(-1).square().masked_fill(~mask, 0).sum(1)
            zloss = (z / mask.sum(1).clamp(min=1)).mean()
            loss = nll + 1e-3 * zloss
            return (loss, outputs) if return_outputs else loss

    return OwnLoss


OWN_ON_REPLICAS = ("dpo", "dft", "smoothing", "own")
"""The trainers whose loss is their own that ``_own_losses_on_replicas_run`` trains on a
dp=2 x pp=2 mesh: TRL's DPO with LoRA, TRL's SFT with ``loss_type="dft"``, the Trainer with
label smoothing, and ``_own_loss_class()``."""
OWN_ON_TENSOR_PARALLEL = ("dft", "own")
"""Those it also trains on dp=2 x pp=1 x tp=2 (``tensor_parallel="auto"``; not DPO: its LoRA
adapters are refused beside tensor parallelism); and ``"experts"``: ``_own_loss_class()`` on a
Mixtral with ``expert_parallel=2`` on dp=2 x pp=2 (its loss without the router's, as in one
process: the subclass's, from the logits)."""


def _own_loss_trainer(name: str, directory: str, mesh=None, experts: int | None = None):
    """``OWN_ON_REPLICAS``'s trainer ``name`` for 2 steps (accumulation 2) on the global batch
    of 4 rows (eval 8), on the tiny Llama in fp32 (with ``experts``, a 2-layer Mixtral with its
    router's loss, its experts sharded over that many replicas): through ``px.pipelined`` on
    ``mesh``, whose replicas share that batch; without a mesh the class itself in this process
    (the reference)."""
    from transformers import Trainer
    from trl import DPOConfig, DPOTrainer, SFTConfig, SFTTrainer

    replicas = 1 if mesh is None else mesh["dp"].size()
    rows = dict(per_device_train_batch_size=4 // replicas, per_device_eval_batch_size=8 // replicas)
    options = _options(f"{directory}/{name}", max_steps=2, **rows)
    torch.manual_seed(0)
    model, layer_cls = mixtral(layers=2, router_loss=True) if experts else llama()
    pipelined = {}
    if mesh is not None:
        tp = "auto" if "tp" in mesh.mesh_dim_names else None
        config = px.PipelineConfig(num_microbatches=2, tensor_parallel=tp, expert_parallel=experts)
        pipelined = dict(layer_cls=layer_cls, pipeline=config)
        pipelined["mesh"] = mesh
    wrap = px.pipelined if mesh is not None else (lambda cls: cls)
    if name == "dpo":
        return wrap(DPOTrainer)(
            model=model,
            args=DPOConfig(**options, bf16=False),
            train_dataset=_preferences(),
            processing_class=_tokenizer(),
            peft_config=_sft_config(),
            **pipelined,
        )
    if name == "dft":
        args = SFTConfig(**options, bf16=False, loss_type="dft", gradient_checkpointing=False)
        return wrap(SFTTrainer)(
            model=model,
            args=args,
            train_dataset=_sft_data(),
            eval_dataset=_sft_eval(),
            processing_class=_tokenizer(),
            **pipelined,
        )
    cls = Trainer if name == "smoothing" else _own_loss_class()
    smoothing = dict(label_smoothing_factor=0.1) if name == "smoothing" else {}
    return wrap(cls)(
        model=model,
        args=_args(f"{directory}/{name}", max_steps=2, **rows, **smoothing),
        train_dataset=_Rows(2, seed=100),
        eval_dataset=_eval_rows(),
        **pipelined,
    )


DPO_METRICS = (
    *("rewards/chosen", "rewards/rejected", "logps/rejected", "logits/chosen", "logits/rejected"),
    *("entropy", "mean_token_accuracy", "num_tokens"),
)
"""The rest of what TRL's ``DPOTrainer`` logs (besides ``OWN_LOGGED["dpo"]``): on replicas,
each gathered over them."""


def _own_logged(name: str) -> tuple[str, ...]:
    """What ``_own_losses_on_replicas_run`` compares of ``name``'s logs."""
    more = {"dpo": DPO_METRICS, "dft": ("num_tokens",)}.get(name, ())
    return (*OWN_LOGGED.get(name, LOGGED[:2]), "learning_rate", *more)


def _own_losses_on_replicas_run(rank, world, directory):
    from torch.distributed.device_mesh import init_device_mesh
    from trl import GRPOTrainer

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "pp"))
    runs = {}
    for name in OWN_ON_REPLICAS:
        trainer = _own_loss_trainer(name, directory, mesh)
        trainer.train()
        metrics = trainer.evaluate() if trainer.eval_dataset is not None else {}
        trainer.save_model(f"{directory}/{name}-model")
        runs[name] = _logs(trainer, _own_logged(name)), metrics.get("eval_loss")
    tp_mesh = init_device_mesh("cpu", (2, 1, 2), mesh_dim_names=("dp", "pp", "tp"))
    tp_runs = {}
    for name in OWN_ON_TENSOR_PARALLEL:
        trainer = _own_loss_trainer(name, f"{directory}/tp", tp_mesh)
        trainer.train()
        tp_runs[name] = _logs(trainer, _own_logged(name))
    trainer = _own_loss_trainer("own", f"{directory}/experts", mesh, experts=2)
    trainer.train()
    tp_runs["experts"] = _logs(trainer)
    grpo = {}
    for lora in (False, True):
        trainer = _grpo(
            px.pipelined(GRPOTrainer),
            f"{directory}/grpo{lora}",
            lora,
            replicas=2,
            layer_cls=llama()[1],
            pipeline=px.PipelineConfig(num_microbatches=2),
            mesh=mesh,
        )
        trainer.train()
        trainer.save_model(f"{directory}/grpo{lora}-model")
        grpo[lora] = _logs(trainer, GRPO_LOGGED), trainer.evaluate()
    trainer = _grpo(
        px.pipelined(GRPOTrainer),
        f"{directory}/grpo-tp",
        False,
        replicas=2,
        layer_cls=llama()[1],
        pipeline=px.PipelineConfig(num_microbatches=2, tensor_parallel="auto"),
        mesh=tp_mesh,
    )
    trainer.train()
    tp_runs["grpo"] = _logs(trainer, GRPO_LOGGED)
    return runs, tp_runs, grpo


def _grpo_ddp_run(rank, world, directory):
    """TRL's ``GRPOTrainer`` itself as 2 DDP processes (accelerate's, over gloo), the whole
    model and LoRA with a KL term (``_grpo``): the reference for GRPO on 2 replicas (TRL
    samples per process, from a seed per process)."""
    from trl import GRPOTrainer

    runs = {}
    for lora in (False, True):
        trainer = _grpo(GRPOTrainer, f"{directory}/grpo-ddp{lora}", lora, replicas=2)
        assert trainer.accelerator.num_processes == 2, trainer.accelerator.state
        trainer.train()
        assert type(trainer.model_wrapped).__name__ == "DistributedDataParallel"
        trainer.save_model(f"{directory}/reference-grpo{lora}")
        runs[lora] = _logs(trainer, GRPO_LOGGED), trainer.evaluate()
    return runs


def test_own_losses_and_grpo_on_a_data_x_pipeline_mesh_train_as_ddp_processes(tmp_path):
    """dp=2 x pp=2: each replica runs the trainer's own step as one of two DDP processes (its
    share of the rows collated alone, accelerate's gathers over the replicas, the gradients
    averaged over them; see [Note: a trainer's own loss on replicas]). TRL's DPO with LoRA,
    TRL's SFT with ``loss_type="dft"``, the Trainer with label smoothing and a Trainer
    subclass with its own ``compute_loss`` log the losses, grad norms and TRL's metrics (DPO's
    rewards, SFT's entropy and token accuracy: gathered over the replicas), evaluate and save
    the weights (DPO: the adapter) of the trainer in one process with the global batch: each of
    these losses is one whose DDP mean is the global batch's (a token sum over HF's count of
    every process's tokens times the processes, or a mean over equal rows). SFT ``dft`` and the
    subclass on dp=2 x tp=2 log the same (each tp rank of a replica in its DDP process), and
    the subclass on a Mixtral with ``expert_parallel=2`` (experts sharded over the replicas). TRL's
    GRPO, each
    replica generating its share of the prompts with ``pipe.generate`` from its own random
    state, samples per process as TRL does, so its reference is TRL itself as 2 DDP processes
    (accelerate over gloo, the same seeds), the whole model and LoRA with a KL term: the same
    rewards (the same sampled tokens), losses, grad norms, entropies, KL values, eval reward and
    loss, and saved weights (adapter); the whole model's logs on dp=2 x tp=2 too."""
    want = {}
    for name in OWN_ON_REPLICAS:
        reference = _own_loss_trainer(name, str(tmp_path / "reference"))
        reference.train()
        metrics = reference.evaluate() if reference.eval_dataset is not None else {}
        reference.save_model(str(tmp_path / f"reference-{name}"))
        want[name] = _logs(reference, _own_logged(name)), metrics.get("eval_loss")
    experts = _own_loss_trainer("own", str(tmp_path / "reference-experts"), experts=2)
    experts.train()
    want["experts"] = _logs(experts), None
    assert any(h["rewards/margins"] != 0 for h in want["dpo"][0])
    want_grpo, other = run_ranks(2, _grpo_ddp_run, str(tmp_path), timeout=300)
    for lora in (False, True):  # every DDP process logs the gathered values
        assert want_grpo[lora][0] == other[lora][0], lora
    assert all((ref["kl"] or 0) > 0 for ref in want_grpo[True][0])
    for runs, tp_runs, grpo_runs in run_ranks(
        4, _own_losses_on_replicas_run, str(tmp_path), timeout=300
    ):
        # GRPO, whole and LoRA, on dp=2 x pp=2; whole on dp=2 x tp=2: as TRL's DDP runs
        grpo_runs = {
            "whole": (grpo_runs[False], want_grpo[False]),
            "lora": (grpo_runs[True], want_grpo[True]),
            "tp": ((tp_runs.pop("grpo"), None), want_grpo[False]),
        }
        for name, logs in tp_runs.items():
            assert len(logs) == len(want[name][0]) == 2, name
            for got, ref in zip(logs, want[name][0], strict=True):
                for k in _own_logged("own" if name == "experts" else name):
                    assert got[k] == pytest.approx(ref[k], rel=1e-5, abs=1e-6), (name, k, got, ref)
        for kind, ((grpo, grpo_eval), (ref_logs, ref_eval)) in grpo_runs.items():
            if grpo_eval is not None:
                assert grpo_eval["eval_reward"] == ref_eval["eval_reward"], (grpo_eval, ref_eval)
                eval_loss = pytest.approx(ref_eval["eval_loss"], rel=1e-4, abs=1e-7)
                assert grpo_eval["eval_loss"] == eval_loss, (grpo_eval, ref_eval)
            assert len(grpo) == len(ref_logs) == 3
            for got, ref in zip(grpo, ref_logs, strict=True):
                assert (got["reward"], got["reward_std"]) == (ref["reward"], ref["reward_std"])
                for k in ("loss", "grad_norm", "entropy", "kl", "learning_rate"):
                    want_k = ref[k] if ref[k] is None else pytest.approx(ref[k], rel=1e-4, abs=1e-7)
                    assert got[k] == want_k, ("grpo", kind, k, got, ref)
        for name, (logs, eval_loss) in runs.items():
            ref_logs, ref_eval = want[name]
            assert len(logs) == len(ref_logs) == 2, name
            for got, ref in zip(logs, ref_logs, strict=True):
                for k in _own_logged(name):
                    assert got[k] == pytest.approx(ref[k], rel=1e-5, abs=1e-6), (name, k, got, ref)
            assert eval_loss == (ref_eval and pytest.approx(ref_eval, rel=1e-5)), name
    for name in (*OWN_ON_REPLICAS, "grpoFalse", "grpoTrue"):
        saved, weights = (_saved(tmp_path / d) for d in (f"{name}-model", f"reference-{name}"))
        assert saved.keys() == weights.keys() and saved, name
        rtol, atol = (1e-4, 1e-5) if "grpo" in name else (1e-5, 2e-5)  # the GRPO test's
        for key, tensor in saved.items():
            torch.testing.assert_close(tensor, weights[key], rtol=rtol, atol=atol, msg=key)


def test_replica_shares_are_the_examples_accelerate_gives_each_ddp_process():
    """``_ReplicaShare`` over the global batches of an order (two epochs of it) gives each
    replica the examples accelerate's ``BatchSamplerShard`` gives its DDP process from the same
    order, an epoch's short last batch completed from the epoch's first examples
    (``even_batches``), cycled where the dataset is smaller than a global batch."""
    from accelerate.data_loader import BatchSamplerShard
    from torch.utils.data import BatchSampler

    from pippy_xla.integrations.trainer import _ReplicaShare

    for size, rows, replicas in ((12, 2, 2), (10, 2, 2), (11, 3, 2), (5, 2, 3), (3, 2, 2)):
        for rank in range(replicas):
            per_process = BatchSampler(range(size), rows, drop_last=False)
            want = list(BatchSamplerShard(per_process, replicas, rank, even_batches=True))
            share = _ReplicaShare(lambda examples: examples, rank, replicas, rows)
            whole = BatchSampler(range(size), rows * replicas, drop_last=False)
            for epoch in range(2):
                got = [share(batch) for batch in whole]
                assert got == want, (size, rows, replicas, rank, epoch, got, want)


def _experts_run(rank, world, directory):
    """Two steps with ``expert_parallel=2`` on dp=2 x pp=2 of a Mixtral with its router loss,
    saving at each, then an evaluation; then a new trainer resumed from the checkpoint of step 1
    (the experts' shards and their AdamW state through DCP): its step 2 logs what the
    uninterrupted run logged."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "pp"))

    def trainer(out):
        torch.manual_seed(0)
        model, layer_cls = mixtral(layers=2, router_loss=True)
        return px.PipelineTrainer(
            model=model,
            args=_args(
                out,
                per_device_train_batch_size=2,
                per_device_eval_batch_size=4,
                max_steps=2,
                save_strategy="steps",
                save_steps=1,
            ),
            train_dataset=_Rows(2, seed=100),
            eval_dataset=_eval_rows(),
            layer_cls=layer_cls,
            pipeline=px.PipelineConfig(num_microbatches=2, expert_parallel=2),
            mesh=mesh,
        )

    whole = trainer(f"{directory}/experts")
    whole.train()
    whole.save_model(f"{directory}/experts-model")
    eval_loss = whole.evaluate()["eval_loss"]
    again = trainer(f"{directory}/again")
    again.train(resume_from_checkpoint=f"{directory}/experts/checkpoint-1")
    assert _logs(again) == _logs(whole), (_logs(again), _logs(whole))
    return _logs(whole), eval_loss


def test_pipeline_trainer_with_expert_parallel_trains_as_one_process(tmp_path):
    """dp=2 x pp=2 with ``expert_parallel=2`` (each stage's experts sharded over its two
    replicas), a Mixtral with its router's loss: the logs (loss, clipped gradient norm, learning
    rate), the eval loss and the saved weights equal the Trainer's in one process with the
    global batch (the router's loss over the Trainer's whole batch, not per microbatch or
    replica: see [Note: added terms over the whole batch]); resuming from its checkpoint logs the
    same."""
    from transformers import AutoModelForCausalLM, Trainer

    torch.manual_seed(0)
    reference = Trainer(
        model=mixtral(layers=2, router_loss=True)[0],
        args=_args(str(tmp_path / "reference"), max_steps=2),
        train_dataset=_Rows(2, seed=100),
        eval_dataset=_eval_rows(),
    )
    reference.train()
    want, want_eval = _logs(reference), reference.evaluate()["eval_loss"]
    for logs, eval_loss in run_ranks(4, _experts_run, str(tmp_path), timeout=300):
        assert len(logs) == len(want) == 2 and all(g["grad_norm"] for g in logs)
        for step, (got, ref) in enumerate(zip(logs, want, strict=True)):
            for key in LOGGED:
                assert got[key] == pytest.approx(ref[key], rel=2e-6, abs=1e-7), (step, key)
        assert eval_loss == pytest.approx(want_eval, rel=2e-6), (eval_loss, want_eval)
    saved = AutoModelForCausalLM.from_pretrained(tmp_path / "experts-model")
    trained = dict(reference.model.named_parameters())
    for name, p in saved.named_parameters():
        torch.testing.assert_close(p, trained[name], rtol=1e-5, atol=2e-5, msg=name)
