"""Pipeline x expert parallel on a (dp=2, pp=2) mesh of 4 gloo ranks, ``expert_parallel=2``:
each stage's experts sharded over its two replicas (HF's own expert plan and all-to-all
dispatch), against one process on the global batch: the loss, the router's auxiliary loss,
every gradient (an expert's against the reference's expert of the same index), the global
gradient norm and the parameters after AdamW steps. Many cases run in one spawn of the ranks."""

from __future__ import annotations

import copy
import os

import pytest
import torch
from models import MODELS, TINY_FAMILIES, full, make_batch, reference_step, tiny
from test_moe import TOL
from transformers import MixtralForCausalLM

import pippy_xla as px
from pippy_xla.hf_compat import expert_parallel_api
from pippy_xla.testing import run_ranks


def _hf_expert_parallel() -> bool:
    try:
        expert_parallel_api()
    except NotImplementedError:
        return False
    return True


HF_EXPERT_PARALLEL = _hf_expert_parallel()
"""Whether this transformers has HF's all-to-all expert parallelism (5.23 on)."""

EP = 2
EXPERTS = 4  # the tiny MoE families' (tests/models.py)


def _mesh(dp=2, pp=2, tp=None):
    from torch.distributed.device_mesh import init_device_mesh

    if tp is None:
        return init_device_mesh("cpu", (dp, pp), mesh_dim_names=("dp", "pp"))
    return init_device_mesh("cpu", (dp, pp, tp), mesh_dim_names=("dp", "pp", "tp"))


def _close(actual, expected, kind, msg):
    torch.testing.assert_close(actual, expected, **TOL[kind], msg=msg)


def _experts_of(name: str, ep_rank: int, ep: int = EP) -> slice | None:
    """The reference's experts that this rank's shard of parameter ``name`` holds (``None`` for
    a dense parameter)."""
    if ".experts." not in name:
        return None
    per = EXPERTS // ep
    return slice(ep_rank * per, (ep_rank + 1) * per)


