"""Stable stage graphs: compiled stages without recompiles, fingerprints, zero-copy stash."""

from __future__ import annotations

import copy
import dataclasses
import hashlib
import os
import subprocess
import sys
import textwrap

import pytest
import torch
from models import MODELS, gpt2, llama, make_batch
from tolerances import assert_close_compiled

import pippy_xla as px
from pippy_xla.runtime import _step
from pippy_xla.testing import run_ranks


def _compiled_training(rank, world):
    """Inductor-compiled stages: equal to eager, and compiled once (three steps, one graph set).
    One layer per stage: inductor's compile time grows with the graph (a second layer costs
    about half as much again), and a second layer adds nothing to compare."""
    import torch._dynamo
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    torch.manual_seed(0)
    model, layer_cls = llama(layers=2)
    eager_model = copy.deepcopy(model)
    pipe = px.PipelineModel(model, layer_cls=layer_cls, num_microbatches=2, compile=True)
    eager = px.PipelineModel(eager_model, layer_cls=layer_cls, num_microbatches=2)
    opt = torch.optim.AdamW(pipe.parameters(), lr=1e-3)
    eager_opt = torch.optim.AdamW(eager.parameters(), lr=1e-3)
    graphs = []
    for step in range(3):
        batch = make_batch(seed=step)
        loss = pipe.run_train(**batch)
        eager_loss = eager.run_train(**batch)
        assert_close_compiled(loss, eager_loss, "loss", f"step {step}")
        opt.step()
        eager_opt.step()
        opt.zero_grad()
        eager_opt.zero_grad()
        graphs.append(int(counters["stats"]["unique_graphs"]))
    assert graphs[0] >= 1
    assert graphs[1:] == [graphs[0]] * 2, f"recompiled after step 1: graphs per step {graphs}"
    assert pipe.recompiles == []
    return graphs


@pytest.mark.compiled
def test_compiled_stages_never_recompile_and_match_eager():
    out = run_ranks(2, _compiled_training, timeout=600)
    assert all(len(g) == 3 for g in out)


def _recompile_watch(rank, world):
    """The recompile watch sees dynamo's guards, whatever backend compiles: aot_eager (dynamo
    and AOTAutograd as with inductor, without inductor's code generation) keeps this test cheap."""
    import torch._dynamo

    torch._dynamo.reset()
    torch.manual_seed(0)
    model, layer_cls = llama(layers=2)
    pipe = px.PipelineModel(
        model,
        layer_cls=layer_cls,
        num_microbatches=2,
        compile=True,
        compile_options={"backend": "aot_eager"},
    )
    for step in range(2):
        pipe.run_train(**make_batch(seed=step))
    assert pipe.recompiles == []

    # Other compiled code in the process is not mistaken for a recompiled stage.
    torch.compile(lambda x: x * 2, backend="eager")(torch.ones(2))
    pipe.run_train(**make_batch(seed=0))
    assert pipe.recompiles == []

    # Evaluation compiles graphs of its own (grad mode off): neither its first step nor the
    # training steps after it are recompiles, even with other code compiled in between.
    pipe.run_eval(**make_batch(seed=0))
    pipe.run_train(**make_batch(seed=0))
    torch.compile(lambda x: x * 3, backend="eager")(torch.ones(2))
    pipe.run_train(**make_batch(seed=0))
    pipe.run_eval(**make_batch(seed=0))
    assert pipe.recompiles == [], pipe.recompiles

    # A real recompile (another sequence length) is reported with its cause.
    pipe.run_train(**make_batch(seed=0, seq=12))
    assert len(pipe.recompiles) == 1
    why = pipe.recompiles[0]
    assert f"[rank {rank}] stage recompiled" in why
    assert "16" in why and "12" in why, why  # the input whose shape changed


def test_recompiles_are_reported_with_their_cause_and_nothing_else_is():
    run_ranks(2, _recompile_watch, timeout=300)


