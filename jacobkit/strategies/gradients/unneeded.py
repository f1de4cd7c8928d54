"""The inputs whose gradients a backward pass leaves out: those the tape
says it needs not (``op.skip_input_indices``) and, where the pass is taken
only towards tensors of the forward pass (``batch``'s cotangents at its
taps' ``z``, :func:`towards`), every variable read, which no such tensor
depends on. The rules of :mod:`jacobkit.strategies.gradients` read
:func:`skipped`; a ``BiasAdd``'s gradient leaves its bias's out so
(:func:`bias_rules`).

NOTE (why the reads are not needed there). A cotangent at a tensor ``t``
of the pass is carried back only through the tensors that depend on ``t``;
a variable's read depends on the variable alone. ``batch`` watches its
target variables (the tape records the pass from their reads on, the taps
found after it), so TensorFlow's tape, which carries the cotangent back
through every recorded op and past the sources, traced every target's
summed gradient, which nothing read (Grappler pruned them before the first
run).

NOTE (measured, oneDNN off, one core, loaded machine: the CPU time of the
first call in fresh processes, alternating with the code before, 11 rounds
over two runs). The conv net of ``benchmarks/reductions.py``: ``jk.gram``
233 -> 218 graph ops, its CPU time per round 0.96x the earlier median
(0.73-1.06), the clipped sum 246 -> 231 ops, 0.96x (0.84-1.01), the
projection 229 -> 214, 0.88x (0.66-1.02, 5 rounds); against the plain
step's first call (CPU) ``jk.gram`` 1.41-1.49x (was 1.40-1.54), the
clipped sum 1.31-1.36x (1.37-1.44). Steady calls run the same ops
(Grappler pruned these): the clipped sum paired with the plain step in one
process 0.92-0.96x after, 1.01-1.06x before (3 runs each, loaded).
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import tensorflow as tf

from jacobkit.strategies.gradients import rules


@dataclass
class _Towards:
    """The ends a pass goes towards, and (found when first asked) whether
    every ``BiasAdd`` of their graphs adds a variable's read."""

    ends: frozenset[Any]
    graphs: tuple[Any, ...]
    biases_read: bool | None = None


_TOWARDS: contextvars.ContextVar[_Towards | None] = contextvars.ContextVar(
    "jacobkit_gradients_towards", default=None
)

BIAS_ADD = "BiasAdd"


@contextlib.contextmanager
def towards(ends: Iterable[tf.Tensor]) -> Iterator[None]:
    """A block in which every backward pass is taken towards ``ends``, tensors
    of the forward pass, alone: gradients at what depends on none of them
    (the variables' reads) are left out (:func:`skipped`); in a graph only
    (an eager tensor tells no op)."""
    ends = list(ends)
    if not ends or not all(tf.is_symbolic_tensor(end) for end in ends):
        # eager tensors tell no ops: nothing left out
        yield
        return
    graphs = tuple({id(end.graph): end.graph for end in ends}.values())
    token = _TOWARDS.set(_Towards(frozenset(end.ref() for end in ends), graphs))
    try:
        yield
    finally:
        _TOWARDS.reset(token)


def skipped(op: Any) -> tuple[int, ...]:
    """The indices of ``op``'s inputs whose gradients are left out: the
    tape's ``skip_input_indices`` and, inside :func:`towards`, each input
    that depends on none of the ends for sure (:func:`_apart`: a
    variable's read, reshaped or cast)."""
    found = tuple(getattr(op, "skip_input_indices", None) or ())
    towards = _TOWARDS.get()
    if towards is None or op.inputs is None:
        return found
    extra = tuple(
        i
        for i, tensor in enumerate(op.inputs)
        if i not in found and _apart(tensor, towards.ends)
    )
    return found + extra


def _bias_skipped(op: Any) -> bool:
    """Whether a ``BiasAdd``'s bias gradient is left out: the tape keeps no
    inputs of a ``BiasAdd`` (its gradient needs none), so inside
    :func:`towards` wherever every ``BiasAdd`` of the ends' graphs adds a
    variable's read (looked at once per block)."""
    if op.inputs is not None:
        return 1 in skipped(op)
    towards = _TOWARDS.get()
    if towards is None or not towards.graphs:
        return False
    if towards.biases_read is None:
        towards.biases_read = all(
            _apart(found.inputs[1], towards.ends)
            for graph in towards.graphs
            for found in graph.get_operations()
            if found.type == BIAS_ADD
        )
    return towards.biases_read


def told(op: Any, skip: tuple[int, ...]) -> Any:
    """``op`` (the tape's stand-in for the forward op) telling TensorFlow's
    own gradient function to leave out ``skip`` (those that read
    ``skip_input_indices``)."""
    if skip and skip != tuple(getattr(op, "skip_input_indices", None) or ()):
        with contextlib.suppress(AttributeError):
            op.skip_input_indices = skip
    return op


#: the most ops :func:`_apart` looks at behind a tensor (past them, it is
#: taken to depend on an end)
LOOK_BACK = 32


def _apart(tensor: Any, ends: frozenset[Any]) -> bool:
    """Whether ``tensor`` depends on none of ``ends`` for sure: every op
    behind it (at most :data:`LOOK_BACK`) is looked at, none gives out an
    end (a variable's read and what reshapes or casts it)."""
    seen: set[int] = set()
    stack = [tensor]
    while stack:
        found = stack.pop()
        if found.ref() in ends:
            return False
        if not tf.is_symbolic_tensor(found):  # an eager tensor tells no op
            return False
        op = found.op
        if id(op) in seen:
            continue
        seen.add(id(op))
        if len(seen) > LOOK_BACK:
            return False
        stack.extend(op.inputs)
    return True


@contextlib.contextmanager
def bias_rules() -> Iterator[None]:
    """``BiasAdd``'s gradient replaced by :func:`_bias_add_gradient` for the
    block where :func:`~jacobkit.strategies.gradients.rules.replaces`."""
    with rules.rule_in_place(BIAS_ADD, _bias_add_gradient):
        yield


def _bias_add_gradient(own: Callable[..., Any], op: Any, grad: tf.Tensor) -> Any:
    """``BiasAdd``'s gradient without its bias's (``BiasAddGrad``) where
    :func:`skipped` leaves it out; elsewhere TensorFlow's own."""
    if not _bias_skipped(op):
        return own(op, grad)
    return [grad, None]
