"""TensorFlow's gradients as the strategies trace them: under TensorFlow's
own CPU kernels (oneDNN off), a convolution's input gradient is taken as the
forward convolution of the cotangent with the flipped kernel, not by
``Conv2DBackpropInput``, and a ``MatMul``'s gradients as products of
transposed copies, not by the kernel's transpose flags.

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

NOTE (the matmul, measured: one core, TF 2.21, the same AVX-512 Xeon,
oneDNN off, loaded; ``benchmarks/results/cpu-onednn-off/mlp_floor.md``).
TensorFlow's ``MatMul`` gradient multiplies ``dc @ bᵀ`` with
``transpose_b`` and ``aᵀ @ dc`` with ``transpose_a``, and Eigen's kernel
runs the transposed operand far below its rate at a backward pass's
shapes: ``(256, 1024) @ (1024, 1024)ᵀ`` (one row of the MLP 512-1024-1024
at B=256, ``while``'s) at 0.25-0.30 of the GEMM probe, against 0.73-1.01
for the same product of the transposed copy; ``(4096, 1024)`` rows (16
rows stacked, ``batch``'s) at 0.88 against 1.00; ``(256, 512)ᵀ @ (256,
1024)`` at 0.48-0.74 against 0.57-0.83. A copy of the operand is one pass
over it, against the product's ``rows`` passes. The whole call (that MLP,
144 features, paired in one process, loaded): ``batch`` 0.91-0.97x its
time with the rule, ``while`` 0.47x (0.61-0.65x with the copies made in
its loop, once per row: :func:`_hoisted`). The transposed copy must
reach the ``MatMul`` as a copy (:func:`transposed_copy`). The same
products (float64: no difference at 7 and 300 rows, 6e-16 relative at one
row, where the kernel is a matrix-vector product). With oneDNN on, nothing
is replaced.

The rule is in place only while a strategy's computation is traced (every
thread then: another thread's gradient gets the same numbers in exact
arithmetic), and put back after; where TensorFlow keeps its gradients
elsewhere (another version), nothing is replaced.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from typing import Any

import tensorflow as tf
from tensorflow.python.framework import ops as _ops
from tensorflow.python.ops import gen_nn_ops as _gen_nn_ops

from jacobkit import runtime
from jacobkit.layers import conv
from jacobkit.strategies import dilated

_OP = "Conv2D"
_MATMUL = "MatMul"
#: the least rows of a ``MatMul``'s cotangent whose gradient
#: :func:`_matmul_gradient` takes through transposed operands (measured at
#: 256 rows and more; a copy of a weight is not worth a product of few rows)
MATMUL_ROWS = 64
#: the largest operand :func:`_matmul_gradient` copies transposed (known
#: size, bytes): the copy is held beside the product for each row in
#: flight, so a language model's head (50257 x 768 floats, 147 MiB) or a
#: long sequence's activations keep TensorFlow's transposed product
MATMUL_COPY_BYTES = 16 * 2**20


def within(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` run under :func:`convolution_rules` and :func:`matmul_rules` (a
    strategy's computation: its Python runs when it is traced)."""

    @functools.wraps(fn)
    def ruled(*args: Any, **kwargs: Any) -> Any:
        with convolution_rules(), matmul_rules():
            return fn(*args, **kwargs)

    return ruled


def replaces() -> bool:
    """Whether :func:`convolution_rules` replaces anything here: TensorFlow's
    own CPU kernels (oneDNN off), no GPU visible (a convolution could run
    there, where this is not measured)."""
    if tf.config.list_logical_devices("GPU"):
        return False
    return not runtime.cpu_kind().onednn


def _registry(op: str = _OP) -> dict[str, Any] | None:
    found = getattr(getattr(_ops, "_gradient_registry", None), "_registry", None)
    if not isinstance(found, dict) or not isinstance(found.get(op), dict):
        return None
    return found


@contextlib.contextmanager
def convolution_rules() -> Iterator[None]:
    """``Conv2D``'s gradient replaced by :func:`_conv2d_gradient` for the
    block where :func:`replaces` (nested and concurrent blocks share one
    replacement)."""
    registry = _registry() if replaces() else None
    if registry is None:
        yield
        return
    with runtime.rule_replaced(
        registry, _OP, runtime.PROCESS.gradient_rules, _replaced
    ):
        yield


def _replaced(
    entry: dict[Any, Any], rule: Callable[..., Any] | None = None
) -> dict[Any, Any]:
    """The registry's entry for ``Conv2D`` (or another op's, by ``rule``)
    with its function replaced (the other fields, where it was registered,
    kept)."""
    keys = [key for key, value in entry.items() if callable(value)]
    if len(keys) != 1:  # pragma: no cover - the layout of TF changed
        return entry
    own = entry[keys[0]]
    return {**entry, keys[0]: functools.partial(rule or _conv2d_gradient, own)}


