"""The package's shape: no import cycle (function-level imports included), no
import against the flow, no private module or name imported across packages,
``Session`` changed only by its own methods, module-level mutable state only
in three registries or in per-model slots each owned by one module, and the
size limits (see ``docs/architecture.md``).

Imports are read from the source with ``ast`` (nothing is imported), so a
lazy import inside a function counts like any other, and so does one under
``if TYPE_CHECKING:``: types point down too (a record never names a type of
a higher rank; it moves down, or the lower rank states a protocol the higher
one satisfies, as ``problem.solution.Solver``).
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
    "memory": 1,
    "keras": 2,
    "layers": 3,
    "problem": 4,
    "verification": 5,
    "strategies": 6,
    # the result holds the configured strategy that ran and auto's plan
    "result": 7,
    "planner": 8,
    "engine": 9,
    "batches": 10,
    "api": 11,
    "reach": 11,
    "reductions": 11,
    # jk.function: a Call planned once (api's rank: it runs what api runs)
    "compiled": 11,
    "explain": 12,
    # DP-SGD in Keras, on jacobian()'s clipped sum
    "privacy": 12,
    "testing": 13,
    # names every public part, jk.testing too (imported on first use)
    "__init__": 14,
    "bench": 15,
    "cli": 16,
    "__main__": 17,
}
MAX_MODULE_LINES = 400
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


def _import_nodes(tree: ast.AST) -> list[ast.Import | ast.ImportFrom]:
    """Every import statement, at any depth: inside a function, and under
    ``if TYPE_CHECKING:`` as well (a type named for type checkers only is a
    dependency all the same: it points the same way)."""
    return [n for n in ast.walk(tree) if isinstance(n, ast.Import | ast.ImportFrom)]


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


def test_the_import_reader_sees_lazy_relative_and_typing_imports(tmp_path):
    """The reader itself: a function-level import, a relative one and one
    under ``if TYPE_CHECKING`` are all edges."""
    source = tmp_path / "m.py"
    source.write_text(
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n    from jacobkit import api\n"
        "def f():\n    from jacobkit import engine\n"
        "from . import result\n"
    )
    found = _imported("jacobkit.problem.problem", source)
    assert found == {"jacobkit.api", "jacobkit.engine", "jacobkit.problem"}
    assert _cycles({"a": {"b"}, "b": {"a"}, "c": {"a"}}) == [["a", "b"]]


def test_an_import_for_type_checkers_only_still_points_the_way(tmp_path):
    """A lower rank naming a higher one's type under ``if TYPE_CHECKING:``
    (``typing.TYPE_CHECKING`` too) breaks the flow, and two modules doing it
    to each other make a cycle: what ``Call`` and ``Solution`` did before
    the ``Solver`` protocol."""
    source = tmp_path / "m.py"
    source.write_text(
        "from __future__ import annotations\n"
        "import typing\n"
        "if typing.TYPE_CHECKING:\n"
        "    from jacobkit.planner.auto import Auto\n"
        "    from jacobkit.strategies.base import Strategy\n"
    )
    name = "jacobkit.problem.call"
    found = _imported(name, source)
    assert found == {"jacobkit.planner.auto", "jacobkit.strategies.base"}
    assert _against_the_flow({name: found}) == [
        "jacobkit.problem.call imports jacobkit.planner.auto",
        "jacobkit.problem.call imports jacobkit.strategies.base",
    ]
    back = {"jacobkit.strategies.base": {name}}
    assert _cycles({name: found, **back}) == [[name, "jacobkit.strategies.base"]]


def test_no_import_cycle():
    assert _cycles(GRAPH) == []


def test_every_part_has_a_rank():
    assert {_part(m) for m in MODULES} <= set(RANKS), (
        "a new part of the package: give it a rank in RANKS"
    )


def _against_the_flow(graph: dict[str, set[str]]) -> list[str]:
    """Each import of a part of a higher rank, sorted."""
    return sorted(
        f"{a} imports {b}"
        for a, targets in graph.items()
        for b in targets
        if _part(a) != _part(b) and RANKS.get(_part(a), -1) < RANKS.get(_part(b), -1)
    )


def test_no_import_against_the_flow():
    assert _against_the_flow(GRAPH) == []


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


# -- private names stay in their package ----------------------------------------
def _package_of(module: str) -> str:
    return module if module in PACKAGES else module.rpartition(".")[0]


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def _private_imports(name: str, path: Path) -> list[str]:
    """``name``'s imports of a private jacobkit module, or of a private name
    of one, from another package."""
    wrong = []
    own = _package_of(name)
    for node in _import_nodes(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            pairs = [(alias.name, None) for alias in node.names]
        else:
            base = node.module or ""
            if node.level:
                anchor = own.split(".")
                anchor = anchor[: len(anchor) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            pairs = [
                (f"{base}.{a.name}", None)
                if f"{base}.{a.name}" in MODULES
                else (base, a.name)
                for a in node.names
            ]
        for module, imported in pairs:
            if not module.startswith("jacobkit"):
                continue
            target = module
            while target and target not in MODULES:
                target = target.rpartition(".")[0]
            if not target or _package_of(target) == own:
                continue
            if any(_private(part) for part in target.split(".")) or (
                imported is not None and _private(imported)
            ):
                wrong.append(
                    f"{name} imports {target}{'.' + imported if imported else ''}"
                )
    return wrong


def test_the_private_import_reader(tmp_path):
    source = tmp_path / "m.py"
    source.write_text(
        "from jacobkit.strategies import _seeds\n"
        "from jacobkit.strategies.base import _block\n"
        "from jacobkit.strategies import base\n"
    )
    assert _private_imports("jacobkit.planner.calls", source) == [
        "jacobkit.planner.calls imports jacobkit.strategies._seeds",
        "jacobkit.planner.calls imports jacobkit.strategies.base._block",
    ]
    assert _private_imports("jacobkit.strategies.chunked", source) == []


def test_no_private_module_or_name_is_imported_across_packages():
    wrong = [w for name, path in MODULES.items() for w in _private_imports(name, path)]
    assert wrong == []


# -- Session changes only through its own methods ---------------------------------
SESSION = "jacobkit.planner.session"


def test_session_state_is_private():
    """Every attribute a ``Session`` sets is private (others read properties)."""
    tree = ast.parse(MODULES[SESSION].read_text())
    (cls,) = [
        n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "Session"
    ]
    public = {
        t.attr
        for node in ast.walk(cls)
        if isinstance(node, ast.Assign | ast.AugAssign | ast.AnnAssign)
        for t in (node.targets if isinstance(node, ast.Assign) else [node.target])
        if isinstance(t, ast.Attribute)
        and isinstance(t.value, ast.Name)
        and t.value.id == "self"
        and not t.attr.startswith("_")
    }
    assert public == set()


def test_no_module_but_the_session_writes_a_session():
    """Outside ``planner/session.py`` nothing assigns to ``session.<x>`` or
    reads its private state: a session changes through its methods only."""
    wrong = []
    for name, path in MODULES.items():
        if name == SESSION:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.Attribute):
                continue
            root = node.value
            if not (isinstance(root, ast.Name) and "session" in root.id.lower()):
                continue
            if isinstance(node.ctx, ast.Store | ast.Del) or node.attr.startswith("_"):
                wrong.append(f"{name}:{node.lineno}: {root.id}.{node.attr}")
    assert wrong == []


# -- module-level mutable state ---------------------------------------------------
#: every module-level mutable registry of the library, and why it is one; at
#: most three (a new one goes into one of these). Per-model state is not
#: here: each module keeping some declares its own ``PerModel`` slot (below).
MODULE_STATE = {
    "jacobkit.runtime.PROCESS": "process-wide state: facts measured once, "
    "one-time notices, the peak-memory blocks open",
    "jacobkit.strategies.registry.REGISTRY": "the strategies, by name",
    "jacobkit.layers.REGISTRY": "the layer kinds: their facts and closed forms",
}
MAX_MODULE_STATE = 3
#: ``problem.cache.PerModel``: one owner's per-model state
_SLOT_CLASS = "PerModel"
_CONTAINERS = {
    "dict",
    "list",
    "set",
    "WeakKeyDictionary",
    "WeakValueDictionary",
    "WeakSet",
    "defaultdict",
    "OrderedDict",
    "deque",
    "Counter",
}
#: decorators and calls whose function keeps every trace it made
_TRACED = {"tf.function", "tensorflow.function"}
_MUTATORS = {
    "append",
    "extend",
    "insert",
    "remove",
    "pop",
    "popitem",
    "clear",
    "add",
    "discard",
    "update",
    "setdefault",
}


def _root(node: ast.expr) -> list[str]:
    """``a.b[c].d`` -> ``["a", "b", "d"]`` (the names along the chain)."""
    names: list[str] = []
    while isinstance(node, ast.Attribute | ast.Subscript):
        if isinstance(node, ast.Attribute):
            names.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        names.append(node.id)
    return names[::-1]


def _module_state(name: str, source: str) -> set[str]:
    """Module-level names of ``name`` that hold mutable state: bound at the
    top to an empty container (``dict()``, ``WeakKeyDictionary()``, ...), or
    to a table or object that some statement in the module mutates (an item
    or attribute set, a mutating method called); and functions cached with
    ``functools.cache``/``lru_cache``."""
    tree = ast.parse(source)
    bound: dict[str, ast.expr] = {}
    found = set()
    for node in tree.body:
        if isinstance(node, ast.Assign):
            for t in node.targets:
                if isinstance(t, ast.Name):
                    bound[t.id] = node.value
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            if node.value is not None:
                bound[node.target.id] = node.value
        elif isinstance(node, ast.FunctionDef):
            for d in node.decorator_list:
                text = ast.unparse(d).split("(")[0]
                # a module-level tf.function keeps its traces for the process
                if text.split(".")[-1] in ("cache", "lru_cache") or text in _TRACED:
                    found.add(f"{name}.{node.name}")
    mutated: set[str] = set()
    for node in ast.walk(tree):
        targets: list[ast.expr] = []
        if isinstance(node, ast.Assign):
            targets = [t for t in node.targets if not isinstance(t, ast.Name)]
        elif isinstance(node, ast.AugAssign | ast.AnnAssign):
            targets = [node.target] if not isinstance(node.target, ast.Name) else []
        elif isinstance(node, ast.Delete):
            targets = [t for t in node.targets if not isinstance(t, ast.Name)]
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr in _MUTATORS
        ):
            targets = [node.func.value]
        for t in targets:
            chain = _root(t)
            if chain and chain[0] != "self":
                mutated.add(chain[0])
    for variable, value in bound.items():
        # an empty container made at the top is made to be filled; a table
        # written out (or any other object) counts where it is changed
        made_empty = isinstance(value, ast.Call) and (
            ast.unparse(value.func).split(".")[-1] in (*_CONTAINERS, _SLOT_CLASS)
            or ast.unparse(value.func) in _TRACED
        )
        changeable = isinstance(
            value,
            ast.Dict | ast.List | ast.Set | ast.DictComp | ast.ListComp | ast.Call,
        )
        if made_empty or (variable in mutated and changeable):
            found.add(f"{name}.{variable}")
    return found


def test_the_module_state_reader():
    source = (
        "import functools, weakref\n"
        "TABLE = {'a': 1}\n"
        "_CACHE = weakref.WeakKeyDictionary()\n"
        "_PASSED = weakref.WeakKeyDictionary()\n"
        "_SEEN: set[str] = set()\n"
        "STATE = Process()\n"
        "def f(k):\n    _CACHE.setdefault(k, {})\n    _SEEN.add(k)\n"
        "    STATE.facts[k] = 1\n"
        "@functools.cache\ndef g():\n    return TABLE['a'], h(_PASSED)\n"
        "@tf.function(reduce_retracing=True)\ndef traced(x):\n    return x\n"
        "COMPILED = tf.function(g)\n"
        "_KEPT = cache.PerModel('what it keeps')\n"
    )
    assert _module_state("m", source) == {
        "m._KEPT",
        "m._CACHE",
        "m._PASSED",
        "m._SEEN",
        "m.STATE",
        "m.g",
        "m.traced",
        "m.COMPILED",
    }


def _is_slot(node: ast.AST) -> bool:
    """``PerModel(...)`` (or ``cache.PerModel(...)``)."""
    return (
        isinstance(node, ast.Call)
        and ast.unparse(node.func).split(".")[-1] == _SLOT_CLASS
    )


def _declared_slots(tree: ast.Module) -> dict[str, ast.Assign]:
    """The module-level ``_NAME = PerModel("what it keeps")`` of a module."""
    return {
        node.targets[0].id: node
        for node in tree.body
        if isinstance(node, ast.Assign)
        and len(node.targets) == 1
        and isinstance(node.targets[0], ast.Name)
        and _is_slot(node.value)
    }


def _from_imports(name: str, tree: ast.Module):
    """``(module, imported name)`` of every ``from module import name``."""
    for node in _import_nodes(tree):
        if not isinstance(node, ast.ImportFrom):
            continue
        base = node.module or ""
        if node.level:
            anchor = _package_of(name).split(".")
            anchor = anchor[: len(anchor) - node.level + 1]
            base = ".".join([*anchor, base] if base else anchor)
        for alias in node.names:
            yield base, alias.name


def _slot_violations(sources: dict[str, str]) -> list[str]:
    """Per-model slots not owned by one module: a ``PerModel`` made anywhere
    but as a module-level private name with a literal saying what it keeps;
    a slot used in its module other than as ``_SLOT.of(model)`` (passed on,
    returned, stored, its ``of`` handed out); another module's slot imported
    or reached as an attribute."""
    trees = {name: ast.parse(source) for name, source in sources.items()}
    declared = {name: _declared_slots(tree) for name, tree in trees.items()}
    everywhere = {slot for slots in declared.values() for slot in slots}
    wrong = []
    for name, tree in trees.items():
        own = declared[name]
        for slot, node in own.items():
            what = node.value.args[0] if node.value.args else None
            if not _private(slot) or not (
                isinstance(what, ast.Constant)
                and isinstance(what.value, str)
                and what.value.strip()
            ):
                wrong.append(f"{name}.{slot}: not a private name saying what it keeps")
        made_here = {id(node.value) for node in own.values()}
        parents = {
            id(child): parent
            for parent in ast.walk(tree)
            for child in ast.iter_child_nodes(parent)
        }
        for node in ast.walk(tree):
            if _is_slot(node) and id(node) not in made_here:
                wrong.append(f"{name}:{node.lineno}: a PerModel made below the top")
            elif isinstance(node, ast.Name) and node.id in own:
                if isinstance(node.ctx, ast.Store) and id(node) in {
                    id(n.targets[0]) for n in own.values()
                }:
                    continue
                used = parents.get(id(node))
                called = parents.get(id(used))
                if not (
                    isinstance(used, ast.Attribute)
                    and used.attr == "of"
                    and isinstance(called, ast.Call)
                    and called.func is used
                ):
                    wrong.append(f"{name}:{node.lineno}: {node.id} handed on")
            elif isinstance(node, ast.Attribute) and node.attr in everywhere:
                wrong.append(f"{name}:{node.lineno}: another module's {node.attr}")
        for module, imported in _from_imports(name, tree):
            if module != name and imported in declared.get(module, {}):
                wrong.append(f"{name} imports {module}.{imported}")
    return sorted(wrong)


def test_the_slot_rule_catches_a_shared_slot():
    """The rule itself: one slot used by two modules, or handed to another,
    or made elsewhere than at a module's top, is caught."""
    sources = {
        "jacobkit.a": (
            "from jacobkit.problem.cache import PerModel\n"
            "_KEPT = PerModel('compiled functions')\n"
            "def get(model, key):\n    return _KEPT.of(model).get(key)\n"
        ),
        "jacobkit.b": (
            "from jacobkit.a import _KEPT\n"
            "from jacobkit import a\n"
            "def get(model):\n    return _KEPT.of(model), a._KEPT.of(model)\n"
        ),
        "jacobkit.c": (
            "SHARED = PerModel(WHAT)\n"
            "_OWN = PerModel('verdicts')\n"
            "def hand(model):\n    helper(_OWN)\n    return _OWN.of\n"
            "def made():\n    return PerModel('inside')\n"
        ),
    }
    assert _slot_violations(sources) == [
        "jacobkit.b imports jacobkit.a._KEPT",
        "jacobkit.b:4: another module's _KEPT",
        "jacobkit.c.SHARED: not a private name saying what it keeps",
        "jacobkit.c:4: _OWN handed on",
        "jacobkit.c:5: _OWN handed on",
        "jacobkit.c:7: a PerModel made below the top",
    ]
    assert _slot_violations({"jacobkit.a": sources["jacobkit.a"]}) == []


