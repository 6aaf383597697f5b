"""Imported by the ranks' forkserver (conftest preloads it): inductor's compiler modules and its
choice of vector instruction set, made once per server instead of once in every forked rank
that compiles a stage. Measured on the 2-core CI machine, in a process that has imported the
tests' modules: importing inductor's compiler 1.0 s, ``pick_vec_isa`` 1.1 s (it builds test
programs with the C++ compiler). The choice follows ``ATEN_CPU_CAPABILITY`` as the server
inherits it from the pytest process, as the ranks' own did. Nothing here starts a thread, so
forking from the server stays safe."""

import torch._inductor.compile_fx  # noqa: F401
from torch._inductor.cpu_vec_isa import pick_vec_isa

VEC_ISA = pick_vec_isa()
