"""Comparing compiled stages with eager ones: a tolerance relative to each tensor's scale.

[Note: compiled tolerance] Inductor fuses kernels and picks its vector code by the CPU's
instruction set (AVX-512, AVX2 or none; ``ATEN_CPU_CAPABILITY`` makes it emit a lesser CPU's code
on any machine), and with it the order of its floating-point sums. A reordered fp32 sum is off by
a few units of rounding of the *summands'* magnitude, not of the result's: an element that is
small because large terms cancel (a gradient near zero) differs from eager by an amount that an
element-wise ``rtol`` scaled by that small element does not admit, on one CPU and not the next
(issue 46: ``rtol=1e-4, atol=1e-6`` held on AVX-512 and failed on AVX2). The error scales with the
tensor, so the check is ``max |compiled - eager| <= REL[kind] * max |eager|``, per tensor.

REL per kind is the worst ratio measured over the compiled-comparison tests (``pytest -m
compiled``) under the native ISA (AVX-512), ``ATEN_CPU_CAPABILITY=avx2`` and ``=default``, times
about ten (the measurements are in ``REL``'s comment). A real fault (a microbatch's gradient lost,
a stage run twice, a tensor from the wrong step) moves a tensor by a sizeable part of its scale
(ratios of 0.1 to 1), three orders of magnitude above these bounds.

``PIPPY_XLA_SPREAD_LOG=<file>`` appends every comparison's ratio to that file instead of asserting
(so one run sees every comparison), which is how the measurements in ``REL``'s comment were taken:
``scripts/compiled_spread.sh`` runs the three ISAs and prints the worst ratio of each kind.
"""

from __future__ import annotations

import os

import torch

# Worst ratio measured by scripts/compiled_spread.sh over the 5 compiled-comparison tests (2-core
# AMD EPYC VM with AVX-512, torch 2.13.0, 2026-11-27), native / avx2 / default, and the tensor:
#   loss    1.2e-7 / 2.4e-7 / 8.7e-8  (MoE router aux loss, step 1; losses over 10 AdamW steps
#                                      of tests/test_compile.py stay below it)
#   output  2.6e-7 / 2.6e-7 / 3.5e-7  (a compiled stage's output)
#   grad    1.1e-5 / 3.6e-5 / 1.4e-5  (layers.1.self_attn.o_proj.weight of the compiled ZB-H1 MoE
#                                      case after one AdamW step: issue 46's failure, which broke
#                                      the element-wise rtol=1e-4, atol=1e-6 under AVX2)
#   param   3.1e-5 / 9.9e-5 / 3.8e-5  (layers.1.self_attn.v_proj.weight after two AdamW steps;
#                                      AdamW's normalized step turns a near-zero gradient's
#                                      rounding into a step of up to lr)
# Each bound is about ten times the worst of the three.
REL = {"loss": 3e-6, "output": 3e-6, "grad": 4e-4, "param": 1e-3}


def assert_close_compiled(
    actual: torch.Tensor, expected: torch.Tensor, kind: str, msg: str = ""
) -> None:
    """``actual`` (compiled) equals ``expected`` (eager) up to ``REL[kind]`` of ``expected``'s
    largest magnitude; see [Note: compiled tolerance]."""
    actual, expected = torch.as_tensor(actual).detach(), torch.as_tensor(expected).detach()
    assert actual.shape == expected.shape, f"{msg}: shape {actual.shape} != {expected.shape}"
    assert torch.isfinite(actual).all(), f"{msg}: compiled result is not finite"
    scale = float(expected.abs().max()) if expected.numel() else 0.0
    diff = float((actual - expected).abs().max()) if expected.numel() else 0.0
    ratio = diff / scale if scale > 0 else diff
    log = os.environ.get("PIPPY_XLA_SPREAD_LOG")
    if log:
        with open(log, "a") as f:
            f.write(f"{kind}\t{ratio:.3e}\t{msg}\n")
        return
    assert ratio <= REL[kind], (
        f"{msg}: max |compiled - eager| = {diff:.3g} is {ratio:.3g} of the largest |eager| "
        f"({scale:.3g}), above the {kind} bound {REL[kind]:g} ([Note: compiled tolerance])"
    )


def under_another_cpu() -> bool:
    """Whether this run emits another CPU's code (``ATEN_CPU_CAPABILITY`` set: scripts/test.sh's
    second pass over the compiled-comparison tests). Only inductor's code depends on it, so a
    case compiled by another backend (``aot_eager``: dynamo and AOTAutograd alone) checks there
    nothing that the first pass did not, and is left out of it."""
    return "ATEN_CPU_CAPABILITY" in os.environ
