"""Checkpoints: pretrained HF weights in and out stage by stage, and distributed checkpoints.

Two formats, both keyed by the original model's parameter names:

- **HF safetensors** (``load_pretrained`` / ``save_pretrained``): the format of
  ``PreTrainedModel.save_pretrained``. Each rank reads only its stage's tensors, lazily through
  ``safetensors.safe_open`` and the index file; each rank writes its own stage's shard(s) and the
  first rank writes one index naming them, so ``from_pretrained`` loads the result.
- **Distributed checkpoints** (``save`` / ``load``) through ``torch.distributed.checkpoint``:
  parameters, persistent buffers and the optimizer's state (flattened under the same names, as
  torch's ``get_optimizer_state_dict(..., flatten_optimizer_state_dict=True)`` writes it for
  pipelines), so DCP itself reshards: a checkpoint saved at one rank count or schedule loads at
  another, and into a plain single-process model (:func:`load_into_module`).
  See [Note: atomic checkpoints].
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch import nn
from torch.optim.lr_scheduler import LRScheduler

from pippy_xla.runtime.data_parallel import assign
from pippy_xla.runtime.failures import FailureState
from pippy_xla.units import parse_bytes

__all__ = [
    "latest_checkpoint",
    "load",
    "load_into_module",
    "load_pretrained",
    "save",
    "save_pretrained",
    "collective",
    "register_wrapper",
    "save_hf_layout",
    "whole_state",
    "wrapper_of",
]

logger = logging.getLogger(__name__)


class Checkpointable(Protocol):
    """What checkpoints read of a :class:`~pippy_xla.PipelineModel` (a protocol, so that this
    module does not import the pipeline, which calls it)."""

    @property
    def rank(self) -> int: ...
    @property
    def num_ranks(self) -> int: ...
    @property
    def dp_rank(self) -> int: ...
    @property
    def dp_size(self) -> int: ...
    @property
    def schedule(self) -> str: ...
    @property
    def group(self) -> dist.ProcessGroup | None: ...
    @property
    def checkpoint_group(self) -> dist.ProcessGroup | None: ...
    @property
    def tp_rank(self) -> int: ...
    @property
    def cp_rank(self) -> int: ...

    config: Any
    generation_config: Any
    _failures: FailureState

    def named_parameters(self) -> Iterator[tuple[str, nn.Parameter]]: ...
    def state_dict(self, keep_vars: bool = False) -> dict[str, torch.Tensor]: ...
    def aliases(self, name: str) -> list[str]: ...
    def all_state_names(self) -> set[str]: ...
    def non_persistent_names(self) -> set[str]: ...
    def checkpoint_name(self, key: str) -> str: ...
    @property
    def checkpoint_conversion(self) -> Any: ...
    def in_pretrained(self, name: str) -> bool: ...
    def checkpoint_state(self) -> dict[str, torch.Tensor]: ...


class ModelWrapper(Protocol):
    """A wrapper around the model whose tensor names are not its pretrained checkpoints' and
    whose ``save_pretrained`` format is its own (PEFT's ``PeftModel``:
    :mod:`pippy_xla.integrations.peft`, which registers itself with :func:`register_wrapper`)."""

    def base_name(self, name: str) -> str | None:
        """The pretrained checkpoint's key of the pipeline's tensor ``name``; ``None`` for a
        tensor no pretrained checkpoint holds."""

    def model_name(self, key: str, names: Callable[[], set[str]]) -> str:
        """The pipeline's name of the pretrained checkpoint's ``key`` (``names()``: all of them,
        asked for once)."""

    def save(self, pipe, path: str | os.PathLike, max_shard_size, merge_adapters: bool) -> None:
        """``pipe.save_pretrained(path, ...)`` in the wrapper's format."""

    def load_adapter(self, pipe, path: str | os.PathLike, adapter_name: str) -> None:
        """Loads the adapter saved at ``path`` into this rank's stages."""

    def check_options(self, config: Any) -> None:
        """Raises for options of the pipeline's ``config`` the wrapper does not support."""

    def inner_model(self) -> nn.Module:
        """The model the wrapper runs (its layers the pipeline's): what generation traces."""

    def fresh_adapters(self, model: nn.Module) -> set[str]:
        """The names of the model's adapter tensors on ``meta``, before the build (an error if
        they cannot be initialized after it)."""

    def init_fresh(self, pipe, fresh: set[str]) -> None:
        """Initializes this rank's tensors of ``fresh`` as the wrapper's library would."""