def _case(
    mesh,
    family,
    schedule,
    mode="replicate",
    layers=2,
    steps=2,
    mbs=2,
    uneven=False,
    clip=None,
    save=None,
    ep=EP,
    over_batch=False,
):
    """``steps`` AdamW steps of the pipeline against :func:`reference_step` on the global batch
    (``mbs`` microbatches per replica); with ``uneven``, the router of the first layer sends
    every token to experts 2 and 3 (its weight zero, all logits equal: ``topk`` takes the last
    ones), so one expert rank gets no token and the other all of them; with ``clip``, the
    gradients are clipped to that global norm before each step; with ``save``, the model is
    written there in HF's layout after the steps and loaded back; on a mesh with a ``tp`` dim,
    the decoder layers are sharded by the model's tp plan too, the experts by ``ep`` of the
    stage's dp x tp ranks; with ``over_batch``, the router's loss is the global batch's
    (``pipe.added_over_batch``), against one process's loss of the whole batch. Returns the
    losses."""
    dp_size = mesh["dp"].size()
    dp_rank = mesh["dp"].get_local_rank()
    tp = mesh["tp"].size() if "tp" in mesh.mesh_dim_names else 1
    tp_rank = mesh["tp"].get_local_rank() if tp > 1 else 0
    # Expert groups of ep consecutive ranks of the stage's dp x tp (efsdp = dp x tp / ep copies).
    ep_rank = (dp_rank * tp + tp_rank) % ep
    options = {"tensor_parallel": "auto"} if tp > 1 else {}
    torch.manual_seed(0)
    model, layer_cls = MODELS[family](layers=layers)
    if uneven:
        with torch.no_grad():
            model.model.layers[0].mlp.gate.weight.zero_()
    ref = copy.deepcopy(model)
    pipe = px.PipelineModel(
        model,
        layer_cls=layer_cls,
        num_microbatches=mbs,
        schedule=schedule,
        mesh=mesh,
        data_parallel=mode,
        expert_parallel=ep,
        timeout=60,
        **options,
    )
    pipe.added_over_batch = over_batch
    named = dict(pipe.named_parameters())
    experts = [n for n in named if _experts_of(n, ep_rank, ep) is not None]
    assert experts, f"{family}: no experts on this rank"
    for n in experts:  # each expert rank holds its share of the experts, whole
        assert named[n].to_local().shape[0] == EXPERTS // ep, n
    opt = torch.optim.AdamW(pipe.parameters(), lr=1e-3, eps=1e-6)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-3, eps=1e-6)
    losses = []
    for step in range(steps):
        where = (
            f"{family} {schedule} {mode} dp={dp_rank}/{dp_size} tp={tp_rank}/{tp} ep={ep} "
            f"uneven={uneven} over_batch={over_batch} step={step}"
        )
        batch = make_batch(seed=step, batch=8)
        loss = pipe.run_train(**batch)
        ref_loss, ref_aux = reference_step(ref, batch, 1 if over_batch else mbs * dp_size)
        _close(loss, ref_loss, "loss", where)
        aux = pipe.last_losses["aux"]
        assert aux > 0, where
        _close(torch.tensor(aux), torch.tensor(ref_aux), "loss", f"{where}: aux")
        for name, p in named.items():
            ref_grad = ref.get_parameter(name).grad
            rows = _experts_of(name, ep_rank, ep)
            if rows is None:
                _close(full(p.grad), ref_grad, "grad", f"{where}: {name}")
            else:
                _close(p.grad.to_local(), ref_grad[rows], "grad", f"{where}: {name}")
        if clip is not None:  # every expert counted once, on one of the ranks
            norm = pipe.clip_grad_norm_(clip)
            ref_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), clip)
            assert float(ref_norm) > 2 * clip, where  # the clipping scales
            _close(norm, ref_norm, "loss", f"{where}: norm")
        opt.step()
        ref_opt.step()
        opt.zero_grad()
        ref_opt.zero_grad()
        for name, p in named.items():
            rows = _experts_of(name, ep_rank, ep)
            mine = full(p) if rows is None else p.to_local()
            want = ref.get_parameter(name) if rows is None else ref.get_parameter(name)[rows]
            _close(mine.detach(), want.detach(), "param", f"{where}: {name}")
        losses.append(float(loss))
    if save is not None:  # every expert once, from the rank holding it
        pipe.save_pretrained(save)
        if torch.distributed.get_rank() == 0:
            from transformers import AutoModelForCausalLM

            loaded = AutoModelForCausalLM.from_pretrained(save)
            for name, t in ref.state_dict().items():
                _close(loaded.state_dict()[name], t, "param", f"{family} saved: {name}")
    ids = make_batch(seed=5)["input_ids"][:4]
    _refused(lambda: pipe.generate(ids, max_new_tokens=2), f"generate with expert_parallel={ep}")
    return losses


class _WithWeightPenalty(MixtralForCausalLM):
    """A Mixtral that adds a term of its parameters alone to its loss."""

    def forward(self, input_ids=None, attention_mask=None, labels=None, **kwargs):
        out = super().forward(
            input_ids=input_ids, attention_mask=attention_mask, labels=labels, **kwargs
        )
        if labels is not None:
            out.loss = out.loss + 1e-3 * self.lm_head.weight.square().sum()
        return out


def _refused(build, *expected: str) -> str:
    """The one-line message ``build()`` raises, checked to say ``expected``."""
    with pytest.raises((ValueError, NotImplementedError)) as e:
        build()
    msg = str(e.value)
    assert "\n" not in msg and all(x in msg for x in expected), msg
    return msg


