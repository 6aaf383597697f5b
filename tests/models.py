"""Tiny HF causal LMs for tests: random weights, dropouts 0, built offline from configs."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    FalconConfig,
    FalconForCausalLM,
    GPT2Config,
    GPT2LMHeadModel,
    GPTNeoXConfig,
    GPTNeoXForCausalLM,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    MixtralConfig,
    MixtralForCausalLM,
    OPTConfig,
    OPTForCausalLM,
    Phi3Config,
    Phi3ForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
)
from transformers.models.falcon.modeling_falcon import FalconDecoderLayer
from transformers.models.gpt2.modeling_gpt2 import GPT2Block
from transformers.models.gpt_neox.modeling_gpt_neox import GPTNeoXLayer
from transformers.models.llama.modeling_llama import LlamaDecoderLayer
from transformers.models.mistral.modeling_mistral import MistralDecoderLayer
from transformers.models.mixtral.modeling_mixtral import MixtralDecoderLayer
from transformers.models.opt.modeling_opt import OPTDecoderLayer
from transformers.models.phi3.modeling_phi3 import Phi3DecoderLayer
from transformers.models.qwen2.modeling_qwen2 import Qwen2DecoderLayer

VOCAB = 256


def _set_attn(cfg, attn: str | None) -> None:
    if attn is not None:
        cfg._attn_implementation = attn


def llama(attn: str | None = None, layers: int = 4) -> tuple[nn.Module, type[nn.Module]]:
    cfg = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
    )
    _set_attn(cfg, attn)
    return LlamaForCausalLM(cfg), LlamaDecoderLayer


def gpt2(attn: str | None = None, layers: int = 4) -> tuple[nn.Module, type[nn.Module]]:
    # bos/eos inside the tiny vocabulary (the defaults, 50256, make the config warn).
    cfg = GPT2Config(
        vocab_size=VOCAB,
        n_embd=64,
        n_layer=layers,
        n_head=4,
        n_positions=128,
        resid_pdrop=0,
        embd_pdrop=0,
        attn_pdrop=0,
        bos_token_id=0,
        eos_token_id=0,
    )
    _set_attn(cfg, attn)
    return GPT2LMHeadModel(cfg), GPT2Block


def qwen2(attn: str | None = None, layers: int = 4) -> tuple[nn.Module, type[nn.Module]]:
    # The upper half of the layers use a 3-token sliding window: two masks (a dict keyed by
    # layer type).
    cfg = Qwen2Config(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        use_sliding_window=True,
        sliding_window=3,
        max_window_layers=layers // 2,
    )
    _set_attn(cfg, attn)
    return Qwen2ForCausalLM(cfg), Qwen2DecoderLayer


def mistral(attn: str | None = None, layers: int = 4) -> tuple[nn.Module, type[nn.Module]]:
    cfg = MistralConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        sliding_window=8,
    )
    _set_attn(cfg, attn)
    return MistralForCausalLM(cfg), MistralDecoderLayer


def gpt_neox(attn: str | None = None, layers: int = 4) -> tuple[nn.Module, type[nn.Module]]:
    # Partial rotary (a quarter of each head), parallel residual, untied head.
    cfg = GPTNeoXConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=layers,
        num_attention_heads=4,
        rotary_pct=0.25,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        bos_token_id=0,
        eos_token_id=0,
    )
    _set_attn(cfg, attn)
    return GPTNeoXForCausalLM(cfg), GPTNeoXLayer


def opt(attn: str | None = None, layers: int = 4) -> tuple[nn.Module, type[nn.Module]]:
    # Learned positions computed from the attention mask (cumsum), a projection-free decoder
    # (word_embed_proj_dim == hidden_size), biases everywhere, tied head.
    cfg = OPTConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        ffn_dim=128,
        num_hidden_layers=layers,
        num_attention_heads=4,
        word_embed_proj_dim=64,
        max_position_embeddings=128,
        dropout=0.0,
        attention_dropout=0.0,
        layerdrop=0.0,
        pad_token_id=0,
        bos_token_id=0,
        eos_token_id=0,
    )
    _set_attn(cfg, attn)
    return OPTForCausalLM(cfg), OPTDecoderLayer


def phi3(attn: str | None = None, layers: int = 4) -> tuple[nn.Module, type[nn.Module]]:
    # Fused qkv and gate_up projections.
    cfg = Phi3Config(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        original_max_position_embeddings=128,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attention_dropout=0.0,
        pad_token_id=0,
        bos_token_id=0,
        eos_token_id=0,
    )
    _set_attn(cfg, attn)
    return Phi3ForCausalLM(cfg), Phi3DecoderLayer


def mixtral(
    attn: str | None = None, layers: int = 4, router_loss: bool = False
) -> tuple[nn.Module, type[nn.Module]]:
    """A mixture of experts: 4 experts, 2 per token, no router jitter; with ``router_loss``, HF
    adds the routers' load-balancing loss (``output_router_logits``) to the loss."""
    cfg = MixtralConfig(
        output_router_logits=router_loss,
        router_aux_loss_coef=0.5,
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=64,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_local_experts=4,
        num_experts_per_tok=2,
        router_jitter_noise=0.0,
        max_position_embeddings=128,
        pad_token_id=0,
        bos_token_id=0,
        eos_token_id=0,
    )
    _set_attn(cfg, attn)
    return MixtralForCausalLM(cfg), MixtralDecoderLayer