_WRAPPERS: list[Callable[[nn.Module], ModelWrapper | None]] = []


def register_wrapper(factory: Callable[[nn.Module], ModelWrapper | None]) -> None:
    """Adds ``factory(model)``, a :class:`ModelWrapper` of the models it knows (else ``None``),
    to those :func:`wrapper_of` asks."""
    _WRAPPERS.append(factory)


def wrapper_of(model: nn.Module) -> ModelWrapper | None:
    """The registered wrapper of ``model``, if any knows it."""
    return next((w for f in _WRAPPERS if (w := f(model)) is not None), None)


SAFE_WEIGHTS = "model.safetensors"
SAFE_INDEX = "model.safetensors.index.json"
LATEST = "latest"
META = "pippy_xla.json"
SCHEDULER = "scheduler.pt"

_REFUSALS = (KeyError, ValueError, OSError)
"""What a checkpoint refused on every rank alike raises (see :func:`collective`)."""


def collective(pipe: Checkpointable, action: str, fn, *args, refusals: tuple = ()):
    """``fn(*args)``, a collective over the checkpoint's ranks, run as a watched collective
    (see [Note: watched collectives]): a peer's failure or death is a ``PipelineError`` naming it
    within seconds, not a wait for the process group's timeout, and a failure here is posted for
    the peers. ``refusals``: exception types that every rank raises alike (a damaged or
    mismatched checkpoint, found before anything is written); they are raised as they are, and
    the pipeline stays usable."""

    def attempt():
        try:
            return fn(*args), None
        except refusals as e:
            return None, e

    value, refusal = pipe._failures.watched(action, attempt)
    if refusal is not None:
        raise refusal
    return value


# ----------------------------------------------------------------------------- HF safetensors


def _open_safetensors(file: Path):
    """``safe_open`` of ``file``; a damaged file (truncated, not safetensors) is a ValueError
    naming it."""
    from safetensors import safe_open

    try:
        return safe_open(file, framework="pt", device="cpu")
    except Exception as e:  # noqa: BLE001  (safetensors' own error type)
        raise ValueError(f"cannot read {file}: {e}") from e


def _weight_map(path: Path) -> tuple[dict[str, Path], Path]:
    """``{key: file}`` of a HF checkpoint directory, and the file that says so."""
    index = path / SAFE_INDEX
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        return {k: path / f for k, f in weight_map.items()}, index
    single = path / SAFE_WEIGHTS
    if single.is_file():
        with _open_safetensors(single) as f:
            return dict.fromkeys(f.keys(), single), single
    raise FileNotFoundError(
        f"{path} holds neither {SAFE_INDEX} nor {SAFE_WEIGHTS}; pass the directory that "
        "save_pretrained wrote (a local HF checkpoint)"
    )


def load_pretrained(pipe: Checkpointable, path: str | os.PathLike) -> None:
    """Loads this rank's stage from a HF safetensors checkpoint directory.

    Only the local stage's tensors are read (one at a time, from the shards the index names), and
    of a tensor sharded over ranks (experts, FSDP2 or tp shards) only the rank's slice, so a
    rank's host memory stays near its share's size. Values are converted to the dtype of the
    pipeline's tensors (build the model in the dtype you want). Tied weights are found under any
    of their names.

    A collective: every rank checks its part first (keys, shapes, whole files), and if any
    rank cannot load, every rank raises before any tensor is written. A peer's failure or death
    is a ``PipelineError`` naming it (see [Note: watched collectives]).

    Raises:
        FileNotFoundError: ``path`` is not a safetensors checkpoint.
        KeyError: a tensor of this stage is missing, or a checkpoint key belongs to no tensor of
            the model; the message names the key and the file (on the other ranks: which rank
            and why).
        ValueError: a tensor has another shape than the model's, or a file is damaged
            (truncated); names the key or the file.
    """
    collective(pipe, "load_pretrained", _load_pretrained, pipe, path, refusals=_REFUSALS)


@dataclass(slots=True)
class _Merged:
    """Tensors of the model that one HF weight converter makes of several checkpoint keys (see
    :func:`pippy_xla.hf_compat.checkpoint_conversion`): Mixtral's ``experts.gate_up_proj`` of
    every expert's ``w1`` and ``w3``."""

    name: str
    """HF's name of the group: its converter's first target."""
    sources: dict[str, list[str]] = field(default_factory=dict)
    """The checkpoint's keys by the converter's source pattern they matched, in key order."""
    targets: dict[str, tuple[str, torch.Tensor]] = field(default_factory=dict)
    """This rank's tensors among the targets: HF's name -> (the model's name, the tensor)."""


