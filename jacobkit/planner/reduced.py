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

Where the first that fits is not ``batch``'s closed forms of every target
(one backward pass per row of an example, against one per row: never
timed), the prior is unsure of the speed: the calls then time it against
the next fitting candidate of another strategy (``grouped`` against
``chunked``, ``chunked`` against ``while(1)``) on their steady calls
(:mod:`jacobkit.planner.paired`: the first call runs the first as before,
the third traces the other), and keep the faster from the seventh call on.
A run over the budget ends the trial. The plan lists the other as pending
(not :attr:`~jacobkit.problem.plan.Plan.settled`) until then.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

from jacobkit import memory
from jacobkit.planner import estimates, paired
from jacobkit.planner.footprint import Overruns
from jacobkit.planner.opening import deciding_scratch, memory_prior
from jacobkit.planner.policy import Policy
from jacobkit.planner.probes import peak_measurable
from jacobkit.problem import Problem, measure_inspection
from jacobkit.problem.plan import Estimate, Plan, Rejection, Switch
from jacobkit.problem.solution import Solution
from jacobkit.strategies import REGISTRY, Strategy

#: a memory budget's share the first candidate's peak, predicted from a
#: problem's structural upper bounds (:mod:`jacobkit.problem.structural_inspect`),
#: may take; beyond it, the inspection is measured and the plan made again
ROOM = 0.5