def decoder_layers(model: nn.Module):
    """The class of the entries of the model's longest ``nn.ModuleList`` (its decoder layers), or
    the tuple of their classes when there are several (hybrid models)."""
    lists = [m for m in model.modules() if isinstance(m, nn.ModuleList)]
    classes = tuple(dict.fromkeys(type(m) for m in max(lists, key=len)))
    return classes[0] if len(classes) == 1 else classes


_TINY = {
    "vocab_size": VOCAB,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "max_position_embeddings": 128,
    "pad_token_id": 0,
    "bos_token_id": 0,
    "eos_token_id": 0,
}


def tiny(model_type: str, attn: str | None = None, layers: int = 4, **overrides):
    """A tiny ``model_type`` causal LM from its HF config with small sizes (``overrides`` win),
    and its decoder-layer class."""
    cfg = AutoConfig.for_model(model_type, **{**_TINY, "num_hidden_layers": layers, **overrides})
    _set_attn(cfg, attn)
    model = AutoModelForCausalLM.from_config(cfg)
    return model, decoder_layers(model)


# Families the issues named, each with what sets it apart (see the table of docs/families.md).
_WINDOW = {"sliding_window": 3}
_MOE = {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32}
_LINEAR = {
    "full_attention_interval": 2,
    "linear_key_head_dim": 16,
    "linear_value_head_dim": 16,
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
}
_ROUTER_LOSS = {"output_router_logits": True, "router_aux_loss_coef": 0.5}
TINY_FAMILIES = {
    # Scaled word embeddings (an nn.Embedding subclass or embedding * sqrt(hidden)) read by the
    # rotary module for its dtype; Gemma 2 soft-caps attention and logits; Gemma 3 has a rotary
    # table per layer type.
    "gemma": {},
    "gemma2": {**_WINDOW, "final_logit_softcapping": 30.0, "attn_logit_softcapping": 50.0},
    "gemma3_text": {**_WINDOW, "sliding_window_pattern": 2},
    # Iterates over a set of layer types (the trace must not depend on the hash seed).
    "olmo3": {**_WINDOW},
    # Sinusoidal positions whose table grows when a sequence is longer (a branch the two sample
    # shapes agree on: followed).
    "xglm": {
        "d_model": 64,
        "ffn_dim": 128,
        "num_layers": 4,
        "attention_heads": 4,
        "dropout": 0.0,
        "attention_dropout": 0.0,
        "activation_dropout": 0.0,
        "layerdrop": 0.0,
    },
    "qwen3_moe": {**_MOE, "norm_topk_prob": True},
    "qwen3_moe_router_loss": {**_MOE, **_ROUTER_LOSS, "tie_word_embeddings": True},
    # Hybrids: linear-attention (gated delta net) layers read a 2-D padding mask that HF builds
    # beside the 4-D one (create_recurrent_attention_mask); a full-attention layer every other.
    "qwen3_5_text": {**_LINEAR},
    "qwen3_5_moe_text": {**_LINEAR, **_MOE, "shared_expert_intermediate_size": 32},
    "qwen3_next": {**_LINEAR, **_MOE, "shared_expert_intermediate_size": 32},
    # Two decoder-layer classes in one ModuleList (attention and linear attention).
    "olmo_hybrid": {},
    # Recurrent (RG-LRU) and local-attention blocks; the embedding scaled by a buffer cast to a
    # traced dtype (`normalizer.type(hidden_states.dtype)`).
    "recurrent_gemma": {
        "lru_width": 64,
        "attention_window_size": 8,
        "num_key_value_heads": 1,
        "block_types": ["recurrent", "attention"],
    },
    # Per-layer input embeddings, a rotary table per layer type, proportional rotary.
    "gemma4_text": {
        **_WINDOW,
        "global_head_dim": 16,
        "hidden_size_per_layer_input": 8,
        "vocab_size_per_layer_input": VOCAB,
    },
    # Hyper-connections (4 copies of the hidden state through the layers), hashed n-gram
    # embeddings inside layer 1, a sparse attention whose indexer selects token blocks, experts.
    "qwen4_exp_text": {
        **_LINEAR,
        **_MOE,
        "shared_expert_intermediate_size": 32,
        "hc_lowrank": 16,
        "ple_layer_ids": [1],
        "ple_embed_dim": 32,
        "ngram_vocab_size_base": 256,
        "split_ngram_parts": 4,
        "indexer_n_heads": 2,
        "indexer_kv_heads": 1,
        "indexer_head_dim": 16,
        "indexer_budget": 8,
        "indexer_compress_ratio": 4,
    },
}


