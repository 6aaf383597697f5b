"""After a step fails part-way, a new pipeline over the same processes trains equal to one process
on every transport, and a mesh that a failed step left is refused in one line. See [Note: a
pipeline's own groups] in pippy_xla/runtime/_build.py."""

from __future__ import annotations

import copy
import os
import re
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from models import llama, make_batch, reference_step
from test_pipeline import check_grads

import pippy_xla as px
from pippy_xla.testing import run_ranks

RUNTIME_PAGE = Path(__file__).resolve().parents[1] / "docs" / "runtime.md"
LOSS_TOL = {"rtol": 1e-5, "atol": 1e-6}  # summed microbatch losses against one sum (rounding)
MBS = 4

# A fault: (what fails, at which stage ("first", "middle", "last"), microbatch, schedule,
# discovery). "loss", "forward" and "backward" raise from the user's side (a loss_fn, a decoder
# layer's forward, a hook on its output's gradient); an engine action ("SF", "RF", "SB", "RB",
# "B", "W") fails right after it runs (Engine.inject_fault), a send or receive it posted left in
# flight. `discovery`: the failing step is the first of its batch shape (boundary headers travel
# too), as in a pipeline's first step.
FAULTS = [
    ("loss", "last", 0, "1f1b", True),  # activations of later microbatches already sent
    ("forward", "first", 1, "1f1b", False),
    ("backward", "middle", 0, "1f1b", False),
    ("SF", "first", 1, "1f1b", True),
    ("RF", "last", 0, "1f1b", False),
    ("SB", "last", 0, "1f1b", False),
    ("RB", "first", 0, "1f1b", True),
    ("B", "middle", 1, "zbh1", False),
    ("W", "last", 0, "zbh1", False),
]


