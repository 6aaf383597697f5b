"""Process exit: letting go of destroyed process groups before the interpreter shuts down.

See [Note: releasing the group at exit] and [Note: groups bound as default arguments].
"""

from __future__ import annotations

import atexit
import sys
import types
import weakref
from typing import Any

import torch.distributed as dist

__all__ = ["release_at_exit", "release_groups_at_exit"]

# Objects alive in this process that hold process groups -> the attributes that hold them.
_HOLDERS: weakref.WeakKeyDictionary[Any, tuple[str, ...]] = weakref.WeakKeyDictionary()


def release_at_exit(holder: Any, *attributes: str) -> None:
    """Has the exit hook set ``holder``'s ``attributes`` (those that hold process groups, or a
    mesh of them) to ``None``, if ``holder`` is still alive then."""
    _HOLDERS[holder] = attributes


@atexit.register
def release_groups_at_exit() -> None:
    """[Note: releasing the group at exit] A pipeline alive at exit (a global, or a local kept by
    an exception's traceback) keeps its process group, and with it gloo's worker threads, alive
    into interpreter finalization even after ``destroy_process_group``. A worker thread that then
    lets go of a Python tensor from an earlier collective (the user's own ``all_gather_object``,
    say) takes the GIL during finalization and the process dies with SIGABRT (see [Note:
    collectives on C++-owned buffers] in csrc/transport/p2p.h). Dropping the pipelines' references
    here, while the interpreter is still whole, lets a destroyed group's threads finish and
    exit now. A group the program never destroyed stays alive; that one is torch's to tear down."""
    for holder, attributes in list(_HOLDERS.items()):
        for name in attributes:
            setattr(holder, name, None)
    _release_stale_default_groups()


def _release_stale_default_groups() -> None:
    """[Note: groups bound as default arguments] Some ``torch.distributed`` modules bind the
    default group as a default argument (``def all_reduce(tensor, ..., group=group.WORLD)`` in
    ``torch.distributed.nn.functional``, which ``transformers`` imports through FSDP's sharded
    tensors). Imported after ``init_process_group``, each such default holds the group, so
    ``destroy_process_group`` frees nothing and the group, with gloo's worker threads, lives into
    interpreter finalization: the [Note: releasing the group at exit] crash, with no pipeline
    involved. A group held this way that is no longer the default one is replaced by ``None``
    (which those functions read as the default group), so it is freed here, before
    finalization."""
    if not dist.is_available():
        return
    world = dist.group.WORLD if dist.is_initialized() else None

    def stale(value) -> bool:
        return isinstance(value, dist.ProcessGroup) and value is not world

    def fix(fn) -> None:
        if type(fn) in (staticmethod, classmethod):
            fn = fn.__func__
        if type(fn) is not types.FunctionType:  # type(), not isinstance: no __getattribute__
            return
        if fn.__defaults__ and any(stale(d) for d in fn.__defaults__):
            fn.__defaults__ = tuple(None if stale(d) else d for d in fn.__defaults__)
        if fn.__kwdefaults__ and any(stale(d) for d in fn.__kwdefaults__.values()):
            fn.__kwdefaults__ = {k: None if stale(d) else d for k, d in fn.__kwdefaults__.items()}

    for name, module in list(sys.modules.items()):
        if module is None or not name.startswith("torch.distributed"):
            continue
        for value in list(vars(module).values()):
            if issubclass(type(value), type):
                for attr in list(vars(value).values()):
                    fix(attr)
            else:
                fix(value)