def falcon_alibi(attn: str | None = None, layers: int = 4) -> tuple[nn.Module, type[nn.Module]]:
    """Falcon with ALiBi: its Python outside the layers branches on the mask's metadata and
    unpacks a shape (see [Note: branches on metadata])."""
    cfg = FalconConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        num_hidden_layers=layers,
        num_attention_heads=4,
        alibi=True,
        new_decoder_architecture=False,
        multi_query=True,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        bos_token_id=0,
        eos_token_id=0,
    )
    _set_attn(cfg, attn)
    return FalconForCausalLM(cfg), FalconDecoderLayer


IMAGE_TOKEN = VOCAB - 1
IMAGE_SIDE, PATCH = 8, 4
PATCHES = (IMAGE_SIDE // PATCH) ** 2
"""Image tokens per row: one per patch (the CLS position dropped, Llava's "default")."""


def llava(
    attn: str | None = None, layers: int = 4, vision_layers: int = 2
) -> tuple[nn.Module, None]:
    """A vision-language model: a CLIP vision tower and a projector before a Llama; no
    decoder-layer class (the pipeline finds the language model's layers from HF's plan)."""
    from transformers import CLIPVisionConfig, LlavaConfig, LlavaForConditionalGeneration

    text = LlamaConfig(**{**_TINY, "num_hidden_layers": layers})
    vision = CLIPVisionConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=vision_layers,
        num_attention_heads=2,
        image_size=IMAGE_SIDE,
        patch_size=PATCH,
    )
    cfg = LlavaConfig(vision_config=vision, text_config=text, image_token_index=IMAGE_TOKEN)
    _set_attn(cfg, attn)
    return LlavaForConditionalGeneration(cfg), None


def _siglip():
    """A tiny SigLIP vision tower's config: the images of :func:`image_batch`."""
    from transformers import SiglipVisionConfig

    return SiglipVisionConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        image_size=IMAGE_SIDE,
        patch_size=PATCH,
    )


def paligemma(attn: str | None = None, layers: int = 4) -> tuple[nn.Module, None]:
    """PaliGemma: a SigLIP tower and a projector before a Gemma whose vocabulary is its text
    config's (the top-level config has another, 257,152); a prefix-LM mask from the batch's
    ``token_type_ids`` (the image and the prompt see each other)."""
    from transformers import PaliGemmaConfig, PaliGemmaForConditionalGeneration

    text = {**_TINY, "model_type": "gemma", "num_hidden_layers": layers}
    cfg = PaliGemmaConfig(
        vision_config=_siglip(), text_config=text, image_token_index=IMAGE_TOKEN, projection_dim=64
    )
    cfg.text_config.num_image_tokens = PATCHES
    _set_attn(cfg, attn)
    return PaliGemmaForConditionalGeneration(cfg), None


def gemma3(attn: str | None = None, layers: int = 4) -> tuple[nn.Module, None]:
    """Gemma 3 with images: a SigLIP tower and a pooling projector before a Gemma 3 text model
    with sliding and full attention layers, whose masks come from one factory as a dict by layer
    type, with the image's tokens attending to each other (``token_type_ids`` 1 on them)."""
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration

    text = {**_TINY, "model_type": "gemma3_text", "num_hidden_layers": layers, **_WINDOW}
    cfg = Gemma3Config(
        vision_config=_siglip().to_dict(),
        text_config={**text, "sliding_window_pattern": 2},
        image_token_index=IMAGE_TOKEN,
        mm_tokens_per_image=PATCHES,
        boi_token_index=IMAGE_TOKEN - 1,
        eoi_token_index=IMAGE_TOKEN - 2,
    )
    _set_attn(cfg, attn)
    return Gemma3ForConditionalGeneration(cfg), None


