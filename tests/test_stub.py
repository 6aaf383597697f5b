"""The hand-written stub ``pippy_xla/_C.pyi`` against the built extension, with mypy's stubtest:
a binding added, removed or changed without its stub (or the reverse) fails here.

By hand, from the repository root: ``python -m mypy.stubtest pippy_xla._C --mypy-config-file F``
with ``F`` holding :data:`MYPY_CONFIG`.
"""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# stubtest type-checks the package around the module, and compares nothing while any module of it
# has a type error: check pippy_xla._C only (the other modules are not the stub's business).
# torch is not followed either (its types become Any): what stubtest compares (names, kinds,
# members, runtime values against stub types) does not need them, and mypy spent 26 of 29 s
# analysing torch.
MYPY_CONFIG = """\
[mypy]
cache_dir = {cache_dir}

[mypy-pippy_xla.*]
ignore_errors = True
follow_imports = skip

[mypy-pippy_xla._C]
ignore_errors = False
follow_imports = normal

[mypy-torch.*]
follow_imports = skip
"""


def test_stub_matches_the_extension(tmp_path: Path) -> None:
    pytest.importorskip("mypy.stubtest", reason="mypy is not installed (scripts/setup.sh does)")
    config = tmp_path / "mypy.ini"
    config.write_text(MYPY_CONFIG.format(cache_dir=tmp_path / "mypy_cache"))
    cmd = [sys.executable, "-m", "mypy.stubtest", "pippy_xla._C", "--mypy-config-file", config]
    # From the root, so that both mypy and the import find this checkout's package.
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    if proc.returncode != 0:
        pytest.fail(
            "pippy_xla/_C.pyi does not match the built pippy_xla._C (python -m mypy.stubtest "
            f"pippy_xla._C, exit {proc.returncode}):\n{proc.stdout}{proc.stderr}",
            pytrace=False,
        )


# stubtest compares no parameters of pybind11 functions (they have no __text_signature__ for
# inspect.signature to read), so the test below compares them with the signature line that
# pybind11 writes at the top of each docstring: names, order, keyword-only and which have defaults.
# Parameters are written as "name", "name=" (with a default), "*" (keyword-only from here) or "/"
# (positional-only: pybind11's unnamed argN). A method's first parameter (the instance) is left out.


def _split_top(text: str) -> list[str]:
    """``text`` split at the commas outside brackets and quotes, and stripped."""
    parts, depth, quote, start = [], 0, "", 0
    for i, c in enumerate(text + ","):
        if quote:
            quote = "" if c == quote else quote
        elif c in "'\"":
            quote = c
        elif c in "([{":
            depth += 1
        elif c in ")]}":
            depth -= 1
        elif c == "," and depth == 0:
            parts.append(text[start:i].strip())
            start = i + 1
    return [p for p in parts if p]


def _runtime_params(runtime: object, name: str, method: bool) -> list[str] | None:
    """The parameters of pybind11's ``name(a: T, *, b: T = 0) -> R`` line; None without one."""
    line = (getattr(runtime, "__doc__", None) or "").partition("\n")[0]
    if not line.startswith(f"{name}("):
        return None  # stub-only classes, properties, slot wrappers
    args = _split_top(line[len(name) :])[0]  # "(...)" up to the first top-level comma: all of it
    out = []
    for part in _split_top(args[1 : args.rindex(")")])[int(method) :]:
        pname = part.split(":")[0].strip()
        if pname == "*":
            out.append("*")
        elif pname == "/":  # the ones before are positional-only
            out = ["/"] * len(out)
        elif re.fullmatch(r"arg\d+", pname):
            out.append("/")
        else:
            out.append(pname + ("=" if " = " in part else ""))
    return out


def _stub_params(fn: ast.FunctionDef, method: bool) -> list[str]:
    a = fn.args
    positional = a.posonlyargs + a.args
    first_default = len(positional) - len(a.defaults)
    out = []
    for i, arg in enumerate(positional[int(method) :], start=int(method)):
        out.append("/" if arg in a.posonlyargs else arg.arg + ("=" if i >= first_default else ""))
    if a.kwonlyargs:
        out.append("*")
    for arg, default in zip(a.kwonlyargs, a.kw_defaults, strict=True):
        out.append(arg.arg + ("=" if default is not None else ""))
    return out


def test_stub_parameters_match_the_bindings() -> None:
    from pippy_xla._native import _C

    stub = ast.parse((ROOT / "pippy_xla" / "_C.pyi").read_text())
    defs = [(None, n) for n in stub.body if isinstance(n, ast.FunctionDef)]
    for c in stub.body:
        if isinstance(c, ast.ClassDef):
            defs += [(c.name, n) for n in c.body if isinstance(n, ast.FunctionDef)]
    wrong, checked = [], 0
    for cls, fn in defs:
        owner = _C if cls is None else getattr(_C, cls, None)
        params = _runtime_params(getattr(owner, fn.name, None), fn.name, cls is not None)
        if params is None:
            continue
        checked += 1
        mine = _stub_params(fn, cls is not None)
        if params != mine:
            where = fn.name if cls is None else f"{cls}.{fn.name}"
            wrong.append(f"{where}: bound ({', '.join(params)}), stub ({', '.join(mine)})")
    assert checked > 40, f"only {checked} signatures compared: did pybind11's docstrings change?"
    assert not wrong, "pippy_xla/_C.pyi parameters differ from the bindings:\n" + "\n".join(wrong)
