"""The spawn helper under its old import name, for the tests that still use it; the helper itself
is :mod:`pippy_xla.testing`."""

from pippy_xla.testing import run_ranks

__all__ = ["run_ranks"]
