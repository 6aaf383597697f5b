"""Bad input gets a clear error before any communication; failing peers give clear errors fast."""

from __future__ import annotations

import os
import time

import pytest
import torch
from _dist import run_ranks
from models import gpt2, llama, make_batch
from transformers.models.gpt2.modeling_gpt2 import GPT2Block

import pippy_xla as px


def _bad_input(rank, world):
    torch.manual_seed(0)
    model, layer_cls = llama()
    with pytest.raises(ValueError, match=r"no GPT2Block"):
        px.PipelineModel(model, layer_cls=GPT2Block, num_microbatches=2)
    small, small_cls = llama(layers=1)
    with pytest.raises(ValueError, match=r"1 decoder layers into 2 stages"):
        px.PipelineModel(small, layer_cls=small_cls, num_microbatches=2)
    with pytest.raises(ValueError, match=r"layer_ranges has 3 stages but the process group has 2"):
        px.PipelineModel(
            model, layer_cls=layer_cls, num_microbatches=2, layer_ranges=[(0, 1), (1, 2), (2, 4)]
        )
    with pytest.raises(ValueError, match=r"num_microbatches must be a positive int"):
        px.PipelineModel(model, layer_cls=layer_cls, num_microbatches=0)
    with pytest.raises(ValueError, match=r"schedule must be"):
        px.PipelineModel(model, layer_cls=layer_cls, num_microbatches=2, schedule="zigzag")

    pipe = px.PipelineModel(model, layer_cls=layer_cls, num_microbatches=4, timeout=30)
    batch = make_batch(seed=0, batch=6)
    with pytest.raises(ValueError, match=r"batch size 6 is not divisible by num_microbatches=4"):
        pipe.run_train(**batch)
    batch = make_batch(seed=0)
    with torch.no_grad(), pytest.raises(RuntimeError, match=r"under torch.no_grad"):
        pipe.run_train(**batch)
    with pytest.raises(ValueError, match=r"needs labels"):
        pipe.run_train(input_ids=batch["input_ids"])
    with pytest.raises(ValueError, match=r"unexpected batch inputs \['pixel_values'\]"):
        pipe.run_train(**batch, pixel_values=batch["input_ids"])
    with pytest.raises(ValueError, match=r"attention_mask'\] has shape \(4, 16\)"):
        pipe.run_train(**{**batch, "attention_mask": batch["attention_mask"][:4]})
    # Rank 1 gets shorter sequences than rank 0: every rank refuses before any transfer.
    seq = 16 if rank == 0 else 12
    skewed = make_batch(seed=0, seq=seq)
    with pytest.raises(
        ValueError, match=r"rank \d got a batch with other inputs, shapes or dtypes"
    ):
        pipe.run_train(**skewed)
    skewed = make_batch(seed=0)
    if rank == 1:
        skewed["input_ids"] = skewed["input_ids"].int()
    with pytest.raises(ValueError, match=r"rank \d got a batch with other inputs"):
        pipe.run_train(**skewed)
    # The pipeline still works after refused batches.
    loss = pipe.run_train(**make_batch(seed=0))
    return float(loss)


def test_bad_input_is_refused_before_communication():
    out = run_ranks(2, _bad_input)
    assert out[0] == out[1] and out[0] > 0


def _shape_changes(rank, world):
    torch.manual_seed(0)
    model, layer_cls = gpt2()
    pipe = px.PipelineModel(model, layer_cls=layer_cls, num_microbatches=2, timeout=5)
    batch = make_batch(seed=0)
    pipe.run_train(**batch)
    if rank == 0:
        # Stage 0 starts producing another shape for the same batch shape.
        gm = pipe.module
        original = gm.forward
        gm.forward = lambda *a: tuple(t[:, :-1].contiguous() for t in original(*a))
    start = time.monotonic()
    with pytest.raises(px.PipelineError) as info:
        pipe.run_train(**batch)
    elapsed = time.monotonic() - start
    err = info.value
    # Rank 0's F found the mismatch; rank 1, waiting to receive from it, was aborted at once
    # and names rank 0 and its error. See [Note: failing fast].
    assert err.failed_rank == 0 and "expects [Float[4, 16, 64] requires_grad]" in err.cause, err
    if rank == 0:
        assert (err.action, err.stage, err.microbatch, err.peer) == ("F", 0, 0, None), err
        assert str(err).startswith("[rank 0 stage 0] F microbatch 0 failed: RuntimeError:")
    else:
        assert (err.action, err.stage, err.microbatch, err.peer) == ("RF", 1, 0, 0), err
        assert str(err).startswith("[rank 1 stage 1] RF microbatch 0 (peer rank 0) aborted: rank 0")
    # A failed engine refuses further steps instead of running with peers mid-step.
    with pytest.raises(px.PipelineError, match="failed in an earlier step"):
        pipe.run_train(**batch)
    return elapsed


def test_stage_output_mismatch_is_an_error_not_a_transport_abort():
    elapsed = run_ranks(2, _shape_changes, pg_timeout=20)
    assert elapsed[1] < 2  # aborted by rank 0's record, not by the 5 s pipeline timeout


