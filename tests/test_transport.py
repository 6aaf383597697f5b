"""The same-host transport ([Note: same-host transport] in csrc/transport/shm.h): messages,
ordering, sizes, slots running out, a dead peer, and pipelines over it against the process group's
own."""

from __future__ import annotations

import copy
import os
import subprocess
import threading
import time

import pytest
import torch
import torch.distributed as dist

import pippy_xla as px
from pippy_xla import _C
from pippy_xla.runtime import ops
from pippy_xla.testing import run_ranks
from tests.models import llama, make_batch

TIMEOUT_MS = 60_000


def _send(x, tag, group):
    return ops.send(x, 1, tag, group)


def _recv(like, tag, group):
    token = ops.recv(like.shape, like.dtype, 0, tag, group)
    return ops.wait_recv(token, like.shape, like.dtype, timeout_ms=TIMEOUT_MS)


def _messages(rank, world):
    """Rank 0 sends, rank 1 receives in another order: by tag, oldest first among equal tags,
    a message larger than the slot's first segment, an empty one, and more messages at once than
    a channel has slots (the rest deferred, [Note: deferred sends])."""
    group = ops.group_name_of(None)
    peers = _C.shm_attach(group, TIMEOUT_MS)
    assert _C.shm_attach(group, TIMEOUT_MS) == peers  # attached once
    small_a = torch.arange(6, dtype=torch.float32)
    small_c = -torch.arange(6, dtype=torch.float32)
    big = torch.randn(3 << 20, generator=torch.Generator().manual_seed(0))  # 12 MiB
    empty = torch.zeros(0, 4)
    many = [torch.full((3,), float(i)) for i in range(_C.SHM_SLOTS + 40)]
    if rank == 0:
        tokens = [_send(small_a, 5, group), _send(big, 3, group), _send(small_c, 5, group)]
        tokens.append(_send(empty, 7, group))
        tokens += [_send(t, 1000 + i, group) for i, t in enumerate(many)]
        # Waiting on a receive pushes the deferred sends: rank 1 answers after taking them all.
        reply = _recv_from(1, torch.zeros(1), 99, group)
        for tok in tokens:
            ops.wait_send(tok, TIMEOUT_MS)
        wrong = ops.send(torch.ones(4), 1, 11, group)
        ops.wait_send(wrong, TIMEOUT_MS)
        return peers, _C.shm_peers(group), float(reply), os.getpid()
    got_big = _recv(big, 3, group)
    got_a = _recv(small_a, 5, group)
    got_c = _recv(small_a, 5, group)
    got_empty = _recv(empty, 7, group)
    got_many = [_recv(t, 1000 + i, group) for i, t in enumerate(many)]
    ops.wait_send(ops.send(torch.tensor([42.0]), 0, 99, group), TIMEOUT_MS)
    with pytest.raises(RuntimeError, match="16 bytes but the receive buffer 20"):
        _recv(torch.zeros(5), 11, group)
    assert torch.equal(got_big, big)
    assert torch.equal(got_a, small_a) and torch.equal(got_c, small_c)
    assert got_empty.shape == (0, 4)
    assert all(torch.equal(g, t) for g, t in zip(got_many, many, strict=True))
    return peers, _C.shm_peers(group), len(got_many), os.getpid()


def _spin_expected(ranks_on_host: int) -> int:
    """[Note: spinning before sleeping]: waits poll only where every rank of the host, with its
    intra-op threads, has a CPU of its own (run_ranks gives each rank one thread)."""
    cpus = len(os.sched_getaffinity(0))
    return _C.SHM_SPIN_US if ranks_on_host * torch.get_num_threads() <= cpus else 0


def _spin_policy(rank, world):
    """The spin budget follows the ranks this host runs: the group's own, or torchrun's
    LOCAL_WORLD_SIZE where that says more (ranks of other groups share the cores)."""
    group = ops.group_name_of(None)
    _C.shm_attach(group, TIMEOUT_MS)
    crowded = dist.new_group(list(range(world)))
    os.environ["LOCAL_WORLD_SIZE"] = str(len(os.sched_getaffinity(0)) + 1)
    _C.shm_attach(crowded.group_name, TIMEOUT_MS)
    unattached = dist.new_group(list(range(world)))
    out = (
        _spin_expected(world),
        _C.shm_spin_us(group),
        _C.shm_spin_us(crowded.group_name),
        _C.shm_spin_us(unattached.group_name),
    )
    _C.shm_attach(crowded.group_name, TIMEOUT_MS, 123)  # attached again: set anew
    return (*out, _C.shm_spin_us(crowded.group_name))


