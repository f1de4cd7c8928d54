"""``jacobian``: TensorFlow's own ``tape.jacobian`` with pfor vectorization."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, final

import tensorflow as tf

from jacobkit.problem import Problem
from jacobkit.strategies import precision, vectorize
from jacobkit.strategies.base import ZERO, Strategy


@final
@dataclass(frozen=True)
class Jacobian(Strategy):
    """``tape.jacobian(rows, targets, experimental_use_pfor=True)`` inside a
    ``tf.function``: every row is vectorized into one pass. Fast, but the
    pass holds R times the activations after the target layer at once."""

    name = "jacobian"

    trace_weight = 2.5

    def vectorized_rows(self) -> bool:
        return True

    def check(self, problem: Problem) -> None:
        precision.refuse_float16_vectorized(problem, self.name)

    def build(self, problem: Problem) -> Callable[[Any], Any]:
        targets = problem.targets

        def compute(inputs: Any) -> Any:
            with tf.GradientTape(
                persistent=True, watch_accessed_variables=False
            ) as tape:
                tape.watch(targets)
                rows = problem.rows(inputs)
            return vectorize.jacobian(tape, rows, targets, unconnected_gradients=ZERO)

        return compute
