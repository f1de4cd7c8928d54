"""``batch``'s clipped sum: the norms and the scaled sum from the same
cotangents, one backward pass (ghost clipping's book-keeping)."""

from __future__ import annotations

from typing import Any

import tensorflow as tf

from jacobkit.layers.base import squared_rows
from jacobkit.layers.contract import reshaped
from jacobkit.problem import Problem
from jacobkit.problem.reduction import ClippedSum, Output
from jacobkit.strategies.batch.contract import (
    Cotangents,
    Taps,
    added,
    no_autograph,
)
from jacobkit.strategies.batch.forward import projections
from jacobkit.strategies.chunks import map_chunks

KIND = ClippedSum


@no_autograph
def contract(
    problem: Problem, taps: Taps, cotangents: Cotangents, *, summed: bool
) -> Output:
    """``reduce=jk.ClippedSum``: each target's sum of the rows' gradients
    scaled to norm at most ``clip_norm`` (over all targets together, or over
    each of its ``groups``, each to its own norm), then every row's norm
    ``(R,)`` over all targets.

    A row's gradient is linear in its cotangent, so no second backward pass
    is needed (the book-keeping of ghost clipping). Per part:

    - where its norms form every row's gradient anyway (a convolution over
      few positions, a normalization: :meth:`LayerRule.forms_rows`, and a
      layer called several times whose rule has no
      :meth:`LayerRule.shared_norms`), those gradients are kept, and the sum
      is them weighted by the scales: ``(R,) x (R, size)``;
    - elsewhere (the Gram form: a Dense layer on vectors, a tied embedding's
      lookup and logits together), the norms come from the cotangents (as
      :mod:`.norm`) and the sum is one more contraction of each call's
      cotangents, each row's scaled by ``min(1, clip_norm / norm)``.

    NOTE (measured). The conv net of ``benchmarks/reductions.py`` (batch 32,
    one core): 18.7 ms with a second contraction for every layer, against
    a 7.5 ms plain step; conv2's rows (196 positions, 288 x 64) are formed
    for their norms, and contracting them again cost as much as forming
    them.
    """
    reduce = problem.reduction
    assert isinstance(reduce, ClippedSum), "a clipped sum is asked for"
    dzs = cotangents.every_row()
    targets = problem.targets
    xs, parts = taps
    formed: dict[int, tuple[Any, Any]] = {}
    # each target's squared row norms (R,), in float32: a formed row's
    # squares summed at once (no square root to undo), a rule's norms squared
    squares: list[Any] = [None] * len(targets)
    for i, p in enumerate(projections(problem)):
        calls = [(x, dz) for x, dz, j in zip(xs, dzs, parts) if j == i]
        norms = _norms(p.rule, calls, summed=summed)
        if norms is None:
            shape = tuple(targets[p.kernel].shape)
            each = [p.rule.gradients(x, dz, shape, summed=summed) for x, dz in calls]
            # flat (R, size) once, for their norms and their weighted sum
            kernel = _flat(added([k for k, _ in each]))
            bias = None if p.bias is None else _flat(added([b for _, b in each]))
            formed[i] = (kernel, bias)
            squares[p.kernel] = squared_rows(kernel)
            if p.bias is not None:
                squares[p.bias] = squared_rows(bias)
        else:
            squares[p.kernel] = tf.square(tf.cast(norms[0], tf.float32))
            if p.bias is not None:
                squares[p.bias] = tf.square(tf.cast(norms[1], tf.float32))
    # each target's scales (R,): its group's (jk.ClippedSum(groups=...); one
    # group of every target by default)
    scales, total = reduce.target_scales(squares)
    batch, rows = int(dzs[0].shape[0]), int(dzs[0].shape[1])

    # the scales as one (1, R) row, cast once per group and dtype, and each
    # target's rows weighted by one matmul on them flattened to a static
    # shape: a tensordot per target built its shape constants and reshapes in
    # Python (188 constants and 83 reshapes of BERT tiny's 3,028-op clipped
    # sum).
    # NOTE (measured). An Einsum "zr,r...->z..." instead took the conv net of
    # benchmarks/reductions.py's clipped sum from 9.6 to 12.1 ms (one core,
    # oneDNN on); the matmul, 9.4 ms
    row_scales: dict[tuple[int, Any], Any] = {}

    def weighted(flat: Any, target: int) -> Any:  # (R, size) -> target's shape
        key = (id(scales[target]), flat.dtype)
        if key not in row_scales:
            row_scales[key] = tf.cast(tf.reshape(scales[target], (1, -1)), flat.dtype)
        found = tf.matmul(row_scales[key], flat)  # (1, size)
        if targets[target].shape.rank == 1:  # a Squeeze: no shape constant
            return tf.squeeze(found, 0)
        return tf.reshape(found, targets[target].shape)

    def contracted(i: int, p: Any, target: int) -> tuple[Any, Any]:
        """Part ``i``'s ``(kernel, bias)`` sums, the cotangents of each call
        scaled by ``target``'s scales and contracted once per call."""
        kernels: list[Any] = []
        biases: list[Any] = []
        for x, dz in ((x, d) for x, d, j in zip(xs, dzs, parts) if j == i):
            # one reshape to the cotangents' rank (two traced four graph ops)
            scale = tf.reshape(
                scales[target],
                (1 if summed else batch, rows, *[1] * (dz.shape.rank - 2)),
            )
            kernel, bias = p.rule.gradients(
                x,
                dz * tf.cast(scale, dz.dtype),
                tuple(targets[p.kernel].shape),
                summed=True,
            )
            kernels.append(_row_sum(kernel))
            biases.append(_row_sum(bias))
        return added(kernels), added(biases)

    # each part's sums in its targets' shapes and dtypes (no leading axis of
    # one to drop, nor the bias's reshape of ``placed``)
    out: list[Any] = [None] * len(targets)
    for i, p in enumerate(projections(problem)):
        if i in formed:  # the rows' gradients, weighted
            kernel, bias = formed[i]
            out[p.kernel] = weighted(kernel, p.kernel)
            if p.bias is not None and bias is not None:
                out[p.bias] = weighted(bias, p.bias)
        else:
            # the cotangents, each row's scaled, contracted once per call
            # (twice where the kernel and the bias are in groups of their
            # own: a user's grouping; the second call's kernel is left unused)
            out[p.kernel], bias = contracted(i, p, p.kernel)
            if p.bias is not None and scales[p.bias] is not scales[p.kernel]:
                bias = contracted(i, p, p.bias)[1]
            if p.bias is not None:
                out[p.bias] = bias
    return Output(tuple(_as_target(t, v) for t, v in zip(out, targets)), total)