def _load_pretrained(pipe: Checkpointable, path: str | os.PathLike) -> None:
    try:
        by_file, merged = _pretrained_entries(pipe, Path(path))
        failure = None
    except (KeyError, ValueError, OSError) as e:
        by_file, merged, failure = {}, [], e
    # Every rank checks its part before any rank writes a tensor: one rank's bad key or file is
    # an error on every rank, and no rank is left half-loaded.
    reports: list = [None] * dist.get_world_size(pipe.checkpoint_group)
    mine = None if failure is None else (type(failure).__name__, _text(failure))
    dist.all_gather_object(reports, mine, group=pipe.checkpoint_group)
    if failure is not None:
        raise failure
    bad = next(((r, rep) for r, rep in enumerate(reports) if rep is not None), None)
    if bad is not None:
        rank, (kind, text) = bad
        error = KeyError if kind == "KeyError" else ValueError
        raise error(
            f"[rank {pipe.rank}] nothing loaded: rank {rank} of the pipeline cannot load its part "
            f"of {path}: {kind}: {text}"
        )
    stored, _ = _weight_map(Path(path))
    with torch.no_grad():
        for file, entries in sorted(by_file.items()):
            with _open_safetensors(file) as f:
                for _, key, target in entries:
                    _read_into(target, f, key)
        for group in merged:
            _read_merged(pipe.checkpoint_conversion, group, stored)


def _local_rows(target: torch.Tensor) -> tuple[slice, ...] | None:
    """This rank's slice of ``target``, a DTensor sharded plainly (``Shard`` / ``Replicate``
    placements: expert, FSDP2 or tp shards); ``None`` where it is read whole."""
    from torch.distributed.tensor import DTensor, Replicate, Shard
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    plain = isinstance(target, DTensor) and target.dim() > 0
    plain = plain and target.device_mesh.get_coordinate() is not None
    plain = plain and all(
        type(p) is Replicate or (type(p) is Shard and p.dim >= 0) for p in target.placements
    )
    if not plain:
        return None
    shape, offset = compute_local_shape_and_global_offset(
        target.shape, target.device_mesh, target.placements
    )
    return tuple(slice(o, o + n) for o, n in zip(offset, shape, strict=True))


def _read_into(target: torch.Tensor, f, key: str) -> None:
    """Copies the stored tensor ``key`` of the open safetensors file ``f`` into ``target``; of a
    plainly sharded DTensor (:func:`_local_rows`) only this rank's slice is read, so a rank's
    host memory holds its shard, not the whole tensor."""
    rows = _local_rows(target)
    if rows is None:
        assign(target, f.get_tensor(key))
    else:
        target.to_local().copy_(f.get_slice(key)[rows])


def _open_all(stack: contextlib.ExitStack, group: _Merged, stored: dict[str, Path]) -> dict:
    """Every file holding one of ``group``'s keys, open (closed with ``stack``)."""
    files = {stored[k] for keys in group.sources.values() for k in keys}
    return {file: stack.enter_context(_open_safetensors(file)) for file in sorted(files)}


def _read_merged(conversion, group: _Merged, stored: dict[str, Path]) -> None:
    """Reads ``group``'s checkpoint keys and copies what HF's converter makes of them into its
    targets. Of a single target sharded on dim 0 (experts under expert parallelism, FSDP2), only
    the sources of this rank's rows are read where each source is one row (one expert's tensor,
    the ``tensor_idx``-th of its pattern's list, as HF's ``DtensorShardOperation`` reads them):
    the converter then stacks this rank's experts only; other sharded targets are converted whole
    and sliced."""
    (_, target), *others = group.targets.values()
    rows = None if others else _local_rows(target)
    sources: dict[str, list[torch.Tensor]] = {}
    with contextlib.ExitStack() as stack:
        opened = _open_all(stack, group, stored)
        for pattern, keys in group.sources.items():
            sources[pattern] = []
            for i, key in enumerate(keys):
                f = opened[stored[key]]
                one_row = rows is not None and len(f.get_slice(key).get_shape()) == target.dim() - 1
                if one_row and not rows[0].start <= i % target.shape[0] < rows[0].stop:
                    continue  # another rank's expert
                sources[pattern].append(f.get_tensor(key))
    values = conversion.convert(group.name, sources)
    for hf_name, (_, tensor) in group.targets.items():
        value = values[hf_name]
        if rows is None:
            assign(tensor, value)
            continue
        if value.shape[0] != tensor.shape[0]:  # already this rank's rows of dim 0
            rows = (slice(None), *rows[1:])
        tensor.to_local().copy_(value[rows])