def _refusals(mesh, tp_mesh) -> list[str]:
    """What the pipeline refuses at build, on every rank alike (no collective runs first);
    ``tp_mesh``: a mesh with a ``tp`` dim."""

    def build(family="qwen3_moe", ep=EP, mesh=mesh, model=None, tensor_parallel=None, **overrides):
        if model is None:
            if overrides:
                model, layer_cls = tiny(family, layers=2, **{**TINY_FAMILIES[family], **overrides})
            else:
                model, layer_cls = MODELS[family](layers=2)
        else:
            layer_cls = None
        options = {"mesh": mesh} if mesh is not None else {}
        if tensor_parallel is not None:
            options["tensor_parallel"] = tensor_parallel
        return px.PipelineModel(
            model,
            layer_cls=layer_cls,
            num_microbatches=2,
            expert_parallel=ep,
            timeout=60,
            **options,
        )

    def odd_style():
        model, _ = MODELS["qwen3_moe"](layers=2)
        model.ep_plan = {**model.ep_plan, "model.layers.*.mlp.experts.down_proj": "rowwise"}
        return build(model=model)

    def dense_beside_tp():  # a parameter kept whole, its gradient partial over tp: not yet
        model, _ = MODELS["qwen3_moe"](layers=2)
        kept = "model.layers.*.mlp.experts.down_proj"
        model.ep_plan = {**model.ep_plan, kept: "replicated_with_grad_allreduce"}
        return build(model=model, mesh=tp_mesh, tensor_parallel="auto")

    def lora_on_experts():  # PEFT's update covers every expert, its lora_B interleaves them
        from peft import LoraConfig, get_peft_model

        model, _ = MODELS["mixtral"](layers=2)
        config = LoraConfig(r=2, target_modules=[], target_parameters=_EXPERT_PARAMS)
        return build(model=get_peft_model(model, config))

    def parameter_term():  # its gradient would be added once per microbatch
        model = _WithWeightPenalty(MODELS["mixtral"](layers=2)[0].config)
        build(model=model).added_over_batch = True

    def without_plan():
        model, _ = MODELS["qwen3_moe"](layers=2)
        model.ep_plan = {}
        return build(model=model)

    return [
        _refused(lambda: build(ep=4), "expert_parallel=4", "dp x tp"),
        _refused(lambda: build(num_experts=3), "3 experts", "expert_parallel=2"),
        _refused(lambda: build("llama"), "LlamaForCausalLM has no HF expert-parallel plan"),
        _refused(without_plan, "no HF expert-parallel plan"),
        _refused(lora_on_experts, "PEFT adapts", "mlp.experts", "target_parameters"),
        _refused(parameter_term, "parameters alone", "over the whole batch"),
        _refused(odd_style, "['rowwise']", "does not apply"),
        _refused(dense_beside_tp, "experts.down_proj whole", "beside tensor parallelism"),
        _refused(lambda: build(mesh=None), "needs mesh="),
    ]


