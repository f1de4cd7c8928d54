"""``SeparableConv2D``: a depthwise convolution, then a 1x1 pointwise one
with the layer's bias; two parts, each with a closed form of its own (the
depthwise kernel's per-channel unfolding, the pointwise kernel's matmul over
the depthwise output)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, ClassVar

import tensorflow as tf

from jacobkit.keras import compat
from jacobkit.layers.base import LayerRule, Tapped, Weights
from jacobkit.layers.conv import Conv2DRule
from jacobkit.layers.depthwise import DepthwiseConv2DRule


class _Depthwise(DepthwiseConv2DRule):
    """The depthwise half: the layer's strides, padding and dilation; no bias
    of its own."""

    kernel_attrs: ClassVar[tuple[str, ...]] = ("depthwise_kernel",)
    bias_attrs: ClassVar[tuple[str, ...]] = ()


class _Pointwise(Conv2DRule):
    """The pointwise half: a 1x1 convolution of the depthwise output (stride
    1, no padding), with the layer's bias."""

    kernel_attrs: ClassVar[tuple[str, ...]] = ("pointwise_kernel",)

    def padded(self, x: tf.Tensor) -> tuple[tf.Tensor, str]:
        return x, "VALID"

    def _window(self) -> tuple[list[int], list[int], list[int]]:
        return [1, 1], [1, 1], [1, 1]

    def pre_activation(
        self, x: tf.Tensor, kernel: tf.Variable, bias: tf.Variable | None
    ) -> tf.Tensor:
        z = tf.nn.convolution(x, kernel, padding="VALID")
        return z if bias is None else z + bias


class SeparableConv2DRule(LayerRule):
    """Closed forms of a ``SeparableConv2D`` (Keras 3 or ``tf_keras``,
    channels last): its depthwise and pointwise kernels and its bias."""

    kind = "separable_conv2d"

    def parts(self) -> tuple[LayerRule, ...]:
        return (_Depthwise(self.layer), _Pointwise(self.layer))

    def weight(self, role: str) -> Any:
        """No single kernel (see :meth:`parts`)."""
        return None

    def unsupported(self) -> str | None:
        why = super().unsupported()
        if why is not None:
            return why
        layer = self.layer
        if compat.data_format(layer, "channels_last") != "channels_last":
            return f"data_format={layer.data_format!r} (only 'channels_last')"
        if layer.padding not in ("valid", "same"):
            return f"padding={layer.padding!r}"
        return None

    def tapped_call(
        self,
        args: tuple,
        kwargs: dict,
        weights: Weights,
        watch: Callable[[tf.Tensor], tf.Tensor],
    ) -> tuple[Any, list[Tapped]]:
        (depthwise_kernel, _), (pointwise_kernel, bias) = weights
        depthwise, pointwise = self.parts()
        middle = depthwise.tapped(args[0], depthwise_kernel, None, watch)
        out = pointwise.tapped(middle.z, pointwise_kernel, bias, watch)
        return self.activation(out.z), [middle, out]
