"""Running ``auto``: every call runs one strategy on every row at once (by
default), and every run is both part of the answer and a measurement.

A :class:`Session` holds what one process knows of one problem (per model,
targets, rows, input shapes, budget and device): the strategy it runs, the
candidates still to try, what it measured so far, and the switches.

- Before each run it picks the strategy (the current one, or a candidate
  being tried, :mod:`jacobkit.planner.selection`); after each it records the
  :class:`~jacobkit.planner.plan.Probe`. A settled plan runs exactly what
  the fixed strategy would.
- No candidate is tried in a process's first call: that is the call the
  user waits for.
- With :data:`SEGMENTS` above 1, a call that measures the current strategy
  or tries a candidate computes its rows in equal segments, each by one
  strategy, joined at the end; other calls run every row at once (traced
  for every row once joining the segments has cost as much as tracing).

An out-of-memory error (or a run over the budget) makes the strategy
:meth:`~jacobkit.strategies.Strategy.smaller` for the rest of the call and
every later one; the rows of the failed run are computed again by the
smaller one (nothing of them was returned).
"""

from __future__ import annotations

import time
import warnings
from dataclasses import replace

import tensorflow as tf

from jacobkit import memory, strategies
from jacobkit.planner import cache, probes, selection, shortcuts
from jacobkit.planner import estimates as est
from jacobkit.planner.plan import Estimate, Plan, Probe, Rejection, Switch
from jacobkit.planner.rows import segment_size, segment_view
from jacobkit.planner.scratch import MemoryPrior
from jacobkit.problem import Problem
from jacobkit.result import Stats
from jacobkit.strategies import Strategy

