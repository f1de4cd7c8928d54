"""The memory accounting of one session: what a run of some rows is
predicted to peak at, and what earlier runs' Jacobians keep alive meanwhile."""

from __future__ import annotations

from dataclasses import dataclass

from jacobkit.planner import estimates as est
from jacobkit.planner.scratch import MemoryPrior
from jacobkit.strategies import Strategy


@dataclass(frozen=True)
class Footprint:
    """The sizes a session's peaks are predicted and checked from.

    Attributes:
        num_rows: rows of the problem.
        segment_rows: rows per segment (``num_rows``: whole calls).
        result_bytes: the whole result.
        segment_result_bytes: one segment's Jacobians.
        allowed_bytes: what the plan may use (the budget times the safety
            margin).
        prior: what peaks are predicted from before they are measured.
    """

    num_rows: int
    segment_rows: int
    result_bytes: int
    segment_result_bytes: int
    allowed_bytes: float
    prior: MemoryPrior

    @property
    def kept_bytes(self) -> int:
        """Earlier segments' Jacobians, alive while a segment runs."""
        return self.kept_during(self.segment_rows)

    def kept_during(self, rows: int) -> int:
        """Earlier runs' Jacobians alive while a run of ``rows`` rows runs
        (none for a run of every row)."""
        return self.result_bytes if rows < self.num_rows else 0

    def predicted_peak(self, strategy: Strategy, rows: int | None = None) -> int:
        """Predicted peak of one run of ``rows`` rows (default: a segment)."""
        rows = self.segment_rows if rows is None else rows
        segment = rows == self.segment_rows
        result = self.segment_result_bytes if segment else self.result_bytes
        return est.predicted_peak(strategy, rows, self.prior, result)

    def fits(
        self,
        strategy: Strategy,
        peak: int | None = None,
        room: float | None = None,
        rows: int | None = None,
    ) -> bool:
        """Whether ``strategy``'s peak on runs of ``rows`` rows (default: a
        segment; ``peak`` where measured, else predicted) plus the kept
        segments fits ``room`` (default: what the budget allows)."""
        room = self.allowed_bytes if room is None else room
        rows = self.segment_rows if rows is None else rows
        if peak is None:
            peak = self.predicted_peak(strategy, rows)
        return peak + self.kept_during(rows) <= room
