"""``DepthwiseConv2D``: each input channel convolved with its own ``m``
filters, unfolded per channel."""

from __future__ import annotations

from typing import ClassVar

import tensorflow as tf

from jacobkit.layers.base import MaterializedNorms
from jacobkit.layers.conv import ConvRule


class DepthwiseConv2DRule(MaterializedNorms, ConvRule):
    """``z[b, p, c*m + j] = sum_q U[b, p, q, c] W[q, c, j] + bias``, ``U`` the
    ``(B, P, kh*kw, C)`` patches: a row's ``dr/dW[q, c, j] = sum_p U[b, p, q,
    c] G[b, p, c, j]``, one einsum per channel group."""

    kind = "depthwise_conv2d"
    # Keras 3 holds it as ``kernel``, tf_keras as ``depthwise_kernel``
    kernel_attrs: ClassVar[tuple[str, ...]] = ("depthwise_kernel", "kernel")

    def unsupported(self) -> str | None:
        why = super().unsupported()
        if why is not None:
            return why
        if self.layer.padding == "causal":
            return "padding='causal'"
        return None

    def pre_activation(
        self, x: tf.Tensor, kernel: tf.Variable, bias: tf.Variable | None
    ) -> tf.Tensor:
        layer = self.layer
        z = tf.nn.depthwise_conv2d(
            x,
            kernel,
            strides=[1, *layer.strides, 1],
            padding=layer.padding.upper(),
            dilations=list(layer.dilation_rate),
        )
        return z if bias is None else z + bias

    def gradients(
        self,
        x: tf.Tensor,
        dz: tf.Tensor,
        kernel_shape: tuple[int, ...],
        *,
        summed: bool,
    ) -> tuple[tf.Tensor, tf.Tensor]:
        kh, kw, channels, multiplier = kernel_shape
        batch, rows = dz.shape[0], dz.shape[1]
        patches = tf.reshape(self.unfold(x), (batch, -1, kh * kw, channels))
        g = tf.reshape(dz, (batch, rows, -1, channels, multiplier))  # (B,K,P,C,m)
        if summed:
            kernel = tf.einsum("bpqc,bkpcj->kqcj", patches, g)
            bias = tf.reduce_sum(g, axis=(0, 2))
        else:
            kernel = tf.einsum("bpqc,bkpcj->bkqcj", patches, g)
            bias = tf.reduce_sum(g, axis=2)
        count = rows if summed else batch * rows
        return (
            tf.reshape(kernel, (count, *kernel_shape)),
            tf.reshape(bias, (count, channels * multiplier)),
        )
