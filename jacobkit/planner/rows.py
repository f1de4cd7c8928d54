"""Row ranges: a problem restricted to rows ``[start, start + size)``.

``auto`` computes the answer in equal segments of rows so that it can time a
strategy while it computes real rows, and change strategy between segments
without computing any row twice. A segment's start is a ``tf.Variable``
read inside the compiled computation, so one trace serves every segment of
the same size: a strategy is traced once per segment size, whichever rows it
computes.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Any

import tensorflow as tf

from jacobkit.problem import Problem, per_model

#: model -> {(problem key, size): the segment's start variable}
_STARTS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


@dataclass(frozen=True)
class _SegmentRows:
    """The problem's :class:`~jacobkit.problem.Rows`, as a segment sees them.

    A segment of ``"per_example"`` or ``"full"`` rows may start or end in the
    middle of an example, so it does not decompose per example (strategies
    that need that refuse it in their ``check``); ``"features"`` rows are
    sums over the batch, and a segment of them is a slice of features.
    """

    whole: Any
    size: int
    num_rows: int

    @property
    def mode(self) -> Any:
        return self.whole.mode

    @property
    def features(self) -> Any:
        return self.whole.features

    @property
    def summed_over_batch(self) -> bool:
        return self.whole.summed_over_batch

    @property
    def decomposes_per_example(self) -> bool:
        if self.size == self.num_rows:
            return self.whole.decomposes_per_example
        return self.whole.summed_over_batch

    def __getattr__(self, name: str) -> Any:
        return getattr(self.whole, name)


class RowRange:
    """``problem`` restricted to ``size`` consecutive rows from :attr:`start`.

    It answers what strategies ask of a problem (``rows``, ``num_rows``,
    ``targets``, ``key``, ...) and forwards the rest to the problem. Set the
    rows with :meth:`select` before each run. ``start`` is the variable the
    compiled computations read: one per (model, problem, size), shared by
    every call's view.
    """

    def __init__(self, problem: Problem, size: int, start: tf.Variable) -> None:
        self._problem = problem
        self.num_rows = int(size)
        self.rows_shape = (self.num_rows,)
        self.rows_spec = _SegmentRows(problem.rows_spec, size, problem.num_rows)
        self.start = start

    def detached(self) -> RowRange:
        """The same rows of the problem without its input values (see
        :meth:`~jacobkit.problem.Problem.detached`)."""
        return RowRange(self._problem.detached(), self.num_rows, self.start)

    @property
    def key(self) -> tuple:
        return (self._problem.key, "rows", self.num_rows)

    @property
    def inputs(self) -> Any:
        return self._problem.inputs

    def select(self, start: int) -> None:
        """Compute rows ``[start, start + size)`` on the next run."""
        if not 0 <= start <= self._problem.num_rows - self.num_rows:
            raise ValueError(
                f"RowRange.select({start}): rows {start}..{start + self.num_rows} "
                f"are outside 0..{self._problem.num_rows}"
            )
        self.start.assign(start)

    def rows(self, inputs: Any) -> tf.Tensor:
        """Rows ``[start, start + size)`` of the problem's flat rows."""
        return tf.slice(self._problem.rows(inputs), [self.start], [self.num_rows])

    def per_example_rows(self, inputs: Any, hook: Any = None) -> tf.Tensor:
        """For ``"features"`` rows: ``(B, size)``, the segment's columns
        (``hook`` as in :meth:`~jacobkit.problem.Problem.call_model`)."""
        per_example = self._problem.per_example_rows(inputs, hook)
        if self.num_rows == self._problem.num_rows:
            return per_example
        return tf.slice(per_example, [0, self.start], [-1, self.num_rows])

    def __getattr__(self, name: str) -> Any:
        return getattr(self._problem, name)


def segment_view(problem: Problem, size: int) -> Problem | RowRange:
    """The view computing ``size`` rows at a time: ``problem`` itself when
    ``size`` is every row, else a :class:`RowRange` on the start variable
    cached per (model, problem, size), so compiled strategies find their own
    variable again (a cached view would keep this call's inputs alive)."""
    if size == problem.num_rows:
        return problem
    starts = per_model(_STARTS, problem.model)
    key = (problem.key, size)
    if key not in starts:
        starts[key] = tf.Variable(0, dtype=tf.int32, trainable=False, name="row_start")
    return RowRange(problem, size, starts[key])


def segment_size(num_rows: int, target: int) -> int:
    """Rows per segment: the divisor of ``num_rows`` nearest ``target`` within
    ``[target / 2, 2 * target]`` (equal segments need one trace), else every
    row in one segment."""
    best = num_rows
    for size in range(max(1, target // 2), min(num_rows, 2 * target) + 1):
        if num_rows % size == 0 and abs(size - target) < abs(best - target):
            best = size
    return best
