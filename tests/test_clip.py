"""Global gradient clipping (``PipelineModel.clip_grad_norm_``) against
``torch.nn.utils.clip_grad_norm_`` on the single-process model."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from models import MODELS, full, make_batch

import pippy_xla as px
from pippy_xla.testing import run_ranks

# fp32: the pipeline sums the same per-tensor norms in another order (per rank, then over ranks),
# so the totals differ by rounding only; gradients as in test_pipeline.py.
NORM_TOL = {"rtol": 1e-5, "atol": 1e-7}
GRAD_TOL = {"rtol": 1e-5, "atol": 1e-6}


def _clip_matches(pipe, ref, batch, norm_type, where):
    """One step, then clipping to a tenth of the reference's norm: the returned norm and every
    clipped gradient equal torch's on the reference."""
    pipe.run_train(**batch)
    ref(**batch, use_cache=False).loss.backward()
    unclipped = torch.nn.utils.get_total_norm([p.grad for p in ref.parameters()], norm_type)
    max_norm = 0.1 * float(unclipped)
    total = pipe.clip_grad_norm_(max_norm, norm_type=norm_type)
    ref_total = torch.nn.utils.clip_grad_norm_(ref.parameters(), max_norm, norm_type=norm_type)
    torch.testing.assert_close(total, ref_total, **NORM_TOL, msg=where)
    n = 0
    for name, p in pipe.named_parameters():
        torch.testing.assert_close(
            full(p.grad), ref.get_parameter(name).grad, **GRAD_TOL, msg=f"{where}: {name}"
        )
        n += 1
    assert n > 0
    return float(total)


def _clipping_equals_one_process(rank, world, family, schedule):
    out = []
    for norm_type in (2.0, math.inf, 1.0):
        torch.manual_seed(0)
        model, layer_cls = MODELS[family]()
        ref = copy.deepcopy(model)
        pipe = px.PipelineModel(
            model, layer_cls=layer_cls, num_microbatches=2, schedule=schedule, timeout=60
        )
        where = f"{family} {schedule} norm {norm_type} rank {rank}"
        out.append(_clip_matches(pipe, ref, make_batch(seed=1), norm_type, where))
    return out


@pytest.mark.parametrize(
    ("world", "family", "schedule"),
    [(2, "llama", "1f1b"), (2, "gpt2", "zbh1"), (4, "gpt2", "1f1b"), (4, "qwen2", "gpipe")],
)
def test_clip_grad_norm_equals_one_process(world, family, schedule):
    # GPT-2's tied lm_head / wte is held by the first and last ranks: counted once, scaled on
    # both.
    out = run_ranks(world, _clipping_equals_one_process, family, schedule)
    assert all(o == out[0] for o in out)  # the same norms on every rank


def _stage_and_global_norms(rank, world):
    torch.manual_seed(0)
    model, layer_cls = MODELS["llama"]()
    pipe = px.PipelineModel(model, layer_cls=layer_cls, num_microbatches=2, timeout=60)
    pipe.run_train(**make_batch(seed=1))
    stage_norm = torch.nn.utils.get_total_norm([p.grad for p in pipe.parameters()])
    return float(stage_norm), float(pipe.clip_grad_norm_(math.inf))  # the norm, no clipping


def test_torch_clip_on_one_stage_sees_only_that_stage():
    # Why docs/usage.md says not to call torch.nn.utils.clip_grad_norm_(pipe.parameters()): each
    # rank would clip by its own stage's norm, and the stages' norms differ from the model's.
    (norm0, global0), (norm1, global1) = run_ranks(2, _stage_and_global_norms)
    torch.manual_seed(0)
    model, _ = MODELS["llama"]()
    model(**make_batch(seed=1), use_cache=False).loss.backward()
    grads = [p.grad for p in model.parameters()]
    whole = float(torch.nn.utils.get_total_norm(grads))
    assert math.hypot(norm0, norm1) == pytest.approx(whole, rel=1e-5)
    assert norm0 < 0.99 * whole and norm1 < 0.99 * whole
    assert global0 == global1 == pytest.approx(whole, rel=1e-5)


def _nonfinite(rank, world):
    torch.manual_seed(0)
    model, layer_cls = MODELS["llama"]()
    pipe = px.PipelineModel(model, layer_cls=layer_cls, num_microbatches=2, timeout=60)
    pipe.run_train(**make_batch(seed=1))
    if rank == 0:
        next(pipe.parameters()).grad[0, 0] = float("nan")
    with pytest.raises(RuntimeError, match="non-finite"):
        pipe.clip_grad_norm_(1.0, error_if_nonfinite=True)
    total = pipe.clip_grad_norm_(1.0)  # without the flag: scaled by NaN, as torch does
    loss = pipe.run_train(**make_batch(seed=2))  # the pipeline is still usable
    return math.isnan(float(total)), math.isfinite(float(loss))


def test_nonfinite_norm_raises_on_every_rank():
    assert run_ranks(2, _nonfinite) == [(True, True), (True, True)]


def _mesh_clipping(rank, world):
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "pp"))
    out = []
    for mode in ("replicate", "shard"):
        for norm_type in (2.0, math.inf):
            torch.manual_seed(0)
            model, layer_cls = MODELS["gpt2"]()
            ref = copy.deepcopy(model)
            pipe = px.PipelineModel(
                model,
                layer_cls=layer_cls,
                num_microbatches=2,
                mesh=mesh,
                data_parallel=mode,
                timeout=60,
            )
            where = f"{mode} norm {norm_type} rank {rank}"
            out.append(_clip_matches(pipe, ref, make_batch(seed=1, batch=8), norm_type, where))
    return out


def test_clip_grad_norm_on_a_mesh_equals_one_process():
    out = run_ranks(4, _mesh_clipping, timeout=420)
    assert all(o == out[0] for o in out)