@contextlib.contextmanager
def matmul_rules() -> Iterator[None]:
    """``MatMul``'s gradient replaced by :func:`_matmul_gradient` for the
    block where :func:`replaces` (nested and concurrent blocks share one
    replacement)."""
    registry = _registry(_MATMUL) if replaces() else None
    if registry is None:
        yield
        return
    with runtime.rule_replaced(
        registry,
        _MATMUL,
        runtime.PROCESS.gradient_rules,
        lambda entry: _replaced(entry, _matmul_gradient),
    ):
        yield


def _matmul_gradient(own: Callable[..., Any], op: Any, grad: tf.Tensor) -> Any:
    """``MatMul``'s gradient (``c = a @ b``, no transposes, real floats, at
    least :data:`MATMUL_ROWS` rows): ``dc @ bᵀ`` and ``aᵀ @ dc`` as 2-D
    matmuls of operands transposed first (:func:`transposed_copy` of ``b``
    and of ``a``, each where it is at most :data:`MATMUL_COPY_BYTES`),
    where TensorFlow's own passes ``transpose_b`` and ``transpose_a`` to the
    kernel; elsewhere TensorFlow's own (``own``). The same products (see
    the module's NOTE on the matmul)."""
    a, b = op.inputs[0], op.inputs[1]
    rows = grad.shape[0] if grad.shape.rank == 2 else None
    if (
        op.get_attr("transpose_a")
        or op.get_attr("transpose_b")
        or not grad.dtype.is_floating
        or rows is None
        or rows < MATMUL_ROWS
    ):
        return own(op, grad)
    skip = getattr(op, "skip_input_indices", None) or ()
    grad_a = grad_b = None
    if 0 not in skip:
        if _copied(b):
            grad_a = tf.matmul(grad, _hoisted(b))
        else:
            grad_a = tf.matmul(grad, b, transpose_b=True)
    if 1 not in skip:
        if _copied(a):
            grad_b = tf.matmul(_hoisted(a), grad)
        else:
            grad_b = tf.matmul(a, grad, transpose_a=True)
    return grad_a, grad_b


def _hoisted(operand: tf.Tensor) -> tf.Tensor:
    """:func:`transposed_copy` of ``operand``, built in ``operand``'s own
    graph where the gradient is being built in a graph nested in it (a
    ``while`` loop's body, ``batch``'s loop over chunks): there it is made
    once per call, not once per row (measured: ``while``'s copies inside its
    loop took 33% of its op time on the MLP). Elsewhere (eager, the same
    graph, a graph not enclosing this one) where the gradient is built.

    Memory: a copy built outside the loop is held while the loop runs, so
    the loop holds one copy of each ``Dense`` kernel its gradient passes
    (at most :data:`MATMUL_COPY_BYTES` each) and of the targets' inputs:
    4.6 MiB on the MLP, beside its 288 MiB result. The planner's peak
    prior does not count it."""
    with _within(enclosing_graph(operand)):
        return transposed_copy(operand)


def _copied(operand: tf.Tensor) -> bool:
    """Whether :func:`_matmul_gradient` copies ``operand`` transposed: its
    size known and at most :data:`MATMUL_COPY_BYTES`."""
    count = operand.shape.num_elements()
    return count is not None and count * operand.dtype.size <= MATMUL_COPY_BYTES


def transposed_copy(matrix: tf.Tensor) -> tf.Tensor:
    """``(m, n)`` -> ``(n, m)``, a copy that a ``MatMul`` takes as it is:
    transposed as a ``(1, m, n)`` tensor. TensorFlow's graph optimizer
    (grappler's arithmetic stage) folds a rank-2 ``Transpose`` feeding a
    ``MatMul`` back into its transpose flag, which undid the rule (measured:
    ``(256, 1024) @ transpose(W)`` in a ``tf.function`` 47 ms, as with
    ``transpose_b``, 48 ms; through this copy 24 ms, against 16 ms for a
    copy made outside)."""
    shape = tf.shape(matrix)
    found = tf.reshape(
        tf.transpose(matrix[None], (0, 2, 1)), tf.stack([shape[1], shape[0]])
    )
    found.set_shape(matrix.shape[::-1])
    return found


