"""``forward``: forward mode, batched tangents over parameter elements."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, final

import tensorflow as tf

from jacobkit.problem import Problem
from jacobkit.strategies.base import ZERO, Strategy, check_chunk_size, map_chunks


@final
@dataclass(frozen=True)
class Forward(Strategy):
    """``tf.autodiff.ForwardAccumulator`` with one tangent per parameter
    element: chunks of ``chunk_size`` one-hot tangents are pushed through the
    model together (``tf.vectorized_map``), each giving one column of the
    Jacobian for every row at once. P/c forward passes for a target with P
    elements: the right choice when P is much smaller than the number of rows
    (a bias, a small layer), the wrong one for a large kernel.

    TensorFlow's pfor cannot vectorize a convolution whose filter is the
    batched tangent, so for Conv kernels each chunk runs its tangents one by
    one in a while loop (correct, not vectorized); Dense kernels and every
    bias vectorize.
    """

    name = "forward"
    chunk_size: int = 64

    trace_weight = 3.0

    def __post_init__(self) -> None:
        object.__setattr__(
            self, "chunk_size", check_chunk_size(self.name, self.chunk_size)
        )

    def smaller(self) -> Forward | None:
        """Half the tangents per chunk, down to one."""
        return Forward(self.chunk_size // 2) if self.chunk_size > 1 else None

    def check(self, problem: Problem) -> None:
        """Refuse a model forward mode cannot run through, before it runs.

        ``tf.autodiff.ForwardAccumulator`` cannot push a tangent through a
        ``tf.while_loop`` that reads a target or carries its tangent (a Keras 3
        LSTM, GRU or SimpleRNN layer on or after the target fails with
        "Tried to take gradients (or similar) of a variable without handle
        data"). Where the model runs such a loop, one tangent's computation is
        traced here (nothing runs) to find out.
        """
        if not problem.has_loops:
            return
        targets = list(problem.targets)

        def one_tangent(inputs: Any) -> Any:
            tangents = [tf.zeros(t.shape, t.dtype) for t in targets]
            with tf.autodiff.ForwardAccumulator(targets, tangents) as acc:
                rows = problem.rows(inputs)
            return acc.jvp(rows, unconnected_gradients=ZERO)

        try:
            problem.function(one_tangent).get_concrete_function(problem.inputs)
        except (ValueError, TypeError, LookupError, tf.errors.OpError) as err:
            failed = err
        else:
            return
        layers = problem.recurrent_layers()
        where = (
            f"through {layers}: TensorFlow's forward mode does not support its "
            "tf.while_loop over time steps"
            if layers
            else f"through this model: {_first_line(failed)}"
        )
        refused = ValueError(
            f"jacobian(strategy='forward'): forward mode cannot run {where}. Use "
            "strategy='chunked', 'while' or 'loop' for this target (or 'auto', "
            "which does not pick forward mode here)."
        )
        # a named layer says it all; TensorFlow's traced error would bury it
        raise refused from (None if layers else failed)

    def build(self, problem: Problem) -> Callable[[Any], Any]:
        num_rows = problem.num_rows

        def compute(inputs: Any) -> Any:
            return [
                self._one_target(problem, inputs, target, num_rows)
                for target in problem.targets
            ]

        return compute

    def _one_target(self, problem: Any, inputs: Any, target: Any, num_rows: Any) -> Any:
        num_params = target.shape.num_elements()

        def jvp(tangent: Any) -> Any:
            with tf.autodiff.ForwardAccumulator(target, tangent) as acc:
                rows = problem.rows(inputs)
            # float32 rows of a float16 model: columns in the target's dtype
            return tf.cast(acc.jvp(rows, unconnected_gradients=ZERO), target.dtype)

        def chunk(start: Any, size: Any) -> Any:
            tangents = tf.one_hot(
                tf.range(start, start + size), num_params, dtype=target.dtype
            )
            tangents = tf.reshape(tangents, (size, *target.shape))
            # pfor has no rule for a convolution whose filter is batched (the
            # JVP of a conv kernel); those chunks fall back to a while loop.
            return [tf.vectorized_map(jvp, tangents, fallback_to_while_loop=True)]

        (columns,) = map_chunks(chunk, num_params, self.chunk_size, [target.dtype])
        # columns: (P, R) -> (R, *target.shape)
        return tf.reshape(tf.transpose(columns), (num_rows, *target.shape))


def _first_line(err: BaseException) -> str:
    """The last line of a traced error that says what went wrong."""
    lines = [line.strip() for line in str(err).splitlines() if line.strip()]
    return lines[-1] if lines else type(err).__name__
