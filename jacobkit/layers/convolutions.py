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

import dataclasses
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

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


@dataclass(frozen=True)
class Gradient:
    """One convolution gradient op of a backward pass, as the memory prior
    reads it: whether TensorFlow's own kernel for it (and its scratch space,
    :mod:`jacobkit.planner.scratch`) runs depends on the strategy and the
    CPU's kind (:func:`jacobkit.planner.scratch.runs_kernel`).

    Attributes:
        kind: its :class:`Convolution`'s kind.
        wrt: ``"input"`` or ``"kernel"``: what it differentiates.
        stride_one: a ``conv2d`` at stride 1, no dilation, no groups,
            ``NHWC``, ``SAME``/``VALID`` padding, its window known: where jacobkit's
            ``Conv2D`` rule (oneDNN off) takes it instead of TensorFlow's op
            (:mod:`jacobkit.strategies.gradients.convolution`).
        patches_bytes: a kernel gradient's input patches (``B * H' * W' *
            kh * kw * C`` numbers), which the rule forms once in a loop over
            rows where they are small enough; ``None``: not known (or an
            input gradient).
        used: whether the pass uses its result; ``False`` for a kernel
            gradient nothing takes (TensorFlow's gradient of a later
            layer whose kernel is no target: a traced pass prunes it, the
            rule in a pass of its own does not take it, :func:`jacobkit.
            strategies.gradients.patches_in_pass`); ``True`` where not
            known.
    """

    kind: str
    wrt: str
    stride_one: bool
    patches_bytes: int | None = None
    used: bool = True

    def scaled(self, factor: float) -> Gradient:
        """The same op on ``factor`` times the examples (its patches grow
        with them)."""
        size = self.patches_bytes
        return Gradient(
            self.kind,
            self.wrt,
            self.stride_one,
            None if size is None else int(size * factor),
            self.used,
        )


def _stride_one(attrs: Callable[[str], object]) -> bool:
    """Whether a ``Conv2D`` gradient op's attributes (``attrs(name)``) are
    the ones jacobkit's rule takes (the window checked apart)."""

    def text(value: object) -> str:
        return value.decode() if isinstance(value, bytes) else str(value)

    return (
        list(attrs("strides")) == [1, 1, 1, 1]  # type: ignore[call-overload]
        and list(attrs("dilations")) == [1, 1, 1, 1]  # type: ignore[call-overload]
        and text(attrs("data_format")) == "NHWC"
        and text(attrs("padding")) in ("SAME", "VALID")
    )


def gradient_op(
    op_type: str,
    attrs: Callable[[str], object],
    inputs: tuple[tf.TensorShape, ...],
    output: tf.TensorShape,
    dtype: tf.DType,
) -> Gradient | None:
    """The :class:`Gradient` of one op (``None``: not a convolution's
    gradient), from its type, attributes, its inputs' shapes and its
    output's (a traced op's or an eagerly run one's alike)."""
    for found in CONVOLUTIONS:
        if op_type not in found.gradient_ops:
            continue
        wrt = "kernel" if "Filter" in op_type else "input"
        if found.kind != "conv2d":
            return Gradient(found.kind, wrt, False)
        # Conv2DBackpropInput(sizes, kernel, dy); ...Filter(x, sizes, dy)
        kernel = inputs[1] if wrt == "input" else output
        x = output if wrt == "input" else inputs[0]
        window = kernel[:2]
        # groups: the kernel's input channels not the input's (no rule)
        plain = kernel.rank == 4 and x.rank == 4 and kernel[2] == x[-1]
        ruled = plain and window.is_fully_defined() and _stride_one(attrs)
        if wrt == "input":
            return Gradient(found.kind, wrt, ruled)
        cotangent = inputs[2]
        patches = None
        if cotangent.is_fully_defined() and x.is_fully_defined():
            numbers = cotangent[:3].num_elements() * window.num_elements()
            patches = int(numbers) * int(x[-1]) * tf.as_dtype(dtype).size
        return Gradient(found.kind, wrt, ruled, patches)
    return None


def of_graph_ops(operations: Iterable[Any]) -> tuple[Gradient, ...]:
    """The :class:`Gradient` records of a traced backward pass's ops, a
    kernel gradient whose result no op takes and the graph does not return
    marked unused (:attr:`Gradient.used`)."""
    found = []
    for op in operations:
        (record,) = _records((op,), lambda op: op.get_attr) or (None,)
        if record is not None and record.wrt == "kernel" and _unused(op):
            record = dataclasses.replace(record, used=False)
        if record is not None:
            found.append(record)
    return tuple(found)


def _unused(op: Any) -> bool:
    """Whether no op takes a traced op's outputs and its graph returns none
    of them."""
    returned = {id(t) for t in getattr(op.graph, "outputs", None) or ()}
    return all(not t.consumers() and id(t) not in returned for t in op.outputs)


def of_eager_ops(operations: Iterable[Any]) -> tuple[Gradient, ...]:
    """The :class:`Gradient` records of ops run eagerly (each with its
    ``type``, ``attrs``: TensorFlow's flat name, value sequence, ``inputs``
    and ``outputs``: :class:`jacobkit.keras.calls.EagerOp`)."""
    return _records(
        (op for op in operations if op.outputs),
        lambda op: dict(zip(op.attrs[::2], op.attrs[1::2], strict=True)).__getitem__,
    )


def _records(
    operations: Iterable[Any], attributes: Callable[[Any], Callable[[str], Any]]
) -> tuple[Gradient, ...]:
    """The :class:`Gradient` records of the convolution-gradient ops among
    ``operations``, each op's attributes read by ``attributes(op)(name)``."""
    found = []
    for op in operations:
        if op.type not in _GRADIENT_OPS:
            continue
        shapes = tuple(t.shape for t in op.inputs)
        out = op.outputs[0]
        read = gradient_op(op.type, attributes(op), shapes, out.shape, out.dtype)
        if read is not None:
            found.append(read)
    return tuple(found)


_GRADIENT_OPS = frozenset().union(*(c.gradient_ops for c in CONVOLUTIONS))
