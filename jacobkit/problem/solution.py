"""What computes a call (:class:`Solver`) and what it answers
(:class:`Solution`, :class:`Stats`).

Every configured strategy (:class:`jacobkit.strategies.Strategy`) and
``auto`` (:class:`jacobkit.planner.Auto`) is a :class:`Solver`: the engine
runs either by ``solve(problem)``, and asks either which strategy computes a
problem (``planned``) and what was decided (``plan``). Both rank above the
problem: the protocol lets what ranks below them (a
:class:`~jacobkit.problem.Call`'s strategy) name them without importing
them. A :class:`Solution` and a :class:`~jacobkit.problem.plan.Plan` name
the strategies they hold by the type parameter ``StrategyT``
(:mod:`jacobkit.problem.plan`), which the engine fills with ``Strategy``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar, Generic, Protocol

from jacobkit.problem.plan import Plan, StrategyT
from jacobkit.problem.problem import Problem
from jacobkit.problem.reduction import Output


@dataclass(frozen=True)
class Stats:
    """What a call cost.

    Every field has a default, so a strategy (or a test) builds one with only
    what it measured: ``Stats(wall_time_s=0.2, num_rows=16)``.

    Attributes:
        wall_time_s: seconds for this call, tracing included if it traced.
        trace_time_s: seconds of the first (tracing) call of the compiled
            computation this call reused; 0.0 for the eager ``loop``.
        traced: whether this call traced (compiled) the computation.
        peak_bytes: peak device memory during the call, when measured.
        num_rows: rows this call computed (``R``, or fewer where ``auto``
            ran a strategy on a range of rows); ``None`` if not known.
        planning_time_s: seconds ``strategy="auto"`` spent planning in this
            call (its probes; 0.0 for a cached plan or a named strategy).
        total_time_s: seconds of the whole ``jacobian()`` call: checking the
            problem, planning and running (``wall_time_s`` is the run only);
            ``None`` where the strategy was run without ``jacobian()``.
    """

    wall_time_s: float = 0.0
    trace_time_s: float = 0.0
    traced: bool = False
    peak_bytes: int | None = None
    num_rows: int | None = None
    planning_time_s: float = 0.0
    total_time_s: float | None = None


@dataclass(frozen=True)
class Solution(Generic[StrategyT]):
    """One call's answer, as a strategy (or ``auto``) computed it: what
    :mod:`jacobkit.engine` wraps into a :class:`~jacobkit.result.JacobianResult`.

    Attributes:
        output: the reduction's :class:`~jacobkit.problem.reduction.Output`:
            per target, the flat ``(R, *v.shape)`` Jacobians (or what the
            problem's reduction gives per target), and every row's norm
            where the reduction has them.
        stats: what the call cost.
        strategy: what computed them (for ``auto``: what later calls run).
        plan: ``auto``'s :class:`~jacobkit.planner.Plan`; ``None`` for a
            configured strategy.
    """

    output: Output
    stats: Stats
    strategy: StrategyT
    plan: Plan[StrategyT] | None = None

    @property
    def jacobians(self) -> tuple[Any, ...]:
        """Per target, what the reduction gives (the Jacobians, unreduced)."""
        return tuple(self.output.values)

    @property
    def norms(self) -> Any:
        """Every row's norm over all targets, where the reduction has them."""
        return self.output.norms


class Solver(Protocol[StrategyT]):
    """What computes a call's rows: a configured strategy, or ``auto``.

    ``Solver[Strategy]`` is what :mod:`jacobkit.engine` runs: its solutions
    and plans hold :class:`~jacobkit.strategies.Strategy` objects.

    Attributes:
        name: the registered name (``"chunked"``, ``"auto"``).
    """

    name: ClassVar[str]

    @property
    def label(self) -> str:
        """Short display name: ``chunked(16)``, ``auto``."""
        ...

    def solve(self, problem: Problem) -> Solution[StrategyT]:
        """Every row of ``problem``, as the engine runs it."""
        ...

    def planned(self, problem: Problem) -> StrategyT:
        """The configured strategy that computes ``problem``: a strategy
        itself, ``auto`` the one its plan runs next (nothing is run)."""
        ...

    def plan(self, problem: Problem) -> Plan[StrategyT] | None:
        """What was decided for ``problem`` and why: ``auto``'s plan, or
        ``None`` for a configured strategy, which decides nothing."""
        ...
