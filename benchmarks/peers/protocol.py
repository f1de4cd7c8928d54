"""How every run of the MLP benchmark is timed, the same for jacobkit,
TensorFlow, PyTorch and JAX: the first call (tracing included) and its
resident-memory growth, the first 3 calls, then (once ``settled()``: ``auto``
tries its other candidates on its first calls; at most :data:`SETTLING_CALLS`
calls) the median of ``repeats`` steady calls, and last one more call's peak
resident growth with the previous result freed (:mod:`memory`).

Beside it, every paired measurement's pieces: :func:`rotated` (rounds that
time each side in turn, the order rotating), :func:`bootstrap` (the
interval of their median ratio) and :func:`paired` (a method against its
own plain step, both in one process).
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable
from typing import Any

import numpy as np
from memory import PeakRss

#: calls waited for ``settled()`` after the first 3. It was 40: on the MLP
#: without oneDNN ``auto`` keeps ``while(10)`` at call 20-23 and tries
#: ``chunked(144)`` some 20 calls later (call 42-44 measured), so its try (a
#: traced call and a timed one, each about twice ``while``'s) could fall
#: into the steady calls, which then were not steady
SETTLING_CALLS = 100


def measure(
    call: Callable[[], Any],
    repeats: int,
    settled: Callable[[], bool] = lambda: True,
) -> tuple[dict[str, float], Any]:
    """The timings of ``call`` and its last result."""
    rss = PeakRss()
    start = time.perf_counter()
    result = call()
    first_s = time.perf_counter() - start
    first_growth = rss.growth()
    first_three = first_s
    for _ in range(2):
        start = time.perf_counter()
        result = call()
        first_three += time.perf_counter() - start
    for _ in range(SETTLING_CALLS):
        if settled():
            break
        result = call()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        result = call()
        times.append(time.perf_counter() - start)
    del result
    rss = PeakRss()
    result = call()
    return {
        "first_s": first_s,
        "first_three_s": first_three,
        "steady_s": statistics.median(times),
        "first_growth_mib": first_growth,
        "peak_growth_mib": rss.growth(),
    }, result


def relative_error(got: Any, want: Any, script: str) -> float:
    """The largest absolute difference over the largest magnitude (``script``
    names the peer in the error for mismatched shapes)."""
    got = np.asarray(got, "float64")
    want = np.asarray(want, "float64")
    if got.shape != want.shape:
        raise SystemExit(f"{script}: shape {got.shape} != {want.shape}")
    return float(np.max(np.abs(got - want)) / np.max(np.abs(want)))


#: the least time each side of a paired round takes (more calls of a fast one)
MIN_SIDE_S = 0.05


def paired(
    call: Callable[[], Any],
    base: Callable[[], Any],
    rounds: int = 10,
    calls: int = 3,
    budget_s: float = 20.0,
) -> dict[str, float]:
    """``call``'s time over ``base``'s (the same framework's plain step) in
    one process: each round times ``calls`` calls of either side, the order
    alternating, and takes the ratio of their medians; the median ratio over
    the rounds and its 95% bootstrap interval (2,000 resamples, seeded). A
    busy machine slows both sides of a round alike, which ratios of runs in
    separate processes do not cancel. A side faster than
    :data:`MIN_SIDE_S` over ``calls`` calls takes more calls per round;
    fewer rounds (at least 5) where ``rounds`` would take more than
    ``budget_s`` at the warm-up's pace."""
    for side in (call, base):  # warm: first calls trace and settle
        for _ in range(2):
            side()
    paces = {}
    for name, side in (("call", call), ("base", base)):
        start = time.perf_counter()
        side()
        paces[name] = time.perf_counter() - start
    # a side of a few milliseconds takes more calls per round (each side's
    # round at least MIN_SIDE_S), so that one slow call on a busy machine
    # does not decide its median
    counts = {
        k: max(calls, math.ceil(MIN_SIDE_S / max(v, 1e-6))) for k, v in paces.items()
    }
    pace = sum(counts[k] * paces[k] for k in paces)
    rounds = max(5, min(rounds, int(budget_s / max(pace, 1e-9))))
    times = rotated({"call": call, "base": base}, rounds, counts)
    ours = [statistics.median(t) for t in times["call"]]
    theirs = [statistics.median(t) for t in times["base"]]
    ratios = [a / b for a, b in zip(ours, theirs)]
    low, high = bootstrap(ratios)
    return {
        "ratio": statistics.median(ratios),
        "low": low,
        "high": high,
        "rounds": rounds,
        "calls": counts["call"],
        "base_calls": counts["base"],
        "call_ms": 1e3 * statistics.median(ours),
        "base_ms": 1e3 * statistics.median(theirs),
    }


def rotated(
    sides: dict[str, Callable[[], Any]], rounds: int, calls: int | dict[str, int]
) -> dict[str, list[list[float]]]:
    """``rounds`` rounds, each timing ``calls`` calls (per side, where a
    dict) of every side in turn, the order rotating by one side a round
    (two sides: alternating), so that a busy spell slows every side alike
    over the rounds: each side's call times (s), one list per round."""
    names = list(sides)
    times: dict[str, list[list[float]]] = {name: [] for name in names}
    for round_ in range(rounds):
        shift = round_ % len(names)
        for name in names[shift:] + names[:shift]:
            count = calls[name] if isinstance(calls, dict) else calls
            times[name].append([timed(sides[name]) for _ in range(count)])
    return times


def timed(call: Callable[[], Any]) -> float:
    """One call's time (s), its result dropped."""
    start = time.perf_counter()
    call()
    return time.perf_counter() - start


def bootstrap(ratios: list[float]) -> tuple[float, float]:
    """The 95% bootstrap interval of the median of ``ratios`` (2,000
    resamples, seeded: the same ratios give the same interval)."""
    rng = np.random.default_rng(0)
    samples = np.median(rng.choice(ratios, (2000, len(ratios))), axis=1)
    return float(np.quantile(samples, 0.025)), float(np.quantile(samples, 0.975))
