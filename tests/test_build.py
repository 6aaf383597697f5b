"""The built extension against the torch it runs with: one libstdc++ ([Note: one libstdc++] in
setup.py). A compiler that links libstdc++ statically (the GPU machine's /opt/gcc/bin/g++) gave
the extension its own copy, and every C++ message holding a number crashed (torch 2.11) or lost
its numbers (torch 2.13)."""

from __future__ import annotations

import os

import pytest
import torch

from pippy_xla import _C


def _mapped_libstdcxx() -> str:
    with open("/proc/self/maps") as maps:
        for line in maps:
            path = line.split()[-1]
            if os.path.basename(path).startswith("libstdc++.so"):
                return os.path.realpath(path)
    pytest.skip("no libstdc++ shared object mapped (not Linux with glibc)")


def test_extension_calls_the_libstdcxx_torch_runs_with() -> None:
    owner = os.path.realpath(_C.libstdcxx_file())
    assert owner != os.path.realpath(_C.__file__)
    assert owner == _mapped_libstdcxx()


def test_cxx_error_messages_keep_their_numbers() -> None:
    # Integers go through std::ostream's num_put facet, the part a second libstdc++ breaks.
    with pytest.raises(ValueError, match="cannot split 1 decoder layers into 5 stages"):
        _C.check_stage_count(1, 5)
    with pytest.raises(RuntimeError, match=r"got \[1\] Float"):
        torch.ops.pippy_xla.wait_send(torch.zeros(1), -5)
