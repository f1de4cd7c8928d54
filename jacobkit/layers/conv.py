"""``Conv1D`` and ``Conv2D`` (channels last, ``groups=1``):
``z = conv(x, W) + c``, unfolded into patches."""

from __future__ import annotations

import tensorflow as tf

from jacobkit.keras import compat
from jacobkit.layers.base import LayerRule, UnfoldedMatmul


class ConvRule(LayerRule):
    """Closed forms of a channels-last convolution (Keras 3 or ``tf_keras``)."""

    def unsupported(self) -> str | None:
        layer = self.layer
        why = super().unsupported()
        if why is not None:
            return why
        if compat.data_format(layer, "channels_last") != "channels_last":
            return f"data_format={layer.data_format!r} (only 'channels_last')"
        if compat.groups(layer) != 1:
            return f"groups={layer.groups} (only groups=1)"
        if layer.padding not in ("valid", "same", "causal"):
            return f"padding={layer.padding!r}"
        return None

    def padded(self, x: tf.Tensor) -> tuple[tf.Tensor, str]:
        """``x`` padded as a causal Conv1D pads it, and the TF padding name."""
        layer = self.layer
        if layer.padding != "causal":
            return x, layer.padding.upper()
        left = layer.dilation_rate[0] * (layer.kernel_size[0] - 1)
        return tf.pad(x, [[0, 0], [left, 0], [0, 0]]), "VALID"

    def pre_activation(
        self, x: tf.Tensor, kernel: tf.Variable, bias: tf.Variable | None
    ) -> tf.Tensor:
        padded, padding = self.padded(x)
        z = tf.nn.convolution(
            padded,
            kernel,
            strides=list(self.layer.strides),
            padding=padding,
            dilations=list(self.layer.dilation_rate),
        )
        return z if bias is None else z + bias

    def unfold(self, x: tf.Tensor) -> tf.Tensor:
        """``(B, P, I)`` patches (``tf.image.extract_patches``, with the
        layer's strides, dilation and padding), ``I = prod(kernel_size) * C``
        ordered as the kernel's leading axes."""
        return self._patches(*self.padded(x), *self._window())

    def _window(self) -> tuple[list[int], list[int], list[int]]:
        layer = self.layer
        return list(layer.kernel_size), list(layer.strides), list(layer.dilation_rate)

    @staticmethod
    def _patches(x, padding, sizes, strides, rates) -> tf.Tensor:
        patches = tf.image.extract_patches(
            x,
            sizes=[1, *sizes, 1],
            strides=[1, *strides, 1],
            rates=[1, *rates, 1],
            padding=padding,
        )
        return tf.reshape(patches, (x.shape[0], -1, patches.shape[-1]))


class Conv2DRule(UnfoldedMatmul, ConvRule):
    kind = "conv2d"


class Conv1DRule(UnfoldedMatmul, ConvRule):
    """A Conv1D is unfolded as a Conv2D of height 1."""

    kind = "conv1d"

    def unfold(self, x: tf.Tensor) -> tf.Tensor:
        padded, padding = self.padded(x)
        sizes, strides, rates = self._window()
        return self._patches(
            padded[:, None], padding, [1, *sizes], [1, *strides], [1, *rates]
        )
