"""The cotangents ``batch`` seeds its backward pass with, one per row: one-hot
rows of the model's output, or, where the model ends in a linear head, the
head's kernel columns at the head's input."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import tensorflow as tf

from jacobkit.problem import Problem, structure


@dataclass(frozen=True)
class OneHotRows:
    """The ``count`` rows of the forward pass's per-example rows ``P``,
    ``(B, count)``, each selected by a one-hot cotangent."""

    count: int

    def of(self, start: Any, count: Any, batch: int, dtype: Any) -> Any:
        """``(count, B, K)`` cotangents selecting rows ``start..start+count-1``
        of every example: the gradient of ``sum_b P[b, k]`` at ``z[b]`` is
        ``d P[b, k] / d z[b]`` when examples do not mix."""
        one_hot = tf.one_hot(tf.range(start, start + count), self.count, dtype=dtype)
        return tf.broadcast_to(one_hot[:, None, :], (count, batch, self.count))

    def only(self, batch: int, dtype: Any) -> Any:
        """``(B, 1)``: the cotangent of the one row (``count`` 1), ones: one
        constant, not a range, one_hot, broadcast and squeeze (19 graph
        ops)."""
        return tf.ones((batch, 1), dtype)


@dataclass(frozen=True)
class HeadRows:
    """The model's rows through its linear head ``Y = h @ W + c``, from a
    forward pass whose per-example rows are those of ``h``, ``(B, D)``: row
    ``k`` is ``h @ W[:, k] + c[k]``, so its cotangent at ``h`` is column ``k``
    of ``W`` for every example (exact: the head is linear and not a target).
    This skips the head's backward from one-hot rows: a ``(K*B, K) @ (K, D)``
    matmul per call (11 of 127 GFLOP on the MLP 512-1024-1024-144 at B=256).

    Attributes:
        columns: ``W`` transposed, ``(K, D)``, in the kernel's dtype.
    """

    columns: tf.Tensor

    @property
    def count(self) -> int:
        return int(self.columns.shape[0])

    def of(self, start: Any, count: Any, batch: int, dtype: Any) -> Any:
        """``(count, B, D)``: rows ``start..start+count-1`` of ``W`` transposed
        for every example."""
        rows = tf.cast(self.columns[start : start + count], dtype)
        return tf.broadcast_to(rows[:, None, :], (count, batch, self.columns.shape[1]))

    def only(self, batch: int, dtype: Any) -> Any:
        """``(B, D)``: the cotangent of the one row (``count`` 1), ``W``'s
        column for every example."""
        return tf.squeeze(self.of(0, 1, batch, dtype), 0)


def seed_head(problem: Problem) -> structure.LinearHead | None:
    """The model's linear head, where ``batch`` seeds its backward pass at
    the head's input (:class:`HeadRows`): every row (not a segment of
    them) summing each example's features (``"features"``,
    ``"per_example"``) of a model that certainly ends in a stock linear
    ``Dense``; else ``None``."""
    mode = problem.rows_spec.mode
    if mode not in ("features", "per_example"):
        return None
    try:
        head = structure.find_head(problem)
    except structure.NotApplicable:
        return None
    # every row of the head, not a segment of them (auto's row ranges)
    columns = int(head.kernel().shape[1])
    whole = columns if mode == "features" else columns * (problem.batch_size or 0)
    return head if problem.num_rows == whole else None
