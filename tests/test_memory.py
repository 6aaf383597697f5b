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
    assert after_x.live_bytes - base.live_bytes == 4_000_000
    assert after_x.allocations - base.allocations == 1
    # y came and went: the peak saw it, the live count does not.
    assert after_y.live_bytes == after_x.live_bytes
    assert after_y.peak_bytes - after_x.live_bytes == 3_000_000
    # Allocated on another thread, still alive.
    assert after_thread.live_bytes - after_y.live_bytes == 4_000_000
    assert after_view.live_bytes == after_thread.live_bytes
    assert end.live_bytes == base.live_bytes


def _step_peaks(rank, world, microbatch_counts, seq):
    """Per pipeline with each microbatch count (microbatches of 2): this rank's peak of live
    tensor bytes during a training step above its live bytes before it, and the boundary size."""
    import gc

    import torch
    from models import MODELS, make_batch

    import pippy_xla as px
    from pippy_xla import _C

    _C.memory_tracker_install()
    out = []
    for m in microbatch_counts:
        with torch.device("meta"):
            model, layer_cls = MODELS["llama"](layers=4)
        pipe = px.PipelineModel(model, layer_cls=layer_cls, num_microbatches=m, timeout=60)
        batch = make_batch(0, batch=2 * m, seq=seq)
        pipe.run_train(**batch)  # gradients exist from here on
        base = _C.memory_stats().live_bytes
        _C.memory_reset_peak()
        pipe.run_train(**batch)
        out.append(_C.memory_stats().peak_bytes - base)
        boundary = 2 * seq * model.config.hidden_size * 4
        del pipe, model, batch
        gc.collect()
    return out, boundary


def test_step_memory_does_not_grow_with_microbatches():
    """1F1B holds at most ``stages - s`` microbatches on stage ``s``, so a step's peak must not
    grow with the number of microbatches. It did by one or more boundary tensors per microbatch
    on middle stages while the engine kept every transfer alive until the end of the step (see
    [Note: send release] in csrc/runtime/schedule_analysis.cpp): 8 more microbatches would add 16 or
    more."""
    results = run_ranks(4, _step_peaks, (4, 12), 64)
    for rank, ((few, many), boundary) in enumerate(results):
        # Allowance: half a boundary tensor per extra microbatch (the last stage grows by about
        # 0.4 of one, from the per-microbatch loss bookkeeping), plus the batch itself (int64
        # ids, mask and labels), 16 rows of 64 tokens larger.
        assert many - few <= 8 * boundary // 2 + 3 * 8 * 16 * 64, (rank, few, many, boundary)
