"""Federated methods, one module each, registered by name.

Every module of this package that defines an :class:`Algorithm` subclass with a ``name`` is
registered automatically (no list to edit): adding a method is adding its module.

``resolve_method(name, method_params)`` returns the algorithm class and its validated config.
A method name is either a registered algorithm (``fedavg``) or a variant declared in
``method_params`` with an ``algorithm`` key, e.g.::

    method_params:
      fedkper_noclip: {algorithm: fedkper, clip_grad_norm: null}

A ``train`` key in a method's entry overrides the study's ``train`` section for that method's
runs only (the model, local epochs, batch size, ...; validated by :mod:`medpfl.config` with
:mod:`medpfl.compose`), e.g.
``fedavg-mlp: {algorithm: fedavg, train: {model: mlp}}``: one study can hold several models or
local-epoch settings as a list of method variants.
"""

from __future__ import annotations

import ast
import importlib
import inspect
import pkgutil
from pathlib import Path

from pydantic import ValidationError

from medpfl.algorithms.base import Algorithm, MethodConfig
from medpfl.errors import ParamsError


def _discover() -> dict[str, type[Algorithm]]:
    found: dict[str, type[Algorithm]] = {}
    for mod in sorted(pkgutil.iter_modules(__path__), key=lambda m: m.name):
        if mod.name.startswith("_") or mod.name == "base":
            continue
        module = importlib.import_module(f"{__name__}.{mod.name}")
        for _, cls in inspect.getmembers(module, inspect.isclass):
            if issubclass(cls, Algorithm) and cls.__module__ == module.__name__ and cls.name:
                if cls.name in found and found[cls.name] is not cls:
                    raise RuntimeError(f"two methods are named {cls.name!r}: {found[cls.name]} and {cls}")
                found[cls.name] = cls
    return dict(sorted(found.items()))


REGISTRY: dict[str, type[Algorithm]] = _discover()


def resolve_method(name: str, method_params: dict | None = None) -> tuple[type[Algorithm], MethodConfig]:
    """``(algorithm class, validated config)`` for a method name.

    Raises :class:`medpfl.errors.ParamsError` naming ``methods`` or ``method_params.<name>.<key>``.
    """
    overrides = dict((method_params or {}).get(name) or {})
    algo_name = overrides.pop("algorithm", name)
    overrides.pop("train", None)  # the method's train overrides: checked by medpfl.config
    if algo_name not in REGISTRY:
        where = f"method_params.{name}.algorithm" if algo_name != name else "methods"
        raise ParamsError(f"{where}: unknown method {algo_name!r}; known: {', '.join(sorted(REGISTRY))}")
    cls = REGISTRY[algo_name]
    try:
        cfg = cls.Config.model_validate(overrides)
    except ValidationError as e:
        msgs = []
        for err in e.errors():
            loc = ".".join(str(p) for p in err["loc"])
            msg = "unknown key for this method" if err["type"] == "extra_forbidden" else err["msg"]
            msgs.append(f"method_params.{name}.{loc}: {msg}")
        raise ParamsError("; ".join(msgs)) from None
    return cls, cfg


def method_sources(algorithm: str) -> list[Path]:
    """The source files of this package a registered method's code consists of: ``base.py``,
    ``__init__.py``, its own module and every ``medpfl.algorithms`` module it imports,
    transitively (sorted). The train stage hashes these (with the engine and the models), so
    adding or editing one method re-runs only the runs of the methods that use that code.

    Raises KeyError for an unknown name."""
    pkg = Path(__file__).parent
    todo = [Path(inspect.getfile(REGISTRY[algorithm]))]
    seen = {pkg / "__init__.py", pkg / "base.py"}
    while todo:
        f = todo.pop()
        if f in seen:
            continue
        seen.add(f)
        for node in ast.walk(ast.parse(f.read_text())):
            mods = []
            if isinstance(node, ast.ImportFrom) and node.module:
                mods = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
            elif isinstance(node, ast.Import):
                mods = [a.name for a in node.names]
            for m in mods:
                if m.startswith(__name__ + ".") and m.count(".") == 2:
                    cand = pkg / (m.rsplit(".", 1)[1] + ".py")
                    if cand.is_file():
                        todo.append(cand)
    return sorted(seen)


__all__ = ["Algorithm", "MethodConfig", "REGISTRY", "method_sources", "resolve_method"]
