"""Single-process tests of the fx partitioner (``pippy_xla.split.partition``)."""

from __future__ import annotations

import models
import pytest
import torch
from models import VOCAB, gpt2, llama, qwen2
from torch import nn
from transformers.models.gpt2.modeling_gpt2 import GPT2Block
from transformers.models.llama.modeling_llama import LlamaDecoderLayer

from pippy_xla.split import hf
from pippy_xla.split.classify import keeps_self_meta
from pippy_xla.split.partition import UnsupportedModelError, find_layers, partition
from pippy_xla.split.trace import traced_root

torch.set_num_threads(1)

RANGES = {
    1: [(0, 4)],
    2: [(0, 2), (2, 4)],
    4: [(0, 1), (1, 2), (2, 3), (3, 4)],
}


MODELS = {
    "llama-sdpa": lambda: llama(),
    "llama-eager": lambda: llama("eager"),
    "gpt2-sdpa": lambda: gpt2(),
    "gpt2-eager": lambda: gpt2("eager"),
    "qwen2-sdpa": lambda: qwen2(),
    "qwen2-eager": lambda: qwen2("eager"),
}


def build(name: str, seed: int = 0) -> tuple[nn.Module, type[nn.Module]]:
    torch.manual_seed(seed)
    model, layer_cls = MODELS[name]()
    return model.train(), layer_cls


def make_batch(padding: str) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(1, VOCAB, (3, 8), generator=g)
    mask = torch.ones(3, 8, dtype=torch.long)
    if padding == "left":
        mask[1, :3] = 0
        mask[2, :1] = 0
    elif padding == "right":
        mask[1, 5:] = 0
        mask[2, 7:] = 0
    return {"input_ids": ids, "attention_mask": mask}


def run_pipeline(stages, batch) -> torch.Tensor:
    out: tuple[torch.Tensor, ...] = ()
    for stage in stages:
        out = stage.module(*[batch[n] for n in stage.batch_inputs], *out)
        assert isinstance(out, tuple) and all(isinstance(t, torch.Tensor) for t in out)
        expected = 1 if stage is stages[-1] else stage.num_boundary_outputs
        assert len(out) == expected
    return out[0]


def loss_of(logits: torch.Tensor) -> torch.Tensor:
    return logits.float().square().mean() + logits.float().sin().sum()


@pytest.mark.parametrize("padding", ["left", "right", "none"])
@pytest.mark.parametrize("name", list(MODELS))
def test_matches_unpipelined_forward_and_backward(name: str, padding: str) -> None:
    model, layer_cls = build(name)
    batch = make_batch(padding)
    # Reference; the model stays in train mode (dropouts are 0), as the pipeline would run it.
    ref = model(**batch, use_cache=False).logits
    loss_of(ref).backward()
    ref_grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    for num_stages, ranges in RANGES.items():
        model.zero_grad(set_to_none=True)
        stages = partition(model, layer_cls, ranges)
        assert [s.index for s in stages] == list(range(num_stages))
        assert sum((s.layers for s in stages), []) == [0, 1, 2, 3]
        assert model.training, "partition must restore the training mode"
        logits = run_pipeline(stages, batch)
        # Same modules, same ops in the same order on the same inputs: bitwise equal.
        diff = (logits - ref).abs().max()
        assert torch.equal(logits, ref), f"{num_stages} stages: max diff {diff}"
        loss_of(logits).backward()
        for n, p in model.named_parameters():
            assert p.grad is not None, f"{num_stages} stages: no gradient for {n}"
            # Gradients are accumulated in a possibly different order (e.g. tied weights), so
            # compare with a tolerance of a few float32 ulps of the gradient scale.
            torch.testing.assert_close(p.grad, ref_grads[n], rtol=1e-5, atol=1e-6, msg=n)


