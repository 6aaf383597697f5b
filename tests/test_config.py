"""PipelineConfig: validated once with clear errors; a config and keyword options build the same
pipeline; activation checkpointing from the config. The import structure: test_layout.py."""

from __future__ import annotations

import copy
import re

import pytest
import torch
from models import llama, make_batch

import pippy_xla as px
from pippy_xla.config import PipelineConfig
from pippy_xla.testing import run_ranks


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"num_microbatches": 0}, "num_microbatches must be a positive int, got 0"),
        ({"num_microbatches": True}, "num_microbatches must be a positive int"),
        ({"num_microbatches": 2, "schedule": "1F1B"}, "schedule must be one of"),
        ({"num_microbatches": 2, "chunks": 0}, "chunks must be a positive int, got 0"),
        ({"num_microbatches": 2, "timeout": 0}, "timeout must be a positive number"),
        ({"num_microbatches": 2, "timeout": float("inf")}, "timeout must be a positive number"),
        ({"num_microbatches": 2, "input_names": "input_ids"}, "input_names must be a non-empty"),
        ({"num_microbatches": 2, "loss_fn": 3}, "loss_fn must be callable"),
        ({"num_microbatches": 2, "data_parallel": "ddp"}, "data_parallel must be one of"),
        ({"num_microbatches": 2, "pp_dim": "x", "dp_dim": "x"}, "pp_dim and tp_dim must differ"),
        ({"num_microbatches": 2, "tensor_parallel": "yes"}, "tensor_parallel must be None, 'auto'"),
        ({"num_microbatches": 2, "tensor_parallel": {3: "colwise"}}, "keys must be module names"),
    ],
)
def test_config_rejects_bad_values(options, message):
    with pytest.raises((ValueError, TypeError), match=message.replace("(", r"\(")):
        PipelineConfig(**options)


def test_config_keeps_its_own_copy_of_tensor_parallel_rules():
    rules = {"model.layers.*.mlp.up_proj": "replicate"}
    config = PipelineConfig(num_microbatches=2, tensor_parallel=rules)
    rules["model.layers.*.mlp.down_proj"] = "replicate"
    assert config.tensor_parallel == {"model.layers.*.mlp.up_proj": "replicate"}


def test_config_defaults_come_from_the_schedule_table():
    assert PipelineConfig(num_microbatches=2).chunks == 1
    assert PipelineConfig(num_microbatches=2, schedule="interleaved").chunks == 2
    assert PipelineConfig(num_microbatches=2).timeout * 1000 == px._C.DEFAULT_TIMEOUT_MS


def test_config_refuses_a_plan_with_other_settings():
    plan = px.Plan(
        schedule="gpipe", num_microbatches=4, stages=[], step_time=1.0, bottleneck_time=1.0
    )
    with pytest.raises(ValueError, match="the plan was made for schedule 'gpipe' with 4"):
        PipelineConfig(num_microbatches=2, plan=plan)
    with pytest.raises(ValueError, match="either plan=... or layer_ranges=..."):
        PipelineConfig(num_microbatches=4, schedule="gpipe", plan=plan, layer_ranges=[(0, 1)])
    with pytest.raises(ValueError, match="either plan=... or checkpoint_layers=..."):
        PipelineConfig(num_microbatches=4, schedule="gpipe", plan=plan, checkpoint_layers=[0])


def test_a_plan_gives_its_schedule_microbatches_and_chunks_once():
    plan = px.Plan(
        schedule="interleaved",
        num_microbatches=4,
        stages=[],
        step_time=1.0,
        bottleneck_time=1.0,
        chunks=2,
    )
    for cfg in (
        PipelineConfig.from_options(None, {"plan": plan, "timeout": 5}),
        PipelineConfig.from_plan(plan, num_microbatches=4, chunks=None),  # agreeing: accepted
    ):
        assert (cfg.schedule, cfg.num_microbatches, cfg.chunks, cfg.plan) == (
            "interleaved",
            4,
            2,
            plan,
        )
    assert PipelineConfig.from_options(None, {"plan": plan, "timeout": 5}).timeout == 5
    made_for = "the plan was made for schedule 'interleaved' with 4 microbatches and 2 stage(s)"
    for options, named in (
        ({"schedule": "1f1b"}, "schedule='1f1b'"),
        ({"num_microbatches": 8}, "num_microbatches=8"),
        ({"chunks": 1, "num_microbatches": 2}, "num_microbatches=2, chunks=1"),
    ):
        with pytest.raises(ValueError, match=f"{re.escape(made_for)}.*drop {re.escape(named)}, or"):
            PipelineConfig.from_options(None, {"plan": plan, **options})
    with pytest.raises(TypeError, match=r"needs num_microbatches=\.\.\. \(or plan="):
        PipelineConfig.from_options(None, {"schedule": "gpipe"})


def test_options_are_checked_before_any_communication():
    # No process group exists in this process: these fail in the options, not in the build.
    model, layer_cls = llama()
    with pytest.raises(TypeError, match=r"unexpected keyword argument\(s\) \['num_microbatch'\]"):
        px.PipelineModel(model, layer_cls=layer_cls, num_microbatch=2)
    with pytest.raises(TypeError, match="either config=PipelineConfig"):
        px.PipelineModel(
            model,
            layer_cls=layer_cls,
            config=PipelineConfig(num_microbatches=2),
            schedule="gpipe",
        )
    with pytest.raises(TypeError, match="needs num_microbatches"):
        px.PipelineModel(model, layer_cls=layer_cls)
    with pytest.raises(RuntimeError, match="needs torch.distributed"):
        px.PipelineModel(model, layer_cls=layer_cls, num_microbatches=2)


def _config_equals_options(rank, world):
    """The same pipeline from a config and from keyword options; and checkpointed layers from the
    config give the gradients of the plain model."""
    batch = make_batch(seed=0)
    out = {}
    for how in ("options", "config", "checkpointed"):
        torch.manual_seed(0)
        model, layer_cls = llama()
        ref = copy.deepcopy(model)
        options = {"num_microbatches": 2, "schedule": "gpipe", "timeout": 60}
        if how == "options":
            pipe = px.PipelineModel(model, layer_cls=layer_cls, **options)
        else:
            extra = {"checkpoint_layers": [1, 2]} if how == "checkpointed" else {}
            config = PipelineConfig(**options, **extra)
            pipe = px.PipelineModel(model, layer_cls=layer_cls, config=config)
        loss = pipe.run_train(**batch)
        ref(**batch, use_cache=False).loss.backward()
        for name, p in pipe.named_parameters():
            torch.testing.assert_close(p.grad, ref.get_parameter(name).grad, rtol=1e-5, atol=1e-6)
        out[how] = (loss.item(), repr(pipe), pipe.pipeline_config.checkpoint_layers)
    return out


def test_config_and_keyword_options_build_the_same_pipeline():
    for rank, out in enumerate(run_ranks(2, _config_equals_options)):
        assert out["options"][0] == out["config"][0] == out["checkpointed"][0]
        assert out["options"][1] == out["config"][1]
        assert f"rank {rank} of 2, 2 stages, schedule 'gpipe', 2 microbatches" in out["config"][1]
        assert f"stage {rank}: layers [{2 * rank}, {2 * rank + 1}]" in out["config"][1]
        assert out["checkpointed"][2] == (1, 2)
