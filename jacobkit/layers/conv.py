"""``Conv1D`` and ``Conv2D`` (channels last): ``z = conv(x, W) + c``,
unfolded into patches; a ``Conv2D`` with ``groups > 1`` by
:mod:`jacobkit.layers.grouped`."""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import tensorflow as tf

from jacobkit import runtime
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

    def unfold_times(self, x: tf.Tensor, matrix: tf.Tensor) -> tf.Tensor:
        """``unfold(x) @ matrix`` as the layer's own convolution of ``x``
        with ``matrix`` (``(I, s)``) as its kernel ``(*kernel_size, C, s)``:
        the patches are never formed.

        NOTE (measured, one core, oneDNN on). ``jk.Project(2048)`` on the
        conv net of ``benchmarks/reductions.py``: conv2's gather and 2-D
        matmul became one fused convolution of 1.1 ms (the whole compiled
        call 11.85 -> 11.7 ms), and its ``k²``-sized patches are not held."""
        if compat.groups(self.layer) != 1:
            return super().unfold_times(x, matrix)
        # the rule's own window: a separable layer's pointwise part is 1x1
        shape = (*self._window()[0], int(x.shape[-1]), int(matrix.shape[1]))
        kernel = tf.reshape(tf.cast(matrix, x.dtype), shape)
        mapped = self.pre_activation(x, kernel, None)  # the layer's convolution
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
    batch, channels = x.shape[0], x.shape[-1]
    if _by_identity_kernel(x, channels * math.prod(sizes), rates):
        return _identity_patches(x, sizes, strides, outs)
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
    flat = tf.reshape(x, (-1, x.shape[1] * padded_width, channels))
    found = tf.gather(flat, index, axis=1)
    return tf.reshape(found, (-1 if batch is None else batch, outs[0] * outs[1], -1))


#: a patch of at most this many numbers is unfolded under oneDNN by a
#: convolution with the identity as its kernel (:func:`_identity_patches`)
IDENTITY_PATCH_SIZE = 32


def _by_identity_kernel(x: tf.Tensor, size: int, rates: list[int]) -> bool:
    """Whether :func:`patches` unfolds ``x`` by :func:`_identity_patches`:
    under oneDNN on a CPU, patches of at most :data:`IDENTITY_PATCH_SIZE`
    numbers, no dilation, a floating input.

    NOTE (measured, one core, AMD EPYC, TF 2.21; 32 images, ms for the
    gather against the identity convolution). oneDNN on: 32x32x3 by 3x3
    (27 numbers a patch) 1.51 / 0.98, SAME 1.91 / 1.25; 32x32x1 by 3x3
    1.53 / 0.50; 28x28x1 by 5x5 2.24 / 0.68; 32x32x4 by 3x3 (36) 1.82 /
    1.79; 32x32x3 by 5x5 (75) 4.77 / 5.63; 30x30x32 by 3x3 (288) 1.29 /
    12.1. The gather copies a patch's rows ``C`` numbers at a time, slow
    where ``C`` is a few channels. With TensorFlow's own kernels the
    convolution was slower at every size (32x32x3 by 3x3: 1.76 / 3.14)."""
    if size > IDENTITY_PATCH_SIZE or any(rate != 1 for rate in rates):
        return False
    if not tf.as_dtype(x.dtype).is_floating or tf.config.list_logical_devices("GPU"):
        return False
    return runtime.cpu_kind().onednn


