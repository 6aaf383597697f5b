import getpass
import os
import sys
import tempfile

# Test helpers (models.py) import as top-level modules, in this process and in the
# processes that the spawn helper starts.
sys.path.insert(0, os.path.dirname(__file__))

# [Note: inductor compiles in the rank] By default inductor compiles its C++ kernels in a pool of
# worker processes when a machine has 2 cores or more, and each compiling process (every rank
# of a compiled test) starts a pool of its own: an interpreter that imports torch, for a few
# kernels, on cores the other ranks are computing on. The tests' ranks compile in their own
# process instead (their ranks inherit this): a compiled test on 2 ranks with a cold cache took
# 53 s against 66 s on the 2-core CI machine.
os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")

# [Note: one inductor cache per instruction set] Inductor's on-disk caches do not tell graphs
# compiled under one ATEN_CPU_CAPABILITY from another's (torch 2.13): after a run on this
# machine's native AVX-512, the same tests under ATEN_CPU_CAPABILITY=avx2 replayed the cached
# graphs and got NaN losses and a segmentation fault inside the compiled code; with a cache of
# their own they pass. A run that names a capability therefore gets its own cache directory,
# inherited by the ranks it starts (scripts/test.sh runs the compiled tests that way).
_isa = os.environ.get("ATEN_CPU_CAPABILITY")
if _isa and "TORCHINDUCTOR_CACHE_DIR" not in os.environ:
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(
        tempfile.gettempdir(), f"torchinductor_{getpass.getuser()}_{_isa}"
    )


TRAINER_MODULES = (
    "transformers.trainer",
    "trl.trainer.sft_trainer",
    "trl.trainer.grpo_trainer",
    "trl.trainer.dpo_trainer",
    "trl.trainer.rloo_trainer",
    "trl.trainer.kto_trainer",
    "trl.trainer.reward_trainer",
)
"""HF's Trainer and TRL's trainers, which the Trainer tests' ranks build: 1.2 CPU-s of imports a
process, paid once by the forkserver instead of by each of some 60 ranks."""


def pytest_collection_finish(session):
    """The ranks' forkserver imports the tests' helpers and every collected test module once,
    before its first fork, instead of each rank importing them (``pippy_xla.testing.preload``);
    the trainers' modules too where the Trainer's tests are collected."""
    from pippy_xla.testing import preload

    names = sorted({item.module.__name__ for item in session.items if hasattr(item, "module")})
    trainers = TRAINER_MODULES if "test_trainer" in names else ()
    preload("models", "inductor_warm", *trainers, *names)


def pytest_report_header(config):
    """The releases under test (scripts/test.sh runs the `compat` tests against several)."""
    import torch
    import transformers

    where = transformers.__file__
    return f"transformers {transformers.__version__} ({where}), torch {torch.__version__}"
