"""One-channel rows at a convolution's output: every row's cotangent at the
convolution's *input* from one small convolution each, instead of one
dense backward pass each.

NOTE (why the step is exact). The rows are ``"features"`` rows of ``h =
act(z)``, ``z = conv(x, K) + c``: a stock ``Conv1D``/``Conv2D`` at stride 1,
no dilation, one group, channels last, with an elementwise activation (or
linear), whose output is the model's output (a linear head's input: the
head's sub-problem). Row ``r`` is ``sum_{b,pos} h[b, pos, c_r]``, so its
cotangent at ``z`` is ``dz_r[b, pos, o] = act'(z[b, pos, c_r])`` for ``o =
c_r`` and 0 elsewhere: one channel. Its cotangent at ``x`` is then
``X_r[b, j, i] = sum_a dz_r[b, j - a + p, c_r] K[a, i, c_r]`` (``p`` the
leading padding, the window ``a`` on each spatial axis), the convolution of
that one channel, padded by ``k - 1 - p`` before and ``k - 1 - p'`` after,
with ``K[..., c_r]`` reversed along its window: ``B*T*k*I`` multiply-adds
for a row, where the dense backward pass of ``z`` costs ``C`` times that
(``C`` the convolution's output channels). The rows' Jacobians are those of
``x``'s vector-Jacobian products with the ``X_r`` (the chain rule through
``x``; ``K``, ``c`` and ``z`` hold no target: the targets are read before
the convolution). Nothing is approximated; the same products are summed in
another order.

A strided or dilated convolution, ``groups > 1``, channels first, a
non-elementwise activation, LoRA or a quantized kernel, a mixed-precision
convolution, the convolution's own variables among the targets, or rows
other than ``"features"``: refused (:class:`NotApplicable`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import tensorflow as tf

from jacobkit import layers, runtime
from jacobkit.keras import compat
from jacobkit.keras import graph as keras_graph
from jacobkit.problem import functional
from jacobkit.problem.call import Call
from jacobkit.problem.functional import Graph, NotApplicable
from jacobkit.problem.problem import Problem

_KINDS = {"Conv1D": 1, "Conv2D": 2}


@dataclass(frozen=True)
class ConvChannels:
    """The rows are one channel each at a stride-1 convolution's output.

    Attributes:
        conv: the ``Conv1D``/``Conv2D`` layer.
        rank: its spatial rank (1 or 2).
        channels: the output channel of each row (``c_r``).
        input_problem: ``inputs -> x``, the convolution's input ``(B, *S,
            I)``, as a problem on the same targets (its :meth:`call_model`
            is what is differentiated; its rows are not used). It holds no
            inputs (:meth:`Problem.detached`).
        pads: the padding of the convolution on each spatial axis, ``(before,
            after)`` (2-D: the first axis of a ``Conv1D`` is a unit axis, ``(0,
            0)``).
    """

    conv: Any
    rank: int
    channels: tuple[int, ...]
    input_problem: Problem
    pads: tuple[tuple[int, int], ...]

    def describe(self) -> str:
        return (
            f"{len(self.channels)} one-channel cotangents at {self.conv.name!r} "
            "taken to its input at once"
        )

    def window(self) -> tuple[int, int]:
        """The kernel's window as 2-D ``(kh, kw)``."""
        size = tuple(int(k) for k in self.conv.kernel.shape[: self.rank])
        return (1, size[0]) if self.rank == 1 else (size[0], size[1])

    def preactivation(self, x: tf.Tensor) -> tf.Tensor:
        """``z = conv(x, K) + c``, ``(B, *S', C)``, as the layer computes it."""
        conv = self.conv
        if conv.padding == "causal":
            (before, after) = self.pads[-1]
            x = tf.pad(x, [[0, 0], [before, after], [0, 0]])
            kernel = tf.convert_to_tensor(conv.kernel)
            z = tf.nn.convolution(x, tf.cast(kernel, x.dtype), padding="VALID")
        else:
            z = conv.convolution_op(x, conv.kernel)
        if conv.use_bias:
            z = z + tf.cast(tf.convert_to_tensor(conv.bias), z.dtype)
        return z

    def slopes(self, x: tf.Tensor) -> tf.Tensor:
        """``act'(z)`` at the rows' channels, rows first and padded as
        :meth:`cotangents` convolves them: ``(R, B, H' + kh - 1, W' + kw -
        1)`` (a ``Conv1D``'s ``H'`` is a unit axis).

        NOTE (measured, one core, oneDNN off, under load: a profile of the
        wide generator's default call). Rows last, each row's channel was
        gathered from ``(B, 1, T', R)`` in every iteration of the rows'
        loop: 0.54 ms a gather (a number every ``R`` numbers), 4% of the
        call; rows first, a row's slopes are one contiguous slice."""
        z = self.preactivation(x)
        with tf.GradientTape(watch_accessed_variables=False) as tape:
            tape.watch(z)
            h = self.conv.activation(z)
        slope = tape.gradient(h, z)  # elementwise: the gradient of the sum
        picked = tf.gather(slope, list(self.channels), axis=-1)  # (B, *S', R)
        if self.rank == 1:
            picked = picked[:, None]  # (B, 1, T', R)
        pads = [
            [k - 1 - before, k - 1 - after]
            for (before, after), k in zip(self.pads_2d(), self.window())
        ]
        rows_first = tf.transpose(picked, (3, 0, 1, 2))  # (R, B, H', W')
        return tf.pad(rows_first, [[0, 0], [0, 0], *pads])

    def columns(self, dtype: tf.DType) -> tf.Tensor:
        """Each row's column of the kernel, reversed along its window, rows
        first: ``(R, kh, kw, I)`` (taken once, not in every row's turn)."""
        kernel = tf.cast(tf.convert_to_tensor(self.conv.kernel), dtype)
        if self.rank == 1:
            kernel = kernel[None]  # (1, k, I, C)
        picked = tf.gather(kernel, list(self.channels), axis=-1)  # (kh, kw, I, R)
        return tf.transpose(tf.reverse(picked, [0, 1]), (3, 0, 1, 2))

    def cotangents(self, slopes: tf.Tensor, columns: tf.Tensor, rows: Any) -> tf.Tensor:
        """The cotangents at ``x`` of the rows at positions ``rows`` (a 1-D
        int tensor of ``n`` indices into :attr:`channels`), from
        :meth:`slopes` and :meth:`columns`: ``(n, B, *S, I)``. Each row's one
        channel convolved with its own column of the flipped kernel (see the
        NOTE): where :func:`windows_product`, as the channel's ``kh * kw``
        shifted windows ``(n, B * H * W, kh * kw)`` times the columns ``(n,
        kh * kw, I)``, else as one depthwise convolution.

        NOTE (measured, one core, TF 2.21, the AVX-512 Xeon, under load:
        alternating rounds in one process, medians). A row of the wide
        generator (``(B, T, 128)`` from 3 taps), alone in a loop: the
        depthwise convolution (channel multiplier ``I``) 1.66 ms with oneDNN
        off and 0.86 with it on, the windows' product 1.02 and 0.75 ms. The
        whole default call (9 rounds, its process's CPU time): 0.973x with
        oneDNN off, 1.023x with it on, so the product is taken only with
        oneDNN off. The same products, summed in another order. The windows
        take ``kh * kw / I`` of the output's memory."""
        kh, kw = self.window()
        if not windows_product(kh * kw, int(columns.shape[-1])):
            return self._depthwise(slopes, columns, rows)
        picked = tf.gather(slopes, rows)  # (n, B, H + kh - 1, W + kw - 1)
        windows = tf.stack(
            [
                picked[:, :, a : _stop(a, kh), c : _stop(c, kw)]
                for a in range(kh)
                for c in range(kw)
            ],
            -1,
        )  # (n, B, H, W, kh * kw)
        shape = tf.shape(windows)
        n, channels = shape[0], int(columns.shape[-1])
        flat = tf.reshape(windows, tf.stack([n, -1, kh * kw]))
        picked_columns = tf.gather(columns, rows)  # (n, kh, kw, I)
        out = tf.matmul(
            flat, tf.reshape(picked_columns, tf.stack([n, kh * kw, channels]))
        )  # (n, B * H * W, I)
        seeds = tf.reshape(out, tf.concat([shape[:4], [channels]], 0))
        return seeds[:, :, 0] if self.rank == 1 else seeds

    def _depthwise(self, slopes: tf.Tensor, columns: tf.Tensor, rows: Any) -> tf.Tensor:
        """:meth:`cotangents` as one depthwise convolution: each row's one
        channel by its own column of the flipped kernel."""
        flipped = tf.transpose(tf.gather(columns, rows), (1, 2, 0, 3))  # (kh, kw, n, I)
        padded = tf.transpose(tf.gather(slopes, rows), (1, 2, 3, 0))  # (B, H, W, n)
        out = tf.nn.depthwise_conv2d(padded, flipped, [1, 1, 1, 1], "VALID")
        n = tf.shape(rows)[0]
        shape = tf.concat([tf.shape(out)[:3], [n, -1]], 0)
        seeds = tf.transpose(tf.reshape(out, shape), (3, 0, 1, 2, 4))
        return seeds[:, :, 0] if self.rank == 1 else seeds

    def pads_2d(self) -> tuple[tuple[int, int], ...]:
        return ((0, 0), *self.pads) if self.rank == 1 else self.pads


