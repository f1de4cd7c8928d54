"""Which strategies ``auto`` considers, which it starts on, when it tries
another, and which wins.

- Candidates: every registered strategy's
  :meth:`~jacobkit.strategies.Strategy.for_auto` configuration, made smaller
  (:meth:`~jacobkit.strategies.Strategy.smaller`) until its predicted peak
  fits, ordered by :attr:`~jacobkit.strategies.Strategy.trace_weight`: the
  first call starts on the one cheapest to trace (``while``), because
  explainability code often calls ``jacobian`` once or a few times.
- Starting: the cheapest to trace, unless a candidate that computes more
  rows at once traces within the policy's ``start_trace_factor`` of it and
  is predicted to peak within its ``start_peak_factor`` of it (plus its
  ``start_slack_bytes``): then that one (:func:`starting_first`).
- Trying another (a ski-rental rule): a candidate is tried on real calls
  once the time spent running the current strategy
  (tracing not counted) reaches the policy's ``rent`` times the try's
  predicted cost (:func:`try_cost_s`: the candidate's predicted tracing
  time and its trial's runs, each at no less than the current call), and
  never in a process's first call. A trial whose first untraced run is
  far slower than the current strategy ends on it
  (:func:`~jacobkit.planner.trials.ends_early`), and what a try cost
  beyond its prediction is earned back (``rent`` times over) before the
  next one (:func:`~jacobkit.planner.trials.overrun_s`). Whatever it
  could save, trying then costs at most about ``1 / rent`` more than never
  trying, and nothing when the calls stop early.
- Which try is next (:func:`next_try`): the first pending candidate that
  fits the room a try may take, made smaller until it does.
- Winning: the least time per row; where rates are within the policy's
  ``noise``, the lower peak.

The tunables are :class:`~jacobkit.planner.policy.Policy`'s fields.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from jacobkit import memory, strategies
from jacobkit.planner import estimates as est
from jacobkit.planner.policy import Policy
from jacobkit.problem.plan import Estimate, Rejection
from jacobkit.strategies import Strategy


def candidates(
    num_rows: int,
    fits: Callable[[Strategy], bool],
    cannot_run: Callable[[Strategy], str | None] = lambda strategy: None,
) -> tuple[list[Strategy], list[Rejection]]:
    """``auto``'s candidates for calls of ``num_rows`` rows, cheapest to
    trace first, each as large as ``fits(strategy)`` allows; and the
    registered strategies it does not consider, with the reason (among them
    those that ``cannot_run`` names a reason for)."""
    found: list[Strategy] = []
    rejected: list[Rejection] = []
    ranked = sorted(strategies.REGISTRY.values(), key=lambda cls: cls.trace_weight)
    for cls in ranked:
        strategy = cls.for_auto(num_rows)
        if strategy is None:
            rejected.append(Rejection(cls.name, _NOT_AUTO.get(cls.name, "not offered")))
            continue
        reason = cannot_run(strategy)
        if reason is not None:
            rejected.append(Rejection(cls.name, reason))
            continue
        while strategy is not None and not fits(strategy):
            strategy = strategy.smaller()
        if strategy is None:
            rejected.append(
                Rejection(cls.name, "predicted peak over the budget", memory=True)
            )
        else:
            found.append(strategy)
    return found, rejected


def starting_first(
    found: list[Strategy],
    num_rows: int,
    predicted_peak: Callable[[Strategy], int],
    policy: Policy,
) -> list[Strategy]:
    """``found`` (cheapest to trace first) with the strategy the first call
    runs moved to the front: of those tracing within the policy's
    ``start_trace_factor`` of the cheapest and predicted to peak within its
    ``start_peak_factor`` of it plus its ``start_slack_bytes``, the one
    computing the most rows at once
    (the cheapest on a tie). Peaks are compared as configured for every one
    of the ``num_rows`` rows, before a budget made them smaller:
    how much memory vectorizing rows costs is a property of the problem."""
    if len(found) < 2:
        return found

    def unbudgeted_peak(strategy: Strategy) -> int:
        return predicted_peak(type(strategy).for_auto(num_rows) or strategy)

    cheapest = found[0]
    limit = policy.start_peak_factor * unbudgeted_peak(cheapest)
    limit += policy.start_slack_bytes
    close = [
        s
        for s in found
        if s.trace_weight <= policy.start_trace_factor * cheapest.trace_weight
        and unbudgeted_peak(s) <= limit
    ]
    start = max(close, key=lambda s: s.rows_at_once(num_rows), default=cheapest)
    return [start] + [s for s in found if s is not start]


_NOT_AUTO = {
    "jacobian": "the same computation as chunked(rows), without a budget",
    "loop": "eager Python loop: slowest",
    "grouped": "proposed where closed forms serve some of the targets and not "
    "all (batch on those, a generic strategy on the others)",
    "forward": "one pass per parameter: only for targets with fewer parameters "
    "than rows (pass strategy='forward')",
}


def try_cost_s(policy: Policy, trace_s: float, call_s: float) -> float:
    """The predicted cost of trying a candidate predicted to trace in
    ``trace_s`` seconds while the current strategy's call takes ``call_s``:
    the trace, and the trial's runs (the traced one and the policy's
    ``trial_runs``) each at the current call's time at least.

    Counting the trace alone, a try cost 5-20x its prediction: on the conv
    net of ``benchmarks/reductions_models.py`` (32 per-example loss rows,
    1 core) ``batch``'s call is 11 ms and ``while(parallel=10)``'s trial
    took 317, 170 and 174 ms against a predicted 0.03 s."""
    return trace_s + (1 + policy.trial_runs) * call_s


def should_try(policy: Policy, spent_s: float, cost_s: float | None) -> bool:
    """Whether to try a candidate whose try is predicted to cost ``cost_s``
    seconds (:func:`try_cost_s`), after ``spent_s`` seconds running the
    current strategy."""
    if cost_s is None:
        return False
    return spent_s >= policy.rent * cost_s


def race_room(
    policy: Policy, current_peak: int | None, allowed: float, margin: float
) -> float:
    """The largest predicted peak a candidate may have to be tried, given the
    current strategy's measured peak (``None``: not measured): ``margin``
    (:func:`race_margin`) of the policy's ``race_peak_factor`` times it plus
    its ``race_slack_bytes``, within what the budget ``allowed``."""
    if current_peak is None:
        return allowed
    return min(
        allowed,
        margin * (policy.race_peak_factor * current_peak + policy.race_slack_bytes),
    )


def race_margin(policy: Policy, candidate: Strategy) -> float:
    """The share of :func:`race_room` a ``candidate``'s predicted peak may
    take: all of it where rows run one after another
    (:meth:`~jacobkit.strategies.Strategy.sequential_rows`: ``loop``,
    ``while``), whose prior walks the traced pass's tensors and was never
    measured below (1.02-1.04x on the MLP 512-1024-1024-144, 1.1-2.2x on ten
    problems: ``tests/test_planner.py``); the policy's ``safety`` elsewhere,
    as below a budget: on that MLP, ``chunked(72)`` was predicted at 1035
    MiB against a bound of 1064 MiB, measured 1101 MiB, and the try set the
    process's high-water mark above the bound.

    Measured (that MLP, oneDNN off, TF's pooled allocator): ``batch`` peaks
    at 389 MiB, so the room is 645 MiB; ``while`` at 577-584 MiB whatever
    its rows in flight (1, 2, 4 or 10: the result stacked twice, 577 MiB,
    is nearly all of it), predicted at 590-602 MiB. With the margin on
    every candidate (548 MiB) it was never tried, though 1.2-1.3x faster
    than ``batch`` there."""
    return 1.0 if candidate.sequential_rows() else policy.safety


def too_big_to_try(
    policy: Policy,
    candidate: Strategy,
    predicted: tuple[int, int],
    room: float,
    allowed: float,
) -> Rejection:
    """Why ``candidate`` (``predicted`` to peak at these bytes as configured
    and at its smallest) is not tried: over the ``room`` a try may take
    (:func:`race_room`), a rejection for memory where that room is all the
    budget ``allowed`` (a larger budget may fit it; not where the current
    peak sets it)."""
    margin = race_margin(policy, candidate)
    largest, smallest = predicted
    even = f" (at its smallest {_fmt(smallest)})" if smallest != largest else ""
    return Rejection(
        candidate,
        f"predicted peak {_fmt(largest)}{even} over {_fmt(room)} "
        f"({margin:.0%} of {policy.race_peak_factor:g} x the current "
        f"peak + {_fmt(policy.race_slack_bytes)}, within the budget)",
        memory=room >= allowed,
    )


def _fmt(n: float) -> str:
    return memory.format_bytes(int(n))


def winner(policy: Policy, a: Estimate, b: Estimate) -> Estimate:
    """The faster of two measured estimates; within the policy's ``noise``,
    the one with the lower peak (``a`` on a tie)."""
    assert a.seconds_per_row is not None and b.seconds_per_row is not None
    fast, slow = (a, b) if a.seconds_per_row <= b.seconds_per_row else (b, a)
    assert fast.seconds_per_row is not None and slow.seconds_per_row is not None
    close = slow.seconds_per_row <= policy.noise * fast.seconds_per_row
    if close and a.peak is not None and b.peak is not None:
        return a if a.peak <= b.peak else b
    return fast


@dataclass(frozen=True)
class NextTry:
    """Which candidate a call tries.

    Attributes:
        candidate: the candidate to try now, made small enough for the room a
            try may take (``None``: none is due yet).
        reason: why now, in words (the plan's switch), where ``candidate``.
        cost_s: the try's predicted cost (:func:`try_cost_s`; ``None``:
            tried for another reason, after the eager start).
        dropped: candidates at the head of the queue dropped on the way,
            each predicted over that room even at its smallest, or measured
            slower than the current strategy by an earlier process (the
            plan cache: a plan made again for a larger budget knows them).
    """

    candidate: Strategy | None
    reason: str
    dropped: tuple[Rejection, ...]
    cost_s: float | None = None


def next_try(
    policy: Policy,
    pending: Sequence[Strategy],
    current: Estimate,
    spent_s: float,
    earlier: Callable[[Strategy], Estimate | None],
    predicted_peak: Callable[[Strategy], int],
    fits: Callable[[Strategy, float], bool],
    limits: tuple[float, int],
    *,
    left_eager: bool = False,
    measured: Callable[[], Sequence[Estimate]] = tuple,
) -> NextTry:
    """The next of the ``pending`` candidates to try, given the ``current``
    strategy's estimate (its rate known) and the ``spent_s`` seconds spent
    running it since the last try: the first that fits the room a try may
    take (:func:`~jacobkit.planner.race_room`, within ``limits``:
    the bytes the budget allows and the rows), made smaller until it fits,
    once ``spent_s`` reaches the policy's ``rent`` times its try's
    predicted cost (:func:`try_cost_s`, its tracing time by
    :func:`~jacobkit.planner.estimates.predicted_trace_s`, from what
    ``earlier`` processes measured, scaled from the current strategy's
    and the others ``measured`` here); at once where the current
    strategy is the eager start and it has answered the calls it answers
    (``left_eager``: the policy's ``eager_calls``)."""
    allowed, num_rows = limits

    def room(strategy: Strategy) -> float:
        margin = race_margin(policy, strategy)
        return race_room(policy, current.peak_bytes, allowed, margin)

    dropped: list[Rejection] = []
    for candidate in pending:
        smaller: Strategy | None = candidate
        smallest = candidate
        while smaller is not None and not fits(smaller, room(smaller)):
            smallest, smaller = smaller, smaller.smaller()
        if smaller is None:
            predicted = (predicted_peak(candidate), predicted_peak(smallest))
            dropped.append(
                too_big_to_try(policy, candidate, predicted, room(candidate), allowed)
            )
            continue
        slower = known_slower(policy, earlier(smaller), current)
        if slower is not None:
            dropped.append(slower)
            continue
        if left_eager and not current.strategy.compiled:
            reason = (
                f"trying it: the eager {current.strategy.label} answers the "
                f"first {policy.eager_calls} call(s) only"
            )
            return NextTry(smaller, reason, tuple(dropped))
        trace_s = est.predicted_trace_s(
            smaller, earlier(smaller), current, num_rows, measured()
        )
        call_s = current.seconds(num_rows)
        assert call_s is not None, "the current rate is known"
        cost_s = None if trace_s is None else try_cost_s(policy, trace_s, call_s)
        if not should_try(policy, spent_s, cost_s):
            return NextTry(None, "", tuple(dropped))
        assert trace_s is not None and cost_s is not None, "should_try refuses"
        reason = (
            f"trying it: {spent_s:.2f} s spent running {current.strategy.label} "
            f">= {policy.rent:g} x its try's predicted {cost_s:.2f} s (trace "
            f"{trace_s:.2f} s + {1 + policy.trial_runs} runs at "
            f"{call_s * 1e3:.3g} ms)"
        )
        return NextTry(smaller, reason, tuple(dropped), cost_s)
    return NextTry(None, "", tuple(dropped))


def known_slower(
    policy: Policy, known: Estimate | None, current: Estimate
) -> Rejection | None:
    """Why a candidate whose rate an earlier process measured (``known``)
    is not tried: slower than the ``current`` strategy's, beyond the
    policy's ``noise`` (``None``: it may be faster, or is not known)."""
    if known is None or known.seconds_per_row is None:
        return None
    rate, now = known.seconds_per_row, current.seconds_per_row
    if now is None or rate <= policy.noise * now:
        return None
    return Rejection(
        known.strategy,
        f"measured slower by an earlier run: {rate * 1e3:.3g} ms/row vs "
        f"{now * 1e3:.3g} ms/row",
    )
