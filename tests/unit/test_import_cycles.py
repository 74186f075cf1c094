"""No import cycles among the project's modules (`areal`, `schemas`, `workers`), read from the
source (AST), not by importing anything.

An import under `if TYPE_CHECKING:` runs no code and is left out. `test_no_cycle_at_import_time`
counts what runs when a module is imported: module-level imports (in `if` / `try` / `with` /
class bodies too, not in functions), and importing `a.b.c` runs the `__init__` of `a.b` first.
`test_no_cycle_even_through_deferred_imports` also counts imports inside functions: a deferred
import keeps `--help` fast, but two modules that reach for each other that way (issue 44:
`launch/ranks.py` and `launch/worker.py` for one constant; `data/sources.py` and
`data/datasets.py`) are one knot, and the fix is to move what they share, not to defer.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("areal", "schemas", "workers")
ImportNode = ast.Import | ast.ImportFrom


def modules(root: Path = ROOT, packages: tuple[str, ...] = PACKAGES) -> dict[str, Path]:
    """Dotted module name -> file, for every module of `packages` under `root`."""
    out: dict[str, Path] = {}
    for pkg in packages:
        for path in (root / pkg).rglob("*.py"):
            parts = list(path.relative_to(root).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            out[".".join(parts)] = path
    return out


def _type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def imports(tree: ast.Module, *, in_functions: bool) -> Iterator[ImportNode]:
    """The import statements of `tree`, less those under `if TYPE_CHECKING:` (and those in a
    function body unless `in_functions`)."""

    def walk(nodes: list[ast.stmt]) -> Iterator[ImportNode]:
        for node in nodes:
            if isinstance(node, ast.Import | ast.ImportFrom):
                yield node
            elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                if in_functions:
                    yield from walk(node.body)
            elif isinstance(node, ast.If):
                if not _type_checking(node.test):
                    yield from walk(node.body)
                yield from walk(node.orelse)
            else:  # class bodies, try / with / for / while / match blocks: run at import
                for name in ("body", "orelse", "finalbody", "handlers", "cases"):
                    for child in getattr(node, name, []):
                        if isinstance(child, ast.stmt):
                            yield from walk([child])
                        elif hasattr(child, "body"):  # an except handler, a match case
                            yield from walk(child.body)

    yield from walk(tree.body)


def import_graph(
    *, in_functions: bool, root: Path = ROOT, packages: tuple[str, ...] = PACKAGES
) -> dict[str, set[str]]:
    """Module -> the project's modules it imports (see the module docstring)."""
    mods = modules(root, packages)
    graph: dict[str, set[str]] = {m: set() for m in mods}

    def known(name: str) -> str | None:  # the module itself, else the closest package above
        while name and name not in mods:
            name = name.rpartition(".")[0]
        return name or None

    for mod, path in mods.items():
        package = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
        for node in imports(ast.parse(path.read_text()), in_functions=in_functions):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            else:
                base = node.module or ""
                if node.level:
                    up = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                    base = ".".join([*up, *([node.module] if node.module else [])])
                # `from pkg import mod` imports the module pkg.mod; `from mod import name`, mod
                targets = [
                    f"{base}.{a.name}" if f"{base}.{a.name}" in mods else base for a in node.names
                ]
            for target in filter(None, map(known, targets)):
                parts = target.split(".")
                for i in range(1, len(parts) + 1):  # a.b.c runs a/b/__init__ first
                    step = ".".join(parts[:i])
                    if step in mods and step != mod and not mod.startswith(step + "."):
                        graph[mod].add(step)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for root in sorted(graph):
        if root in index:
            continue
        work: list[tuple[str, Iterator[str]]] = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    top = stack.pop()
                    on_stack.discard(top)
                    component.append(top)
                    if top == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def _describe(graph: dict[str, set[str]], found: list[list[str]]) -> str:
    lines = []
    for component in found:
        members = set(component)
        lines.append(" <-> ".join(component))
        lines += [f"    {m} imports {sorted(graph[m] & members)}" for m in component]
    return "\n".join(lines)


@pytest.mark.parametrize(
    "in_functions",
    [False, True],
    ids=["test_no_cycle_at_import_time", "test_no_cycle_even_through_deferred_imports"],
)
def test_no_import_cycle(in_functions: bool) -> None:
    graph = import_graph(in_functions=in_functions)
    assert len(graph) > 100  # the walk found the project
    found = cycles(graph)
    assert not found, "import cycles:\n" + _describe(graph, found)


def test_the_check_sees_a_cycle_and_what_it_leaves_out(tmp_path):
    sources = {
        "p/__init__.py": "",
        "p/a.py": "from p import b\n",
        "p/b.py": "from . import c\nimport p.a\n",
        "p/c.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from p import a\n"
        "def f():\n    from p.b import x\n",
    }
    for name, text in sources.items():
        (tmp_path / name).parent.mkdir(exist_ok=True)
        (tmp_path / name).write_text(text)

    def found(in_functions: bool) -> list[list[str]]:
        return cycles(import_graph(in_functions=in_functions, root=tmp_path, packages=("p",)))

    assert found(False) == [["p.a", "p.b"]]  # not c: its imports are type-only or deferred
    assert found(True) == [["p.a", "p.b", "p.c"]]