#: a call computes about this many segments (fewer where the rows do not
#: divide into equal segments). 1: every call, the first included, runs one
#: strategy on every row, and a candidate is tried on whole calls. Measured
#: (2-core CPU, MLP 512-1024-1024-144, B=256, a 289 MiB result) with 4
#: segments: joining them cost about 0.5 s a call, running every row at once
#: later cost one more trace, and chunked(36) on segments ran 5.5-5.6
#: ms/row against 5.0-5.3 for chunked(72) on whole calls. The segment
#: machinery stays (tests run it with 4) for devices where joining is cheap.
SEGMENTS = 1
#: a segment has at least this many rows (shorter ones time poorly)
MIN_SEGMENT_ROWS = 8
#: a tried candidate's rate is the median of this many segments that did
#: not trace (one is at the mercy of a busy machine)
TRIAL_SEGMENTS = 2
#: segments kept per strategy for its estimate (the newest)
_KEPT_PROBES = 8


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
    ) -> None:
        self.num_rows = problem.num_rows
        self.budget_bytes = budget_bytes
        self.allowed_bytes = allowed_bytes
        self.device = device
        self.prior = prior
        self.result_bytes = probes.result_bytes(problem)
        target = max(MIN_SEGMENT_ROWS, self.num_rows // SEGMENTS)
        size = segment_size(self.num_rows, target)
        if size < self.num_rows and 2 * self.result_bytes > allowed_bytes:
            size = self.num_rows  # no room to concatenate segments
        # the shortcut with as few rows of its inner strategy at once as the
        # budget needs (``None``: none fits)
        fitting = shortcut
        while fitting is not None and (
            est.predicted_peak(fitting, self.num_rows, prior, self.result_bytes)
            > allowed_bytes
        ):
            fitting = fitting.smaller()
        if fitting is not None:
            size = self.num_rows  # it computes every row at once
        closed_form = _per_example_fast_path(problem)
        if closed_form:
            # a segment of per-example rows may cut an example in two, which
            # the batch strategy (their closed-form fast path) cannot compute:
            # whole calls, so that it can be tried
            size = self.num_rows
        self.segment_rows = size
        self.segment_result_bytes = probes.result_bytes(problem, size)
        self.probes: list[Probe] = []
        self.known: dict[Strategy, Estimate] = {}
        found, self.rejected = selection.candidates(size, self.fits)
        # which strategy starts is a property of the problem (what vectorizing
        # its rows costs), not of this CPU's kernels: compared without scratch
        activations = replace(prior, scratch_bytes=0)
        found = selection.starting_first(
            found,
            self.num_rows,
            lambda s: est.predicted_peak(
                s, self.num_rows, activations, self.result_bytes
            ),
        )
        if closed_form:
            # the closed form computes B x K per-example rows for about the
            # price of K summed ones: a prior strong enough to start on it
            found.sort(key=lambda s: s.name != "batch")
        found, self.structure = _with_shortcut(
            self, problem, found, shortcut, fitting, structure, closed_form
        )
        if not found:
            smallest = min(
                est.predicted_peak(s, 1, prior, self.segment_result_bytes)
                for s in _smallest_configurations()
            )
            source = "from the forward pass's activations"
            if prior.scratch_bytes:
                source += (
                    f" and {_fmt(prior.scratch_bytes)} of work space that this "
                    "CPU's convolution gradient kernels take, measured"
                )
            raise ValueError(
                f"jacobian(memory_budget={_fmt(budget_bytes)}): even one row at a "
                f"time needs about {_fmt(smallest + self.kept_bytes)} (estimated "
                f"{source}), more than the budget allows. Raise memory_budget, "
                "keep fewer rows with features=[...], or use a smaller batch."
            )
        #: time spent joining segments of the current strategy (what running
        #: every row at once would save); reset whenever it changes
        self.joining_s = 0.0
        self.current = found[0]
        self.pending: list[Strategy] = found[1:]
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
    @property
    def kept_bytes(self) -> int:
        """Earlier segments' Jacobians, alive while a segment runs."""
        return self.kept_during(self.segment_rows)

    def kept_during(self, rows: int) -> int:
        """Earlier runs' Jacobians alive while a run of ``rows`` rows runs
        (none for a run of every row)."""
        return self.result_bytes if rows < self.num_rows else 0

    def predicted_peak(self, strategy: Strategy, rows: int | None = None) -> int:
        """Predicted peak of one run of ``rows`` rows (default: a segment)."""
        rows = self.segment_rows if rows is None else rows
        segment = rows == self.segment_rows
        result = self.segment_result_bytes if segment else self.result_bytes
        return est.predicted_peak(strategy, rows, self.prior, result)

    def fits(
        self, strategy: Strategy, room: float | None = None, rows: int | None = None
    ) -> bool:
        """Whether ``strategy``'s peak on runs of ``rows`` rows (default: a
        segment; measured, else predicted) plus the kept segments fits
        ``room`` (default: what the budget allows)."""
        room = self.allowed_bytes if room is None else room
        rows = self.segment_rows if rows is None else rows
        known = self.estimate(strategy)
        peak = known.peak if known is not None else None
        if peak is None:
            peak = self.predicted_peak(strategy, rows)
        return peak + self.kept_during(rows) <= room

    # -- knowledge ---------------------------------------------------------
    def estimate(self, strategy: Strategy) -> Estimate | None:
        """What is known of ``strategy`` (``None`` if nothing)."""
        earlier = self.known.get(strategy)
        if not any(p.strategy == strategy for p in self.probes):
            return earlier
        found = est.estimate(strategy, self.probes, earlier)
        return replace(found, predicted_peak_bytes=self.predicted_peak(strategy))

    def plan(self) -> Plan:
        """The current state as a frozen :class:`Plan`."""
        ran = {p.strategy for p in self.probes} | set(self.known)
        estimates = tuple(e for s in ran if (e := self.estimate(s)) is not None)
        current = self.estimate(self.current)
        peak = current.peak if current is not None else None
        return Plan(
            strategy=self.current,
            budget_bytes=self.budget_bytes,
            result_bytes=self.result_bytes,
            num_rows=self.num_rows,
            segment_rows=self.segment_rows,
            predicted_time_s=current.seconds(self.num_rows) if current else None,
            predicted_peak_bytes=(
                peak + self.kept_bytes
                if peak is not None
                else self.predicted_peak(self.current) + self.kept_bytes
            ),
            estimates=tuple(sorted(estimates, key=lambda e: e.strategy.label)),
            pending=tuple(([self.trying] if self.trying else []) + self.pending),
            rejected=tuple(self.rejected),
            switches=tuple(self.switches),
            last_call=self.last_call,
            source=self.source,
            calls=self.calls,
            structure=self.structure,
        )

    # -- choosing ------------------------------------------------------------
    def choose(self, row: int) -> Strategy:
        """The strategy for the segment starting at ``row``."""
        if self.trying is not None:
            timed = [p for p in self.probes if p.strategy == self.trying]
            if sum(not p.traced for p in timed) < TRIAL_SEGMENTS:
                return self.trying  # its tracing segment is not its speed
            self._finish_trial(self.estimate(self.trying), row)
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
                f"{self.current.label} >= {selection.RENT:g} x its predicted "
                f"trace {trace_s:.2f} s",
            )
        )
        self.spent_s = 0.0
        return candidate

    def _due_candidate(self, rows: int) -> tuple[Strategy, float] | None:
        """The next candidate to try now on runs of ``rows`` rows (configured
        for them, and made smaller until it fits the room a try may take)
        and its predicted tracing time; ``None`` in a process's first call,
        before the current rate is known, or while the time spent running
        the current strategy is below :data:`~jacobkit.planner.selection.
        RENT` times that tracing time. Candidates that cannot fit are
        rejected on the way."""
        current = self.estimate(self.current)
        if self.calls <= 1 or current is None or current.seconds_per_row is None:
            return None
        while self.pending:
            candidate = self.pending[0]
            peak = current.peak_bytes
            room = selection.race_room(
                None if peak is None else peak + self.kept_during(rows),
                self.allowed_bytes,
            )
            smaller = candidate
            if rows == self.num_rows and rows != self.segment_rows:
                # tried on whole calls: as many rows at once as whole calls
                # allow (a vectorized chunk of every row, where it fits)
                smaller = type(candidate).for_auto(rows) or candidate
            while smaller is not None and not self.fits(smaller, room, rows):
                smaller = smaller.smaller()
            if smaller is None:
                self.pending.pop(0)
                self.rejected.append(
                    Rejection(
                        candidate,
                        f"predicted peak {_fmt(self.predicted_peak(candidate))} "
                        f"over {_fmt(room)} (twice the current peak + "
                        f"{_fmt(selection.RACE_SLACK_BYTES)}, within the budget)",
                    )
                )
                self.dirty = True
                continue
            trace_s = est.predicted_trace_s(smaller, self.known.get(smaller), current)
            if not selection.should_try(self.spent_s, trace_s):
                return None
            self.pending[0] = smaller
            return smaller, trace_s
        return None

    def _call_rows(self) -> int:
        """Rows per run in this call. Segments while the call measures the
        current strategy's rate or tries a candidate. Otherwise every row at
        once, which needs the strategy traced for every row: free where it
        has not been traced in this process yet (a first call from the disk
        cache traces once either way). Else the new trace is paid once
        the time segments cost beyond one run (joining them: measured per
        call) adds up to that tracing time (ski rental), or once the time
        spent running the strategy reaches
        :data:`~jacobkit.planner.selection.RENT` times it, like a
        candidate's try."""
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
        if selection.should_run_whole(self.joining_s, current.trace_s):
            return self.num_rows
        if selection.should_try(self.spent_s, current.trace_s):
            # whole calls as a try of their own: then later candidates are
            # tried on whole calls too, configured for every row (on the MLP
            # 512-1024-1024-144, chunked(72) on whole calls ran 5.0-5.3
            # ms/row, chunked(36) on segments 5.5-5.6)
            return self.num_rows
        return self.segment_rows

    def _finish_trial(self, found: Estimate, row: int) -> None:
        current = self.estimate(self.current)
        trying = self.trying
        # the first run after a trace is slow while the allocator grows for
        # the new function (measured: 1.5-1.8x the later rate, every
        # strategy, MLP 512-1024-1024-144 on 2 CPU cores): both are judged
        # by their best run, the candidate over its trial, the current
        # strategy over its recent runs
        current = replace(
            current,
            seconds_per_row=self._best_rate(self.current, current.seconds_per_row),
        )
        found = replace(
            found, seconds_per_row=self._best_rate(trying, found.seconds_per_row)
        )
        self.trying = None
        self.dirty = True
        rates = (
            f"{found.seconds_per_row * 1e3:.3g} ms/row vs "
            f"{current.seconds_per_row * 1e3:.3g} ms/row"
        )
        if selection.winner(current, found) is found:
            why = (
                "faster"
                if found.seconds_per_row < current.seconds_per_row
                else f"within {selection.NOISE - 1:.0%} and a lower peak"
            )
            self.switches.append(
                Switch(self.calls, row, self.current, trying, f"{why}: {rates}")
            )
            self.rejected.append(
                Rejection(self.current, f"slower than {trying.label}: {rates}")
            )
            self.current = trying
        else:
            self.switches.append(
                Switch(
                    self.calls,
                    row,
                    trying,
                    self.current,
                    f"{trying.label} was not faster ({rates}, or within "
                    f"{selection.NOISE - 1:.0%} with a higher peak)",
                )
            )
            self.rejected.append(Rejection(trying, f"tried: {rates}"))

    # -- running -------------------------------------------------------------
    def run(self, problem: Problem) -> tuple[list[tf.Tensor], Stats]:
        """One call: every row (in segments where it measures or tries a
        candidate); the Jacobians and their Stats."""
        self.calls += 1
        size = self.call_rows = self._call_rows()
        kept = self.kept_during(size)
        view = segment_view(problem, size)
        begin = time.perf_counter()
        parts: list[list[tf.Tensor]] = []
        done: list[Probe] = []
        row = 0
        while row < self.num_rows:
            strategy = self.choose(row)
            try:
                jacobians, probe = probes.run_segment(
                    strategy, view, row, self.calls, self.device
                )
            except tf.errors.ResourceExhaustedError:
                self._back_off(strategy, row, "ran out of memory")
                continue
            except Exception as err:
                why = f"{type(err).__name__}: {err}"
                if strategy == self.trying:
                    # a candidate that refuses (its check) or fails on this
                    # problem is dropped; the current strategy computes the rows
                    self._drop_trial(strategy, why)
                elif self.pending and not any(
                    p.strategy == strategy for p in self.probes
                ):
                    # the starting strategy refused before computing anything:
                    # the next candidate starts instead
                    self._drop_start(strategy, why)
                else:
                    raise
                continue
            self._record(probe)
            done.append(probe)
            parts.append(jacobians)
            row += size
            over = probe.peak_bytes is not None and (
                probe.peak_bytes + kept > self.allowed_bytes
            )
            if over and strategy.smaller() is not None:
                self._back_off(strategy, row, "went over the budget")
        joining = time.perf_counter()
        flat = (
            parts[0]
            if len(parts) == 1
            else [tf.concat(list(chunks), axis=0) for chunks in zip(*parts)]
        )
        if len(parts) > 1 and all(p.strategy == self.current for p in done):
            # the first call's joining counts too: measured on the MLP
            # 512-1024-1024-144 (a 289 MiB result), the second call's cost
            # as much (0.5 s), so it is not a one-off
            self.joining_s += time.perf_counter() - joining
        self.last_call = tuple(done)
        if self.source == "not run yet":
            self.source = "measured"
        peaks = [p.peak_bytes for p in done if p.peak_bytes is not None]
        stats = Stats(
            wall_time_s=time.perf_counter() - begin,
            trace_time_s=sum(
                e.trace_s or 0.0
                for s in {p.strategy for p in done if p.traced}
                if (e := self.estimate(s)) is not None
            ),
            traced=any(p.traced for p in done),
            peak_bytes=max(peaks) + kept if peaks else None,
            num_rows=sum(p.rows for p in done),
        )
        return flat, stats

    def _record(self, probe: Probe) -> None:
        if probe.traced:
            self.dirty = True
        self.probes.append(probe)
        mine = [p for p in self.probes if p.strategy == probe.strategy]
        if len(mine) > _KEPT_PROBES:  # keep the traced one and the newest
            old = next(p for p in mine if not p.traced)
            self.probes.remove(old)
        if probe.strategy == self.current and not probe.traced:
            self.spent_s += probe.seconds
            if not any(
                p.strategy == probe.strategy and not p.traced for p in self.probes[:-1]
            ):
                self.dirty = True  # its first rate

    def _best_rate(self, strategy: Strategy, otherwise: float) -> float:
        """Least seconds per row of ``strategy``'s newest untraced runs
        (``otherwise`` if none)."""
        rates = [
            p.seconds / p.rows
            for p in self.probes
            if p.strategy == strategy and not p.traced
        ]
        return min(rates[-est.RATE_RUNS :], default=otherwise)

    def _drop_trial(self, strategy: Strategy, why: str) -> None:
        self.trying = None
        self._reject_failed(strategy, why)

    def _drop_start(self, strategy: Strategy, why: str) -> None:
        self.current = self.pending.pop(0)
        self._reject_failed(strategy, why)

    def _reject_failed(self, strategy: Strategy, why: str) -> None:
        self.rejected.append(Rejection(strategy, why.splitlines()[0][:160]))
        self.dirty = True

    def _back_off(self, strategy: Strategy, row: int, what: str) -> None:
        """``strategy`` needs less at once: its :meth:`smaller`, from now on."""
        smaller = strategy.smaller()
        if not self.warned:
            after = smaller.label if smaller is not None else self.current.label
            warnings.warn(
                f"jacobkit: {strategy.label} {what}; retrying with less at once "
                f"({after}).",
                ResourceWarning,
                stacklevel=5,
            )
            self.warned = True
        self.dirty = True
        if strategy is self.trying or strategy == self.trying:
            if smaller is None:
                self._drop_trial(strategy, f"{what} at its smallest")
            else:
                self.trying = smaller
            return
        if smaller is None:
            raise tf.errors.ResourceExhaustedError(
                None,
                None,
                f"jacobkit: {strategy.label} {what} computing one row at a time",
            )
        self.switches.append(Switch(self.calls, row, strategy, smaller, what))
        self.rejected.append(Rejection(strategy, what))
        self.current = smaller