@pytest.mark.parametrize("name", ["llama-sdpa", "llama-eager", "qwen2-sdpa"])
def test_later_stages_replicate_prologue(name: str) -> None:
    model, layer_cls = build(name)
    stages = partition(model, layer_cls, RANGES[4])
    embed = "model.embed_tokens.weight"
    assert embed in stages[0].param_names.values()
    assert stages[0].num_boundary_inputs == 0
    assert stages[-1].num_boundary_outputs == 0
    for stage in stages[1:]:
        # Only the hidden states cross; masks, rotary tables and positions are recomputed.
        assert stage.num_boundary_inputs == 1
        assert stage.batch_inputs == ["input_ids", "attention_mask"]
        assert embed not in stage.param_names.values()
        called = [n.target for n in stage.module.graph.nodes if n.op == "call_module"]
        assert "model.model.rotary_emb" in called
        assert any(t.startswith(hf.MASKS_ATTR + ".create_") for t in called)
        assert "model.model.embed_tokens" not in called
    for stage in stages[:-1]:
        assert stage.num_boundary_outputs == 1
    if name.startswith("qwen2"):
        # Layers 0-1 are full-attention, 2-3 sliding-window: each stage builds only its mask.
        masks = [
            [
                n.target.removeprefix(hf.MASKS_ATTR + ".")
                for n in stage.module.graph.nodes
                if n.op == "call_module" and n.target.startswith(hf.MASKS_ATTR)
            ]
            for stage in stages
        ]
        full, sliding = ["create_causal_mask"], ["create_sliding_window_causal_mask"]
        assert masks == [full, full, sliding, sliding]


def test_stage_graphs_reference_original_parameters() -> None:
    model, layer_cls = build("gpt2-sdpa")
    originals = dict(model.named_parameters(remove_duplicate=False))
    originals.update(model.named_buffers(remove_duplicate=False))
    stages = partition(model, layer_cls, RANGES[2])
    for stage in stages:
        tensors = dict(stage.module.named_parameters(remove_duplicate=False))
        tensors.update(stage.module.named_buffers(remove_duplicate=False))
        assert list(tensors) == list(stage.param_names)
        for stage_name, orig_name in stage.param_names.items():
            assert tensors[stage_name] is originals[orig_name]
    # Tied head: each stage names the module path it uses.
    assert "transformer.wte.weight" in stages[0].param_names.values()
    assert "lm_head.weight" in stages[1].param_names.values()
    assert "transformer.wte.weight" not in stages[1].param_names.values()
    assert stages[1].num_boundary_inputs == 1


def test_deterministic_code_and_parameter_order() -> None:
    model_a, layer_cls = build("qwen2-sdpa", seed=0)
    model_b, _ = build("qwen2-sdpa", seed=1)
    first = partition(model_a, layer_cls, RANGES[4])
    again = partition(model_a, layer_cls, RANGES[4])
    other = partition(model_b, layer_cls, RANGES[4])
    for x, y, z in zip(first, again, other, strict=True):
        assert x.code == y.code == z.code
        assert list(x.param_names.items()) == list(y.param_names.items())
        assert list(x.param_names.items()) == list(z.param_names.items())
        assert [n for n, _ in x.module.named_parameters()] == [
            n for n, _ in z.module.named_parameters()
        ]


@pytest.mark.parametrize("name", ["llama-sdpa", "gpt2-sdpa"])
def test_meta_device_model(name: str) -> None:
    model, layer_cls = build(name)
    with torch.device("meta"):
        meta_model, _ = MODELS[name]()
    assert next(meta_model.parameters()).is_meta
    real = partition(model, layer_cls, RANGES[2])
    meta = partition(meta_model, layer_cls, RANGES[2])
    for x, y in zip(real, meta, strict=True):
        assert x.code == y.code
        assert list(x.param_names.items()) == list(y.param_names.items())


def test_mask_globals_restored() -> None:
    import transformers.models.llama.modeling_llama as modeling_llama
    from transformers import masking_utils

    model, layer_cls = build("llama-sdpa")
    partition(model, layer_cls, RANGES[2])
    assert modeling_llama.create_causal_mask is masking_utils.create_causal_mask


