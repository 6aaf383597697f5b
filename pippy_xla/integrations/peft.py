"""PEFT adapters in and out of a pipeline, through PEFT's own machinery.

[Note: PEFT models in the pipeline] A ``PeftModel`` wraps the HF model (its tensors sit under
``base_model.model.``), and PEFT's tuner layers wrap the modules they adapt: the wrapped module's
own tensors move under ``.base_layer.`` (``.original_module.`` for ``modules_to_save``), and every
tensor an adapter adds sits under the adapter's name (``lora_A.default.weight``,
``lora_magnitude_vector.default.weight``, ``ia3_l.default``, ``hada_w1_a.default``,
``modules_to_save.default.weight``), for every PEFT method alike. The pipeline traces and trains
the ``PeftModel`` as any model: PEFT's layers run inside the decoder layers, and frozen tensors
get no gradient (the optimizer of ``pipe.parameters()`` keeps no state for them). What differs
is the checkpoints, and they go through PEFT:

- ``save_pretrained(path)``: PEFT's own ``get_peft_model_state_dict`` picks each rank's tensors
  to save (adapter tensors, trainable biases with ``bias="all"``, the base embedding where PEFT
  saves it); they are gathered on the pipeline's first rank, which calls the ``PeftModel``'s own
  ``save_pretrained(path, state_dict=...)``: PEFT renames them and writes
  ``adapter_config.json`` and ``adapter_model.safetensors`` (a subdirectory per other named
  adapter), as one process does. Nothing else of the frozen base is gathered or written.
- ``save_pretrained(path, merge_adapters=True)``: each rank merges a copy of each of its tuner
  layers (PEFT's ``merge``: LoRA, DoRA, IA3, LoHa, ... each by its own rule) and writes the
  base model's tensors under the base model's names in HF's layout, as ``merge_and_unload()``
  then ``save_pretrained`` would; the pipeline's own layers stay unmerged.
- ``load_pretrained(base_path)``: a base checkpoint's key names the tensor whose name loses the
  ``PeftModel``'s prefix and the ``.base_layer`` / ``.original_module`` parts; adapter tensors
  are in no base checkpoint and keep their values.
- ``load_adapter(path)``: PEFT reads the adapter file (``load_peft_weights``) and loads it into
  the ``PeftModel`` (``set_peft_model_state_dict``): each rank's own stages take their values,
  the other stages' tensors are on ``meta`` (a copy does nothing) or unused on this rank.
- A base built on ``meta``: new adapters are initialized by PEFT after the build
  (:meth:`PeftAdapters.init_fresh`), each rank from its own random state: the data-parallel
  replicas take the first one's (sharded or not), the cp ranks cp rank 0's; an adapter
  ``PeftModel.from_pretrained`` meant to load is refused (:meth:`PeftAdapters.fresh_adapters`).
"""

from __future__ import annotations

import copy
import os
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from pippy_xla import checkpoint
from pippy_xla.runtime.data_parallel import assign

__all__ = ["PeftAdapters", "is_peft_model"]

_BASE_PARTS = ("base_layer", "original_module")
"""Path parts under which PEFT keeps a wrapped module's own tensors."""


def is_peft_model(model: nn.Module) -> bool:
    """Whether ``model`` is a ``peft.PeftModel`` (without importing PEFT where it is not)."""
    return any(
        c.__name__ == "PeftModel" and c.__module__.startswith("peft.") for c in type(model).__mro__
    )


