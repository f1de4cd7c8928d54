"""The memory accounting of one session: what a run is predicted to peak
at, and whether a strategy fits."""

from __future__ import annotations

from dataclasses import dataclass

from jacobkit.planner import estimates as est
from jacobkit.planner.scratch import MemoryPrior
from jacobkit.strategies import Strategy


@dataclass(frozen=True)
class Footprint:
    """The sizes a session's peaks are predicted and checked from.

    Attributes:
        num_rows: rows of the problem (every call computes them all at once).
        result_bytes: the whole result.
        allowed_bytes: what the plan may use (the budget times the safety
            margin).
        prior: what peaks are predicted from before they are measured.
    """

    num_rows: int
    result_bytes: int
    allowed_bytes: float
    prior: MemoryPrior

    def predicted_peak(self, strategy: Strategy) -> int:
        """Predicted peak of one run of every row."""
        return est.predicted_peak(
            strategy, self.num_rows, self.prior, self.result_bytes
        )

    def fits(
        self, strategy: Strategy, peak: int | None = None, room: float | None = None
    ) -> bool:
        """Whether ``strategy``'s peak (``peak`` where measured, else
        predicted) fits ``room`` (default: what the budget allows)."""
        room = self.allowed_bytes if room is None else room
        if peak is None:
            peak = self.predicted_peak(strategy)
        return peak <= room
