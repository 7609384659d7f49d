"""The package's shape (issue 14): no import cycles in jitckpt/, and each subpackage says what it owns.

Every import that runs counts, also those inside functions: a lazy import hides a cycle from the
interpreter, not from a reader. Imports under ``if TYPE_CHECKING:`` (annotations only) do not.
"""
from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parents[1] / "jitckpt"


def declared_extensions(repo: Path) -> list[str]:
    """The extension modules the build declares (``pybind11_add_module(NAME ...)`` in any
    CMakeLists.txt of ours): they are modules of the package whether or not they are built yet."""
    names = []
    for cm in sorted(repo.glob("*/**/CMakeLists.txt")):
        if cm.relative_to(repo).parts[0] in ("third_party", ".venv", "build"):
            continue
        names += re.findall(r"pybind11_add_module\(\s*(\w+)", cm.read_text())
    return names


def modules(root: Path, *, built: bool = True) -> dict[str, tuple[Path | None, bool]]:
    """Dotted name -> (source file or None for an extension module, is a package). ``built``:
    also the ``*.so`` files found in the tree (False: as in a checkout without ``make native``)."""
    mods: dict[str, tuple[Path | None, bool]] = {}
    for f in root.rglob("*.py"):
        parts = list(f.relative_to(root.parent).with_suffix("").parts)
        is_pkg = parts[-1] == "__init__"
        mods[".".join(parts[:-1] if is_pkg else parts)] = (f, is_pkg)
    for f in root.rglob("*.so") if built else ():
        rel = f.relative_to(root.parent)
        mods[".".join(rel.parent.parts + (f.name.split(".")[0],))] = (None, False)
    # The native modules import nothing of ours, built or not yet.
    for name in declared_extensions(root.parent):
        mods.setdefault(f"{root.name}.{name}", (None, False))
    return mods


def _known(name: str, mods: dict) -> str | None:
    while name and name not in mods:
        name = name.rpartition(".")[0]
    return name or None


def _runtime_nodes(tree: ast.AST):
    """ast.walk, minus the bodies of ``if TYPE_CHECKING:`` blocks."""
    todo = [tree]
    while todo:
        node = todo.pop()
        yield node
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            todo.extend(node.orelse)
            continue
        todo.extend(ast.iter_child_nodes(node))


def import_graph(root: Path, *, built: bool = True) -> dict[str, set[str]]:
    """Module -> the modules of the same package it imports (anywhere in its source)."""
    mods = modules(root, built=built)
    graph: dict[str, set[str]] = {}
    for mod, (path, is_pkg) in mods.items():
        deps: set[str] = set()
        tree = ast.parse(path.read_text()) if path is not None else ast.Module(body=[], type_ignores=[])
        for node in _runtime_nodes(tree):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = mod.split(".") if is_pkg else mod.split(".")[:-1]
                    base = base[:len(base) - (node.level - 1)]
                    prefix = ".".join(base + ([node.module] if node.module else []))
                else:
                    prefix = node.module or ""
                # `from pkg import name`: the module pkg.name if it is one, else pkg itself
                targets = [f"{prefix}.{a.name}" if f"{prefix}.{a.name}" in mods else prefix
                           for a in node.names]
            for t in targets:
                known = _known(t, mods)
                if known is not None and known != mod:
                    deps.add(known)
        graph[mod] = deps
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
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
            visit(v)
    return found


def test_no_import_cycles():
    assert cycles(import_graph(PKG)) == []


def test_no_import_cycles_in_a_checkout_without_the_native_build():
    """Issue 43 item 5: without ``make native`` no ``*.so`` is in the tree; every extension module
    the build declares must still be known, or ``from jitckpt import _copy_hash`` reads as the
    package root and the graph finds a cycle that is not there."""
    assert {"_native", "_copy_hash"} <= set(declared_extensions(PKG.parent))
    assert cycles(import_graph(PKG, built=False)) == []


def test_the_cycle_finder_finds_one(tmp_path):
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("from .sub import a\n")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "sub" / "a.py").write_text("def f():\n    from ..b import g\n")  # lazy, still a cycle
    (pkg / "b.py").write_text("import pkg\n")
    (pkg / "c.py").write_text("import pkg.b\n")  # depends on the cycle, not part of it
    (pkg / "d.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import pkg.e\n")
    (pkg / "e.py").write_text("import pkg.d\n")  # d -> e for annotations only: no cycle
    assert cycles(import_graph(pkg)) == [["pkg", "pkg.b", "pkg.sub.a"]]


@pytest.mark.parametrize("sub", sorted(p.parent.relative_to(PKG).as_posix()
                                       for p in PKG.rglob("__init__.py") if p.parent != PKG))
def test_every_subpackage_says_what_it_owns(sub):
    doc = ast.get_docstring(ast.parse((PKG / sub / "__init__.py").read_text()))
    assert doc and len(doc) > 40, f"jitckpt/{sub}/__init__.py needs a docstring saying what it owns"

