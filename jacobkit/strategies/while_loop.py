"""``while``: ``tape.jacobian`` without pfor, one row per loop iteration."""

from __future__ import annotations

from typing import final

import tensorflow as tf

from jacobkit.problem import Problem
from jacobkit.strategies.base import ZERO, Strategy


@final
class While(Strategy):
    """``tape.jacobian(rows, targets, experimental_use_pfor=False)`` inside a
    ``tf.function``: R backward passes in a ``tf.while_loop``. Memory of one
    row at a time, no Python overhead per row, no vectorization speed-up."""

    name = "while"

    def build(self, problem: Problem):
        targets = problem.targets

        def compute(inputs):
            with tf.GradientTape(
                persistent=True, watch_accessed_variables=False
            ) as tape:
                tape.watch(targets)
                rows = problem.rows(inputs)
            return tape.jacobian(
                rows, targets, unconnected_gradients=ZERO, experimental_use_pfor=False
            )

        return compute
