"""``Embedding``: ``z[b, p] = W[ids[b, p]]``, a scatter of cotangents by id."""

from __future__ import annotations

import tensorflow as tf

from jacobkit.layers.base import MaterializedNorms


class EmbeddingRule(MaterializedNorms):
    """Closed forms of an ``Embedding`` layer (Keras 3 or ``tf_keras``).

    A row's gradient is non-zero only on the rows of the table whose ids occur
    in its example: ``dr/dW[v] = sum_{p: ids[b, p] = v} G[b, p]``. It is
    returned dense, ``(R, vocabulary, dim)``; the sparse alternative (the ids
    and the ``P`` cotangent rows per example, what ``tf.IndexedSlices`` holds)
    is ``P / vocabulary`` of the size, and is what a user summing them into
    an optimizer step would want; jacobkit's results are dense.
    """

    kind = "embedding"
    kernel_attrs = ("embeddings",)
    bias_attrs = ()

    def unsupported(self) -> str | None:
        why = super().unsupported()
        if why is not None:
            return why
        if getattr(self.layer, "sparse", False):
            return "it returns sparse tensors"
        return None

    def pre_activation(
        self, x: tf.Tensor, kernel: tf.Variable, bias: tf.Variable | None
    ) -> tf.Tensor:
        return tf.gather(kernel, tf.cast(x, tf.int32))

    def activation(self, z: tf.Tensor) -> tf.Tensor:
        return z

    def gradients(
        self,
        x: tf.Tensor,
        dz: tf.Tensor,
        kernel_shape: tuple[int, ...],
        *,
        summed: bool,
    ) -> tuple[tf.Tensor, tf.Tensor]:
        """``dz`` (``(B, K, ..., D)``) scattered into the table by the ids
        ``x`` (``(B, ...)``): ``(R, vocabulary, D)``, one segment sum."""
        vocabulary, dim = kernel_shape
        batch, rows = dz.shape[0], dz.shape[1]
        ids = tf.reshape(tf.cast(x, tf.int32), (batch, -1))  # (B, P)
        positions = ids.shape[1]
        # (B * P, K, D): the cotangent rows of every position
        data = tf.reshape(
            tf.transpose(tf.reshape(dz, (batch, rows, positions, dim)), (0, 2, 1, 3)),
            (batch * positions, rows, dim),
        )
        if summed:
            table = tf.math.unsorted_segment_sum(
                data, tf.reshape(ids, (-1,)), vocabulary
            )  # (V, K, D)
            kernel = tf.transpose(table, (1, 0, 2))
        else:
            own = ids + vocabulary * tf.range(batch)[:, None]  # example b's rows
            table = tf.math.unsorted_segment_sum(
                data, tf.reshape(own, (-1,)), batch * vocabulary
            )  # (B * V, K, D)
            table = tf.reshape(table, (batch, vocabulary, rows, dim))
            kernel = tf.reshape(
                tf.transpose(table, (0, 2, 1, 3)), (batch * rows, vocabulary, dim)
            )
        count = kernel.shape[0]
        return kernel, tf.zeros((count, 0), dz.dtype)