def _checkpoints(mesh, tmp: str) -> list[str]:
    """A step of ``expert_parallel=2`` on ``mesh`` saved (DCP, with AdamW's state) and loaded
    into the same layout, into the same mesh without expert parallelism and into dp=4 x pp=1
    with ``expert_parallel=4``: the next step equal to one process's; the reference's HF
    checkpoint read by ``load_pretrained`` under ``expert_parallel=2`` (each rank its experts),
    in the model's fused layout and in HF's ``save_pretrained`` layout (a key per expert, merged
    as ``from_pretrained`` merges them), equal to it. Returns what was checked."""
    family = "mixtral_router_loss"
    torch.manual_seed(0)
    ref, layer_cls = MODELS[family](layers=2)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-3, eps=1e-6)

    def pipeline(mesh, ep):
        torch.manual_seed(1)  # other weights than the reference's: the load must set them all
        model, _ = MODELS[family](layers=2)
        options = {} if ep is None else {"expert_parallel": ep}
        # 4 microbatches of 2 rows in all (the router loss is per microbatch), as the reference's
        mbs = 4 // mesh["dp"].size()
        return px.PipelineModel(
            model, layer_cls=layer_cls, num_microbatches=mbs, mesh=mesh, timeout=60, **options
        )

    def check(pipe, ep, where):
        ep_rank = pipe.mesh["dp"].get_local_rank() % ep if ep else 0
        for name, p in pipe.named_parameters():
            rows = _experts_of(name, ep_rank, ep) if ep else None
            mine = full(p) if rows is None else p.to_local()
            want = ref.get_parameter(name) if rows is None else ref.get_parameter(name)[rows]
            _close(mine.detach(), want.detach(), "param", f"{where}: {name}")

    def step(pipe, opt, seed):
        batch = make_batch(seed=seed, batch=8)
        if pipe is not None:
            pipe.run_train(**batch)
            opt.step()
            opt.zero_grad()
        return batch

    if torch.distributed.get_rank() == 0:  # the model's own layout (experts fused)
        from safetensors.torch import save_file

        os.makedirs(f"{tmp}-hf")
        save_file(ref.state_dict(), f"{tmp}-hf/model.safetensors", metadata={"format": "pt"})
        ref.config.save_pretrained(f"{tmp}-hf")
        loaded = type(ref).from_pretrained(f"{tmp}-hf")  # HF reads it as the reference
        for name, t in ref.state_dict().items():
            _close(loaded.state_dict()[name], t, "param", f"from_pretrained: {name}")
        ref.save_pretrained(f"{tmp}-hf-experts")  # HF's own layout: a key per expert
    torch.distributed.barrier()
    saver = pipeline(mesh, EP)
    saver.load_pretrained(f"{tmp}-hf-experts")
    check(saver, EP, "load_pretrained of a key per expert")
    with torch.no_grad():
        for p in saver.parameters():
            p.zero_()
    saver.load_pretrained(f"{tmp}-hf")
    check(saver, EP, "load_pretrained")
    opt = torch.optim.AdamW(saver.parameters(), lr=1e-3, eps=1e-6)
    reference_step(ref, step(saver, opt, 0), 4)
    ref_opt.step()
    ref_opt.zero_grad()
    saver.save(tmp, opt, step=1)
    reference_step(ref, step(None, None, 1), 4)
    ref_opt.step()
    checked = ["load_pretrained"]
    for where, layout, ep in (
        ("same", mesh, EP),
        ("no ep", mesh, None),
        ("4x1 ep=4", _mesh(4, 1), 4),
    ):
        pipe = pipeline(layout, ep)
        opt = torch.optim.AdamW(pipe.parameters(), lr=1e-3, eps=1e-6)
        assert pipe.load(tmp, opt) == 1, where
        step(pipe, opt, 1)
        check(pipe, ep, f"loaded into {where}")
        checked.append(where)
    return checked


def _peft(mesh, tmp: str) -> list[str]:
    """PEFT's LoRA on the dp=2 x pp=2 mesh: on the attention (``target_modules``) with
    ``expert_parallel=2``, and on the experts themselves (PEFT's ``target_parameters``) with the
    experts replicated (beside expert parallelism it is refused, :func:`_refusals`): two AdamW
    steps of the adapters (one for the experts') against PEFT in one process on the global batch,
    the router's loss over it; the adapter ``save_pretrained`` writes equal to PEFT's own.
    Returns what was checked."""
    from peft import LoraConfig, get_peft_model
    from test_peft import _same_adapter_files

    checked = []
    for name, ep, steps, targets in (
        ("attention", EP, 2, {"target_modules": ["q_proj", "v_proj"]}),
        ("experts", None, 1, {"target_modules": [], "target_parameters": _EXPERT_PARAMS}),
    ):
        torch.manual_seed(0)
        model, layer_cls = MODELS["mixtral_router_loss"](layers=2)
        peft_model = get_peft_model(model, LoraConfig(r=2, init_lora_weights=False, **targets))
        ref = copy.deepcopy(peft_model)
        options = {} if ep is None else {"expert_parallel": ep}
        pipe = px.PipelineModel(
            peft_model, layer_cls=layer_cls, num_microbatches=2, mesh=mesh, timeout=60, **options
        )
        pipe.added_over_batch = True
        trained = {n: p for n, p in pipe.named_parameters() if p.requires_grad}
        assert trained and all("lora_" in n for n in trained), sorted(trained)
        opt = torch.optim.AdamW(trained.values(), lr=1e-3, eps=1e-6)
        ref_opt = torch.optim.AdamW(
            [p for p in ref.parameters() if p.requires_grad], lr=1e-3, eps=1e-6
        )
        for step in range(steps):
            where = f"LoRA on the {name}, step {step}"
            batch = make_batch(seed=step, batch=8)
            loss = pipe.run_train(**batch)
            ref_loss = ref(**batch, use_cache=False).loss
            ref_loss.backward()
            _close(loss, ref_loss.detach(), "loss", where)
            for n, p in trained.items():
                _close(full(p.grad), ref.get_parameter(n).grad, "grad", f"{where}: {n}")
            opt.step()
            ref_opt.step()
            opt.zero_grad()
            ref_opt.zero_grad()
        pipe.save_pretrained(f"{tmp}-{name}")
        if torch.distributed.get_rank() == 0:
            _same_adapter_files(f"{tmp}-{name}", ref, f"{tmp}-{name}-peft", **TOL["param"])
        checked.append(name)
    return checked


