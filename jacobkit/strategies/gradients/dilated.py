"""A dilated ``Conv2D``'s gradient where TensorFlow's own CPU kernels
(oneDNN off) refuse it: their ``Conv2DBackpropInput`` and
``Conv2DBackpropFilter`` raise "Current CPU implementations do not yet
support dilation rates larger than 1" (TF 2.21), though the forward
``Conv2D`` runs. :func:`jacobkit.strategies.gradients`'s rule for
``Conv2D`` takes it from here while a strategy's computation is traced, so a
user's ``tf.nn.conv2d(..., dilations=2)`` gets its Jacobian on that kind (a
plain ``tape.gradient`` of it fails there). Keras' convolution layers never
pass a dilated ``Conv2D``: ``tf.nn.convolution`` takes a dilation through
``SpaceToBatchND``.
"""

from __future__ import annotations

from typing import Any

import tensorflow as tf
from tensorflow.python.ops import gen_nn_ops as _gen_nn_ops

from jacobkit import runtime
from jacobkit.strategies.gradients import rules


def refuses_dilation(op: Any) -> bool:
    """Whether TensorFlow's own gradient of ``op`` (a ``Conv2D``) fails here:
    a dilation over 1 under TensorFlow's own CPU kernels (oneDNN off; the
    rule is never in place with a GPU visible)."""
    dilated = any(d != 1 for d in op.get_attr("dilations"))
    return dilated and not runtime.cpu_kind().onednn


def dilated_gradient(op: Any, grad: tf.Tensor) -> list[tf.Tensor]:
    """A dilated ``Conv2D``'s input and kernel gradients, ``(B, H, W, I)``
    and ``(kh, kw, I, O)`` (``NHWC``; ``NCHW`` alike), from its cotangent
    ``grad``: TensorFlow's own undilated kernels on the kernel spread out
    (:func:`spread_kernel`, zeros between its taps), whose convolution is
    the dilated one (the same window, so the same ``SAME`` padding), and the
    spread kernel's gradient at its taps. The same products plus products
    with zero: exact zeros, but for an infinite or NaN input, where the
    zero taps give NaN. Any stride and padding."""
    x, kernel = op.inputs[0], op.inputs[1]
    layout = rules.text(op.get_attr("data_format"))
    dilations = list(op.get_attr("dilations"))
    steps = dilations[1:3] if layout == "NHWC" else dilations[2:4]
    spread = spread_kernel(kernel, steps)
    common = {
        "strides": op.get_attr("strides"),
        "padding": op.get_attr("padding"),
        "explicit_paddings": op.get_attr("explicit_paddings"),
        "use_cudnn_on_gpu": op.get_attr("use_cudnn_on_gpu"),
        "data_format": layout,
    }
    grad_x = _gen_nn_ops.conv2d_backprop_input(tf.shape(x), spread, grad, **common)
    grad_spread = _gen_nn_ops.conv2d_backprop_filter(
        x, tf.shape(spread), grad, **common
    )
    grad_kernel = grad_spread[:: steps[0], :: steps[1]]
    grad_x.set_shape(x.shape)
    grad_kernel.set_shape(kernel.shape)
    return [grad_x, grad_kernel]


def spread_kernel(kernel: tf.Tensor, steps: list[int]) -> tf.Tensor:
    """``kernel`` ``(kh, kw, I, O)`` with ``steps[0] - 1`` and ``steps[1] -
    1`` rows and columns of zeros between its taps: ``((kh - 1) * dh + 1,
    (kw - 1) * dw + 1, I, O)``, whose undilated convolution is ``kernel``'s
    convolution dilated by ``steps``."""
    dh, dw = steps
    shape = tf.shape(kernel)
    apart = tf.pad(
        kernel[:, None, :, None],
        [[0, 0], [0, dh - 1], [0, 0], [0, dw - 1], [0, 0], [0, 0]],
    )
    flat = tf.reshape(
        apart, tf.stack([shape[0] * dh, shape[1] * dw, shape[2], shape[3]])
    )
    return flat[: (shape[0] - 1) * dh + 1, : (shape[1] - 1) * dw + 1]