def _factory_raising_on_meta(config, input_embeds):
    if not globals().get("is_tracing", lambda: False)():
        raise RuntimeError("reads values")
    return None


def test_a_mask_sample_leaves_a_module_without_is_tracing_as_it_was() -> None:
    assert "is_tracing" not in globals()
    assert hf.MaskLeaf(_factory_raising_on_meta, None).sample(input_embeds=None) is None
    assert "is_tracing" not in globals()


def test_find_layers() -> None:
    model, layer_cls = build("gpt2-sdpa")
    assert find_layers(model, layer_cls) == [f"transformer.h.{i}" for i in range(4)]
    with pytest.raises(ValueError, match=r"no LlamaDecoderLayer.*GPT2Block.*_no_split_modules"):
        find_layers(model, LlamaDecoderLayer)


@pytest.mark.parametrize(
    ("ranges", "match"),
    [
        ([(0, 1), (1, 2), (2, 3), (3, 4), (4, 4)], r"5 stages.*only 4 decoder layers"),
        ([(0, 2), (3, 4)], r"expected layer_ranges\[1\] = \(2, stop > 2\), found \(3, 4\)"),
        ([(0, 2), (2, 3)], r"cover all 4 decoder layers.*end at layer 3"),
        ([(1, 4)], r"expected layer_ranges\[0\] = \(0"),
        ([(0, 2), (2, 2), (2, 4)], r"found \(2, 2\)"),
        ([], r"empty"),
    ],
)
def test_bad_ranges(ranges, match: str) -> None:
    model, layer_cls = build("llama-sdpa")
    with pytest.raises(ValueError, match=match):
        partition(model, layer_cls, ranges)


def test_bad_layer_cls_and_inputs() -> None:
    model, _ = build("llama-sdpa")
    with pytest.raises(ValueError, match=r"no GPT2Block"):
        partition(model, GPT2Block, RANGES[2])
    with pytest.raises(ValueError, match=r"input_names"):
        partition(model, LlamaDecoderLayer, RANGES[2], input_names=("input_ids", "input_ids"))


class _ToyLayer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(x).tanh()


