"""The linear part of Dense, Conv1D and Conv2D layers, computed beside the layer.

``pre_activation`` gives a layer's pre-activation output ``z`` from its input
with the layer's own variables, reading the layer's configuration and never
calling or changing the layer. The batch strategy differentiates through it
(see the NOTE in :mod:`jacobkit.strategies.batch`).
"""

from __future__ import annotations

from typing import Any

import tensorflow as tf


def unsupported(layer: Any, kind: str) -> str | None:
    """Why ``layer``'s call is not ``activation(pre_activation(x))``, or None."""
    if getattr(layer, "lora_enabled", False):
        return "it has LoRA enabled"
    if getattr(layer, "quantization_mode", None):
        return f"it is quantized ({layer.quantization_mode})"
    if kind == "dense":
        return None
    if getattr(layer, "data_format", "channels_last") != "channels_last":
        return f"data_format={layer.data_format!r} (only 'channels_last')"
    if getattr(layer, "groups", 1) != 1:
        return f"groups={layer.groups} (only groups=1)"
    if layer.padding not in ("valid", "same", "causal"):
        return f"padding={layer.padding!r}"
    return None


def conv_padding(layer: Any, x: tf.Tensor) -> tuple[tf.Tensor, str]:
    """``x`` padded as a causal Conv1D pads it, and the TF padding name."""
    if layer.padding != "causal":
        return x, layer.padding.upper()
    left = layer.dilation_rate[0] * (layer.kernel_size[0] - 1)
    return tf.pad(x, [[0, 0], [left, 0], [0, 0]]), "VALID"


def pre_activation(
    layer: Any, kind: str, x: tf.Tensor, kernel: tf.Variable, bias: Any
) -> tf.Tensor:
    """``z = linear(x; kernel, bias)``, the layer's output before activation.

    Args:
        layer: the Keras Dense/Conv1D/Conv2D layer (its configuration is read).
        kind: ``"dense"``, ``"conv1d"`` or ``"conv2d"``.
        x: the layer's input, shape ``(B, ..., C)``.
        kernel, bias: the layer's variables (``bias`` may be ``None``).

    Returns:
        ``z``, shape of the layer's output.
    """
    if kind == "dense":
        z = tf.tensordot(x, kernel, axes=[[x.shape.rank - 1], [0]])
    else:
        padded, padding = conv_padding(layer, x)
        z = tf.nn.convolution(
            padded,
            kernel,
            strides=list(layer.strides),
            padding=padding,
            dilations=list(layer.dilation_rate),
        )
    return z if bias is None else z + bias
