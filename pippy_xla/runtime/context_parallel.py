"""Pipeline x context parallel: each stage's tokens shared over ``cp`` ranks, attention exact.

[Note: pipeline x context parallel]

A mesh ``("cp", "pp")`` (or ``("cp",)``: one stage) runs ``cp`` copies of the pipeline, each on a
share of every row's tokens; ``("dp", "cp", "pp")`` runs that for each replica of data
parallelism, on its rows. Every rank is given the same whole batch.

- Layout (head-tail, "zigzag"): a row's ``S`` tokens are cut in ``2 cp`` equal chunks and cp
  rank ``i`` holds chunks ``i`` and ``2 cp - 1 - i``, in that order, so that under a causal mask
  every rank attends over as many key/query pairs as any other. Every sequence input is taken
  to this share before the microbatches reach the stages: the boundaries between stages carry
  ``S / cp`` tokens per row. The labels are shifted on the whole row first (a share's last
  token's label is the first token of the next chunk), so each rank's loss is HF's causal-LM
  loss with ``shift_labels``, over the whole batch's count of label tokens: the cp ranks' losses
  add up to the one-process loss, and so do their gradients.
- Positions: the tokens' global positions (``position_ids`` are made a stage input; a batch
  without them gets ``0 .. S-1`` per row, what HF's decoders use when none are given), so the
  rotary tables each stage computes are those of its tokens.
- Masks: every rank holds the whole batch, so the whole sequence's padding mask and positions
  are known everywhere. The stages' mask leaves (:class:`~pippy_xla.split.hf.MaskLeaf`, HF's own
  mask factories) are called with the whole microbatch's ``attention_mask`` and
  ``position_ids`` and a length of ``S`` (a forward pre-hook on each leaf): the decoder layers
  get the mask of the whole sequence (causal, padding, sliding window, whatever HF builds for the
  layer), or ``None`` where sdpa runs ``is_causal``.
- Attention (Ulysses): the model's config names an attention function registered in HF's
  ``AttentionInterface`` (``pippy_xla_cp<n>_<impl>``, with HF's mask function of ``<impl>`` in
  ``AttentionMaskInterface``); the model's code is not modified. It exchanges query, key and
  value all-to-all over the cp ranks so that each holds every token of ``1/cp`` of the heads
  (query and key/value heads alike, so grouped-query attention keeps its grouping), puts the
  tokens in their natural order, calls the model's own implementation (``sdpa``, or the
  modeling module's ``eager_attention_forward``) with the whole sequence's mask, and sends the
  output back all-to-all. Its backward is the same two exchanges reversed (autograd through
  torch's functional ``all_to_all_single``, waited on at once); every cp rank of a stage runs
  the same schedule, so the collectives pair up microbatch by microbatch.
- Gradients: every weight is replicated over ``cp`` (the cp ranks start from cp rank 0's values,
  PEFT's adapters made after the build too); each rank's gradient is its tokens' share, and the
  shares are summed over ``cp`` once per step, after the engine's last backward (one all-reduce of
  the stage's gradients flattened). The step's own only: gradients from before it (an accumulation
  window's earlier steps, summed already) are set aside during the step and added back after the
  sum. With replicas, FSDP2 first reduces over ``dp`` as each stage completes (see
  [Note: pipeline x data parallel]); the cp sum then adds the reduced shards: both are sums.
- Outputs: ``run_eval``'s logits are every token's, in natural order, on each cp rank's last
  stage (each rank's share put in its place among zeros, summed over ``cp``); the loss is
  summed over ``cp`` with the step's token sums.
- Failures: the all-to-alls and the cp sum are the cp group's collectives, not watched ones (a
  cp peer that dies there fails the step at the process group's timeout); the pipelines of a
  ``(cp, pp)`` mesh fail fast each over its own pipeline group.
"""

from __future__ import annotations

import inspect
import itertools
import sys
from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import nn

