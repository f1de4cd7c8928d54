"""The package's shape: no import cycle (function-level imports included), no
import against the flow, and the size limits (see ``docs/architecture.md``).

Imports are read from the source with ``ast`` (nothing is imported), so a
lazy import inside a function counts like any other; imports under
``if TYPE_CHECKING:`` do not run and are left out.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "jacobkit"

#: each part of the package, by rank: a module may import its own part and
#: any part of a lower rank, never a higher one (``api -> engine -> planner
#: -> strategies -> problem -> ...``: what runs a call above what it runs).
RANKS = {
    "runtime": 0,
    "result": 1,
    "memory": 1,
    "keras": 2,
    "layers": 3,
    "problem": 4,
    "verification": 5,
    "strategies": 6,
    "planner": 7,
    "engine": 8,
    "batches": 9,
    "api": 10,
    "explain": 11,
    "__init__": 12,
    "testing": 13,
    "bench": 14,
    "cli": 15,
    "__main__": 16,
}
MAX_MODULE_LINES = 450
MAX_CLASS_LINES = 300
MAX_FUNCTION_LINES = 120
#: modules directly in ``jacobkit/`` (``__init__`` and ``__main__`` included)
MAX_TOP_LEVEL_MODULES = 8


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


MODULES = {
    _module_name(p): p
    for p in sorted(PACKAGE.rglob("*.py"))
    if "__pycache__" not in p.parts
}
PACKAGES = {_module_name(p) for p in PACKAGE.rglob("__init__.py")}


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _import_nodes(tree: ast.AST):
    """Every import statement, at any depth, but under ``if TYPE_CHECKING``."""
    stack = [tree]
    while stack:
        node = stack.pop()
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and _is_type_checking(child):
                stack.extend(child.orelse)
                continue
            if isinstance(child, ast.Import | ast.ImportFrom):
                yield child
            stack.append(child)


def _imported(name: str, path: Path) -> set[str]:
    """The jacobkit modules module ``name`` (at ``path``) imports."""
    found: set[str] = set()
    package = name if name in PACKAGES else name.rpartition(".")[0]
    for node in _import_nodes(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        else:
            base = node.module or ""
            if node.level:
                anchor = package.split(".")
                anchor = anchor[: len(anchor) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            # ``from a import b``: module ``a.b`` if there is one, else ``a``
            targets = [
                f"{base}.{alias.name}" if f"{base}.{alias.name}" in MODULES else base
                for alias in node.names
            ]
        for target in targets:
            # the longest module the name is in (``a.b.c`` -> ``a.b`` for a name
            # ``c`` defined in ``a/b.py`` or ``a/b/__init__.py``)
            while target and target not in MODULES:
                target = target.rpartition(".")[0]
            if target and target != name:
                found.add(target)
    return found


GRAPH = {name: _imported(name, path) for name, path in MODULES.items()}


def _part(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(graph.get(node, ())):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
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

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_the_import_reader_sees_lazy_and_relative_imports(tmp_path):
    """The reader itself: a function-level import and a relative one are
    edges; one under ``if TYPE_CHECKING`` is not."""
    source = tmp_path / "m.py"
    source.write_text(
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n    from jacobkit import api\n"
        "def f():\n    from jacobkit import engine\n"
        "from . import result\n"
    )
    found = _imported("jacobkit.problem.problem", source)
    assert found == {"jacobkit.engine", "jacobkit.problem"}
    assert _cycles({"a": {"b"}, "b": {"a"}, "c": {"a"}}) == [["a", "b"]]


def test_no_import_cycle():
    assert _cycles(GRAPH) == []


def test_every_part_has_a_rank():
    assert {_part(m) for m in MODULES} <= set(RANKS), (
        "a new part of the package: give it a rank in RANKS"
    )


def test_no_import_against_the_flow():
    wrong = [
        f"{a} imports {b}"
        for a, targets in GRAPH.items()
        for b in targets
        if _part(a) != _part(b) and RANKS.get(_part(a), -1) < RANKS.get(_part(b), -1)
    ]
    assert wrong == []


def test_at_most_eight_modules_at_the_top():
    top = sorted(p.name for p in PACKAGE.glob("*.py"))
    assert len(top) <= MAX_TOP_LEVEL_MODULES, top


@pytest.mark.parametrize("name", sorted(MODULES))
def test_sizes(name):
    path = MODULES[name]
    source = path.read_text()
    assert len(source.splitlines()) <= MAX_MODULE_LINES, f"{name} is too long"
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ClassDef):
            lines = node.end_lineno - node.lineno + 1
            assert lines <= MAX_CLASS_LINES, f"class {node.name}: {lines} lines"
        elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            lines = node.end_lineno - node.lineno + 1
            assert lines <= MAX_FUNCTION_LINES, f"{node.name}(): {lines} lines"
