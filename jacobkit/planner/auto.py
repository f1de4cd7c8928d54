"""``strategy="auto"`` as one object: :class:`Auto`.

``Auto`` is configured like any strategy (a frozen record of its options:
the memory budget, the device, the plan cache) and run like one: it is a
:class:`~jacobkit.problem.solution.Solver` (:meth:`Auto.solve`, by
:mod:`jacobkit.engine`'s one path; :meth:`Auto.planned` and
:meth:`Auto.plan` answer where a strategy answers with itself and ``None``).
It owns its state: the planning sessions it keeps per model (its own
:class:`~jacobkit.problem.cache.PerModel` slot, keyed by the problem's
:class:`~jacobkit.problem.ProblemKey`, the input shapes, its own options, the
device and the policy), and, in a second slot, the plans of reduced calls
(:mod:`jacobkit.planner.reduced`). Two equal ``Auto`` objects share
their sessions, so ``strategy="auto"`` on every call plans once, as a named
strategy traces once.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace
from typing import Any, ClassVar, final

from jacobkit import memory, strategies
from jacobkit.planner import calls, probes, reduced
from jacobkit.planner.opening import open_session
from jacobkit.planner.policy import current_policy
from jacobkit.planner.session import Session
from jacobkit.problem import PerModel, Problem
from jacobkit.problem.plan import Plan
from jacobkit.problem.solution import Solution
from jacobkit.strategies import Strategy

_SESSIONS = PerModel("Auto: its planning sessions per problem and configuration")
_REDUCED = PerModel("Auto: its plans of reduced calls per problem and configuration")


@final
@dataclass(frozen=True)
class Auto:
    """The first answer as fast as the best single strategy, then the fastest
    strategy that fits the memory budget (see :mod:`jacobkit.planner`).

    ``jacobian(..., strategy=Auto(memory_budget="1GiB"))`` is
    ``jacobian(..., strategy="auto", memory_budget="1GiB")``.

    Attributes:
        memory_budget: bytes, a string like ``"2GiB"``, a fraction of free
            device memory, or ``None`` (the default fraction, see
            :data:`jacobkit.memory.DEFAULT_BUDGET_FRACTION`).
        device: whose memory the budget is of, and where peaks are measured
            (``None``: the CPU, or the device the call runs on).
        cache: read and write the plan cache on disk
            (:mod:`jacobkit.planner.cache`); ``False``: plan in memory only.
    """

    name: ClassVar[str] = "auto"
    memory_budget: int | float | str | None = None
    device: str | None = None
    cache: bool = True

    def __post_init__(self) -> None:
        # a bad budget or device is refused now, before any model is traced
        if self.memory_budget is not None:
            try:
                memory.parse_budget(self.memory_budget, free=1 << 40)
            except (TypeError, ValueError) as err:
                raise type(err)(
                    f"jacobian(memory_budget={self.memory_budget!r}): {err}"
                ) from err
        if self.device is not None:
            try:
                memory.normalize_device(self.device)
            except (TypeError, ValueError) as err:
                raise ValueError(
                    f"Auto(device={self.device!r}): not a device name; use "
                    "'CPU:0' or 'GPU:0' (or None: the CPU, or the call's device)."
                ) from err
        if not isinstance(self.cache, bool):
            raise TypeError(
                f"Auto(cache={self.cache!r}): expected True (use the plan cache "
                "on disk) or False (plan in memory only)."
            )

    @property
    def label(self) -> str:
        return self.name

    def solve(self, problem: Problem) -> Solution[Strategy]:
        """One call: every row of ``problem`` by the strategy the session
        picks; the solution names what later calls run and the plan.
        ``stats.planning_time_s`` is the time spent outside the run that
        computed the rows (the budget check, the memory prior, the cache).
        Where the model draws randomness no seed state pins
        (``problem.unpinned``), one strategy whose result comes from one
        pass, and nothing probed."""
        if problem.unpinned:
            return one_pass(problem).solve(problem)
        if problem.reduction.reduces:
            return self.reduced(problem).solve(problem)
        start = time.perf_counter()
        session = self._session(problem)
        solved = calls.run_call(session, problem)
        session.persist()
        stats = solved.stats
        planning = max(time.perf_counter() - start - stats.wall_time_s, 0.0)
        return replace(solved, stats=replace(stats, planning_time_s=planning))

    def plan(self, problem: Problem) -> Plan[Strategy]:
        """What the next call on ``problem`` runs and what is known (nothing
        is run: before the first call, the strategy it starts on and its
        predicted peak, or what the disk cache holds)."""
        if problem.reduction.reduces:
            return self.reduced(problem).plan()
        return self._session(problem).plan()

    def planned(self, problem: Problem) -> Strategy:
        """The strategy the next call on ``problem`` runs (what every replica
        of ``distribute=`` runs, and what ``jk.gram`` fuses its products
        with)."""
        return self.plan(problem).strategy

    def reduced(self, problem: Problem) -> reduced.Reduced:
        """For a reduced call (``reduce="norm"``, ``jk.ClippedSum``,
        ``jk.Project``): ``batch``'s closed forms where they apply, else
        ``chunked`` with the most rows at once that fit the budget, kept
        per problem and configuration (:mod:`jacobkit.planner.reduced`)."""
        device = memory.normalize_device(self.device)
        kept = _REDUCED.of(problem.model)
        key = (problem.key, probes.input_shapes(problem), self, device)
        if key not in kept:
            kept[key] = reduced.Reduced(
                problem, self.memory_budget, device, current_policy()
            )
        found: reduced.Reduced = kept[key]
        return found

    def _session(self, problem: Problem) -> Session:
        """This process's session for ``problem`` under this configuration
        and the current policy: made (or continued from the disk cache) on
        the first call, the same one on every later call."""
        device = memory.normalize_device(self.device)
        policy = current_policy()
        key = (problem.key, probes.input_shapes(problem), self, device, policy)
        sessions: dict[Any, Session] = _SESSIONS.of(problem.model)
        if key not in sessions:  # a repeated call plans (and fingerprints) nothing
            sessions[key] = open_session(
                problem, self.memory_budget, device, policy, self.cache
            )
        return sessions[key]


def solver(
    strategy: str | Strategy | Auto,
    memory_budget: Any,
    device: str | None,
    cache: bool,
) -> Strategy | Auto:
    """What computes the rows: ``"auto"`` (or an :class:`~jacobkit.planner.Auto`,
    given the call's device and cache setting where it names none) or a
    configured strategy. A memory budget is for ``auto`` only."""
    if isinstance(strategy, Auto):
        if memory_budget is not None:
            raise ValueError(
                f"jacobian(memory_budget={memory_budget!r}, strategy={strategy!r})"
                ": the budget is the Auto object's; pass Auto(memory_budget="
                f"{memory_budget!r}) or drop memory_budget=."
            )
        return replace(
            strategy,
            device=strategy.device if strategy.device is not None else device,
            cache=strategy.cache and cache,
        )
    if isinstance(strategy, str) and strategy == "auto":
        return Auto(memory_budget, device, cache)
    chosen = strategies.get(strategy)
    if memory_budget is not None:
        raise ValueError(
            f"jacobian(memory_budget={memory_budget!r}, strategy={strategy!r}): "
            "a memory budget is planned for by strategy='auto' only. Drop "
            "strategy= to let auto fit the budget, or drop memory_budget= and "
            "size the strategy yourself (e.g. Chunked(chunk_size=8))."
        )
    return chosen


def one_pass(problem: Problem) -> Strategy:
    """``auto``'s pick where the model's randomness cannot be pinned: ``batch``
    where it serves, its result (a clipped sum's too) from one forward
    pass; else ``chunked``, whose rows come from one pass (a clipped sum
    from two passes is refused there, by the strategy:
    :meth:`~jacobkit.strategies.base.Strategy.check_draws`)."""
    try:
        strategies.Batch().check(problem)
    except ValueError as err:
        chunked = strategies.Chunked()
        chunked.check_draws(problem, why=str(err))
        return chunked
    return strategies.Batch()
