"""The matrix products of a forward pass whose gradients take an operand
transposed: what :mod:`jacobkit.strategies.gradients`' ``MatMul`` rule
copies (oneDNN off), read from the inspecting pass (traced or eager) so
that the planner can count the copies before a strategy runs.

For ``c = a @ b`` (a ``MatMul`` without transposes), the gradient for ``a``
is ``dc @ bᵀ`` and the one for ``b`` is ``aᵀ @ dc``: each input whose
gradient the backward pass takes (it is downstream of a target) names the
*other* input as the operand taken transposed. One record per such operand:
its bytes and the product's rows (the rule copies only where a product has
enough rows, and only operands that are not too large).
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass
from typing import Any

#: the op type whose gradient the rule replaces
MATMUL = "MatMul"


@dataclass(frozen=True)
class Transposed:
    """An operand of a forward ``MatMul`` that its gradient takes transposed.

    Attributes:
        rows: the product's rows (``c``'s leading axis, the cotangent's).
        bytes: the operand's bytes.
    """

    rows: int
    bytes: int


def of_graph(
    operations: Sequence[Any], reads: Collection[str]
) -> tuple[Transposed, ...]:
    """The transposed operands of a traced forward pass's ``operations``
    (graph ops, in order), given the names of the tensors through which it
    reads the targets (``reads``: the placeholders of their captures):
    every ``MatMul`` without transposes, of known shapes."""
    differentiated = set(reads)
    found = []
    for op in operations:
        if any(t.name in differentiated for t in op.inputs):
            differentiated.update(t.name for t in op.outputs)
        if (
            op.type != MATMUL
            or op.get_attr("transpose_a")
            or op.get_attr("transpose_b")
        ):
            continue
        needed = [t.name in differentiated for t in op.inputs]
        found += _operands(op.inputs, op.outputs[0], needed)
    return tuple(found)


def of_eager(ops: Sequence[Any], handles: set[int]) -> tuple[Transposed, ...]:
    """The transposed operands of an eager forward pass's recorded ``ops``
    (each with ``type``, ``inputs``, ``outputs``), given the ids of the
    targets' handles. The record has no attributes: a ``MatMul`` counts
    where its shapes are those of a product without transposes (``(m, k)
    @ (k, n) -> (m, n)``; a square transposed product would count too)."""
    differentiated = set(handles)
    found = []
    for op in ops:
        if any(id(t) in differentiated for t in op.inputs):
            differentiated.update(id(t) for t in op.outputs)
        if op.type != MATMUL or len(op.inputs) != 2 or not op.outputs:
            continue
        a, b = (tuple(t.shape) for t in op.inputs)
        c = tuple(op.outputs[0].shape)
        if len(a) != 2 or len(b) != 2 or a[1] != b[0] or c != (a[0], b[1]):
            continue
        needed = [id(t) in differentiated for t in op.inputs]
        found += _operands(op.inputs, op.outputs[0], needed)
    return tuple(found)


def _operands(inputs: Any, output: Any, needed: list[bool]) -> list[Transposed]:
    """The operands taken transposed for the inputs ``needed`` (input 0's
    gradient takes input 1, and the other way), where the shapes are known."""
    rows = output.shape[0] if output.shape.rank == 2 else None
    if rows is None:
        return []
    found = []
    for i, other in ((0, 1), (1, 0)):
        if not needed[i]:
            continue
        count = inputs[other].shape.num_elements()
        if count is not None:
            size = count * inputs[other].dtype.size
            found.append(Transposed(int(rows), int(size)))
    return found


def extrapolated(
    first: Sequence[Transposed],
    second: Sequence[Transposed],
    sizes: tuple[int, int],
    batch: int,
) -> tuple[Transposed, ...] | None:
    """The operands on ``batch`` examples from two eager passes on ``sizes``
    examples, each figure affine in the examples (a weight's the same, an
    activation's one example's times ``B``); ``None`` where they do not
    match."""
    if len(first) != len(second):
        return None
    found = []
    for one, two in zip(first, second, strict=True):
        rows = _affine(one.rows, two.rows, sizes, batch)
        size = _affine(one.bytes, two.bytes, sizes, batch)
        if rows is None or size is None:
            return None
        found.append(Transposed(rows, size))
    return tuple(found)


def _affine(small: int, large: int, sizes: tuple[int, int], batch: int) -> int | None:
    """``s(batch)`` of a figure with ``s(a) = small`` and ``s(b) = large``
    on ``sizes = (a, b)`` examples, affine in the examples with a whole,
    non-negative step (``None``: not)."""
    a, b = sizes
    step, rest = divmod(large - small, b - a)
    if step < 0 or rest:
        return None
    return small + (batch - a) * step
