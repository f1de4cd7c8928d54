"""Two ways of computing one problem's result timed against each other on
its steady calls, the faster kept: the one a prior chose (:data:`PRIOR`)
and one other (:data:`OTHER`). ``auto``'s reduced calls
(:mod:`jacobkit.planner.reduced`: the first candidate that fits, against
the next that fits) and ``jk.gram``'s arrangements
(:mod:`jacobkit.reductions.arrangement`: the cost rule's forms, against
every row formed) use it.

The calls follow :data:`SCHEDULE`: the first runs the prior's way (a first
call traces nothing more than before), the third traces the other, and the
untraced calls are timed, alternating; the faster by its best timed call
(as ``jacobian``'s trials judge: the first run after a trace is slow while
the allocator grows) is kept from the seventh call on, the prior's on a
tie or within the trial's noise. An other way whose first timed call took
over :data:`GIVE_UP` times the prior's best is dropped there (one slow
steady call, not two).
"""

from __future__ import annotations

from dataclasses import dataclass, field

PRIOR = 0
OTHER = 1
#: which way each call runs until one is kept
SCHEDULE = (PRIOR, PRIOR, OTHER, OTHER, PRIOR, OTHER)
#: the calls of :data:`SCHEDULE` whose time counts (the others trace)
TIMED = frozenset({1, 3, 4, 5})
#: the other way dropped after its first timed call where it took over this
#: many times the prior's best
GIVE_UP = 2.0


def choose(times: dict[int, list[float]], noise: float = 1.0) -> int:
    """The way to keep from each one's timed calls (seconds): the other
    where its best call is faster than the prior's best by more than
    ``noise`` (a factor: 1.15 is 15%), else the prior."""
    if not times.get(OTHER) or not times.get(PRIOR):
        return PRIOR
    return OTHER if min(times[OTHER]) * noise < min(times[PRIOR]) else PRIOR


@dataclass
class Trial:
    """One problem's two ways: what each timed call took, and the one kept
    (``None`` while timing); ``noise``: by how much the other must be
    faster to be kept (:func:`choose`)."""

    noise: float = 1.0
    calls: int = 0
    times: dict[int, list[float]] = field(
        default_factory=lambda: {PRIOR: [], OTHER: []}
    )
    kept: int | None = None

    def next(self) -> int:
        """The way the next call runs."""
        if self.kept is not None:
            return self.kept
        return SCHEDULE[self.calls]

    def record(self, way: int, seconds: float) -> None:
        """A call the way :meth:`next` said took ``seconds``."""
        if self.kept is not None:
            return
        if self.calls in TIMED:
            self.times[way].append(seconds)
        self.calls += 1
        other, prior = self.times[OTHER], self.times[PRIOR]
        if len(other) == 1 and prior and other[0] > GIVE_UP * min(prior):
            self.kept = PRIOR
        elif self.calls == len(SCHEDULE):
            self.kept = choose(self.times, self.noise)

    def end(self, way: int = PRIOR) -> None:
        """Keep ``way`` from now on, untimed (nothing else to try, or a
        budget that decided)."""
        self.kept = way