def llava_onevision(attn: str | None = None, layers: int = 4) -> tuple[nn.Module, None]:
    """LLaVA-OneVision: a SigLIP tower over each image's tiles (any-resolution: the base image
    and a grid of crops, here one), unpadded to the image's size, with a learned newline row
    (``image_newline``, a parameter of the model itself) before a Qwen2."""
    from transformers import LlavaOnevisionConfig, LlavaOnevisionForConditionalGeneration

    text = {**_TINY, "model_type": "qwen2", "num_hidden_layers": layers}
    cfg = LlavaOnevisionConfig(
        vision_config=_siglip().to_dict(),
        text_config=text,
        image_token_index=IMAGE_TOKEN,
        image_grid_pinpoints=[[IMAGE_SIDE, IMAGE_SIDE]],
        vision_feature_layer=-1,
    )
    _set_attn(cfg, attn)
    return LlavaOnevisionForConditionalGeneration(cfg), None


def idefics3(attn: str | None = None, layers: int = 4) -> tuple[nn.Module, None]:
    """Idefics3 (SmolVLM): its own vision transformer, a pixel-shuffle connector (4 patches to
    one token) before a Llama; images per row with a pixel mask; its feature method returns a
    list of each image's rows (the pipeline joins them)."""
    from transformers import Idefics3Config, Idefics3ForConditionalGeneration

    vision = {**_siglip().to_dict(), "model_type": "idefics3_vision", "image_size": 2 * IMAGE_SIDE}
    text = {**_TINY, "model_type": "llama", "num_hidden_layers": layers}
    cfg = Idefics3Config(
        vision_config=vision, text_config=text, image_token_id=IMAGE_TOKEN, scale_factor=2
    )
    _set_attn(cfg, attn)
    return Idefics3ForConditionalGeneration(cfg), None


def qwen2_vl(attn: str | None = None, layers: int = 4) -> tuple[nn.Module, None]:
    """Qwen2-VL: every image's patches concatenated over the batch (``pixel_values``, no row
    per prompt) with their grids (``image_grid_thw``), and 3-D rotary positions (M-RoPE) from the
    tokens and the grids (:func:`qwen2_vl_batch`)."""
    from transformers import Qwen2VLConfig, Qwen2VLForConditionalGeneration

    rope = {"rope_type": "default", "mrope_section": [4, 2, 2], "rope_theta": 10000.0}
    text = {**_TINY, "model_type": "qwen2_vl_text", "num_hidden_layers": layers}
    vision = dict(
        depth=2,
        embed_dim=32,
        hidden_size=_TINY["hidden_size"],
        num_heads=2,
        patch_size=2,
        spatial_merge_size=2,
        temporal_patch_size=2,
        mlp_ratio=2,
    )
    cfg = Qwen2VLConfig(
        text_config={**text, "rope_parameters": rope},
        vision_config=vision,
        image_token_id=IMAGE_TOKEN,
        video_token_id=IMAGE_TOKEN - 1,
        vision_start_token_id=IMAGE_TOKEN - 2,
    )
    _set_attn(cfg, attn)
    return Qwen2VLForConditionalGeneration(cfg), None


def qwen3_5_vl(attn: str | None = None, layers: int = 4) -> tuple[nn.Module, None]:
    """Qwen3.5 with images: Qwen2-VL's image format and M-RoPE (with a text position row
    besides, 4 rows) before a hybrid of linear-attention and attention layers."""
    from transformers import Qwen3_5Config, Qwen3_5ForConditionalGeneration

    text = {**_TINY, **TINY_FAMILIES["qwen3_5_text"], "num_hidden_layers": layers}
    vision = {"depth": 1, "hidden_size": 32, "intermediate_size": 64, "num_heads": 2}
    vision.update(out_hidden_size=_TINY["hidden_size"], patch_size=2, temporal_patch_size=2)
    cfg = Qwen3_5Config(
        text_config=text,
        vision_config={**vision, "spatial_merge_size": 2},
        image_token_id=IMAGE_TOKEN,
        video_token_id=IMAGE_TOKEN - 1,
        vision_start_token_id=IMAGE_TOKEN - 2,
    )
    _set_attn(cfg, attn)
    return Qwen3_5ForConditionalGeneration(cfg), None


