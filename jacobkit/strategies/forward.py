"""``forward``: forward mode, batched tangents over parameter elements."""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, final

import tensorflow as tf

from jacobkit.problem import Problem, through
from jacobkit.strategies import vectorize
from jacobkit.strategies.base import ZERO, Strategy
from jacobkit.strategies.chunks import check_chunk_size, map_chunks


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

    Its cost is known before it runs: one forward pass per Conv kernel element
    and one per chunk of the other targets' elements, against the loop's one
    backward pass (about 3 forward passes) per row. Where that predicts more
    than ``max_slowdown`` times the loop's passes and more than
    :data:`MANY_PASSES`, :meth:`check` refuses with the numbers (MobileNetV2's
    ``Conv_1``: 409,600 passes). ``max_slowdown=None`` runs it anyway.
    """

    name = "forward"
    #: a forward pass per chunk of tangents
    one_pass = False
    chunk_size: int = 64
    max_slowdown: float | None = 10.0

    trace_weight = 3.0
    result_copies = 1

    def __post_init__(self) -> None:
        object.__setattr__(
            self, "chunk_size", check_chunk_size(self.name, self.chunk_size)
        )

    def smaller(self) -> Forward | None:
        """Half the tangents per chunk, down to one."""
        if self.chunk_size <= 1:
            return None
        return dataclasses.replace(self, chunk_size=self.chunk_size // 2)

    def check(self, problem: Problem) -> None:
        """Refuse a model forward mode cannot run through, before it runs.

        ``tf.autodiff.ForwardAccumulator`` cannot push a tangent through a
        ``tf.while_loop`` that reads a target or carries its tangent (a Keras 3
        LSTM, GRU or SimpleRNN layer on or after the target fails with
        "Tried to take gradients (or similar) of a variable without handle
        data"). Where the model runs such a loop, one tangent's computation is
        traced here (nothing runs) to find out.
        """
        _check_cost(self, problem)
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
        layers = through.recurrent_layers(problem)
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
            return [
                vectorize.vectorized_map(jvp, tangents, fallback_to_while_loop=True)
            ]

        (columns,) = map_chunks(chunk, num_params, self.chunk_size)
        # columns: (P, R) -> (R, *target.shape)
        return tf.reshape(tf.transpose(columns), (num_rows, *target.shape))


def _first_line(err: BaseException) -> str:
    """The last line of a traced error that says what went wrong."""
    lines = [line.strip() for line in str(err).splitlines() if line.strip()]
    return lines[-1] if lines else type(err).__name__


#: up to this many forward passes run whatever their ratio to the loop.
#: Measured: MobileNetV2 at 32 px, batch 2, its 432-element first kernel
#: (one pass each, in a while loop) took 20 s with tracing, on a loaded 2-core
#: CPU; 2,000 passes are then about a minute and a half
MANY_PASSES = 2_000
#: one backward pass of the loop, in forward passes
_BACKWARD_PASSES = 3


def predicted_passes(strategy: Forward, problem: Problem) -> int:
    """Forward passes ``strategy`` makes: a Conv kernel's (rank >= 3)
    tangents run one by one (see :class:`Forward`), others in chunks."""
    passes = 0
    for target in problem.targets:
        size = int(target.shape.num_elements())
        one_by_one = target.shape.rank is not None and target.shape.rank >= 3
        passes += size if one_by_one else math.ceil(size / strategy.chunk_size)
    return passes


def predicted_slowdown(strategy: Forward, problem: Problem) -> float:
    """:func:`predicted_passes` over the loop's passes (one backward pass,
    about 3 forward passes, per row): what :meth:`Forward.check` holds to
    ``max_slowdown``."""
    loop_passes = _BACKWARD_PASSES * max(problem.num_rows, 1)
    return predicted_passes(strategy, problem) / loop_passes


def _check_cost(strategy: Forward, problem: Problem) -> None:
    """Refuse, with the numbers, where forward mode makes more than
    ``strategy.max_slowdown`` times the loop's passes and more than
    :data:`MANY_PASSES`; an eager forward pass is timed only then, for the
    message."""
    if strategy.max_slowdown is None:
        return
    passes = predicted_passes(strategy, problem)
    loop_passes = _BACKWARD_PASSES * problem.num_rows
    if passes <= max(strategy.max_slowdown * loop_passes, MANY_PASSES):
        return
    problem.call_model(problem.inputs)  # the first call builds; time the next
    start = time.perf_counter()
    problem.call_model(problem.inputs)
    per_pass = time.perf_counter() - start
    predicted = passes * per_pass
    raise ValueError(
        f"jacobian(strategy='forward'): forward mode needs {passes:,} forward "
        f"passes here (one per element of a Conv kernel, one per "
        f"{strategy.chunk_size} of the others), up to {predicted:,.0f} s at "
        f"{per_pass * 1e3:.1f} ms an eager pass; the loop needs "
        f"{problem.num_rows:,} backward passes (about "
        f"{loop_passes * per_pass:,.1f} s): {passes / loop_passes:,.0f}x slower. "
        "Use strategy='loop', 'chunked' or 'auto', or "
        "jacobkit.strategies.Forward(max_slowdown=None) to run it anyway."
    )