def _text(e: BaseException) -> str:
    """An exception's message (``str`` of a ``KeyError`` is its message quoted)."""
    return str(e.args[0]) if isinstance(e, KeyError) and e.args else str(e)


def _split_keys(
    pipe: Checkpointable, stored: dict[str, Path]
) -> tuple[dict[str, str], dict[str, tuple[_Merged, str]]]:
    """The checkpoint's keys as the model names them: ``{name: key}`` of the keys read as they
    are, and ``{name: (group, HF's name)}`` of the tensors HF's weight converters make of
    several keys (see :func:`pippy_xla.hf_compat.checkpoint_conversion`)."""
    from pippy_xla.hf_compat import key_order

    conversion = pipe.checkpoint_conversion
    keys: dict[str, str] = {}
    groups: dict[str, _Merged] = {}
    for key in stored if conversion is None else sorted(stored, key=key_order):
        name, pattern = (key, None) if conversion is None else conversion.rename(key)
        if pattern is None:
            keys[pipe.checkpoint_name(key)] = key
        else:
            groups.setdefault(name, _Merged(name)).sources.setdefault(pattern, []).append(key)
    made = {
        pipe.checkpoint_name(t): (group, t)
        for group in groups.values()
        for t in conversion.targets(group.name, next(iter(group.sources)))
    }
    return keys, made


def _pretrained_entries(
    pipe: Checkpointable, path: Path
) -> tuple[dict[Path, list[tuple[str, str, torch.Tensor]]], list[_Merged]]:
    """This rank's tensors in the safetensors checkpoint at ``path``: those stored as they are,
    by file, and those HF's weight converters make of several keys; checked (every key known,
    every local tensor present with the model's shape, every file whole) without reading any
    tensor's values."""

    stored, listing = _weight_map(path)
    keys, made = _split_keys(pipe, stored)
    first = {
        name: keys.get(name) or next(iter(made[name][0].sources.values()))[0]
        for name in (*keys, *made)
    }  # the model's name -> a file's key
    known = pipe.all_state_names()
    ignored = pipe.non_persistent_names()
    unexpected = sorted(k for k in first if k not in known and k not in ignored)
    if unexpected:
        shown = ", ".join(f"'{first[k]}' (in {stored[first[k]].name})" for k in unexpected[:8])
        raise KeyError(
            f"[rank {pipe.rank}] the checkpoint {path} holds {len(unexpected)} key(s) that belong "
            f"to no tensor of the model: {shown}; is it a checkpoint of this model class and "
            "config?"
        )
    by_file: dict[Path, list[tuple[str, str, torch.Tensor]]] = {}
    merged: dict[int, _Merged] = {}
    for name, target in pipe.state_dict(keep_vars=True).items():
        if not pipe.in_pretrained(name):
            continue  # an adapter's tensor: no pretrained checkpoint holds it
        alias = next((k for k in pipe.aliases(name) if k in first), None)
        if alias is None:
            raise KeyError(
                f"[rank {pipe.rank}] the checkpoint {path} has no tensor '{name}' (looked in "
                f"{listing.name})"
            )
        if alias in keys:
            by_file.setdefault(stored[keys[alias]], []).append((name, keys[alias], target))
        else:
            group, hf_name = made[alias]
            group.targets[hf_name] = (name, target)
            merged[id(group)] = group
    _check_shapes(pipe, by_file, list(merged.values()), stored)
    return by_file, list(merged.values())


