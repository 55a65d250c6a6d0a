"""Size of the method contract at one or more commits, by static parsing (``ast``) of the files
as git stores them: nothing of the measured revision is imported, so any commit can be measured.

    python scripts/contract_counts.py afd2e5a HEAD

prints one Markdown table, a column per revision. The rules:

- hooks: the public methods and properties (``def``, any decorator; no leading underscore,
  not ``__init__``) in the body of the class ``Algorithm`` of ``src/medpfl/algorithms/base.py``;
  "overridden" counts those that at least one class in another module of
  ``src/medpfl/algorithms`` defines again (as a ``def`` or an assignment) — the hooks that
  methods really override;
- Phase fields: the annotated class-level names of the dataclass ``Phase`` in
  ``src/medpfl/fl/program.py``;
- capability declarations: the capability names are those the base class declares as a
  ``ClassVar`` annotation or as a ``@property``, except ``name``, ``Config`` and ``paper``; across
  every class body in ``src/medpfl/algorithms/*.py`` (base included), a ``@property`` of such a
  name counts as a property, a class-level assignment (plain or annotated) as a ClassVar;
- lines: non-blank lines of ``src/medpfl/algorithms/*.py`` and of ``src/medpfl/fl/*.py``;
- ``@property`` blocks: functions decorated ``@property`` in ``src/medpfl/algorithms/*.py``.
"""

from __future__ import annotations

import argparse
import ast
import subprocess

ALGOS = "src/medpfl/algorithms"
FL = "src/medpfl/fl"
NOT_CAPABILITIES = {"name", "Config", "paper"}


def git(*args: str) -> str:
    return subprocess.run(["git", *args], check=True, capture_output=True, text=True).stdout


def files(rev: str, folder: str) -> dict[str, str]:
    """``{path: text}`` of the ``*.py`` files directly in ``folder`` at ``rev``."""
    names = git("ls-tree", "--name-only", f"{rev}:{folder}").split()
    return {f"{folder}/{n}": git("show", f"{rev}:{folder}/{n}") for n in names if n.endswith(".py")}


def is_property(fn: ast.AST) -> bool:
    return any(isinstance(d, ast.Name) and d.id == "property" for d in getattr(fn, "decorator_list", []))


def class_body(tree: ast.Module, name: str) -> list[ast.stmt]:
    for node in tree.body:
        if isinstance(node, ast.ClassDef) and node.name == name:
            return node.body
    raise LookupError(f"no class {name}")


def assigned(stmt: ast.stmt) -> list[str]:
    if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name):
        return [stmt.target.id]
    if isinstance(stmt, ast.Assign):
        return [t.id for t in stmt.targets if isinstance(t, ast.Name)]
    return []


def is_classvar(ann: ast.expr) -> bool:
    node = ann.value if isinstance(ann, ast.Subscript) else ann
    return (isinstance(node, ast.Name) and node.id == "ClassVar") or (
        isinstance(node, ast.Attribute) and node.attr == "ClassVar")


def counts(rev: str) -> dict[str, int]:
    algos = {p: ast.parse(t) for p, t in files(rev, ALGOS).items()}
    fl = files(rev, FL)
    base_path = f"{ALGOS}/base.py"
    base = class_body(algos[base_path], "Algorithm")
    funcs = [s for s in base if isinstance(s, (ast.FunctionDef, ast.AsyncFunctionDef))]
    hooks = [f.name for f in funcs if not f.name.startswith("_")]
    caps = {f.name for f in funcs if is_property(f)}
    caps |= {s.target.id for s in base if isinstance(s, ast.AnnAssign) and isinstance(s.target, ast.Name)
             and is_classvar(s.annotation)}
    caps -= NOT_CAPABILITIES

    redefined: set[str] = set()
    cap_prop = cap_var = props = 0
    for path, tree in algos.items():
        for cls in (n for n in ast.walk(tree) if isinstance(n, ast.ClassDef)):
            for s in cls.body:
                if isinstance(s, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    if is_property(s):
                        props += 1
                        cap_prop += s.name in caps
                    if path != base_path:
                        redefined.add(s.name)
                else:
                    names = assigned(s)
                    cap_var += sum(n in caps for n in names)
                    if path != base_path:
                        redefined.update(names)
    phase = class_body(ast.parse(fl[f"{FL}/program.py"]), "Phase")

    def nonblank(texts) -> int:
        return sum(1 for t in texts for line in t.splitlines() if line.strip())

    return {
        "overridable hooks on Algorithm (public def/property)": len(hooks),
        "  of which overridden by a method": sum(h in redefined for h in hooks),
        "Phase dataclass fields": sum(isinstance(s, ast.AnnAssign) for s in phase),
        "capability declarations as @property": cap_prop,
        "capability declarations as class attributes": cap_var,
        "@property blocks in algorithms/": props,
        "non-blank lines, algorithms/*.py": nonblank(files(rev, ALGOS).values()),
        "non-blank lines, fl/*.py": nonblank(fl.values()),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("revs", nargs="+", help="git revisions (e.g. afd2e5a HEAD)")
    args = ap.parse_args()
    cols = {rev: counts(rev) for rev in args.revs}
    heads = [f"{rev} ({git('rev-parse', '--short', rev).strip()})" for rev in args.revs]
    print("| measure | " + " | ".join(heads) + " |")
    print("| --- | " + " | ".join("---:" for _ in heads) + " |")
    for key in next(iter(cols.values())):
        print(f"| {key} | " + " | ".join(str(cols[r][key]) for r in args.revs) + " |")


if __name__ == "__main__":
    main()
