"""PipelineModel.generate on gloo ranks against HF's generate on the unsplit model."""

from __future__ import annotations

import copy

import pytest
import torch
from models import (
    INPUT_NAMES,
    MODELS,
    VIDEO_FRAMES,
    VOCAB,
    family_batch,
    llama,
    make_batch,
    needs_hf_tensor_parallel,
    qwen2_vl_batch,
    tiny,
)
from test_pipeline import LOSS_TOL
from torch import nn

import pippy_xla as px
from pippy_xla.runtime._generate import DECODE_WINDOW, cache_bytes
from pippy_xla.runtime.data_parallel import local_tensor
from pippy_xla.testing import run_ranks

NEW = 6
"""New tokens per prompt: enough for rows to finish at different steps, cheap on 2 cores."""

SAMPLING = {"do_sample": True, "temperature": 0.8, "top_k": 20, "top_p": 0.9}
"""Sampling options (with a repetition penalty, every kind of HF processor and warper)."""

_FAMILIES = {**MODELS, "qwen3": lambda: tiny("qwen3")}


def _prompts(batch: int = 3, length: int = 6) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-padded prompts of lengths ``length``, ``length - 2``, ``length - 1``, ..."""
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(1, VOCAB, (batch, length), generator=g)
    mask = torch.ones_like(ids)
    for row, pad in zip(range(1, batch), (2, 1, 3), strict=False):
        mask[row, :pad] = 0
        ids[row, :pad] = 0
    return ids, mask


def _pipe(family: str, **options):
    torch.manual_seed(0)
    model, layer_cls = _FAMILIES[family]()
    model.eval()
    ref = copy.deepcopy(model)
    pipe = px.PipelineModel(model, layer_cls=layer_cls, num_microbatches=2, timeout=60, **options)
    return pipe, ref


def _equal_hf(family: str) -> list[str]:
    """Greedy, greedy with rows stopping at an eos token at different steps, and seeded sampling
    (twice: reproducible) equal HF's generate on left-padded prompts of different lengths."""
    pipe, ref = _pipe(family)
    ids, mask = _prompts()
    done = []

    def new_tokens(out: torch.Tensor) -> torch.Tensor:
        return out[:, ids.shape[1] :]

    opts = {"max_new_tokens": NEW, "do_sample": False, **_OPTIONS.get(family, {})}
    greedy = ref.generate(ids, attention_mask=mask, **opts)
    got = pipe.generate(ids, attention_mask=mask, groups=1, **opts)
    assert torch.equal(got, greedy), f"{family} greedy\n{got}\n{greedy}"
    # By default a group of rows per rank (here 2 and 1 or 1, 1 and 1), each with its caches:
    # a pipelined prefill.
    got = pipe.generate(ids, attention_mask=mask, **opts)
    assert torch.equal(got, greedy), f"{family} greedy\n{got}\n{greedy}"
    groups = min(pipe.num_ranks, ids.shape[0])
    if family == "llama":  # see [Note: per-stage generation graphs]: this rank's layers only
        cfg, (start, stop) = ref.config, pipe.layer_ranges[pipe.rank]
        per_layer = 2 * ids.shape[0] * cfg.num_key_value_heads * (greedy.shape[1] - 1) * 16 * 4
        assert cache_bytes(pipe._generator.caches) == (stop - start) * per_layer
        assert all(len(c) == groups for c in pipe._generator.caches.values())  # one per group
    # HF's chunked prefill (``prefill_chunk_size``): each group's prompt in chunks of 4 and 2
    # tokens, each chunk a microbatch of the prefill schedule (pipelined by groups and chunks),
    # HF's own chunked tokens.
    chunked = {**opts, "prefill_chunk_size": 4}
    want = ref.generate(ids, attention_mask=mask, **chunked)
    got = pipe.generate(ids, attention_mask=mask, **chunked)
    assert torch.equal(got, want), f"{family} chunked prefill\n{got}\n{want}"
    assert ("prefill", 2 * groups) in pipe._generator.engines, list(pipe._generator.engines)
    done.append("greedy")
    # Row 0's second new token ends row 0 after two steps, other rows later or never.
    eos = int(greedy[0, ids.shape[1] + 1])
    stop = {**opts, "eos_token_id": eos, "pad_token_id": 3}
    want = ref.generate(ids, attention_mask=mask, **stop)
    got = pipe.generate(ids, attention_mask=mask, groups=2, **stop)
    assert torch.equal(got, want), f"{family} eos\n{got}\n{want}"
    new = (new_tokens(got) == eos).int()
    ends = {int(r.argmax()) if r.any() else NEW for r in new}
    assert len(ends) > 1, f"{family}: every row ended at step {ends}"
    # A group per row, decode windows of 2 tokens (new tokens 1-2, 3-4, 5): row r ends by its
    # new token 1 + r, so every row ends before NEW, maybe inside a window; a group that
    # finished leaves the schedule at the next window.
    eos = [int(greedy[r, ids.shape[1] + 1 + r]) for r in range(ids.shape[0])]
    stop = {**opts, "eos_token_id": eos, "pad_token_id": 3}
    want = ref.generate(ids, attention_mask=mask, **stop)
    pipe._generator.window = 2
    got = pipe.generate(ids, attention_mask=mask, groups=3, **stop)
    pipe._generator.window = DECODE_WINDOW
    assert torch.equal(got, want), f"{family} eos, 3 groups\n{got}\n{want}"
    ends = [next((i for i, x in enumerate(r.tolist()) if x in eos), NEW) for r in new_tokens(want)]
    live = [tuple(r for r, e in enumerate(ends) if e >= s) for s in (1, 3, 5) if s <= max(ends)]
    assert pipe._generator.decode_runs == live, f"{family}: {pipe._generator.decode_runs}"
    if family == "llama":  # rows end at new tokens 1, 2 and 3: inside the second window
        assert live == [(0, 1, 2), (2,)] and want.shape[1] == ids.shape[1] + 4, (live, want)
    done.append("eos")
    sample = {**opts, **SAMPLING, "repetition_penalty": 1.2}
    torch.manual_seed(7)
    want = ref.generate(ids, attention_mask=mask, **sample)
    runs = []
    for _ in range(2):
        torch.manual_seed(7)
        runs.append(pipe.generate(ids, attention_mask=mask, groups=len(runs) + 1, **sample))
    assert torch.equal(runs[0], runs[1]), f"{family} sampling not reproducible (1 or 2 groups)"
    assert torch.equal(runs[0], want), f"{family} sampling\n{runs[0]}\n{want}"
    done.append("sampling")
    return done