def _compiled_zero_bubble(rank, world, schedule):
    from torch._dynamo.utils import counters

    from pippy_xla.split import _split_compile

    split = []  # every split stage this rank's compiles make ([Note: compiled W])
    make = _split_compile._SplitStage.__init__

    def recorded(self, *args, **kwargs):
        make(self, *args, **kwargs)
        split.append(self)

    _split_compile._SplitStage.__init__ = recorded
    torch.manual_seed(0)
    model, layer_cls = llama()
    eager_model = copy.deepcopy(model)
    kw = {"layer_cls": layer_cls, "num_microbatches": 4, "schedule": schedule}
    pipe = px.PipelineModel(model, compile=True, **kw)
    eager = px.PipelineModel(eager_model, **kw)
    graphs = []
    for step in range(3):
        batch = make_batch(seed=step)
        loss, eager_loss = pipe.run_train(**batch), eager.run_train(**batch)
        assert_close_compiled(loss, eager_loss, "loss", f"{schedule} step {step}")
        graphs.append(int(counters["stats"]["unique_graphs"]))
    assert graphs[1:] == [graphs[0]] * 2, f"recompiled after step 1: graphs per step {graphs}"
    assert pipe.recompiles == []
    for (name, p), (_, q) in zip(pipe.named_parameters(), eager.named_parameters(), strict=True):
        assert_close_compiled(p.grad, q.grad, "grad", f"{schedule}: {name}")
    # W is real work: each local stage's training graph was split, and its weight graph, which
    # returns parameter gradients, ran (it is compiled at its first call).
    return [(len(st.weight_slots), st.weight_backward.compiled is not None) for st in split]


@pytest.mark.compiled
def test_compiled_stages_with_split_backward_match_eager():
    # ZB-V: a split backward with two stages per rank in a V (the last rank's two stages hand
    # over locally); every stage compiled into forward, input-gradient and weight-gradient graphs.
    out = run_ranks(2, _compiled_zero_bubble, "zbv", timeout=600)
    for stages in out:
        assert len(stages) == 2 and all(n > 0 and ran for n, ran in stages), stages


class _Stage(torch.nn.Module):
    """A stage's kinds of inputs and work: a batch input without gradients (a mask), a hidden
    state from the previous stage that takes one, projections, a norm and a residual. The split
    backend's B and W on HF's decoder layers are test_compiled_stages_with_split_backward's
    (compiled ZB-V against eager); this one looks at the nodes themselves, on a graph with a
    third of the kernels inductor compiles for a Llama stage (about 2.5 s of g++ each)."""

    def __init__(self) -> None:
        super().__init__()
        self.up = torch.nn.Linear(64, 128)
        self.norm = torch.nn.LayerNorm(128)
        self.down = torch.nn.Linear(128, 64)

    def forward(self, mask, hidden):
        h = hidden * mask.unsqueeze(-1)
        return (self.down(torch.nn.functional.silu(self.norm(self.up(h)))) + hidden,)


def _stage_and_input():
    torch.manual_seed(0)
    batch = make_batch(seed=0)
    hidden = torch.randn(8, 16, 64)
    return _Stage(), (batch["attention_mask"].float(),), hidden


