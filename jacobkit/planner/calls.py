"""Running one ``auto`` call: every row (in segments where the call measures
or tries a candidate), each run both part of the answer and a measurement.

An out-of-memory error (or a run over the budget) makes the strategy
:meth:`~jacobkit.strategies.Strategy.smaller` for the rest of the call and
every later one; the rows of the failed run are computed again by the
smaller one (nothing of them was returned). A candidate that refuses or
fails is dropped; so is a starting strategy that refuses before computing
anything (the next candidate starts instead).
"""

from __future__ import annotations

import time
import warnings

import tensorflow as tf

from jacobkit.planner import probes
from jacobkit.planner.plan import Probe, Rejection, Switch
from jacobkit.planner.rows import segment_view
from jacobkit.planner.session import Session
from jacobkit.problem import Problem
from jacobkit.result import Stats
from jacobkit.strategies import Strategy


def run_call(session: Session, problem: Problem) -> tuple[list[tf.Tensor], Stats]:
    """One call of ``session`` on ``problem``: the Jacobians and their Stats."""
    session.calls += 1
    size = session.call_rows = session.next_call_rows()
    kept = session.footprint.kept_during(size)
    view = segment_view(problem, size)
    begin = time.perf_counter()
    parts: list[list[tf.Tensor]] = []
    done: list[Probe] = []
    row = 0
    while row < session.num_rows:
        strategy = session.choose(row)
        try:
            jacobians, probe = probes.run_segment(
                strategy, view, row, session.calls, session.device
            )
        except tf.errors.ResourceExhaustedError:
            _back_off(session, strategy, row, "ran out of memory")
            continue
        except Exception as err:
            if not _dropped(session, strategy, err):
                raise
            continue
        session.record(probe)
        done.append(probe)
        parts.append(jacobians)
        row += size
        over = probe.peak_bytes is not None and (
            probe.peak_bytes + kept > session.allowed_bytes
        )
        if over and strategy.smaller() is not None:
            _back_off(session, strategy, row, "went over the budget")
    flat = _joined(session, parts, done)
    session.last_call = tuple(done)
    if session.source == "not run yet":
        session.source = "measured"
    return flat, _stats(session, done, kept, time.perf_counter() - begin)


def _joined(
    session: Session, parts: list[list[tf.Tensor]], done: list[Probe]
) -> list[tf.Tensor]:
    """The segments' Jacobians joined per target; the time it took counts
    towards running every row at once where one strategy computed them."""
    joining = time.perf_counter()
    flat = (
        parts[0]
        if len(parts) == 1
        else [tf.concat(list(chunks), axis=0) for chunks in zip(*parts)]
    )
    if len(parts) > 1 and all(p.strategy == session.current for p in done):
        # the first call's joining counts too: measured on the MLP
        # 512-1024-1024-144 (a 289 MiB result), the second call's cost
        # as much (0.5 s), so it is not a one-off
        session.joining_s += time.perf_counter() - joining
    return flat


def _stats(session: Session, done: list[Probe], kept: int, wall_s: float) -> Stats:
    """The call's Stats from its runs (``kept``: earlier segments alive)."""
    peaks = [p.peak_bytes for p in done if p.peak_bytes is not None]
    return Stats(
        wall_time_s=wall_s,
        trace_time_s=sum(
            e.trace_s or 0.0
            for s in {p.strategy for p in done if p.traced}
            if (e := session.estimate(s)) is not None
        ),
        traced=any(p.traced for p in done),
        peak_bytes=max(peaks) + kept if peaks else None,
        num_rows=sum(p.rows for p in done),
    )


def _dropped(session: Session, strategy: Strategy, err: Exception) -> bool:
    """A run of ``strategy`` raised ``err`` (not out of memory): whether it was
    dropped (a candidate being tried, or the starting strategy that has
    computed nothing yet); else the error is the caller's to raise."""
    why = f"{type(err).__name__}: {err}"
    if strategy == session.trying:
        # a candidate that refuses (its check) or fails on this
        # problem is dropped; the current strategy computes the rows
        _drop_trial(session, strategy, why)
        return True
    if session.pending and not any(p.strategy == strategy for p in session.probes):
        # the starting strategy refused before computing anything:
        # the next candidate starts instead
        session.current = session.pending.pop(0)
        _reject_failed(session, strategy, why)
        return True
    return False


def _drop_trial(session: Session, strategy: Strategy, why: str) -> None:
    session.trying = None
    _reject_failed(session, strategy, why)


def _reject_failed(session: Session, strategy: Strategy, why: str) -> None:
    session.rejected.append(Rejection(strategy, why.splitlines()[0][:160]))
    session.dirty = True


def _back_off(session: Session, strategy: Strategy, row: int, what: str) -> None:
    """``strategy`` needs less at once: its :meth:`smaller`, from now on."""
    smaller = strategy.smaller()
    if not session.warned:
        after = smaller.label if smaller is not None else session.current.label
        warnings.warn(
            f"jacobkit: {strategy.label} {what}; retrying with less at once ({after}).",
            ResourceWarning,
            stacklevel=5,
        )
        session.warned = True
    session.dirty = True
    if strategy is session.trying or strategy == session.trying:
        if smaller is None:
            _drop_trial(session, strategy, f"{what} at its smallest")
        else:
            session.trying = smaller
        return
    if smaller is None:
        raise tf.errors.ResourceExhaustedError(
            None,
            None,
            f"jacobkit: {strategy.label} {what} computing one row at a time",
        )
    session.switches.append(Switch(session.calls, row, strategy, smaller, what))
    session.rejected.append(Rejection(strategy, what))
    session.current = smaller
