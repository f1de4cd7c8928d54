"""What ``auto`` knows of one problem in one process, and what it runs next.

A :class:`Session` holds (per model, targets, rows, input shapes, budget,
device and policy) the strategy it runs, the candidates still to try, what
it measured so far, and the switches.

- Before each run it picks the strategy (the current one, or a candidate
  being tried, :mod:`jacobkit.planner.selection`); after each it records the
  :class:`~jacobkit.planner.plan.Probe`. A settled plan runs exactly what
  the fixed strategy would.
- No candidate is tried in a process's first call: that is the call the
  user waits for.
- With the policy's ``segments`` above 1, a call that measures the current
  strategy or tries a candidate computes its rows in equal segments, each
  by one strategy, joined at the end; other calls run every row at once
  (traced for every row once joining the segments has cost as much as
  tracing).

Running a call, out-of-memory back-off included, is
:mod:`jacobkit.planner.calls`; judging a finished trial is
:mod:`jacobkit.planner.trials`.
"""

from __future__ import annotations

from dataclasses import replace

from jacobkit import memory
from jacobkit.planner import estimates as est
from jacobkit.planner import selection, trials
from jacobkit.planner.footprint import Footprint
from jacobkit.planner.plan import Estimate, Plan, Probe, Rejection, Switch
from jacobkit.planner.policy import Policy
from jacobkit.planner.scratch import MemoryPrior
from jacobkit.planner.start import start
from jacobkit.problem import Problem
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
    ) -> None:
        begun = start(
            problem, budget_bytes, allowed_bytes, prior, shortcut, structure, policy
        )
        self.policy = policy
        self.footprint: Footprint = begun.footprint
        self.num_rows = problem.num_rows
        self.segment_rows = begun.footprint.segment_rows
        self.budget_bytes = budget_bytes
        self.allowed_bytes = allowed_bytes
        self.device = device
        self.prior = prior
        self.result_bytes = begun.footprint.result_bytes
        self.structure = begun.structure
        self.probes: list[Probe] = []
        self.known: dict[Strategy, Estimate] = {}
        self.rejected: list[Rejection] = list(begun.rejected)
        #: time spent joining segments of the current strategy (what running
        #: every row at once would save); reset whenever it changes
        self.joining_s = 0.0
        self.current = begun.candidates[0]
        self.pending: list[Strategy] = list(begun.candidates[1:])
        self.trying: Strategy | None = None
        #: rows per run of the candidate being tried, and of this call
        self.trial_rows = self.segment_rows
        self.call_rows = self.segment_rows
        self.switches: list[Switch] = []
        self.spent_s = 0.0
        self.calls = 0
        self.source = "not run yet"
        self.last_call: tuple[Probe, ...] = ()
        self.warned = False
        #: something worth writing to the disk cache changed
        self.dirty = False

    @property
    def current(self) -> Strategy:
        """The strategy calls run (but for a candidate being tried)."""
        return self._current

    @current.setter
    def current(self, strategy: Strategy) -> None:
        self._current = strategy
        self.joining_s = 0.0

    # -- memory ------------------------------------------------------------
    def fits(
        self, strategy: Strategy, room: float | None = None, rows: int | None = None
    ) -> bool:
        """Whether ``strategy``'s peak on runs of ``rows`` rows (default: a
        segment; measured, else predicted) plus the kept segments fits
        ``room`` (default: what the budget allows)."""
        known = self.estimate(strategy)
        peak = known.peak if known is not None else None
        return self.footprint.fits(strategy, peak, room, rows)

    # -- knowledge ---------------------------------------------------------
    def estimate(self, strategy: Strategy) -> Estimate | None:
        """What is known of ``strategy`` (``None`` if nothing)."""
        earlier = self.known.get(strategy)
        if not any(p.strategy == strategy for p in self.probes):
            return earlier
        found = est.estimate(strategy, self.probes, earlier, self.policy.rate_runs)
        peak = self.footprint.predicted_peak(strategy)
        return replace(found, predicted_peak_bytes=peak)

    def plan(self) -> Plan:
        """The current state as a frozen :class:`Plan`."""
        ran = {p.strategy for p in self.probes} | set(self.known)
        estimates = tuple(e for s in ran if (e := self.estimate(s)) is not None)
        current = self.estimate(self.current)
        peak = current.peak if current is not None else None
        if peak is None:
            peak = self.footprint.predicted_peak(self.current)
        return Plan(
            strategy=self.current,
            budget_bytes=self.budget_bytes,
            result_bytes=self.result_bytes,
            num_rows=self.num_rows,
            segment_rows=self.segment_rows,
            predicted_time_s=current.seconds(self.num_rows) if current else None,
            predicted_peak_bytes=peak + self.footprint.kept_bytes,
            estimates=tuple(sorted(estimates, key=lambda e: e.strategy.label)),
            pending=tuple(([self.trying] if self.trying else []) + self.pending),
            rejected=tuple(self.rejected),
            switches=tuple(self.switches),
            last_call=self.last_call,
            source=self.source,
            calls=self.calls,
            structure=self.structure,
        )

    def record(self, probe: Probe) -> None:
        """Keep what a run measured (the newest runs of each strategy)."""
        if probe.traced:
            self.dirty = True
        self.probes.append(probe)
        mine = [p for p in self.probes if p.strategy == probe.strategy]
        if len(mine) > self.policy.kept_probes:  # keep the traced one, the newest
            old = next(p for p in mine if not p.traced)
            self.probes.remove(old)
        if probe.strategy == self.current and not probe.traced:
            self.spent_s += probe.seconds
            if not any(
                p.strategy == probe.strategy and not p.traced for p in self.probes[:-1]
            ):
                self.dirty = True  # its first rate

    # -- choosing ------------------------------------------------------------
    def choose(self, row: int) -> Strategy:
        """The strategy for the segment starting at ``row``."""
        if self.trying is not None:
            timed = [p for p in self.probes if p.strategy == self.trying]
            if sum(not p.traced for p in timed) < self.policy.trial_segments:
                return self.trying  # its tracing segment is not its speed
            self._finish_trial(row)
        due = self._due_candidate(self.call_rows)
        if due is None:
            return self.current
        candidate, trace_s = due
        self.pending.pop(0)
        self.trying = candidate
        self.trial_rows = self.call_rows
        self.switches.append(
            Switch(
                self.calls,
                row,
                self.current,
                candidate,
                f"trying it: {self.spent_s:.2f} s spent running "
                f"{self.current.label} >= {self.policy.rent:g} x its predicted "
                f"trace {trace_s:.2f} s",
            )
        )
        self.spent_s = 0.0
        return candidate

    def _finish_trial(self, row: int) -> None:
        """Keep the faster of the candidate tried and the current strategy."""
        trying = self.trying
        assert trying is not None, "a trial is under way"
        current, found = self.estimate(self.current), self.estimate(trying)
        assert current is not None and found is not None, "both have run"
        verdict = trials.judge(
            self.policy,
            self.probes,
            self.current,
            trying,
            (current, found),
            (self.calls, row),
        )
        self.trying = None
        self.dirty = True
        self.switches.append(verdict.switch)
        self.rejected.append(verdict.rejection)
        if verdict.won:
            self.current = trying

    def _due_candidate(self, rows: int) -> tuple[Strategy, float] | None:
        """The next candidate to try now on runs of ``rows`` rows (configured
        for them, and made smaller until it fits the room a try may take)
        and its predicted tracing time; ``None`` in a process's first call,
        before the current rate is known, or while the time spent running
        the current strategy is below the policy's ``rent`` times that
        tracing time. Candidates that cannot fit are rejected on the way."""
        current = self.estimate(self.current)
        if self.calls <= 1 or current is None or current.seconds_per_row is None:
            return None
        while self.pending:
            candidate = self.pending[0]
            peak = current.peak_bytes
            room = selection.race_room(
                self.policy,
                None if peak is None else peak + self.footprint.kept_during(rows),
                self.allowed_bytes,
            )
            smaller: Strategy | None = candidate
            if rows == self.num_rows and rows != self.segment_rows:
                # tried on whole calls: as many rows at once as whole calls
                # allow (a vectorized chunk of every row, where it fits)
                smaller = type(candidate).for_auto(rows) or candidate
            while smaller is not None and not self.fits(smaller, room, rows):
                smaller = smaller.smaller()
            if smaller is None:
                self.pending.pop(0)
                predicted = self.footprint.predicted_peak(candidate)
                slack = self.policy.race_slack_bytes
                self.rejected.append(
                    Rejection(
                        candidate,
                        f"predicted peak {_fmt(predicted)} over {_fmt(room)} "
                        f"({self.policy.safety:.0%} of "
                        f"{self.policy.race_peak_factor:g} x the current peak + "
                        f"{_fmt(slack)}, within the budget)",
                    )
                )
                self.dirty = True
                continue
            trace_s = est.predicted_trace_s(
                smaller, self.known.get(smaller), current, self.num_rows
            )
            if not selection.should_try(self.policy, self.spent_s, trace_s):
                return None
            assert trace_s is not None, "should_try refuses an unknown time"
            self.pending[0] = smaller
            return smaller, trace_s
        return None

    def next_call_rows(self) -> int:
        """Rows per run in the next call. Segments while the call measures
        the current strategy's rate or tries a candidate. Otherwise every
        row at once, which needs the strategy traced for every row: free
        where it has not been traced in this process yet (a first call from
        the disk cache traces once either way). Else the new trace is paid
        once the time segments cost beyond one run (joining them: measured
        per call) adds up to that tracing time (ski rental), or once the
        time spent running the strategy reaches the policy's ``rent`` times
        it, like a candidate's try."""
        if self.trying is not None:
            return self.trial_rows
        ran = [p for p in self.probes if p.strategy == self.current]
        whole = self.segment_rows == self.num_rows or any(
            p.rows == self.num_rows for p in ran
        )
        rows = self.num_rows if whole else self.segment_rows
        if self._due_candidate(rows) is not None:
            return rows  # a try, on runs like the current strategy's
        current = self.estimate(self.current)
        if current is None or current.seconds_per_row is None:
            return self.segment_rows
        if whole or not ran:
            return self.num_rows
        if selection.should_run_whole(self.policy, self.joining_s, current.trace_s):
            return self.num_rows
        if selection.should_try(self.policy, self.spent_s, current.trace_s):
            # whole calls as a try of their own: then later candidates are
            # tried on whole calls too, configured for every row (on the MLP
            # 512-1024-1024-144, chunked(72) on whole calls ran 5.0-5.3
            # ms/row, chunked(36) on segments 5.5-5.6)
            return self.num_rows
        return self.segment_rows


def _fmt(n: float) -> str:
    return memory.format_bytes(int(n))
