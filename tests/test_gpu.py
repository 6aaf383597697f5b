"""GPU tests: two ranks sharing one GPU over NCCL (see pippy_xla/testing.py), against one process.

Skipped where CUDA is absent (CI). Run on the GPU machine with ``bash scripts/gpu_check.sh``.
"""

from __future__ import annotations

import copy

import pytest
import torch
from models import MODELS, make_batch, needs_hf_tensor_parallel

import pippy_xla as px
from pippy_xla.testing import run_ranks

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

# fp32 on the GPU: the pipeline sums microbatch losses and gradients that the reference
# computes over the whole batch, and cuBLAS may pick other kernels for the smaller microbatch
# GEMMs (TF32 is off by default for matmuls), so results agree to float rounding of differently
# blocked sums: rtol 1e-4, atol 1e-5.
TOL = {"rtol": 1e-4, "atol": 1e-5}
# bf16: one bf16 rounding of a gradient is 2^-8 relative (0.4%); sums of rounded terms in another
# order differ by a few of those, so 3e-2 relative and 1e-2 absolute.
BF16_TOL = {"rtol": 3e-2, "atol": 1e-2}
# Two ranks over NCCL. A hang ends at run_ranks' deadline, which prints every rank's Python stack
# (SIGABRT, faulthandler), set before NCCL's watchdog (the group's timeout) tears the ranks down
# without one.
NCCL = {"backend": "nccl", "timeout": 90, "pg_timeout": 120}


def _train_vs_reference(rank, world, family, schedule, dtype_name):
    dtype = getattr(torch, dtype_name)
    torch.manual_seed(0)
    model, layer_cls = MODELS[family]()
    model.to(dtype)
    ref = copy.deepcopy(model).cuda()
    pipe = px.PipelineModel(model, layer_cls=layer_cls, num_microbatches=4, schedule=schedule)
    assert pipe.device == torch.device("cuda", 0)
    assert pipe._place.in_order is not None  # NCCL: transfers matched in order
    tol = TOL if dtype == torch.float32 else BF16_TOL
    batch = make_batch(seed=0)
    loss = pipe.run_train(**batch)
    ref_loss = ref(**{k: v.cuda() for k, v in batch.items()}, use_cache=False).loss
    ref_loss.backward()
    torch.testing.assert_close(loss.float(), ref_loss.detach().float(), **tol)
    checked = 0
    for name, p in pipe.named_parameters():
        assert p.device.type == "cuda" and p.grad is not None, name
        torch.testing.assert_close(p.grad, ref.get_parameter(name).grad, **tol, msg=name)
        checked += 1
    out = pipe.run_eval(**batch)
    if pipe.is_last:
        ref_logits = ref(**{k: v.cuda() for k, v in batch.items()}, use_cache=False).logits
        torch.testing.assert_close(out.logits, ref_logits, **tol)
    return checked


@pytest.mark.parametrize("schedule", ["1f1b", "gpipe", "interleaved", "zbh1"])
def test_nccl_schedules_match_one_process(schedule):
    assert all(run_ranks(2, _train_vs_reference, "llama", schedule, "float32", **NCCL))


@pytest.mark.parametrize("dtype", ["bfloat16"])
def test_nccl_bf16_and_tied_weights(dtype):
    assert all(run_ranks(2, _train_vs_reference, "gpt2", "1f1b", dtype, **NCCL))


def _compiled(rank, world):
    torch.manual_seed(0)
    model, layer_cls = MODELS["llama"]()
    pipe = px.PipelineModel(model, layer_cls=layer_cls, num_microbatches=2, compile=True)
    for step in range(4):
        pipe.run_train(**make_batch(seed=step))
    return pipe.recompiles


def test_nccl_compiled_stages_never_recompile():
    assert run_ranks(2, _compiled, backend="nccl", timeout=600, pg_timeout=660) == [[], []]


