"""``auto``: choose a strategy and chunk size for a problem."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from jacobkit import strategies
from jacobkit.problem import Problem


@dataclass(frozen=True)
class Plan:
    """What ``auto`` chose, and why.

    Attributes:
        strategy: the configured strategy to run.
        predicted_peak_bytes: predicted peak memory of the run, if estimated.
        predicted_time_s: predicted steady-state time, if estimated.
        rejected: ``(label, reason)`` for each candidate not chosen.
    """

    strategy: strategies.Strategy
    predicted_peak_bytes: int | None = None
    predicted_time_s: float | None = None
    rejected: list[tuple[str, str]] = field(default_factory=list)


def plan_problem(
    problem: Problem, *, memory_budget: Any = None, device: str | None = None
) -> Plan:
    """A simple rule: vectorized chunks of up to 32 rows."""
    return Plan(strategies.Chunked(chunk_size=min(32, problem.num_rows)))
