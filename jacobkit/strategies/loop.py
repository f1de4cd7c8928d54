"""``loop``: one ``tape.gradient`` per row on a persistent tape (the baseline)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, final

import tensorflow as tf

from jacobkit.problem import Problem
from jacobkit.strategies.base import ZERO, Strategy


@final
@dataclass(frozen=True)
class Loop(Strategy):
    """A persistent ``tf.GradientTape`` and one ``tape.gradient`` per row, in
    eager Python: what users write first. R backward passes run one after
    another; the extra memory is one row's cotangents, but the tape keeps the
    whole forward pass alive for the whole loop.
    """

    name = "loop"
    compiled = False

    trace_weight = 0.0

    def rows_at_once(self, num_rows: int) -> int:
        return 1

    def sequential_rows(self) -> bool:
        return True

    def build(self, problem: Problem) -> Callable[[Any], Any]:
        targets = problem.targets

        def compute(inputs: Any) -> Any:
            with tf.GradientTape(
                persistent=True, watch_accessed_variables=False
            ) as tape:
                tape.watch(targets)
                # Rows are sliced inside the tape so that each slice is
                # recorded; a slice taken outside has no gradient (None).
                rows = tf.unstack(problem.rows(inputs))
            per_row = [
                tape.gradient(row, targets, unconnected_gradients=ZERO) for row in rows
            ]
            return [tf.stack(grads) for grads in zip(*per_row)]

        return compute