def _check_shapes(
    pipe: Checkpointable,
    by_file: dict[Path, list[tuple[str, str, torch.Tensor]]],
    merged: list[_Merged],
    stored: dict[str, Path],
) -> None:
    """Raises a ValueError naming the key (or the converted tensor) whose shape is not the
    model's; a converted tensor's shape is that of HF's conversion run on meta tensors."""
    for file, entries in sorted(by_file.items()):
        with _open_safetensors(file) as f:
            for name, key, target in entries:
                shape = tuple(f.get_slice(key).get_shape())
                if shape != tuple(target.shape):
                    raise ValueError(
                        f"[rank {pipe.rank}] '{key}' in {file.name} has shape {shape}, the "
                        f"model's '{name}' has {tuple(target.shape)}"
                    )
    for group in merged:
        with contextlib.ExitStack() as stack:
            opened = _open_all(stack, group, stored)
            sources = {
                pattern: [
                    torch.empty(opened[stored[k]].get_slice(k).get_shape(), device="meta")
                    for k in keys
                ]
                for pattern, keys in group.sources.items()
            }
        try:
            values = pipe.checkpoint_conversion.convert(group.name, sources)
        except Exception as e:  # noqa: BLE001  (HF's operations raise what they raise)
            raise ValueError(
                f"[rank {pipe.rank}] cannot convert {sum(map(len, group.sources.values()))} "
                f"checkpoint key(s) into '{group.name}' as HF does: {e}"
            ) from e
        for hf_name, (name, target) in group.targets.items():
            shape = tuple(values[hf_name].shape) if hf_name in values else None
            if shape != tuple(target.shape):
                raise ValueError(
                    f"[rank {pipe.rank}] HF's conversion of the checkpoint's keys into "
                    f"'{hf_name}' has shape {shape}, the model's '{name}' has "
                    f"{tuple(target.shape)}"
                )


def _shards(tensors: dict[str, torch.Tensor], max_bytes: int | None) -> list[list[str]]:
    shards: list[list[str]] = [[]]
    size = 0
    for name, t in tensors.items():
        nbytes = t.numel() * t.element_size()
        if max_bytes is not None and shards[-1] and size + nbytes > max_bytes:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += nbytes
    return [s for s in shards if s]


def save_pretrained(
    pipe: Checkpointable, path: str | os.PathLike, max_shard_size: int | str | None = None
) -> None:
    """Writes the model in HF's safetensors layout; a collective over the pipeline's ranks.

    Every rank writes its own stage's shard(s) (split at ``max_shard_size`` bytes, e.g.
    ``"2GB"``); the first rank writes the index naming them and the model's config, so
    ``AutoModelForCausalLM.from_pretrained(path)`` loads the trained model. A tied weight is
    written once, under its first name in the model (as HF does), by the lowest rank holding it.
    On a mesh, the first replica writes (sharded tensors are gathered over the replicas first;
    with context parallelism, cp rank 0: the cp ranks hold equal copies).
    A failure on one rank is a ``PipelineError`` on every rank (see [Note: watched
    collectives]).
    """
    collective(pipe, "save_pretrained", save_hf_layout, pipe, path, max_shard_size)


def whole_state(pipe: Checkpointable) -> dict[str, torch.Tensor]:
    """The local state dict with every sharded tensor (a DTensor on a mesh) gathered whole; a
    collective over the mesh's groups."""
    from torch.distributed.tensor import DTensor

    return {
        k: v.full_tensor() if isinstance(v, DTensor) else v for k, v in pipe.state_dict().items()
    }


def writes_whole(pipe: Checkpointable) -> bool:
    """Whether this rank's pipeline is the one that writes a model in HF's layout (PEFT's too):
    the first replica's, at tp rank 0 and cp rank 0, which holds every tensor whole (the other
    replicas and cp ranks hold equal copies, the other tp ranks shards gathered before)."""
    return pipe.dp_rank == 0 and pipe.tp_rank == 0 and pipe.cp_rank == 0


