"""``auto``: the first answer as fast as the best single strategy, then the
fastest strategy that fits the memory budget, with no work thrown away.

How a call runs (nothing of the full Jacobian's size is allocated before
the budget is checked):

1. The budget (``memory_budget``; default :data:`jacobkit.memory.
   DEFAULT_BUDGET_FRACTION` of free device memory) is checked against the
   result itself, ``R × P × itemsize``, and refused with the bytes needed.
2. Every call runs one strategy on every row at once, exactly as the fixed
   strategy would, and is timed and its peak measured while it computes the
   answer (:mod:`~jacobkit.planner.probes`). No row is computed twice. (The
   execution can split calls into segments of rows, each by one strategy,
   :mod:`~jacobkit.planner.rows`; off by default, see
   :attr:`~jacobkit.planner.policy.Policy.segments`.)
3. The first call starts on the candidate cheapest to trace (``while``), or
   on one vectorizing more rows where it is predicted to cost little more
   memory, made small enough that its predicted peak fits
   (:mod:`~jacobkit.planner.selection`). Other candidates are tried on later
   calls (never the first call of a process) once the time spent running
   the current one reaches :attr:`~jacobkit.planner.policy.Policy.rent`
   times their predicted tracing time; the faster one (the lower peak within
   noise) is kept (:mod:`~jacobkit.planner.estimates`).
4. What was measured is written to a plan cache on disk
   (:mod:`~jacobkit.planner.cache`), so the next process starts on the
   strategy that won, and a settled plan probes nothing.

An out-of-memory error, or a run over the budget, makes the strategy
:meth:`~jacobkit.strategies.Strategy.smaller` from then on (warned once).

The tunables are a frozen :class:`Policy`; :func:`use_policy` changes them
for the sessions started within a ``with`` block.

Modules, in the order data flows: :mod:`~jacobkit.planner.policy`,
:mod:`~jacobkit.planner.start` (segments and candidates),
:mod:`~jacobkit.planner.session` (the state, choosing),
:mod:`~jacobkit.planner.trials` (judging a try),
:mod:`~jacobkit.planner.calls` (running a call, backing off),
:mod:`~jacobkit.planner.entry` and :mod:`~jacobkit.planner.cache` (the disk
cache).
"""

from __future__ import annotations

import functools
import weakref
from typing import Any

import tensorflow as tf

from jacobkit import memory, strategies
from jacobkit.planner import cache as disk
from jacobkit.planner import calls, probes, scratch
from jacobkit.planner.entry import CacheEntry, entry_of, restore
from jacobkit.planner.plan import Estimate, Plan, Probe, Rejection, Switch
from jacobkit.planner.policy import Policy, current_policy, use_policy
from jacobkit.planner.scratch import MemoryPrior
from jacobkit.planner.session import Session
from jacobkit.problem import Problem, per_model
from jacobkit.result import Stats
from jacobkit.strategies import Strategy, precision
from jacobkit.strategies.structured import NoShortcut

