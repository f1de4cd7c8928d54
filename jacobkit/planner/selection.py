"""Which strategies ``auto`` considers, which it starts on, when it tries
another, and which wins.

- Candidates: every registered strategy's
  :meth:`~jacobkit.strategies.Strategy.for_auto` configuration, made smaller
  (:meth:`~jacobkit.strategies.Strategy.smaller`) until its predicted peak
  fits, ordered by :attr:`~jacobkit.strategies.Strategy.trace_weight`: the
  first call starts on the one cheapest to trace (``while``), because
  explainability code often calls ``jacobian`` once or a few times.
- Starting: the cheapest to trace, unless a candidate that computes more
  rows at once traces within :data:`START_TRACE_FACTOR` of it and is
  predicted to peak within :data:`START_PEAK_FACTOR` of it: then that one
  (:func:`starting_first`).
- Trying another (a ski-rental rule): a candidate is tried on real calls
  (or segments of them) once the time spent running the current strategy
  (tracing not counted) reaches :data:`RENT` times the candidate's predicted
  tracing time, and never in a process's first call. Whatever it could save, trying it
  then costs at most ``1 / RENT`` more than never trying it, and nothing
  when the calls stop early.
- Winning: the least time per row; where rates are within :data:`NOISE`,
  the lower peak.
"""

from __future__ import annotations

from collections.abc import Callable

from jacobkit import strategies
from jacobkit.planner.plan import Estimate, Rejection
from jacobkit.strategies import Strategy

#: try a candidate once the current strategy has run this many times its
#: predicted tracing time. The classic ski-rental bound is 2 (at most twice
#: the cost of the better choice), but explainability code often stops after
#: a few calls: at 5, a try costs at most 20% over never trying, which is
#: what "the first 3 calls within 1.2x the best fixed strategy" allows.
#: Measured (2-core CPU, MLP 512-1024-1024-144, B=256): with 2, calls 2-3
#: traced batch and chunked and the first 3 calls took 1.6x the best fixed
#: strategy's; ``while`` alone took 1.04x.
RENT = 5.0
#: trace the current strategy for whole calls once joining its segments has
#: cost this many times its tracing time (1: the ski-rental break-even; the
#: saving is measured, not guessed, so no margin is needed)
WHOLE_RENT = 1.0
#: start on a candidate computing more rows at once than the cheapest to
#: trace where it traces within this factor of it (``chunked`` against
#: ``while``: 1.5) and its predicted peak is within :data:`START_PEAK_FACTOR`
#: of it: its first call then costs about the same tracing and, where
#: vectorizing rows costs little memory, less per row. Measured (2-core CPU):
#:
#: - MLP 512-1024-1024-144, B=256, target hidden1: chunked(144) predicted at
#:   2.3x while's peak (measured 1.1x); first calls chunked(144) 1.43 s,
#:   tape.jacobian 1.24 s, while 1.61 s; steady 0.88, 0.77 and 1.19 s.
#: - generator B=64 T=128 (64/128/128 filters), target conv1: chunked(144)
#:   predicted at 13x (chunked(36) measured at 23x); first calls while 1.97 s,
#:   chunked(36) 2.50 s. The smaller generators predict 4.4-13x.
START_TRACE_FACTOR = 2.0
START_PEAK_FACTOR = 2.5
#: rates within this factor are measurement noise on a busy machine; the
#: lower peak wins among them
NOISE = 1.15
#: a candidate is tried only if its predicted peak is at most this many times
#: the current strategy's measured peak plus :data:`RACE_SLACK_BYTES`: the
#: allocator keeps what it took, so a losing try leaves the process bigger
RACE_PEAK_FACTOR = 2
RACE_SLACK_BYTES = 256 * 2**20


def candidates(
    segment_rows: int, fits: Callable[[Strategy], bool]
) -> tuple[list[Strategy], list[Rejection]]:
    """``auto``'s candidates for segments of ``segment_rows`` rows, cheapest to
    trace first, each as large as ``fits(strategy)`` allows; and the
    registered strategies it does not consider, with the reason."""
    found: list[Strategy] = []
    rejected: list[Rejection] = []
    ranked = sorted(strategies.REGISTRY.values(), key=lambda cls: cls.trace_weight)
    for cls in ranked:
        strategy = cls.for_auto(segment_rows)
        if strategy is None:
            rejected.append(Rejection(cls.name, _NOT_AUTO.get(cls.name, "not offered")))
            continue
        while strategy is not None and not fits(strategy):
            strategy = strategy.smaller()
        if strategy is None:
            rejected.append(Rejection(cls.name, "predicted peak over the budget"))
        else:
            found.append(strategy)
    return found, rejected


def starting_first(
    found: list[Strategy], num_rows: int, predicted_peak: Callable[[Strategy], int]
) -> list[Strategy]:
    """``found`` (cheapest to trace first) with the strategy the first call
    runs moved to the front: of those tracing within
    :data:`START_TRACE_FACTOR` of the cheapest and predicted to peak within
    :data:`START_PEAK_FACTOR` of it, the one computing the most rows at once
    (the cheapest on a tie). Peaks are compared as configured for every one
    of the ``num_rows`` rows, before a budget or segments made them smaller:
    how much memory vectorizing rows costs is a property of the problem."""
    if len(found) < 2:
        return found

    def unbudgeted_peak(strategy: Strategy) -> int:
        return predicted_peak(type(strategy).for_auto(num_rows) or strategy)

    cheapest = found[0]
    limit = START_PEAK_FACTOR * unbudgeted_peak(cheapest)
    close = [
        s
        for s in found
        if s.trace_weight <= START_TRACE_FACTOR * cheapest.trace_weight
        and unbudgeted_peak(s) <= limit
    ]
    start = max(close, key=lambda s: s.rows_at_once(num_rows), default=cheapest)
    return [start] + [s for s in found if s is not start]


_NOT_AUTO = {
    "jacobian": "the same computation as chunked(rows), without a budget",
    "loop": "eager Python loop: slowest",
    "forward": "one pass per parameter: only for targets with fewer parameters "
    "than rows (pass strategy='forward')",
}


def should_try(spent_s: float, trace_s: float | None) -> bool:
    """Whether to try a candidate predicted to trace in ``trace_s`` seconds,
    after ``spent_s`` seconds running the current strategy."""
    if trace_s is None:
        return False
    return spent_s >= RENT * trace_s


def should_run_whole(joining_s: float, trace_s: float | None) -> bool:
    """Whether to trace the current strategy for every row at once, after
    ``joining_s`` seconds spent joining its segments (what whole calls
    save), given its tracing time ``trace_s``."""
    return trace_s is not None and joining_s >= WHOLE_RENT * trace_s


def race_room(current_peak: int | None, allowed: float) -> float:
    """The largest predicted peak (earlier segments kept included) a
    candidate may have to be tried, given the current strategy's measured
    peak with the same accounting (``None``: not measured)."""
    if current_peak is None:
        return allowed
    return min(allowed, RACE_PEAK_FACTOR * current_peak + RACE_SLACK_BYTES)


def winner(a: Estimate, b: Estimate) -> Estimate:
    """The faster of two measured estimates; within :data:`NOISE`, the one
    with the lower peak (``a`` on a tie)."""
    fast, slow = (a, b) if a.seconds_per_row <= b.seconds_per_row else (b, a)
    close = slow.seconds_per_row <= NOISE * fast.seconds_per_row
    if close and a.peak is not None and b.peak is not None:
        return a if a.peak <= b.peak else b
    return fast
