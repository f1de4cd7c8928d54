"""``Dense``: ``z = x @ W + c`` over the last axis of ``x``."""

from __future__ import annotations

import tensorflow as tf

from jacobkit.layers.base import UnfoldedMatmul


class DenseRule(UnfoldedMatmul):
    """Closed forms of a ``Dense`` layer (Keras 3 or ``tf_keras``)."""

    kind = "dense"
    summed_starts_on_batch = True

    def pre_activation(
        self, x: tf.Tensor, kernel: tf.Variable, bias: tf.Variable | None
    ) -> tf.Tensor:
        z = tf.tensordot(x, kernel, axes=[[x.shape.rank - 1], [0]])
        return z if bias is None else z + bias

    def unfold(self, x: tf.Tensor) -> tf.Tensor:
        """``(B, ..., C)`` -> ``(B, P, C)``: the positions are the middle axes."""
        return tf.reshape(x, (x.shape[0], -1, x.shape[-1]))