def _families(rank, world, families):
    return {f: _equal_hf(f) for f in families}


def _all_equal(families) -> dict[str, list[str]]:
    """What ``_families`` returns when every check of every family passed."""
    return {f: ["greedy", "eos", "sampling"] for f in families}


FAMILIES = (
    *("llama", "gpt2", "qwen3", "mixtral", "mistral", "qwen2", "gemma3_text", "falcon_alibi"),
    "qwen3_5_text",
)
"""Rotary, learned positions and a tied head, Qwen3's q/k norms, experts, a sliding window,
sliding and full layers on different stages (two masks), a rotary table per layer type, and
ALiBi (whose HF code takes no static cache: HF's dynamic one, as ``cache_implementation`` says),
and Qwen3.5's hybrid of recurrent (linear-attention state) and attention layers."""

_OPTIONS = {"falcon_alibi": {"cache_implementation": "dynamic"}}


@pytest.mark.compat
def test_generate_equal_hf_two_ranks():
    out = run_ranks(2, _families, FAMILIES, timeout=600)
    assert out == [_all_equal(FAMILIES)] * 2


IMAGE_FAMILIES = (
    "llava",
    "llava_onevision",
    "idefics3",
    "gemma3",
    "paligemma",
    "qwen2_vl_video",
    "qwen3_vl_video",
    "qwen3_5_vl",
    "qwen3_5_vl_video",
    "qwen3_vl",
)
"""Vision-language families whose prompts' images are a row each (HF's ``pixel_values`` and
LLaVA-OneVision's ``image_sizes``, Idefics3's ``pixel_attention_mask``; Gemma 3's and
PaliGemma's ``token_type_ids``, which their prefill masks read), or concatenated over the
prompts with their grids and M-RoPE positions (Qwen3.5 with images; Qwen3-VL, DeepStack)."""