def _conv2d_gradient(own: Callable[..., Any], op: Any, grad: tf.Tensor) -> Any:
    """``Conv2D``'s gradient: TensorFlow's own (``own``) but where
    :func:`flipped_padding` applies (or where
    :func:`~jacobkit.strategies.dilated.refuses_dilation`: there its
    ``dilated_gradient``), there the input's by :func:`input_gradient`
    and the kernel's by TensorFlow's own ``Conv2DBackpropFilter`` or, where
    the convolution was traced outside the graph its gradient is taken in
    (a loop over rows: see :func:`enclosing_graph`), as the product of its
    input's patches, formed once outside the loop, with the cotangent."""
    pads = flipped_padding(op)
    if pads is None:
        if dilated.refuses_dilation(op):
            return dilated.dilated_gradient(op, grad)
        return own(op, grad)
    x, kernel = op.inputs[0], op.inputs[1]
    # the loop's invariants, made once before it where there is one
    with _within(enclosing_graph(kernel)):
        flipped = flipped_kernel(kernel)
    outer = enclosing_graph(x)
    with _within(outer):
        unfolded = shared_patches(op) if outer is not None else None
    if unfolded is not None:
        cotangent = tf.reshape(grad, (-1, int(kernel.shape[-1])))
        product = tf.matmul(unfolded, cotangent, transpose_a=True)
        kernel_gradient = tf.reshape(product, tf.shape(kernel))
    else:
        kernel_gradient = _gen_nn_ops.conv2d_backprop_filter(
            x,
            tf.shape(kernel),
            grad,
            dilations=op.get_attr("dilations"),
            strides=op.get_attr("strides"),
            padding=op.get_attr("padding"),
            explicit_paddings=op.get_attr("explicit_paddings"),
            use_cudnn_on_gpu=op.get_attr("use_cudnn_on_gpu"),
            data_format=op.get_attr("data_format"),
        )
    return [input_gradient(grad, kernel, pads, flipped), kernel_gradient]


def enclosing_graph(tensor: Any) -> Any:
    """The graph of ``tensor`` (a forward op's input) where a gradient is
    being traced in another graph inside it (a ``tf.while_loop``'s body over
    rows: ``tensor`` is the same in every iteration), else ``None``."""
    graph = getattr(tensor, "graph", None)
    current = _ops.get_default_graph()
    if graph is None or graph is current or not tf.inside_function():
        return None
    inner = getattr(current, "outer_graph", None)
    while inner is not None and inner is not graph:
        inner = getattr(inner, "outer_graph", None)
    return graph if inner is graph else None


def _within(graph: Any) -> Any:
    """``graph`` as the default graph for a block (``None``: the current)."""
    return graph.as_default() if graph is not None else contextlib.nullcontext()


#: the largest input patches :func:`shared_patches` forms (bytes): they are
#: held through the whole loop
SHARED_PATCHES_BYTES = 16 * 2**20


def shared_patches(op: Any) -> tf.Tensor | None:
    """The patches of ``op``'s input (a stride-1 ``Conv2D``, ``NHWC``) as
    ``(B * H' * W', kh * kw * C)``, ordered as the kernel's leading axes, or
    ``None`` where its shape is not static or they take more than
    :data:`SHARED_PATCHES_BYTES`.

    NOTE (measured, one core, oneDNN off, under load;
    ``benchmarks/results/cpu-onednn-off/generator_floor.md``). The wide
    generator's conv1 (``B=64, T=128``, 16 -> 64 by 5): a row's kernel
    gradient by ``Conv2DBackpropFilter`` 6.93 ms, by these patches (formed
    once for the 128 rows) times the row's cotangent 5.25 ms (4.98 and
    3.50 in a less loaded run); the patches formed in every row's turn cost
    what TensorFlow's kernel does."""
    x, kernel = op.inputs[0], op.inputs[1]
    if not x.shape.is_fully_defined():
        return None
    window = [int(k) for k in kernel.shape[:2]]
    batch, height, width, channels = (int(d) for d in x.shape)
    padding = _text(op.get_attr("padding"))
    if padding == "VALID":
        height, width = height - window[0] + 1, width - window[1] + 1
    size = batch * height * width * window[0] * window[1] * channels
    if size * x.dtype.size > SHARED_PATCHES_BYTES:
        return None
    found = conv.patches(x, padding, window, [1, 1], [1, 1])
    return tf.reshape(found, (-1, int(found.shape[-1])))


def flipped_kernel(kernel: tf.Tensor) -> tf.Tensor:
    """``kernel`` ``(kh, kw, I, O)`` reversed along its window, input and
    output channels swapped: ``(kh, kw, O, I)``."""
    return tf.transpose(tf.reverse(kernel, [0, 1]), (0, 1, 3, 2))


def flipped_padding(op: Any) -> list[list[int]] | None:
    """How :func:`input_gradient` pads the cotangent of ``op`` (a ``Conv2D``)
    on its two spatial axes, or ``None`` where it does not apply: a stride or
    dilation other than 1, a layout other than ``NHWC``, explicit padding, a
    kernel of unknown window."""
    strides = list(op.get_attr("strides"))
    dilations = list(op.get_attr("dilations"))
    padding = _text(op.get_attr("padding"))
    layout = _text(op.get_attr("data_format"))
    window = op.inputs[1].shape[:2]
    if strides != [1, 1, 1, 1] or dilations != [1, 1, 1, 1] or layout != "NHWC":
        return None
    if padding not in ("SAME", "VALID") or not window.is_fully_defined():
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


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)