from pippy_xla._native import _C
from pippy_xla.runtime._batch import replica_rows
from pippy_xla.runtime.data_parallel import MeshGroups, local_tensor
from pippy_xla.split.hf import MaskLeaf, text_vocab_size

__all__ = ["ContextParallel", "check_model", "check_options", "mesh_groups", "zigzag_index"]

_NAMES = itertools.count()
"""Numbers the attention functions registered by pipelines of this process."""

_SEQUENCE_INPUTS = ("input_ids", "attention_mask", "position_ids", "labels", "token_type_ids")
"""The batch inputs laid out ``[rows, tokens]`` that context parallelism splits by tokens."""


def zigzag_index(length: int, rank: int, size: int) -> torch.Tensor:
    """The token indices of a row of ``length`` that cp rank ``rank`` of ``size`` holds: chunks
    ``rank`` and ``2 size - 1 - rank`` of ``2 size`` (see [Note: pipeline x context
    parallel])."""
    chunk = length // (2 * size)
    first = torch.arange(rank * chunk, (rank + 1) * chunk)
    last = torch.arange((2 * size - 1 - rank) * chunk, (2 * size - rank) * chunk)
    return torch.cat([first, last])


def mesh_groups(mesh, config) -> tuple[dist.ProcessGroup, MeshGroups | None]:
    """The pipeline's group (this rank alone on a mesh ``(cp,)``) and, on a mesh ``(dp, cp,
    pp)``, the replicas' groups. The mesh is ``(cp, pp)``, ``(cp,)`` or ``(dp, cp, pp)``; other
    dims are refused."""
    names, cp, pp, dp = tuple(mesh.mesh_dim_names), config.cp_dim, config.pp_dim, config.dp_dim
    if names not in ((cp, pp), (cp,), (dp, cp, pp)):
        raise NotImplementedError(
            f"context parallelism runs on a mesh ({cp!r}, {pp!r}), ({cp!r},) or ({dp!r}, {cp!r}, "
            f"{pp!r}); the mesh's dims are {names} (cp beside tensor parallelism or HSDP is not "
            "supported yet)"
        )
    if mesh.size() != dist.get_world_size():
        raise ValueError(
            f"the mesh spans {mesh.size()} ranks but the job has {dist.get_world_size()}; "
            "PipelineModel needs a mesh over every rank of the job"
        )
    if pp in names:
        group = mesh.get_group(pp)
    else:
        group = dist.new_group([dist.get_rank()], use_local_synchronization=True)
    return group, MeshGroups(mesh, pp, dp) if dp in names else None


def check_options(config) -> None:
    """What context parallelism does not cover yet, refused in one line."""
    not_yet = {
        "tensor_parallel": config.tensor_parallel is not None,
        "expert_parallel": (config.expert_parallel or 1) > 1,
        "compile=True": config.compile,
        "loss_fn": config.loss_fn is not None,
    }
    for what, given in not_yet.items():
        if given:
            raise NotImplementedError(
                f"context parallelism with {what} is not supported yet (issue 72); the loss is "
                "the model's own causal-LM loss on labels shifted before the split"
            )