@dataclass(frozen=True)
class Candidate:
    """One strategy a reduced call may run, and its predicted peak."""

    strategy: Strategy
    predicted_bytes: int
    #: its result's bytes (:func:`~jacobkit.planner.estimates.result_bytes`)
    result_bytes: int


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
        self.rejected: list[Rejection] = []
        self.candidates = self._candidates(problem)
        if memory_budget is not None and _tight(problem, self.candidates, self.allowed):
            self.rejected = []
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
        #: the candidate timed against :attr:`index` (``None``: none)
        self.other = self._other()
        # the other kept only where faster beyond jacobian's trials' noise
        self.trial = paired.Trial(noise=policy.noise)
        if self.other is None:
            self.trial.end()
        self.calls = 0
        self.switches: list[Switch[Strategy]] = []
        #: the last plan made and the state it was made from (:meth:`plan`)
        self._planned: tuple[tuple[Any, ...], Plan] | None = None

    def _candidates(self, problem: Problem) -> list[Candidate]:
        """Every registered strategy's configurations for a reduced call
        (:meth:`~jacobkit.strategies.base.Strategy.for_reduced`), in order of
        preference, less those that refuse the problem, each with its
        predicted peak (:meth:`_predicted`)."""
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
        return self._predicted(problem, found)

    def _predicted(
        self, problem: Problem, found: list[tuple[Strategy, int]]
    ) -> list[Candidate]:
        """``found``'s candidates with their predicted peaks. The kernels'
        scratch space is measured (:func:`jacobkit.planner.scratch.
        scratch_bytes`) only where it can change which fit: for the way
        a candidate's convolution gradients run (:attr:`~jacobkit.
        strategies.Strategy.convolution_gradients`; only the kinds whose
        TensorFlow kernels run that way, :func:`~jacobkit.planner.scratch.
        kinds_run`) where it fits without scratch but not with
        :data:`~jacobkit.planner.scratch.SCRATCH_BOUND` per backward pass in
        flight; elsewhere this CPU kind's prior is counted
        (:func:`~jacobkit.planner.scratch.prior_bytes`; a run over the
        budget scales the predictions, as for any error). The probe's own
        peak is the kernel's (32 MiB with oneDNN off): asked where nothing
        can change, it alone broke a 2 MiB budget the run kept.

        NOTE (measured, loaded). The probe took 0.14-0.58 s of the conv
        net's first clipped sum (plain step's: 0.48 s); its answer (9 KiB
        with oneDNN, 16-33 MiB without) changed nothing beside 14 GiB."""

        def predicted(
            per_pass: Callable[[str, frozenset[str]], int] | None,
        ) -> list[Candidate]:
            prior = memory_prior(
                problem, problem.activation_bytes, self.device, per_pass
            )
            return _with_peaks(problem, found, prior)

        return predicted(
            deciding_scratch(problem, self.device, self.allowed, predicted)
        )

    def _other(self) -> int | None:
        """The candidate to time against the first that fits: the next that
        fits of another strategy, where the first is not the closed forms
        of every target (``reduced_preference`` 0)."""
        first = self.candidates[self.index].strategy
        if first.reduced_preference == 0:
            return None
        for i in range(self.index + 1, len(self.candidates)):
            c = self.candidates[i]
            fits = c.predicted_bytes * self.scale <= self.allowed
            if fits and type(c.strategy) is not type(first):
                return i
        return None

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
        self.calls += 1
        way = self.trial.next()
        timed = self.other if way == paired.OTHER else self.index
        assert timed is not None, "an other way only where there is one"
        ran = self.candidates[timed]
        began = time.perf_counter()
        if self.device is None:
            solved = ran.strategy.solve(problem)
        else:
            with memory.PeakMemory(self.device) as measured:
                solved = ran.strategy.solve(problem)
            peak = self.peak = int(measured.extra_bytes or 0)
            if peak > self.allowed:
                self.trial.end()  # memory decides: the first that fits
                if timed == self.index:
                    self._back_off(ran, peak)
                else:
                    self.scale = max(self.scale, peak / max(ran.predicted_bytes, 1))
        self.trial.record(way, time.perf_counter() - began)
        if self.trial.kept == paired.OTHER and self.other is not None:
            self._switch()
        return replace(solved, plan=self.plan())

    def _switch(self) -> None:
        """The other candidate was faster: later calls run it."""
        assert self.other is not None
        was, now = self.candidates[self.index], self.candidates[self.other]
        self.switches.append(
            Switch(
                self.calls + 1,
                0,
                was.strategy,
                now.strategy,
                f"faster: {self._rates()}",
            )
        )
        self.index, self.other = self.other, None
        self.trial.end(paired.PRIOR)  # the one kept now runs as the first

    def _rates(self) -> str:
        """Each way's best timed call, the other's first."""
        best = {w: min(t) for w, t in self.trial.times.items() if t}
        return " vs ".join(
            f"{best[w] * 1e3:.3g} ms" for w in (paired.OTHER, paired.PRIOR) if w in best
        )

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
        """What runs next, with every candidate's prediction, the timed
        trial's rates, and what is still to be timed (``pending``).

        Made again only where what it reads changed since the last one
        (the candidate, the trial, the measured peak and scale, a switch or
        rejection); else the last one with this call's count (making it
        took 15-40 us of every steady call)."""
        state = (
            self.index,
            self.other,
            self.trial.kept,
            self.trial.calls,
            self.peak,
            self.scale,
            len(self.switches),
            len(self.rejected),
        )
        if self._planned is not None and self._planned[0] == state:
            return replace(self._planned[1], calls=self.calls)
        found = self._plan()
        self._planned = (state, found)
        return found

    def _plan(self) -> Plan:
        chosen = self.candidates[self.index]
        allowed = memory.format_bytes(int(self.allowed))
        skipped = [
            Rejection(
                c.strategy,
                f"predicted peak {_scaled(c.predicted_bytes, self.scale)} over the "
                f"{allowed} a plan may use",
                memory=True,
            )
            if c.predicted_bytes * self.scale > self.allowed
            else Rejection(c.strategy, self._lost(c))
            for c in self.candidates[: self.index]
        ]
        other = None if self.other is None else self.candidates[self.other]
        pending = () if other is None or self.trial.kept is not None else (other,)
        if (
            other is not None
            and self.trial.kept is not None
            and self.trial.times[paired.OTHER]
        ):
            skipped.append(
                Rejection(other.strategy, f"not faster when timed: {self._rates()}")
            )
        return Plan(
            chosen.strategy,
            self.budget,
            chosen.result_bytes,
            self.num_rows,
            predicted_time_s=self._best(chosen),
            predicted_peak_bytes=int(chosen.predicted_bytes * self.scale),
            estimates=tuple(
                Estimate(
                    c.strategy,
                    self._per_row(way),
                    None,
                    self.peak if c is chosen else None,
                    c.predicted_bytes,
                )
                for c, way in self._timed(chosen, other)
            ),
            pending=tuple(c.strategy for c in pending),
            rejected=(*self.rejected, *skipped),
            switches=tuple(self.switches),
            source="predicted" if self.peak is None else "measured",
            calls=self.calls,
        )

    def _lost(self, candidate: Candidate) -> str:
        """Why a candidate that fits runs no more: it lost the timed trial,
        or it is a configuration of that loser's with fewer rows at once."""
        loser = self.switches[0].old if self.switches else None
        if candidate.strategy == loser:
            return f"slower when timed: {self._rates()}"
        return f"not timed: {loser.label if loser else 'another'} was slower"

    def _timed(
        self, chosen: Candidate, other: Candidate | None
    ) -> list[tuple[Candidate, int]]:
        """The candidates with an estimate: the one that runs (the trial's
        prior, or the other once it won) and the one timed against it."""
        if self.switches:  # the other won: it is the chosen one
            return [(chosen, paired.OTHER)]
        found = [(chosen, paired.PRIOR)]
        if other is None or not self.trial.times[paired.OTHER]:
            return found
        return [*found, (other, paired.OTHER)]

    def _best(self, chosen: Candidate) -> float | None:
        """The chosen candidate's best timed call (seconds), if timed."""
        way = paired.OTHER if self.switches else paired.PRIOR
        times = self.trial.times[way]
        return min(times) if times else None

    def _per_row(self, way: int) -> float | None:
        times = self.trial.times[way]
        return min(times) / max(self.num_rows, 1) if times else None


def _with_peaks(
    problem: Problem, found: list[tuple[Strategy, int]], prior: Any
) -> list[Candidate]:
    """``found``'s candidates (each with its passes) and their peaks under
    ``prior``, each one's result as it computes it, with the kind's working
    bytes and the rows it forms on that strategy (:meth:`~jacobkit.
    strategies.Strategy.formed_bytes`)."""
    working = problem.reduction.working_bytes(problem)
    peaks = []
    for s, n in found:
        held = estimates.result_bytes(s, problem)
        formed = s.formed_bytes(problem)
        predicted = estimates.predicted_peak(s, n, prior, held, working + formed)
        peaks.append(Candidate(s, predicted, held))
    return peaks


def _scaled(predicted: int, scale: float) -> str:
    return memory.format_bytes(int(predicted * scale))


def _tight(problem: Problem, candidates: list[Candidate], allowed: float) -> bool:
    """Whether ``problem``'s inspection, read from its structure (upper
    bounds), leaves its first candidate's predicted peak over :data:`ROOM`
    of ``allowed``: then it is measured (:func:`jacobkit.problem.
    measure_inspection`), and the candidates must be predicted again."""
    if problem.inspection_measured:
        return False
    if candidates and candidates[0].predicted_bytes <= ROOM * allowed:
        return False
    measure_inspection(problem)
    return True
