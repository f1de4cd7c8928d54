"""``while``: ``tape.jacobian`` without pfor, rows in a ``tf.while_loop``."""

from __future__ import annotations

import numbers
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, final

import tensorflow as tf

from jacobkit.problem import Problem
from jacobkit.problem.reduction import Norms, Rows
from jacobkit.strategies.base import ZERO, Strategy
from jacobkit.strategies.chunks import as_norms, rows_in_chunks

#: TensorFlow's default ``parallel_iterations`` of a while loop
DEFAULT_PARALLEL_ITERATIONS = 10


@final
@dataclass(frozen=True)
class While(Strategy):
    """``tape.jacobian(rows, targets, experimental_use_pfor=False)`` inside a
    ``tf.function``: R backward passes in a ``tf.while_loop``, no Python
    overhead per row, no vectorization speed-up.

    Up to ``parallel_iterations`` rows run at once (``None``: TensorFlow's
    default of 10), and each holds one backward pass's buffers: measured on
    CPU, the Conv1D generator peaked at 38 MiB with 1, 61 MiB with 2 and
    72 MiB with the default, for ~10% more time with 1. ``auto`` sets it from
    the memory budget.
    """

    name = "while"
    parallel_iterations: int | None = field(
        default=None, metadata={"label": "parallel"}
    )

    trace_weight = 1.0

    @classmethod
    def for_auto(cls, num_rows: int) -> While:
        return While(min(DEFAULT_PARALLEL_ITERATIONS, num_rows))

    @classmethod
    def for_reduced(cls, problem: Problem) -> tuple[Strategy, ...]:
        """One row at a time, reduced before the next: where pfor cannot run
        (a depthwise convolution's gradient, float16 rows), or where nothing
        vectorized fits."""
        return (While(1),)

    reduced_preference = 3
    convolution_gradients = "loop"

    def rows_at_once(self, num_rows: int) -> int:
        return min(self.parallel_iterations or DEFAULT_PARALLEL_ITERATIONS, num_rows)

    def sequential_rows(self) -> bool:
        return True

    def rows_formed(self, num_rows: int) -> int:
        """Each iteration in flight's row."""
        return self.rows_at_once(num_rows)

    def passes_in_flight(self, num_rows: int) -> int:
        """Each iteration in flight runs its own row's backward pass."""
        return self.rows_at_once(num_rows)

    def __post_init__(self) -> None:
        parallel = self.parallel_iterations
        if parallel is not None and (
            isinstance(parallel, bool)
            or not isinstance(parallel, numbers.Integral)
            or parallel < 1
        ):
            raise ValueError(
                f"strategies.while(parallel_iterations={parallel!r}): "
                "expected a positive int (rows in flight at once), or None for "
                "TensorFlow's default."
            )
        if parallel is not None:
            object.__setattr__(self, "parallel_iterations", int(parallel))

    @property
    def key(self) -> tuple[Any, ...]:
        """``None`` read as TensorFlow's default of 10: ``While()`` and
        ``While(10)`` build the same loop, and share one compiled
        computation (a user calling both traces once)."""
        parallel = self.parallel_iterations or DEFAULT_PARALLEL_ITERATIONS
        return (self.name, (("parallel_iterations", parallel),))

    def smaller(self) -> While | None:
        """Half the rows in flight (from TensorFlow's default of 10), down
        to one."""
        parallel = self.parallel_iterations or DEFAULT_PARALLEL_ITERATIONS
        return While(parallel // 2) if parallel > 1 else None

    def builds(self) -> Mapping[str, Callable[[Problem], Callable[[Any], Any]]]:
        """The rows, and their norms one row at a time
        (:func:`_norms_row_by_row`)."""
        return {Rows.name: self.build, Norms.name: _norms_row_by_row}

    def build(self, problem: Problem) -> Callable[[Any], Any]:
        targets = problem.targets
        parallel = self.parallel_iterations

        def compute(inputs: Any) -> Any:
            with tf.GradientTape(
                persistent=True, watch_accessed_variables=False
            ) as tape:
                tape.watch(targets)
                rows = problem.rows(inputs)
                # tape.jacobian stacks gradients in the rows' dtype: rows are
                # seeded in each target's dtype (float32 rows, float16 targets)
                seeded = {t.dtype: tf.cast(rows, t.dtype) for t in targets}
            jacobians = {}
            for dtype, rows_in_dtype in seeded.items():
                group = [t for t in targets if t.dtype == dtype]
                found = tape.jacobian(
                    rows_in_dtype,
                    group,
                    unconnected_gradients=ZERO,
                    parallel_iterations=parallel,
                    experimental_use_pfor=False,
                )
                jacobians.update({id(t): j for t, j in zip(group, found)})
            return [jacobians[id(t)] for t in targets]

        return compute


def _norms_row_by_row(problem: Problem) -> Callable[[Any], Any]:
    """``reduce="norm"``: each row's gradient in turn (a ``tf.while_loop``,
    one row in flight), reduced to its norms before the next, so that one
    row's gradients are held at a time. It is the norms' (and so the clipped
    sum's) way where pfor cannot run: ``chunked`` refuses a depthwise
    convolution's gradient, and before this ``auto`` had nothing else that
    does not hold every row's Jacobians."""
    targets = problem.targets

    def one_row(tape: Any, rows: tf.Tensor, cotangents: tf.Tensor) -> list[tf.Tensor]:
        found = tape.gradient(
            rows, targets, output_gradients=cotangents[0], unconnected_gradients=ZERO
        )
        # (an embedding's gradient comes as IndexedSlices)
        return [tf.convert_to_tensor(g)[None] for g in found]

    return rows_in_chunks(problem, 1, one_row, as_norms)