def _sharpened(model: torch.nn.Module) -> torch.nn.Module:
    """Gemma 3 and PaliGemma as tiny random models generate tokens that depend on nothing but the
    last prompt token: Gemma scales its embeddings by sqrt(hidden) and ties its head to them, so
    the last token's own embedding outweighs the layers, and Gemma 3's image projection starts at
    zeros (HF's initialization). Random projection weights and the language model's matrices
    four times larger make the tokens depend on the images and the token types (asserted)."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim >= 2 and not p.any():
                p.normal_(0, 0.02)
            if "language_model" in name and p.ndim >= 2 and "embed" not in name:
                p.mul_(4)
    return model


TYPED = ("gemma3", "paligemma")
"""Image families whose prefill mask reads ``token_type_ids`` (bidirectional attention over an
image, or PaliGemma's prefix), made sensitive by :func:`_sharpened`."""


def _image_prompts(family: str, seed: int) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """Prompts whose image tokens follow the first token, one left-padded by 2, and the rows'
    images (Qwen's format: 0, 1, 2 and 1 images, the first row's none)."""
    if INPUT_NAMES[family] == INPUT_NAMES["qwen2_vl"]:
        batch = qwen2_vl_batch(4 * seed, batch=4, seq=14, pad=False)  # rows of QWEN_GRIDS
    elif family in VIDEO_FRAMES:  # and of QWEN_VIDEO_GRIDS
        frames = VIDEO_FRAMES[family]
        batch = qwen2_vl_batch(4 * seed, 4, 18 if frames else 16, False, True, frames)
    else:
        batch = family_batch(family, seed=seed, pad=False)
        per_token = ("input_ids", "token_type_ids")
        batch = {k: v[:4, :14] if k in per_token else v[:4] for k, v in batch.items()}
    ids = batch["input_ids"]
    mask = torch.ones_like(ids)
    mask[0, :2] = 0
    names = [k for k in INPUT_NAMES[family] if k not in ("input_ids", "attention_mask")]
    return ids, mask, {k: batch[k] for k in names}


def _with_images(rank, world) -> dict[str, list[bool]]:
    out = {}
    for family in IMAGE_FAMILIES:
        torch.manual_seed(0)
        model, _ = MODELS[family]()
        model.eval()
        if family in TYPED:
            _sharpened(model)
        ref = copy.deepcopy(model)
        pipe = px.PipelineModel(
            model, num_microbatches=2, timeout=60, input_names=INPUT_NAMES[family]
        )
        equal = []
        # Other images: the same prefill graphs. A group a row: rows holding a video but no
        # image, or neither, take the graphs of what they hold.
        rounds = ((3, None), (4, 1), *([(3, 4)] if family in VIDEO_FRAMES else []))
        for seed, groups in rounds:
            ids, mask, images = _image_prompts(family, seed)
            opts = {"max_new_tokens": 4, "do_sample": False}
            want = ref.generate(input_ids=ids, attention_mask=mask, **opts, **images)
            got = pipe.generate(ids, mask, groups=groups, **opts, **images)
            equal.append(torch.equal(got, want))
        g = torch.Generator().manual_seed(5)
        for name in [k for k, v in images.items() if v.is_floating_point()]:
            other = {**images, name: torch.randn(images[name].shape, generator=g)}
            changed = ref.generate(input_ids=ids, attention_mask=mask, **opts, **other)
            assert not torch.equal(changed, want), (family, name)  # the tokens depend on each
        if family in TYPED:  # and on the token types (the prefill's bidirectional blocks)
            untyped = {k: v for k, v in images.items() if k != "token_type_ids"}
            assert not torch.equal(
                ref.generate(input_ids=ids, attention_mask=mask, **opts, **untyped), want
            )
        ids, mask, images = _image_prompts(family, 3)
        with pytest.raises(ValueError, match="a row per prompt"):
            pipe.generate(ids, mask, max_new_tokens=2, pixel_values=images["pixel_values"][:1])
        with pytest.raises(ValueError, match="prefill_chunk_size"):
            pipe.generate(ids, mask, max_new_tokens=2, prefill_chunk_size=4, **images)
        out[family] = equal
    return out


def test_generate_with_images_equal_hf_two_ranks():
    """Vision-language models generate from prompts with images as HF's ``generate`` does (the
    vision tower in the prefill only; see [Note: images in the prefill]): greedy tokens equal
    to HF's in one process (changing the images changes them), with as many groups as ranks
    and with one; images of other than a row per prompt, and chunked prefill with images, are
    refused on every rank."""
    out = run_ranks(2, _with_images, timeout=600)
    want = {f: [True] * (3 if f in VIDEO_FRAMES else 2) for f in IMAGE_FAMILIES}
    assert out == [want] * 2


def _meta_built(rank, world) -> bool:
    """A model built on ``meta``, loaded from the reference's state dict, generates HF's tokens
    (local layers materialized, the others never); its layers found without ``layer_cls``."""
    torch.manual_seed(0)
    ref, _ = MODELS["llama"]()
    ref.eval()
    with torch.device("meta"):
        model = type(ref)(ref.config)
    pipe = px.PipelineModel(model, layer_cls=None, num_microbatches=2, timeout=60)
    pipe.load_state_dict(ref.state_dict())
    ids, mask = _prompts()
    got = pipe.generate(ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False)
    want = ref.generate(ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False)
    assert torch.equal(got, want), f"meta-built\n{got}\n{want}"
    return True


def _group_per_stage(world: int) -> bool:
    """As many groups as stages (a group per row): greedy and seeded sampling equal HF's, every
    decode run with all groups (no row finishes)."""
    pipe, ref = _pipe("llama")
    ids, mask = _prompts(batch=world)
    for opts in ({"do_sample": False}, SAMPLING):
        torch.manual_seed(7)
        want = ref.generate(ids, attention_mask=mask, max_new_tokens=NEW, **opts)
        torch.manual_seed(7)
        got = pipe.generate(ids, attention_mask=mask, max_new_tokens=NEW, groups=world, **opts)
        assert torch.equal(got, want), f"{world} groups {opts}\n{got}\n{want}"
        assert pipe._generator.decode_runs == [tuple(range(world))]
    return True


FOUR_RANK_FAMILIES = ("llama", "gpt2", "qwen3", "mixtral", "mistral")
"""Llama, GPT-2, Qwen3, Mixtral and Mistral on four ranks, a layer per stage: rotary, a tied
head with learned positions, q/k norms, experts, and a sliding window (Mistral's 8 tokens, fewer
than a prompt and its new tokens, 12)."""


def _four(rank, world):
    families = _families(rank, world, FOUR_RANK_FAMILIES)
    return families, _meta_built(rank, world), _group_per_stage(world)


def test_generate_equal_hf_four_ranks():
    out = run_ranks(4, _four, timeout=300)
    assert out == [(_all_equal(FOUR_RANK_FAMILIES), True, True)] * 4


def _stages_per_rank(rank, world) -> dict[str, list[int]]:
    """Two stages per rank, in loop (``interleaved``) and V (``zbv``: the last stage on rank 0,
    which feeds the first stage's token ids locally) placements, one group and as many as
    stages; the loop placement once more with transfers matched in order (NCCL's rule, here
    over gloo): HF's greedy tokens; returns each run's local stages."""
    out = {}
    runs = (("interleaved", "auto"), ("zbv", "auto"), ("interleaved", "in_order"))
    for schedule, transport in runs:
        pipe, ref = _pipe("llama", schedule=schedule, chunks=2, transport=transport)
        ids, mask = _prompts()
        want = ref.generate(ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False)
        for groups in (1, 3) if transport == "auto" else (3,):
            got = pipe.generate(
                ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False, groups=groups
            )
            assert torch.equal(got, want), f"{schedule} {transport} {groups}\n{got}\n{want}"
        out[f"{schedule} {transport}"] = [st.index for st in pipe.local_stages]
    return out


def test_generate_with_two_stages_per_rank():
    out = run_ranks(2, _stages_per_rank, timeout=300)
    for rank, o in enumerate(out):
        loop, v = [rank, rank + 2], [rank, 3 - rank]
        assert o == {"interleaved auto": loop, "zbv auto": v, "interleaved in_order": loop}


def _between_steps(rank, world):
    """A generate between two training steps: the losses stay the reference's, the training
    graphs are the same objects with the same code, and generate sees the trained weights (also
    under bf16 autocast)."""
    pipe, ref = _pipe("llama")
    codes = [st.module.code for st in pipe.local_stages]
    modules = [st.module for st in pipe.local_stages]
    opt = torch.optim.SGD(pipe.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    ids, mask = _prompts()
    for step in range(2):
        batch = make_batch(seed=step)
        loss = pipe.run_train(**batch)
        ref_loss = ref(**batch, use_cache=False).loss
        ref_loss.backward()
        torch.testing.assert_close(loss, ref_loss.detach(), rtol=1e-5, atol=1e-6)
        for o in (opt, ref_opt):
            o.step()
            o.zero_grad()
        got = pipe.generate(ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False)
        want = ref.generate(ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False)
        assert torch.equal(got, want), f"step {step}\n{got}\n{want}"
    with torch.autocast("cpu", dtype=torch.bfloat16):  # another boundary dtype, same tokens
        got = pipe.generate(ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False)
        want = ref.generate(ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False)
    assert torch.equal(got, want), f"bf16 autocast\n{got}\n{want}"
    evaluated = pipe.run_eval(**make_batch(seed=5)).loss
    torch.testing.assert_close(evaluated, ref(**make_batch(seed=5), use_cache=False).loss)
    assert [st.module for st in pipe.local_stages] == modules
    assert [st.module.code for st in pipe.local_stages] == codes
    return True


def test_generate_between_training_steps():
    assert run_ranks(2, _between_steps) == [True, True]


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(16, 16)

    def forward(self, x):
        return x + self.fc(x)


class _NoHead(nn.Module):
    """A plain module whose output is the logits: it trains, but has no generation head."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, 16)
        self.blocks = nn.ModuleList(_Block() for _ in range(2))
        self.head = nn.Linear(16, VOCAB)

    def forward(self, input_ids, attention_mask):
        x = self.emb(input_ids)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def _loss(logits, labels, num_items):
    return nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="sum") / (
        num_items
    )


def _error(case: str, rank: int) -> str:
    if case == "no_head":
        torch.manual_seed(0)
        pipe = px.PipelineModel(
            _NoHead(),
            layer_cls=_Block,
            num_microbatches=1,
            timeout=60,
            loss_fn=_loss,
            num_items_fn=lambda labels: (labels != -100).sum(),
        )
        ids, mask = _prompts()
        pipe.generate(ids, attention_mask=mask, max_new_tokens=2)
    pipe, _ = _pipe("llama")
    ids, mask = _prompts()
    if case == "too_long":
        pipe.generate(ids, attention_mask=mask, max_length=ids.shape[1])
    if case == "other_prompts":
        pipe.generate(ids + rank, attention_mask=mask, max_new_tokens=2)
    if case == "other_options":
        pipe.generate(ids, attention_mask=mask, max_new_tokens=2, groups=1 + rank)
    if case == "bad_chunk":
        pipe.generate(ids, attention_mask=mask, max_new_tokens=2, prefill_chunk_size=0)
    if case == "text_types":  # token types of a model without images
        pipe.generate(ids, attention_mask=mask, max_new_tokens=2, token_type_ids=mask)
    raise AssertionError(f"{case}: no error")


def _decode_failure(pipe, rank: int, world: int) -> dict:
    """The last stage of ``pipe`` (its generation graphs built) raises in the decode schedule
    (group 1's first decode token): every rank fails with the engine's error naming that rank,
    stage and microbatch, as in training."""
    from test_errors import _raiser_outlives_peers

    ids, mask = _prompts()
    last = world - 1
    if rank == last:
        st = pipe._generator.stages[-1]
        module, calls = st.module, []

        def failing(*args):
            calls.append(None)
            if len(calls) == 4:  # two prefill forwards, then group 0's and group 1's token 0
                raise ValueError("decode exploded")
            return module(*args)

        st.module = failing
    with pytest.raises(px.PipelineError) as info:
        pipe.generate(ids, attention_mask=mask, max_new_tokens=NEW, groups=2)
    _raiser_outlives_peers(rank, world, last)
    e = info.value
    return {"failed_rank": e.failed_rank, "stage": e.stage, "mb": e.microbatch, "action": e.action}


def _errors(rank, world):
    """Each error on every rank, and the pipeline still generates afterwards; then a failure
    inside the decode schedule."""
    out = {}
    for case in (
        "no_head",
        "too_long",
        "other_prompts",
        "other_options",
        "bad_chunk",
        "text_types",
    ):
        try:
            _error(case, rank)
        except (ValueError, px.BatchMismatchError) as e:
            out[case] = (type(e).__name__, str(e).splitlines()[0][:200])
    pipe, ref = _pipe("llama")
    ids, mask = _prompts()
    got = pipe.generate(ids, attention_mask=mask, max_new_tokens=2)
    assert torch.equal(got, ref.generate(ids, attention_mask=mask, max_new_tokens=2))
    out["decode_failure"] = _decode_failure(pipe, rank, world)
    return out


def test_generate_errors_on_every_rank():
    out = run_ranks(2, _errors, timeout=300)
    for o in out:
        assert o["no_head"][0] == "UnsupportedModelError", o["no_head"]
        assert "no generation head" in o["no_head"][1]
        assert o["too_long"][0] == "ValueError" and "max_length" in o["too_long"][1]
        assert o["bad_chunk"] == (
            "ValueError",
            "prefill_chunk_size must be a positive int or None, got 0",
        )
        assert (
            o["text_types"][0] == "ValueError"
            and "LlamaForCausalLM has no images" in o["text_types"][1]
        )
        for case in ("other_prompts", "other_options"):
            assert o[case][0] == "BatchMismatchError", o[case]
            assert "other values" in o[case][1], o[case]
        assert "generation_options" in o["other_options"][1]
        assert o["decode_failure"]["failed_rank"] == 1, o
    assert out[1]["decode_failure"] == {"failed_rank": 1, "stage": 1, "mb": 1, "action": "F"}


def _compiled_between(rank, world) -> list[str]:
    """Compiled training and evaluation graphs are not recompiled around a ``generate``, whose
    prefill and decode graphs are compiled once each, whatever the number of new tokens (see
    [Note: compiled generation]), and a real recompile of them is reported; aot_eager keeps it
    cheap (see test_compile)."""
    import torch._dynamo

    torch._dynamo.reset()
    pipe, ref = _pipe("llama", compile=True, compile_options={"backend": "aot_eager"})
    ids, mask = _prompts(batch=4)  # a group of 2 rows per rank: one group size
    for step in range(2):
        pipe.run_train(**make_batch(seed=step))
        pipe.run_eval(**make_batch(seed=step))
    for new in (4, 12):
        want = ref.generate(ids, attention_mask=mask, max_new_tokens=new, do_sample=False)
        got = pipe.generate(ids, attention_mask=mask, max_new_tokens=new, do_sample=False)
        assert torch.equal(got, want), f"{new} new tokens\n{got}\n{want}"
        graphs = pipe._generator.compiled_graphs()
        assert graphs == {"prefill": 1, "decode": 1}, f"after {new} new tokens: {graphs}"
    # HF's chunked prefill: chunks of 4 and 2 tokens compile the prefill graph at most twice
    # more (the lengths made dynamic at the first chunk, where the ids' and the mask's were still
    # equal, then apart at the second), and a second chunked call nothing.
    chunked = {"max_new_tokens": 4, "do_sample": False, "prefill_chunk_size": 4}
    want, graphs = ref.generate(ids, attention_mask=mask, **chunked), []
    for _ in range(2):
        got = pipe.generate(ids, attention_mask=mask, **chunked)
        assert torch.equal(got, want), f"chunked prefill\n{got}\n{want}"
        graphs.append(pipe._generator.compiled_graphs())
    assert graphs[0] == graphs[1] and graphs[0]["prefill"] <= 3, graphs
    assert graphs[0]["decode"] == 1, graphs
    pipe.run_train(**make_batch(seed=0))
    pipe.run_eval(**make_batch(seed=0))
    assert pipe.recompiles == []
    # A real recompile of the generation graphs (their guards on the parameters' requires_grad)
    # is reported, with dynamo's reason.
    for p in pipe.parameters():
        p.requires_grad_(False)
    pipe.generate(ids, attention_mask=mask, max_new_tokens=4, do_sample=False)
    return [why.split(":")[0] for why in pipe.recompiles], pipe.recompiles[-1]


def test_generate_keeps_compiled_training_graphs():
    for rank, (what, why) in enumerate(run_ranks(2, _compiled_between, timeout=300)):
        graphs = ("prefill", "decode")
        assert what == [f"[rank {rank}] {g} graph recompiled" for g in graphs], what
        assert "requires_grad" in why, why


def _compiled_sliding(rank, world) -> list[dict[str, int]]:
    """Mistral's sliding-window layers (a window of 8, full after the second new token): HF's
    greedy tokens from compiled graphs, and as many graphs after 12 new tokens as after 4 (HF's
    sliding layer counts tokens in a Python int, which dynamo makes symbolic at its second
    value: see [Note: compiled generation]); aot_eager keeps it cheap."""
    import torch._dynamo

    torch._dynamo.reset()
    pipe, ref = _pipe("mistral", compile=True, compile_options={"backend": "aot_eager"})
    ids, mask = _prompts(batch=4)  # a group of 2 rows per rank: one group size
    graphs = []
    for new in (4, 12):
        want = ref.generate(ids, attention_mask=mask, max_new_tokens=new, do_sample=False)
        got = pipe.generate(ids, attention_mask=mask, max_new_tokens=new, do_sample=False)
        assert torch.equal(got, want), f"{new} new tokens\n{got}\n{want}"
        graphs.append(pipe._generator.compiled_graphs())
    assert pipe.recompiles == [], pipe.recompiles
    return graphs


def test_compiled_generate_with_sliding_windows_compiles_a_bounded_number_of_graphs():
    for first, second in run_ranks(2, _compiled_sliding, timeout=300):
        assert first == second and first["decode"] <= 3, (first, second)


def _compiled_generate(rank, world) -> dict[str, int]:
    """Inductor-compiled generation graphs: HF's greedy tokens, for 4 and then 12 new tokens
    with one prefill and one decode graph per stage (the second call compiles nothing: the
    cache and the decode mask have one length, ``COMPILED_CACHE_MIN``, for both). The tokens
    are equal, not close: this model and these prompts have no near-tie among the top logits
    that inductor's reordered sums could flip (checked under AVX-512 and AVX2)."""
    import torch._dynamo

    torch._dynamo.reset()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model, layer_cls = llama(layers=2)  # a layer per stage: see test_compile._compiled_training
    model.eval()
    ref = copy.deepcopy(model)
    pipe = px.PipelineModel(model, layer_cls=layer_cls, num_microbatches=2, compile=True)
    ids, mask = _prompts()
    one = {"groups": 1, "do_sample": False}  # one group of 3 rows: a graph of each kind
    for new in (4, 12):
        want = ref.generate(ids, attention_mask=mask, max_new_tokens=new, do_sample=False)
        got = pipe.generate(ids, attention_mask=mask, max_new_tokens=new, **one)
        assert torch.equal(got, want), f"{new} new tokens\n{got}\n{want}"
    return pipe._generator.compiled_graphs()


@pytest.mark.compiled
def test_compiled_generate_equal_hf_without_recompiles():
    assert run_ranks(2, _compiled_generate, timeout=600) == [{"prefill": 1, "decode": 1}] * 2


class _IdsAfterLayer(nn.Module):
    """Reads the token ids after its layers: by value (``by_value``) or by shape only."""

    def __init__(self, by_value: bool) -> None:
        super().__init__()
        self.by_value = by_value
        self.embed = nn.Embedding(VOCAB, 8)
        self.layers = nn.ModuleList([nn.Linear(8, 8), nn.Linear(8, 8)])

    def forward(self, input_ids, attention_mask):
        h = self.layers[1](self.layers[0](self.embed(input_ids)))
        if self.by_value:  # recomputed on the last stage from the batch input
            return h + (input_ids == 3)[..., None]
        return h + torch.ones(input_ids.shape)[..., None]


def test_a_later_stage_reading_token_ids_is_found():
    """While decoding only the first stage receives the sampled tokens (see [Note: generation
    data flow]): a later stage's graph that reads the ids' values is found (generate refuses
    such a model), one that reads their shape is not."""
    from pippy_xla.split.generation import _value_reader
    from pippy_xla.split.partition import partition

    inputs = ("input_ids", "attention_mask")
    for by_value, found in ((True, "eq"), (False, None)):
        stages = partition(_IdsAfterLayer(by_value), nn.Linear, [(0, 1), (1, 2)], inputs)
        reader = _value_reader(stages[1].module, "input_ids")
        assert (reader if reader is None else "eq") == found, reader
        if found:
            assert "input_ids" in reader and "3" in reader, reader


def _staggered_stops(ref, ids, mask, opts) -> tuple[dict, torch.Tensor]:
    """Options under which row ``r`` of HF's greedy output ends by its new token ``1 + r`` (that
    token of every row is an end-of-sequence id), and HF's output under them."""
    greedy = ref.generate(ids, attention_mask=mask, **opts)
    eos = [int(greedy[r, ids.shape[1] + 1 + r]) for r in range(ids.shape[0])]
    stop = {**opts, "eos_token_id": eos, "pad_token_id": 3}
    return stop, ref.generate(ids, attention_mask=mask, **stop)


def _on_mesh(rank, world) -> dict[str, list[str]]:
    """On a (dp=2, pp=2) mesh, each replica generating for its half of the rows, every rank
    returns HF's greedy tokens of the whole batch, with FSDP2 ``replicate`` and ``shard``; rows
    stop at eos at different steps (replica 0's rows end before replica 1's, its
    shorter sequences padded as HF pads); under ``shard`` the stages are resharded after it and
    the next training step's loss is HF's; prompts that differ between the replicas, or a batch
    that does not split between them, are refused on every rank."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "pp"))
    ids, mask = _prompts(batch=4)
    out = {}
    for mode in ("replicate", "shard"):
        pipe, ref = _pipe("llama", mesh=mesh, data_parallel=mode)
        opts = {"max_new_tokens": NEW, "do_sample": False}
        # Row r ends by its new token 1 + r: replica 0 (rows 0, 1) stops before replica 1.
        stop, want = _staggered_stops(ref, ids, mask, opts)
        eos = stop["eos_token_id"]
        got = pipe.generate(ids, attention_mask=mask, groups=2, **stop)
        assert torch.equal(got, want), f"{mode} eos\n{got}\n{want}"
        new = want[:, ids.shape[1] :].tolist()
        ends = [next((i for i, x in enumerate(r) if x in eos), NEW) for r in new]
        assert max(ends[:2]) < max(ends[2:]) < NEW, ends  # replica 0's output was padded
        out[mode] = ["greedy", "eos"]
        if mode == "shard":  # resharded after generating, and training goes on
            p = next(p for n, p in pipe.named_parameters() if n.endswith("q_proj.weight"))
            assert local_tensor(p).numel() * 2 == p.numel()
            batch = make_batch(seed=0, batch=4)
            torch.testing.assert_close(pipe.run_train(**batch), ref(**batch).loss, **LOSS_TOL)
            out[mode].append("train")
    with pytest.raises(ValueError, match="not a multiple of the data-parallel size 2"):
        pipe.generate(ids[:3], attention_mask=mask[:3], max_new_tokens=2)
    try:
        pipe.generate(ids + mesh["dp"].get_local_rank(), attention_mask=mask, max_new_tokens=2)
    except px.BatchMismatchError as e:
        out["other_prompts"] = [str(e).splitlines()[0][:200]]
    return out


def test_generate_on_a_data_parallel_mesh():
    out = run_ranks(4, _on_mesh, timeout=300)
    for o in out:
        assert o["replicate"] == ["greedy", "eos"] and o["shard"] == [*o["replicate"], "train"], o
        assert "data-parallel" in o["other_prompts"][0], o


def _on_tp_mesh(rank, world) -> dict:
    """With tensor parallelism, the tp ranks of a stage generating the same rows together (their
    layers' collectives): HF's greedy tokens on pp=2 x tp=2 (each tp rank's cache holding its
    key/value heads only) and on dp=2 x tp=2 sharded; seeded sampling equal to HF's with tp
    ranks seeded differently (the last stage's tp ranks draw alike) and HF's chunked prefill on
    pp=2 x tp=2; a tp rank given other
    prompts is refused on every rank."""
    from torch.distributed.device_mesh import init_device_mesh

    ids, mask = _prompts(batch=4)
    out = {}
    for shape, mode in (((1, 2, 2), "replicate"), ((2, 1, 2), "shard")):
        mesh = init_device_mesh("cpu", shape, mesh_dim_names=("dp", "pp", "tp"))
        pipe, ref = _pipe("llama", mesh=mesh, tensor_parallel="auto", data_parallel=mode)
        opts = {"max_new_tokens": NEW, "do_sample": False}
        stop, want = _staggered_stops(ref, ids, mask, opts)
        got = pipe.generate(ids, attention_mask=mask, groups=2, **stop)
        assert torch.equal(got, want), f"{shape} eos\n{got}\n{want}"
        out[shape] = "eos"
        if shape[0] == 1:  # one replica, one group: HF's sampled tokens whatever the tp seeds
            sample = {**opts, **SAMPLING}
            torch.manual_seed(7)
            want = ref.generate(ids, attention_mask=mask, **sample)
            torch.manual_seed(7 + 100 * mesh["tp"].get_local_rank())
            got = pipe.generate(ids, attention_mask=mask, **sample)
            assert torch.equal(got, want), f"{shape} sampling\n{got}\n{want}"
            # HF's chunked prefill, the tp ranks of a stage taking the chunks together.
            chunked = {**opts, "prefill_chunk_size": 4}
            want = ref.generate(ids, attention_mask=mask, **chunked)
            got = pipe.generate(ids, attention_mask=mask, **chunked)
            assert torch.equal(got, want), f"{shape} chunked prefill\n{got}\n{want}"
            out[shape] = "eos, sampling, chunked"
    # This replica's 2 rows, this tp rank's half of the key/value heads, the cache's length.
    cfg, (start, end) = ref.config, pipe.layer_ranges[pipe.rank]
    head = cfg.hidden_size // cfg.num_attention_heads
    per_layer = 2 * 2 * (cfg.num_key_value_heads // 2) * (ids.shape[1] + NEW - 1) * head * 4
    out["cache"] = (cache_bytes(pipe._generator.caches), (end - start) * per_layer)
    try:
        pipe.generate(ids + mesh["tp"].get_local_rank(), attention_mask=mask, max_new_tokens=2)
    except px.BatchMismatchError as e:
        out["other_prompts"] = str(e).splitlines()[0][:200]
    return out


@pytest.mark.compat
@needs_hf_tensor_parallel
def test_generate_with_tensor_parallel():
    out = run_ranks(4, _on_tp_mesh, timeout=300)
    for o in out:
        assert o[(1, 2, 2)] == "eos, sampling, chunked" and o[(2, 1, 2)] == "eos", o
        assert o["cache"][0] == o["cache"][1], o
        assert "tensor-parallel" in o["other_prompts"], o