def _identity_patches(
    x: tf.Tensor, sizes: list[int], strides: list[int], outs: list[int]
) -> tf.Tensor:
    """:func:`patches` of the padded ``x`` ``(B, H, W, C)`` as its
    convolution with the identity of ``prod(sizes) * C`` as the kernel
    ``(*sizes, C, prod(sizes) * C)``: output channel ``(i, j, c)`` is the
    window's entry ``(i, j, c)``, a product by 1 plus products by 0, exact.
    The conv net of ``benchmarks/reductions.py`` unfolds its first
    layer's 32x32x3 images so for its clipped sum and Gram matrix."""
    channels = int(x.shape[-1])
    size = channels * math.prod(sizes)
    # one constant (tf.eye built six graph ops, and a reshape two more)
    identity = np.eye(size).reshape((*sizes, channels, size))
    kernel = tf.constant(identity, dtype=x.dtype)
    found = tf.nn.convolution(x, kernel, strides=strides, padding="VALID")
    batch = x.shape[0]
    return tf.reshape(found, (-1 if batch is None else batch, outs[0] * outs[1], size))


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
        if self._by_example(dz, summed=summed):
            padded, padding = self.padded(x)
            return example_filters(
                padded, dz, kernel_shape, list(self.layer.strides), padding
            )
        if groups == 1:
            return super().gradients(x, dz, kernel_shape, summed=summed)
        return grouped.gradients(
            self.unfold(x), dz, kernel_shape, groups, summed=summed
        )

    def _by_example(self, dz: tf.Tensor, *, summed: bool) -> bool:
        """Whether per-example rows' kernel gradients are computed by
        :func:`example_filters` (one filter gradient per example), not by
        the patches' batched matmul: per example at least
        :func:`example_filter_macs` multiply-adds, no dilation, no groups."""
        if summed or compat.groups(self.layer) != 1:
            return False
        if any(rate != 1 for rate in self.layer.dilation_rate):
            return False
        kernel = [int(size) for size in self.weight("kernel").shape]
        positions = math.prod(int(size) for size in dz.shape[2:-1])
        work = positions * math.prod(kernel) * int(dz.shape[1])
        return work >= example_filter_macs()

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
        # per-example filter gradients where the rows are formed at once
        formed = kwargs.get("form") is None and self.forms_rows(x, dz, summed=summed)
        by_example = formed and self._by_example(dz, summed=summed)
        if compat.groups(self.layer) == 1 and not by_example:
            return super().norms(x, dz, summed=summed, **kwargs)
        kernel, bias = self.gradients(
            x, dz, tuple(self.weight("kernel").shape), summed=summed
        )
        return row_norms(kernel), row_norms(bias)


#: under oneDNN, a convolution's per-example kernel gradients are computed
#: one example at a time (:func:`example_filters`) from this many
#: multiply-adds per example (positions x kernel size x rows); below it, as
#: one batched matmul of the unfolded patches.
#: NOTE (measured, one core, batch 32, 3x3 kernels, ms for the patches'
#: matmul against one filter gradient per example; the summed filter
#: gradient beside). oneDNN on: 3->32 at 30x30 (0.8 M) 1.6 / 2.4 (0.9);
#: 32->64 stride 2 (3.6 M) 2.4 / 4.2 (2.0); 64->128 stride 2 at 13x13
#: (12.5 M) 11.7 / 10.1 (5.8); 64->64 at 28x28 (29 M) 16.4 / 13.2 (9.4).
#: With TensorFlow's own kernels (oneDNN off), one filter gradient per
#: example cost what the summed one did from 0.8 M on (0.8 M: 2.8 / 1.85
#: (1.8); 29 M: 36 / 29 (31)). The clipped sums of
#: ``benchmarks/reductions.py``, oneDNN off, one process each against the
#: batched matmul: ``convnet_medium`` 155.7 -> 133.0 ms (1.28 -> 1.09x its
#: plain step), the conv net 15.1 -> 13.7 ms (1.40 -> 1.18x); with oneDNN
#: on, ``convnet_medium``'s about 6% less.
ONEDNN_EXAMPLE_FILTER_MACS = 2**23
#: the same under TensorFlow's own CPU kernels. NOTE (measured, as above,
#: oneDNN off): 41 k multiply-adds (32 images 8x8x8 -> 16) 0.34 / 0.54 ms;
#: 85 k (256 images 16x16x3 -> 16) 3.9 / 4.9; 226 k 1.80 / 1.77; 903 k
#: 1.83 / 1.59: a loop iteration per example costs what a small
#: example's arithmetic does. Both thresholds were measured against the
#: ``tf.map_fn`` loop; one op per example (:data:`UNROLLED_EXAMPLES`) costs
#: 0.65-0.79x the loop, so their crossovers now lie lower (to be measured
#: again).
EIGEN_EXAMPLE_FILTER_MACS = 2**18


def example_filter_macs() -> float:
    """From how many multiply-adds per example a convolution's per-example
    kernel gradients are one filter gradient per example: under oneDNN
    :data:`ONEDNN_EXAMPLE_FILTER_MACS`, under TensorFlow's own CPU kernels
    :data:`EIGEN_EXAMPLE_FILTER_MACS`; never where a GPU is visible (the
    batched matmul: a loop of per-example filter gradients there is still
    to be measured)."""
    if tf.config.list_logical_devices("GPU"):
        return math.inf
    if runtime.cpu_kind().onednn:
        return ONEDNN_EXAMPLE_FILTER_MACS
    return EIGEN_EXAMPLE_FILTER_MACS


