"""TensorFlow's ``Conv2D`` gradient as the strategies trace it: under
TensorFlow's own CPU kernels (oneDNN off), a stride-1 convolution's input
gradient is taken as the forward convolution of the cotangent with the
flipped kernel, not by ``Conv2DBackpropInput``, and in a loop over rows its
kernel gradient as the input's patches, formed once before the loop, times
the row's cotangent (:func:`convolution_rules`).

NOTE (why the two are the same numbers). For ``y = conv(x, W)`` at stride 1
and no dilation, ``y[i] = sum_a x[i + a - p] W[a]`` (``p`` the leading
padding), so ``dx[j] = sum_a dy[j - a + p] W[a]^T``: with ``a' = k - 1 - a``
this is the convolution of ``dy`` (padded by ``k - 1 - p`` before and ``k -
1 - p'`` after, ``p'`` the trailing padding) with ``W`` reversed along its
window and its input and output channels swapped. The same products, summed
in another order (float32: within 3e-7 of ``Conv2DBackpropInput`` relative to
the largest entry, on the generator below).

NOTE (measured, one core, TF 2.21, Intel Xeon with AVX-512, under load:
paired in one process, median of the rounds' ratios;
``benchmarks/results/cpu/conv_gradients.md``). With oneDNN off, one row of
the wide generator (``B=64, T=128``; Conv1D 128->128 by 3 and 64->128 by 5):
TensorFlow's ``Conv2DBackpropInput`` ran at 83 and 90 GFLOP/s, the forward
convolution of the same products at 145 and 137 (the GEMM probe: 140; in
the results file, more loaded: 20 and 21 against 32 and 30, probe 34); four
rows stacked on the batch axis (pfor's way) 20 and 20 against 35 and 29.
The cotangent's patches times the kernel as one GEMM (im2col) ran at 16 and
12 (16 and 8 stacked), ``k`` shifted GEMMs summed at 24 and 17: slower than
the forward convolution, so not taken. The whole call (the wide
generator's first Conv1D, 144 features, 5 rounds) took 0.69x its time with
this rule by default (``structured(while)``), ``structured(while)`` 0.71x,
``structured(batch)`` 0.74x, ``structured(chunked(16))`` 0.71x; the default
then 0.54x TensorFlow's ``tape.jacobian``, at 71% of the GEMM rate on its
200 GFLOP (47% before). With oneDNN on the two ops cost the same (one row:
40 and 48 GFLOP/s forward against 41 and 44 backward; stacked 41 and 52
against 49 and 48), the whole call was no faster with the rule (default
1.04x, ``structured(while)`` 1.03x, ``structured(batch)`` 1.00x, 3 rounds;
the same numbers: oneDNN's backward kernel is this convolution): nothing is
replaced there. A row's filter gradient as the patches' matmul, the
patches formed in the row's turn, cost what ``Conv2DBackpropFilter`` does;
in a loop over rows (``while``: the convolution traced outside the loop's
body) the patches are formed once before the loop and each row's kernel
gradient is their product with its cotangent (:func:`shared_patches`:
1.3-1.4x faster a row). Likewise the flipped kernel: once, not in every row's
turn.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Callable, Iterator
from typing import Any

import tensorflow as tf
from tensorflow.python.ops import gen_nn_ops as _gen_nn_ops

from jacobkit.layers import conv
from jacobkit.strategies.gradients import dilated, matmul, rules, unneeded

_OP = "Conv2D"
#: whether a kernel gradient taken outside any loop forms its input's
#: patches in its own pass (:func:`patches_in_pass`)
_IN_PASS: contextvars.ContextVar[bool] = contextvars.ContextVar(
    "jacobkit_patches_in_pass", default=False
)


@contextlib.contextmanager
def convolution_rules() -> Iterator[None]:
    """``Conv2D``'s gradient replaced by :func:`_conv2d_gradient` for the
    block where :func:`~jacobkit.strategies.gradients.rules.replaces`
    (nested and concurrent blocks share one replacement)."""
    with rules.rule_in_place(_OP, _conv2d_gradient):
        yield


@contextlib.contextmanager
def patches_in_pass() -> Iterator[None]:
    """:func:`convolution_rules`, and a stride-1 kernel gradient taken
    outside any loop over rows (an eager pass: ``structured``'s first call's
    check) from its input's patches formed in that pass
    (:func:`shared_patches`: the products a loop's rows take), not by
    ``Conv2DBackpropFilter``, for the block in this thread.

    NOTE (measured, oneDNN off, AMD EPYC, 2 cores loaded). The Conv1D
    generator (B=32, T=128, 8 -> 32 -> 32 -> 32, 144 features, ``conv1``):
    the check's peak 41.0 MiB by TensorFlow's kernels (40.7 with the input
    gradients by this module's rule), 14.5 with the patches formed in the
    pass (``Conv2DBackpropFilter``'s im2col buffer was the rest), 12.0 with
    the later layers' unneeded kernel gradients not taken: what it
    measures with oneDNN on (12.0)."""
    token = _IN_PASS.set(True)
    try:
        with convolution_rules():
            yield
    finally:
        _IN_PASS.reset(token)


def _conv2d_gradient(own: Callable[..., Any], op: Any, grad: tf.Tensor) -> Any:
    """``Conv2D``'s gradient: TensorFlow's own (``own``) but where
    :func:`flipped_padding` applies (or where
    :func:`~jacobkit.strategies.gradients.dilated.refuses_dilation`: there its
    ``dilated_gradient``), there the input's by :func:`input_gradient`
    and the kernel's by TensorFlow's own ``Conv2DBackpropFilter`` or, where
    the convolution was traced outside the graph its gradient is taken in
    (a loop over rows: see
    :func:`~jacobkit.strategies.gradients.rules.enclosing_graph`), as the
    product of its input's patches, formed once outside the loop, with the
    cotangent (or in the pass, within :func:`patches_in_pass`). Where the
    tape needs no input gradient (``op.skip_input_indices``: the input is
    neither a source nor a recorded op's output, a model's first
    convolution on its inputs), the kernel's alone, at any stride; where it
    needs no kernel gradient (a later layer's kernel, no target), none.

    NOTE (measured, oneDNN off). TensorFlow's own gradient traces the input
    gradient whatever the tape needs (Grappler prunes it before the first
    run): for the conv net of ``benchmarks/reductions.py`` its first
    layer's flipped convolution, 7 of the 248 graph ops ``jk.gram``'s first
    call built."""
    pads = flipped_padding(op)
    if dilated.refuses_dilation(op):
        return dilated.dilated_gradient(op, grad)
    # the tape needs no input gradient where the input is no recorded op's
    # output and no source (a model's first layer, on its inputs); no kernel
    # gradient the tape does not need (a later layer's, its kernel no
    # target: eagerly nothing prunes it, and in a loop its patches would be
    # formed before the loop and carried into it) or where the pass goes
    # towards the taps alone (:func:`~jacobkit.strategies.gradients.
    # unneeded.towards`)
    left_out = unneeded.skipped(op)
    skipped, no_kernel = 0 in left_out, 1 in left_out
    if skipped and no_kernel:
        return [None, None]
    if pads is None and not skipped and not no_kernel:
        return own(op, grad)
    kernel = op.inputs[1]
    if no_kernel and pads is None:  # stride other than 1: TensorFlow's own
        return [_own_input_gradient(op, grad), None]
    kernel_gradient = None if no_kernel else _kernel_gradient(op, grad, pads)
    if skipped:
        return [None, kernel_gradient]
    assert pads is not None  # a stride other than 1 took TensorFlow's own above
    # the flipped kernel, a loop's invariant, made once before it
    with rules.within_graph(rules.enclosing_graph(kernel)):
        flipped = flipped_kernel(kernel)
    return [input_gradient(grad, kernel, pads, flipped), kernel_gradient]


def _kernel_gradient(
    op: Any, grad: tf.Tensor, pads: list[list[int]] | None
) -> tf.Tensor:
    """``op``'s kernel gradient (:func:`_conv2d_gradient`): at stride 1
    (``pads`` given) from its input's patches where they are formed once
    before a loop over rows, or in this pass (:func:`patches_in_pass`),
    else by TensorFlow's ``Conv2DBackpropFilter``."""
    x, kernel = op.inputs[0], op.inputs[1]
    outer = rules.enclosing_graph(x)
    unfolded = None
    if pads is not None and outer is not None:
        # stride 1 in a loop over rows: its patches, made once before it
        with rules.within_graph(outer):
            unfolded = shared_patches(op)
    elif pads is not None and _IN_PASS.get():  # stride 1: this pass's patches
        unfolded = shared_patches(op)
    if unfolded is not None:
        cotangent = tf.reshape(grad, (-1, int(kernel.shape[-1])))
        product = tf.matmul(unfolded, cotangent)  # (kh * kw * I, O)
        return tf.reshape(product, tf.shape(kernel))
    return _gen_nn_ops.conv2d_backprop_filter(
        x,
        tf.shape(kernel),
        grad,
        **_attributes(op),
    )


#: what a ``Conv2D`` passes on to its gradient ops
_ATTRIBUTES = (
    "dilations",
    "strides",
    "padding",
    "explicit_paddings",
    "use_cudnn_on_gpu",
    "data_format",
)


def _attributes(op: Any) -> dict[str, Any]:
    """The attributes ``op`` (a ``Conv2D``) passes on to its gradient ops."""
    return {name: op.get_attr(name) for name in _ATTRIBUTES}


def _own_input_gradient(op: Any, grad: tf.Tensor) -> tf.Tensor:
    """``op``'s input gradient as TensorFlow's own gradient computes it."""
    return _gen_nn_ops.conv2d_backprop_input(
        tf.shape(op.inputs[0]),
        op.inputs[1],
        grad,
        **_attributes(op),
    )


#: the largest input patches :func:`shared_patches` forms (bytes): they are
#: held through the whole loop
SHARED_PATCHES_BYTES = 16 * 2**20


def shared_patches(op: Any) -> tf.Tensor | None:
    """The patches of ``op``'s input (a stride-1 ``Conv2D``, ``NHWC``),
    transposed: ``(kh * kw * C, B * H' * W')``, a copy (its rows ordered as
    the kernel's leading axes), or ``None`` where its shape is not static or
    they take more than :data:`SHARED_PATCHES_BYTES`. A row's kernel
    gradient is this times its cotangent ``(B * H' * W', O)``.

    NOTE (measured, one core, oneDNN off, under load;
    ``benchmarks/results/cpu-onednn-off/generator_floor.md``). The wide
    generator's conv1 (``B=64, T=128``, 16 -> 64 by 5): a row's kernel
    gradient by ``Conv2DBackpropFilter`` 6.93 ms, by the patches (formed
    once for the 128 rows) times the row's cotangent with ``transpose_a``
    5.25 ms (4.98 and 3.50 in a less loaded run); the patches formed in
    every row's turn cost what TensorFlow's kernel does. Eigen runs the
    transposed operand far below its rate here (as in the ``MatMul`` rule,
    :mod:`~jacobkit.strategies.gradients.matmul`): the same product from a
    transposed copy made once took 0.49x its time (1.74 against 3.58 ms,
    80% of the GEMM probe against 39%; four rows side by side 1.24 ms a
    row, 110%)."""
    x, kernel = op.inputs[0], op.inputs[1]
    if not x.shape.is_fully_defined():
        return None
    window = [int(k) for k in kernel.shape[:2]]
    batch, height, width, channels = (int(d) for d in x.shape)
    padding = rules.text(op.get_attr("padding"))
    if padding == "VALID":
        height, width = height - window[0] + 1, width - window[1] + 1
    size = batch * height * width * window[0] * window[1] * channels
    if size * x.dtype.size > SHARED_PATCHES_BYTES:
        return None
    found = conv.patches(x, padding, window, [1, 1], [1, 1])
    return matmul.transposed_copy(tf.reshape(found, (-1, int(found.shape[-1]))))


def flipped_kernel(kernel: tf.Tensor) -> tf.Tensor:
    """``kernel`` ``(kh, kw, I, O)`` reversed along its window, input and
    output channels swapped: ``(kh, kw, O, I)``."""
    return tf.transpose(tf.reverse(kernel, [0, 1]), (0, 1, 3, 2))


def flipped_padding(op: Any) -> list[list[int]] | None:
    """How :func:`input_gradient` pads the cotangent of ``op`` (a ``Conv2D``)
    on its two spatial axes, or ``None`` where it does not apply: a stride or
    dilation other than 1, a layout other than ``NHWC``, explicit padding, a
    kernel of unknown window, a grouped convolution (the kernel's input
    channels not the input's: its flipped kernel is no convolution's)."""
    strides = list(op.get_attr("strides"))
    dilations = list(op.get_attr("dilations"))
    padding = rules.text(op.get_attr("padding"))
    layout = rules.text(op.get_attr("data_format"))
    window = op.inputs[1].shape[:2]
    if strides != [1, 1, 1, 1] or dilations != [1, 1, 1, 1] or layout != "NHWC":
        return None
    if padding not in ("SAME", "VALID") or not window.is_fully_defined():
        return None
    channels, kernel_channels = op.inputs[0].shape[-1], op.inputs[1].shape[2]
    if channels is None or kernel_channels is None or channels != kernel_channels:
        return None
    pads = []
    for size in (int(window[0]), int(window[1])):
        # TensorFlow's SAME pads (k - 1) // 2 before and the rest after
        before = (size - 1) // 2 if padding == "SAME" else 0
        after = size - 1 - before if padding == "SAME" else 0
        pads.append([size - 1 - before, size - 1 - after])
    return pads


def input_gradient(
    grad: tf.Tensor,
    kernel: tf.Tensor,
    pads: list[list[int]],
    flipped: tf.Tensor | None = None,
) -> tf.Tensor:
    """A stride-1 ``Conv2D``'s input gradient, ``(B, H, W, I)``, from its
    cotangent ``grad`` ``(B, H', W', O)`` and kernel ``(kh, kw, I, O)``: the
    forward convolution of ``grad`` padded by ``pads`` with the kernel
    reversed along its window, input and output channels swapped
    (``flipped``, :func:`flipped_kernel`, where it is made already)."""
    if flipped is None:
        flipped = flipped_kernel(kernel)
    if all(before == after for before, after in pads):
        # an odd window under SAME: TensorFlow's SAME pads the same amounts
        window = kernel.shape[:2]
        if all(before == (int(k) - 1) // 2 for (before, _), k in zip(pads, window)):
            return tf.nn.conv2d(grad, flipped, 1, "SAME")
    padded = tf.pad(grad, [[0, 0], pads[0], pads[1], [0, 0]])
    return tf.nn.conv2d(padded, flipped, 1, "VALID")
