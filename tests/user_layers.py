"""The user's layer of ``jacobkit.layers.register``'s docstring example, one
definition for every test that registers it: ``z = x * w`` over the last
axis, its rule the per-row ``sum_p x[b, p] * G[b, p]`` (``MaterializedNorms``
gives its norms from those gradients).

The registry refuses a class registered twice and gives a subclass its
nearest registered base's rule, so :class:`Scale` itself is never
registered: each test registers its own subclass (``class _Scale(Scale)``),
unknown to ``batch`` until that test registers it.
"""

from __future__ import annotations

from typing import Any

import keras
import tensorflow as tf

from jacobkit import layers


class Scale(keras.layers.Layer):
    """A user's layer: ``x * w`` over the last axis (the register() example)."""

    def build(self, shape: Any) -> None:
        self.w = self.add_weight(shape=(shape[-1],), initializer="ones")

    def call(self, x: Any) -> Any:
        return x * self.w


class ScaleRule(layers.MaterializedNorms):
    """:class:`Scale`'s closed form (the register() example's rule)."""

    kind = "scale"
    kernel_attrs = ("w",)
    bias_attrs = ()

    def pre_activation(self, x: Any, kernel: Any, bias: Any) -> Any:
        return x * kernel

    def activation(self, z: Any) -> Any:
        return z

    def gradients(
        self, x: Any, dz: Any, kernel_shape: Any, *, summed: bool
    ) -> tuple[Any, Any]:
        n = kernel_shape[-1]
        x = tf.reshape(x, (x.shape[0], -1, n))
        g = tf.reshape(dz, (dz.shape[0], dz.shape[1], -1, n))
        per = tf.einsum("bpc,bkpc->bkc", x, g)  # (B, K, n)
        w = tf.reduce_sum(per, 0) if summed else tf.reshape(per, (-1, n))
        return w, tf.zeros((w.shape[0], 0), w.dtype)