def test_waits_poll_only_where_every_rank_has_a_core():
    for world in (2, 4):
        for expected, spin, crowded, unattached, set_anew in run_ranks(world, _spin_policy):
            assert spin == expected
            assert crowded == 0 and unattached == 0
            assert set_anew == 123
    assert _C.SHM_SPIN_US > 0


def _recv_from(peer, like, tag, group):
    token = ops.recv(like.shape, like.dtype, peer, tag, group)
    return ops.wait_recv(token, like.shape, like.dtype, timeout_ms=TIMEOUT_MS)


def _names_of(pid: int) -> list[str]:
    """What process ``pid`` created under /dev/shm ([Note: shared-memory names])."""
    return [n for n in os.listdir("/dev/shm") if n.startswith(f"pippy_xla.{os.getuid()}.{pid}.")]


def test_shared_memory_messages_arrive_by_tag_in_order_and_whole():
    # What a crashed run left: names whose creator is gone. An attach unlinks the old one.
    dead = subprocess.Popen(["true"])
    dead.wait()
    stale = f"/dev/shm/pippy_xla.{os.getuid()}.{dead.pid}.7.0.1.0.1"
    recent = f"/dev/shm/pippy_xla.{os.getuid()}.{dead.pid}.7.0.1.0.2"
    for name in (stale, recent):
        open(name, "wb").close()
    two_hours_ago = time.time() - 7200
    os.utime(stale, (two_hours_ago, two_hours_ago))
    out = run_ranks(2, _messages)
    assert out[0][:3] == (1, 1, 42.0)
    assert out[1][:3] == (1, 1, _C.SHM_SLOTS + 40)
    # Every name was unlinked once both sides had mapped it.
    assert not _names_of(out[0][3]) and not _names_of(out[1][3])
    # An hour old at least: a job of another pid namespace sharing /dev/shm keeps its names.
    assert not os.path.exists(stale) and os.path.exists(recent)
    os.unlink(recent)


def _peer_exits(rank, world):
    group = ops.group_name_of(None)
    assert _C.shm_attach(group, TIMEOUT_MS) == 1
    assert _C.shm_whole_group(group)
    dist.barrier()
    if rank == 1:
        time.sleep(1.0)
        os._exit(0)  # never sends, nor joins a collective
    # A collective whose peer does not come can be ended from another thread (the pipeline's
    # watcher does so on a peer's abort record), and an Abortable aborted once stays aborted.
    abortable = _C.Abortable()
    start = time.monotonic()  # before the timer starts: the abort comes 0.3 s after it at least
    threading.Timer(0.3, abortable.abort).start()
    with pytest.raises(RuntimeError, match="the wait was aborted") as err:
        _C.all_gather_int64([1], group, "cpu", TIMEOUT_MS, "gather", abortable=abortable)
    aborted = time.monotonic() - start, str(err.value), abortable.aborted
    with pytest.raises(RuntimeError, match="the wait was aborted"):
        _C.broadcast_copy(torch.ones(1), 1, group, TIMEOUT_MS, "broadcast", abortable=abortable)
    # A wait on a peer that exits fails once it is gone.
    start = time.monotonic()
    with pytest.raises(RuntimeError, match="exited while this rank waited") as err:
        _recv_from(1, torch.zeros(2), 0, group)
    return aborted, (time.monotonic() - start, str(err.value))


