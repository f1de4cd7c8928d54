"""The memory accounting of one session: what a run is predicted to peak
at, whether a strategy fits, and what a session does when a run did not
(:class:`Overruns`)."""

from __future__ import annotations

import warnings
from dataclasses import dataclass

from jacobkit import memory, runtime
from jacobkit.planner import estimates as est
from jacobkit.planner.scratch import MemoryPrior
from jacobkit.strategies import Strategy


class BudgetWarning(UserWarning):
    """``auto`` changed what it runs because memory ran short (a run went
    over ``memory_budget``, or out of memory), or it cannot hold the budget:
    a :class:`UserWarning`, shown by default, once per plan each."""


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


class Overruns:
    """A session's runs that ran out of memory or over the budget: whether
    running less at once can help, and the warnings
    (:class:`BudgetWarning`, each once).

    Args:
        budget_bytes: the memory budget.
        gain: the policy's ``backoff_gain``.
    """

    def __init__(self, budget_bytes: int, gain: float) -> None:
        self._budget_bytes = budget_bytes
        self._gain = gain
        self._warned = False
        self._unheld = False
        #: the last back-off over the budget: (what runs since, the peak)
        self._last: tuple[Strategy, int] | None = None

    def lowers(self, strategy: Strategy, peak: int) -> bool:
        """Whether running ``strategy`` with less at once
        (:meth:`~jacobkit.strategies.Strategy.smaller`) may lower ``peak``,
        what its run measured over the budget. Not where it has nothing
        smaller, nor where it is itself a back-off over the budget whose peak
        stayed above ``gain`` times the one before: what takes the memory is
        not its rows at once (a first call's check, the forward pass, the
        result), and another back-off would only trace again."""
        if strategy.smaller() is None:
            return False
        last = self._last
        return last is None or last[0] != strategy or peak <= self._gain * last[1]

    def backed_off(
        self, strategy: Strategy, what: str, peak: int | None, after: Strategy
    ) -> None:
        """``strategy`` ``what`` (its run measured ``peak`` over the budget,
        or ran out of memory: ``None``); ``after`` runs from now on."""
        smaller = strategy.smaller()
        if peak is not None and smaller is not None:
            self._last = (smaller, peak)
        if not self._warned:
            self._warned = True
            then = "retrying" if peak is None else "later calls run"
            _warn(f"{strategy.label} {what}; {then} with less at once ({after.label}).")

    def not_held(self, strategy: Strategy, peak: int) -> None:
        """The budget is not held: ``strategy`` measured ``peak``, and running
        less at once cannot lower it (:meth:`lowers`)."""
        if self._unheld:
            return
        self._unheld = True
        last = self._last
        why = (
            f"running it with less at once left its peak at {_fmt(peak)} "
            f"(from {_fmt(last[1])})"
            if last is not None and last[0] == strategy
            else "it has nothing smaller"
        )
        _warn(
            f"memory_budget={_fmt(self._budget_bytes)} is not held: "
            f"{strategy.label} measured {_fmt(peak)}, and {why}; it keeps "
            "running without tracing again. Raise memory_budget, keep fewer "
            "rows with features=[...], or use a smaller batch."
        )


def _warn(message: str) -> None:
    warnings.warn(
        f"jacobkit: {message}",
        BudgetWarning,
        stacklevel=runtime.caller_stacklevel(),
    )


def _fmt(n: float) -> str:
    return memory.format_bytes(int(n))
