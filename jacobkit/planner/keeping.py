"""A session and the plan cache on disk: what an entry keeps of a session
(:func:`entry`, from its :class:`~jacobkit.problem.plan.Plan`), and how a
session's fresh lineup continues from an entry (:func:`resumed`). Pure
functions: the session applies them through its own methods
(:meth:`~jacobkit.planner.session.Session.cache_entry`,
:meth:`~jacobkit.planner.session.Session.restore`); the JSON is
:mod:`jacobkit.planner.entry`'s, the files :mod:`jacobkit.planner.cache`'s."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

from jacobkit import runtime
from jacobkit.planner.entry import CacheEntry
from jacobkit.planner.footprint import Footprint
from jacobkit.planner.lineup import Lineup
from jacobkit.problem.plan import Plan
from jacobkit.strategies import Strategy


def entry(plan: Plan[Strategy], spent_s: float, footprint: Footprint) -> CacheEntry:
    """What the disk cache keeps of a session whose state is ``plan``, which
    spent ``spent_s`` seconds running its strategy since the last try and
    plans within ``footprint`` (its memory prior per row, what the budget
    allows)."""
    return CacheEntry(
        current=plan.strategy,
        pending=plan.pending,
        segment_rows=plan.num_rows,
        row_bytes=footprint.prior.row_bytes,
        spent_s=spent_s,
        estimates=plan.estimates,
        rejected=plan.rejected,
        allowed_bytes=footprint.allowed_bytes,
        cpu=runtime.cpu_kind().describe(),
    )


def measured_here(kept: CacheEntry) -> bool:
    """Whether ``kept`` may have been measured on this process's kind of CPU
    (:meth:`~jacobkit.planner.entry.CacheEntry.measured_on`): the cache's file
    name holds the kind already, so one that does not is an entry moved
    between machines, and is read as missing."""
    return kept.measured_on(runtime.cpu_kind().describe())


def resumed(
    lineup: Lineup,
    kept: CacheEntry,
    footprint: Footprint,
    fits: Callable[[Strategy], bool],
) -> tuple[Lineup, bool] | None:
    """A session's fresh ``lineup`` continued from ``kept``
    (:meth:`~jacobkit.planner.entry.CacheEntry.resume`, under the budget
    ``footprint`` allows, given whether a strategy ``fits`` with what the
    entry measured known), and whether the entry no longer says it (it is
    rewritten); ``None``: the entry does not apply, the fresh start
    stands."""
    fresh = (lineup.current, *lineup.pending)
    found = kept.resume(fresh, footprint.allowed_bytes, fits)
    if found is None:
        return None
    continued = replace(
        lineup, current=kept.current, pending=found.pending, rejected=found.rejected
    )
    return continued, found.changed
