"""The per-row kernel and bias gradients of a layer that is linear in them,
``z[b, p] = U[b, p] @ W + c`` with ``U`` its unfolded input
(:meth:`jacobkit.layers.LayerRule.unfold`), contracted in closed form."""

from __future__ import annotations

from collections.abc import Sequence

import tensorflow as tf


def reshaped(tensor: tf.Tensor, shape: Sequence[int]) -> tf.Tensor:
    """``tensor`` reshaped to ``shape``, unless its static shape is that
    already (no Reshape traced where it would change nothing: the conv net's
    head's cotangents, three of them six graph ops)."""
    if tensor.shape.is_fully_defined() and tuple(tensor.shape) == tuple(shape):
        return tensor
    return tf.reshape(tensor, shape)


def per_example_matmul(patches: tf.Tensor, cotangents: tf.Tensor) -> tf.Tensor:
    """``out[b, k] = patches[b]ᵀ @ cotangents[b, k]``: ``(B, P, I)`` and
    ``(B, K, P, O)`` -> ``(B, K, I, O)``, one broadcasting batched matmul.

    Measured on CPU (B=64, K=144, P=64, I=40, O=32): 90 ms, against 383 ms
    for the same ``tf.einsum("bpi,bkpo->bkio")``, which transposes its output.
    One row per example (a loss): a rank-3 matmul of the patches as they
    are, transposed by the kernel (B=32, P=196, I=288, O=64: 1.9 ms against
    2.5 ms, one core).
    """
    if cotangents.shape[1] == 1:
        # Squeeze and ExpandDims: no strided slices (their begin, end and
        # strides constants, per target)
        found = tf.matmul(patches, tf.squeeze(cotangents, 1), transpose_a=True)
        return tf.expand_dims(found, 1)
    return tf.matmul(tf.transpose(patches, (0, 2, 1))[:, None], cotangents)


def summed_matmul(patches: tf.Tensor, cotangents: tf.Tensor) -> tf.Tensor:
    """``out[k] = sum_b patches[b]ᵀ @ cotangents[b, k]``: ``(B, P, I)`` and
    ``(B, K, P, O)`` -> ``(K, I, O)`` (53 ms against ``tf.einsum``'s 158 ms,
    same sizes as :func:`per_example_matmul`)."""
    batch, rows, positions, units = cotangents.shape
    flat = tf.reshape(patches, (batch * positions, patches.shape[-1]))
    by_row = tf.reshape(
        tf.transpose(cotangents, (1, 0, 2, 3)), (rows, batch * positions, units)
    )
    return tf.matmul(flat, by_row, transpose_a=True)


def summed_gradients_by_row(
    patches: tf.Tensor, dz: tf.Tensor, kernel_shape: tuple[int, ...]
) -> tuple[tf.Tensor, tf.Tensor]:
    """Rows summed over the batch from row-major cotangents: ``patches``
    ``(B, P, I)`` and ``dz`` ``(K, B, *z.shape[1:])`` -> the ``K`` rows'
    kernel ``(K, *kernel_shape)`` and bias ``(K, units)`` gradients (the
    closed form of :func:`kernel_and_bias_gradients`, ``summed``).

    One broadcasting batched matmul straight from ``dz``'s layout, with no
    transpose of the cotangents, the patches transposed once (a contiguous
    ``(I, B * P)``): on the MLP 512-1024-1024-144 (B=256, 16 rows), 48 ms
    against 56 ms with ``transpose_a=True`` instead, 77 ms for
    ``tf.einsum("bi,kbj->kij")``, and a further 2 transposes for
    :func:`summed_matmul` (one core).
    """
    rows, units = dz.shape[0], dz.shape[-1]
    flat = tf.reshape(patches, (-1, patches.shape[-1]))  # (B * P, I)
    cotangents = tf.reshape(dz, (rows, -1, units))  # (K, B * P, O)
    kernel = tf.matmul(tf.transpose(flat)[None], cotangents)
    bias = tf.reduce_sum(cotangents, axis=1)
    return tf.reshape(kernel, (rows, *kernel_shape)), bias