def _meta_on_gpu(rank, world):
    with torch.device("meta"):
        model, layer_cls = MODELS["llama"]()
    pipe = px.PipelineModel(model, layer_cls=layer_cls, num_microbatches=2)
    device = "cuda" if torch.cuda.is_available() else "cpu"  # cpu: to check this test's logic
    assert all(p.device.type == device for p in pipe.parameters())
    loss = float(pipe.run_train(**make_batch(seed=0)))
    return loss, {k: v.detach().cpu() for k, v in pipe.state_dict().items()}


def _check_materialized(out) -> None:
    """The losses equal one process running the values the ranks materialized (so the pipeline
    computes the model's function of them), and those values follow HF's initialization (norm
    weights 1, linear and embedding weights of std ``initializer_range``)."""
    (loss0, state0), (loss1, state1) = out
    assert loss0 == loss1
    ref, _ = MODELS["llama"]()
    missing, unexpected = ref.load_state_dict({**state0, **state1}, strict=False)
    assert not unexpected and all("rotary" in k for k in missing), (missing, unexpected)
    ref_loss = float(ref(**make_batch(seed=0), use_cache=False).loss)
    assert loss0 == pytest.approx(ref_loss, rel=1e-4)
    std = ref.config.initializer_range
    for name, t in {**state0, **state1}.items():
        if name.endswith("norm.weight"):
            assert torch.equal(t, torch.ones_like(t)), name
        elif t.dim() == 2:
            assert abs(float(t.std()) - std) < 0.15 * std, (name, float(t.std()))


def test_meta_model_materializes_on_the_gpu():
    _check_materialized(run_ranks(2, _meta_on_gpu, **NCCL))


def _generate_on_gpu(rank, world):
    """Greedy ``generate`` over NCCL (the decode ring's token transfers, the window broadcasts)
    against HF's ``generate`` of the unsplit model on the same GPU, in one group and in two."""
    from test_generate import _prompts

    torch.manual_seed(0)
    model, layer_cls = MODELS["llama"]()
    model.eval()
    ref = copy.deepcopy(model).cuda()
    pipe = px.PipelineModel(model, layer_cls=layer_cls, num_microbatches=2)
    ids, mask = (t.cuda() for t in _prompts(batch=4))
    opts = {"max_new_tokens": 8, "do_sample": False}
    want = ref.generate(ids, attention_mask=mask, **opts).cpu()
    got = {g: pipe.generate(ids, attention_mask=mask, groups=g, **opts).cpu() for g in (1, 2)}
    return {g: torch.equal(t, want) for g, t in got.items()}


def test_nccl_generate_equals_hf():
    assert run_ranks(2, _generate_on_gpu, **NCCL) == [{1: True, 2: True}] * 2


def _tensor_parallel_on_gpu(rank, world):
    """pp=2 x tp=2 on four ranks sharing the GPU over NCCL (tp collectives from DTensor beside the
    pipeline's transfers matched in order) against one process on the GPU: loss and every
    gradient (gathered over tp) of one step."""
    from models import reference_step
    from test_pipeline import check_grads
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cuda", (1, 2, 2), mesh_dim_names=("dp", "pp", "tp"))
    torch.manual_seed(0)
    model, layer_cls = MODELS["llama"](layers=2)
    ref = copy.deepcopy(model).cuda()
    pipe = px.PipelineModel(
        model, layer_cls=layer_cls, num_microbatches=2, mesh=mesh, tensor_parallel="auto"
    )
    batch = make_batch(seed=0, batch=4)
    loss = pipe.run_train(**batch)
    ref_loss, _ = reference_step(ref, {k: v.cuda() for k, v in batch.items()}, 2)
    torch.testing.assert_close(loss.float(), ref_loss.detach().float(), **TOL)
    check_grads(pipe.named_parameters(), ref, f"rank {rank}", TOL)
    return True


@needs_hf_tensor_parallel
def test_nccl_pipeline_by_tensor_parallel():
    assert run_ranks(4, _tensor_parallel_on_gpu, **NCCL) == [True] * 4
