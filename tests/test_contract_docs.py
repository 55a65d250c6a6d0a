"""docs/contract.md's worked example runs as printed: its Python blocks are taken from the page,
the method module is registered by the registry's own discovery (``medpfl.algorithms._discover``
over the package path plus a temporary folder), and the test functions of the page's test file
are called with the ``fed_data`` fixture. Nothing is written into the source tree, and the
registry and ``sys.modules`` are restored afterwards."""

from __future__ import annotations

import importlib.util
import inspect
import re
import sys
from pathlib import Path

import pytest

import medpfl.algorithms as algorithms

DOC = Path(__file__).resolve().parents[1] / "docs" / "contract.md"
BLOCK = re.compile(r"^```python\n(.*?)^```", re.S | re.M)


def blocks() -> dict[str, str]:
    """``{path named on the block's first line: code}`` for every python block of the page."""
    out = {}
    for code in BLOCK.findall(DOC.read_text()):
        first = code.splitlines()[0]
        assert first.startswith("# ") and first.endswith(".py"), f"a python block must start with '# <path>.py': {first!r}"
        out[first[2:].strip()] = code
    return out


def test_every_block_names_its_file_and_compiles():
    found = blocks()
    assert {"src/medpfl/algorithms/prox_example.py", "tests/test_prox_example.py"} <= set(found)
    for path, code in found.items():
        compile(code, path, "exec")


@pytest.fixture
def registered(tmp_path, monkeypatch):
    """The page's method module, discovered as ``medpfl.algorithms.prox_example`` from a temporary
    folder on the package path and put in the registry; undone after the test."""
    code = blocks()["src/medpfl/algorithms/prox_example.py"]
    (tmp_path / "prox_example.py").write_text(code)
    monkeypatch.setattr(algorithms, "__path__", [*algorithms.__path__, str(tmp_path)])
    try:
        found = algorithms._discover()
        cls = found["prox_example"]
        monkeypatch.setitem(algorithms.REGISTRY, "prox_example", cls)
        yield cls
    finally:
        sys.modules.pop("medpfl.algorithms.prox_example", None)


def test_worked_example_registers_and_its_tests_pass(registered, fed_data, tmp_path):
    assert registered.__module__ == "medpfl.algorithms.prox_example"
    assert algorithms.resolve_method("prox_example", {"prox_example": {"mu": 0.1}})[1].mu == 0.1
    path = tmp_path / "test_prox_example.py"
    path.write_text(blocks()["tests/test_prox_example.py"])
    spec = importlib.util.spec_from_file_location("doc_test_prox_example", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    tests = [(n, f) for n, f in vars(module).items() if n.startswith("test_") and callable(f)]
    assert len(tests) == 2
    for name, fn in tests:
        params = set(inspect.signature(fn).parameters)
        assert params <= {"fed_data"}, f"{name}: the page's tests may use only the fed_data fixture, got {params}"
        fn(**({"fed_data": fed_data} if params else {}))