class _ToyLM(nn.Module):
    """Not an HF model: a Python int computed after layer 0 is used after layer 1."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(16, 8)
        self.layers = nn.ModuleList([_ToyLayer(), _ToyLayer()])

    def forward(self, input_ids, attention_mask, use_cache=None, return_dict=None):
        h = self.layers[0](self.embed(input_ids))
        width = h.shape[-1]
        h = self.layers[1](h)
        return {"logits": h * width}


def test_non_tensor_boundary_is_rejected() -> None:
    model = _ToyLM()
    stages = partition(model, _ToyLayer, [(0, 2)])
    batch = make_batch("none")
    batch["input_ids"] = batch["input_ids"] % 16
    assert torch.equal(run_pipeline(stages, batch), model(**batch)["logits"])
    match = r"not a tensor but would cross the boundary between stages 0 and 1"
    with pytest.raises(ValueError, match=match):
        partition(model, _ToyLayer, [(0, 1), (1, 2)])


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x):
        return self.lin(x)


class _Branching(nn.Module):
    """Branches outside its layers on the embedding's metadata (followed) or, with
    ``on_size``, on the sequence length (refused: it depends on the batch)."""

    def __init__(self, on_size: bool) -> None:
        super().__init__()
        self.on_size = on_size
        self.embed = nn.Embedding(16, 8)
        self.layers = nn.ModuleList([_Block(), _Block()])

    def forward(self, input_ids):
        h = self.embed(input_ids)
        if self.on_size and h.shape[1] > 4:
            h = h * 2
        if h.ndim == 3 and h.dtype == torch.float32:
            h = h + torch.finfo(h.dtype).eps
        for layer in self.layers:
            h = layer(h)
        return h


def test_branches_on_metadata_are_followed_and_on_sizes_refused():
    model = _Branching(on_size=False)
    stages = partition(model, _Block, [(0, 1), (1, 2)], input_names=("input_ids",))
    ids = torch.randint(0, 16, (2, 6))
    out = stages[1].module(*stages[0].module(ids))[0]
    torch.testing.assert_close(out, model(ids))
    assert "_finfo_attr" in stages[0].code  # the dtype stays symbolic
    with pytest.raises(UnsupportedModelError, match=r"control flow .*h.shape\[1\] > 4"):
        partition(_Branching(on_size=True), _Block, [(0, 1), (1, 2)], input_names=("input_ids",))


class _Numbers(_Branching):
    """Fixes a number in the graph with Python's builtins: ``len(h.shape)`` (a constant of the
    model), or with ``by_size`` ``int(h.shape[1] // 8)``, which two short samples (lengths 4 and
    7) agree on but a real batch does not."""

    def __init__(self, by_size: bool) -> None:
        super().__init__(on_size=False)
        self.by_size = by_size

    def forward(self, input_ids):
        h = self.embed(input_ids)
        h = h * len(h.shape)
        if self.by_size:
            h = h + int(h.shape[1] // 8)
        for layer in self.layers:
            h = layer(h)
        return h


def test_numbers_of_the_model_are_fixed_and_of_the_batch_refused():
    model = _Numbers(by_size=False)
    stages = partition(model, _Block, [(0, 1), (1, 2)], input_names=("input_ids",))
    ids = torch.randint(0, 16, (2, 20))
    torch.testing.assert_close(stages[1].module(*stages[0].module(ids))[0], model(ids))
    with pytest.raises(UnsupportedModelError, match="int of a traced value that depends on"):
        partition(_Numbers(by_size=True), _Block, [(0, 1), (1, 2)], input_names=("input_ids",))


def test_a_container_handed_to_the_layers_is_one_per_stage():
    # See [Note: containers handed to the layers]: Gemma 4's KVSharingDict.
    model, layer_cls = models.MODELS["gemma4_text"]()
    stages = partition(model, layer_cls, [(0, 2), (2, 4)])
    for st in stages:
        assert st.code.count("KVSharingDict()") == 1, st.code
        assert st.code.count("shared_kv_states = kvsharing_dict") == 2, st.code


def test_the_text_models_stack_is_found_when_the_vision_tower_is_longer():
    # See [Note: finding the layer stack]: the vision tower's 6 CLIP layers, named by a plan of
    # their own config (as sub-models' configs may have), lose to the text model's 2 layers.
    model, _ = models.llava(layers=2, vision_layers=6)
    model.config.vision_config.base_model_pp_plan = {"layers": (["hidden_states"], ["x"])}
    names = find_layers(model, None)
    assert names == ["model.language_model.layers.0", "model.language_model.layers.1"]
    stages = partition(model, None, [(0, 1), (1, 2)], input_names=models.INPUT_NAMES["llava"])
    held = [
        {n.rsplit(".", 1)[0] for n in st.param_names.values() if ".layers." in n} for st in stages
    ]
    assert held[0] >= {"model.language_model.layers.0.mlp.up_proj"}
    assert not any("language_model.layers.0" in n for n in held[1]), held[1]


class _TwoStacks(nn.Module):
    """Two stacks of blocks, one an ``nn.Sequential``, with no config to choose between them;
    each block holds a nested list (never a candidate)."""

    def __init__(self, second: bool) -> None:
        super().__init__()
        self.embed = nn.Embedding(16, 8)
        self.layers = nn.Sequential(_Block(), _Block(), _Block())
        for block in self.layers:
            block.parts = nn.ModuleList([nn.Linear(8, 8) for _ in range(5)])
        if second:
            self.other = nn.ModuleList([_Block(), _Block(), _Block()])


def test_one_stack_is_found_and_several_are_refused():
    assert find_layers(_TwoStacks(second=False), None) == ["layers.0", "layers.1", "layers.2"]
    with pytest.raises(UnsupportedModelError, match=r"several layer stacks .*layers \(3 x _Block"):
        find_layers(_TwoStacks(second=True), None)


class _Fills(_Branching):
    """An out-of-place ``masked_fill`` that keeps its tensor's shape, one that broadcasts it, and
    an in-place one."""

    def forward(self, input_ids):
        h = self.embed(input_ids)
        pad = (input_ids == 0).unsqueeze(-1)
        h = h.masked_fill(pad, 0.0)  # keeps h's shape
        h = h + torch.zeros(8, device=h.device).masked_fill(pad, 1.0)  # broadcasts (8,) to h's
        h = h.masked_fill_(pad, 0.0)
        for layer in self.layers:
            h = layer(h)
        return h


def test_only_fills_that_keep_their_tensors_shape_keep_its_metadata():
    _, graph = traced_root(_Fills(on_size=False), (_Block,), ("input_ids",), "cpu")
    fills = [n for n in graph.nodes if n.op == "call_method" and "masked_fill" in n.target]
    assert [n.target for n in fills] == ["masked_fill", "masked_fill", "masked_fill_"]
    assert [keeps_self_meta(n) for n in fills] == [True, False, True]
    assert torch.zeros(3).masked_fill(torch.ones(2, 3, dtype=torch.bool), 1).shape == (2, 3)


class _LossBranching(_Branching):
    """Branches on its labels' values before computing its loss: traced without labels."""

    loss_function = staticmethod(nn.functional.cross_entropy)

    def forward(self, input_ids, labels=None):
        logits = super().forward(input_ids)
        if labels is not None and bool((labels != -100).any()):
            self.loss_function(logits.flatten(0, 1), labels.flatten())
        return logits