def find(problem: Problem, graph: Graph) -> ConvChannels:
    """The one-channel structure of ``problem``'s rows at the output of its
    last convolution (see the NOTE).

    Raises:
        NotApplicable: not there, or not certainly.
    """
    keras = graph.keras
    if problem.rows_spec.mode != "features":
        raise NotApplicable(
            f"one-channel rows: outputs={problem.rows_spec.mode!r} rows, not 'features'"
        )
    if problem.tensor_targets is not None or problem.rows_spec.loss is not None:
        raise NotApplicable("one-channel rows: not a layer's variables' rows")
    conv, node = keras_graph.producer(graph.output)
    kind = layers.stock_kind(conv)
    rank = _KINDS.get(str(kind.layer)) if kind is not None else None
    if rank is None:
        raise NotApplicable(
            f"one-channel rows: the output layer {conv.name!r} "
            f"({type(conv).__name__}) is not a stock Conv1D or Conv2D"
        )
    _check_conv(keras, conv, rank)
    keras_graph.used_once(conv)
    functional.refuse_own_variables(problem, conv, "one-channel rows")
    x = keras_graph.single_input(conv, node)
    if type(keras_graph.producer(x)[0]).__name__ == "InputLayer":
        raise NotApplicable(f"one-channel rows: {conv.name!r} reads the model's input")
    prefix = keras_graph.input_model(keras, problem.model, x)
    input_problem = Call(
        prefix,
        problem.layer if problem.layer is not None else list(problem.targets),
        outputs="features",
        training=problem.training,
        unconnected="zero",
    ).problem(problem.inputs)
    window = [int(k) for k in conv.kernel.shape[:rank]]
    return ConvChannels(
        conv,
        rank,
        functional.channels(problem),
        input_problem.detached(),
        tuple(_padding(conv.padding, k) for k in window),
    )