def qwen3_vl(attn: str | None = None, layers: int = 4) -> tuple[nn.Module, None]:
    """Qwen3-VL: Qwen2-VL's images and M-RoPE (interleaved), and DeepStack: the features of two
    vision layers added to the hidden states of the first two text layers at the image tokens."""
    from transformers import Qwen3VLConfig, Qwen3VLForConditionalGeneration

    rope = {"rope_type": "default", "mrope_section": [4, 2, 2], "mrope_interleaved": True}
    text = {
        **_TINY,
        "model_type": "qwen3_vl_text",
        "num_hidden_layers": layers,
        "rope_parameters": rope,
    }
    vision = dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, patch_size=2)
    vision.update(out_hidden_size=_TINY["hidden_size"], num_position_embeddings=16)
    cfg = Qwen3VLConfig(
        text_config={**text, "rope_parameters": rope},
        vision_config={**vision, "spatial_merge_size": 2, "deepstack_visual_indexes": [0, 1]},
        image_token_id=IMAGE_TOKEN,
        video_token_id=IMAGE_TOKEN - 1,
        vision_start_token_id=IMAGE_TOKEN - 2,
    )
    _set_attn(cfg, attn)
    return Qwen3VLForConditionalGeneration(cfg), None


def glm4v(attn: str | None = None, layers: int = 4) -> tuple[nn.Module, None]:
    """GLM-4.1V: its own vision tower (learned positions interpolated per grid) over Qwen2-VL's
    image format, and M-RoPE on half of each head (partial rotary) in a GLM-4 text model."""
    from transformers import Glm4vConfig, Glm4vForConditionalGeneration

    rope = {"rope_type": "default", "mrope_section": [2, 1, 1], "partial_rotary_factor": 0.5}
    text = {**_TINY, "model_type": "glm4v_text", "num_hidden_layers": layers}
    vision = dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, patch_size=2)
    vision.update(out_hidden_size=_TINY["hidden_size"], image_size=8, temporal_patch_size=2)
    cfg = Glm4vConfig(
        text_config={**text, "rope_parameters": {**rope, "rope_theta": 10000.0}},
        vision_config={**vision, "spatial_merge_size": 2},
        image_token_id=IMAGE_TOKEN,
        video_token_id=IMAGE_TOKEN - 1,
        image_start_token_id=IMAGE_TOKEN - 2,
    )
    _set_attn(cfg, attn)
    return Glm4vForConditionalGeneration(cfg), None


QWEN_GRIDS = [[], [(1, 4, 4)], [(1, 2, 4), (1, 4, 4)], [(1, 4, 2)]]
"""The images of :func:`qwen2_vl_batch`'s rows, in turn: none, one, two of other sizes, one."""


QWEN_VIDEO_GRIDS = [[(2, 4, 4)], [], [(2, 2, 2), (2, 2, 2)], [(2, 2, 4)]]
"""The videos of :func:`qwen2_vl_batch`'s rows with ``videos``, after their images: 2 temporal
patches (4 frames) each (as :data:`QWEN_GRIDS`, 4 rows' worth, so a batch's halves hold the
same: the reference's microbatches are its chunks)."""