def check_model(model: nn.Module, layers: Sequence[nn.Module], cp: int) -> str:
    """The model's attention implementation, after checking that context parallelism fits it:
    every decoder layer attends through HF's attention interface and carries no state along
    the sequence (a convolution over it, as Mamba's and linear attention's layers have), and
    the query and key/value heads divide by ``cp``. Raises ``NotImplementedError`` /
    ``ValueError`` in one line otherwise."""
    from transformers import PretrainedConfig

    config = model.config.get_text_config() if hasattr(model, "config") else None
    if not isinstance(config, PretrainedConfig):
        raise NotImplementedError(
            f"context parallelism plugs into HF's attention interface; {type(model).__name__} "
            "is not an HF model"
        )
    for i, layer in enumerate(layers):
        kinds = {type(m).__name__ for m in layer.modules() if isinstance(m, nn.Conv1d)}
        attends = any(_uses_attention_interface(m) for m in layer.modules())
        if kinds or not attends:
            what = (
                f"a convolution along the sequence ({sorted(kinds)[0]})"
                if kinds
                else ("no attention module calling HF's attention interface")
            )
            raise NotImplementedError(
                f"context parallelism (cp={cp}) shards every layer's tokens, but decoder layer "
                f"{i} ({type(layer).__name__}) has {what}: its state runs along the sequence "
                "(Mamba, linear attention) and is not exchanged between the shares; not "
                "supported"
            )
    heads = getattr(config, "num_attention_heads", None)
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    if not heads or heads % cp or kv_heads % cp:
        raise ValueError(
            f"context parallelism (cp={cp}) exchanges attention heads all-to-all, but the model "
            f"has {heads} query and {kv_heads} key/value heads: both must divide by cp"
        )
    if "shift_labels" not in inspect.signature(model.loss_function).parameters:
        raise NotImplementedError(
            f"context parallelism shifts the labels on the whole row before the split, but "
            f"{type(model).__name__}'s loss takes no shift_labels (not a causal-LM loss)"
        )
    impl = config._attn_implementation or "eager"
    if impl not in ("sdpa", "eager"):
        raise NotImplementedError(
            f"context parallelism runs the model's own attention on the whole sequence; "
            f"attn_implementation={impl!r} is not supported yet, use 'sdpa' or 'eager'"
        )
    return impl


def _uses_attention_interface(module: nn.Module) -> bool:
    """Whether ``module``'s forward looks its attention up in HF's ``ALL_ATTENTION_FUNCTIONS``."""
    try:
        source = inspect.getsource(type(module).forward)
    except (OSError, TypeError):
        return False
    return "ALL_ATTENTION_FUNCTIONS" in source


