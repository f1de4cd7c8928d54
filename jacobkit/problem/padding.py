"""``jk.ClippedSum(clip_norm, pad_batches=True)``: a batch of loss rows
padded with examples of weight 0 up to one of a few sizes.

Each new input shape traces the compiled computation once. DP-SGD's Poisson
samples differ in size from step to step (an expected batch of 64 draws
sizes from about 40 to 90), so an unpadded training run traces once per
size it meets. Padded to :func:`bucket`'s sizes (four per doubling: ..., 32,
40, 48, 56, 64, 80, ...), they trace a few times (the DP-SGD example,
``examples/dp_sgd.py``: 6 traces where it made 41).

NOTE (why it is exact). A padded example is a copy of the batch's last one
with sample weight 0 (:func:`padded`): its loss row is ``0 * loss``, so its
gradient is exactly zero, its norm 0, its scale 1, and it adds exactly 0 to
the clipped sum. Its norm is dropped from the result (:func:`trimmed`). The
examples must not mix (no batch statistics), which a per-example loss
gradient needs anyway: ``batch`` checks it before its first run.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import numpy as np
import tensorflow as tf

from jacobkit.problem import loss as losses
from jacobkit.result import JacobianResult

#: sizes per doubling of the batch: a batch is padded by at most a quarter
#: of its size
SIZES_PER_DOUBLING = 4


def bucket(size: int) -> int:
    """The padded size of a batch of ``size`` examples: ``size`` rounded up
    to a multiple of ``2**(floor(log2(size)) - 2)`` (sizes up to 8 are
    their own)."""
    if size < 1:
        raise ValueError(f"a batch of {size} examples has nothing to pad")
    step = 2 ** max(0, size.bit_length() - 1 - (SIZES_PER_DOUBLING.bit_length() - 1))
    return -(-size // step) * step


def check(outputs: Any) -> None:
    """Refuse ``pad_batches=True`` where rows have no sample weight to set
    to 0: only a loss's rows do."""
    if not isinstance(outputs, losses.Loss):
        raise ValueError(
            "jacobian(reduce=jk.ClippedSum(..., pad_batches=True)): padding "
            "adds examples of sample weight 0, which only loss rows have; pass "
            f"outputs=jk.Loss(loss_fn), not outputs={outputs!r}."
        )


def size_of(inputs: Any) -> int:
    """The number of examples of a loss's ``(x, y[, sample_weight])``."""
    _, labels = losses.split(inputs)
    return int(np.shape(labels[0])[0])


def padded(inputs: Any, size: int) -> Any:
    """A loss's inputs ``(x, y)`` or ``(x, y, sample_weight)`` of ``n``
    examples as ``(x', y', w')`` of ``size``: ``x`` and ``y`` with their
    last example repeated, ``w'`` the weights (ones where none were given)
    followed by zeros (a batch of ``size`` gets its weights only)."""
    x, labels = losses.split(inputs)
    n = int(np.shape(labels[0])[0])
    # a batch already of its size still gets weights: every batch of one
    # size is then one structure, one trace
    extra = max(size - n, 0)

    def repeated(a: Any) -> Any:
        a = tf.convert_to_tensor(a)
        if not extra:
            return a
        return tf.concat([a, tf.repeat(a[-1:], extra, axis=0)], axis=0)

    if len(labels) > 1:
        weights = tf.convert_to_tensor(labels[1])
    else:
        weights = tf.ones((n,), tf.float32)
    zeros = tf.zeros((extra, *weights.shape[1:]), weights.dtype)
    return (
        tf.nest.map_structure(repeated, x),
        repeated(labels[0]),
        tf.concat([weights, zeros], axis=0),
    )


def trimmed(result: JacobianResult, size: int) -> JacobianResult:
    """A padded batch's result with the rows of its first ``size`` examples
    only: the norms and the rows' shape (the clipped sum has none of the
    padding's)."""
    if result.rows_shape[0] == size:
        return result
    norms = None if result.norms is None else result.norms[:size]
    return replace(result, norms=norms, rows_shape=(size, *result.rows_shape[1:]))