def save_hf_layout(
    pipe: Checkpointable,
    path: str | os.PathLike,
    max_shard_size: int | str | None,
    local: dict[str, torch.Tensor] | None = None,
    rename=None,
) -> None:
    """Writes ``local`` (by default :func:`whole_state`), keyed by the pipeline's names, in HF's
    safetensors layout under ``rename(name)`` (default: the name itself); see
    :func:`save_pretrained`. Collective; run inside :func:`collective`."""
    from safetensors.torch import save_file

    path = Path(path)
    max_bytes = None if max_shard_size is None else parse_bytes(max_shard_size)
    local = whole_state(pipe) if local is None else local
    rename = rename or (lambda name: name)
    if not writes_whole(pipe):
        dist.barrier(group=pipe.checkpoint_group)  # until the pipeline that writes has written
        return
    everyone: list = [None] * pipe.num_ranks
    dist.all_gather_object(everyone, sorted(local), group=pipe.group)
    mine: dict[str, torch.Tensor] = {}
    for name, t in local.items():
        group = pipe.aliases(name)
        if name != group[0] and any(n in local for n in group[: group.index(name)]):
            continue  # written under an earlier local name of the same tie
        holders = [r for r, names in enumerate(everyone) if any(n in names for n in group)]
        if holders[0] == pipe.rank and rename(group[0]) not in mine:
            mine[rename(group[0])] = t.detach().contiguous()
    shards = _shards(mine, max_bytes)
    counts: list = [None] * pipe.num_ranks
    dist.all_gather_object(counts, len(shards), group=pipe.group)
    total, first = sum(counts), sum(counts[: pipe.rank])
    path.mkdir(parents=True, exist_ok=True)
    weight_map = {}
    for i, names in enumerate(shards):
        file = f"model-{first + i + 1:05d}-of-{total:05d}.safetensors"
        if total == 1:
            file = SAFE_WEIGHTS
        save_file({n: mine[n] for n in names}, str(path / file), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(names, file))
    sizes = sum(t.numel() * t.element_size() for t in mine.values())
    maps: list = [None] * pipe.num_ranks
    dist.all_gather_object(maps, (weight_map, sizes), group=pipe.group)
    if pipe.rank == 0:
        if total > 1:
            merged = {k: f for m, _ in maps for k, f in m.items()}
            index = {
                "metadata": {"total_size": sum(s for _, s in maps)},
                "weight_map": dict(sorted(merged.items())),
            }
            (path / SAFE_INDEX).write_text(json.dumps(index, indent=2) + "\n")
        if pipe.config is not None:
            pipe.config.save_pretrained(path)
        if pipe.generation_config is not None:
            pipe.generation_config.save_pretrained(path)
    dist.barrier(group=pipe.checkpoint_group)


# ----------------------------------------------------------------------------- DCP

"""[Note: atomic checkpoints]

``save(directory, step=k)`` writes ``directory/.step-0000000k.partial`` through DCP (every rank
writes its shard, the first rank writes DCP's ``.metadata`` last), then the first rank renames it
to ``directory/step-0000000k`` and replaces ``directory/latest`` (a one-line file naming it) with
``os.replace``. A run killed while saving leaves a ``.partial`` directory that nothing reads, and
``latest`` still names the previous complete checkpoint. ``load(directory)`` follows ``latest``.
"""


class _ParamView(nn.Module):
    """Parameters registered under their original names, for torch's optimizer state-dict
    helpers; a tied parameter appears once, under its first name in the model (the name a plain
    single-process model's optimizer state uses)."""

    def __init__(self, params: Mapping[str, nn.Parameter]) -> None:
        super().__init__()
        for name, p in params.items():
            owner: nn.Module = self
            *path, attr = name.split(".")
            for atom in path:
                if atom not in owner._modules:
                    owner.add_module(atom, nn.Module())
                owner = owner._modules[atom]
            owner.register_parameter(attr, p)


def _optim_options():
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(flatten_optimizer_state_dict=True)


def _optimizer_state(module: nn.Module, optimizer: torch.optim.Optimizer) -> dict:
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    return get_optimizer_state_dict(module, optimizer, options=_optim_options())


def _set_optimizer_state(module: nn.Module, optimizer: torch.optim.Optimizer, state: dict) -> None:
    from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict

    set_optimizer_state_dict(module, optimizer, state, options=_optim_options())


def _view(pipe: Checkpointable) -> _ParamView:
    return _ParamView({pipe.aliases(name)[0]: p for name, p in pipe.named_parameters()})


def _rng_key(pipe: Checkpointable) -> str:
    group = pipe.checkpoint_group
    return f"rng.rank{dist.get_rank(group)}-of-{dist.get_world_size(group)}"


def latest_checkpoint(directory: str | os.PathLike) -> Path | None:
    """The checkpoint ``directory/latest`` names, or ``directory`` itself if it is one, or
    ``None`` if there is none yet."""
    directory = Path(directory)
    if (directory / ".metadata").is_file():
        return directory
    latest = directory / LATEST
    if latest.is_file():
        return directory / latest.read_text().strip()
    return None


