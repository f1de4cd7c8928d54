"""Finishing a candidate's trial: when it ends (:func:`ends_early`: on its
first untraced run, where that is far slower than the current strategy),
which of it and the current strategy is kept, and the switch and rejection
the plan records (:func:`judge`, a pure function returning a typed
:class:`Verdict`), and what it cost beyond its prediction
(:func:`overrun_s`)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

from jacobkit.planner import estimates as est
from jacobkit.planner import selection
from jacobkit.planner.policy import Policy
from jacobkit.problem.plan import Estimate, Probe, Rejection, Switch
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
    early = ""
    if est.timed_runs(probes, trying) < policy.trial_runs:
        early = (
            f"; judged on its first run, over "
            f"{policy.first_run_inflation * policy.noise:.3g}x the current rate"
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
            f"{policy.noise - 1:.0%} with a higher peak){early}",
        ),
        Rejection(trying, f"tried: {rates}{early}"),
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


def ends_early(
    policy: Policy, probes: Sequence[Probe], was: Strategy, trying: Strategy
) -> bool:
    """Whether ``trying``'s trial ends now, before its ``trial_runs``: its
    first untraced run (among ``probes``) took more than the policy's
    ``first_run_inflation`` times its ``noise`` times the current strategy's
    (``was``) best recent rate, which no first run after a trace explains
    (:func:`judge` then rejects it on that run)."""
    mine = [p for p in probes if p.strategy == trying and not p.traced]
    ours = [p for p in probes if p.strategy == was and not p.traced]
    if not mine or not ours:
        return False
    first = mine[0].seconds / mine[0].rows
    now = best_rate(probes, was, first, policy.rate_runs)
    return first > policy.first_run_inflation * policy.noise * now


def overrun_s(probes: Sequence[Probe], trying: Strategy, predicted_s: float) -> float:
    """How much longer ``trying``'s trial took (its runs among ``probes``,
    the traced one included) than the ``predicted_s`` seconds its try was
    predicted to cost (:func:`~jacobkit.planner.selection.try_cost_s`);
    0 where it took no longer."""
    took = sum(p.seconds for p in probes if p.strategy == trying)
    return max(took - predicted_s, 0.0)