def _smallest_configurations() -> list[Strategy]:
    """Each auto candidate at its smallest (for the refusal message)."""
    found = []
    for cls in strategies.REGISTRY.values():
        strategy = cls.for_auto(1)
        while strategy is not None and strategy.smaller() is not None:
            strategy = strategy.smaller()
        if strategy is not None:
            found.append(strategy)
    return found


def _fmt(n: float) -> str:
    return memory.format_bytes(int(n))


def entry_of(session: Session) -> dict:
    """What the disk cache keeps of ``session`` (JSON-friendly)."""
    plan = session.plan()
    return {
        "current": cache.strategy_to_json(session.current),
        "pending": [cache.strategy_to_json(s) for s in plan.pending],
        "segment_rows": session.segment_rows,
        "row_bytes": session.prior.row_bytes,
        "spent_s": session.spent_s,
        "estimates": [cache.estimate_to_json(e) for e in plan.estimates],
        "rejected": [cache.rejection_to_json(r) for r in plan.rejected],
    }


def restore(session: Session, entry: dict) -> bool:
    """Continue from a disk cache entry; ``False`` where it does not apply
    (other segments, or its strategy no longer fits the budget: re-planned).
    Raises ``ValueError``/``KeyError``/``TypeError`` on a malformed entry."""
    if int(entry["segment_rows"]) != session.segment_rows:
        return False
    known = [cache.estimate_from_json(e) for e in entry["estimates"]]
    current = cache.strategy_from_json(entry["current"])
    pending = [cache.strategy_from_json(s) for s in entry["pending"]]
    rejected = [cache.rejection_from_json(r) for r in entry["rejected"]]
    spent = float(entry["spent_s"])
    session.known = {e.strategy: e for e in known}
    if not session.fits(current):
        session.known = {}
        return False
    session.current = current
    session.pending = [s for s in pending if session.fits(s)]
    session.rejected = rejected
    session.spent_s = spent
    session.source = "disk cache"
    return True