def test_a_wait_on_a_peer_that_exited_or_was_aborted_fails_instead_of_timing_out():
    out = run_ranks(2, _peer_exits, may_exit=(1,), pg_timeout=20, timeout=120)
    (elapsed, message, aborted), (gone_after, gone_message) = out[0]
    # The timeout is 60 s; the abort came after 0.3 s.
    assert 0.3 <= elapsed < 5 and aborted, (elapsed, message)
    assert message.startswith("gather failed: the wait was aborted"), message
    # The liveness check runs every kShmWakeMs (100 ms).
    assert gone_after < TIMEOUT_MS / 1000 / 2, (gone_after, gone_message)
    assert "rank 1" in gone_message


def _both_transports(rank, world):
    """One model, two pipelines over the world group: one over shared memory (``"shm"``: the
    default's choice here, insisted on), one with the process group's own send and receive (each
    pipeline runs on a group of its own: [Note: a pipeline's own groups])."""
    model, layer_cls = llama(layers=4)
    batch = make_batch(1, batch=8, seq=16)
    out = {}
    for transport in ("shm", "process_group"):
        pipe = px.PipelineModel(
            copy.deepcopy(model),
            layer_cls=layer_cls,
            num_microbatches=4,
            schedule="zbv",
            transport=transport,
            transport_spin_us=0 if transport == "shm" else None,  # waits sleep at once
        )
        out[transport] = float(pipe.run_train(**batch))
        out[transport + " peers"] = pipe.shm_peers
        out[transport + " spin"] = _C.shm_spin_us(pipe._place.group_name)
    return out


def test_pipelines_over_shared_memory_and_over_gloo_give_the_same_losses():
    out = run_ranks(2, _both_transports)
    for r in out:
        assert r["shm peers"] == 1 and r["process_group peers"] == 0
        assert r["shm spin"] == 0 and r["process_group spin"] == 0
        assert r["shm"] == r["process_group"], r  # the same bits: only the wire differs
    assert out[0]["shm"] == out[1]["shm"]


def test_transport_options_must_be_valid():
    with pytest.raises(ValueError, match="transport must be one of"):
        px.PipelineConfig(num_microbatches=2, transport="tcp")
    for bad in (-1, 1.5, True, "fast"):
        with pytest.raises(ValueError, match="transport_spin_us must be None or an int >= 0"):
            px.PipelineConfig(num_microbatches=2, transport_spin_us=bad)


def _collectives(rank, world):
    """The small collectives of csrc/transport/p2p.h over shared memory (the world group, attached)
    against gloo's (a second group of the same ranks)."""
    shm, gloo = ops.group_name_of(None), dist.new_group(list(range(world))).group_name
    assert _C.shm_attach(shm, TIMEOUT_MS) == world - 1
    mine = torch.randn(5, generator=torch.Generator().manual_seed(rank), dtype=torch.float64)
    out = {}
    for name in (shm, gloo):
        out[name] = (
            _C.all_gather_int64([rank, 10 * rank], name, "cpu", TIMEOUT_MS, "gather"),
            _C.broadcast_copy(mine, world - 1, name, TIMEOUT_MS, "broadcast"),
            _C.all_reduce_sum_copy(mine, name, TIMEOUT_MS, "sum"),
        )
    parts = [
        torch.randn(5, generator=torch.Generator().manual_seed(r), dtype=torch.float64)
        for r in range(world)
    ]
    in_rank_order = parts[0].clone()
    for p in parts[1:]:
        in_rank_order += p
    (g_shm, b_shm, s_shm), (g_gloo, b_gloo, s_gloo) = out[shm], out[gloo]
    assert g_shm == g_gloo == [[r, 10 * r] for r in range(world)]
    assert torch.equal(b_shm, b_gloo) and torch.equal(b_shm, parts[-1])
    assert torch.equal(s_shm, in_rank_order)
    torch.testing.assert_close(s_shm, s_gloo, rtol=1e-12, atol=0)
    # Ranks that run different collectives fail on the messages' sizes instead of mixing them.
    with pytest.raises(RuntimeError, match="bytes but the receive buffer"):
        _C.all_gather_int64([1, 2, 3] if rank == 0 else [1, 2], shm, "cpu", TIMEOUT_MS, "gather")
    return s_shm


def test_small_collectives_over_shared_memory_equal_gloos():
    out = run_ranks(4, _collectives)
    assert all(torch.equal(o, out[0]) for o in out)  # every rank the same bits