def save(
    pipe: Checkpointable,
    directory: str | os.PathLike,
    optimizer: torch.optim.Optimizer | None = None,
    step: int | None = None,
    scheduler: LRScheduler | None = None,
) -> Path:
    """Saves the pipeline's parameters, persistent buffers, ``optimizer``'s state, each rank's
    RNG state, ``step`` and the learning-rate ``scheduler``'s state (the same on every rank) as
    ``directory/step-<step>`` with ``torch.distributed.checkpoint``; a collective over the
    pipeline's ranks (on a mesh: over every rank of the mesh; sharded tensors are saved as DCP
    shards). Atomic: see [Note: atomic checkpoints]. A failure on one rank, or its death, is a
    ``PipelineError`` naming it on every rank within seconds (see [Note: watched collectives]);
    the previous checkpoint stays the latest."""
    return collective(pipe, "checkpoint save", _save, pipe, directory, optimizer, step, scheduler)


def _save(
    pipe: Checkpointable,
    directory: str | os.PathLike,
    optimizer: torch.optim.Optimizer | None,
    step: int | None,
    scheduler: LRScheduler | None,
) -> Path:
    import torch.distributed.checkpoint as dcp

    directory = Path(directory)
    name = "checkpoint" if step is None else f"step-{step:08d}"
    final, partial = directory / name, directory / f".{name}.partial"
    group = pipe.checkpoint_group
    first = dist.get_rank(group) == 0
    if first:
        directory.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(partial, ignore_errors=True)
    dist.barrier(group=group)
    state: dict = {"model": pipe.checkpoint_state(), _rng_key(pipe): torch.get_rng_state()}
    if optimizer is not None:
        state["optim"] = _optimizer_state(_view(pipe), optimizer)
    dcp.save(state, checkpoint_id=partial, process_group=group)
    if first:
        meta = {
            "step": step,
            "ranks": pipe.num_ranks,
            "replicas": pipe.dp_size,
            "schedule": pipe.schedule,
        }
        if scheduler is not None:
            torch.save(scheduler.state_dict(), partial / SCHEDULER)
        (partial / META).write_text(json.dumps(meta) + "\n")
        shutil.rmtree(final, ignore_errors=True)
        os.rename(partial, final)
        tmp = directory / f".{LATEST}.tmp"
        tmp.write_text(name + "\n")
        os.replace(tmp, directory / LATEST)
    dist.barrier(group=group)
    logger.info("[rank %d] saved %s", pipe.rank, final)
    return final


def _scheduler_state(path: Path, scheduler: LRScheduler | None) -> dict | None:
    """The saved state for ``scheduler`` (read before anything is loaded, so that a checkpoint
    without one fails with nothing half-loaded; applied once the rest has loaded)."""
    if scheduler is None:
        return None
    file = path / SCHEDULER
    if not file.is_file():
        raise FileNotFoundError(
            f"the checkpoint {path} holds no learning-rate scheduler state ({SCHEDULER}): it was "
            "saved without scheduler=...; load without scheduler=... or save with it"
        )
    return torch.load(file, weights_only=True)


