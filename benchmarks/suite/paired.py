"""auto against a fixed strategy, timed in pairs: in alternating calls of one
process (:func:`paired_rounds`, the suite's ``paired`` and ``overhead``
figures), and first calls alone (:func:`first_call_s`), which the runner
alternates in fresh processes.
"""

from __future__ import annotations

import functools
import statistics
import time
from dataclasses import asdict, dataclass
from typing import Any

from jacobkit import engine, planner, strategies
from jacobkit.problem import Problem


@dataclass(frozen=True)
class Paired:
    """``auto`` against one fixed strategy in alternating calls of one
    process (both already traced): a ratio free of the process-to-process
    noise of separate measurements (up to 1.3x on 2 shared CPU cores).

    Attributes:
        strategy: the fixed strategy's label.
        rounds: alternating pairs of calls timed.
        auto_s: median time of auto's calls.
        fixed_s: median time of the fixed strategy's calls.
        ratio: ``auto_s / fixed_s`` (below 1: auto faster).
        auto_times_s, fixed_times_s: the timed calls, pair by pair, for the
            confidence interval and signed-rank test of
            :mod:`jacobkit.bench.stats`.
    """

    strategy: str
    rounds: int
    auto_s: float
    fixed_s: float
    ratio: float
    auto_times_s: tuple[float, ...] = ()
    fixed_times_s: tuple[float, ...] = ()

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def paired_rounds(
    problem: Problem,
    fixed: strategies.Strategy,
    *,
    rounds: int = 5,
    device: str | None = None,
) -> Paired:
    """Time ``auto`` (as :func:`measure_auto` left it) and ``fixed`` in
    ``rounds`` alternating pairs of calls, after one untimed call of
    ``fixed`` (its tracing); the order within a pair alternates too."""
    calls = {
        "auto": functools.partial(engine.run, problem, planner.Auto(device=device)),
        "fixed": functools.partial(engine.run, problem, fixed),
    }
    calls["fixed"]()
    times: dict[str, list[float]] = {"auto": [], "fixed": []}
    for i in range(rounds):
        for name in ("auto", "fixed") if i % 2 == 0 else ("fixed", "auto"):
            start = time.perf_counter()
            calls[name]()
            times[name].append(time.perf_counter() - start)
    auto_s, fixed_s = (statistics.median(times[k]) for k in ("auto", "fixed"))
    return Paired(
        fixed.label,
        rounds,
        auto_s,
        fixed_s,
        auto_s / fixed_s,
        tuple(times["auto"]),
        tuple(times["fixed"]),
    )


def first_call_s(
    problem: Problem,
    strategy: strategies.Strategy | None = None,
    *,
    device: str | None = None,
) -> float:
    """Seconds of one call of ``strategy`` (``None``: auto, with the plan
    cache ``$JACOBKIT_CACHE_DIR`` holds) on ``problem``: the first call of a
    fresh process, tracing and planning included."""
    start = time.perf_counter()
    engine.run(problem, planner.Auto(device=device) if strategy is None else strategy)
    return time.perf_counter() - start
