"""Single-process tests of the activation stash (``pippy_xla._C.Stash``)."""

from __future__ import annotations

import pytest
import torch

from pippy_xla import _C


def nbytes(*tensors: torch.Tensor) -> int:
    return sum(t.nbytes for t in tensors)


def test_push_pop_keep_the_very_tensors() -> None:
    # [Note: zero-copy stash] a slot holds the tensors forward produced, not copies.
    base = torch.randn(4, 6)
    leaf = base[1:3].detach().requires_grad_()  # a view: offset into a larger storage
    out = (leaf * 2).sum(dim=1)
    extra = torch.arange(5, dtype=torch.int64)
    inputs, outputs = [leaf, extra], [out]
    before = [t.detach().clone() for t in inputs + outputs]
    ptrs = [(t.untyped_storage().data_ptr(), t.data_ptr()) for t in inputs + outputs]
    storages = [t.untyped_storage() for t in inputs + outputs]

    stash = _C.Stash()
    stash.push(0, 0, inputs, outputs)
    assert stash.contains(0, 0) and not stash.contains(0, 1) and len(stash) == 1

    peeked = stash.peek(0, 0)
    peeked_in, peeked_out = peeked.inputs, peeked.outputs
    assert all(a is b for a, b in zip(peeked_in + peeked_out, inputs + outputs, strict=True))
    # A write through the original is visible in the slot: nothing was copied.
    extra.add_(100)
    before[1].add_(100)

    popped = stash.pop(0, 0)
    got_in, got_out = popped.inputs, popped.outputs
    assert not stash.contains(0, 0) and len(stash) == 0
    got = got_in + got_out
    assert len(got_in) == 2 and len(got_out) == 1
    for t, orig, ptr, storage, value in zip(
        got, inputs + outputs, ptrs, storages, before, strict=True
    ):
        assert t is orig
        assert t.untyped_storage() is storage
        assert (t.untyped_storage().data_ptr(), t.data_ptr()) == ptr
        assert torch.equal(t.detach(), value)
    # Autograd metadata survives: the output still backpropagates into the stashed leaf.
    assert got_in[0].requires_grad and got_out[0].grad_fn is not None
    got_out[0].sum().backward()
    assert torch.equal(leaf.grad, torch.full_like(leaf, 2.0))


def test_live_and_peak_bytes() -> None:
    stash = _C.Stash()
    assert (stash.live_bytes, stash.peak_bytes) == (0, 0)
    a = [torch.zeros(10), torch.zeros(3, dtype=torch.float64)], [torch.zeros(7, dtype=torch.int8)]
    b = [torch.zeros(2, 5)], [torch.zeros(100, dtype=torch.float16)[::2]]  # strided view
    c = [], [torch.zeros(64)]
    size = {k: nbytes(*v[0], *v[1]) for k, v in {"a": a, "b": b, "c": c}.items()}
    assert size == {"a": 40 + 24 + 7, "b": 40 + 100, "c": 256}

    live, peak = 0, 0
    for op, key, (stage, mb), slot in [
        ("push", "a", (0, 0), a),
        ("push", "b", (0, 1), b),
        ("pop", "a", (0, 0), None),
        ("push", "c", (1, 0), c),
        ("pop", "b", (0, 1), None),
        ("pop", "c", (1, 0), None),
    ]:
        if op == "push":
            stash.push(stage, mb, *slot)
            live += size[key]
        else:
            stash.pop(stage, mb)
            live -= size[key]
        peak = max(peak, live)
        assert (stash.live_bytes, stash.peak_bytes) == (live, peak), (op, key)
    assert peak == size["b"] + size["c"]
    assert stash.live_bytes == 0


def test_reset_peak() -> None:
    stash = _C.Stash()
    big, small = torch.zeros(100), torch.zeros(10)
    stash.push(0, 0, [big], [])
    stash.push(0, 1, [small], [])
    stash.pop(0, 0)
    assert (stash.live_bytes, stash.peak_bytes) == (40, 440)
    stash.reset_peak()
    assert (stash.live_bytes, stash.peak_bytes) == (40, 40)
    stash.push(0, 2, [small], [])
    assert stash.peak_bytes == 80
    stash.pop(0, 1)
    stash.pop(0, 2)
    stash.reset_peak()
    assert (stash.live_bytes, stash.peak_bytes) == (0, 0)


def test_double_push_is_an_error() -> None:
    stash = _C.Stash()
    t = torch.zeros(4)
    stash.push(2, 1, [t], [])
    with pytest.raises(RuntimeError, match=r"slot \(stage 2, microbatch 1\) is already full"):
        stash.push(2, 1, [torch.zeros(8)], [])
    # The failed push changed nothing.
    assert len(stash) == 1 and stash.live_bytes == 16 and stash.peak_bytes == 16
    assert stash.pop(2, 1).inputs[0] is t


def test_pop_of_missing_slot_is_an_error() -> None:
    stash = _C.Stash()
    with pytest.raises(RuntimeError, match=r"no slot for \(stage 0, microbatch 3\)"):
        stash.pop(0, 3)
    with pytest.raises(RuntimeError, match=r"no slot for \(stage 1, microbatch 0\)"):
        stash.peek(1, 0)
    stash.push(0, 0, [torch.zeros(1)], [])
    stash.pop(0, 0)
    with pytest.raises(RuntimeError, match=r"no slot for \(stage 0, microbatch 0\)"):
        stash.pop(0, 0)  # backward twice
    assert stash.live_bytes == 0


def test_check_empty() -> None:
    stash = _C.Stash()
    stash.check_empty()
    stash.push(1, 0, [torch.zeros(1)], [])
    stash.push(0, 2, [], [torch.zeros(1)])
    stash.push(0, 5, [], [])
    stash.pop(0, 5)
    with pytest.raises(
        RuntimeError,
        match=r"2 slot\(s\) left at the end of the step: \(stage 0, mb 2\) \(stage 1, mb 0\)",
    ):
        stash.check_empty()
    stash.pop(0, 2)
    stash.pop(1, 0)
    stash.check_empty()