def _peer_dies(rank, world, how):
    torch.manual_seed(0)
    model, layer_cls = llama()
    pipe = px.PipelineModel(model, layer_cls=layer_cls, num_microbatches=4, timeout=3)
    batch = make_batch(seed=0)
    pipe.run_train(**batch)
    if rank == 1:
        gm = pipe.module
        original = gm.forward

        def forward(*a):
            if how == "dies":
                os._exit(0)
            time.sleep(8)  # sends nothing within the 3 s timeout
            return original(*a)

        gm.forward = forward
    start = time.monotonic()
    with pytest.raises(px.PipelineError) as info:
        pipe.run_train(**batch)
    return str(info.value), time.monotonic() - start


@pytest.mark.parametrize("how", ["dies", "hangs"])
def test_dead_or_silent_peer_fails_fast_with_a_clear_error(how):
    out = run_ranks(2, _peer_dies, how, may_exit=(1,), pg_timeout=20, timeout=120)
    msg, elapsed = out[0]
    assert msg.startswith("[rank 0 stage 0]"), msg
    assert "rank 1" in msg, msg
    if how == "hangs":
        assert "did not complete within 3000 ms" in msg, msg
    assert elapsed < 15, elapsed


def _fields(err: px.PipelineError) -> dict:
    return {
        k: getattr(err, k)
        for k in ("rank", "failed_rank", "stage", "microbatch", "action", "peer", "cause")
    }


def _fault(rank, world, case):
    """One step with a fault on the last rank; returns what this rank raised, and when."""
    torch.manual_seed(0)
    model, layer_cls = llama()
    pipe = px.PipelineModel(model, layer_cls=layer_cls, num_microbatches=4, timeout=30)
    batch = make_batch(seed=0)
    pipe.run_train(**batch)  # boundary shapes agreed; the fault comes in the second step
    last = world - 1
    if rank == last and case in ("kill", "raise"):
        loss_fn = pipe._loss_fn

        def faulty_loss(logits, labels, num_items):
            if case == "kill":
                os._exit(1)
            raise ValueError("loss exploded")

        pipe._loss_fn = faulty_loss
        del loss_fn
    if rank == last and case == "shape":
        batch = make_batch(seed=0, seq=12)
    if rank == last and case == "dtype":
        batch = {**batch, "input_ids": batch["input_ids"].int()}
    start = time.monotonic()
    try:
        pipe.run_train(**batch)
        raised = None
    except px.PipelineError as e:
        raised = e
    elapsed = time.monotonic() - start
    assert raised is not None, "the faulty step did not fail"
    out = {"type": type(raised).__name__, "elapsed": elapsed, **_fields(raised)}
    if case in ("shape", "dtype"):
        # Refused before any transfer: the pipeline stays usable.
        out["next_loss"] = float(pipe.run_train(**make_batch(seed=1)))
    else:
        with pytest.raises(px.PipelineError, match="failed in an earlier step"):
            pipe.run_train(**make_batch(seed=1))
    if case == "raise" and rank == last:
        # The raising rank lives on (a notebook, a retrying loop): its sockets stay open, so its
        # peers can only learn of the failure from its abort record. Its error chains the cause.
        assert isinstance(raised.__cause__, ValueError)
        time.sleep(12)
    return out


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("case", ["kill", "raise", "shape", "dtype"])
def test_faults_raise_pipeline_error_on_every_rank(case, world):
    last = world - 1
    out = run_ranks(world, _fault, case, may_exit=(last,) if case == "kill" else (), pg_timeout=30)
    survivors = [o for o in out if o is not None]
    assert len(survivors) == (world - 1 if case == "kill" else world)
    for r, o in enumerate(survivors):
        assert o["rank"] == r
    if case in ("shape", "dtype"):
        for o in survivors:
            assert o["type"] == "BatchMismatchError" and o["action"] == "batch signature check"
            assert o["peer"] == (last if o["rank"] != last else 0), o
            assert "other inputs, shapes or dtypes" in o["cause"]
        assert len({o["next_loss"] for o in survivors}) == 1
        return
    origins = {o["failed_rank"] for o in survivors}
    assert len(origins) == 1, survivors  # every rank names the same origin
    origin = origins.pop()
    for o in survivors:
        assert o["type"] == "PipelineError" and o["action"] in ("RF", "RB", "SF", "SB", "F"), o
        assert o["stage"] is not None and o["microbatch"] is not None, o
        # Fail fast: seconds, not the 30 s pipeline timeout.
        assert o["elapsed"] < 10, o
    if case == "raise":
        assert origin == last
        assert "ValueError: loss exploded" in survivors[0]["cause"]
        assert survivors[last]["action"] == "F" and survivors[last]["stage"] == last
    else:
        # The rank next to the killed one saw its connection close and reported it, naming it.
        assert origin == last - 1, survivors
        assert survivors[origin]["peer"] == last, survivors
        assert f"rank {last}" in survivors[0]["cause"], survivors
