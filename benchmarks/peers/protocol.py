"""How every run of the MLP benchmark is timed, the same for jacobkit,
TensorFlow, PyTorch and JAX: the first call (tracing included) and its
resident-memory growth, the first 3 calls, then (once ``settled()``: ``auto``
tries its other candidates on its first calls; at most 40 calls) the median
of ``repeats`` steady calls, and last one more call's peak resident growth
with the previous result freed (:mod:`memory`).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

import numpy as np
from memory import PeakRss


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
    for _ in range(40):
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
