"""The package's layout: three wings whose imports run one way, a front above them, one door to
C++, no import cycles, and no function too long to read at once.

- ``split/`` (how a model is split) imports only the base modules;
- ``runtime/`` (how a step runs) and ``plan/`` (how a plan is made) import the base and ``split/``,
  never each other;
- the front (``config.py``, ``pipeline.py``, ``checkpoint.py``, ``cli.py`` and the other
  top-level modules that import a wing) may import anything;
- the base (``_native.py``, ``_version.py``, ``units.py``, ``errors.py``, ``hf_compat.py``)
  imports no wing;
- ``integrations/`` (the pipeline inside other libraries' formats and loops: PEFT) sits above
  the front and may import anything; nothing imports it but the package's ``__init__``, which
  may import anything (the front finds an integration through what it registers).

Imports are read with ``ast`` from every module, function-local imports included. Imports under
``if TYPE_CHECKING:`` are left out: they name types for annotations and never run, so the runtime
may name ``PipelineConfig`` (front) in its signatures while reading only the object it is given.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import pippy_xla as px

PACKAGE = Path(px.__file__).parent
WINGS = ("split", "runtime", "plan")
BASE = ("_native", "_version", "units", "errors", "hf_compat")
ALLOWED = {
    "base": {"base"},
    "split": {"base", "split"},
    "runtime": {"base", "split", "runtime"},
    "plan": {"base", "split", "plan"},
    "front": {"base", "split", "runtime", "plan", "front"},
    "integrations": {"base", "split", "runtime", "plan", "front", "integrations"},
    "package": {"base", "split", "runtime", "plan", "front", "integrations"},
}
INTEGRATIONS = "integrations"


def _modules() -> dict[str, Path]:
    """Every module of the package by dotted name (``pippy_xla.split.partition``)."""
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        found[name] = path
    return found


MODULES = _modules()


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _walk_run_time(node: ast.AST):
    """``ast.walk`` without the bodies of ``if TYPE_CHECKING:`` (their ``else`` runs)."""
    yield node
    for child in ast.iter_child_nodes(node):
        if isinstance(child, ast.If) and _is_type_checking(child):
            for other in child.orelse:
                yield from _walk_run_time(other)
            continue
        yield from _walk_run_time(child)


def _resolve(name: str) -> str | None:
    """The package module that importing ``name`` runs last (a name inside a module: the module)."""
    while name and name not in MODULES:
        name = name.rpartition(".")[0]
    return name or None


def imports(module: str) -> set[str]:
    """The package modules that ``module`` imports at run time, by dotted name."""
    found = set()
    tree = ast.parse(MODULES[module].read_text())
    is_package = MODULES[module].name == "__init__.py"
    for node in _walk_run_time(tree):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.startswith("pippy_xla")}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from the module's package
                anchor = module.split(".")
                anchor = anchor[: len(anchor) - node.level + (1 if is_package else 0)]
                base = ".".join([*anchor, *([base] if base else [])])
            if not base.startswith("pippy_xla"):
                continue
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                found.add(sub if sub in MODULES or sub == "pippy_xla._C" else base)
    return {m if m == "pippy_xla._C" else _resolve(m) for m in found} - {None, module}


def layer(module: str) -> str:
    parts = module.split(".")
    if module == "pippy_xla":
        return "package"
    if len(parts) >= 2 and parts[1] == INTEGRATIONS:
        return "integrations"
    if len(parts) >= 2 and parts[1] in WINGS:
        return parts[1]
    if len(parts) == 2 and parts[1] in BASE:
        return "base"
    return "front"


def test_the_wings_exist_and_every_module_belongs_to_one():
    for wing in WINGS:
        assert f"pippy_xla.{wing}" in MODULES, f"pippy_xla/{wing}/__init__.py is missing"
    # a module outside the wings must be a base or a front module on purpose: list new ones here
    assert f"pippy_xla.{INTEGRATIONS}" in MODULES
    top = {m.split(".")[1] for m in MODULES if m.count(".") == 1} - {*WINGS, INTEGRATIONS}
    front = {"__main__", "_report", "checkpoint", "cli", "config", "pipeline", "testing"}
    assert top == set(BASE) | front, f"unexpected top-level modules: {top - set(BASE) - front}"


@pytest.mark.parametrize("module", sorted(MODULES))
def test_imports_run_one_way(module):
    mine = layer(module)
    for target in sorted(imports(module)):
        if target in ("pippy_xla", "pippy_xla._C"):
            continue
        theirs = layer(target)
        assert theirs in ALLOWED[mine], (
            f"{module} ({mine}) imports {target} ({theirs}); {mine} may import only "
            f"{sorted(ALLOWED[mine])}"
        )


def test_one_door_to_cpp_and_no_import_from_the_package_init():
    for module in sorted(MODULES):
        targets = imports(module)
        if layer(module) != "front":  # the command line may use the public API as users do
            assert "pippy_xla" not in targets, f"{module} imports from the package's __init__"
        if module != "pippy_xla._native":
            assert "pippy_xla._C" not in targets, f"{module} imports _C; use pippy_xla._native"


def test_no_import_cycles():
    graph = {m: imports(m) - {"pippy_xla", "pippy_xla._C"} for m in MODULES if m != "pippy_xla"}
    # a subpackage's __init__ re-exports its modules: only cycles through modules count
    graph = {m: {t for t in ts if MODULES[t].name != "__init__.py"} for m, ts in graph.items()}

    def cycle_from(start, node, path):
        for nxt in sorted(graph.get(node, ())):
            if nxt == start:
                return [*path, nxt]
            if nxt not in path:
                found = cycle_from(start, nxt, [*path, nxt])
                if found:
                    return found
        return None

    for module in sorted(graph):
        cycle = cycle_from(module, module, [module])
        assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_public_names_stay_importable_from_the_package():
    for wing in WINGS:
        package = __import__(f"pippy_xla.{wing}", fromlist=["__all__"])
        assert package.__all__, f"pippy_xla.{wing} names no public pieces"
        for name in package.__all__:
            assert hasattr(package, name), f"pippy_xla.{wing}.__all__ names missing {name}"
    for name in px.__all__:
        assert hasattr(px, name), name
    assert callable(px.plan) and callable(px.partition)


def test_pyproject_ships_every_subpackage():
    tomllib = pytest.importorskip("tomllib")
    pyproject = PACKAGE.parent / "pyproject.toml"
    if not pyproject.exists():
        pytest.skip("an installed package: no pyproject.toml beside it")
    listed = tomllib.loads(pyproject.read_text())["tool"]["setuptools"]["packages"]
    packages = sorted(m for m, p in MODULES.items() if p.name == "__init__.py")
    assert sorted(listed) == packages, "[tool.setuptools] packages must list every subpackage"


MAX_FUNCTION_LINES = 60
LONG_ALLOWED = {"pippy_xla.cli._parser"}  # the argparse table of the command line


def test_no_function_is_longer_than_60_lines():
    """Counted with ``ast`` (``end_lineno - lineno + 1``, docstring and nested functions
    included in their parent)."""
    long = []
    for module, path in sorted(MODULES.items()):

        def visit(node, prefix, module=module):
            for child in ast.iter_child_nodes(node):
                if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef):
                    name = f"{module}.{prefix}{child.name}"
                    lines = child.end_lineno - child.lineno + 1
                    if lines > MAX_FUNCTION_LINES and name not in LONG_ALLOWED:
                        long.append(f"{name}: {lines} lines")
                elif isinstance(child, ast.ClassDef):
                    visit(child, f"{prefix}{child.name}.")

        visit(ast.parse(path.read_text()), "")
    assert not long, f"functions over {MAX_FUNCTION_LINES} lines:\n" + "\n".join(long)