@pytest.mark.compiled
def test_compiled_stage_leaves_weight_gradients_to_w():
    from torch._dynamo.utils import counters

    from pippy_xla import _C
    from pippy_xla.split._split_compile import split_backward_backend

    torch._dynamo.reset()
    stage, batch_args, hidden = _stage_and_input()
    eager = copy.deepcopy(stage)
    compiled = torch.compile(stage, backend=split_backward_backend())
    for step in range(2):
        h = hidden.clone().requires_grad_()
        h_eager = hidden.clone().requires_grad_()
        (out,) = compiled(*batch_args, h)
        (ref,) = eager(*batch_args, h_eager)
        assert_close_compiled(out, ref, "output", f"step {step}: output")
        grad = torch.randn_like(ref)
        ref.backward(grad)
        # B: input gradients only; no parameter has a gradient yet.
        (h_grad,), work = _C.input_gradients([out], [grad], [h])
        assert_close_compiled(h_grad, h_eager.grad, "grad", f"step {step}: input")
        assert all(p.grad is None for p in stage.parameters())
        # W: every parameter's gradient, equal to eager's.
        work.run()
        for (name, p), (_, q) in zip(
            stage.named_parameters(), eager.named_parameters(), strict=True
        ):
            assert_close_compiled(p.grad, q.grad, "grad", f"step {step}: {name}")
            p.grad = q.grad = None
        if step == 0:
            graphs = int(counters["stats"]["unique_graphs"])
    assert int(counters["stats"]["unique_graphs"]) == graphs  # no recompile
    # A full backward (1F1B's) runs both nodes.
    h = hidden.clone().requires_grad_()
    compiled(*batch_args, h)[0].backward(grad)
    assert all(p.grad is not None for p in stage.parameters())


