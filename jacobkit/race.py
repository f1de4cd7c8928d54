"""Racing ``auto``'s near-equal candidates on its first real calls.

Probes are short, and on a busy machine their timings move by tens of
percent, so candidates predicted within :data:`jacobkit.planner.RACE_MARGIN`
of the fastest are not told apart by the prediction alone. The plan then
names a shortlist, and ``jacobian(strategy="auto")`` runs its calls with each
candidate in turn: every candidate's first (compiling) call is not timed,
the next :data:`RUNS` are. Once every candidate has its timings, the one with
the least time wins and every later call runs it. Every candidate computes
the same Jacobians and was predicted to fit the memory budget, so racing
changes only how long the first calls take.
"""

from __future__ import annotations

from collections.abc import Sequence

from jacobkit.strategies import Strategy

#: timed (not compiling) calls per candidate before the race is decided
RUNS = 2


class Race:
    """Which candidate the next call runs, and what the calls measured.

    Args:
        candidates: the planned strategy first, then the shortlist.
    """

    def __init__(self, candidates: Sequence[Strategy]) -> None:
        if not candidates:
            raise ValueError("Race needs at least one candidate")
        self.candidates = list(candidates)
        self.times: dict[Strategy, list[float]] = {c: [] for c in self.candidates}
        self.winner: Strategy | None = (
            self.candidates[0] if len(self.candidates) == 1 else None
        )

    def next(self) -> Strategy:
        """The strategy the next call should run."""
        if self.winner is not None:
            return self.winner
        # the candidate with the fewest timings; the earlier one on ties
        return min(self.candidates, key=lambda c: len(self.times[c]))

    def record(self, strategy: Strategy, seconds: float, compiled: bool) -> None:
        """Note one call's wall time; ``compiled``: the call traced (not timed)."""
        if self.winner is not None or strategy not in self.times:
            return
        if compiled:  # tracing time is not the strategy's speed
            return
        self.times[strategy].append(seconds)
        if all(len(t) >= RUNS for t in self.times.values()):
            self.winner = min(self.candidates, key=lambda c: min(self.times[c]))

    def finish(self, strategy: Strategy) -> None:
        """End the race on ``strategy`` (e.g. the size an out-of-memory back-off
        settled on)."""
        self.winner = strategy

    def summary(self) -> str:
        """One line: who is racing, or who won with what times."""
        timed = ", ".join(
            f"{c.label} {min(t) * 1e3:.1f} ms" if t else f"{c.label} (not timed yet)"
            for c, t in self.times.items()
        )
        if self.winner is None:
            return f"racing on the first calls: {timed}"
        if len(self.candidates) == 1:
            return f"runs {self.winner.label}"
        return f"raced on the first calls ({timed}): {self.winner.label} won"
