"""What the gradient rules of :mod:`jacobkit.strategies.gradients` share:
whether they replace anything here (:func:`replaces`), TensorFlow's registry
of gradient functions and an entry of it with its function replaced
(:func:`registry`, :func:`replaced`), and the graph a loop's invariants are
built in (:func:`enclosing_graph`, :func:`within_graph`).

A rule is in place only while a strategy's computation is traced (every
thread then: another thread's gradient gets the same numbers in exact
arithmetic), and put back after; where TensorFlow keeps its gradients
elsewhere (another version), nothing is replaced.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from typing import Any

import tensorflow as tf
from tensorflow.python.framework import ops as _ops

from jacobkit import runtime


def replaces() -> bool:
    """Whether the rules replace anything here: TensorFlow's own CPU kernels
    (oneDNN off), no GPU visible (a convolution could run there, where this
    is not measured)."""
    if tf.config.list_logical_devices("GPU"):
        return False
    return not runtime.cpu_kind().onednn


def registry(op: str) -> dict[str, Any] | None:
    """TensorFlow's registry of gradient functions by op type, where it has
    an entry for ``op`` in the layout this module knows, else ``None``."""
    found = getattr(getattr(_ops, "_gradient_registry", None), "_registry", None)
    if not isinstance(found, dict) or not isinstance(found.get(op), dict):
        return None
    return found


def replaced(entry: dict[Any, Any], rule: Callable[..., Any]) -> dict[Any, Any]:
    """The registry's ``entry`` for an op with its function replaced by
    ``rule`` (called as ``rule(own, op, grad)``, ``own`` TensorFlow's
    function; the other fields, where it was registered, kept)."""
    keys = [key for key, value in entry.items() if callable(value)]
    if len(keys) != 1:  # pragma: no cover - the layout of TF changed
        return entry
    own = entry[keys[0]]
    return {**entry, keys[0]: functools.partial(rule, own)}


@contextlib.contextmanager
def rule_in_place(op: str, rule: Callable[..., Any]) -> Iterator[None]:
    """``op``'s gradient replaced by ``rule`` (called with TensorFlow's own
    gradient function, the op and its cotangent) for the block where
    :func:`replaces` (nested and concurrent blocks share one replacement)."""
    found = registry(op) if replaces() else None
    if found is None:
        yield
        return
    with runtime.rule_replaced(
        found,
        op,
        runtime.PROCESS.gradient_rules,
        lambda entry: replaced(entry, rule),
    ):
        yield


def enclosing_graph(tensor: Any) -> Any:
    """The graph of ``tensor`` (a forward op's input) where a gradient is
    being traced in another graph inside it (a ``tf.while_loop``'s body over
    rows: ``tensor`` is the same in every iteration), else ``None``."""
    graph = getattr(tensor, "graph", None)
    current = _ops.get_default_graph()
    if graph is None or graph is current or not tf.inside_function():
        return None
    inner = getattr(current, "outer_graph", None)
    while inner is not None and inner is not graph:
        inner = getattr(inner, "outer_graph", None)
    return graph if inner is graph else None


def within_graph(graph: Any) -> Any:
    """``graph`` as the default graph for a block (``None``: the current)."""
    return graph.as_default() if graph is not None else contextlib.nullcontext()


def text(value: Any) -> str:
    """An op's string attribute as text."""
    return value.decode() if isinstance(value, bytes) else str(value)
