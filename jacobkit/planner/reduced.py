"""``auto`` for a reduced call (``reduce="norm"``, ``jk.ClippedSum``,
``jk.Project``): which strategy, and how many rows at once, fit the budget.

A reduced call never holds its rows' Jacobians: its result is a norm or a
projection per row, or one sum in each target's shape. The candidates are
``batch``'s closed forms where every target has one (rows of one example run
as one backward pass per row of each example: ``num_rows / B`` passes), then
``chunked`` with fewer and fewer rows at once, or where
pfor cannot run (a depthwise convolution's gradient, float16 rows)
``while(1)``, one row at a time. The first
whose peak, predicted from the memory prior a session uses
(:func:`jacobkit.planner.estimates.predicted_peak`, with the reduced result
in place of the Jacobians), fits the budget runs. Where the device reports
its peak, each call measures it; a run over the budget scales every
candidate's prediction by the measured / predicted ratio and later calls run
the first that then fits (a :class:`~jacobkit.planner.BudgetWarning`,
once). Measured, why: on an LSTM the prior predicted ``chunked(16)`` at 2.5
MiB and its run took 24 MiB (pfor over the recurrent loop keeps every
step's tensors per row).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from jacobkit import memory
from jacobkit.planner import estimates
from jacobkit.planner.footprint import Overruns
from jacobkit.planner.opening import memory_prior
from jacobkit.planner.policy import Policy
from jacobkit.planner.probes import peak_measurable
from jacobkit.problem import Problem
from jacobkit.problem.plan import Estimate, Plan, Rejection
from jacobkit.problem.solution import Solution
from jacobkit.strategies import REGISTRY, Strategy


def result_bytes(problem: Problem) -> int:
    """Bytes of a reduced call's result."""
    return problem.reduction.result_bytes(problem)


@dataclass(frozen=True)
class Candidate:
    """One strategy a reduced call may run, and its predicted peak."""

    strategy: Strategy
    predicted_bytes: int


class Reduced:
    """The plan of one reduced problem under one configuration, kept across
    calls: the candidates, which one runs, and what was measured.

    Raises (at construction):
        ValueError: an explicit ``memory_budget`` that no candidate fits.
    """

    def __init__(
        self,
        problem: Problem,
        memory_budget: int | float | str | None,
        device: str,
        policy: Policy,
    ) -> None:
        self.budget = memory.parse_budget(memory_budget, device=device)
        self.allowed = self.budget * policy.safety
        self.device = device if peak_measurable(device) else None
        self.num_rows = problem.num_rows
        self.result_bytes = result_bytes(problem)
        self.rejected: list[Rejection] = []
        self.candidates = self._candidates(problem)
        #: measured / predicted peak of the runs so far (1 before any)
        self.scale = 1.0
        self.peak: int | None = None
        self._overruns = Overruns(self.budget, policy.backoff_gain)
        fitting = self._first_fitting()
        if fitting is None:
            if memory_budget is not None:
                raise ValueError(self._refusal(problem, policy))
            fitting = 0  # the default budget: run the first candidate
        self.index = fitting

    def _candidates(self, problem: Problem) -> list[Candidate]:
        """Every registered strategy's configurations for a reduced call
        (:meth:`~jacobkit.strategies.base.Strategy.for_reduced`), in order of
        preference, less those that refuse the problem."""
        prior = memory_prior(problem, problem.activation_bytes, self.device)
        found: list[tuple[Strategy, int]] = []
        ordered = sorted(REGISTRY.values(), key=lambda cls: cls.reduced_preference)
        for cls in ordered:
            configs = cls.for_reduced(problem)
            if not configs:
                continue
            try:
                configs[0].check(problem)
            except ValueError as err:
                self.rejected.append(Rejection(cls.name, str(err)))
                continue
            found += [(s, s.passes(problem)) for s in configs]
        return [
            Candidate(s, estimates.predicted_peak(s, rows, prior, self.result_bytes))
            for s, rows in found
        ]

    def _first_fitting(self, after: int = -1) -> int | None:
        for i, c in enumerate(self.candidates):
            if i > after and c.predicted_bytes * self.scale <= self.allowed:
                return i
        return None

    def _refusal(self, problem: Problem, policy: Policy) -> str:
        least = min(c.predicted_bytes for c in self.candidates)
        return (
            f"jacobian(reduce={problem.reduce!r}, memory_budget="
            f"{memory.format_bytes(self.budget)}): even one row at a time needs "
            f"about {memory.format_bytes(least)} (estimated from the traced "
            f"pass's tensors), more than the {memory.format_bytes(int(self.allowed))} "
            f"({policy.safety:.0%} of the budget) a plan may use. Raise "
            "memory_budget, or use a smaller batch."
        )

    @property
    def strategy(self) -> Strategy:
        return self.candidates[self.index].strategy

    def solve(self, problem: Problem) -> Solution:
        """One call by the current candidate, its peak measured where the
        device reports it; a run over the budget moves later calls to the
        first candidate that fits the corrected predictions."""
        ran = self.candidates[self.index]
        if self.device is None:
            solved = ran.strategy.solve(problem)
        else:
            with memory.PeakMemory(self.device) as measured:
                solved = ran.strategy.solve(problem)
            peak = self.peak = int(measured.extra_bytes or 0)
            if peak > self.allowed:
                self._back_off(ran, peak)
        return replace(solved, plan=self.plan())

    def _back_off(self, ran: Candidate, peak: int) -> None:
        self.scale = max(self.scale, peak / max(ran.predicted_bytes, 1))
        following = self._first_fitting(after=self.index)
        last = len(self.candidates) - 1
        if following is None and self.index < last:
            following = last  # none fits: the least at once
        if following is None:
            self._overruns.not_held(ran.strategy, peak)
            return
        what = (
            f"measured {memory.format_bytes(peak)}, over "
            f"{memory.format_bytes(int(self.allowed))}"
        )
        self.index = following
        self._overruns.backed_off(ran.strategy, what, peak, self.strategy)

    def plan(self) -> Plan:
        """What runs next, with every candidate's prediction."""
        chosen = self.candidates[self.index]
        allowed = memory.format_bytes(int(self.allowed))
        skipped = [
            Rejection(
                c.strategy,
                f"predicted peak {_scaled(c.predicted_bytes, self.scale)} over the "
                f"{allowed} a plan may use",
                memory=True,
            )
            for c in self.candidates[: self.index]
        ]
        return Plan(
            chosen.strategy,
            self.budget,
            self.result_bytes,
            self.num_rows,
            predicted_peak_bytes=int(chosen.predicted_bytes * self.scale),
            estimates=(
                Estimate(
                    chosen.strategy, None, None, self.peak, chosen.predicted_bytes
                ),
            ),
            rejected=(*self.rejected, *skipped),
            source="predicted" if self.peak is None else "measured",
        )


def _scaled(predicted: int, scale: float) -> str:
    return memory.format_bytes(int(predicted * scale))
