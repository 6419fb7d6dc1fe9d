"""The package's structure: no import cycle between its modules (imports inside functions counted), every name in a
module's ``__all__`` defined there, and the library never importing the measuring drivers (benchmarks/)."""

from __future__ import annotations

import ast
import importlib
import pkgutil
from pathlib import Path

import pytest

import lightning_edu

ROOT = Path(lightning_edu.__file__).parent


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path, modules: set[str]) -> set[str]:
    """The package modules ``path`` imports, at its top or inside a function: ``from .x import y`` counts x, and y
    too where y is itself a module."""
    name = _module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                target = f"{base}.{node.module}" if node.module else base
            else:
                target = node.module or ""
            if target in modules:
                out.add(target)
            for alias in node.names:
                if f"{target}.{alias.name}" in modules:
                    out.add(f"{target}.{alias.name}")
        elif isinstance(node, ast.Import):
            out.update(alias.name for alias in node.names if alias.name in modules)
    out.discard(name)
    # importing a submodule runs its package's __init__: a module of a package never "imports" its own package
    return {m for m in out if not name.startswith(m + ".")}


def _graph() -> dict[str, set[str]]:
    paths = sorted(ROOT.rglob("*.py"))
    modules = {_module_name(p) for p in paths}
    return {_module_name(p): _imports(p, modules) for p in paths}


def test_no_import_cycle_between_the_package_modules():
    graph = _graph()
    state, stack, cycles = {}, [], []

    def visit(node):
        state[node] = "open"
        stack.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == "open":
                cycles.append(stack[stack.index(nxt):] + [nxt])
            elif nxt not in state:
                visit(nxt)
        stack.pop()
        state[node] = "done"

    for node in sorted(graph):
        if node not in state:
            visit(node)
    assert not cycles, "import cycles: " + "; ".join(" -> ".join(c) for c in cycles)


def test_the_cycle_finder_finds_a_cycle(tmp_path, monkeypatch):
    # The check above on a package made to have one: a imports b at its top, b imports a inside a function.
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from . import b\n")
    (pkg / "b.py").write_text("def f():\n    from .a import g\n")
    modules = {"pkg", "pkg.a", "pkg.b"}
    monkeypatch.setattr(__import__(__name__), "ROOT", pkg)
    assert _imports(pkg / "a.py", modules) == {"pkg.b"} and _imports(pkg / "b.py", modules) == {"pkg.a"}


@pytest.mark.parametrize("module", sorted(m.name for m in pkgutil.walk_packages(lightning_edu.__path__, "lightning_edu.")))
def test_every_name_in_all_is_defined(module):
    mod = importlib.import_module(module)
    missing = [name for name in getattr(mod, "__all__", ()) if not hasattr(mod, name)]
    assert not missing, f"{module}.__all__ names what it does not define: {missing}"


def test_tests_mirror_the_package_folders_and_their_file_names_are_unique():
    # tests/<folder>/ for lightning_edu/<folder>/ (and benchmarks/, the drivers); the files' names unique across the
    # folders (pytest imports each test file by its name; tests/conftest.py keys the GPU durations by it).
    tests = Path(__file__).parent
    folders = {p.name for p in tests.iterdir() if p.is_dir() and any(p.glob("test_*.py"))}
    package = {p.name for p in ROOT.iterdir() if p.is_dir() and (p / "__init__.py").exists()}
    assert folders and folders <= package | {"benchmarks"}, folders - package
    names = [p.name for p in tests.rglob("test_*.py")]
    assert len(names) == len(set(names)), sorted(n for n in names if names.count(n) > 1)
