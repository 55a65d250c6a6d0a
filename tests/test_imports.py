"""The package's import structure (issue 31, "No import circle").

- ``medpfl.config`` is schemas only: importing it loads no other part of the project but
  ``medpfl.errors`` (no method registry, no engine, no model zoo, no torch), and its source
  imports nothing else of ``medpfl``, at module level or inside a function.
- ``medpfl.fl`` runs without the pipeline: importing the engine loads no Snakemake, MLflow,
  DVC, pandera, ``medpfl.report``, ``medpfl.tracking`` or ``medpfl.compose``.
- No import circle among ``medpfl`` modules, counting the imports inside functions (which only
  delay one, they do not remove it); ``if TYPE_CHECKING:`` imports are annotations and do not
  count.

The sys.modules checks run in fresh interpreters: the test session has imported everything.
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys

import pytest

from helpers import REPO

SRC = REPO / "src"

_LOADED = """
import importlib, json, sys
importlib.import_module(sys.argv[1])
print(json.dumps(sorted(sys.modules)))
"""


def _loaded(module: str) -> set[str]:
    out = subprocess.run([sys.executable, "-c", _LOADED, module], capture_output=True, text=True, timeout=300,
                         check=True, cwd=REPO).stdout
    return set(json.loads(out.splitlines()[-1]))


def _under(loaded: set[str], package: str) -> list[str]:
    return sorted(m for m in loaded if m == package or m.startswith(package + "."))


def test_config_imports_no_registry():
    loaded = _loaded("medpfl.config")
    ours = _under(loaded, "medpfl")
    assert ours == ["medpfl", "medpfl.config", "medpfl.errors"], ours
    assert "torch" not in loaded


@pytest.mark.parametrize("module", ["medpfl.fl.engine", "medpfl.fl.executors", "medpfl.algorithms"])
def test_the_engine_imports_without_the_pipeline(module):
    loaded = _loaded(module)
    for forbidden in ("snakemake", "mlflow", "dvc", "pandera", "medpfl.report", "medpfl.tracking", "medpfl.compose",
                      "medpfl.cli"):
        assert not _under(loaded, forbidden), f"import {module} loads {forbidden} ({_under(loaded, forbidden)[:5]})"


# ----- the import graph, read from the sources --------------------------------------------------
def _module_name(path) -> str:
    parts = path.relative_to(SRC).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {_module_name(p): p for p in sorted((SRC / "medpfl").rglob("*.py"))}


def _imports(path) -> list[tuple[str, int, bool]]:
    """``(imported medpfl module, line, inside a function)`` for every import in ``path`` but
    those under ``if TYPE_CHECKING:``."""
    out: list[tuple[str, int, bool]] = []

    def visit(node, in_function: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test):
                for orelse in child.orelse:
                    visit(orelse, in_function)
                continue
            inner = in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
            if isinstance(child, ast.ImportFrom) and child.level == 0 and (child.module or "").split(".")[0] == "medpfl":
                for alias in child.names:
                    sub = f"{child.module}.{alias.name}"
                    out.append((sub if sub in MODULES else child.module, child.lineno, inner))
            elif isinstance(child, ast.Import):
                out.extend((a.name, child.lineno, inner) for a in child.names if a.name.split(".")[0] == "medpfl")
            visit(child, inner)

    visit(ast.parse(path.read_text()), False)
    return out


def _graph() -> dict[str, set[str]]:
    """module -> the medpfl modules importing it runs (the imported module and the packages
    above it, whose ``__init__`` runs first), counting imports inside functions."""
    graph: dict[str, set[str]] = {}
    for name, path in MODULES.items():
        deps = set()
        for target, _, _ in _imports(path):
            parts = target.split(".")
            for i in range(2, len(parts) + 1):
                dep = ".".join(parts[:i])
                if dep in MODULES and dep != name and not name.startswith(dep + "."):
                    deps.add(dep)
        graph[name] = deps
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def connect(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            connect(v)
    return found


def test_no_import_circle_even_through_function_local_imports():
    assert _cycles(_graph()) == []


def test_the_cycle_finder_finds_a_cycle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


@pytest.mark.parametrize("module", ["medpfl.config", "medpfl.errors"])
def test_schema_modules_import_nothing_of_the_project(module):
    """Neither at module level nor inside a function (where an import would hide a circle)."""
    allowed = {"medpfl.config": {"medpfl.errors"}, "medpfl.errors": set()}[module]
    bad = [f"line {line}: {target}" + (" (inside a function)" if inner else "")
           for target, line, inner in _imports(MODULES[module]) if target not in allowed]
    assert not bad, f"{module} imports {bad}"
