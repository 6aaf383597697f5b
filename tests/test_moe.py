"""MoE router losses across stages: HF's load-balancing loss over every layer's router, added
to each microbatch's loss as HF adds it, equal to one process (loss, aux part, every gradient,
parameters after AdamW) for every schedule, tied weights, compiled stages, 2 and 4 ranks and a
2x2 mesh; with one microbatch the pipeline's loss is HF's own loss of the batch."""

from __future__ import annotations

import copy

import pytest
import torch
from models import MODELS, full, make_batch, pipeline, shared_reference_step
from tolerances import assert_close_compiled

import pippy_xla as px
from pippy_xla.testing import run_ranks

# Eager stages against one process: the same kernels on the same shapes, so equal up to the
# order of the microbatch sums (see tests/test_pipeline.py). Compiled stages: scale-relative
# bounds, [Note: compiled tolerance] in tests/tolerances.py.
TOL = {
    "loss": {"rtol": 1e-5, "atol": 1e-6},
    "grad": {"rtol": 1e-4, "atol": 1e-6},
    "param": {"rtol": 1e-5, "atol": 2e-5},
}


def _close(actual, expected, kind, compiled, msg):
    if compiled:
        assert_close_compiled(actual, expected, kind, msg)
    else:
        torch.testing.assert_close(actual, expected, **TOL[kind], msg=msg)


def _mesh(shape):
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", shape, mesh_dim_names=("dp", "pp"))


def _case(
    rank, world, family, schedule, mbs, layers=4, compile_=False, mesh_shape=None, checkpoint=()
):
    """Two AdamW steps against :func:`reference_step`; returns the aux parts seen."""
    torch.manual_seed(0)
    model, layer_cls = MODELS[family](layers=layers)
    ref = copy.deepcopy(model)
    options = {}
    if mesh_shape is not None:
        options = {"mesh": _mesh(mesh_shape), "data_parallel": "shard"}
    pipe = pipeline(
        model, layer_cls, schedule, mbs, compile=compile_, checkpoint_layers=checkpoint, **options
    )
    opt = torch.optim.AdamW(pipe.parameters(), lr=1e-3, eps=1e-6)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-3, eps=1e-6)
    replicas = mesh_shape[0] if mesh_shape else 1
    seen = []
    for step in range(2):
        batch = make_batch(seed=step)
        where = f"{family} {schedule} mbs={mbs} compile={compile_} mesh={mesh_shape} step={step}"
        loss = pipe.run_train(**batch)
        ref_loss, ref_aux, grads, values = shared_reference_step(
            ref, batch, mbs * replicas, ref_opt
        )
        _close(loss, ref_loss, "loss", compile_, where)
        parts = pipe.last_losses
        assert parts["aux"] > 0, where
        _close(torch.tensor(parts["aux"]), torch.tensor(ref_aux), "loss", compile_, f"{where}: aux")
        assert parts["total"] == pytest.approx(float(loss), rel=1e-6), where
        assert parts["main"] + parts["aux"] == pytest.approx(parts["total"], rel=1e-6), where
        routers = 0
        for name, p in pipe.named_parameters():
            _close(full(p.grad), grads[name], "grad", compile_, f"{where}: {name}")
            routers += ".gate." in name or name.endswith(".gate.weight")
        assert routers > 0, where  # this rank's routers got their share of the aux gradient
        opt.step()
        opt.zero_grad()
        for name, p in pipe.named_parameters():
            _close(full(p), values[name], "param", compile_, f"{where}: {name}")
        seen.append(parts["aux"])
    return seen


def _hf_own_loss(rank, world, family):
    """One microbatch: the pipeline's loss (train and eval) is HF's own loss of the batch."""
    torch.manual_seed(0)
    model, layer_cls = MODELS[family]()
    ref = copy.deepcopy(model)
    pipe = px.PipelineModel(model, layer_cls=layer_cls, num_microbatches=1, timeout=60)
    batch = make_batch(seed=3)
    out = ref(**batch, use_cache=False)
    assert out.aux_loss is not None and float(out.aux_loss) > 0
    evaluated = pipe.run_eval(**batch).loss
    torch.testing.assert_close(evaluated, out.loss.detach(), **TOL["loss"])
    loss = pipe.run_train(**batch)
    torch.testing.assert_close(loss, out.loss.detach(), **TOL["loss"])
    coef = ref.config.router_aux_loss_coef
    assert pipe.last_losses["aux"] == pytest.approx(coef * float(out.aux_loss), rel=1e-5)
    return float(loss)


CASES = {
    2: [
        ("mixtral_router_loss", "1f1b", 4),
        ("qwen3_moe_router_loss", "zbh1", 4),  # tied embeddings
        ("mixtral_router_loss", "1f1b", 2, 4, False, None, (0, 3)),  # checkpointed layers
    ],
    4: [
        ("mixtral_router_loss", "interleaved", 4, 8),
        ("qwen3_moe_router_loss", "gpipe", 2, 4, False, (2, 2)),
    ],
}
# Compiled with W its own graph ([Note: compiled W]), the first stage's layer checkpointed: the
# router losses through compiled stages, one layer per stage (inductor's compile time grows with
# the graph). A compiled full backward is test_compile.py's.
COMPILED_CASES = [("mixtral_router_loss", "zbh1", 2, 2, True, None, (0,))]


def _cases(rank, world, cases):
    return [_case(rank, world, *case) for case in cases]


@pytest.mark.parametrize("world", [2, 4])
def test_router_losses_equal_one_process(world):
    out = run_ranks(world, _cases, CASES[world], timeout=600)
    assert all(o == out[0] for o in out)  # every rank reports the same aux parts


@pytest.mark.compiled
def test_compiled_router_losses_equal_one_process():
    out = run_ranks(2, _cases, COMPILED_CASES, timeout=600)
    assert all(o == out[0] for o in out)


def test_one_microbatch_is_hf_own_loss():
    out = run_ranks(2, _hf_own_loss, "qwen3_moe_router_loss")
    assert out[0] == out[1]