def test_a_model_whose_loss_cannot_be_traced_is_traced_without_labels():
    model = _LossBranching(on_size=False)
    stages = partition(model, _Block, [(0, 1), (1, 2)], input_names=("input_ids",))
    assert not stages[-1].added_loss
    ids = torch.randint(0, 16, (2, 6))
    torch.testing.assert_close(stages[1].module(*stages[0].module(ids))[0], model(ids))


class _InPlace(nn.Module):
    """Changes values in place outside its layers, the results unused (see [Note: in-place ops
    outside the layers]); ``through_view`` changes one through a view."""

    def __init__(self, through_view: bool = False) -> None:
        super().__init__()
        self.through_view = through_view
        self.embed = nn.Embedding(16, 8)
        self.layers = nn.ModuleList([_Block(), _Block(), _Block()])

    def forward(self, input_ids, attention_mask):
        h = self.embed(input_ids)
        h.masked_fill_(attention_mask[..., None] == 0, 0.0)
        h = self.layers[0](h)
        h.mul_(2)
        h = self.layers[1](h)
        h.add_(1)
        if self.through_view:
            h.view(-1)[:3].zero_()
        return self.layers[2](h)


def test_in_place_ops_outside_the_layers_are_kept_on_the_right_stage():
    torch.manual_seed(0)
    model = _InPlace()
    batch = make_batch("left")
    batch["input_ids"] = batch["input_ids"] % 16
    expected = model(**batch)
    expected.square().sum().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    for ranges in ([(0, 3)], [(0, 1), (1, 2), (2, 3)], [(0, 2), (2, 3)]):
        model.zero_grad()
        stages = partition(model, _Block, ranges, input_names=("input_ids", "attention_mask"))
        out = run_pipeline(stages, batch)
        torch.testing.assert_close(out, expected, rtol=0, atol=0)
        out.square().sum().backward()
        for n, p in model.named_parameters():
            torch.testing.assert_close(p.grad, grads[n], rtol=0, atol=0, msg=n)
    with pytest.raises(UnsupportedModelError, match=r"changes a view in place .*`zero_`"):
        partition(_InPlace(through_view=True), _Block, [(0, 3)])
