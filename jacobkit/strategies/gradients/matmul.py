"""TensorFlow's ``MatMul`` gradient as the strategies trace it: under
TensorFlow's own CPU kernels (oneDNN off), products of transposed copies,
not by the kernel's transpose flags (:func:`matmul_rules`).

NOTE (the matmul, measured: one core, TF 2.21, the same AVX-512 Xeon,
oneDNN off, loaded; ``benchmarks/results/cpu-onednn-off/mlp_floor.md``).
TensorFlow's ``MatMul`` gradient multiplies ``dc @ bᵀ`` with
``transpose_b`` and ``aᵀ @ dc`` with ``transpose_a``, and Eigen's kernel
runs the transposed operand far below its rate at a backward pass's
shapes: ``(256, 1024) @ (1024, 1024)ᵀ`` (one row of the MLP 512-1024-1024
at B=256, ``while``'s) at 0.25-0.30 of the GEMM probe, against 0.73-1.01
for the same product of the transposed copy; ``(4096, 1024)`` rows (16
rows stacked, ``batch``'s) at 0.88 against 1.00; ``(256, 512)ᵀ @ (256,
1024)`` at 0.48-0.74 against 0.57-0.83. A copy of the operand is one pass
over it, against the product's ``rows`` passes. The whole call (that MLP,
144 features, paired in one process, loaded): ``batch`` 0.91-0.97x its
time with the rule, ``while`` 0.47x (0.61-0.65x with the copies made in
its loop, once per row: :func:`_hoisted`). The transposed copy must
reach the ``MatMul`` as a copy (:func:`transposed_copy`). The same
products (float64: no difference at 7 and 300 rows, 6e-16 relative at one
row, where the kernel is a matrix-vector product). With oneDNN on, nothing
is replaced.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import tensorflow as tf

from jacobkit.problem.operands import Transposed
from jacobkit.strategies.gradients import rules, unneeded

_MATMUL = "MatMul"
#: the least rows of a ``MatMul``'s cotangent whose gradient
#: :func:`_matmul_gradient` takes through transposed operands (measured at
#: 256 rows and more; a copy of a weight is not worth a product of few rows)
MATMUL_ROWS = 64
#: the largest operand :func:`_matmul_gradient` copies transposed (known
#: size, bytes): the copy is held beside the product for each row in
#: flight, so a language model's head (50257 x 768 floats, 147 MiB) or a
#: long sequence's activations keep TensorFlow's transposed product
MATMUL_COPY_BYTES = 16 * 2**20


@contextlib.contextmanager
def matmul_rules() -> Iterator[None]:
    """``MatMul``'s gradient replaced by :func:`_matmul_gradient` for the
    block where :func:`~jacobkit.strategies.gradients.rules.replaces`
    (nested and concurrent blocks share one replacement)."""
    with rules.rule_in_place(_MATMUL, _matmul_gradient):
        yield


def _matmul_gradient(own: Callable[..., Any], op: Any, grad: tf.Tensor) -> Any:
    """``MatMul``'s gradient (``c = a @ b``, no transposes, real floats, at
    least :data:`MATMUL_ROWS` rows): ``dc @ bᵀ`` and ``aᵀ @ dc`` as 2-D
    matmuls of operands transposed first (:func:`transposed_copy` of ``b``
    and of ``a``, each where it is at most :data:`MATMUL_COPY_BYTES`),
    where TensorFlow's own passes ``transpose_b`` and ``transpose_a`` to the
    kernel; elsewhere TensorFlow's own (``own``). The same products (see
    the module's NOTE on the matmul)."""
    a, b = op.inputs[0], op.inputs[1]
    rows = grad.shape[0] if grad.shape.rank == 2 else None
    skip = unneeded.skipped(op)
    if (
        op.get_attr("transpose_a")
        or op.get_attr("transpose_b")
        or not grad.dtype.is_floating
        or rows is None
        or rows < MATMUL_ROWS
    ):
        # TensorFlow's own leaves out what skip_input_indices names
        return own(unneeded.told(op, skip), grad)
    grad_a = grad_b = None
    if 0 not in skip:
        if _copied(b):
            grad_a = tf.matmul(grad, _hoisted(b))
        else:
            grad_a = tf.matmul(grad, b, transpose_b=True)
    if 1 not in skip:
        if _copied(a):
            grad_b = tf.matmul(_hoisted(a), grad)
        else:
            grad_b = tf.matmul(a, grad, transpose_a=True)
    return grad_a, grad_b


def _hoisted(operand: tf.Tensor) -> tf.Tensor:
    """:func:`transposed_copy` of ``operand``, built in ``operand``'s own
    graph where the gradient is being built in a graph nested in it (a
    ``while`` loop's body, ``batch``'s loop over chunks): there it is made
    once per call, not once per row (measured: ``while``'s copies inside its
    loop took 33% of its op time on the MLP). Elsewhere (eager, the same
    graph, a graph not enclosing this one) where the gradient is built.

    Memory: a copy built outside the loop is held while the loop runs, so
    the loop holds one copy of each ``Dense`` kernel its gradient passes
    (at most :data:`MATMUL_COPY_BYTES` each) and of the targets' inputs:
    5.1 MiB on the MLP, beside its 288 MiB result; the planner's peak
    prior counts it (:func:`hoisted_bytes`)."""
    with rules.within_graph(rules.enclosing_graph(operand)):
        return transposed_copy(operand)


def hoisted_bytes(operands: Iterable[Transposed]) -> int:
    """Bytes of the transposed copies :func:`_matmul_gradient` makes of
    ``operands`` (a problem's :attr:`~jacobkit.problem.Problem.transposed`),
    each held once while a traced call's rows run (:func:`_hoisted`): those
    of products of at least :data:`MATMUL_ROWS` rows, each at most
    :data:`MATMUL_COPY_BYTES`; 0 where the rule replaces nothing
    (:func:`~jacobkit.strategies.gradients.rules.replaces`)."""
    if not rules.replaces():
        return 0
    return sum(
        o.bytes
        for o in operands
        if o.rows >= MATMUL_ROWS and o.bytes <= MATMUL_COPY_BYTES
    )


def _copied(operand: tf.Tensor) -> bool:
    """Whether :func:`_matmul_gradient` copies ``operand`` transposed: its
    size known and at most :data:`MATMUL_COPY_BYTES`."""
    count = operand.shape.num_elements()
    return count is not None and count * operand.dtype.size <= MATMUL_COPY_BYTES


def transposed_copy(matrix: tf.Tensor) -> tf.Tensor:
    """``(m, n)`` -> ``(n, m)``, a copy that a ``MatMul`` takes as it is:
    transposed as a ``(1, m, n)`` tensor. TensorFlow's graph optimizer
    (grappler's arithmetic stage) folds a rank-2 ``Transpose`` feeding a
    ``MatMul`` back into its transpose flag, which undid the rule (measured:
    ``(256, 1024) @ transpose(W)`` in a ``tf.function`` 47 ms, as with
    ``transpose_b``, 48 ms; through this copy 24 ms, against 16 ms for a
    copy made outside)."""
    shape = tf.shape(matrix)
    found = tf.reshape(
        tf.transpose(matrix[None], (0, 2, 1)), tf.stack([shape[1], shape[0]])
    )
    found.set_shape(matrix.shape[::-1])
    return found
