"""``Conv1D`` and ``Conv2D`` (channels last): ``z = conv(x, W) + c``,
unfolded into patches; a ``Conv2D`` with ``groups > 1`` by
:mod:`jacobkit.layers.grouped`."""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import tensorflow as tf

from jacobkit.keras import compat
from jacobkit.layers import grouped
from jacobkit.layers.base import LayerRule, UnfoldedMatmul, row_norms


class ConvRule(LayerRule):
    """Closed forms of a channels-last convolution (Keras 3 or ``tf_keras``)."""

    #: the rule computes ``groups > 1`` (:mod:`jacobkit.layers.grouped`)
    grouped_ok = False

    def unsupported(self) -> str | None:
        layer = self.layer
        why = super().unsupported()
        if why is not None:
            return why
        if compat.data_format(layer, "channels_last") != "channels_last":
            return f"data_format={layer.data_format!r} (only 'channels_last')"
        if compat.groups(layer) != 1 and not self.grouped_ok:
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
        strides = list(self.layer.strides)
        dilations = list(self.layer.dilation_rate)
        groups = compat.groups(self.layer)
        if groups == 1:
            z = tf.nn.convolution(
                padded, kernel, strides=strides, padding=padding, dilations=dilations
            )
        else:
            z = grouped.convolution(
                padded,
                tf.convert_to_tensor(kernel),
                groups,
                lambda a, k: tf.nn.convolution(
                    a, k, strides=strides, padding=padding, dilations=dilations
                ),
                lambda a, k: tf.nn.depthwise_conv2d(
                    a, k, strides=[1, *strides, 1], padding=padding, dilations=dilations
                ),
            )
        return z if bias is None else z + bias

    def unfold(self, x: tf.Tensor) -> tf.Tensor:
        """``(B, P, I)`` patches (with the layer's strides, dilation and
        padding, :func:`patches`), ``I = prod(kernel_size) * C`` ordered as
        the kernel's leading axes."""
        return patches(*self.padded(x), *self._window())

    def unfold_times(self, x: tf.Tensor, matrix: np.ndarray) -> tf.Tensor:
        """``unfold(x) @ matrix`` as the layer's own convolution of ``x``
        with ``matrix`` (``(I, s)``) as its kernel ``(*kernel_size, C, s)``:
        the patches are never formed.

        NOTE (measured, one core, oneDNN on). ``jk.Project(2048)`` on the
        conv net of ``benchmarks/reductions.py``: conv2's unfold (a gather,
        1.2 ms) and its product with the left factor (1.1 ms) became one
        fused convolution."""
        if compat.groups(self.layer) != 1:
            return super().unfold_times(x, matrix)
        padded, padding = self.padded(x)
        sizes, strides, rates = self._window()
        kernel = tf.reshape(
            tf.cast(matrix, x.dtype), (*sizes, int(x.shape[-1]), int(matrix.shape[1]))
        )
        mapped = tf.nn.convolution(
            padded, kernel, strides=strides, padding=padding, dilations=rates
        )
        batch, positions = x.shape[0], math.prod(mapped.shape[1:-1])
        return tf.reshape(mapped, (-1 if batch is None else batch, positions, -1))

    def _window(self) -> tuple[list[int], list[int], list[int]]:
        layer = self.layer
        return list(layer.kernel_size), list(layer.strides), list(layer.dilation_rate)