def _check_conv(keras: Any, conv: Any, rank: int) -> None:
    name = conv.name
    if any(int(s) != 1 for s in conv.strides):
        raise NotApplicable(
            f"one-channel rows: {name!r} has strides {tuple(conv.strides)}, not 1"
        )
    if any(int(d) != 1 for d in conv.dilation_rate):
        raise NotApplicable(
            f"one-channel rows: {name!r} has dilation {tuple(conv.dilation_rate)}, "
            "not 1"
        )
    if int(getattr(conv, "groups", 1)) != 1:
        raise NotApplicable(f"one-channel rows: {name!r} has groups > 1")
    if compat.data_format(conv) != "channels_last":
        raise NotApplicable(f"one-channel rows: {name!r} is channels_first")
    if conv.padding not in ("same", "valid", "causal"):
        raise NotApplicable(f"one-channel rows: {name!r} pads {conv.padding!r}")
    if functional.lora_or_quantized(conv):
        raise NotApplicable(f"one-channel rows: {name!r} is LoRA/quantized")
    if conv.compute_dtype not in ("float32", "float64") or (
        conv.compute_dtype != conv.variable_dtype
    ):
        raise NotApplicable(
            f"one-channel rows: {name!r} computes in {conv.compute_dtype} "
            f"(variables {conv.variable_dtype})"
        )
    if conv.activation is not None and not layers.elementwise_activation(
        keras, conv.activation
    ):
        raise NotApplicable(
            f"one-channel rows: {name!r}'s activation "
            f"{compat.activation_name(conv.activation) or conv.activation!r} is "
            "not elementwise"
        )


def windows_product(taps: int, channels: int) -> bool:
    """Whether :meth:`ConvChannels.cotangents` takes the shifted windows'
    product, not the depthwise convolution: with TensorFlow's own CPU
    kernels (oneDNN off), no GPU visible (where it is not measured), and
    windows (``taps = kh * kw`` numbers a position) no larger than the
    output they make (``channels`` a position): larger windows would hold
    more than the planner's peak estimate counts."""
    if taps > channels or tf.config.list_logical_devices("GPU"):
        return False
    return not runtime.cpu_kind().onednn


def _stop(start: int, size: int) -> int | None:
    """The end of the slice from ``start`` that leaves ``size - 1`` positions
    of a padded axis (``None``: to its end)."""
    end = start - (size - 1)
    return end if end < 0 else None


def _padding(padding: str, k: int) -> tuple[int, int]:
    """``(before, after)`` that the stride-1 convolution pads its input by on
    an axis of window ``k`` (TensorFlow's SAME: ``(k - 1) // 2`` before)."""
    if padding == "valid":
        return (0, 0)
    if padding == "causal":
        return (k - 1, 0)
    return ((k - 1) // 2, k - 1 - (k - 1) // 2)
