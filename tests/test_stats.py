"""The benchmark statistics (jacobkit.bench.stats) against independent
computations: exact rank-test p-values counted by hand, and a percentile
bootstrap written with numpy alone; then the reports that print them."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest

from benchmarks.suite import auto_report, report
from jacobkit.bench import measure, stats


# -- rank tests: exact p-values from counting -------------------------------------
def _mann_whitney_exact_less(x, y) -> float:
    """P(U <= observed U of x) over every equally likely split of the pooled
    ranks (no ties): the one-sided exact test that x tends to be smaller."""
    pooled = np.concatenate([x, y])
    ranks = pooled.argsort().argsort() + 1
    observed = ranks[: len(x)].sum()
    sums = [sum(c) for c in itertools.combinations(range(1, len(pooled) + 1), len(x))]
    return sum(s <= observed for s in sums) / len(sums)


def _signed_rank_exact_less(differences) -> float:
    """P(W+ <= observed) over the 2^n equally likely signs (no ties, no zeros)."""
    d = np.asarray(differences)
    ranks = np.abs(d).argsort().argsort() + 1
    observed = ranks[d > 0].sum()
    n = len(d)
    count = 0
    for signs in itertools.product((0, 1), repeat=n):
        count += sum(r for r, s in zip(range(1, n + 1), signs) if s) <= observed
    return count / 2**n


def test_separated_samples_give_the_textbook_exact_p_values():
    # every candidate call faster than every baseline call: 1 / C(6, 3) = 1/20
    # for 3 against 3, 1 / C(10, 5) = 1/252 for 5 against 5
    found = stats.speedup([3.0, 3.1, 3.2], [1.0, 1.1, 1.2])
    assert found.test == "Mann-Whitney U"
    assert found.p_value == pytest.approx(1 / 20)
    five = stats.speedup([3.0, 3.1, 3.2, 3.3, 3.4], [1.0, 1.1, 1.2, 1.3, 1.4])
    assert five.p_value == pytest.approx(1 / 252)
    assert found.significant is False and five.significant is True


def test_mann_whitney_matches_counting_on_overlapping_samples():
    rng = np.random.default_rng(3)
    baseline = rng.lognormal(0.1, 0.2, size=5)
    candidate = rng.lognormal(0.0, 0.2, size=4)
    found = stats.speedup(baseline, candidate)
    assert found.p_value == pytest.approx(_mann_whitney_exact_less(candidate, baseline))


def test_paired_times_use_the_signed_rank_test():
    baseline = [1.00, 1.20, 0.90, 1.10, 1.05]
    candidate = [0.95, 1.05, 0.89, 0.80, 1.06]
    found = stats.speedup(baseline, candidate, paired=True)
    assert found.test == "Wilcoxon signed-rank"
    differences = np.subtract(candidate, baseline)
    assert found.p_value == pytest.approx(_signed_rank_exact_less(differences))
    # every pair faster: 1 / 2^5
    all_faster = stats.speedup([2, 3, 4, 5, 6], [1, 1.9, 2.8, 3.7, 4.6], paired=True)
    assert all_faster.p_value == pytest.approx(1 / 32)
    with pytest.raises(ValueError, match="paired"):
        stats.speedup([1, 2, 3], [1, 2], paired=True)


# -- the bootstrap interval against a numpy percentile bootstrap -------------------
def _numpy_bootstrap(samples, statistic, paired, resamples=20000, seed=11):
    rng = np.random.default_rng(seed)
    values = []
    n = len(samples[0])
    for _ in range(resamples):
        if paired:
            index = rng.integers(0, n, n)
            drawn = [s[index] for s in samples]
        else:
            drawn = [s[rng.integers(0, len(s), len(s))] for s in samples]
        values.append(statistic(*drawn))
    return np.percentile(values, [2.5, 97.5])


@pytest.mark.parametrize("paired", [False, True])
def test_the_interval_of_the_ratio_of_medians_agrees_with_numpy(paired):
    rng = np.random.default_rng(5)
    baseline = rng.lognormal(0.7, 0.15, size=15)
    candidate = rng.lognormal(0.0, 0.15, size=15)
    found = stats.speedup(baseline, candidate, paired=paired)
    assert found.ratio == pytest.approx(np.median(baseline) / np.median(candidate))
    low, high = _numpy_bootstrap(
        (baseline, candidate),
        lambda b, c: np.median(b) / np.median(c),
        paired,
    )
    # two independent Monte Carlo estimates of the same percentiles
    assert found.low == pytest.approx(low, rel=0.03)
    assert found.high == pytest.approx(high, rel=0.03)
    assert found.low <= found.ratio <= found.high


def test_the_interval_is_reproducible_and_degenerate_where_times_are_equal():
    a = stats.speedup([3.0, 3.3, 2.9, 3.1], [1.0, 1.2, 0.9, 1.1])
    b = stats.speedup([3.0, 3.3, 2.9, 3.1], [1.0, 1.2, 0.9, 1.1])
    assert a == b  # a fixed seed
    flat = stats.speedup([2.0, 2.0, 2.0], [1.0, 1.0, 1.0])
    assert (flat.ratio, flat.low, flat.high) == (2.0, 2.0, 2.0)


def test_one_time_gives_the_ratio_without_statistics():
    found = stats.speedup([2.0], [1.0, 1.1])
    assert found.ratio == pytest.approx(2.0 / 1.05)
    assert (found.low, found.high, found.p_value) == (None, None, None)
    with pytest.raises(ValueError, match="at least one"):
        stats.speedup([], [1.0])


def test_per_round_ratios():
    values = [0.9, 0.8, 0.95, 0.7, 0.85, 0.75, 0.92]
    found = stats.ratios(values)
    assert found.median == pytest.approx(np.median(values)) and found.n == 7
    low, high = _numpy_bootstrap((np.asarray(values),), np.median, paired=False)
    assert (found.low, found.high) == (pytest.approx(low), pytest.approx(high))
    # every ratio below 1: two-sided 2 / 2^7
    assert found.p_value == pytest.approx(2 / 2**7)
    assert stats.ratios([1.2]).p_value is None


def test_texts():
    assert stats.interval_text(2.13, 3.456) == "[2.1x, 3.5x]"
    assert stats.interval_text(0.91, 1.02, suffix="") == "[0.91, 1]"
    assert stats.interval_text(None, None) == ""
    assert stats.p_text(1 / 252) == "p=0.004"
    assert stats.p_text(None) == ""


# -- the reports --------------------------------------------------------------------
def _measurement(label, name, times, diff=1e-7):
    return measure.Measurement(
        label,
        name,
        None,
        first_call_s=1.0,
        first_3_calls_s=2.0,
        steady_s=float(np.median(times)),
        spread_s=max(times) - min(times),
        steady_times_s=tuple(times),
        peak_bytes=1024,
        growth_bytes=0,
        max_rel_diff=diff,
    )


def test_compare_table_gives_the_interval_and_the_test_beside_vs_loop():
    table = measure.format_table(
        [
            _measurement("loop", "loop", [3.0, 3.1, 3.2]),
            _measurement("while", "while", [1.0, 1.1, 1.2]),
        ]
    )
    header, _, loop, fast = table.splitlines()
    assert "vs loop, 95% CI" in header and "faster than loop (rank test)" in header
    cells = [c.strip() for c in fast.strip("|").split("|")]
    expected = stats.speedup([3.0, 3.1, 3.2], [1.0, 1.1, 1.2])
    assert cells[4] == f"{3.1 / 1.1:.1f}x"
    assert cells[5] == stats.interval_text(expected.low, expected.high)
    assert cells[6] == "p=0.05"
    assert cells[-1] == "1.0e-07"  # the last column stays the agreement
    assert [c.strip() for c in loop.strip("|").split("|")][5:7] == ["", ""]


def _row(label, name, times):
    return {
        "problem": "p",
        "strategy": label,
        "name": name,
        "ok": True,
        "first_call_s": 1.0,
        "first_3_calls_s": 2.0,
        "steady_s": float(np.median(times)),
        "spread_s": max(times) - min(times),
        "steady_times_s": list(times),
        "peak_bytes": 1024,
        "growth_bytes": 0,
        "max_rel_diff": 1e-7,
    }


def test_bench_tables_give_the_evidence_behind_each_speedup():
    loop = _row("loop", "loop", [3.0, 3.1, 3.2, 3.3, 3.4])
    jac = _row("jacobian", "jacobian", [2.0, 2.1, 2.2, 2.3, 2.4])
    fast = _row("while", "while", [1.0, 1.1, 1.2, 1.3, 1.4])
    table = report.problem_table([loop, jac, fast])
    line = table.splitlines()[-1]
    assert "p=0.004" in line and line.count("[") == 2
    assert report.speedup_evidence(loop, loop) == ""
    # results.json written before the times were recorded: no statistics
    old = {k: v for k, v in fast.items() if k != "steady_times_s"}
    assert report.speedup_evidence(loop, old) == ""


def test_paired_rounds_show_their_interval_and_signed_rank_test():
    auto = [1.0, 1.1, 0.9, 1.05, 0.95]
    fixed = [1.0, 1.0, 1.0, 1.0, 1.0]
    paired = {
        "strategy": "while",
        "rounds": 5,
        "auto_s": float(np.median(auto)),
        "fixed_s": 1.0,
        "ratio": float(np.median(auto)),
        "auto_times_s": auto,
        "fixed_times_s": fixed,
    }
    text = auto_report.paired_text({"paired": paired})
    assert text.startswith("1.00 [") and "two-sided (while, 5 rounds)" in text
    first = {"strategy": "while", "ratios": [0.9, 1.1, 1.0], "ratio": 1.0, "rounds": 3}
    assert "[0.9, 1.1]" in auto_report.first_paired_text({"first_paired": first}, 1.25)
    assert math.isclose(stats.ratios([0.9, 1.1, 1.0]).median, 1.0)