def patches(
    x: tf.Tensor,
    padding: str,
    sizes: list[int],
    strides: list[int],
    rates: list[int],
) -> tf.Tensor:
    """``tf.image.extract_patches(x, ...)`` of a ``(B, H, W, C)`` input as
    ``(B, P, prod(sizes) * C)``, the same numbers, by one gather: ``x`` is
    padded (``"SAME"`` as TensorFlow pads), its positions flattened, and
    every window's positions taken at once, ordered ``(position, row
    offset, column offset)`` so that each patch's entries follow the
    kernel's leading axes.

    NOTE (measured, one core, TF 2.21, the same with oneDNN on and off).
    ``extract_patches`` cost more than the gradients it feeds on CPU (32
    images of 32x32x3, a 3x3 window: 6.6 ms against 0.8 ms for the summed
    filter gradient). Unit-stride slices of the input reshaped by stride
    phase, concatenated, cost 1.3 ms there; this gather 1.1 ms. At 8
    images: 56x56x64 SAME 18.8 -> 7.4 ms, 112x112x32 stride 2 12.0 ->
    4.5 ms, a 5x5 window of stride 2 on 16x16x8 0.43 -> 0.13 ms; the conv
    net's conv2 (32 images of 30x30x32, stride 2) 1.8 -> 0.66 ms. Nine
    slices and a concat write every patch twice; a gather once."""
    height, width = x.shape[1], x.shape[2]
    if height is None or width is None:
        raise ValueError(
            f"jacobkit unfolds a convolution's input by its static height and "
            f"width; this input's shape is {tuple(x.shape)}."
        )
    pads, outs = [], []
    for length, size, stride, rate in zip((height, width), sizes, strides, rates):
        span = (size - 1) * rate + 1
        if padding == "SAME":
            out = -(-length // stride)
            total = max((out - 1) * stride + span - length, 0)
            pads.append([total // 2, total - total // 2])
        else:
            out = (length - span) // stride + 1
            pads.append([0, 0])
        outs.append(out)
    if any(p for pair in pads for p in pair):
        x = tf.pad(x, [[0, 0], pads[0], pads[1], [0, 0]])
    padded_width = width + sum(pads[1])
    rows = (
        np.arange(outs[0])[:, None, None, None] * strides[0]
        + np.arange(sizes[0])[None, None, :, None] * rates[0]
    )
    cols = (
        np.arange(outs[1])[None, :, None, None] * strides[1]
        + np.arange(sizes[1])[None, None, None, :] * rates[1]
    )
    index = (rows * padded_width + cols).reshape(-1).astype(np.int32)
    batch, channels = x.shape[0], x.shape[-1]
    flat = tf.reshape(x, (-1, x.shape[1] * padded_width, channels))
    found = tf.gather(flat, index, axis=1)
    return tf.reshape(found, (-1 if batch is None else batch, outs[0] * outs[1], -1))


class Conv2DRule(UnfoldedMatmul, ConvRule):
    """A ``Conv2D``; with ``groups > 1``, each group's closed form
    (:mod:`jacobkit.layers.grouped`), and norms from the per-row gradients
    (each the size of the small grouped kernel)."""

    kind = "conv2d"
    grouped_ok = True

    def factored(self) -> bool:
        return compat.groups(self.layer) == 1

    def gradients(
        self,
        x: tf.Tensor,
        dz: tf.Tensor,
        kernel_shape: tuple[int, ...],
        *,
        summed: bool,
    ) -> tuple[tf.Tensor, tf.Tensor]:
        groups = compat.groups(self.layer)
        if groups == 1:
            return super().gradients(x, dz, kernel_shape, summed=summed)
        return grouped.gradients(
            self.unfold(x), dz, kernel_shape, groups, summed=summed
        )

    def summed_gradients(
        self, x: tf.Tensor, dz: tf.Tensor, kernel_shape: tuple[int, ...]
    ) -> tuple[tf.Tensor, tf.Tensor]:
        if compat.groups(self.layer) == 1:
            return super().summed_gradients(x, dz, kernel_shape)
        by_example = tf.experimental.numpy.moveaxis(dz, 0, 1)
        return self.gradients(x, by_example, kernel_shape, summed=True)

    def forms_rows(self, x: tf.Tensor, dz: tf.Tensor, *, summed: bool) -> bool:
        if compat.groups(self.layer) == 1:
            return super().forms_rows(x, dz, summed=summed)
        return True  # its norms form every row's gradient (below)

    def norms(self, x: tf.Tensor, dz: tf.Tensor, *, summed: bool, **kwargs: Any) -> Any:
        if compat.groups(self.layer) == 1:
            return super().norms(x, dz, summed=summed, **kwargs)
        kernel, bias = self.gradients(
            x, dz, tuple(self.weight("kernel").shape), summed=summed
        )
        return row_norms(kernel), row_norms(bias)


class Conv1DRule(UnfoldedMatmul, ConvRule):
    """A Conv1D is unfolded as a Conv2D of height 1."""

    kind = "conv1d"

    def unfold(self, x: tf.Tensor) -> tf.Tensor:
        padded, padding = self.padded(x)
        sizes, strides, rates = self._window()
        return patches(
            padded[:, None], padding, [1, *sizes], [1, *strides], [1, *rates]
        )
