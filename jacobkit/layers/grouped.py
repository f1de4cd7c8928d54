"""``Conv2D`` with ``groups > 1`` (keras.applications ConvNeXt's depthwise
convolutions are ``Conv2D(groups=channels)``): each group of ``C / g`` input
channels is convolved with its own ``F / g`` filters.

NOTE (the closed form). With ``U`` the ``(B, P, kh*kw, C)`` patches of the
input and the kernel ``W[q, i, f]`` of shape ``(kh*kw, C/g, F)``, output
channel ``f`` of group ``g(f) = f // (F/g)`` reads input channels
``g(f) * C/g + i``: ``z[b, p, f] = sum_{q, i} U[b, p, q, g(f)*C/g + i]
W[q, i, f] + c[f]``. A row with cotangent ``G = dr/dz`` has
``dr/dW[q, i, f] = sum_p U[b, p, q, g(f)*C/g + i] G[b, p, f]``: with ``U``
split as ``(B, P, kh*kw, g, C/g)`` and ``G`` as ``(B, K, P, g, F/g)``, one
einsum per (example, row) pair, no per-row backward pass.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import tensorflow as tf


def convolution(
    x: tf.Tensor,
    kernel: tf.Tensor,
    groups: int,
    conv: Callable[[tf.Tensor, tf.Tensor], tf.Tensor],
    depthwise: Callable[[tf.Tensor, tf.Tensor], tf.Tensor],
) -> tf.Tensor:
    """The grouped convolution of ``x`` (channels last) with ``kernel``
    ``(kh, kw, C/g, F)``: one ``depthwise(x, kernel (kh, kw, C, F/C))`` where
    each group has one input channel (ConvNeXt's; output channel ``c*m + j``
    is filter ``j`` of channel ``c``, as in the grouped layout), else
    ``conv`` (an ungrouped convolution with the layer's strides, padding and
    dilation) per group."""
    channels = int(x.shape[-1])
    filters = int(kernel.shape[-1])
    if int(kernel.shape[-2]) == 1 and groups == channels:
        shape = (*kernel.shape[:2], channels, filters // channels)
        return depthwise(x, tf.reshape(kernel, shape))
    xs = tf.split(x, groups, axis=-1)
    kernels = tf.split(kernel, groups, axis=-1)
    return tf.concat([conv(a, k) for a, k in zip(xs, kernels)], axis=-1)


def gradients(
    patches: tf.Tensor,
    dz: tf.Tensor,
    kernel_shape: tuple[int, ...],
    groups: int,
    *,
    summed: bool,
) -> tuple[Any, Any]:
    """Per-row kernel and bias gradients (see the NOTE): ``patches``
    ``(B, P, kh*kw*C)`` ordered as ``(kh, kw, C)``, ``dz`` ``(B, K, *z.shape[1:])``
    -> ``(R, *kernel_shape)`` and ``(R, F)``, ``R = K`` if ``summed`` else
    ``B * K``."""
    batch, rows = int(dz.shape[0]), int(dz.shape[1])
    filters = int(dz.shape[-1])
    per_group_in, per_group_out = kernel_shape[-2], filters // groups
    window = int(patches.shape[-1]) // (per_group_in * groups)
    u = tf.reshape(patches, (batch, -1, window, groups, per_group_in))
    g = tf.reshape(dz, (batch, rows, -1, groups, per_group_out))
    if summed:
        kernel = tf.einsum("bpsgi,bkpgo->ksigo", u, g)
        bias = tf.reduce_sum(g, axis=(0, 2))
    else:
        kernel = tf.einsum("bpsgi,bkpgo->bksigo", u, g)
        bias = tf.reduce_sum(g, axis=2)
    count = rows if summed else batch * rows
    return (
        tf.reshape(kernel, (count, *kernel_shape)),
        tf.reshape(bias, (count, filters)),
    )
