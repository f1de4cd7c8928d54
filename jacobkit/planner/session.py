"""What ``auto`` knows of one problem in one process, and what it runs next.

A :class:`Session` holds (per model, targets, rows, input shapes, budget,
device and policy) its lineup (:class:`~jacobkit.planner.lineup.Lineup`:
the strategy it runs, the candidate tried, those still to try, those left
out, the switches), what it measured so far, and its calls' progress. It
changes only through its own methods, in the order a call takes them
(:mod:`jacobkit.planner.calls`):

- :meth:`begin_call`, then :meth:`choose` the strategy of the run (the
  current one, or a candidate being tried, :mod:`jacobkit.planner.selection`);
- :meth:`record` what the run measured (a :class:`~jacobkit.problem.plan.Probe`),
  or, where it failed, :meth:`back_off` (out of memory, over the budget) or
  :meth:`drop` (a candidate, or a start, that refused);
- :meth:`end_call`, then :meth:`persist` what was learned to the disk cache.

A settled plan runs exactly what the fixed strategy would. No candidate is
tried in a process's first call: that is the call the user waits for. Every
call runs one strategy on every row at once.

What a decision changes is the lineup's: each change (a try begun, a trial
judged by :mod:`jacobkit.planner.trials`, a back-off, a refusal) is one of
its pure methods, and the session holds the result. Choosing stays here: it
runs on every call, and a steady call enters as few modules as it can
(``tests/test_architecture.py``). What the disk cache keeps and how a
session continues from it is :mod:`jacobkit.planner.keeping`
(:meth:`cache_entry`, :meth:`restore`), the files
:mod:`jacobkit.planner.cache`.
"""

from __future__ import annotations

from jacobkit.planner import cache as disk
from jacobkit.planner import estimates as est
from jacobkit.planner import keeping, selection, trials
from jacobkit.planner.entry import CacheEntry
from jacobkit.planner.footprint import Footprint, Overruns
from jacobkit.planner.lineup import Lineup
from jacobkit.planner.policy import Policy
from jacobkit.planner.scratch import MemoryPrior
from jacobkit.planner.start import start
from jacobkit.problem import Problem
from jacobkit.problem.plan import Estimate, Plan, Probe
from jacobkit.strategies import Strategy