class _CountingNorm(torch.nn.Module):
    """Mutates a buffer in forward: the split backend keeps one backward node for it."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)
        self.register_buffer("calls", torch.zeros(()))

    def forward(self, x):
        self.calls.add_(1)
        return self.lin(x).relu()


def test_compiled_stage_that_mutates_a_buffer_falls_back_with_a_warning():
    import pytest

    from pippy_xla.split._split_compile import split_backward_backend

    torch._dynamo.reset()
    torch.manual_seed(0)
    module = _CountingNorm()
    eager = copy.deepcopy(module)
    x = torch.randn(3, 4, requires_grad=True)
    with pytest.warns(UserWarning, match="mutates an input"):
        out = torch.compile(module, backend=split_backward_backend())(x)
    out.sum().backward()
    eager(x.detach()).sum().backward()
    torch.testing.assert_close(module.lin.weight.grad, eager.lin.weight.grad)
    assert float(module.calls) == 1.0


_PRINT_FINGERPRINTS = textwrap.dedent(
    """
    import hashlib, sys, torch
    sys.path.insert(0, "tests")
    from models import MODELS
    import pippy_xla as px
    torch.manual_seed(int(sys.argv[1]))
    model, cls = MODELS["llama"]()
    for st in px.partition(model, cls, [(0, 1), (1, 3), (3, 4)]):
        print(px.fingerprint(st).to_json())
    model, cls = MODELS["olmo3"]()
    stages = px.partition(model, cls, [(0, 2), (2, 4)])
    print(hashlib.sha256("".join(st.code for st in stages).encode()).hexdigest())
    """
)


def test_fingerprints_and_traces_identical_across_processes_and_seeds():
    """Two processes, each with its own torch seed and hash seed (as torchrun's ranks have), and
    this one: Llama's stage fingerprints are the same, and so is the code of Olmo 3's stages,
    which builds its rotary tables iterating over a set of layer types: without canonical graphs
    the order of its nodes follows the hash seed (see [Note: canonical graphs])."""
    runs = [
        subprocess.run(
            [sys.executable, "-c", _PRINT_FINGERPRINTS, str(seed)],
            capture_output=True,
            text=True,
            check=True,
            env={**os.environ, "PYTHONHASHSEED": hash_seed},
        ).stdout
        for seed, hash_seed in ((0, "1"), (1, "2"))
    ]
    assert runs[0] == runs[1]
    *lines, digest = runs[0].splitlines()
    assert len(digest) == len(hashlib.sha256().hexdigest()), digest
    prints = [px.Fingerprint.from_json(line) for line in lines]
    assert len(prints) == 3 and len({p.digest for p in prints}) == 3
    model, cls = MODELS["llama"]()
    here = [px.fingerprint(st) for st in px.partition(model, cls, [(0, 1), (1, 3), (3, 4)])]
    assert [p.digest for p in here] == [p.digest for p in prints]
    assert all(px.explain_difference(a, b) is None for a, b in zip(here, prints, strict=True))


def test_explain_difference_names_the_first_difference():
    model, cls = llama()
    a = px.partition(model, cls, [(0, 2), (2, 4)])
    b = px.partition(model, cls, [(0, 1), (1, 4)])
    why = px.explain_difference(a[0], b[0])
    assert "decoder layers differ: (0, 1) vs (0,)" in why, why

    wide, wcls = llama()
    wide.config.rms_norm_eps = 1e-3  # same parameters, other constant in the code
    for layer in wide.model.layers:
        layer.input_layernorm.variance_epsilon = 1e-3
    c = px.partition(model, cls, [(0, 2), (2, 4)])
    assert px.explain_difference(a[1], c[1]) is None
    half = copy.deepcopy(model).to(torch.bfloat16)
    d = px.partition(half, cls, [(0, 2), (2, 4)])
    why = px.explain_difference(a[1], d[1])
    assert "has dtype float32 vs bfloat16" in why, why

    g, gcls = gpt2()
    fp = px.fingerprint(px.partition(g, gcls, [(0, 4)])[0])
    lines = fp.code.splitlines()
    lines[3] += "  # edited"
    mutated = dataclasses.replace(fp, code="\n".join(lines))
    why = px.explain_difference(fp, mutated)
    assert why is not None and "generated code first differs at line 4" in why, why


def _stash_is_zero_copy(rank, world, compile):
    """Inside every forward, the earlier microbatches still in the stash hold the very tensors
    the stage received and produced (same storage), the stash's live bytes equal their bytes,
    and the peak never exceeds min(stages - s, microbatches) microbatches' worth."""
    torch.manual_seed(0)
    model, layer_cls = llama()
    m = 4
    # aot_eager: dynamo + AOTAutograd, as with inductor, without inductor's code generation time.
    pipe = px.PipelineModel(
        model,
        layer_cls=layer_cls,
        num_microbatches=m,
        compile=compile,
        compile_options={"backend": "aot_eager"},
    )
    engine = pipe.engine
    seen: dict[int, list[tuple[int, int]]] = {}
    per_mb_bytes: list[int] = []
    checks = 0

    original_forward = _step.stage_forward

    def instrumented(*a, **k):
        fwd = original_forward(*a, **k)

        def wrapped(stage, mb, inputs):
            nonlocal checks
            live = 0
            for old in sorted(seen):
                if not engine.stash_contains(stage, old):
                    continue
                slot = engine.stash_peek(stage, old)
                ptrs = [
                    (t.untyped_storage().data_ptr(), t.nbytes)
                    for t in [*slot.inputs, *slot.outputs]
                ]
                assert ptrs == seen[old], f"stash slot {old} was copied or replaced"
                live += sum(n for _, n in ptrs)
                checks += 1
            assert engine.stash_live_bytes == live
            out = fwd(stage, mb, inputs)
            seen[mb] = [(t.untyped_storage().data_ptr(), t.nbytes) for t in [*inputs, *out]]
            per_mb_bytes.append(sum(n for _, n in seen[mb]))
            return out

        return wrapped

    _step.stage_forward = instrumented  # this rank's process only
    for step in range(2):
        seen.clear()
        per_mb_bytes.clear()
        pipe.reset_stash_peak()
        pipe.run_train(**make_batch(seed=step))
        assert engine.stash_live_bytes == 0
        in_flight = min(world - rank, m)
        assert pipe.stash_peak_bytes <= in_flight * max(per_mb_bytes)
        assert pipe.stash_peak_bytes >= in_flight * min(per_mb_bytes)
    return checks, pipe.stash_peak_bytes


def test_stash_keeps_storage_and_bounded_peak_eager_and_compiled():
    for compile in (False, True):
        out = run_ranks(2, _stash_is_zero_copy, compile, timeout=600)
        # Stage 0 holds up to 2 microbatches in flight, so it checked earlier slots.
        assert out[0][0] > 0
        assert out[0][1] > out[1][1]  # the first stage's peak is the larger one
