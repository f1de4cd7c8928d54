"""``reduce=None``: every row's gradient itself, the Jacobians."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, final

import tensorflow as tf

from jacobkit.problem import tensor_targets
from jacobkit.problem.reduction.base import (
    Call,
    Computation,
    Computations,
    Problem,
    Reduction,
)


@final
@dataclass(frozen=True)
class Rows(Reduction):
    """No reduction: each row's gradient, ``rows_shape + v.shape`` per
    target (each example's own block for a tensor target's per-example
    rows). Every strategy computes it."""

    name = "rows"
    reduces = False
    linear = True

    @property
    def argument(self) -> Any:
        return None

    def check_batches(self, call: Call, *, multi_worker: bool) -> None:
        return None

    def row_shape(self, target: Any) -> tuple[int, ...]:
        return tuple(target.shape)

    def shaped(self, problem: Problem, value: Any, target: Any) -> Any:
        if problem.blocked:
            return tensor_targets.own_example_blocks(value, problem.rows_shape)
        shape = problem.rows_shape + tuple(target.shape)
        return value if tuple(value.shape) == shape else tf.reshape(value, shape)

    def generic(
        self, problem: Problem, computation: Computations, native: frozenset[str]
    ) -> Computation:
        raise TypeError(
            "every strategy computes the rows: list 'rows' in its native kinds"
        )