_EXPERT_PARAMS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
"""The tiny Mixtral's experts' parameters, as PEFT's ``target_parameters`` names them."""


def _cases(rank, world, cases, efsdp_cases, tp_cases, save):
    mesh = _mesh()
    if not HF_EXPERT_PARALLEL:  # transformers before 5.23: refused in one line
        return [_refused(lambda: _case(mesh, *cases[0]), "transformers>=5.23")]
    out = [_checkpoints(mesh, f"{save}-dcp"), _peft(mesh, f"{save}-peft")]
    out += [
        _case(mesh, *_args(case), save=save if i == 0 else None, **_keywords(case))
        for i, case in enumerate(cases)
    ]
    wide = _mesh(4, 1)  # 4 replicas, expert groups of 2: two copies of each expert
    out += [_case(wide, *case) for case in efsdp_cases]
    with_tp = _mesh(2, 1, 2)  # 2 replicas x 2 tp ranks of one stage
    out += [_case(with_tp, *case[:-2], ep=case[-2], **case[-1]) for case in tp_cases]
    return out + _refusals(mesh, with_tp)


def _args(case: tuple) -> tuple:
    """A case's positional arguments of :func:`_case` (those before a trailing dict)."""
    return case[:-1] if isinstance(case[-1], dict) else case


def _keywords(case: tuple) -> dict:
    """A case's keyword arguments of :func:`_case`: its trailing dict, if any."""
    return case[-1] if isinstance(case[-1], dict) else {}


# Every kind of schedule: 1f1b, zero-bubble with the backward split (an expert's weight
# gradient in W, its all-to-alls in B), two stages per rank (interleaved, zbv's V); dense
# weights replicated or sharded over the replicas; tied embeddings (Qwen3-MoE's). The router's
# loss per microbatch, or over the global batch (``over_batch``: one process's loss of the
# whole batch, as HF's Trainer computes it).
CASES = [
    ("qwen3_moe_router_loss", "1f1b", "replicate", 2, 2, 2, False, 0.05),
    ("mixtral_router_loss", "zbh1", "shard", {"over_batch": True}),
    ("mixtral_router_loss", "interleaved", "replicate", 4, {"over_batch": True}),
    ("qwen3_moe_router_loss", "zbv", "shard", 4, 1),
    ("mixtral_router_loss", "gpipe", "replicate", 2, 1, 2, True),
]


# dp=4 x pp=1, expert_parallel=2: each expert's gradient summed over its two copies.
EFSDP_CASES = [("mixtral_router_loss", "1f1b", "shard", 2, 2, 2, False, 0.05)]