def _stage_of(where: str, world: int) -> int:
    return {"first": 0, "middle": world // 2, "last": world - 1}[where]


def _layers(pipe: px.PipelineModel, layer_cls) -> list[torch.nn.Module]:
    return [m for st in pipe.local_stages for m in st.module.modules() if isinstance(m, layer_cls)]


def _arm(pipe: px.PipelineModel, layer_cls, kind: str, stage: int, mb: int) -> None:
    """Makes ``pipe``'s next step fail on this rank as ``kind`` says, at ``stage``'s microbatch
    ``mb`` (this rank holds ``stage``)."""
    if kind == "loss":

        def raising_loss(*args):
            raise ValueError("loss exploded")

        pipe.loss_fn = raising_loss
    elif kind in ("forward", "backward"):
        calls = [0]

        def hook(module, args, out):
            calls[0] += 1
            if calls[0] != mb + 1:
                return None
            if kind == "forward":
                raise ValueError("layer exploded")

            def raising_grad(grad):
                raise ValueError("layer backward exploded")

            out.register_hook(raising_grad)
            return None

        _layers(pipe, layer_cls)[0].register_forward_hook(hook)
    else:
        pipe._runner.train_engine.inject_fault(kind, stage, mb)


def _equal_to_one_process(pipe, ref, batch, where) -> float:
    """One step of ``pipe`` against ``ref``'s: the loss and every local gradient."""
    loss = pipe.run_train(**batch)
    ref_loss, _ = reference_step(ref, batch, MBS)
    torch.testing.assert_close(loss, ref_loss, **LOSS_TOL, msg=where)
    check_grads(pipe.named_parameters(), ref, where)
    return float(loss)


def _fresh(seed: int, transport: str, schedule: str, **options):
    torch.manual_seed(seed)
    model, layer_cls = llama()
    ref = copy.deepcopy(model)
    pipe = px.PipelineModel(
        model,
        layer_cls=layer_cls,
        num_microbatches=MBS,
        schedule=schedule,
        transport=transport,
        timeout=30,
        **options,
    )
    return pipe, ref, layer_cls


def _faults_then_new_pipelines(rank, world, transport):
    """Per fault: a new pipeline trains one step equal to one process (after the previous
    fault), then fails at the fault on every rank, then refuses further steps. Returns each
    fault's errors and, last, the step after the last fault."""
    out = []
    for i, (kind, where, mb, schedule, discovery) in enumerate(FAULTS):
        pipe, ref, layer_cls = _fresh(i, transport, schedule)
        label = f"{transport} ranks={world} after fault {i - 1} rank={rank}"
        _equal_to_one_process(pipe, ref, make_batch(seed=i), label)
        stage = _stage_of(where, world)
        if stage in [st.index for st in pipe.local_stages]:
            _arm(pipe, layer_cls, kind, stage, mb)
        batch = make_batch(seed=100 + i, seq=12 if discovery else 16)
        start = time.monotonic()
        with pytest.raises(px.PipelineError) as info:
            pipe.run_train(**batch)
        elapsed = time.monotonic() - start
        with pytest.raises(px.PipelineError, match="failed in an earlier step"):
            pipe.run_train(**batch)
        out.append((kind, where, info.value.failed_rank, info.value.action, elapsed))
    pipe, ref, _ = _fresh(len(FAULTS), transport, "1f1b")
    label = f"{transport} ranks={world} after the last fault rank={rank}"
    out.append(_equal_to_one_process(pipe, ref, make_batch(seed=len(FAULTS)), label))
    return out


@pytest.mark.parametrize("transport", ["auto", "process_group", "in_order"])
@pytest.mark.parametrize("world", [2, 4])
def test_a_pipeline_built_after_a_failed_step_trains_equal_to_one_process(world, transport):
    out = run_ranks(world, _faults_then_new_pipelines, transport, pg_timeout=30, timeout=400)
    for i, (kind, where, *_rest) in enumerate(FAULTS):
        failing = _stage_of(where, world)
        errors = [o[i] for o in out]
        # Every rank raised, naming the rank that failed; none waited out a timeout.
        assert {e[2] for e in errors} == {failing}, (kind, where, errors)
        assert all(e[4] < 15 for e in errors), (kind, where, errors)
        if kind not in ("loss", "forward", "backward"):
            assert errors[failing][3] == kind, (kind, errors[failing])
    assert len({o[-1] for o in out}) == 1  # the last step's loss, the same on every rank


def _eval_and_generate_faults(rank, world):
    """A failed ``run_eval`` and a failed ``generate``, each followed by a new pipeline that
    trains equal to one process."""
    out = []
    for i, call in enumerate(("run_eval", "generate")):
        pipe, ref, layer_cls = _fresh(i, "auto", "1f1b")
        if rank == world - 1:
            _arm(pipe, layer_cls, "forward", world - 1, 0)
        batch = make_batch(seed=i)
        with pytest.raises(px.PipelineError) as info:
            if call == "run_eval":
                pipe.run_eval(**batch)
            else:
                pipe.generate(batch["input_ids"][:, :8], max_new_tokens=4, do_sample=False)
        out.append(info.value.failed_rank)
        pipe, ref, _ = _fresh(10 + i, "auto", "1f1b")
        out.append(_equal_to_one_process(pipe, ref, batch, f"after a failed {call} rank={rank}"))
    return out


def test_a_pipeline_built_after_a_failed_eval_or_generate_trains_equal_to_one_process():
    out = run_ranks(2, _eval_and_generate_faults, pg_timeout=30, timeout=200)
    for o in out:
        assert o[0] == 1 and o[2] == 1, o  # the last rank failed, in either call
    assert out[0] == out[1]


def _mesh_faults(rank, world, dims):
    """On a mesh ``dims`` (``("dp", "pp")``, or ``("dp", "pp", "tp")`` with one replica): a step
    fails; a pipeline on the same mesh, or on a new mesh equal to it, is refused at once in one
    line; one on a mesh with other dim names trains equal to one process."""
    from torch.distributed.device_mesh import init_device_mesh

    def mesh(names):
        shape = (2, 2) if len(names) == 2 else (1, 2, 2)
        dims = dict(zip(("dp_dim", "pp_dim", "tp_dim"), names, strict=False))
        return init_device_mesh("cpu", shape, mesh_dim_names=names), dims

    options = {"tensor_parallel": "auto"} if "tp" in dims else {"data_parallel": "shard"}
    used, names = mesh(dims)
    pipe, _, layer_cls = _fresh(0, "auto", "1f1b", mesh=used, **options, **names)
    # The last stage's loss raises: on both of its tensor-parallel ranks, which compute it
    # together (one rank alone would leave its peer inside a collective of the layers' backward).
    if 1 in [st.index for st in pipe.local_stages] and (rank == world - 1 or "tp" in dims):
        _arm(pipe, layer_cls, "loss", 1, 0)
    with pytest.raises(px.PipelineError):
        pipe.run_train(**make_batch(seed=0))
    refused = []
    for again in (used, mesh(dims)[0]):
        start = time.monotonic()
        with pytest.raises(RuntimeError) as info:
            _fresh(1, "auto", "1f1b", mesh=again, **options, **names)
        refused.append((str(info.value), time.monotonic() - start))
    other, names = mesh(tuple(d + "2" for d in dims))
    pipe, ref, _ = _fresh(2, "auto", "1f1b", mesh=other, **options, **names)
    batch = make_batch(seed=2)
    loss = pipe.run_train(**batch)
    ref_loss = ref(**batch, use_cache=False).loss
    ref_loss.backward()
    torch.testing.assert_close(loss, ref_loss.detach(), **LOSS_TOL)
    check_grads(pipe.named_parameters(), ref, f"{dims} on a mesh with other names rank={rank}")
    dist.barrier()
    return refused


@pytest.mark.parametrize("dims", [("dp", "pp"), ("dp", "pp", "tp")])
def test_a_mesh_left_by_a_failed_step_is_refused_and_another_mesh_trains(dims):
    out = run_ranks(4, _mesh_faults, dims, pg_timeout=30, timeout=200)
    for refused in out:
        for message, elapsed in refused:
            assert "a pipeline on a DeviceMesh of this layout and dim names failed" in message
            assert "build the mesh with other dim names" in message, message
            assert "\n" not in message and elapsed < 1.0, (message, elapsed)


def _recovery_loop() -> str:
    """The training loop of docs/runtime.md's "Recovering after a failure", as written."""
    section = RUNTIME_PAGE.read_text().split("### Recovering after a failure", 1)[1]
    return re.search(r"^```python\n(.*?)^```$", section, re.M | re.S).group(1)


def _docs_loop(rank, world, directory):
    """The page's loop, then the same loop with no failure (in another directory): the weights
    they end with."""
    ends = []
    for fail, code in (
        (True, _recovery_loop()),
        (False, _recovery_loop().replace("not failures", "False")),
    ):
        os.makedirs(f"{directory}/{fail}", exist_ok=True)
        os.chdir(f"{directory}/{fail}")
        scope: dict = {}
        exec(compile(code, "docs/runtime.md", "exec"), scope)
        ends.append(({n: p.detach().clone() for n, p in scope["pipe"].named_parameters()}, scope))
    (failed, scope), (clean, clean_scope) = ends
    assert [e.failed_rank for e in scope["failures"]] == [world - 1], scope["failures"]
    assert clean_scope["failures"] == [] and scope["step"] == clean_scope["step"] == 4
    assert failed.keys() == clean.keys() and failed
    for name in failed:
        assert torch.equal(failed[name], clean[name]), name
    return len(failed)


def test_the_docs_recovery_loop_ends_where_a_run_without_the_failure_ends(tmp_path):
    assert all(n > 0 for n in run_ranks(2, _docs_loop, str(tmp_path), timeout=200))