class Session:
    """What ``auto`` knows of one problem in this process, and runs next.

    Args:
        problem: the resolved problem.
        budget_bytes: the memory budget.
        allowed_bytes: what the plan may use (the budget times the safety
            margin).
        device: where peak memory is measured, or ``None`` if it cannot be.
        prior: what peaks are predicted from before they are measured (the
            forward pass's activations per row, the kernels' scratch space).
        shortcut: an exact structural shortcut (the ``structured`` strategy)
            that applies to ``problem``, or ``None``; where it fits the
            budget it is the only candidate and computes every row at once.
        structure: what the shortcut found, or why none applies (the plan
            shows it).
        policy: the tunables it plans by.
        cache_name: its entry in the disk cache (``None``: not cached).
    """

    def __init__(
        self,
        problem: Problem,
        budget_bytes: int,
        allowed_bytes: float,
        device: str | None,
        prior: MemoryPrior,
        shortcut: Strategy | None = None,
        structure: str = "",
        policy: Policy = Policy(),  # noqa: B008 - frozen
        cache_name: str | None = None,
    ) -> None:
        begun = start(
            problem, budget_bytes, allowed_bytes, prior, shortcut, structure, policy
        )
        self._policy = policy
        self._footprint: Footprint = begun.footprint
        self._num_rows = problem.num_rows
        self._budget_bytes = budget_bytes
        self._device = device
        self._structure = begun.structure
        self._cache_name = cache_name
        self._measured = est.Measurements(policy, begun.footprint.predicted_peak)
        first, *others = begun.candidates
        self._lineup = Lineup(first, tuple(others), rejected=begun.rejected)
        self._spent_s = 0.0
        #: the predicted cost of the try under way (``None``: none predicted)
        self._try_cost_s: float | None = None
        self._calls = 0
        self._source = "not run yet"
        self._last_call: tuple[Probe, ...] = ()
        self._overruns = Overruns(budget_bytes, policy.backoff_gain)
        #: something worth writing to the disk cache changed
        self._dirty = False

    # -- what others read ----------------------------------------------------
    @property
    def current(self) -> Strategy:
        """The strategy calls run (but for a candidate being tried)."""
        return self._lineup.current

    @property
    def device(self) -> str | None:
        """Where peaks are measured (``None``: not measured)."""
        return self._device

    @property
    def structure(self) -> str | None:
        """What the exact shortcut found, where it is the one candidate."""
        return self._structure

    # -- memory --------------------------------------------------------------
    def fits(self, strategy: Strategy, room: float | None = None) -> bool:
        """Whether ``strategy``'s peak (measured, else predicted) fits ``room``
        (default: what the budget allows)."""
        known = self.estimate(strategy)
        peak = known.peak if known is not None else None
        return self._footprint.fits(strategy, peak, room)

    # -- knowledge -------------------------------------------------------------
    def estimate(self, strategy: Strategy) -> Estimate | None:
        """What is known of ``strategy`` (``None`` if nothing)."""
        return self._measured.estimate(strategy)

    def plan(self) -> Plan[Strategy]:
        """The current state as a frozen :class:`Plan`."""
        lineup = self._lineup
        current = self.estimate(lineup.current)
        peak = current.peak if current is not None else None
        if peak is None:
            peak = self._footprint.predicted_peak(lineup.current)
        return Plan(
            strategy=lineup.current,
            budget_bytes=self._budget_bytes,
            result_bytes=self._footprint.result_bytes,
            num_rows=self._num_rows,
            predicted_time_s=current.seconds(self._num_rows) if current else None,
            predicted_peak_bytes=peak,
            estimates=self._measured.estimates(),
            pending=(*([lineup.trying] if lineup.trying else []), *lineup.pending),
            rejected=lineup.rejected,
            switches=lineup.switches,
            last_call=self._last_call,
            source=self._source,
            calls=self._calls,
            structure=self._structure,
        )

    # -- one call ------------------------------------------------------------
    def begin_call(self) -> int:
        """A call starts: its number (1 for the first of this process)."""
        self._calls += 1
        return self._calls

    def choose(self) -> Strategy:
        """The strategy of the call's run: a candidate while it is tried,
        else the current one (a candidate starts its try where it is due,
        :func:`~jacobkit.planner.selection.next_try`)."""
        trying = self._lineup.trying
        if trying is not None:
            if not self._trial_over(trying):
                return trying  # its tracing run is not its speed
            self._lineup = self._lineup.judged(
                self._policy, self._measured, self._calls
            )
            if self._try_cost_s is not None:
                # what the try cost beyond its prediction is earned back
                # (rent times over) before the next one
                probes = self._measured.probes
                over = trials.overrun_s(probes, trying, self._try_cost_s)
                self._spent_s = -self._policy.rent * over if over else 0.0
            self._dirty = True
        current = self.estimate(self._lineup.current)
        if self._calls <= 1 or current is None or current.seconds_per_row is None:
            return self._lineup.current  # never in the first call; no rate yet
        due = selection.next_try(
            self._policy,
            self._lineup.pending,
            current,
            self._spent_s,
            self._measured.earlier,
            self._footprint.predicted_peak,
            self.fits,
            (self._footprint.allowed_bytes, self._num_rows),
            left_eager=self._calls > self._policy.eager_calls,
            measured=self._measured.estimates,
        )
        if due.dropped:
            self._lineup = self._lineup.without(due.dropped)
            self._dirty = True
        if due.candidate is None:
            return self._lineup.current
        self._lineup = self._lineup.trial(due.candidate, self._calls, due.reason)
        self._spent_s = 0.0
        self._try_cost_s = due.cost_s
        return due.candidate

    def _trial_over(self, trying: Strategy) -> bool:
        """Whether ``trying``'s trial is over (:func:`~jacobkit.planner.
        trials.over`: its runs done, settled, or ended early)."""
        was = self._lineup.current
        current, found = self.estimate(was), self.estimate(trying)
        if current is None or found is None or found.seconds_per_row is None:
            return False  # it has not run untraced yet
        assert current.seconds_per_row is not None, "a try starts from a rate"
        probes = self._measured.probes
        return trials.over(self._policy, probes, was, trying, (current, found))

    def record(self, probe: Probe) -> None:
        """Keep what a run measured (the newest runs of each strategy)."""
        first_rate = not probe.traced and not self._measured.timed_runs(probe.strategy)
        self._measured.add(probe)
        self._dirty = self._dirty or probe.traced or first_rate
        if probe.strategy == self._lineup.current and not probe.traced:
            self._spent_s += probe.seconds

    def end_call(self, runs: tuple[Probe, ...]) -> None:
        """The call is done: ``runs`` are what it ran (the last computed it)."""
        self._last_call = runs
        if self._source == "not run yet":
            self._source = "measured"

    def over_budget(self, probe: Probe) -> bool:
        """Whether a run measured above what the budget allows."""
        return (
            probe.peak_bytes is not None
            and probe.peak_bytes > self._footprint.allowed_bytes
        )

    def back_off(self, strategy: Strategy, what: str, peak: int | None = None) -> None:
        """``strategy`` needs less at once (``what`` happened; ``peak``: what
        a run that computed its rows measured, over the budget): its
        :meth:`~jacobkit.strategies.Strategy.smaller` from now on, or, for a
        candidate at its smallest, the current strategy. Warned once
        (:class:`~jacobkit.planner.BudgetWarning`). Where a run over the
        budget has nothing smaller, or the last back-off did not lower its
        peak (what takes the memory is not its rows at once), nothing changes
        and nothing is traced again: the budget is not held, warned once.

        Raises:
            tf.errors.ResourceExhaustedError: the current strategy already
                runs one row at a time.
        """
        lineup = self._lineup
        smaller = strategy.smaller()
        if peak is not None and not self._overruns.lowers(strategy, peak):
            if strategy != lineup.trying:
                self._overruns.not_held(strategy, peak)
                return
            smaller = None  # a candidate that cannot fit is dropped
        self._overruns.backed_off(strategy, what, peak, smaller or lineup.current)
        self._dirty = True
        self._lineup = lineup.backed_off(strategy, smaller, self._calls, what)

    def drop(self, strategy: Strategy, err: Exception) -> bool:
        """A run of ``strategy`` raised ``err`` (not out of memory): whether it
        was dropped (a candidate being tried, or the starting strategy that
        has computed nothing yet: the next candidate starts instead); else the
        error is the caller's to raise."""
        why = f"{type(err).__name__}: {err}"
        ran = self._measured.ran(strategy)
        dropped = self._lineup.failed(strategy, why, ran)
        if dropped is None:
            return False
        self._lineup, self._dirty = dropped, True
        return True

    # -- the disk cache --------------------------------------------------------
    def cache_entry(self) -> CacheEntry:
        """What the disk cache keeps of this session."""
        return keeping.entry(self.plan(), self._spent_s, self._footprint)

    def restore(self, entry: CacheEntry) -> bool:
        """Continue from ``entry`` where it applies (its strategy fits,
        :meth:`~jacobkit.planner.entry.CacheEntry.resume`); else (``False``)
        start as planned afresh, and rewrite it after the first call, knowing
        what it measured where only a larger budget made it not apply."""
        self._dirty = True
        if entry.segment_rows != self._num_rows:
            return False
        self._measured.know(entry.estimates)
        if not self.fits(entry.current):  # measured over today's budget
            self._measured.know(())
            return False
        resumed = keeping.resumed(self._lineup, entry, self._footprint, self.fits)
        if resumed is None:
            return False
        self._lineup, self._dirty = resumed
        self._spent_s = entry.spent_s
        self._source = "disk cache"
        return True

    def persist(self) -> None:
        """Write what was learned to the disk cache (where it is on and
        something changed)."""
        if self._cache_name is not None and self._dirty:
            disk.save(self._cache_name, self.cache_entry())
            self._dirty = False
