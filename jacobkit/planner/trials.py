"""Trying candidates: which one to try next, and when (:func:`next_try`),
and at the end of a try which of it and the current strategy is kept, with
the switch and rejection the plan records (:func:`judge`). Pure functions of
what the session knows, returning typed verdicts."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

from jacobkit.planner import estimates as est
from jacobkit.planner import selection
from jacobkit.planner.plan import Estimate, Probe, Rejection, Switch
from jacobkit.planner.policy import Policy
from jacobkit.strategies import Strategy


@dataclass(frozen=True)
class Verdict:
    """How a trial ended.

    Attributes:
        won: the candidate is faster (or as fast with a lower peak): later
            calls run it.
        switch: what the plan records of the change (or of staying).
        rejection: the loser, with the rates.
    """

    won: bool
    switch: Switch
    rejection: Rejection


def judge(
    policy: Policy,
    probes: Sequence[Probe],
    was: Strategy,
    trying: Strategy,
    estimates: tuple[Estimate, Estimate],
    at: tuple[int, int],
) -> Verdict:
    """The end of ``trying``'s trial against ``was`` (the current strategy),
    given their ``estimates`` (in that order) and what ``probes`` measured,
    at ``(call, row)``."""
    current, found = estimates
    call, row = at
    # both ran: their rates are known
    assert current.seconds_per_row is not None and found.seconds_per_row is not None
    # the first run after a trace is slow while the allocator grows for
    # the new function (measured: 1.5-1.8x the later rate, every
    # strategy, MLP 512-1024-1024-144 on 2 CPU cores): both are judged
    # by their best run, the candidate over its trial, the current
    # strategy over its recent runs
    runs = policy.rate_runs
    current = replace(
        current,
        seconds_per_row=best_rate(probes, was, current.seconds_per_row, runs),
    )
    found = replace(
        found,
        seconds_per_row=best_rate(probes, trying, found.seconds_per_row, runs),
    )
    assert current.seconds_per_row is not None and found.seconds_per_row is not None
    rates = (
        f"{found.seconds_per_row * 1e3:.3g} ms/row vs "
        f"{current.seconds_per_row * 1e3:.3g} ms/row"
    )
    if selection.winner(policy, current, found) is found:
        why = (
            "faster"
            if found.seconds_per_row < current.seconds_per_row
            else f"within {policy.noise - 1:.0%} and a lower peak"
        )
        return Verdict(
            True,
            Switch(call, row, was, trying, f"{why}: {rates}"),
            Rejection(was, f"slower than {trying.label}: {rates}"),
        )
    return Verdict(
        False,
        Switch(
            call,
            row,
            trying,
            was,
            f"{trying.label} was not faster ({rates}, or within "
            f"{policy.noise - 1:.0%} with a higher peak)",
        ),
        Rejection(trying, f"tried: {rates}"),
    )


def best_rate(
    probes: Sequence[Probe], strategy: Strategy, otherwise: float, runs: int
) -> float:
    """Least seconds per row of ``strategy``'s ``runs`` newest untraced runs
    among ``probes`` (``otherwise`` if none)."""
    rates = [
        p.seconds / p.rows for p in probes if p.strategy == strategy and not p.traced
    ]
    return min(rates[-runs:], default=otherwise)


@dataclass(frozen=True)
class NextTry:
    """Which candidate a call tries.

    Attributes:
        candidate: the candidate to try now, made small enough for the room a
            try may take (``None``: none is due yet).
        reason: why now, in words (the plan's switch), where ``candidate``.
        too_big: candidates at the head of the queue dropped on the way, each
            predicted over that room even at its smallest.
    """

    candidate: Strategy | None
    reason: str
    too_big: tuple[Rejection, ...]


def next_try(
    policy: Policy,
    pending: Sequence[Strategy],
    current: Estimate,
    spent_s: float,
    earlier: Callable[[Strategy], Estimate | None],
    predicted_peak: Callable[[Strategy], int],
    fits: Callable[[Strategy, float], bool],
    limits: tuple[float, int],
) -> NextTry:
    """The next of the ``pending`` candidates to try, given the ``current``
    strategy's estimate (its rate known) and the ``spent_s`` seconds spent
    running it since the last try: the first that fits the room a try may
    take (:func:`~jacobkit.planner.selection.race_room`, within ``limits``:
    the bytes the budget allows and the rows), made smaller until it fits,
    once ``spent_s`` reaches the policy's ``rent`` times its predicted
    tracing time (:func:`~jacobkit.planner.estimates.predicted_trace_s`,
    from what ``earlier`` processes measured)."""
    allowed, num_rows = limits
    room = selection.race_room(policy, current.peak_bytes, allowed)
    too_big: list[Rejection] = []
    for candidate in pending:
        smaller: Strategy | None = candidate
        while smaller is not None and not fits(smaller, room):
            smaller = smaller.smaller()
        if smaller is None:
            too_big.append(
                selection.too_big_to_try(
                    policy, candidate, predicted_peak(candidate), room
                )
            )
            continue
        trace_s = est.predicted_trace_s(smaller, earlier(smaller), current, num_rows)
        if not selection.should_try(policy, spent_s, trace_s):
            return NextTry(None, "", tuple(too_big))
        assert trace_s is not None, "should_try refuses an unknown time"
        reason = (
            f"trying it: {spent_s:.2f} s spent running {current.strategy.label} "
            f">= {policy.rent:g} x its predicted trace {trace_s:.2f} s"
        )
        return NextTry(smaller, reason, tuple(too_big))
    return NextTry(None, "", tuple(too_big))
