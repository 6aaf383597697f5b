"""A pipeline rank's parameters and state dicts, under the original model's names.

The local stages' graph modules hold the model's own tensors under their own qualified names;
:class:`StageState` maps them back (``StageGraph.param_names``), so optimizers, state dicts and
checkpoints see the names of the unwrapped model, and a tied weight under every one of its names.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence

import torch
from torch import nn

from pippy_xla.runtime.data_parallel import assign
from pippy_xla.split.partition import StageGraph

__all__ = ["StageState", "named_parameters", "params_named"]


def named_parameters(local_stages: Sequence[StageGraph]) -> Iterator[tuple[str, nn.Parameter]]:
    """The local stages' parameters under the original model's names (each once)."""
    seen = set()
    for st in local_stages:
        for stage_name, p in st.module.named_parameters(remove_duplicate=False):
            if id(p) not in seen:
                seen.add(id(p))
                yield st.param_names[stage_name], p


def params_named(local_stages: Sequence[StageGraph], names: Sequence[str]) -> list[nn.Parameter]:
    wanted = set(names)
    return [p for name, p in named_parameters(local_stages) if name in wanted]


class StageState:
    """The parameters and persistent buffers of one rank's stages.

    Args:
        stages: every stage of the pipeline (to know the whole model's names).
        local_stages: this rank's stages.
        aliases: every name of a tied tensor -> all its names, in model order.
        rank: this rank, for error messages.
    """

    def __init__(
        self,
        stages: Sequence[StageGraph],
        local_stages: Sequence[StageGraph],
        aliases: Mapping[str, list[str]],
        rank: int,
    ) -> None:
        self._stages = list(stages)
        self._local = list(local_stages)
        self._aliases = dict(aliases)
        self._rank = rank

    def named_parameters(self) -> Iterator[tuple[str, nn.Parameter]]:
        """The local stages' parameters under the original model's names (each once)."""
        return named_parameters(self._local)

    def state_dict(self, keep_vars: bool = False) -> dict[str, torch.Tensor]:
        """The local stages' parameters and persistent buffers under the original names (a tied
        weight under each local name)."""
        return {
            st.param_names[k]: v
            for st in self._local
            for k, v in st.module.state_dict(keep_vars=keep_vars).items()
        }

    def aliases(self, name: str) -> list[str]:
        """Every name of the model's tensor ``name`` (several for tied weights), in model order:
        the first is the name HF checkpoints and plain models store it under."""
        return self._aliases.get(name, [name])

    def all_state_names(self) -> set[str]:
        """The state-dict keys of the whole model (every stage, every name of a tied weight)."""
        names = {st.param_names[k] for st in self._stages for k in st.module.state_dict()}
        return names | {a for n in list(names) for a in self.aliases(n)}

    def non_persistent_names(self) -> set[str]:
        """Buffers of the model that state dicts leave out (such as rotary ``inv_freq``)."""
        every = {n for st in self._stages for n in st.param_names.values()}
        return every - self.all_state_names()

    def load_state_dict(self, state_dict: Mapping[str, torch.Tensor], strict: bool = True) -> None:
        """Loads the local stages' entries of a full model's state dict; other stages' keys are
        ignored. A missing or mis-shaped key of a local stage is an error naming it; with
        ``strict``, so is a key that belongs to no stage of the model."""
        if strict:
            known = self.all_state_names() | self.non_persistent_names()
            unknown = sorted(k for k in state_dict if k not in known)
            if unknown:
                raise KeyError(f"state_dict keys belong to no stage of this model: {unknown[:8]}")
        with torch.no_grad():
            for name, target in self.state_dict(keep_vars=True).items():
                source = next((state_dict[a] for a in self.aliases(name) if a in state_dict), None)
                if source is None:
                    raise KeyError(f"[rank {self._rank}] state_dict has no key '{name}'")
                if tuple(source.shape) != tuple(target.shape):
                    raise ValueError(
                        f"[rank {self._rank}] state_dict['{name}'] has shape "
                        f"{tuple(source.shape)}, the model expects {tuple(target.shape)}"
                    )
                assign(target, source)