def _dcp_load(state: dict, path: Path, group: dist.ProcessGroup | None, rank: int) -> None:
    """``torch.distributed.checkpoint.load`` of ``state`` from ``path``, after checking that every
    file the checkpoint's metadata names is there and long enough (so that a damaged checkpoint
    loads nothing on any rank). DCP's ``CheckpointException`` (a ``BaseException`` that names
    only the failing ranks) becomes a ``ValueError`` with each failing rank's error."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    metadata = dcp.FileSystemReader(path).read_metadata()
    need: dict[str, int] = {}
    for info in (metadata.storage_data or {}).values():
        need[info.relative_path] = max(need.get(info.relative_path, 0), info.offset + info.length)
    damaged = [
        f"{name} ({'missing' if not (path / name).is_file() else 'truncated'})"
        for name, size in sorted(need.items())
        if not (path / name).is_file() or (path / name).stat().st_size < size
    ]
    if damaged:
        raise FileNotFoundError(
            f"[rank {rank}] the checkpoint {path} is damaged: {', '.join(damaged)}; nothing was "
            "loaded (load an earlier checkpoint)"
        )
    try:
        dcp.load(state, checkpoint_id=path, process_group=group)
    except CheckpointException as e:
        details = "; ".join(f"rank {r}: {_describe(f)}" for r, f in sorted(e.failures.items()))
        raise ValueError(f"[rank {rank}] cannot load {path}: {details}") from None


def _describe(failure) -> str:
    exc = failure[0] if isinstance(failure, tuple) else failure
    text = f"{type(exc).__name__}: {exc}"
    return text if len(text) < 400 else text[:400] + " ..."


def _complete(directory: str | os.PathLike) -> Path | None:
    """The checkpoint :func:`latest_checkpoint` names, if it is complete."""
    path = latest_checkpoint(directory)
    return path if path is not None and (path / ".metadata").is_file() else None


def _resolve(directory: str | os.PathLike) -> Path:
    path = _complete(directory)
    if path is None:
        raise FileNotFoundError(
            f"no complete checkpoint in {directory}: neither a '{LATEST}' file naming one nor "
            "DCP's .metadata (save with pippy_xla's save())"
        )
    return path


def load(
    pipe: Checkpointable,
    directory: str | os.PathLike,
    optimizer: torch.optim.Optimizer | None = None,
    scheduler: LRScheduler | None = None,
    missing_ok: bool = False,
) -> int | None:
    """Loads the checkpoint that :func:`save` wrote (the latest in ``directory``) into this
    pipeline, ``optimizer`` and ``scheduler``, whatever rank count, mesh or schedule saved it; a
    collective (on a mesh: over every rank of the mesh). Restores each rank's RNG state when the
    rank count is the one saved. Returns the saved step.

    With ``missing_ok``, a ``directory`` that holds no complete checkpoint yet (a fresh run) loads
    nothing and returns ``None``. Every rank must see the same checkpoint: ranks that disagree
    (a folder that is not shared between the machines) raise on every rank. A peer's failure or
    death is a ``PipelineError`` naming it (see [Note: watched collectives])."""
    return collective(
        pipe,
        "checkpoint load",
        _load,
        pipe,
        directory,
        optimizer,
        scheduler,
        missing_ok,
        refusals=_REFUSALS,
    )


def _load(
    pipe: Checkpointable,
    directory: str | os.PathLike,
    optimizer: torch.optim.Optimizer | None,
    scheduler: LRScheduler | None,
    missing_ok: bool,
) -> int | None:
    import torch.distributed.checkpoint as dcp

    found = _complete(directory)
    seen: list = [None] * dist.get_world_size(pipe.checkpoint_group)
    dist.all_gather_object(seen, found is not None, group=pipe.checkpoint_group)
    if any(seen) and not all(seen):
        have = [r for r, s in enumerate(seen) if s]
        raise FileNotFoundError(
            f"[rank {pipe.rank}] a complete checkpoint in {directory} is visible to ranks {have} "
            f"of the {len(seen)} ranks that load it, not to the others; every rank must read the "
            "same checkpoint (a folder on a file system that every machine shares)"
        )
    if found is None and missing_ok:
        return None
    path = _resolve(directory)
    scheduler_state = _scheduler_state(path, scheduler)
    keys = dcp.FileSystemReader(path).read_metadata().state_dict_metadata
    state: dict = {"model": pipe.checkpoint_state()}
    view = None
    if optimizer is not None:
        view = _view(pipe)
        state["optim"] = _optimizer_state(view, optimizer)
    rng = _rng_key(pipe)
    if rng in keys:
        state[rng] = torch.get_rng_state()
    _dcp_load(state, path, pipe.checkpoint_group, pipe.rank)
    if optimizer is not None:
        _set_optimizer_state(view, optimizer, state["optim"])
    if scheduler_state is not None:
        scheduler.load_state_dict(scheduler_state)
    if rng in state:
        torch.set_rng_state(state[rng])
    meta = json.loads((path / META).read_text()) if (path / META).is_file() else {}
    logger.info("[rank %d] loaded %s", pipe.rank, path)
    return meta.get("step")


def load_into_module(
    module: nn.Module,
    directory: str | os.PathLike,
    optimizer: torch.optim.Optimizer | None = None,
    scheduler: LRScheduler | None = None,
) -> int | None:
    """Loads a checkpoint that :func:`save` wrote into a plain (not pipelined) model, its
    optimizer and its learning-rate scheduler, in one process or on every rank of a
    data-parallel job. Returns the saved step."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict

    path = _resolve(directory)
    scheduler_state = _scheduler_state(path, scheduler)
    state: dict = {"model": get_model_state_dict(module)}
    if optimizer is not None:
        state["optim"] = _optimizer_state(module, optimizer)
    rank = dist.get_rank() if dist.is_initialized() else 0
    _dcp_load(state, path, None, rank)
    set_model_state_dict(module, state["model"])
    if optimizer is not None:
        _set_optimizer_state(module, optimizer, state["optim"])
    if scheduler_state is not None:
        scheduler.load_state_dict(scheduler_state)
    meta = json.loads((path / META).read_text()) if (path / META).is_file() else {}
    return meta.get("step")
