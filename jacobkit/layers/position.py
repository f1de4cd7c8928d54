"""keras_hub's ``PositionEmbedding``: ``z = table[:T]`` broadcast to the
input's shape ``(B, ..., T, D)`` (the input gives the shape only)."""

from __future__ import annotations

from typing import ClassVar

import numpy as np
import tensorflow as tf

from jacobkit.layers.base import MaterializedNorms


class PositionEmbeddingRule(MaterializedNorms):
    """A row's gradient is its cotangent at ``z`` summed over the axes before
    the positions, in the table's first ``T`` rows (zero beyond):
    ``dr/dtable[t] = sum_{...} G[b, ..., t]`` for ``t < T``. The call must
    start at position 0 (keras_hub's default; a call with ``start_index``,
    as cached decoding makes, computes another slice, and the ``batch``
    strategy's check refuses it).

    Its gradient is a lookup's whose ids are the positions
    (:meth:`lookup_ids`): ``jk.gram`` pairs a row's ``T`` rows of the table
    and the projections gather the map's rows at them, where the formed
    gradient is the whole table, zero beyond ``T``."""

    kind = "position_embedding"
    shape_only_input = True
    kernel_attrs: ClassVar[tuple[str, ...]] = ("position_embeddings",)
    bias_attrs: ClassVar[tuple[str, ...]] = ()

    def pre_activation(
        self, x: tf.Tensor, kernel: tf.Variable, bias: tf.Variable | None
    ) -> tf.Tensor:
        positions = x.shape[-2]
        table = tf.convert_to_tensor(kernel)[:positions]
        return tf.broadcast_to(table, tf.shape(x))

    def activation(self, z: tf.Tensor) -> tf.Tensor:
        return z

    def output_is_z(self) -> bool:
        return True

    def gradients(
        self,
        x: tf.Tensor,
        dz: tf.Tensor,
        kernel_shape: tuple[int, ...],
        *,
        summed: bool,
    ) -> tuple[tf.Tensor, tf.Tensor]:
        length, dim = kernel_shape
        batch, rows, positions = dz.shape[0], dz.shape[1], dz.shape[-2]
        g = tf.reduce_sum(tf.reshape(dz, (batch, rows, -1, positions, dim)), axis=2)
        g = tf.pad(g, [[0, 0], [0, 0], [0, length - positions], [0, 0]])
        if summed:
            kernel = tf.reduce_sum(g, axis=0)
        else:
            kernel = tf.reshape(g, (batch * rows, length, dim))
        return kernel, tf.zeros((kernel.shape[0], 0), dz.dtype)

    def lookup_ids(self, x: tf.Tensor) -> tf.Tensor | None:
        """Each position's row of the table, ``(B, P)``: the positions
        ``0 .. T-1`` along the input's second-to-last axis, for every index
        of the axes between (``P`` all of them, in the order ``dz`` has): a
        constant, read before the trace by ``jk.gram``
        (:mod:`jacobkit.reductions.lookup_forms`)."""
        if not x.shape[:-1].is_fully_defined():
            ids = tf.broadcast_to(tf.range(tf.shape(x)[-2]), tf.shape(x)[:-1])
            return tf.reshape(ids, (tf.shape(x)[0], -1))
        shape = tuple(x.shape[:-1].as_list())
        ids = np.broadcast_to(np.arange(shape[-1], dtype=np.int32), shape)
        return tf.constant(ids.reshape(shape[0], -1))
