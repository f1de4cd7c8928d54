"""The statistics behind every "faster" in the reports of ``jacobkit compare``
and of the benchmark suite (``benchmarks/suite``): a bootstrap confidence
interval for the ratio of median times, and a rank test of whether one
strategy's calls are faster.

Times of calls on a shared machine are skewed and few (3 to 5 per strategy),
so nothing here assumes a normal distribution:

- :func:`speedup`: ``median(baseline) / median(candidate)`` (above 1: the
  candidate is faster), its percentile bootstrap interval
  (:func:`scipy.stats.bootstrap`, a fixed seed, so a report redrawn from the
  same times reads the same), and the one-sided p-value of a rank test that
  the candidate's calls take less time: Mann-Whitney U for calls timed
  independently (:func:`scipy.stats.mannwhitneyu`), the Wilcoxon signed-rank
  test for calls timed in pairs (:func:`scipy.stats.wilcoxon`).
- :func:`ratios` does the same for a list of per-round ratios (first calls
  paired in fresh processes): the median ratio, its interval and the
  two-sided signed-rank p-value of the log ratios against 0 (a ratio of 1).

With few calls the exact tests cannot give small p-values: 3 calls against 3
give at best p = 0.05 (1 in the 20 ways to split 6 ranks), 5 paired rounds at
best p = 1/32 one-sided. A report prints the p-value beside the ratio, so a
speed-up measured on too few calls to support it reads as such.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

#: the interval's confidence level
CONFIDENCE = 0.95
#: bootstrap resamples (the interval's end points move by well under 1% of
#: the ratio between seeds at this count)
RESAMPLES = 9999
#: the bootstrap's seed: the same times always give the same interval
SEED = 0
#: below this p-value a report may call a difference significant
ALPHA = 0.05


@dataclass(frozen=True)
class Speedup:
    """One strategy's times against a baseline's.

    Attributes:
        ratio: ``median(baseline) / median(candidate)`` (above 1: faster).
        low, high: the bootstrap confidence interval of ``ratio`` (``None``
            with fewer than 2 times on either side).
        p_value: one-sided p-value of the rank test that the candidate's
            calls take less time than the baseline's, or two-sided where
            asked for (``None`` with fewer than 2 times on either side).
        test: ``"Mann-Whitney U"`` or ``"Wilcoxon signed-rank"``.
        n_baseline, n_candidate: how many times each side had.
    """

    ratio: float
    low: float | None
    high: float | None
    p_value: float | None
    test: str
    n_baseline: int
    n_candidate: int

    @property
    def significant(self) -> bool:
        """The rank test says faster at :data:`ALPHA`."""
        return self.p_value is not None and self.p_value < ALPHA

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class Ratios:
    """Per-round ratios (candidate / baseline, below 1: the candidate faster).

    Attributes:
        median: the median ratio.
        low, high: its bootstrap confidence interval (``None`` with fewer
            than 2 ratios).
        p_value: two-sided p-value of the Wilcoxon signed-rank test of the
            log ratios against 0 (``None`` with fewer than 2 ratios).
        n: how many ratios.
    """

    median: float
    low: float | None
    high: float | None
    p_value: float | None
    n: int

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def _clean(values: Sequence[float] | None) -> np.ndarray:
    data = np.asarray([] if values is None else list(values), dtype=np.float64)
    return data[np.isfinite(data)]


def _ratio_of_medians(baseline, candidate, axis=-1):
    return np.median(baseline, axis=axis) / np.median(candidate, axis=axis)


def _interval(result: Any) -> tuple[float | None, float | None]:
    low, high = result.confidence_interval
    if not (math.isfinite(low) and math.isfinite(high)):
        return None, None
    return float(low), float(high)


def speedup(
    baseline: Sequence[float],
    candidate: Sequence[float],
    *,
    paired: bool = False,
    confidence: float = CONFIDENCE,
    resamples: int = RESAMPLES,
    seed: int = SEED,
    alternative: str = "less",
) -> Speedup:
    """``candidate``'s times (seconds) against ``baseline``'s: see
    :class:`Speedup`. ``paired=True``: ``candidate[i]`` and ``baseline[i]``
    were timed together (alternating calls); the pairs are resampled
    together and the signed-rank test is used. ``alternative="two-sided"``
    tests for a difference either way instead of the candidate being
    faster."""
    from scipy import stats

    base, cand = _clean(baseline), _clean(candidate)
    if paired and len(base) != len(cand):
        raise ValueError(
            f"paired times need as many baseline times ({len(base)}) as "
            f"candidate times ({len(cand)})"
        )
    test = "Wilcoxon signed-rank" if paired else "Mann-Whitney U"
    if len(base) == 0 or len(cand) == 0:
        raise ValueError("speedup needs at least one time on each side")
    ratio = float(np.median(base) / np.median(cand))
    if len(base) < 2 or len(cand) < 2:
        return Speedup(ratio, None, None, None, test, len(base), len(cand))
    interval = stats.bootstrap(
        (base, cand),
        _ratio_of_medians,
        paired=paired,
        vectorized=True,
        confidence_level=confidence,
        n_resamples=resamples,
        method="percentile",
        rng=np.random.default_rng(seed),
    )
    low, high = _interval(interval)
    if paired:
        differences = cand - base
        p_value = (
            1.0  # every pair tied: no evidence either way
            if not np.any(differences)
            else float(stats.wilcoxon(cand, base, alternative=alternative).pvalue)
        )
    else:
        p_value = float(stats.mannwhitneyu(cand, base, alternative=alternative).pvalue)
    return Speedup(ratio, low, high, p_value, test, len(base), len(cand))


def _median(values, axis=-1):
    return np.median(values, axis=axis)


def ratios(
    values: Sequence[float],
    *,
    confidence: float = CONFIDENCE,
    resamples: int = RESAMPLES,
    seed: int = SEED,
) -> Ratios:
    """Per-round ratios (each positive): see :class:`Ratios`."""
    from scipy import stats

    data = _clean(values)
    data = data[data > 0]
    if len(data) == 0:
        raise ValueError("ratios needs at least one positive ratio")
    median = float(np.median(data))
    if len(data) < 2:
        return Ratios(median, None, None, None, len(data))
    interval = stats.bootstrap(
        (data,),
        _median,
        vectorized=True,
        confidence_level=confidence,
        n_resamples=resamples,
        method="percentile",
        rng=np.random.default_rng(seed),
    )
    low, high = _interval(interval)
    logs = np.log(data)
    p_value = 1.0 if not np.any(logs) else float(stats.wilcoxon(logs).pvalue)
    return Ratios(median, low, high, p_value, len(data))


def interval_text(low: float | None, high: float | None, suffix: str = "x") -> str:
    """``"[2.1x, 3.4x]"``, or ``""`` without an interval."""
    if low is None or high is None:
        return ""
    return f"[{low:.2g}{suffix}, {high:.2g}{suffix}]"


def p_text(p_value: float | None) -> str:
    """``"p=0.05"`` (two significant digits), or ``""`` without a test."""
    if p_value is None:
        return ""
    return f"p={p_value:.2g}"
