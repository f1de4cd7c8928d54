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

#: the most bytes of one chunk's summed rows (every target's gradients of
#: the chunk's rows, held until they are written into the result).
#: NOTE (why). Where TensorFlow's pooled CPU allocator is off (its default
#: allocator, glibc's malloc), a block over 32 MiB, malloc's largest
#: threshold, is always a fresh mapping: page-faulted on first touch and
#: unmapped when freed, so every chunk's result was faulted in afresh.
#: Measured (MLP 512-1024-1024-144, B=256, target hidden1, oneDNN off, one
#: core, loaded): 16 rows a chunk (32 MiB) took 147.6k minor page faults a
#: call, twice the result's 73.7k, and 0.29-0.35 s of system time; 12 rows
#: (24 MiB) 74-86k faults, 0.14-0.17 s; the call's least CPU time in three
#: paired runs 0.93-1.04x ``while``'s, where 16 rows took 1.06-1.14x (the
#: same bits). With oneDNN on (its own pooled allocator), no change
#: measured (1.01x). A smaller chunk also lowers the peak.
CHUNK_RESULT_BYTES = 28 * 2**20


def contract(
    problem: Problem, taps: Taps, cotangents: Cotangents, *, summed: bool
) -> list[Any]:
    """Rows summed over the batch: each chunk's cotangents contracted at once
    and written into the result (the peak is the result plus one chunk, at
    most :data:`CHUNK_RESULT_BYTES`); per-example rows: one contraction of
    every row's cotangents."""
    if summed:
        row_bytes = sum(t.shape.num_elements() * t.dtype.size for t in problem.targets)
        chunks = cotangents.at_most(CHUNK_RESULT_BYTES // max(row_bytes, 1))
        return chunks.each_chunk(lambda dzs: summed_rows(problem, taps, dzs))
    return gradients(problem, taps, cotangents.every_row(), summed=False)