def test_every_per_model_slot_is_owned_by_its_module():
    sources = {name: path.read_text() for name, path in MODULES.items()}
    assert _slot_violations(sources) == []


def test_module_level_state_is_a_registry_or_an_owned_slot():
    """Module-level mutable state: one of the registries, or a per-model
    slot (checked to be owned by its module above)."""
    found = set()
    for name, path in MODULES.items():
        source = path.read_text()
        slots = {f"{name}.{slot}" for slot in _declared_slots(ast.parse(source))}
        found |= _module_state(name, source) - slots
    assert found <= set(MODULE_STATE), sorted(found - set(MODULE_STATE))
    assert len(MODULE_STATE) <= MAX_MODULE_STATE


# -- how far one call reaches -------------------------------------------------------
#: modules a steady default call entered before the second design step
#: (``benchmarks/call_walk.py`` on the code before it: 34)
MODULES_OF_A_STEADY_CALL = 34


def test_a_steady_default_call_enters_fewer_modules_than_before():
    """One steady ``auto`` call on the generator (``benchmarks/call_walk.py``):
    33 modules, 10 deep, when this was written; it must stay below the 34 of
    the code before the design step."""
    from benchmarks.call_walk import steady_default_call

    found = steady_default_call()
    assert len(found.modules) < MODULES_OF_A_STEADY_CALL, sorted(found.modules)
    assert "jacobkit.batches.collect" not in found.modules  # one array: no batches
