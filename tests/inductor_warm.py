"""Imported by the ranks' forkserver (conftest preloads it): inductor's modules and its choice of
vector instruction set, made once per server instead of once per forked rank that compiles.

Measured on the 2-core CI machine: importing ``torch._inductor``'s compiler 1.0 s and
``pick_vec_isa`` 1.1 s (it builds test programs with the C++ compiler) in every rank process
of a compiled test, about 16 of them in the suite's first pass and 14 in its second. The choice
follows ``ATEN_CPU_CAPABILITY`` as the server inherits it, which is the pytest process's, as
the ranks' was. The server starts no thread here, so forking from it stays safe."""

import torch._inductor.compile_fx  # noqa: F401
from torch._inductor.cpu_vec_isa import pick_vec_isa

VEC_ISA = pick_vec_isa()