#: model -> {((problem key, input shapes, budget as given, device, policy),
#: cache on): (Session, cache name)}. The cache name is looked up only for a
#: new session: fingerprinting reads the model's config and variables, which
#: cost tens of milliseconds on a backbone, on every call otherwise.
_SESSIONS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def session_for(
    problem: Problem,
    *,
    memory_budget: Any = None,
    device: str | None = None,
    cache: bool = True,
) -> tuple[Session, str | None]:
    """This process's :class:`Session` for ``problem`` (made, or continued
    from the disk cache, if new) and its disk cache name (``None``: off)."""
    device = memory.normalize_device(device)
    policy = current_policy()
    shapes = probes.input_shapes(problem)
    key = (problem.key, shapes, repr(memory_budget), device, policy, cache)
    sessions = per_model(_SESSIONS, problem.model)
    if key in sessions:  # a repeated call: nothing to plan (nor to fingerprint)
        return sessions[key]
    on = cache and disk.directory() is not None
    name = disk.fingerprint(problem, device) if on else None
    budget = memory.parse_budget(memory_budget, device=device)
    result_bytes = probes.result_bytes(problem)
    if result_bytes > budget * policy.safety:
        raise ValueError(
            f"jacobian(memory_budget={memory.format_bytes(budget)}): the result "
            f"alone needs {memory.format_bytes(result_bytes)} ({result_bytes} "
            f"bytes: {problem.num_rows} rows × "
            f"{sum(t.shape.num_elements() for t in problem.targets)} parameters × "
            f"{problem.output_dtype.size} bytes), more than the budget allows. "
            "Raise memory_budget, keep fewer rows with features=[...], or use a "
            "smaller batch."
        )
    shortcut, structure = _structured(problem)
    entry = disk.load(name) if name is not None else None
    row_bytes = entry.row_bytes if entry is not None else None
    if row_bytes is None:
        # the forward pass's activations, from the trace the problem made:
        # an upper bound on what one row's backward pass keeps per row
        row_bytes = problem.activation_bytes
    measured_on = device if probes.peak_measurable(device) else None
    prior = _memory_prior(problem, row_bytes, measured_on)
    fresh = functools.partial(
        Session,
        problem,
        budget,
        budget * policy.safety,
        measured_on,
        prior,
        shortcut=shortcut,
        structure=structure,
        policy=policy,
    )
    session = fresh()
    if session.structure is not None:  # one candidate: nothing to learn or load
        entry = None
    if entry is not None and not restore(session, entry):
        session = fresh()  # planned afresh, and rewritten after the first call
        session.dirty = True
    sessions[key] = (session, name)
    return session, name


def _structured(problem: Problem) -> tuple[Strategy | None, str]:
    """``(Structured(), what it found)`` where an exact structural shortcut
    applies to ``problem`` (:mod:`jacobkit.problem.structure`), else
    ``(None, why not)``: the refusal's
    :attr:`~jacobkit.strategies.structured.NoShortcut.reason`, or the inner
    strategy's own refusal."""
    shortcut = strategies.Structured()
    try:
        shortcut.check(problem)
    except NoShortcut as err:
        return None, err.reason
    except ValueError as err:  # the inner strategy refuses the head's input
        return None, str(err)
    return shortcut, shortcut.describe(problem)


def _memory_prior(problem: Problem, row_bytes: int, device: str | None) -> MemoryPrior:
    """The memory prior of ``problem``: ``row_bytes`` per row alive at once
    in a vectorized pass, its sequential rows' figures, and the scratch space
    its convolution gradients' kernels take on this machine, measured where
    ``device`` reports its peak (else none)."""
    measured = 0
    if device is not None and problem.convolutions:
        dtype = precision.gradient_dtype(problem)
        measured = scratch.scratch_bytes(problem.convolutions, dtype, device)
    return MemoryPrior(
        row_bytes,
        problem.sequential_memory,
        measured,
        scratch.inter_op_threads(),
        eager_bytes=problem.forward_bytes,
    )


def plan_problem(
    problem: Problem,
    *,
    memory_budget: Any = None,
    device: str | None = None,
    cache: bool = True,
) -> Plan:
    """What ``auto`` runs next on ``problem`` and what it knows (nothing is
    run: before the first call, the plan is the starting strategy with its
    predicted peak, or what the disk cache holds)."""
    session, _ = session_for(
        problem, memory_budget=memory_budget, device=device, cache=cache
    )
    return session.plan()


def run(
    problem: Problem,
    *,
    memory_budget: Any = None,
    device: str | None = None,
    cache: bool = True,
) -> tuple[Strategy, list[tf.Tensor], Stats, Plan]:
    """One ``auto`` call: ``(strategy later calls run, flat (R, *v.shape)
    Jacobians, Stats, Plan)``; writes the disk cache when something was
    learned."""
    session, name = session_for(
        problem, memory_budget=memory_budget, device=device, cache=cache
    )
    flat, stats = calls.run_call(session, problem)
    if name is not None and session.dirty:
        disk.save(name, entry_of(session))
        session.dirty = False
    return session.current, flat, stats, session.plan()


__all__ = [
    "CacheEntry",
    "Estimate",
    "Plan",
    "Policy",
    "Probe",
    "Rejection",
    "Session",
    "Switch",
    "current_policy",
    "plan_problem",
    "run",
    "session_for",
    "use_policy",
]