def _flat(rows: Any) -> Any:
    """``(R, ...)`` rows as ``(R, size)`` (rows already flat as they are)."""
    if rows.shape.rank == 2:
        return rows
    return tf.reshape(rows, (-1, rows.shape[1:].num_elements()))


def _row_sum(rows: Any) -> Any:
    """``(K, ...)`` -> ``(...)``, the sum over the rows (one row: a Squeeze,
    an attribute where a sum has its axis constant)."""
    if rows.shape[0] == 1:
        return tf.squeeze(rows, 0)
    return tf.reduce_sum(rows, axis=0)


def _as_target(found: Any, target: Any) -> Any:
    """A sum in its target's shape (a bias of a rule's ``(units,)`` for
    ``EinsumDense``'s ``(heads, dim)``) and dtype."""
    return tf.cast(reshaped(found, target.shape), target.dtype)


def _norms(rule: Any, calls: list[Any], *, summed: bool) -> Any:
    """A part's row norms ``(kernel, bias)`` from its cotangents, without its
    rows formed (one call: :meth:`~jacobkit.layers.LayerRule.norms`; several:
    :meth:`~jacobkit.layers.LayerRule.shared_norms`); ``None`` where the rows
    are formed for them anyway (:meth:`~jacobkit.layers.LayerRule.forms_rows`)
    or the rule has no norms of several calls: then those rows are weighted."""
    if len(calls) > 1:
        return rule.shared_norms(calls, summed=summed)
    ((x, dz),) = calls
    if rule.forms_rows(x, dz, summed=summed):
        return None
    return rule.norms(x, dz, summed=summed, map_chunks=map_chunks)
