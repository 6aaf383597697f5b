"""Python side of the ``pippy_xla`` point-to-point ops: typed wrappers and fake kernels.

The schemas and kernels live in ``csrc/transport/p2p.cpp``; the engine uses the same C++ transfer
code (see [Note: one send/recv implementation] there). Two families:

- asynchronous: ``send`` / ``recv`` post a transfer and return a token (a 0-d int64 tensor, see
  [Note: p2p tokens]); ``wait_send`` / ``wait_recv`` complete it. Each op takes the previous
  op's token as ``dep``, so the order of communication is data flow that no pass can reorder.
- blocking and differentiable: ``send_wait(x)`` returns a 0-d float "sink" whose backward
  receives ``x``'s gradient from the destination; ``recv_wait(anchor)`` returns the received
  tensor, and its backward sends the gradient back to the source. Pass a tensor that requires
  grad as ``anchor`` to make the received tensor part of the autograd graph; the sink of a
  ``send_wait`` serves as the next op's anchor to order them.

All ops are marked side-effecting, so that dead-code elimination never drops them, and have fake
kernels, so that ``torch.compile(fullgraph=True)``, ``make_fx`` and ``torch.export`` capture them.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch.fx.node import has_side_effect

from pippy_xla._native import _C  # registers the ops

__all__ = [
    "group_name_of",
    "recv",
    "recv_wait",
    "send",
    "send_wait",
    "wait_recv",
    "wait_send",
]

_ops = torch.ops.pippy_xla


def _token() -> torch.Tensor:
    return torch.empty((), dtype=torch.long)


def _send_fake(x, dep, peer, tag, group_name):
    return _token()


def _recv_fake(dep, shape, dtype, device, peer, tag, group_name):
    return _token()


def _wait_send_fake(token, timeout_ms):
    return _token()


def _wait_recv_fake(token, shape, dtype, device, timeout_ms):
    return torch.empty(shape, dtype=dtype, device=device)


def _send_wait_fake(x, peer, tag, group_name, timeout_ms):
    return x.new_empty((), dtype=torch.float32)


def _recv_wait_fake(anchor, shape, dtype, device, peer, tag, group_name, timeout_ms):
    return torch.empty(shape, dtype=dtype, device=device)


def _send_wait_setup(ctx, inputs, output):
    x, ctx.peer, ctx.tag, ctx.group_name, ctx.timeout_ms = inputs
    ctx.shape, ctx.dtype, ctx.device = list(x.shape), x.dtype, x.device


def _send_wait_backward(ctx, grad_sink):
    # The gradient of a send is a receive from the destination (same tag, other direction).
    # The incoming gradient is its anchor, so that no partitioner can hoist the receive into the
    # forward graph (it would block forward on the peer's backward).
    grad = _ops.recv_wait(
        grad_sink,
        ctx.shape,
        ctx.dtype,
        ctx.device,
        ctx.peer,
        ctx.tag,
        ctx.group_name,
        ctx.timeout_ms,
    )
    return grad, None, None, None, None


def _recv_wait_setup(ctx, inputs, output):
    anchor, _, _, _, ctx.peer, ctx.tag, ctx.group_name, ctx.timeout_ms = inputs
    ctx.anchor_meta = None if anchor is None else (anchor.shape, anchor.dtype, anchor.device)


def _recv_wait_backward(ctx, grad):
    # The gradient of a receive is a send back to the source. The anchor's (zero) gradient is
    # computed from the send's sink, so that no graph pass can drop the send as unused.
    sink = _ops.send_wait(grad.contiguous(), ctx.peer, ctx.tag, ctx.group_name, ctx.timeout_ms)
    anchor_grad = None
    if ctx.anchor_meta is not None:
        shape, dtype, device = ctx.anchor_meta
        anchor_grad = sink.to(device=device, dtype=dtype).expand(shape).clone()
    return anchor_grad, None, None, None, None, None, None, None


# Every op of csrc/transport/p2p.cpp's TORCH_LIBRARY(pippy_xla), by name: its fake kernel and, for
# the differentiable ones, its autograd formula (backward, setup_context).
_KERNELS = {
    "send": (_send_fake, None),
    "recv": (_recv_fake, None),
    "wait_send": (_wait_send_fake, None),
    "wait_recv": (_wait_recv_fake, None),
    "send_wait": (_send_wait_fake, (_send_wait_backward, _send_wait_setup)),
    "recv_wait": (_recv_wait_fake, (_recv_wait_backward, _recv_wait_setup)),
}
OPS = tuple(getattr(_ops, name).default for name in _KERNELS)
"""The overloads of every ``pippy_xla`` op, in the order of ``_KERNELS``."""

for _op, (_fake, _autograd) in zip(OPS, _KERNELS.values(), strict=True):
    has_side_effect(_op)
    torch.library.register_fake(_op, _fake)
    if _autograd is not None:
        torch.library.register_autograd(_op, _autograd[0], setup_context=_autograd[1])


def group_name_of(group: dist.ProcessGroup | None) -> str:
    """The name under which c10d registered ``group`` (default: the world group)."""
    return (group or dist.group.WORLD).group_name


def send(
    x: torch.Tensor, peer: int, tag: int, group_name: str, dep: torch.Tensor | None = None
) -> torch.Tensor:
    """Posts an asynchronous send of ``x`` to group-local rank ``peer``; returns its token."""
    return _ops.send(x, dep, peer, tag, group_name)


def recv(
    shape: Sequence[int],
    dtype: torch.dtype,
    peer: int,
    tag: int,
    group_name: str,
    device: torch.device | str = "cpu",
    dep: torch.Tensor | None = None,
) -> torch.Tensor:
    """Posts an asynchronous receive from group-local rank ``peer``; returns its token."""
    return _ops.recv(dep, list(shape), dtype, torch.device(device), peer, tag, group_name)


def wait_send(token: torch.Tensor, timeout_ms: int = _C.DEFAULT_TIMEOUT_MS) -> torch.Tensor:
    """Waits for the send behind ``token``; returns a completion token."""
    return _ops.wait_send(token, timeout_ms)


def wait_recv(
    token: torch.Tensor,
    shape: Sequence[int],
    dtype: torch.dtype,
    device: torch.device | str = "cpu",
    timeout_ms: int = _C.DEFAULT_TIMEOUT_MS,
) -> torch.Tensor:
    """Waits for the receive behind ``token``; returns the received tensor."""
    return _ops.wait_recv(token, list(shape), dtype, torch.device(device), timeout_ms)


def send_wait(
    x: torch.Tensor, peer: int, tag: int, group_name: str, timeout_ms: int = _C.DEFAULT_TIMEOUT_MS
):
    """Sends ``x`` to ``peer`` and waits; returns a 0-d float sink whose gradient flows back
    as a receive of ``x``'s gradient from ``peer``."""
    return _ops.send_wait(x, peer, tag, group_name, timeout_ms)


def recv_wait(
    shape: Sequence[int],
    dtype: torch.dtype,
    peer: int,
    tag: int,
    group_name: str,
    device: torch.device | str = "cpu",
    anchor: torch.Tensor | None = None,
    timeout_ms: int = _C.DEFAULT_TIMEOUT_MS,
) -> torch.Tensor:
    """Receives a tensor from ``peer`` and waits. With an ``anchor`` that requires grad, the
    result requires grad and its gradient is sent back to ``peer`` in backward."""
    return _ops.recv_wait(
        anchor, list(shape), dtype, torch.device(device), peer, tag, group_name, timeout_ms
    )