# dp=2 x pp=1 x tp=2, the layers sharded by the tp plan too: expert groups drawn from dp x tp
# (HF's rule: ep a multiple of tp dividing dp x tp), the batch sliced over each tp group by HF's
# dispatch; ep=2 (each tp group an expert group, two copies of each expert) and ep=4 (one).
TP_CASES = [
    ("qwen3_moe_router_loss", "1f1b", "replicate", 2, 2, 2, False, 0.05, None, 2, {}),
    ("mixtral_router_loss", "1f1b", "shard", 2, 1, 2, False, None, None, 4, {"over_batch": True}),
]


@pytest.mark.compat
def test_expert_parallel_equals_one_process(tmp_path):
    save = str(tmp_path / "saved")
    out = run_ranks(4, _cases, CASES, EFSDP_CASES, TP_CASES, save, timeout=300)
    assert all(o == out[0] for o in out)  # every rank the same losses and refusals


def _failure_before_dispatch(rank, world):
    """Rank 2 raises before its first expert layer's all-to-all; rank 0, its expert peer, waits
    in that all-to-all: the pipeline's timeout (3 s) ends the wait, not the process group's."""
    torch.manual_seed(0)
    model, layer_cls = MODELS["mixtral"](layers=2)
    pipe = px.PipelineModel(
        model, layer_cls=layer_cls, num_microbatches=2, mesh=_mesh(), expert_parallel=EP, timeout=3
    )
    if rank == 2:

        def fail(*_):
            raise RuntimeError("injected failure before the expert all-to-all")

        model.model.layers[0].mlp.experts.register_forward_pre_hook(fail)
    with pytest.raises(px.PipelineError) as e:
        pipe.run_train(**make_batch(seed=0, batch=8))
    return e.value.failed_rank, e.value.stage, e.value.microbatch, str(e.value)


def test_a_peer_failing_before_the_expert_all_to_all_ends_it_within_the_timeout():
    """HF's all-to-alls wait at most the pipeline's ``timeout`` (see the Failures of [Note:
    pipeline x expert parallel]): rank 0, waiting in the all-to-all of a peer that raised and
    lives on, fails its step within it (before, at the process group's timeout, here 120 s,
    past the test's own 100 s), naming its stage, microbatch and action and the rank that
    failed."""
    out = run_ranks(4, _failure_before_dispatch, pg_timeout=120, timeout=100)
    # The expert pair (ranks 0 and 2) name rank 2. The second stage's ranks fail their first
    # receive too, naming rank 2 or their own wait on rank 0, whichever they learn of first: rank
    # 0 ends its process once it has returned, which a rank waiting on it may see first.
    assert out[0][0] == out[2][0] == 2, out
    assert [o[1:3] for o in (out[1], out[3])] == [(1, 0), (1, 0)], out
    _, stage, microbatch, msg = out[0]
    assert (stage, microbatch) == (0, 0), out[0]
    assert msg.startswith("[rank 0 stage 0] F microbatch 0 aborted: rank 2 failed"), msg


def test_the_router_loss_over_the_batch_is_refused_beside_context_parallelism():
    """``added_over_batch`` (which ``PipelineTrainer`` sets) refuses a model with a router loss
    on a runner with context parallelism, in one line (the check alone, on the stage graphs: a
    cp mesh is not needed to reach it)."""
    from pippy_xla.runtime._step import StepRunner
    from pippy_xla.split import partition

    model, layer_cls = MODELS["mixtral_router_loss"](layers=2)
    runner = StepRunner.__new__(StepRunner)  # what the check reads: the stages and cp
    runner.stages, runner.cp = partition(model, layer_cls, [(0, 1), (1, 2)]), object()
    with pytest.raises(ValueError, match="under context parallelism") as e:
        runner.check_added_over_batch()
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("bad", [0, -2, 2.0, True, "2"])
def test_expert_parallel_must_be_a_positive_int(bad):
    with pytest.raises(ValueError, match="expert_parallel must be None or a positive int"):
        px.PipelineConfig(num_microbatches=2, expert_parallel=bad)