class ContextParallel:
    """A stage's tokens shared over the mesh's ``cp`` dimension. See [Note: pipeline x context
    parallel]."""

    def __init__(self, mesh, cp_dim: str, timeout_ms: int, device: torch.device) -> None:
        self.mesh = mesh[cp_dim]
        self.group: dist.ProcessGroup = self.mesh.get_group()
        self.group_name: str = self.group.group_name
        self.rank: int = self.mesh.get_local_rank()
        self.size: int = self.mesh.size()
        self._timeout_ms = timeout_ms
        self._device = str(device)
        self._full: list[tuple[torch.Tensor | None, torch.Tensor]] = []
        """Per microbatch of the running step: its whole ``attention_mask`` and
        ``position_ids``, which the mask leaves read."""
        self.microbatch = 0
        """The microbatch whose forward runs now."""
        self._orders: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self._impl = "sdpa"
        self._model: nn.Module | None = None
        self.loss_fn = None
        """The model's own loss of one microbatch on this rank's shifted labels (set by
        :meth:`prepare`)."""

    # ----------------------------------------------------------------------------- build

    def prepare(self, model: nn.Module, layers: Sequence[nn.Module]) -> None:
        """Checks that the model fits (:func:`check_model`), before it is partitioned, and
        makes :attr:`loss_fn`."""
        self._impl = check_model(model, layers, self.size)
        self._model = model
        self.loss_fn = self.loss(model, text_vocab_size(model.config))

    def attach(self, stage_modules: Sequence[nn.Module]) -> None:
        """Registers this pipeline's attention function and its mask function, names it in every
        HF config of the model, and hooks the stages' mask leaves; after the partition (whose
        tracing runs the layers on ``meta`` tensors) and before the first step."""
        from transformers import AttentionInterface, PretrainedConfig
        from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface

        impl, model = self._impl, self._model
        name = f"pippy_xla_cp{next(_NAMES)}_{impl}"
        AttentionInterface.register(name, self._attention_function(impl))
        AttentionMaskInterface.register(name, ALL_MASK_ATTENTION_FUNCTIONS[impl])
        for config in {id(c): c for c in _configs(model, PretrainedConfig)}.values():
            config._attn_implementation = name
        self.copy_from_first_rank(
            [t for m in stage_modules for t in [*m.named_parameters(), *m.named_buffers()]]
        )
        leaves = {id(m): m for s in stage_modules for m in s.modules() if isinstance(m, MaskLeaf)}
        for leaf in leaves.values():
            leaf.register_forward_pre_hook(self._whole_sequence_mask, with_kwargs=True)

    @staticmethod
    def loss(model: nn.Module, vocab_size: int):
        """The model's own causal-LM loss of one microbatch, given this rank's labels already
        shifted on the whole row (``shift_labels``)."""
        loss_function = model.loss_function

        def loss_fn(logits: torch.Tensor, shifted: torch.Tensor, num_items: torch.Tensor):
            return loss_function(
                logits=logits,
                labels=None,
                vocab_size=vocab_size,
                num_items_in_batch=num_items,
                shift_labels=shifted,
            )

        return loss_fn

    def copy_from_first_rank(self, named: Sequence[tuple[str, torch.Tensor]]) -> None:
        """The cp ranks start from cp rank 0's values of ``named`` (the stages' weights and
        buffers at build, as the replicas of data parallelism do; PEFT's new adapters made
        after it), so a model initialized differently per rank trains as one; a broadcast
        each, in the order given (the same on every cp rank: they hold the same stages)."""
        with torch.no_grad():
            for name, t in named:
                what = f"context-parallel start: broadcast of {name}"
                t = local_tensor(t.detach())  # a data-parallel shard: this rank's part
                t.copy_(_C.broadcast_copy(t, 0, self.group_name, self._timeout_ms, what))

    def _attention_function(self, impl: str):
        def attention(module, query, key, value, attention_mask, **kwargs):
            inner = _implementation(module, impl)
            length = query.shape[2] * self.size
            to_natural, to_shares = self._order(length, query.device)
            q, k, v = (self._heads_to_tokens(t, to_natural) for t in (query, key, value))
            kwargs.pop("position_ids", None)  # this rank's; the mask holds the whole row's
            _refuse_tensor_arguments(module, kwargs)
            out, _ = inner(module, q, k, v, attention_mask, **kwargs)
            return self._tokens_to_heads(out, to_shares), None

        return attention

    # ----------------------------------------------------------------------------- layout

    def _order(self, length: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """Token indices: the whole row in natural order from the cp ranks' shares concatenated
        in rank order, and back."""
        if length not in self._orders:
            shares = torch.cat([zigzag_index(length, r, self.size) for r in range(self.size)])
            self._orders[length] = (torch.argsort(shares), shares)
        return tuple(t.to(device) for t in self._orders[length])

    def _exchange(self, t: torch.Tensor) -> torch.Tensor:
        """All-to-all over dim 0 (``cp`` equal blocks), differentiable."""
        from torch.distributed._functional_collectives import all_to_all_single, wait_tensor

        return wait_tensor(all_to_all_single(t.contiguous(), None, None, self.group))

    def _heads_to_tokens(self, t: torch.Tensor, to_natural: torch.Tensor) -> torch.Tensor:
        """``[b, heads, S/cp, d]`` (this rank's tokens, every head) -> ``[b, heads/cp, S, d]``
        (every token in natural order, this rank's heads)."""
        b, h, s, d = t.shape
        sent = t.reshape(b, self.size, h // self.size, s, d).transpose(0, 1)
        got = self._exchange(sent)  # [cp (the sender's tokens), b, h/cp, s, d]
        whole = got.permute(1, 2, 0, 3, 4).reshape(b, h // self.size, self.size * s, d)
        return whole.index_select(2, to_natural)

    def _tokens_to_heads(self, t: torch.Tensor, to_shares: torch.Tensor) -> torch.Tensor:
        """The attention output ``[b, S, heads/cp, d]`` -> ``[b, S/cp, heads, d]``."""
        b, length, h, d = t.shape
        s = length // self.size
        sent = t.index_select(1, to_shares).reshape(b, self.size, s, h, d).transpose(0, 1)
        got = self._exchange(sent)  # [cp (the sender's heads), b, s, h, d]
        return got.permute(1, 2, 0, 3, 4).reshape(b, s, self.size * h, d)

    def _whole_sequence_mask(self, leaf: nn.Module, args: tuple, kwargs: dict):
        """A mask leaf's inputs made the whole microbatch's (see [Note: pipeline x context
        parallel])."""
        mask, positions = self._full[self.microbatch]
        embeds = kwargs.get("inputs_embeds")
        if embeds is not None:  # read for its shape, dtype and device only
            b, _, *rest = embeds.shape
            kwargs["inputs_embeds"] = embeds[:, :1].expand(b, positions.shape[-1], *rest)
        if mask is not None and isinstance(kwargs.get("attention_mask"), torch.Tensor):
            kwargs["attention_mask"] = mask.to(kwargs["attention_mask"].device)
        if kwargs.get("position_ids") is not None:
            kwargs["position_ids"] = positions.to(kwargs["position_ids"].device)
        return args, kwargs

    # ----------------------------------------------------------------------------- steps

    def complete(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The batch with ``position_ids`` (``0 .. S-1`` per row where it has none), checked:
        every input ``[rows, tokens]`` with tokens a multiple of ``2 cp``, the attention mask
        2-D. The same on every rank: every rank raises the same error."""
        first = batch.get("input_ids")
        if first is None or first.dim() != 2:
            raise ValueError("context parallelism needs input_ids of shape [rows, tokens]")
        rows, length = first.shape
        if length % (2 * self.size):
            raise ValueError(
                f"context parallelism (cp={self.size}) cuts each row in 2 x cp = "
                f"{2 * self.size} equal chunks, but the batch's rows have {length} tokens; pad "
                f"them to a multiple of {2 * self.size}"
            )
        batch = dict(batch)
        if batch.get("position_ids") is None:
            batch["position_ids"] = torch.arange(length).expand(rows, length)
        for k, v in batch.items():
            if v is not None and (k not in _SEQUENCE_INPUTS or tuple(v.shape) != (rows, length)):
                raise ValueError(
                    f"context parallelism splits every input by tokens, but batch['{k}'] has "
                    f"shape {tuple(v.shape)}; the inputs must be {list(_SEQUENCE_INPUTS)} of "
                    f"shape [rows, tokens] = {[rows, length]} (a 2-D attention mask)"
                )
        return batch

    def shard(self, microbatches: dict, batch: dict, dp_rank: int, dp_size: int) -> None:
        """This rank's tokens of every microbatch of its replica's rows (in place), the labels
        shifted on the whole row first; the whole masks and positions kept for the mask
        leaves."""
        m = len(next(iter(microbatches.values())))
        rows = replica_rows(len(batch["position_ids"]), dp_rank, dp_size)
        masks = batch.get("attention_mask")
        masks = masks[rows].chunk(m) if masks is not None else [None] * m
        self._full = list(zip(masks, batch["position_ids"][rows].chunk(m), strict=True))
        for k, parts in microbatches.items():
            if k == "labels":
                parts = tuple(_shift(p) for p in parts)
            index = zigzag_index(parts[0].shape[1], self.rank, self.size).to(parts[0].device)
            microbatches[k] = tuple(p.index_select(1, index) for p in parts)

    def whole_tokens(self, t: torch.Tensor, what: str) -> torch.Tensor:
        """``t`` of this rank's tokens, ``[rows, S / cp, ...]`` (its head-tail share), made
        ``[rows, S, ...]``: every token in natural order, on every cp rank (a collective: each
        rank's tokens put in their places among zeros, summed over cp, exactly)."""
        rows, share, *rest = t.shape
        length = share * self.size
        whole = t.new_zeros(rows, length, *rest)
        whole.index_copy_(1, zigzag_index(length, self.rank, self.size).to(t.device), t)
        return self.all_reduce_sum(whole, what)

    @staticmethod
    def set_aside_grads(params: Sequence[nn.Parameter]) -> list[torch.Tensor | None]:
        """The parameters' gradients from before the step (an accumulation window's earlier
        steps', summed over cp already), taken off them: :meth:`reduce_grads` sums the step's
        own alone, then adds them back."""
        earlier = [p.grad for p in params]
        for p in params:
            p.grad = None
        return earlier

    def reduce_grads(
        self, params: Sequence[nn.Parameter], earlier: Sequence[torch.Tensor | None]
    ) -> None:
        """Sums the step's gradients of ``params`` (each listed once) over the cp ranks (one
        all-reduce, flattened), then adds back the ``earlier`` ones
        (:meth:`set_aside_grads`)."""
        grads = [local_tensor(p.grad) for p in params if p.grad is not None]
        if grads:
            flat = torch.cat([g.reshape(-1) for g in grads])
            total = self.all_reduce_sum(flat, "context-parallel gradient sum")
            for g, part in zip(grads, total.split([g.numel() for g in grads]), strict=True):
                g.copy_(part.view_as(g))
        with torch.no_grad():
            for p, before in zip(params, earlier, strict=True):
                if before is not None:
                    p.grad = before if p.grad is None else before.add_(p.grad)

    def all_reduce_sum(self, tensor: torch.Tensor, what: str) -> torch.Tensor:
        return _C.all_reduce_sum_copy(tensor, self.group_name, self._timeout_ms, what)

    def agree(self, key: int, what: str) -> bool:
        """Whether every cp rank passed the same 64-bit ``key``."""
        keys = _C.all_gather_int64([key], self.group_name, self._device, self._timeout_ms, what)
        return all(k == [key] for k in keys)


def _refuse_tensor_arguments(module: nn.Module, kwargs: dict) -> None:
    """A tensor the attention module hands its attention function besides query, key, value and
    mask (a value per head, such as attention sinks, or per token) would need its own share of
    the heads or the tokens: refused, naming it."""
    tensors = sorted(k for k, v in kwargs.items() if isinstance(v, torch.Tensor))
    if tensors:
        raise NotImplementedError(
            f"context parallelism: {type(module).__name__} passes {tensors} to its attention "
            "function, a tensor per head or per token that the all-to-all over heads does not "
            "split yet (issue 72)"
        )


def _shift(labels: torch.Tensor) -> torch.Tensor:
    """Causal-LM labels shifted left by one on the whole row (HF's shift, done before the
    split): position ``t`` is labeled by token ``t + 1``, the last by -100."""
    return torch.cat([labels[:, 1:], labels.new_full((labels.shape[0], 1), -100)], dim=1)


def _implementation(module: nn.Module, impl: str):
    """The model's own attention function ``impl``: HF's registered one, or for ``"eager"`` the
    ``eager_attention_forward`` of the module's modeling file."""
    if impl != "eager":
        from transformers import AttentionInterface

        return AttentionInterface._global_mapping[impl]
    eager = getattr(sys.modules[type(module).__module__], "eager_attention_forward", None)
    if eager is None:
        raise NotImplementedError(
            f"context parallelism with attn_implementation='eager': {type(module).__name__}'s "
            "modeling module has no eager_attention_forward; use 'sdpa'"
        )
    return eager


def _configs(model: nn.Module, config_type: type) -> list:
    """Every HF config the model's modules hold."""
    found = []
    for m in model.modules():
        c = getattr(m, "config", None)
        if isinstance(c, config_type):
            found.append(c)
    return found
