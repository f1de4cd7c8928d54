"""The strategies, and the one registry that names them.

A strategy is a small final class with a ``name`` and a ``build(problem)``
method (see :class:`~jacobkit.strategies.base.Strategy`). ``register`` adds one
under its name; the conformance tests run every registered strategy on every
test problem, so a new strategy is checked by registering it.

This module only re-exports: the registry lives in
:mod:`~jacobkit.strategies.registry`, the built-in strategies are registered
by :mod:`~jacobkit.strategies.builtin`.
"""

from __future__ import annotations

from jacobkit.problem.solution import Solution
from jacobkit.strategies.base import Strategy
from jacobkit.strategies.builtin import (
    Batch,
    Chunked,
    Forward,
    Grouped,
    Jacobian,
    Loop,
    Structured,
    While,
)
from jacobkit.strategies.registry import (
    REGISTRY,
    from_spec,
    get,
    names,
    register,
    to_spec,
)

__all__ = [
    "REGISTRY",
    "Batch",
    "Chunked",
    "Forward",
    "Grouped",
    "Jacobian",
    "Loop",
    "Solution",
    "Strategy",
    "Structured",
    "While",
    "from_spec",
    "get",
    "names",
    "register",
    "to_spec",
]
