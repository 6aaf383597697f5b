"""The counting CPU allocator (``_C.memory_*``, see [Note: counting CPU allocator]) checked
against allocations of known sizes, in a fresh process (it stays installed once installed)."""

from __future__ import annotations

from pippy_xla.testing import run_ranks


def _known_allocations(rank, world):
    import threading

    import torch

    from pippy_xla import _C

    _C.memory_tracker_install()
    _C.memory_tracker_install()  # idempotent
    base = _C.memory_stats()
    x = torch.empty(1_000_000, dtype=torch.float32)  # 4,000,000 bytes
    after_x = _C.memory_stats()
    _C.memory_reset_peak()
    y = torch.ones(3_000_000, dtype=torch.uint8)
    del y
    after_y = _C.memory_stats()
    held = []
    t = threading.Thread(target=lambda: held.append(torch.zeros(500_000, dtype=torch.float64)))
    t.start()
    t.join()
    after_thread = _C.memory_stats()
    z = x.view(1000, 1000)  # a view allocates no storage
    after_view = _C.memory_stats()
    del x, z
    held.clear()
    end = _C.memory_stats()
    return base, after_x, after_y, after_thread, after_view, end


def test_tracker_counts_known_allocations_on_every_thread():
    base, after_x, after_y, after_thread, after_view, end = run_ranks(1, _known_allocations)[0]
    assert after_x["live_bytes"] - base["live_bytes"] == 4_000_000
    assert after_x["allocations"] - base["allocations"] == 1
    # y came and went: the peak saw it, the live count does not.
    assert after_y["live_bytes"] == after_x["live_bytes"]
    assert after_y["peak_bytes"] - after_x["live_bytes"] == 3_000_000
    # Allocated on another thread, still alive.
    assert after_thread["live_bytes"] - after_y["live_bytes"] == 4_000_000
    assert after_view["live_bytes"] == after_thread["live_bytes"]
    assert end["live_bytes"] == base["live_bytes"]
