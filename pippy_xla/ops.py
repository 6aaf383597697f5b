"""Python side of the ``pippy_xla`` point-to-point ops: typed wrappers and fake kernels.

The schemas and kernels live in ``csrc/ops/p2p.cpp``. A transfer is posted by ``send`` / ``recv``,
which return a token (a 0-d int64 tensor, see [Note: p2p tokens] in the C++ source), and completed
by ``wait_send`` / ``wait_recv``. Each op takes the previous op's token as ``dep`` so that the
order of communication is data flow that no graph pass can reorder; all four are marked
side-effecting so that dead-code elimination never drops them.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch.fx.node import has_side_effect

import pippy_xla._C  # noqa: F401  (registers the ops)

__all__ = ["send", "recv", "wait_send", "wait_recv", "group_name_of"]

_ops = torch.ops.pippy_xla

for _op in (_ops.send.default, _ops.recv.default, _ops.wait_send.default, _ops.wait_recv.default):
    has_side_effect(_op)


def _token() -> torch.Tensor:
    return torch.empty((), dtype=torch.long)


@torch.library.register_fake("pippy_xla::send")
def _send_fake(x, dep, peer, tag, group_name):
    return _token()


@torch.library.register_fake("pippy_xla::recv")
def _recv_fake(dep, shape, dtype, device, peer, tag, group_name):
    return _token()


@torch.library.register_fake("pippy_xla::wait_send")
def _wait_send_fake(token, timeout_ms):
    return _token()


@torch.library.register_fake("pippy_xla::wait_recv")
def _wait_recv_fake(token, shape, dtype, device, timeout_ms):
    return torch.empty(shape, dtype=dtype, device=device)


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


def wait_send(token: torch.Tensor, timeout_ms: int = 300_000) -> torch.Tensor:
    """Waits for the send behind ``token``; returns a completion token."""
    return _ops.wait_send(token, timeout_ms)


def wait_recv(
    token: torch.Tensor,
    shape: Sequence[int],
    dtype: torch.dtype,
    device: torch.device | str = "cpu",
    timeout_ms: int = 300_000,
) -> torch.Tensor:
    """Waits for the receive behind ``token``; returns the received tensor."""
    return _ops.wait_recv(token, list(shape), dtype, torch.device(device), timeout_ms)
