"""The one door to the C++ extension: every module of the package reaches ``pippy_xla._C``
through ``from pippy_xla._native import _C``.

Loading it here, once, keeps the order right (libtorch before the extension, which registers the
``pippy_xla`` ops on import) and turns a missing or stale build into an error that says what to
do, instead of an ``ImportError`` from whichever module happened to import it first. The module's
types are in ``pippy_xla/_C.pyi``, which the test suite checks against the built module.
"""

from __future__ import annotations

import os

import torch  # noqa: F401  (libtorch's symbols must be loaded before the extension's)

__all__ = ["_C"]

try:
    import pippy_xla._C as _C
except ImportError as e:
    raise ImportError(
        f"pippy_xla's C++ extension (pippy_xla._C) could not be loaded: {e}. Build it from the "
        "repository root with `pip install --no-build-isolation -e .` (or `bash "
        "scripts/setup.sh`), against the torch that is installed now"
    ) from e

_stdcxx = _C.libstdcxx_file()
if _stdcxx and os.path.realpath(_stdcxx) == os.path.realpath(_C.__file__):
    raise ImportError(
        f"pippy_xla's C++ extension ({_C.__file__}) holds its own copy of libstdc++ (its compiler "
        "linked the static archive), which breaks C++ streams shared with libtorch (crashes "
        "when formatting numbers). Rebuild it with `pip install --no-build-isolation -e .`, whose "
        "setup.py links the libstdc++ torch runs with, or with a compiler that links libstdc++ "
        "as a shared library; see [Note: one libstdc++] in setup.py"
    )
