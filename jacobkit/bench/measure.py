"""Run strategies on one problem and measure them: time, peak memory, agreement.

Used by ``jacobkit compare``, the benchmark runner and the notebooks.
"""

from __future__ import annotations

import functools
import statistics
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, replace
from typing import Any

import tensorflow as tf

from jacobkit import engine, memory, planner, strategies
from jacobkit.bench import stats
from jacobkit.bench.candidates import default_strategies
from jacobkit.bench.resident import resident_bytes
from jacobkit.problem import Problem
from jacobkit.testing.reference import max_relative_difference


@dataclass(frozen=True)
class PeakPrediction:
    """What ``auto`` predicted of one strategy's peak before it ran (its
    memory prior), beside the peak it measured running it.

    Attributes:
        strategy: the configured strategy's label.
        predicted_bytes: the prior's peak (``None``: not predicted).
        measured_bytes: the highest measured peak of its runs (``None``: not
            measured on this device).
    """

    strategy: str
    predicted_bytes: int | None
    measured_bytes: int | None


@dataclass(frozen=True)
class Measurement:
    """One strategy (or ``auto``) on one problem.

    Attributes:
        strategy: the strategy's label (``"chunked(8)"``; ``"auto: while"``
            names what auto settled on).
        name: the registered name, or ``"auto"``.
        chunk_size: rows (or tangents) per vectorized pass, if chunked.
        first_call_s: the first call, tracing (and auto's planning) included.
        first_3_calls_s: the first three calls together.
        steady_s: median of the timed calls after the first three (for auto,
            after it settled, or after :data:`SETTLE_CALLS` calls).
        spread_s: (max - min) of the timed calls.
        steady_times_s: the timed calls themselves, for the confidence
            intervals and rank tests of :mod:`jacobkit.bench.stats`.
        peak_bytes: peak device memory above the baseline during a steady call
            (``None`` where the device reports no statistics).
        growth_bytes: growth of the process's resident memory from before the
            first call to after the last, each result dropped before the next
            call (``del res``): what the calls themselves leave the process
            holding (the allocator keeps what it took), to compare with
            ``peak_bytes``, which excludes results held across the call
            (``None`` where the system does not report it).
        held_growth_bytes: the same growth after ``held_calls`` more calls,
            each made while the previous result is still held, as a loop of
            ``res = jacobian(...)`` holds it: two results are alive during
            each of those calls (``None`` unless asked for).
        max_rel_diff: :func:`jacobkit.testing.max_relative_difference` to the
            reference, the largest over targets.
        error: ``"ExceptionName: message"`` if the strategy failed.
        plan: for auto, ``str(result.plan)`` after the last timed call: what
            it ran, measured, tried and switched.
        ran_spec: for auto, the strategy it settled on
            (:func:`jacobkit.strategies.to_spec`), to time it fixed beside.
        peaks: for auto, each strategy it ran: its prior's predicted peak and
            the peak it measured.
    """

    strategy: str
    name: str
    chunk_size: int | None
    first_call_s: float | None = None
    first_3_calls_s: float | None = None
    steady_s: float | None = None
    spread_s: float | None = None
    steady_times_s: tuple[float, ...] | None = None
    peak_bytes: int | None = None
    growth_bytes: int | None = None
    held_growth_bytes: int | None = None
    max_rel_diff: float | None = None
    error: str | None = None
    plan: str | None = None
    ran_spec: dict[str, Any] | None = None
    peaks: tuple[PeakPrediction, ...] = ()

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Measurement:
        """The measurement :meth:`as_dict` gave, back from its JSON (other
        keys ignored)."""
        known = {k: v for k, v in data.items() if k in cls.__dataclass_fields__}
        if known.get("steady_times_s") is not None:
            known["steady_times_s"] = tuple(known["steady_times_s"])
        known["peaks"] = tuple(PeakPrediction(**p) for p in known.get("peaks") or ())
        return cls(**known)


#: auto's calls before its steady calls are timed, at most (it usually
#: settles sooner: every candidate tried, or none worth its tracing)
SETTLE_CALLS = 40


def measure(
    problem: Problem,
    strategy: strategies.Strategy,
    reference: Sequence[Any] | None = None,
    *,
    repeats: int = 3,
    device: str | None = None,
    held_calls: int = 0,
) -> Measurement:
    """Time ``strategy`` on ``problem`` (the first call, the first three, then
    ``repeats`` steady calls), measure the peak memory of one steady call and
    the process's memory growth (also with a result held across
    ``held_calls`` more calls, if any), and compare with ``reference``. A
    failure is recorded, not raised."""
    base = Measurement(strategy.label, strategy.name, strategy.chunk_size)
    return measure_calls(
        base,
        functools.partial(engine.run, problem, strategy),
        reference,
        repeats=repeats,
        device=device,
        held_calls=held_calls,
    )


def measure_auto(
    problem: Problem,
    reference: Sequence[Any] | None = None,
    *,
    repeats: int = 3,
    device: str | None = None,
    memory_budget: int | float | str | None = None,
    cache: bool = True,
    held_calls: int = 0,
) -> Measurement:
    """``strategy="auto"`` measured like :func:`measure` (its first call
    includes whatever planning it does), with the calls until it settles not
    timed. The label names what it settled on (``"auto: while(parallel=10)"``).
    """
    call = functools.partial(
        engine.run, problem, planner.Auto(memory_budget, device, cache)
    )
    return measure_calls(
        Measurement("auto", "auto", None),
        call,
        reference,
        repeats=repeats,
        device=device,
        settled=lambda result: result.plan.settled,
        held_calls=held_calls,
    )