def _with_shortcut(
    session: Session,
    problem: Problem,
    found: list[Strategy],
    shortcut: Strategy | None,
    fitting: Strategy | None,
    structure: str,
    closed_form: bool,
) -> tuple[list[Strategy], str | None]:
    """The candidates when an exact shortcut applies (``fitting``: made small
    enough for the budget; ``None`` if nothing fits; beside ``batch``'s
    closed form where ``closed_form``, :func:`_per_example_fast_path`, see
    :mod:`jacobkit.planner.shortcuts`), and the structure line of the plan.
    The registry's own "not offered" rejection of the shortcut's name
    becomes the reason where none applies."""
    named = shortcuts.NAME
    session.rejected = [r for r in session.rejected if r.label != named]
    if shortcut is None:
        if structure:
            session.rejected.append(Rejection(named, structure))
        return found, None
    if fitting is None:
        session.rejected.append(Rejection(shortcut, "predicted peak over the budget"))
        return found, None
    kept, rejected = shortcuts.candidates(
        problem, found, fitting, session.fits, closed_form=closed_form
    )
    session.rejected += rejected
    return kept, structure


def _per_example_fast_path(problem: Problem) -> bool:
    """Rows of single examples of a Dense/Conv layer's own variables: where
    the ``batch`` strategy's closed form may apply."""
    rows = problem.rows_spec
    return (
        rows.decomposes_per_example
        and not rows.summed_over_batch
        and problem.tensor_targets is None
        and problem.linear_layer_kind is not None
    )
