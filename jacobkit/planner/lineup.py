"""Which strategies a session runs, tries and left out (:class:`Lineup`).

The part of a :class:`~jacobkit.planner.session.Session`'s state its
decisions change: the strategy calls run, the candidate being tried, those
still to try, those left out with the reason, and the switches so far. It is
a frozen record: each change is a pure method returning the next lineup, so
what a decision does reads on its own, and the session (which decides when,
through its own methods) is still the one thing that holds it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

import tensorflow as tf

from jacobkit.planner import trials
from jacobkit.planner.estimates import Measurements
from jacobkit.planner.policy import Policy
from jacobkit.problem.plan import Rejection, Switch
from jacobkit.strategies import Strategy


@dataclass(frozen=True)
class Lineup:
    """A session's strategies at one point of its calls.

    Attributes:
        current: the strategy calls run (but for a candidate being tried).
        pending: the candidates still to try, next first.
        trying: the candidate being tried (``None``: none).
        rejected: the strategies left out, with the reason.
        switches: the changes of strategy so far, and the trials' outcomes.
    """

    current: Strategy
    pending: tuple[Strategy, ...] = ()
    trying: Strategy | None = None
    rejected: tuple[Rejection, ...] = ()
    switches: tuple[Switch, ...] = ()

    # -- trying a candidate ----------------------------------------------------
    def without(self, dropped: Sequence[Rejection]) -> Lineup:
        """The first ``len(dropped)`` pending candidates left out, each for
        its rejection (:attr:`~jacobkit.planner.selection.NextTry.dropped`)."""
        return replace(
            self,
            pending=self.pending[len(dropped) :],
            rejected=(*self.rejected, *dropped),
        )

    def trial(self, candidate: Strategy, call: int, reason: str) -> Lineup:
        """The next pending candidate tried from ``call`` on, as
        ``candidate`` (it, or a smaller one that fits), for ``reason``."""
        switch = Switch(call, 0, self.current, candidate, reason)
        return replace(
            self,
            pending=self.pending[1:],
            trying=candidate,
            switches=(*self.switches, switch),
        )

    def judged(self, policy: Policy, measured: Measurements, call: int) -> Lineup:
        """The trial over at ``call``, its candidate and the current strategy
        judged by what was ``measured`` (:func:`~jacobkit.planner.trials.judge`):
        the candidate runs from now on where it won."""
        trying = self.trying
        assert trying is not None, "a trial is under way"
        current, found = measured.estimate(self.current), measured.estimate(trying)
        assert current is not None and found is not None, "both have run"
        verdict = trials.judge(
            policy,
            measured.probes,
            self.current,
            trying,
            (current, found),
            (call, 0),
        )
        return replace(
            self,
            current=trying if verdict.won else self.current,
            trying=None,
            switches=(*self.switches, verdict.switch),
            rejected=(*self.rejected, verdict.rejection),
        )

    def trial_dropped(self, why: str) -> Lineup:
        """The candidate being tried refused, failed or cannot fit: left out
        for ``why``; the current strategy computes the rows."""
        assert self.trying is not None, "a trial is under way"
        return replace(self, trying=None).rejecting(self.trying, why)

    # -- a strategy that failed ------------------------------------------------
    def failed(self, strategy: Strategy, why: str, ran: bool) -> Lineup | None:
        """A run of ``strategy`` failed for ``why`` (not for memory; ``ran``:
        it has computed rows before): without it where it is the candidate
        tried, or the start, which has computed nothing yet, and another
        candidate is pending; ``None``: it stays (the error is the caller's)."""
        if strategy == self.trying:
            # a candidate that refuses (its check) or fails on this problem is
            # dropped; the current strategy computes the rows
            return self.trial_dropped(why)
        if self.pending and not ran:
            return self.next_start(strategy, why)
        return None

    def next_start(self, strategy: Strategy, why: str) -> Lineup:
        """The starting ``strategy``, which has computed nothing yet, refused
        or failed (``why``): the next pending candidate starts instead."""
        return replace(
            self, current=self.pending[0], pending=self.pending[1:]
        ).rejecting(strategy, why)

    def backed_off(
        self, strategy: Strategy, smaller: Strategy | None, call: int, what: str
    ) -> Lineup:
        """``strategy`` ``what`` (out of memory, over the budget) at ``call``:
        ``smaller`` (its :meth:`~jacobkit.strategies.Strategy.smaller`, or
        ``None``: none that may help) runs in its place from now on, the
        candidate tried or the current strategy; a candidate with nothing
        smaller is dropped.

        Raises:
            tf.errors.ResourceExhaustedError: the current strategy has
                nothing smaller (it already runs one row at a time).
        """
        if strategy == self.trying:
            if smaller is None:
                return self.trial_dropped(f"{what} at its smallest")
            return replace(self, trying=smaller)
        if smaller is None:
            raise tf.errors.ResourceExhaustedError(
                None,
                None,
                f"jacobkit: {strategy.label} {what} computing one row at a time",
            )
        return replace(
            self,
            current=smaller,
            switches=(*self.switches, Switch(call, 0, strategy, smaller, what)),
            rejected=(*self.rejected, Rejection(strategy, what, memory=True)),
        )

    def rejecting(self, strategy: Strategy, why: str) -> Lineup:
        """``strategy`` left out for ``why`` (an error's first line, cut)."""
        rejection = Rejection(strategy, why.splitlines()[0][:160])
        return replace(self, rejected=(*self.rejected, rejection))
