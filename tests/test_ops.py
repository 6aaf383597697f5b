"""The pippy_xla point-to-point ops: schemas, fake kernels, autograd, tracing and real transfers."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from tolerances import assert_close_compiled
from torch.fx.experimental.proxy_tensor import make_fx

import pippy_xla as px
from pippy_xla.runtime import ops
from pippy_xla.testing import run_ranks

P = torch.ops.pippy_xla


@pytest.fixture(scope="module")
def fake_group():
    """A 2-rank 'fake' process group: transfers complete at once and move no data, so opcheck
    can run the ops as often as it likes in one process."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        dist.destroy_process_group()
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    yield ops.group_name_of(None)
    dist.destroy_process_group()


def test_opcheck_every_op(fake_group):
    g = fake_group
    x = torch.randn(3, 4)
    cases = [
        (P.send.default, (x, None, 1, 0, g)),
        (P.recv.default, (None, [3, 4], torch.float32, torch.device("cpu"), 1, 0, g)),
        (P.send_wait.default, (torch.randn(2, 5, requires_grad=True), 1, 0, g, 1000)),
        (
            P.recv_wait.default,
            (
                torch.ones((), requires_grad=True),
                [2, 5],
                torch.float32,
                torch.device("cpu"),
                1,
                0,
                g,
                1000,
            ),
        ),
    ]
    # opcheck's AOT tests compare outputs and gradients of two runs, but tokens carry a fresh
    # key per call and a fake group's receives (the ops' outputs, and send_wait's gradient) are
    # uninitialized memory: those tests cannot apply here. The real AOT path is exercised with
    # real data in test_compiled_receive_compute_send_across_two_ranks.
    structural = ("test_schema", "test_autograd_registration", "test_faketensor")
    for op, args in cases:
        torch.library.opcheck(op, args, test_utils=structural)
    # wait_* consume their token, so opcheck (which runs an op several times) cannot check their
    # fake kernels: compare each fake kernel's output with one real run's, on a shape and dtype
    # that no default would produce.
    cpu = torch.device("cpu")
    real_recv = P.wait_recv(
        P.recv(None, [5, 2], torch.float64, cpu, 1, 0, g), [5, 2], torch.float64, cpu, 1000
    )
    real_send = P.wait_send(P.send(torch.randn(5, 2, dtype=torch.float64), None, 1, 0, g), 1000)
    with torch._subclasses.fake_tensor.FakeTensorMode() as mode:
        token = mode.from_tensor(torch.zeros((), dtype=torch.long))
        fake_recv = P.wait_recv(token, [5, 2], torch.float64, cpu, 1000)
        fake_send = P.wait_send(token, 1000)
    for real, fake in ((real_recv, fake_recv), (real_send, fake_send)):
        assert (fake.shape, fake.dtype, fake.device, fake.stride()) == (
            real.shape,
            real.dtype,
            real.device,
            real.stride(),
        )
    assert real_recv.shape == (5, 2) and real_recv.dtype == torch.float64
    torch.library.opcheck(
        P.wait_recv.default,
        (P.recv(None, [3, 4], torch.float32, cpu, 1, 0, g), [3, 4], torch.float32, cpu, 1000),
        test_utils=("test_schema",),
    )


def _async_transfer(rank, world):
    """send / recv / wait_*: the receiver gets the sender's values, shape and dtype."""
    group = ops.group_name_of(None)
    x = torch.arange(10, dtype=torch.float64).reshape(5, 2) + 0.5
    if rank == 0:
        done = ops.wait_send(ops.send(x, 1, 3, group), 30_000)
        return (tuple(done.shape), str(done.dtype))
    y = ops.wait_recv(ops.recv([5, 2], torch.float64, 0, 3, group), [5, 2], torch.float64)
    assert torch.equal(y, x), y
    return (tuple(y.shape), str(y.dtype))


def test_async_send_and_recv_move_the_values():
    assert run_ranks(2, _async_transfer) == [((), "torch.int64"), ((5, 2), "torch.float64")]


def test_ops_trace_with_make_fx_in_order_and_survive_dce():
    def step(x):
        t = ops.send(x * 2, 1, 0, "unused")
        r = ops.recv([4], torch.float32, 1, 1, "unused", dep=t)
        y = ops.wait_recv(r, [4], torch.float32)
        ops.wait_send(t)  # its result is unused: only its side effect keeps it
        return y + 1

    gm = make_fx(step, tracing_mode="fake")(torch.randn(4))
    gm.graph.eliminate_dead_code()
    calls = [n.target for n in gm.graph.nodes if n.op == "call_function"]
    p2p = [c for c in calls if c in ops.OPS]
    assert p2p == [P.send.default, P.recv.default, P.wait_recv.default, P.wait_send.default]


