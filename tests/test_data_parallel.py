"""Pipeline x data parallel on a 2-D DeviceMesh (4 gloo ranks) against a one-process reference
trained on the global batch."""

from __future__ import annotations

import copy

import pytest
import torch
from models import MODELS, full, make_batch, on_first_rank
from test_pipeline import ADAM, LOSS_TOL, PARAM_TOL, check_grads, whole_batch_step

import pippy_xla as px
from pippy_xla.testing import run_ranks


def _mesh(dp: int, pp: int):
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", (dp, pp), mesh_dim_names=("dp", "pp"))


def _build(family: str, seed: int):
    torch.manual_seed(seed)
    return MODELS[family]()


def _assert_params_equal(pipe, ref, where: str) -> int:
    """``pipe``'s parameters equal ``ref``'s (a model, or its values by name)."""
    n = 0
    for name, p in pipe.named_parameters():
        torch.testing.assert_close(
            full(p).detach(),
            ref[name] if isinstance(ref, dict) else ref.get_parameter(name).detach(),
            **PARAM_TOL,
            msg=lambda m, name=name: f"{where}: param {name}\n{m}",
        )
        n += 1
    return n


def _reference_eval(ref, batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """One process's loss and logits of ``batch`` (on the first rank for every rank)."""
    with torch.no_grad():
        out = ref(**batch, use_cache=False)
    return out.loss, out.logits


def _mesh_trains_like_one_process(rank, world, schedule, families, transport, steps=3, mbs=2):
    """For each family and mode: per step the loss and every gradient equal the reference's on
    the global batch; after AdamW steps the parameters still match. Each replica starts from
    another seed: the pipeline must copy the first replica's values (the reference's)."""
    from torch.distributed.tensor import DTensor

    mesh = _mesh(2, 2)
    dp_rank = mesh["dp"].get_local_rank()
    checked = []
    for family in families:
        for mode in ("replicate", "shard"):
            ref, layer_cls = _build(family, seed=0)
            model, _ = _build(family, seed=dp_rank)  # replica 1 starts elsewhere
            pipe = px.PipelineModel(
                model,
                layer_cls=layer_cls,
                num_microbatches=mbs,
                schedule=schedule,
                mesh=mesh,
                data_parallel=mode,
                timeout=60,
                transport=transport,
            )
            assert (pipe.dp_rank, pipe.dp_size, pipe.num_ranks) == (dp_rank, 2, 2)
            params = dict(pipe.named_parameters())
            assert all(isinstance(p, DTensor) for p in params.values())
            if mode == "shard":  # each replica holds half of every (even-sized) dim 0
                name, p = next((n, p) for n, p in params.items() if p.dim() == 2)
                assert p.to_local().shape[0] == p.shape[0] // 2, name
            where0 = f"{family} {schedule} {mode} rank={rank}"
            assert _assert_params_equal(pipe, ref, f"{where0} start") > 0
            opt = torch.optim.AdamW(pipe.parameters(), **ADAM)
            ref_opt = torch.optim.AdamW(ref.parameters(), **ADAM)
            losses = []
            for step in range(steps):
                batch = make_batch(seed=step, batch=8)
                loss = pipe.run_train(**batch)
                ref_loss, grads, values = on_first_rank(whole_batch_step, ref, batch, ref_opt)
                where = f"{where0} step={step}"
                torch.testing.assert_close(loss, ref_loss, **LOSS_TOL, msg=where)
                check_grads(params.items(), grads, where)
                opt.step()
                opt.zero_grad()
                _assert_params_equal(pipe, values, where)
                losses.append(float(loss))
                if step == 0 and px.schedule_info(schedule).list_scheduled:
                    # The replicas average their measured costs: one order on every rank (the
                    # reorder checks that they agree), and later steps still match.
                    tuned = pipe.tune_schedule()
                    assert pipe.engine.schedule.table() == tuned.table()
            out = pipe.run_eval(**make_batch(seed=9, batch=8))
            ref_loss, ref_logits = on_first_rank(_reference_eval, ref, make_batch(seed=9, batch=8))
            torch.testing.assert_close(out.loss, ref_loss, **LOSS_TOL)
            if pipe.is_last:  # this replica's half of the batch
                half = slice(4 * dp_rank, 4 * dp_rank + 4)
                torch.testing.assert_close(out.logits, ref_logits[half], **PARAM_TOL)
            checked.append((family, mode, losses, sorted(params)))
    return checked


@pytest.mark.parametrize(
    "schedule,families,transport",
    # ZB-V with GPT-2: a split backward, and the tied embedding and head on one rank, each stage
    # with its copy ([Note: a copy per stage on a mesh]). Interleaved with the transfers matched
    # in order: each replica's pipeline makes its own groups ([Note: transfers matched in order]).
    [
        ("1f1b", ("llama", "gpt2"), "auto"),
        ("zbv", ("gpt2",), "auto"),
        ("interleaved", ("llama",), "in_order"),
    ],
)
def test_two_by_two_mesh_matches_one_process(schedule, families, transport):
    out = run_ranks(4, _mesh_trains_like_one_process, schedule, families, transport, timeout=420)
    for family in families:
        model, _ = _build(family, seed=0)
        names = {n for n, _ in model.named_parameters()}
        for mode in ("replicate", "shard"):
            runs = [[c for c in checked if c[:2] == (family, mode)][0] for checked in out]
            # Every rank reports the same global losses; each pipeline owns every parameter.
            assert all(r[2] == runs[0][2] for r in runs), runs
            for replica in ((0, 1), (2, 3)):
                owned = set(runs[replica[0]][3]) | set(runs[replica[1]][3])
                assert names <= owned, (family, mode, names - owned)


def _bad_inputs(rank, world):
    from torch.distributed.device_mesh import init_device_mesh

    model, layer_cls = _build("llama", seed=0)
    errors = {}

    def wrap(**kw):
        kw.setdefault("mesh", _mesh(2, 2))
        return px.PipelineModel(copy.deepcopy(model), layer_cls=layer_cls, num_microbatches=2, **kw)

    for case, kw in {
        "unnamed dims": {"mesh": init_device_mesh("cpu", (2, 2))},
        "missing dim": {"mesh": init_device_mesh("cpu", (2, 2), mesh_dim_names=("data", "pp"))},
        "same dims": {"pp_dim": "dp"},
        "group not the pp dim": {"group": _mesh(2, 2).get_group("dp")},
        "mode": {"data_parallel": "ddp"},
        # HSDP: the replicate dim after the shard dim, a missing shard dim, three dp dims, and
        # an HSDP mesh with the default dp_dim.
        "hsdp order": {
            "mesh": init_device_mesh("cpu", (1, 2, 2), mesh_dim_names=("ds", "dr", "pp")),
            "dp_dim": ("dr", "ds"),
        },
        "hsdp missing": {"mesh": _mesh(2, 2), "dp_dim": ("dp", "dp_shard")},
        "hsdp three": {"dp_dim": ("a", "b", "c")},
        "hsdp default": {
            "mesh": init_device_mesh("cpu", (1, 2, 2), mesh_dim_names=("dr", "ds", "pp"))
        },
    }.items():
        with pytest.raises((ValueError, TypeError)) as e:
            wrap(**kw)
        errors[case] = str(e.value)
    pipe = wrap()
    with pytest.raises(ValueError) as e:
        pipe.run_train(**make_batch(seed=0, batch=6))  # 6 is not a multiple of 2 x 2
    errors["batch"] = str(e.value)
    loss = pipe.run_train(**make_batch(seed=0, batch=4))  # a good batch still works after it
    assert torch.isfinite(loss)
    return errors


def test_bad_mesh_arguments_and_batches_say_what_is_wrong():
    errors = run_ranks(4, _bad_inputs)[0]
    assert "('dp', 'pp')" in errors["unnamed dims"] and "None" in errors["unnamed dims"]
    assert "'data', 'pp'" in errors["missing dim"] and "'dp'" in errors["missing dim"]
    assert "must differ" in errors["same dims"]
    assert "not the mesh's pipeline dimension 'pp'" in errors["group not the pp dim"]
    assert "'replicate', 'shard'" in errors["mode"]
    assert "have 'ds' before 'dr'; build the mesh with 'dr' before 'ds'" in errors["hsdp order"]
    assert "('dp_shard' missing)" in errors["hsdp missing"]
    assert "two names (replicate, shard)" in errors["hsdp three"]
    assert "('dp' missing)" in errors["hsdp default"] and "HSDP" in errors["hsdp default"]
    assert "data-parallel size 2 x num_microbatches=2 = 4" in errors["batch"]


def _assert_params_equal_models(model, ref, where: str) -> None:
    for name, p in ref.named_parameters():
        torch.testing.assert_close(
            model.get_parameter(name),
            p,
            **PARAM_TOL,
            msg=lambda m, name=name: f"{where}: {name}\n{m}",
        )


def _checkpoint_across_meshes(rank, world, tmp):
    """2 (dp) x 2 (pp) trains two steps and saves (DCP, and HF's layout); 1 x 4, 4 x 1 and HSDP
    2 (dp_replicate) x 2 (dp_shard) x 1 load it and take a third step, equal to three steps of
    the reference (parameters and optimizer state restored)."""
    from torch.distributed.device_mesh import init_device_mesh

    ref, layer_cls = _build("llama", seed=0)
    ref_opt = torch.optim.AdamW(ref.parameters(), **ADAM)

    def ref_step(step):
        ref(**make_batch(seed=step, batch=8), use_cache=False).loss.backward()
        ref_opt.step()
        ref_opt.zero_grad()

    def pipeline(dp, pp, hsdp=False):
        model, _ = _build("llama", seed=1)  # overwritten by the load
        mesh, dims = (_mesh(dp, pp) if dp > 1 else None), "dp"
        if hsdp:
            dims = ("dp_replicate", "dp_shard")
            mesh = init_device_mesh("cpu", (2, dp // 2, pp), mesh_dim_names=(*dims, "pp"))
        return px.PipelineModel(
            model,
            layer_cls=layer_cls,
            num_microbatches=2,
            mesh=mesh,
            data_parallel="shard",
            dp_dim=dims,
        )

    saver = pipeline(2, 2)
    saver.load_state_dict(ref.state_dict())
    opt = torch.optim.AdamW(saver.parameters(), **ADAM)
    for step in range(2):
        saver.run_train(**make_batch(seed=step, batch=8))
        opt.step()
        opt.zero_grad()
        ref_step(step)
    saver.save(tmp, opt, step=2)
    saver.save_pretrained(f"{tmp}-hf")  # sharded tensors gathered, the first replica writes
    exported = type(ref).from_pretrained(f"{tmp}-hf")
    _assert_params_equal_models(exported, ref, f"save_pretrained rank={rank}")
    ref_step(2)
    checked = []
    for dp, pp, hsdp in ((1, 4, False), (4, 1, False), (4, 1, True)):
        pipe = pipeline(dp, pp, hsdp)
        opt = torch.optim.AdamW(pipe.parameters(), **ADAM)
        assert pipe.load(tmp, opt) == 2
        pipe.run_train(**make_batch(seed=2, batch=8))
        opt.step()
        checked.append((dp, pp, _assert_params_equal(pipe, ref, f"{dp}x{pp} rank={rank}")))
    return checked


def test_checkpoint_saved_on_a_mesh_loads_on_other_meshes(tmp_path):
    out = run_ranks(4, _checkpoint_across_meshes, str(tmp_path / "ckpt"), timeout=420)
    for rank_checks in out:
        assert [(dp, pp) for dp, pp, n in rank_checks] == [(1, 4), (4, 1), (4, 1)]
        assert all(n > 0 for _, _, n in rank_checks)