class PeftAdapters:
    """The checkpoints of a pipeline built from a ``PeftModel`` (see [Note: PEFT models in the
    pipeline])."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.adapter_names = set(model.peft_config)
        self.prefix = "base_model.model."
        self._by_base: dict[str, str] | None = None  # see model_name
        bad = [n for n, c in model.peft_config.items() if getattr(c, "is_prompt_learning", False)]
        if bad:
            kind = type(model.peft_config[bad[0]]).__name__
            raise ValueError(
                f"PEFT adapter(s) {bad} are prompt-learning methods ({kind}), which add virtual "
                "tokens before the decoder layers; the pipeline supports "
                "methods that adapt modules (LoRA, DoRA, IA3, LoHa, LoKr, ...)"
            )

    def inner_model(self) -> nn.Module:
        """The HF model inside the ``PeftModel``, PEFT's tuner layers in it: what
        ``PeftModelForCausalLM.generate`` runs, and what the pipeline's ``generate`` traces."""
        return self.model.get_base_model()

    def check_options(self, config) -> None:
        """Refuses, in one line: a model built to train (an adapter not in inference mode) of
        which nothing trains (its adapters frozen by hand, or ``target_modules`` matching only
        frozen copies); and what the pipeline does not do with PEFT yet: tensor parallelism (HF's
        plan shards the modules PEFT wraps, whose tuner layers are not ``nn.Linear``). A model in
        inference mode (``PeftModel.from_pretrained``) builds: it evaluates and generates."""
        training = [n for n, c in self.model.peft_config.items() if not c.inference_mode]
        if training and not any(p.requires_grad for p in self.model.parameters()):
            raise ValueError(
                f"the PEFT model's adapter {training[0]!r} is in training mode but no parameter "
                "requires grad, so nothing would train; set requires_grad on the adapters "
                "(peft_model.set_requires_grad) or load it with "
                "PeftModel.from_pretrained(..., is_trainable=False) to evaluate"
            )
        if config.tensor_parallel is None:
            return
        from peft.tuners.tuners_utils import BaseTunerLayer

        from pippy_xla.runtime.tensor_parallel import expand_plan

        inner = self.inner_model()
        plan = expand_plan(inner, dict(getattr(inner, "tp_plan", None) or {}))
        wrapped = [n for n, m in inner.named_modules() if isinstance(m, BaseTunerLayer)]
        sharded = [(n, plan[n]) for n in wrapped if n in plan]
        where = f"{sharded[0][0]} (HF's plan: {sharded[0][1]!r})" if sharded else wrapped[0]
        raise NotImplementedError(
            f"tensor_parallel={config.tensor_parallel!r} with PEFT adapters is not supported yet: "
            f"PEFT wraps {where}, and the pipeline shards HF's own layers only; use a mesh "
            "without a 'tp' dim (data and pipeline parallel train PEFT models)"
        )

    # ------------------------------------------------------------------------------ meta

    def fresh_adapters(self, model: nn.Module) -> set[str]:
        """The names of the adapter tensors that are on ``meta`` (a ``PeftModel`` of a meta-built
        base), checked before the build. An adapter in inference mode on ``meta`` is refused:
        ``PeftModel.from_pretrained`` (which sets it) loads nothing into a meta-built base's
        adapters, even with ``low_cpu_mem_usage=True`` (PEFT 0.21), and initializing them anew
        would silently drop the saved adapter."""
        fresh = {
            n
            for n, t in model.state_dict(keep_vars=True).items()
            if t.is_meta and self.base_name(n) is None
        }
        for name in sorted({a for n in fresh for a in n.split(".") if a in self.adapter_names}):
            config = self.model.peft_config[name]
            if config.inference_mode:
                raise ValueError(
                    f"the PEFT adapter {name!r} is on the meta device (PeftModel.from_pretrained "
                    "on a meta-built base loads nothing into it); wrap the base with "
                    "get_peft_model(base, config) (config.inference_mode=False) and call "
                    "pipe.load_adapter(path) after building"
                )
            init = getattr(config, "init_lora_weights", True)
            if isinstance(init, str) and init not in ("gaussian",) or config.modules_to_save:
                what = f"init_lora_weights={init!r}" if isinstance(init, str) else "modules_to_save"
                raise ValueError(
                    f"the PEFT adapter {name!r} is on the meta device with {what}, which "
                    "starts from the base's pretrained weights; build the base on a real device, "
                    "or load a saved adapter (pipe.load_adapter(path))"
                )
        return fresh

    def init_fresh(self, pipe, fresh: set[str]) -> None:
        """Initializes this rank's adapter tensors that were on ``meta`` (``fresh``) as PEFT
        initializes a new adapter: PEFT adds the adapter to a copy of each tuner layer's base
        module (``inject_adapter_in_model``), whose new tensors are copied in (the data-parallel
        replicas' from the first replica's: each rank drew its own)."""
        from peft import inject_adapter_in_model
        from peft.tuners.tuners_utils import BaseTunerLayer

        names = {id(t): n for n, t in pipe.state_dict(keep_vars=True).items()}
        for stage in pipe.local_stages:
            for module in stage.module.modules():
                if not isinstance(module, BaseTunerLayer):
                    continue
                for adapter in sorted(self.adapter_names):
                    own = {
                        n: t
                        for n, t in module.state_dict(keep_vars=True).items()
                        if adapter in n.split(".") and names.get(id(t)) in fresh
                    }
                    if own:
                        self._init_from_peft(module, adapter, own, inject_adapter_in_model)

    def _init_from_peft(self, module, adapter: str, own: dict, inject) -> None:
        config = copy.deepcopy(self.model.peft_config[adapter])
        config.target_modules = {"target"}
        for field in ("layers_to_transform", "layers_pattern"):
            if hasattr(config, field):
                setattr(config, field, None)
        if hasattr(config, "feedforward_modules"):
            config.feedforward_modules = {"target"} if module.is_feedforward else set()
        for field, per_adapter in (("r", "r"), ("lora_alpha", "lora_alpha")):
            value = getattr(module, per_adapter, None)
            if isinstance(value, dict) and adapter in value and hasattr(config, field):
                setattr(config, field, value[adapter])  # rank_pattern / alpha_pattern resolved
        for field in ("rank_pattern", "alpha_pattern"):
            if hasattr(config, field):
                setattr(config, field, {})
        holder = nn.Module()
        holder.target = copy.deepcopy(module.get_base_layer())
        inject(config, holder, adapter_name=adapter)
        made = holder.target.state_dict()
        with torch.no_grad():
            for n, t in own.items():
                if n not in made or made[n].shape != t.shape:
                    raise ValueError(
                        f"PEFT's new adapter {adapter!r} has no tensor {n} of shape "
                        f"{tuple(t.shape)} here; build the base on a real device instead"
                    )
                assign(t, made[n], from_first=True)  # the replicas' draws: the first's

    def base_name(self, name: str) -> str | None:
        """The base model's name of the pipeline's tensor ``name``, or ``None`` for an adapter's
        tensor (which no base checkpoint holds)."""
        parts = name.removeprefix(self.prefix).split(".")
        if any(p in self.adapter_names for p in parts):
            return None
        return ".".join(p for p in parts if p not in _BASE_PARTS)

    def model_name(self, key: str, names: Callable[[], set[str]]) -> str:
        """The pipeline's name of the base checkpoint's key ``key`` (``names()``: every name of
        the pipeline's tensors, asked for once: the table is made at the first call)."""
        if self._by_base is None:
            bases = ((self.base_name(n), n) for n in sorted(names()))
            self._by_base = {base: n for base, n in bases if base is not None}
        return self._by_base.get(key, key)

    # ------------------------------------------------------------------------------ saving

    def save(self, pipe, path: str | os.PathLike, max_shard_size, merge_adapters: bool) -> None:
        if merge_adapters:
            checkpoint.collective(
                pipe, "save_pretrained", self._save_merged, pipe, path, max_shard_size
            )
        else:
            checkpoint.collective(pipe, "save_pretrained", self._save_adapters, pipe, path)

    def _adapter_state(self, pipe) -> dict[str, torch.Tensor]:
        """This rank's tensors that PEFT saves (whole), under the pipeline's names: PEFT's own
        ``get_peft_model_state_dict`` picks them from the local state dict (adapter tensors,
        trainable biases, the base embedding where the adapter resized it, ...), and its picks
        are the local tensors themselves, found by identity."""
        from peft.utils import get_peft_model_state_dict

        whole = checkpoint.whole_state(pipe)
        by_id = {id(t): n for n, t in whole.items()}
        # PEFT reads the keys of every module it saves whole (modules_to_save) from the state
        # dict: the other stages' are stand-ins on meta, never picked from here.
        everything = {n: torch.empty(0, device="meta") for n in pipe.all_state_names()}
        everything.update(whole)
        picked: set[str] = set()
        for adapter in sorted(self.adapter_names):
            chosen = get_peft_model_state_dict(
                self.model, state_dict=everything, adapter_name=adapter
            )
            picked |= {by_id[id(t)] for t in chosen.values() if id(t) in by_id}
        return {n: whole[n].detach().cpu() for n in sorted(picked)}

    def _save_adapters(self, pipe, path: str | os.PathLike) -> None:
        mine = self._adapter_state(pipe)
        if not checkpoint.writes_whole(pipe):
            dist.barrier(group=pipe.checkpoint_group)
            return
        everyone: list = [None] * pipe.num_ranks
        dist.all_gather_object(everyone, mine, group=pipe.group)
        if pipe.rank == 0:
            state = {k: v for part in everyone for k, v in part.items()}
            self.model.save_pretrained(str(path), state_dict=state)
        dist.barrier(group=pipe.checkpoint_group)

    def _save_merged(self, pipe, path: str | os.PathLike, max_shard_size) -> None:
        local = dict(checkpoint.whole_state(pipe))
        for name, tensor in self._merged_local(pipe).items():
            local[name] = tensor
        local = {n: t for n, t in local.items() if self.base_name(n) is not None}
        checkpoint.save_hf_layout(pipe, path, max_shard_size, local, rename=self.base_name)

    def _merged_local(self, pipe) -> dict[str, torch.Tensor]:
        """The merged value of every local tuner layer's own tensors, whole, under the pipeline's
        names: PEFT's ``merge`` of a copy of each layer (the pipeline's layers stay as they are).
        A collective over the mesh's groups where tensors are sharded."""
        from peft.tuners.tuners_utils import BaseTunerLayer
        from torch.distributed.tensor import DTensor

        names = {id(t): n for n, t in pipe.state_dict(keep_vars=True).items()}
        merged: dict[str, torch.Tensor] = {}
        for stage in pipe.local_stages:
            for module in stage.module.modules():
                if not isinstance(module, BaseTunerLayer):
                    continue
                own = dict(module.get_base_layer().named_parameters(recurse=False))
                # The twin's tensors are whole: on a mesh, sharded ones are gathered (every
                # replica holds the same layers and meets them in the same order).
                whole = {
                    id(t): nn.Parameter(
                        t.full_tensor() if isinstance(t, DTensor) else t.detach().clone(),
                        requires_grad=False,
                    )
                    for t in module.parameters()
                }
                twin = copy.deepcopy(module, memo=whole)
                with torch.no_grad():
                    twin.merge(safe_merge=False)
                twin_base = twin.get_base_layer()
                for attr, t in own.items():
                    merged[names[id(t)]] = getattr(twin_base, attr).detach()
        return merged

    # ------------------------------------------------------------------------------ loading

    def load_adapter(self, pipe, path: str | os.PathLike, adapter_name: str) -> None:
        checkpoint.collective(
            pipe,
            "load_adapter",
            self._load_adapter,
            pipe,
            path,
            adapter_name,
            refusals=(KeyError, ValueError, OSError),
        )

    def _load_adapter(self, pipe, path: str | os.PathLike, adapter_name: str) -> None:
        from peft import PeftConfig
        from peft.utils import load_peft_weights, set_peft_model_state_dict

        if adapter_name not in self.model.peft_config:
            raise KeyError(
                f"the pipeline's model has no adapter {adapter_name!r} (it has "
                f"{sorted(self.model.peft_config)}); add it to the PeftModel before wrapping it"
            )
        saved = PeftConfig.from_pretrained(str(path))
        ours = self.model.peft_config[adapter_name]
        if _comparable(saved) != _comparable(ours):
            raise ValueError(
                f"the adapter at {path} was saved with {_comparable(saved)}, the pipeline's "
                f"adapter {adapter_name!r} has {_comparable(ours)}; build the PeftModel with "
                "that adapter's config (PeftModel.from_pretrained(base, path))"
            )
        weights = load_peft_weights(str(path), device="cpu")
        with torch.no_grad():  # other stages' tensors: on meta (a copy does nothing) or unused here
            result = set_peft_model_state_dict(self.model, weights, adapter_name=adapter_name)
        local = set(pipe.state_dict(keep_vars=True))
        missing = sorted(
            n
            for n in result.missing_keys
            if n in local and self.base_name(n) is None and adapter_name in n.split(".")
        )
        if result.unexpected_keys or missing:
            shown = (result.unexpected_keys or missing)[:4]
            raise KeyError(
                f"[rank {pipe.rank}] the adapter at {path} does not fit the pipeline's adapter "
                f"{adapter_name!r}: {'unexpected' if result.unexpected_keys else 'missing'} "
                f"tensor(s) {shown}; is it an adapter of this model?"
            )


def _comparable(config: Any) -> dict:
    """The fields of a PEFT config that decide the adapter's tensors."""
    keep = ("peft_type", "r", "target_modules", "use_dora", "modules_to_save", "bias")
    out = {}
    for k in keep:
        v = getattr(config, k, None)
        out[k] = sorted(v) if isinstance(v, set | list) else (str(v) if v is not None else None)
    return out