#: :func:`example_filters` writes one ``Conv2DBackpropFilter`` per example
#: into the graph for batches of at most this many examples (a
#: ``tf.map_fn`` while loop for larger ones, one loop whatever the batch).
#: NOTE (measured, one core, loaded machine, paired in one process, the
#: conv net of ``benchmarks/reductions.py``, batch 32). Against the while
#: loop, the same numbers bit for bit: oneDNN off, conv1 (3 -> 32 at 30x30)
#: 0.76x, conv2 (32 -> 64, stride 2) 0.65x; oneDNN on 0.74x / 0.79x. The
#: loop's profile (oneDNN off): each example's step through the executor,
#: and its TensorList unstack of the images (2.4 ms, loaded) and stack of
#: the results (1.6 ms), beside 7.2 + 4.7 ms of the filter gradients
#: themselves.
UNROLLED_EXAMPLES = 64


def example_filters(
    padded: tf.Tensor,
    dz: tf.Tensor,
    kernel_shape: tuple[int, ...],
    strides: list[int],
    padding: str,
) -> tuple[tf.Tensor, tf.Tensor]:
    """Per-row kernel and bias gradients of a 2-D convolution (no dilation,
    no groups), each example's by one ``Conv2DBackpropFilter`` of its own
    input: ``padded`` ``(B, H, W, C)`` (as the layer pads it), ``dz`` ``(B,
    K, H', W', O)`` -> ``(B * K, *kernel_shape)`` and ``(B * K, O)``. An
    example's ``K`` rows are one filter gradient's ``K * O`` output
    channels, so there is one op per example whatever ``K``."""
    batch, rows, units = int(dz.shape[0]), int(dz.shape[1]), int(dz.shape[-1])
    spatial = [int(size) for size in dz.shape[2:-1]]
    # (B, K, H', W', O) -> (B, H', W', K * O): the rows as output channels
    # (one row, a loss's: a reshape alone)
    moved = dz if rows == 1 else tf.transpose(dz, (0, 2, 3, 1, 4))
    cotangents = tf.reshape(moved, (batch, *spatial, rows * units))
    sizes = [*kernel_shape[:-1], rows * units]
    # one constant shared by every example's op (a list made one per op: 31
    # more graph ops per layer of 32 examples)
    filter_sizes = tf.constant(sizes, tf.int32)

    def one(pair: tuple[tf.Tensor, tf.Tensor]) -> tf.Tensor:
        image, cotangent = pair
        return tf.raw_ops.Conv2DBackpropFilter(
            input=image,
            filter_sizes=filter_sizes,
            out_backprop=cotangent,
            strides=[1, *strides, 1],
            padding=padding,
        )

    images = tf.cast(padded, dz.dtype)
    if batch <= UNROLLED_EXAMPLES:  # one op per example, no while loop
        # split, not unstacked: each example keeps its batch axis of one, so
        # no slice or reshape per example (6 graph ops per layer fewer)
        found = tf.stack(
            [
                one(pair)
                for pair in zip(
                    tf.split(images, batch), tf.split(cotangents, batch), strict=True
                )
            ]
        )
    else:
        found = tf.map_fn(
            one,
            (images[:, None], cotangents[:, None]),
            fn_output_signature=tf.TensorSpec(sizes, dz.dtype),
        )  # (B, kh, kw, C, K * O)
    if rows > 1:  # -> (B, K, kh, kw, C, O)
        found = tf.reshape(found, (batch, *kernel_shape[:-1], rows, units))
        found = tf.transpose(found, (0, 4, 1, 2, 3, 5))
    kernel = tf.reshape(found, (batch * rows, *kernel_shape))
    bias = tf.reduce_sum(dz, axis=list(range(2, 2 + len(spatial))))
    return kernel, tf.reshape(bias, (batch * rows, units))


class Conv1DRule(UnfoldedMatmul, ConvRule):
    """A Conv1D is unfolded as a Conv2D of height 1."""

    kind = "conv1d"

    def unfold(self, x: tf.Tensor) -> tf.Tensor:
        padded, padding = self.padded(x)
        sizes, strides, rates = self._window()
        return patches(
            padded[:, None], padding, [1, *sizes], [1, *strides], [1, *rates]
        )