def qwen2_vl_batch(
    seed: int,
    batch: int = 8,
    seq: int = 20,
    pad: bool = True,
    videos: bool = False,
    frames: bool = False,
) -> dict:
    """Rows with 0, 1 or 2 images of several grids (``(t, h, w)`` patches, merged 2 x 2 into
    ``t * h * w / 4`` tokens after a vision-start token): their patches concatenated in row
    order, their grids, and ``mm_token_type_ids`` (1 on image tokens). With ``videos``, rows
    also hold 0-2 videos after their images (:data:`QWEN_VIDEO_GRIDS`), in
    ``pixel_values_videos`` and ``video_grid_thw`` (``mm_token_type_ids`` 2 on their tokens),
    a video's tokens in one run, or with ``frames`` a run per temporal patch, each after its
    own vision-start token (Qwen3-VL's and Qwen3.5's layout, whose timestamps part the frames)."""
    out = make_batch(seed, batch, seq, pad)
    ids = out["input_ids"].clamp(max=IMAGE_TOKEN - 3)
    kinds = [(IMAGE_TOKEN, QWEN_GRIDS, "pixel_values", "image_grid_thw")]
    if videos:
        kinds.append((IMAGE_TOKEN - 1, QWEN_VIDEO_GRIDS, "pixel_values_videos", "video_grid_thw"))
    grids = {token: [] for token, *_ in kinds}
    for r in range(batch):
        at = 1
        for token, rows, _, _ in kinds:
            for t, h, w in rows[(r + seed) % len(rows)]:
                runs = t if frames and token != IMAGE_TOKEN else 1
                for _ in range(runs):
                    ids[r, at] = IMAGE_TOKEN - 2
                    ids[r, at + 1 : at + 1 + t * h * w // 4 // runs] = token
                    at += 1 + t * h * w // 4 // runs
                grids[token].append([t, h, w])
    out["input_ids"] = ids
    media = (ids == IMAGE_TOKEN) | (ids == IMAGE_TOKEN - 1)
    out["labels"] = ids.masked_fill((out["attention_mask"] == 0) | media, -100)
    g = torch.Generator().manual_seed(seed)
    for token, _, pixels, grid in kinds:
        patches = sum(t * h * w for t, h, w in grids[token])
        out[pixels] = torch.randn(patches, 3 * 2 * 2 * 2, generator=g)
        out[grid] = torch.tensor(grids[token]).reshape(-1, 3)
    out["mm_token_type_ids"] = (ids == IMAGE_TOKEN).long() + 2 * (ids == IMAGE_TOKEN - 1).long()
    return out


IMAGES = {
    "llava_onevision": ((2, 3, IMAGE_SIDE, IMAGE_SIDE), 10),
    "idefics3": ((1, 3, 2 * IMAGE_SIDE, 2 * IMAGE_SIDE), 4),
}
"""Per family whose images are not :func:`image_batch`'s: a row's ``pixel_values`` shape and its
image tokens (LLaVA-OneVision: the base image and one crop, 4 + 4 features and 2 newlines;
Idefics3: 16 patches shuffled into 4 tokens)."""


def image_batch(
    seed: int,
    batch: int = 8,
    seq: int = 16,
    pad: bool = True,
    row: tuple[int, ...] = (3, IMAGE_SIDE, IMAGE_SIDE),
    tokens: int = PATCHES,
) -> dict:
    """:func:`make_batch` with an image per row: ``pixel_values`` (each row's of shape
    ``row``) and, after the first token, ``tokens`` image tokens (their labels -100)."""
    out = make_batch(seed, batch, max(seq, tokens + 8), pad)
    ids = out["input_ids"].clamp(max=IMAGE_TOKEN - 1)
    ids[:, 1 : 1 + tokens] = IMAGE_TOKEN
    out["input_ids"] = ids
    out["labels"] = ids.masked_fill((out["attention_mask"] == 0) | (ids == IMAGE_TOKEN), -100)
    g = torch.Generator().manual_seed(seed)
    out["pixel_values"] = torch.randn(batch, *row, generator=g)
    return out


INPUT_NAMES = {
    "llava": ("input_ids", "pixel_values", "attention_mask"),
    "paligemma": ("input_ids", "pixel_values", "attention_mask", "token_type_ids"),
    "gemma3": ("input_ids", "pixel_values", "attention_mask", "token_type_ids"),
    "llava_onevision": ("input_ids", "pixel_values", "attention_mask", "image_sizes"),
    "idefics3": ("input_ids", "pixel_values", "attention_mask", "pixel_attention_mask"),
    "qwen2_vl": (
        "input_ids",
        "pixel_values",
        "attention_mask",
        "image_grid_thw",
        "mm_token_type_ids",
    ),
}
for _family in ("qwen3_5_vl", "qwen3_vl", "glm4v"):  # Qwen2-VL's image format
    INPUT_NAMES[_family] = INPUT_NAMES["qwen2_vl"]
for _family in ("qwen2_vl_video", "qwen3_vl_video", "qwen3_5_vl_video"):  # and videos
    INPUT_NAMES[_family] = (*INPUT_NAMES["qwen2_vl"], "pixel_values_videos", "video_grid_thw")
"""The batch inputs of families whose batch holds more than token ids and a mask."""


VIDEO_FRAMES = {"qwen2_vl_video": False, "qwen3_vl_video": True, "qwen3_5_vl_video": True}
"""The families trained with videos besides their images, and whether a video's tokens come a
run per frame (:func:`qwen2_vl_batch`'s ``frames``: Qwen3-VL's layout)."""


def family_batch(family: str, seed: int, **kw) -> dict:
    """The batch a family trains on (:func:`image_batch` for the vision-language ones, with the
    inputs the family adds: PaliGemma's ``token_type_ids`` 0 on the image and a 3-token prompt
    and 1 on the rest, Gemma 3's 1 on the image's tokens, LLaVA-OneVision's ``image_sizes``,
    Idefics3's ``pixel_attention_mask``)."""
    if family not in INPUT_NAMES:
        return make_batch(seed, **kw)
    if INPUT_NAMES[family] == INPUT_NAMES["qwen2_vl"]:
        return qwen2_vl_batch(seed, **kw)
    if family in VIDEO_FRAMES:
        frames = VIDEO_FRAMES[family]
        return qwen2_vl_batch(
            seed, videos=True, frames=frames, **{"seq": 26 if frames else 20, **kw}
        )
    row, tokens = IMAGES.get(family, ((3, IMAGE_SIDE, IMAGE_SIDE), PATCHES))
    out = image_batch(seed, row=row, tokens=tokens, **kw)
    rows = out["input_ids"].shape[0]
    if family == "llava_onevision":  # each image's size (height, width)
        out["image_sizes"] = torch.tensor([[IMAGE_SIDE, IMAGE_SIDE]] * rows)
    elif family == "idefics3":  # no padding in the images
        out["pixel_attention_mask"] = torch.ones(rows, *row[:1], *row[2:], dtype=torch.bool)
    elif family == "paligemma":
        types = torch.ones_like(out["input_ids"])
        types[:, : 1 + PATCHES + 3] = 0
        out["token_type_ids"] = types
    elif family == "gemma3":
        out["token_type_ids"] = (out["input_ids"] == IMAGE_TOKEN).long()
    return out


def _tiny_family(name: str):
    model_type = name.removesuffix("_router_loss")
    return lambda attn=None, layers=4: tiny(model_type, attn, layers, **TINY_FAMILIES[name])


MODELS = {
    "llama": llama,
    "gpt2": gpt2,
    "qwen2": qwen2,
    "mistral": mistral,
    "gpt_neox": gpt_neox,
    "opt": opt,
    "phi3": phi3,
    "mixtral": mixtral,
    "mixtral_router_loss": lambda attn=None, layers=4: mixtral(attn, layers, router_loss=True),
    **{name: _tiny_family(name) for name in TINY_FAMILIES},
    "falcon_alibi": falcon_alibi,
    "llava": llava,
    "paligemma": paligemma,
    "gemma3": gemma3,
    "llava_onevision": llava_onevision,
    "idefics3": idefics3,
    "qwen2_vl": qwen2_vl,
    "qwen2_vl_video": qwen2_vl,
    "qwen3_vl_video": qwen3_vl,
    "qwen3_5_vl_video": qwen3_5_vl,
    "qwen3_5_vl": qwen3_5_vl,
    "qwen3_vl": qwen3_vl,
    "glm4v": glm4v,
}


def make_batch(seed: int, batch: int = 8, seq: int = 16, pad: bool = True) -> dict:
    """Random token ids; with ``pad``, some sequences are right-padded (attention_mask 0) and
    their padding labels are -100."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, VOCAB, (batch, seq), generator=g)
    mask = torch.ones(batch, seq, dtype=torch.long)
    if pad:
        for i in range(0, batch, 3):
            keep = int(torch.randint(seq // 2, seq, (1,), generator=g))
            mask[i, keep:] = 0
    labels = ids.masked_fill(mask == 0, -100)
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def warmup_cosine(opt, warmup=2, total=6):
    """Linear warmup, then cosine decay (the HF Trainer's default shape): the learning rate
    differs at every step, so a resume that restarted the curve would change the losses."""

    def factor(step):
        if step < warmup:
            return (step + 1) / warmup
        return 0.5 * (1 + math.cos(math.pi * (step - warmup) / (total - warmup)))

    return torch.optim.lr_scheduler.LambdaLR(opt, factor)


def full(t: torch.Tensor) -> torch.Tensor:
    """The whole of ``t``, gathered if it is a DTensor (a data-parallel shard)."""
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t


def hidden_loss(hidden, labels, num_items):
    """A loss over a base model's last hidden states (no head): their mean square at each labeled
    token, over ``num_items`` (:func:`labeled`)."""
    return (hidden.float().pow(2).mean(-1) * (labels != -100)).sum() / num_items


def labeled(labels):
    """The labeled tokens of a batch: :func:`hidden_loss`'s ``num_items``."""
    return (labels != -100).sum()


def reference_step(
    ref: nn.Module, batch: dict, num_microbatches: int
) -> tuple[torch.Tensor, float]:
    """One process's training step as the pipeline defines it (see [Note: added loss terms per
    microbatch]): for each microbatch, HF's loss function over the whole batch's token count plus
    what the model adds to it (HF's loss of the microbatch minus the loss function's part) over
    ``num_microbatches``; backward. Returns the summed loss and the summed added part."""
    from pippy_xla.runtime._build import causal_lm_num_items
    from pippy_xla.split.hf import text_vocab_size

    num_items = causal_lm_num_items(batch["labels"])
    vocab_size = text_vocab_size(ref.config)
    total = torch.zeros(())
    added_total = 0.0
    for mb in range(num_microbatches):
        part = {k: v.chunk(num_microbatches)[mb] for k, v in batch.items()}
        out = ref(**part, use_cache=False)
        main = ref.loss_function(
            out.logits, part["labels"], vocab_size, num_items_in_batch=num_items
        )
        own = ref.loss_function(out.logits, part["labels"], vocab_size)
        added = (out.loss - own) / num_microbatches
        loss = main + added
        loss.backward()
        total = total + loss.detach()
        added_total += float(added.detach())
    return total, added_total


def on_first_rank(fn, *args):
    """``fn(*args)`` computed on rank 0 only, its result (tensors included) broadcast to every rank.

    [Note: one reference per multi-rank test] The one-process reference is the same on every
    rank; each rank computing it cost a 4-rank test four whole models' steps beside the
    pipeline's one. Only rank 0's reference model is then trained: the other ranks' stays as
    built, and what they check comes from rank 0."""
    import torch.distributed as dist

    out = [fn(*args) if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(out, src=0)
    return out[0]


def grads_of(ref: nn.Module) -> dict[str, torch.Tensor | None]:
    """Every parameter's gradient by name, tied ones under each name (``None``: none)."""
    return {
        n: None if p.grad is None else p.grad.detach().clone()
        for n, p in ref.named_parameters(remove_duplicate=False)
    }


def params_of(ref: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter's value by name, tied ones under each name."""
    return {n: p.detach().clone() for n, p in ref.named_parameters(remove_duplicate=False)}


def shared_reference_step(ref: nn.Module, batch: dict, num_microbatches: int, opt=None):
    """:func:`reference_step` on rank 0 for every rank ([Note: one reference per multi-rank
    test]): its loss, its added part and ``{name: gradient}``, then ``opt`` (``ref``'s
    optimizer) stepped and zeroed, and ``{name: value}`` after that step."""

    def step():
        loss, added = reference_step(ref, batch, num_microbatches)
        grads = grads_of(ref)
        if opt is not None:
            opt.step()
            opt.zero_grad()
        return loss, added, grads, params_of(ref)

    return on_first_rank(step)


def pipeline(model: nn.Module, layer_cls: type[nn.Module], schedule="1f1b", mbs=2, **options):
    """The model pipelined with ``schedule`` (its default stages per rank), ``mbs``
    microbatches and a short timeout (60 s; compiled stages 600 s: a peer's first receive waits
    through inductor's compile of the stage, minutes on a slow or busy 2-core machine)."""
    import pippy_xla as px

    options.setdefault("timeout", 600 if options.get("compile") else 60)
    return px.PipelineModel(
        model,
        layer_cls=layer_cls,
        num_microbatches=mbs,
        schedule=schedule,
        **options,
    )


def _hf_tensor_parallel() -> bool:
    from pippy_xla.hf_compat import tensor_parallel_api

    try:
        tensor_parallel_api()
    except NotImplementedError:
        return False
    return True


HF_TENSOR_PARALLEL = _hf_tensor_parallel()
"""Whether this transformers has the tensor-parallel API the pipeline applies (5.23 on)."""

needs_hf_tensor_parallel = pytest.mark.skipif(
    not HF_TENSOR_PARALLEL,
    reason="transformers before 5.23: tensor parallelism is refused in one line "
    "(test_tensor_parallel.py::test_tensor_parallel_is_refused_before_transformers_5_23)",
)