def kernel_and_bias_gradients(
    patches: tf.Tensor,
    dz: tf.Tensor,
    kernel_shape: tuple[int, ...],
    *,
    summed: bool,
) -> tuple[tf.Tensor, tf.Tensor]:
    """Per-row gradients of the kernel and bias from the cotangents at ``z``.

    NOTE (the closed form). ``z[b, p, o] = sum_i U[b, p, i] W[i, o] + c[o]``
    with ``U = unfold(x)``, so a row ``r`` with cotangent ``G = dr/dz`` has
    ``dr/dW[i, o] = sum_{b, p} U[b, p, i] G[b, p, o]`` and
    ``dr/dc[o] = sum_{b, p} G[b, p, o]`` (BackPACK's and Opacus's per-sample
    rules). A row of example ``b`` only has ``G`` zero outside ``b``, so its
    gradient is the same sum over ``p`` alone: one batched einsum for every
    (example, row) pair, no loop and no per-row backward pass.

    Args:
        patches: the unfolded layer input ``U``, ``(B, P, I)``.
        dz: ``(B, K, *z.shape[1:])``, ``dz[b, k] = dP[b, k] / dz[b]``.
        kernel_shape: the kernel's shape.
        summed: rows summed over the batch (``"features"``): gradients of the
            ``K`` rows ``sum_b P[b, k]``; otherwise of the ``B × K`` rows
            ``P[b, k]``, row-major.

    Returns:
        ``(kernel, bias)`` gradients, ``(R, *kernel_shape)`` and
        ``(R, units)`` with ``R = K`` if ``summed`` else ``B * K``.
    """
    batch, rows = dz.shape[0], dz.shape[1]
    units = dz.shape[-1]
    if rows == 1:
        return _one_row(patches, dz, kernel_shape, summed=summed)
    cotangents = tf.reshape(dz, (batch, rows, -1, units))  # (B, K, P, O)
    if summed:
        kernel = summed_matmul(patches, cotangents)
        bias = tf.reduce_sum(cotangents, axis=(0, 2))
    else:
        kernel = per_example_matmul(patches, cotangents)
        bias = tf.reduce_sum(cotangents, axis=2)
    count = rows if summed else batch * rows
    return (
        tf.reshape(kernel, (count, *kernel_shape)),
        tf.reshape(bias, (count, units)),
    )


def _one_row(
    patches: tf.Tensor,
    dz: tf.Tensor,
    kernel_shape: tuple[int, ...],
    *,
    summed: bool,
) -> tuple[tf.Tensor, tf.Tensor]:
    """:func:`kernel_and_bias_gradients` of one row per example (a loss),
    ``dz`` ``(B, 1, *z.shape[1:])``: the same matmuls and sums with no row
    axis to carry. NOTE (why). Its reshape to ``(B, 1, P, O)``, a Squeeze,
    an ExpandDims after the matmul and the bias's reshape traced nine graph
    ops per convolution of the conv net's first clipped sum, a transpose and
    another reshape more where summed."""
    batch, units = dz.shape[0], dz.shape[-1]
    if summed:  # (B * P, I)ᵀ (B * P, O): one 2-D matmul
        flat = tf.reshape(patches, (-1, patches.shape[-1]))
        cotangents = tf.reshape(dz, (-1, units))  # (B * P, O)
        kernel = tf.matmul(flat, cotangents, transpose_a=True)
        bias = tf.reduce_sum(cotangents, axis=0, keepdims=True)
        return tf.reshape(kernel, (1, *kernel_shape)), bias
    cotangents = tf.reshape(dz, (batch, -1, units))  # (B, P, O)
    kernel = tf.matmul(patches, cotangents, transpose_a=True)  # (B, I, O)
    bias = tf.reduce_sum(cotangents, axis=1)
    return tf.reshape(kernel, (batch, *kernel_shape)), bias
