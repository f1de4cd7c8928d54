"""``reduce="norm"``: each row's L2 norm per target, without the rows'
Jacobians held together."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, final

import tensorflow as tf

from jacobkit.problem.reduction.base import (
    Computation,
    Computations,
    Output,
    Problem,
    Reduction,
)
from jacobkit.problem.reduction.rows import Rows


@final
@dataclass(frozen=True)
class Norms(Reduction):
    """Each row's L2 norm per target, shape ``rows_shape`` (a tensor
    target's per-example rows: ``(K, B)`` computed, shown as ``rows_shape``).
    Computed natively chunk by chunk (``chunked``), row by row (``while``) or
    from the closed forms (``batch``); by any other strategy from the rows
    it holds anyway."""

    name = "norm"

    @property
    def argument(self) -> Any:
        return "norm"

    def row_shape(self, target: Any) -> tuple[int, ...]:
        return ()

    def shaped(self, problem: Problem, value: Any, target: Any) -> Any:
        if problem.blocked:
            value = tf.transpose(value)
        return super().shaped(problem, value, target)

    def generic(
        self, problem: Problem, computation: Computations, native: frozenset[str]
    ) -> Computation:
        rows = computation(problem.with_reduction(Rows()))
        blocked = problem.blocked

        def norms(inputs: Any) -> Output:
            found = rows(inputs).values
            return Output(tuple(chunk_norms(j, blocked) for j in found))

        return norms


def chunk_norms(jacobians: tf.Tensor, blocked: bool) -> tf.Tensor:
    """L2 norms over a chunk's parameter axes: ``(c, *v.shape) -> (c,)``, or
    ``(c, B, *block) -> (c, B)`` for own-example blocks (``blocked``), in at
    least float32 (a float16 row's squares overflow from 256 on)."""
    if jacobians.dtype.size < 4:
        jacobians = tf.cast(jacobians, tf.float32)
    first = 2 if blocked else 1
    axes = list(range(first, jacobians.shape.rank))
    squares = tf.square(jacobians)
    return tf.sqrt(tf.reduce_sum(squares, axis=axes) if axes else squares)
