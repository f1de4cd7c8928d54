"""Run strategies on one problem and measure them: time, peak memory, agreement.

Used by ``jacobkit compare``, the benchmark runner and the notebooks.
"""

from __future__ import annotations

import functools
import statistics
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import tensorflow as tf

from jacobkit import memory, strategies, testing
from jacobkit.api import run_auto, run_strategy
from jacobkit.problem import Problem


@dataclass(frozen=True)
class Measurement:
    """One strategy on one problem.

    Attributes:
        strategy: the strategy's label (``"chunked(8)"``).
        name: the registered name.
        chunk_size: rows (or tangents) per vectorized pass, if chunked.
        first_call_s: the first call, tracing included.
        steady_s: median of the timed calls after the first.
        spread_s: (max - min) of the timed calls.
        peak_bytes: peak device memory above the baseline during a steady call
            (``None`` where the device reports no statistics).
        max_rel_diff: :func:`jacobkit.testing.max_relative_difference` to the
            reference, the largest over targets.
        error: ``"ExceptionName: message"`` if the strategy failed.
    """

    strategy: str
    name: str
    chunk_size: int | None
    first_call_s: float | None = None
    steady_s: float | None = None
    spread_s: float | None = None
    peak_bytes: int | None = None
    max_rel_diff: float | None = None
    error: str | None = None

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def default_strategies(num_rows: int) -> list[strategies.Strategy]:
    """Every registered strategy, and ``chunked`` at a few chunk sizes."""
    chosen = [cls() for name, cls in strategies.REGISTRY.items() if name != "chunked"]
    sizes = sorted({min(c, num_rows) for c in (1, 8, 32, num_rows)})
    return chosen + [strategies.Chunked(c) for c in sizes]


def measure(
    problem: Problem,
    strategy: strategies.Strategy,
    reference: Sequence[Any] | None = None,
    *,
    repeats: int = 3,
    device: str | None = None,
) -> Measurement:
    """Time ``strategy`` on ``problem`` (first call, then ``repeats`` steady
    calls), measure the peak memory of one steady call, and compare with
    ``reference``. A failure is recorded, not raised."""
    base = Measurement(strategy.label, strategy.name, strategy.chunk_size)
    try:
        start = time.perf_counter()
        first = run_strategy(problem, strategy)
        first_call = time.perf_counter() - start
        times = []
        for _ in range(repeats):
            times.append(run_strategy(problem, strategy).stats.wall_time_s)
        peak = _steady_peak(lambda: run_strategy(problem, strategy), device)
    except _FAILURES as err:
        return _failed(base, err)
    return _measured(base, first, first_call, times, peak, reference)


def measure_auto(
    problem: Problem,
    reference: Sequence[Any] | None = None,
    *,
    repeats: int = 3,
    device: str | None = None,
    memory_budget: int | float | str | None = None,
) -> Measurement:
    """``strategy="auto"`` measured like :func:`measure`: the first call
    (planning probes and compiling included), then the calls while it races
    its shortlist (not timed), then ``repeats`` steady calls. The label names
    what it settled on (``"auto: while(parallel=10)"``)."""
    call = functools.partial(
        run_auto, problem, memory_budget=memory_budget, device=device
    )
    try:
        start = time.perf_counter()
        first = call()
        first_call = time.perf_counter() - start
        race = first.plan.race
        while race is not None and race.winner is None:
            call()
        times = [call().stats.wall_time_s for _ in range(repeats)]
        peak = _steady_peak(call, device)
    except _FAILURES as err:
        return _failed(Measurement("auto", "auto", None), err)
    settled = race.winner if race is not None else first.plan.strategy
    base = Measurement(f"auto: {settled.label}", "auto", settled.chunk_size)
    return _measured(base, first, first_call, times, peak, reference)


#: what a measurement records as a failure instead of raising
_FAILURES = (tf.errors.OpError, ValueError, TypeError, MemoryError)


def _failed(base: Measurement, err: Exception) -> Measurement:
    """``base`` with ``error="ExceptionName: first line of the message"``."""
    message = str(err).strip().splitlines()[0] if str(err).strip() else ""
    return Measurement(
        **{**base.as_dict(), "error": f"{type(err).__name__}: {message}"[:300]}
    )


def _measured(
    base: Measurement,
    first: Any,
    first_call: float,
    times: list[float],
    peak: int | None,
    reference: Sequence[Any] | None,
) -> Measurement:
    diff = None
    if reference is not None:
        diff = max(
            testing.max_relative_difference(a, e)
            for a, e in zip(first.jacobians.values(), reference, strict=True)
        )
    return Measurement(
        **{
            **base.as_dict(),
            "first_call_s": first_call,
            "steady_s": statistics.median(times) if times else first_call,
            "spread_s": (max(times) - min(times)) if times else 0.0,
            "peak_bytes": peak,
            "max_rel_diff": diff,
        }
    )


def _steady_peak(call: Callable[[], Any], device) -> int | None:
    try:
        with memory.PeakMemory(device or "CPU:0") as peak:
            call()
    except RuntimeError:  # the device keeps no allocator statistics
        return None
    return peak.extra_bytes


def compare(
    problem: Problem,
    candidates: Iterable[strategies.Strategy] | None = None,
    reference: Sequence[Any] | None = None,
    *,
    repeats: int = 3,
    device: str | None = None,
    progress: Callable[[str], None] | None = None,
) -> list[Measurement]:
    """Measure each candidate (default: :func:`default_strategies`)."""
    candidates = list(candidates or default_strategies(problem.num_rows))
    results = []
    for strategy in candidates:
        if progress:
            progress(strategy.label)
        results.append(
            measure(problem, strategy, reference, repeats=repeats, device=device)
        )
    return results


def format_table(measurements: Sequence[Measurement]) -> str:
    """A Markdown table of measurements, with times as ratios to ``loop``."""
    loop = next((m for m in measurements if m.name == "loop" and m.steady_s), None)
    lines = [
        "| strategy | first call (s) | steady (s) | vs loop | peak memory "
        "| max rel. diff |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for m in measurements:
        if m.error:
            lines.append(f"| {m.strategy} | failed: {m.error[:60]} | | | | |")
            continue
        ratio = f"{loop.steady_s / m.steady_s:.1f}x" if loop else ""
        peak = memory.format_bytes(m.peak_bytes) if m.peak_bytes is not None else "n/a"
        diff = f"{m.max_rel_diff:.1e}" if m.max_rel_diff is not None else ""
        lines.append(
            f"| {m.strategy} | {m.first_call_s:.3f} | {m.steady_s:.4f} | {ratio} "
            f"| {peak} | {diff} |"
        )
    return "\n".join(lines)
