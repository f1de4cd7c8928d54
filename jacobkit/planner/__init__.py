"""``auto``: the first answer as fast as the best single strategy, then the
fastest strategy that fits the memory budget, with no work thrown away.

How a call runs (nothing of the full Jacobian's size is allocated before
the budget is checked):

1. The budget (``memory_budget``; default :data:`jacobkit.memory.
   DEFAULT_BUDGET_FRACTION` of free device memory) is checked against the
   result itself, ``R × P × itemsize``, and refused with the bytes needed.
2. Every call runs one strategy on every row at once, exactly as the fixed
   strategy would, and is timed and its peak measured while it computes the
   answer (:mod:`~jacobkit.planner.probes`). No row is computed twice.
3. The first call starts on the candidate cheapest to trace (``while``), or
   on one vectorizing more rows where it is predicted to cost little more
   memory, made small enough that its predicted peak fits
   (:mod:`~jacobkit.planner.selection`). Other candidates are tried on later
   calls (never the first call of a process) once the time spent running
   the current one reaches :attr:`~jacobkit.planner.policy.Policy.rent`
   times the try's predicted cost (its tracing time and its trial's calls,
   :func:`~jacobkit.planner.selection.try_cost_s`); a trial far slower than
   the current strategy ends on its first timed call, and what a try cost
   beyond its prediction is earned back before the next
   (:mod:`~jacobkit.planner.trials`); the faster one (the lower peak within
   noise) is kept (:mod:`~jacobkit.planner.estimates`).
4. What was measured is written to a plan cache on disk
   (:mod:`~jacobkit.planner.cache`), so the next process starts on the
   strategy that won, and a settled plan probes nothing.

An out-of-memory error, or a run over the budget, makes the strategy
:meth:`~jacobkit.strategies.Strategy.smaller` from then on (a
:class:`BudgetWarning`, once); where that cannot lower a run's peak over the
budget, the budget is not held, which is warned (once), and nothing is traced
again.

The tunables are a frozen :class:`Policy`; :func:`use_policy` changes them
for the sessions started within a ``with`` block.

Modules, in the order data flows: :mod:`~jacobkit.planner.auto` (the
:class:`Auto` object: its sessions, the norm choice),
:mod:`~jacobkit.planner.opening` (a new session: the budget, the shortcut,
the memory prior, the disk entry), :mod:`~jacobkit.planner.policy`,
:mod:`~jacobkit.planner.start` (the candidates),
:mod:`~jacobkit.planner.session` (the state, choosing),
:mod:`~jacobkit.planner.trials` (judging a try),
:mod:`~jacobkit.planner.calls` (running a call, backing off),
:mod:`~jacobkit.planner.entry` and :mod:`~jacobkit.planner.cache` (the disk
cache). This package face only hands names on.
"""

from jacobkit.planner.auto import Auto, solver
from jacobkit.planner.entry import CacheEntry
from jacobkit.planner.footprint import BudgetWarning
from jacobkit.planner.policy import Policy, current_policy, use_policy
from jacobkit.planner.scratch import MemoryPrior
from jacobkit.planner.session import Session
from jacobkit.problem.plan import Estimate, Plan, Probe, Rejection, Switch

__all__ = [
    "Auto",
    "BudgetWarning",
    "CacheEntry",
    "Estimate",
    "MemoryPrior",
    "Plan",
    "Policy",
    "Probe",
    "Rejection",
    "Session",
    "Switch",
    "current_policy",
    "solver",
    "use_policy",
]
