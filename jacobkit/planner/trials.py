"""Finishing a candidate's trial: which of it and the current strategy is
kept, and the switch and rejection the plan records (:func:`judge`, a pure
function returning a typed :class:`Verdict`)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

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