def test_ops_export_and_compile_fullgraph_capture():
    class M(torch.nn.Module):
        def forward(self, x):
            sink = ops.send_wait(x * 3, 1, 0, "unused")
            y = ops.recv_wait([2, 4], torch.float32, 1, 1, "unused", anchor=sink)
            return y.sum() + sink

    ep = torch.export.export(M(), (torch.randn(2, 4),))
    targets = [n.target for n in ep.graph.nodes if n.op == "call_function"]
    assert P.send_wait.default in targets and P.recv_wait.default in targets

    seen = []

    def backend(gm, example_inputs):
        seen.append(gm)
        return gm.forward

    with torch._subclasses.fake_tensor.FakeTensorMode():
        torch.compile(M(), backend=backend, fullgraph=True)(torch.randn(2, 4))
    assert len(seen) == 1  # one graph: no graph break


# A compiled rank's first wait spans its peer's compile (minutes on a busy 2-core machine with a
# cold inductor cache, as under ATEN_CPU_CAPABILITY=avx2 in scripts/test.sh).
WAIT_MS = 300_000


def _compiled_relay(rank, world):
    """receive -> compute -> send, compiled with fullgraph=True (inductor) on both ranks:
    rank 0 sends h = x @ w0 to rank 1, which receives it, computes z = h @ w1 and sends z
    back; rank 0 receives z and takes loss = sum(z * z). Backward retraces the path through the
    ops' autograd formulas, and every gradient equals single-process autograd's."""
    group = ops.group_name_of(None)
    torch.manual_seed(0)
    x = torch.randn(4, 8)
    w0 = torch.randn(8, 6, requires_grad=True)
    w1 = torch.randn(6, 3, requires_grad=True)
    ref_w0, ref_w1 = w0.detach().clone().requires_grad_(), w1.detach().clone().requires_grad_()
    ref_loss = ((x @ ref_w0 @ ref_w1) ** 2).sum()
    ref_loss.backward()
    if rank == 0:

        @torch.compile(fullgraph=True)
        def first(x, w0):
            sink = ops.send_wait(x @ w0, 1, 1, group, WAIT_MS)
            z = ops.recv_wait([4, 3], torch.float32, 1, 2, group, "cpu", sink, WAIT_MS)
            return (z * z).sum()

        loss = first(x, w0)
        assert_close_compiled(loss, ref_loss, "loss", "relay loss")
        loss.backward()
        assert_close_compiled(w0.grad, ref_w0.grad, "grad", "relay w0")
        return float(loss)

    @torch.compile(fullgraph=True)
    def middle(anchor, w1):
        h = ops.recv_wait([4, 6], torch.float32, 0, 1, group, "cpu", anchor, WAIT_MS)
        return ops.send_wait(h @ w1, 0, 2, group, WAIT_MS)

    sink = middle(torch.zeros((), requires_grad=True), w1)
    sink.backward()
    assert_close_compiled(w1.grad, ref_w1.grad, "grad", "relay w1")
    return float(w1.grad.abs().sum())


@pytest.mark.compiled
def test_compiled_receive_compute_send_across_two_ranks():
    out = run_ranks(2, _compiled_relay, timeout=600)
    assert out[0] > 0 and out[1] > 0


def _checked_at_step_end(rank, world):
    """A receive left to DeviceWaits (how the engine checks transfers of CUDA tensors at the end of
    a step, [Note: waits on a GPU]): it returns the data once it arrived, and a peer that sends
    nothing ends the wait with an error naming the receive at the timeout, not a hang."""
    import time

    # Over shared memory, whose works report completion as it happens (NCCL's do too; gloo's
    # point-to-point works only in their wait).
    group = ops.group_name_of(dist.new_group([0, 1], backend="gloo"))
    assert px._C.shm_attach(group, 30_000) == 1
    x = torch.arange(6, dtype=torch.float32) + 0.25
    if rank == 1:
        ops.wait_send(ops.send(x, 0, 5, group), 30_000)
        dist.barrier()  # rank 0 timed out on tag 6
        ops.wait_send(ops.send(x, 0, 6, group), 30_000)  # what its posted receive waits for
        dist.barrier()
        return None
    got = px._C._receive_checked_at_step_end(torch.empty(6), 1, 5, group, 30_000)
    t0 = time.monotonic()
    with pytest.raises(px._C.TransferError) as err:
        px._C._receive_checked_at_step_end(torch.empty(6), 1, 6, group, 400)
    waited = time.monotonic() - t0
    dist.barrier()
    dist.barrier()
    return got.tolist(), str(err.value), waited


def test_transfers_checked_at_the_end_of_a_step_complete_or_time_out():
    got, msg, waited = run_ranks(2, _checked_at_step_end)[0]
    assert got == [0.25, 1.25, 2.25, 3.25, 4.25, 5.25]
    assert "a receive checked at the end of a step did not complete within 400 ms" in msg, msg
    assert 0.3 < waited < 10, waited


def test_engine_and_ops_share_one_transfer_path():
    # The engine is built on the same C++ isend/irecv as the ops (csrc/transport/p2p.h); nothing
    # in the Python package talks to torch.distributed's point-to-point API directly.
    import inspect

    import pippy_xla.pipeline as pipeline

    src = inspect.getsource(pipeline)
    for banned in ("dist.send(", "dist.recv(", "dist.isend(", "dist.irecv(", "batch_isend_irecv"):
        assert banned not in src
    assert px.ops.send_wait is ops.send_wait
