"""TensorFlow's vectorization (pfor) as the strategies run it:
:func:`vectorized_map` and :func:`jacobian` are ``tf.vectorized_map`` and
``tape.jacobian(experimental_use_pfor=True)`` with pfor's rule for a batched
matmul (``BatchMatMulV2``) replaced while they convert the gradient, by one
that never asks a matmul to broadcast a batch axis of a rank-4 operand.

NOTE (why, measured: TF 2.21, oneDNN on, an AMX Xeon). oneDNN's batched
matmul misreads an operand it broadcasts when the other has a size-1 batch
axis (the upstream report: a rank-4 by rank-2 ``tf.matmul`` corrupts the
heap; fixed after 2.21): ``(4, 1, 16, 16) @ (16, 16)`` was off by 12 (values
of order 4), ``(2, 1, 96, 64) @ (64, 64)`` killed the process, while
``(4, 2, 16, 16) @ (16, 16)`` and every shape without broadcasting were
right. pfor makes exactly these: Keras runs ``EinsumDense("abc,cd->abd")``
(attention's projections, keras_hub's dense layers) as a rank-3 by rank-2
``tf.matmul``, and pfor's rule gives the vectorized operand a leading axis of
rows, ``(rows, B, T, D) @ (D, E)``: with one example (``B = 1``; a prompt, the
last batch of a dataset) every vectorized strategy, ``batch`` included,
returned wrong Jacobians or crashed. The rule here multiplies such a product
as one 2-D matmul over the flattened rows (what pfor's own ``MatMul`` rule
does), a fixed matrix times a vectorized operand as one einsum, and
broadcasts other mismatched batch axes explicitly before the product where
one has a size-1 axis (:func:`_hazard`). The same numbers on every CPU;
TensorFlow's kernels without oneDNN were right either way.

The rule is in place only while a strategy's vectorized pass is converted
(tracing), for every thread then (another thread's pfor gets the same
products, equal in exact arithmetic), and put back after; where TensorFlow
keeps its rules elsewhere (another version), nothing is replaced.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import tensorflow as tf
from tensorflow.python.ops.parallel_for import pfor as _pfor

from jacobkit import runtime

_RULE = "BatchMatMulV2"


def vectorized_map(fn: Callable[[Any], Any], elems: Any, **kwargs: Any) -> Any:
    """``tf.vectorized_map(fn, elems, **kwargs)`` under :func:`safe_rules`."""
    with safe_rules():
        return tf.vectorized_map(fn, elems, **kwargs)


def jacobian(tape: tf.GradientTape, target: Any, sources: Any, **kwargs: Any) -> Any:
    """``tape.jacobian(target, sources, experimental_use_pfor=True,
    **kwargs)`` under :func:`safe_rules`."""
    with safe_rules():
        return tape.jacobian(target, sources, experimental_use_pfor=True, **kwargs)


def _registry() -> dict[str, Any] | None:
    found = getattr(_pfor, "_pfor_converter_registry", None)
    return found if isinstance(found, dict) and _RULE in found else None


@contextlib.contextmanager
def safe_rules() -> Iterator[None]:
    """pfor's batched-matmul rule replaced by :func:`_batch_matmul` for the
    block (nested and concurrent blocks share one replacement)."""
    registry = _registry()
    if registry is None:
        yield
        return
    with runtime.rule_replaced(
        registry, _RULE, runtime.PROCESS.pfor_rules, lambda own: _batch_matmul
    ):
        yield


def _batch_matmul(pfor_input: Any) -> Any:
    """pfor's rule for ``BatchMatMulV2`` without a broadcasting product (see
    the module's NOTE): a vectorized operand times a fixed matrix is one 2-D
    matmul over the flattened rows; a fixed matrix times a vectorized operand
    one einsum over them; otherwise both operands are broadcast to their
    common batch shape before the product where that broadcasting could be
    miscomputed (:func:`_hazard`)."""
    x, x_stacked, _ = pfor_input.input(0)
    y, y_stacked, _ = pfor_input.input(1)
    adj_x, adj_y = pfor_input.get_attr("adj_x"), pfor_input.get_attr("adj_y")
    if x_stacked and not y_stacked and y.shape.rank == 2:
        if adj_x:
            x = tf.linalg.adjoint(x)
        return _pfor.wrap(_times_matrix(x, y, adj_y), True)
    if y_stacked and not x_stacked and x.shape.rank == 2:
        if adj_y:
            y = tf.linalg.adjoint(y)
        matrix = tf.linalg.adjoint(x) if adj_x else x
        flat = tf.reshape(y, tf.concat([[-1], tf.shape(y)[-2:]], 0))
        found = tf.einsum("mk,zke->zme", matrix, flat)
        shape = tf.concat([tf.shape(y)[:-2], tf.shape(found)[-2:]], 0)
        out = tf.reshape(found, shape)
        out.set_shape(
            y.shape[:-2].concatenate(matrix.shape[:1]).concatenate(y.shape[-1:])
        )
        return _pfor.wrap(out, True)
    pfor_input.expanddim_inputs_for_broadcast()
    x, y = pfor_input.input(0)[0], pfor_input.input(1)[0]
    if _hazard(x.shape[:-2], y.shape[:-2]):
        batch = tf.broadcast_dynamic_shape(tf.shape(x)[:-2], tf.shape(y)[:-2])
        x = tf.broadcast_to(x, tf.concat([batch, tf.shape(x)[-2:]], 0))
        y = tf.broadcast_to(y, tf.concat([batch, tf.shape(y)[-2:]], 0))
    return _pfor.wrap(tf.matmul(x, y, adjoint_a=adj_x, adjoint_b=adj_y), True)


def _hazard(x: tf.TensorShape, y: tf.TensorShape) -> bool:
    """Whether a product with these batch shapes broadcasts where oneDNN
    may miscompute it: they differ, and one has an axis of size 1, or a size
    unknown while tracing. Measured right without a size-1 axis (``(4, 2,
    16, 16) @ (2, 16, 8)``, ``(32, 2, 96, 64) @ (2, 64, 64)``), so those keep
    pfor's product and its memory; copying the broadcast operand costs as
    much memory as the product's output, or more."""
    if x == y and x.is_fully_defined():
        return False
    if not (x.is_fully_defined() and y.is_fully_defined()):
        return True
    return 1 in x.as_list() or 1 in y.as_list()


def _times_matrix(x: tf.Tensor, matrix: tf.Tensor, adjoint: bool) -> tf.Tensor:
    """``x @ matrix`` (``matrix`` adjoint first where asked) over ``x``'s last
    axis as one 2-D matmul, with ``x``'s static shape kept."""
    flat = tf.reshape(x, tf.stack([-1, tf.shape(x)[-1]]))
    found = tf.matmul(flat, matrix, adjoint_b=adjoint)
    out = tf.reshape(found, tf.concat([tf.shape(x)[:-1], tf.shape(found)[-1:]], 0))
    out.set_shape(x.shape[:-1].concatenate(found.shape[-1:]))
    return out
