"""What building a :class:`~pippy_xla.PipelineModel` decides, one function per decision: the
device, the stage layout, the loss, and the handshake that every rank built the same pipeline.
Each takes what it needs as arguments and returns its result; ``PipelineModel.__init__`` calls
them in order."""

from __future__ import annotations

import hashlib
import os
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch import nn

from pippy_xla._batch import digest64
from pippy_xla._native import _C
from pippy_xla.partition import StageGraph

if TYPE_CHECKING:
    from pippy_xla.planner import Plan

__all__ = [
    "LossFn",
    "balanced_ranges",
    "causal_lm_num_items",
    "check_ranks_agree",
    "default_loss",
    "resolve_device",
    "resolve_layout",
]

LossFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def balanced_ranges(num_layers: int, num_stages: int) -> list[tuple[int, int]]:
    """Contiguous layer ranges whose sizes differ by at most one (earlier stages get more)."""
    _C.check_stage_count(num_layers, num_stages)
    base, extra = divmod(num_layers, num_stages)
    ranges, start = [], 0
    for s in range(num_stages):
        stop = start + base + (1 if s < extra else 0)
        ranges.append((start, stop))
        start = stop
    return ranges


def resolve_layout(
    *,
    num_layers: int,
    num_ranks: int,
    chunks: int,
    schedule: str,
    num_microbatches: int,
    layer_ranges: Sequence[tuple[int, int]] | None,
    plan: Plan | None,
) -> tuple[list[tuple[int, int]], list[int]]:
    """The layer range of every stage and the checkpointed layers: from ``plan``, from
    ``layer_ranges`` or balanced. Raises ``ValueError`` when they do not fit the pipeline."""
    num_stages = num_ranks * chunks
    checkpoint_layers: list[int] = []
    if plan is not None:
        if layer_ranges is not None:
            raise ValueError("pass either plan=... or layer_ranges=..., not both")
        made_for = (plan.schedule, plan.num_microbatches, plan.chunks)
        if made_for != (schedule, num_microbatches, chunks):
            raise ValueError(
                f"the plan was made for schedule {plan.schedule!r} with "
                f"{plan.num_microbatches} microbatches and {plan.chunks} stage(s) per rank, but "
                f"this pipeline runs {schedule!r} with {num_microbatches} and {chunks}: what "
                f"each rank holds when differs, so its memory prediction would not hold; plan "
                f"with schedule={schedule!r}, num_microbatches={num_microbatches}, "
                f"chunks={chunks}"
            )
        if plan.num_stages != num_stages:
            raise ValueError(
                f"the plan has {plan.num_stages} stages but this pipeline has "
                f"{num_stages} ({num_ranks} ranks x {chunks} chunks); plan for "
                f"{num_stages}"
            )
        layer_ranges = plan.layer_ranges
        checkpoint_layers = plan.checkpoint_layers
    if schedule == "interleaved" and num_layers % num_stages:
        raise ValueError(
            f"schedule 'interleaved' with {chunks} chunks on {num_ranks} ranks needs the "
            f"{num_layers} decoder layers to divide into {num_stages} equal stages; "
            "choose chunks so that ranks x chunks divides the layer count"
        )
    if layer_ranges is None:
        layer_ranges = balanced_ranges(num_layers, num_stages)
    elif len(layer_ranges) != num_stages:
        raise ValueError(
            f"layer_ranges has {len(layer_ranges)} stages but the process group has "
            f"{num_ranks} ranks x {chunks} chunks = {num_stages} stages"
        )
    return [tuple(r) for r in layer_ranges], checkpoint_layers


def resolve_device(device: torch.device | str | None, group: dist.ProcessGroup) -> torch.device:
    """The pipeline's device: checked against the group's backend (gloo moves CPU tensors, NCCL
    CUDA tensors) and the machine."""
    backend = str(dist.get_backend(group)).lower()
    if device is None:
        if "nccl" in backend:
            return resolve_device(f"cuda:{int(os.environ.get('LOCAL_RANK', 0))}", group)
        return torch.device("cpu")
    device = torch.device(device)
    if device.type == "cuda":
        if "nccl" not in backend:
            raise ValueError(
                f"device={str(device)!r} needs an NCCL process group (the pipeline sends CUDA "
                f"tensors point to point), but the group's backend is {backend!r}; use "
                "dist.init_process_group('nccl') or device='cpu'"
            )
        if not torch.cuda.is_available():
            raise ValueError(f"device={str(device)!r} but CUDA is not available on this machine")
        count = torch.cuda.device_count()
        index = torch.cuda.current_device() if device.index is None else device.index
        if not 0 <= index < count:
            raise ValueError(
                f"device={str(device)!r} does not exist: this machine has {count} CUDA "
                f"device(s), cuda:0 to cuda:{count - 1}; under torchrun use cuda:LOCAL_RANK"
            )
        torch.cuda.set_device(index)
        return torch.device("cuda", index)
    if device.type == "cpu":
        if "gloo" not in backend:
            raise ValueError(
                f"device='cpu' needs a gloo process group, but the group's backend is "
                f"{backend!r} (NCCL moves CUDA tensors only); pass device='cuda:LOCAL_RANK' or "
                "use dist.init_process_group('gloo')"
            )
        return device
    raise ValueError(f"device type {device.type!r} is not supported; use 'cpu' or 'cuda'")


def default_loss(model: nn.Module) -> LossFn:
    """The HF model's own loss as a ``loss_fn(logits, labels, num_items)``."""
    if not hasattr(model, "loss_function") or not hasattr(model, "config"):
        raise ValueError(f"{type(model).__name__} has no HF loss_function; pass loss_fn=...")
    loss_function = model.loss_function
    vocab_size = model.config.vocab_size

    def loss_fn(logits: torch.Tensor, labels: torch.Tensor, num_items: torch.Tensor):
        return loss_function(
            logits=logits, labels=labels, vocab_size=vocab_size, num_items_in_batch=num_items
        )

    return loss_fn


def causal_lm_num_items(labels: torch.Tensor) -> torch.Tensor:
    """The valid tokens of causal-LM labels: HF's losses shift labels left by one and ignore
    -100."""
    return (labels[..., 1:] != -100).sum()


def check_ranks_agree(
    stages: Sequence[StageGraph],
    settings: tuple,
    *,
    rank: int,
    group: dist.ProcessGroup,
    group_name: str,
    device: torch.device,
    timeout_ms: int,
) -> int:
    """Build-time handshake: every rank of ``group`` must have built the same stage graphs with
    the same ``settings`` (a tuple of plain values). Returns the 64-bit digest of them (a mesh's
    replicas compare it too); raises ``RuntimeError`` saying what differs."""
    digest = hashlib.sha256()
    for st in stages:
        digest.update(st.code.encode())
        digest.update(repr(sorted(st.param_names.items())).encode())
    mine = (digest.hexdigest(), *settings)
    key = digest64(repr(mine).encode())
    keys = _C.all_gather_int64(
        key, group_name, str(device), timeout_ms, f"[rank {rank}] build handshake"
    )
    if all(k == key for k in keys):
        return key
    everyone: list = [None] * len(keys)  # only to say what differs
    dist.all_gather_object(everyone, mine, group=group)
    for r, theirs in enumerate(everyone):
        if theirs != mine:
            raise RuntimeError(
                f"[rank {rank}] rank {r} built a different pipeline: (graph digest, "
                f"schedule, microbatches, inputs) = {theirs} here {mine}; every rank must "
                "wrap the same model with the same arguments"
            )
    return key
