"""Finishing a candidate's trial: when it ends (:func:`over`: after the
policy's ``trial_runs`` timed runs; on its first untraced run, where that is
far slower than the current strategy, :func:`ends_early`; after up to its
``settle_runs``, where it lost within the noise and more runs may settle
it, :func:`settling`), which of it and the current strategy is kept, and
the switch and rejection the plan records (:func:`judge`, a pure function
returning a typed :class:`Verdict`), and what it cost beyond its prediction
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
    early = settled = ""
    timed = est.timed_runs(probes, trying)
    if timed > policy.trial_runs:
        settled = (
            f"; {timed} timed runs (within {policy.noise - 1:.0%} after "
            f"{policy.trial_runs}: timed again, judged on its best of the newest "
            f"{min(timed, runs)})"
        )
    if timed < policy.trial_runs:
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
            Switch(call, row, was, trying, f"{why}: {rates}{settled}"),
            Rejection(was, f"slower than {trying.label}: {rates}{settled}"),
        )
    return Verdict(
        False,
        Switch(
            call,
            row,
            trying,
            was,
            f"{trying.label} was not faster ({rates}, or within "
            f"{policy.noise - 1:.0%} with a higher peak){settled}{early}",
        ),
        Rejection(trying, f"tried: {rates}{settled}{early}"),
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


def over(
    policy: Policy,
    probes: Sequence[Probe],
    was: Strategy,
    trying: Strategy,
    estimates: tuple[Estimate, Estimate],
) -> bool:
    """Whether ``trying``'s trial against ``was`` (the current strategy;
    ``estimates`` of both, in that order) is over, given ``probes``: after
    its ``trial_runs`` timed runs, unless it is :func:`settling`; before
    them where it :func:`ends_early`."""
    timed = est.timed_runs(probes, trying)
    if timed < policy.trial_runs:
        return ends_early(policy, probes, was, trying)
    return not settling(policy, probes, was, trying, estimates)


def settling(
    policy: Policy,
    probes: Sequence[Probe],
    was: Strategy,
    trying: Strategy,
    estimates: tuple[Estimate, Estimate],
) -> bool:
    """Whether ``trying``'s trial runs again after its ``trial_runs``: it
    would lose (:func:`judge`) with its best rate within the policy's
    ``noise`` of the current strategy's, and has run fewer than its
    ``settle_runs`` timed runs. Where one is clearly faster, or clearly
    slower, the trial ends as before; the runs it adds cost at most the
    noise over the current strategy's.

    A try's first timed runs in a fresh process are slower than its steady
    ones (TensorFlow's default allocator grows, first kernels): on the MLP
    512-1024-1024-144 without oneDNN (B=256, one core, loaded), ``while(10)``'s
    trial measured 6.99 ms/row against ``batch``'s 7.91 (1.13x: within the
    noise, with a higher peak, so ``batch`` was kept) where its steady rate
    is 1.45x faster. The judge takes the best of the newest ``rate_runs``
    runs, so a settled run replaces the first one."""
    if est.timed_runs(probes, trying) >= policy.settle_runs:
        return False
    current, found = estimates
    assert current.seconds_per_row is not None and found.seconds_per_row is not None
    runs = policy.rate_runs
    now = best_rate(probes, was, current.seconds_per_row, runs)
    mine = best_rate(probes, trying, found.seconds_per_row, runs)
    if mine > policy.noise * now:
        return False  # clearly slower
    return not judge(policy, probes, was, trying, estimates, (0, 0)).won


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
