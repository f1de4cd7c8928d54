"""The kinds of convolution whose gradients TensorFlow runs: one vocabulary
for the layer registry (which kinds a layer's backward pass runs), the
traced pass (which kinds a problem's backward pass runs, read from its op
types) and the scratch probe (a tiny convolution of each kind, measured).

>>> from jacobkit.layers import convolutions
>>> convolutions.of_gradient_ops({"MatMul", "Conv2DBackpropFilter"})
frozenset({'conv2d'})
>>> convolutions.convolution("depthwise").pfor_rule
False

A ``Conv1D`` runs ``conv2d`` ops (TensorFlow adds an axis of size one), a
``DepthwiseConv1D`` ``depthwise`` ones, a separable convolution both
(``depthwise``, then a 1x1 ``conv2d``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

import tensorflow as tf


def _convolution(x: tf.Tensor, kernel: tf.Tensor) -> tf.Tensor:
    return tf.nn.convolution(x, kernel, padding="SAME")


def _depthwise(x: tf.Tensor, kernel: tf.Tensor) -> tf.Tensor:
    return tf.nn.depthwise_conv2d(x, kernel, (1, 1, 1, 1), "SAME")


@dataclass(frozen=True)
class Convolution:
    """One kind of convolution, as TensorFlow's gradient kernels see it.

    Attributes:
        kind: ``"conv2d"``, ``"conv3d"``, ``"depthwise"``.
        spatial_axes: the spatial axes of its op's input (2 or 3).
        gradient_ops: the op types of its gradient (input and kernel).
        pfor_rule: whether TensorFlow's vectorization (pfor) converts its
            gradient ops for a batched cotangent; without a rule it falls
            back to a while loop (``DepthwiseConv2dNativeBackpropInput`` and
            ``...Filter``, and ``Conv3DBackpropInputV2``, have none, TF
            2.21).
        forward: ``(x, kernel) -> y``, the op at stride 1 and ``"SAME"``
            padding (the kernel ``(*window, in, out)``; a depthwise one reads
            ``out`` as its channel multiplier).
    """

    kind: str
    spatial_axes: int
    gradient_ops: frozenset[str]
    pfor_rule: bool
    forward: Callable[[tf.Tensor, tf.Tensor], tf.Tensor]


#: every kind, each once
CONVOLUTIONS = (
    Convolution(
        "conv2d",
        2,
        frozenset({"Conv2DBackpropInput", "Conv2DBackpropFilter"}),
        True,
        _convolution,
    ),
    Convolution(
        "conv3d",
        3,
        frozenset({"Conv3DBackpropInputV2", "Conv3DBackpropFilterV2"}),
        # pfor has no rule for Conv3DBackpropInputV2 (TF 2.21): chunked
        # refuses a Conv3D before its first call, as it refuses a depthwise
        # convolution, and auto does not pick it there
        False,
        _convolution,
    ),
    Convolution(
        "depthwise",
        2,
        frozenset(
            {
                "DepthwiseConv2dNativeBackpropInput",
                "DepthwiseConv2dNativeBackpropFilter",
            }
        ),
        False,
        _depthwise,
    ),
)
#: the kinds' names, in the order of :data:`CONVOLUTIONS`
KINDS = tuple(c.kind for c in CONVOLUTIONS)


def convolution(kind: str) -> Convolution:
    """The :class:`Convolution` of ``kind``.

    Raises:
        ValueError: no such kind (the message lists them).
    """
    for found in CONVOLUTIONS:
        if found.kind == kind:
            return found
    raise ValueError(
        f"unknown convolution kind {kind!r}; choose from "
        f"{', '.join(repr(k) for k in KINDS)}"
    )


def of_gradient_ops(op_types: Iterable[str]) -> frozenset[str]:
    """The kinds of convolution whose gradient ops are among ``op_types``
    (a traced backward pass's)."""
    types = frozenset(op_types)
    return frozenset(c.kind for c in CONVOLUTIONS if c.gradient_ops & types)
