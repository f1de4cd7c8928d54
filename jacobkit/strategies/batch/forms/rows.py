"""``batch``'s rows: each row's kernel and bias gradients in closed form,
summed over the batch chunk by chunk where the rows are."""

from __future__ import annotations

from typing import Any

from jacobkit.problem import Problem
from jacobkit.problem.reduction import Rows
from jacobkit.strategies.batch.contract import (
    Cotangents,
    Taps,
    gradients,
    summed_rows,
)

KIND = Rows


def contract(
    problem: Problem, taps: Taps, cotangents: Cotangents, *, summed: bool
) -> list[Any]:
    """Rows summed over the batch: each chunk's cotangents contracted at once
    and written into the result (the peak is the result plus one chunk);
    per-example rows: one contraction of every row's cotangents."""
    if summed:
        return cotangents.each_chunk(lambda dzs: summed_rows(problem, taps, dzs))
    return gradients(problem, taps, cotangents.every_row(), summed=False)
