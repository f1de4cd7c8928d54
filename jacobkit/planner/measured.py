"""What a session measured of each strategy on its problem: the newest runs
(:class:`~jacobkit.planner.plan.Probe`), what the disk cache knew before
them, and the :class:`~jacobkit.planner.plan.Estimate` they add up to."""

from __future__ import annotations

from dataclasses import replace

from jacobkit.planner import estimates as est
from jacobkit.planner.footprint import Footprint
from jacobkit.planner.plan import Estimate, Probe
from jacobkit.planner.policy import Policy
from jacobkit.strategies import Strategy


class Measurements:
    """The runs of one problem's strategies, and what they say.

    Args:
        policy: how many runs are kept and how many make a rate.
        footprint: the predicted peaks an estimate carries beside its
            measured one.
    """

    def __init__(self, policy: Policy, footprint: Footprint) -> None:
        self._policy = policy
        self._footprint = footprint
        self._probes: list[Probe] = []
        self._known: dict[Strategy, Estimate] = {}

    @property
    def probes(self) -> tuple[Probe, ...]:
        """The runs kept, oldest first."""
        return tuple(self._probes)

    def ran(self, strategy: Strategy) -> bool:
        """Whether ``strategy`` ran in this process."""
        return any(p.strategy == strategy for p in self._probes)

    def timed_runs(self, strategy: Strategy) -> int:
        """Runs of ``strategy`` that did not trace (its rate's evidence)."""
        return sum(p.strategy == strategy and not p.traced for p in self._probes)

    def add(self, probe: Probe) -> None:
        """Keep a run (of each strategy the traced one and the newest)."""
        self._probes.append(probe)
        mine = [p for p in self._probes if p.strategy == probe.strategy]
        if len(mine) > self._policy.kept_probes:
            old = next(p for p in mine if not p.traced)
            self._probes.remove(old)

    def know(self, estimates: tuple[Estimate, ...]) -> None:
        """What an earlier process measured (the disk cache), until runs here
        measure it again; ``()`` forgets it."""
        self._known = {e.strategy: e for e in estimates}

    def earlier(self, strategy: Strategy) -> Estimate | None:
        """What an earlier process measured of ``strategy``, if anything."""
        return self._known.get(strategy)

    def estimate(self, strategy: Strategy) -> Estimate | None:
        """What is known of ``strategy`` (``None`` if nothing)."""
        earlier = self._known.get(strategy)
        if not self.ran(strategy):
            return earlier
        found = est.estimate(strategy, self._probes, earlier, self._policy.rate_runs)
        peak = self._footprint.predicted_peak(strategy)
        return replace(found, predicted_peak_bytes=peak)

    def estimates(self) -> tuple[Estimate, ...]:
        """What is known of every strategy that ran or was known, by label."""
        ran = {p.strategy for p in self._probes} | set(self._known)
        found = [e for s in ran if (e := self.estimate(s)) is not None]
        return tuple(sorted(found, key=lambda e: e.strategy.label))