def measure_calls(
    base: Measurement,
    call: Callable[[], Any],
    reference: Sequence[Any] | None = None,
    *,
    repeats: int = 3,
    device: str | None = None,
    settled: Callable[[Any], bool] | None = None,
    held_calls: int = 0,
) -> Measurement:
    """The one measuring path: ``call()`` (a ``JacobianResult``) three times
    (first call, first three calls), until ``settled(result)`` (at most
    :data:`SETTLE_CALLS` calls), ``repeats`` timed steady calls, and one with
    its peak measured, each result dropped before the next call (see
    ``Measurement.growth_bytes``); then ``held_calls`` calls holding the
    previous result. For auto, ``base`` is relabelled with what it ran last.
    """
    try:
        resident = resident_bytes()
        times = []
        diff = None
        for i in range(3):
            result = None  # the caller's ``del res``: no result held across
            start = time.perf_counter()
            result = call()
            times.append(time.perf_counter() - start)
            if i == 0 and reference is not None:
                diff = max(
                    max_relative_difference(a, e)
                    for a, e in zip(result.jacobians.values(), reference, strict=True)
                )
        calls = 3
        while settled is not None and not settled(result) and calls < SETTLE_CALLS:
            result = None
            result = call()
            calls += 1
        steady = []
        for _ in range(repeats):
            result = None
            start = time.perf_counter()
            result = call()
            steady.append(time.perf_counter() - start)
        assert result is not None, "repeats >= 1"
        ran = result.strategy_config
        plan = result.plan if base.name == "auto" else None
        result = None
        peak = _steady_peak(call, device)
        after = resident_bytes()
        for _ in range(held_calls):
            result = call()  # the previous result is alive during this call
        held = resident_bytes() if held_calls else None
    except _FAILURES as err:
        return _failed(base, err)
    if base.name == "auto":
        assert plan is not None, "auto returns its plan"
        base = Measurement(
            f"auto: {ran.label}",
            "auto",
            ran.chunk_size,
            plan=str(plan),
            ran_spec=strategies.to_spec(ran),
            peaks=tuple(
                PeakPrediction(e.strategy.label, e.predicted_peak_bytes, e.peak_bytes)
                for e in plan.estimates
            ),
        )
    growth = None if resident is None or after is None else max(after - resident, 0)
    held_growth = None if resident is None or held is None else max(held - resident, 0)
    return replace(
        base,
        first_call_s=times[0],
        first_3_calls_s=sum(times),
        steady_s=statistics.median(steady) if steady else times[-1],
        spread_s=(max(steady) - min(steady)) if steady else 0.0,
        steady_times_s=tuple(steady) if steady else (times[-1],),
        peak_bytes=peak,
        growth_bytes=growth,
        held_growth_bytes=held_growth,
        max_rel_diff=diff,
    )


#: what a measurement records as a failure instead of raising
_FAILURES = (tf.errors.OpError, ValueError, TypeError, MemoryError)


def _failed(base: Measurement, err: Exception) -> Measurement:
    """``base`` with ``error="ExceptionName: first line of the message"``."""
    message = str(err).strip().splitlines()[0] if str(err).strip() else ""
    return replace(base, error=f"{type(err).__name__}: {message}"[:300])


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
    candidates = list(candidates or default_strategies(problem)[0])
    results = []
    for strategy in candidates:
        if progress:
            progress(strategy.label)
        results.append(
            measure(problem, strategy, reference, repeats=repeats, device=device)
        )
    return results


def format_table(measurements: Sequence[Measurement]) -> str:
    """A Markdown table of measurements, with times as ratios to ``loop``:
    the ratio of median steady times, its 95% bootstrap interval and the
    one-sided Mann-Whitney p-value that the row's calls are faster than the
    loop's (:mod:`jacobkit.bench.stats`)."""
    loop = next((m for m in measurements if m.name == "loop" and m.steady_s), None)
    lines = [
        "| strategy | first call (s) | first 3 calls (s) | steady (s) | vs loop "
        "| vs loop, 95% CI | faster than loop (rank test) "
        "| peak memory | process growth | max rel. diff |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for m in measurements:
        if m.error:
            lines.append(f"| {m.strategy} | failed: {m.error[:60]} | | | | | | | | |")
            continue
        ratio = (
            f"{loop.steady_s / m.steady_s:.1f}x"
            if loop and loop.steady_s and m.steady_s
            else ""
        )
        interval, p_value = _against(loop, m)
        peak = memory.format_bytes(m.peak_bytes) if m.peak_bytes is not None else "n/a"
        growth = (
            memory.format_bytes(m.growth_bytes) if m.growth_bytes is not None else "n/a"
        )
        diff = f"{m.max_rel_diff:.1e}" if m.max_rel_diff is not None else ""
        lines.append(
            f"| {m.strategy} | {m.first_call_s:.3f} | {m.first_3_calls_s:.3f} "
            f"| {m.steady_s:.4f} | {ratio} | {interval} | {p_value} "
            f"| {peak} | {growth} | {diff} |"
        )
    return "\n".join(lines)


def _against(baseline: Measurement | None, m: Measurement) -> tuple[str, str]:
    """The interval and p-value cells of ``m``'s steady calls against
    ``baseline``'s (empty for the baseline itself, or without times)."""
    if baseline is None or baseline is m:
        return "", ""
    if not (baseline.steady_times_s and m.steady_times_s):
        return "", ""
    found = stats.speedup(baseline.steady_times_s, m.steady_times_s)
    return stats.interval_text(found.low, found.high), stats.p_text(found.p_value)
