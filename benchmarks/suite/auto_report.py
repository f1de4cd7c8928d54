"""``results.md``'s table of ``auto`` against the best fixed strategy, on the
problems flagged ``auto_targets``, and the targets it is held to."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

from benchmarks.suite.rows import by_label, rows_by_problem
from jacobkit.bench import stats
from jacobkit.memory.budget import format_bytes

__all__ = [
    "AUTO_LIMITS",
    "GROWTH_SLACK_BYTES",
    "auto_table",
    "overhead_table",
    "chosen_fixed",
    "first_paired_text",
    "paired_text",
]

#: auto's targets (issue 8), as (column, limit) pairs
AUTO_LIMITS = {"first call": 1.25, "first 3 calls": 1.2, "steady": 1.1, "warm": 1.1}
#: process growth allowed over the chosen strategy's steady peak (x2, + this)
GROWTH_SLACK_BYTES = 256 * 2**20
#: auto's steady call against the strategy it runs, called fixed (issue 20)
OVERHEAD_LIMIT = 1.15
#: the memory prior's prediction against the measured peak, either way
PRIOR_LIMIT = 2.0


def chosen_fixed(fixed: Sequence[dict[str, Any]], ran: str) -> dict[str, Any] | None:
    """The fixed row of the configuration auto ran (``ran``, a label): the
    same label, else the same strategy at its defaults."""
    labelled = by_label(fixed)
    return labelled.get(ran) or next(
        (r for r in fixed if r["name"] == ran.split("(")[0]), None
    )


def auto_table(results: dict[str, Any]) -> str:
    """``auto`` against the best fixed strategy, on problems flagged
    ``auto_targets``: each ratio with its target, and the memory check."""
    lines = [
        "| problem | auto ran | first call: auto / fastest fixed "
        "| first 3 calls: auto / best | steady: auto / best "
        "| steady, paired rounds in one process: auto / best "
        "| growth <= 2 x peak + 256 MiB | warm cache first call / its own |",
        "|---|---|---:|---:|---:|---:|---|---:|",
    ]
    for name, rows, any_ran in _auto_problems(results):
        fixed = [r for r in rows if r["name"] != "auto"]
        labelled = by_label(rows)
        auto, warm = labelled.get("auto"), labelled.get("auto, warm cache")
        if auto is None or not fixed:
            what = "failed" if any_ran else "not run"
            lines.append(f"| {name} | {what} | | | | | | |")
            continue
        ran = (auto.get("ran") or "").removeprefix("auto: ")
        own = chosen_fixed(fixed, ran)

        fits = _growth_check(auto, own)
        warm_ratio = "n/a"
        if warm is not None and own is not None and own.get("first_call_s"):
            value = warm["first_call_s"] / own["first_call_s"]
            over = "" if value <= AUTO_LIMITS["warm"] else " **over**"
            warm_ratio = f"{value:.2f} ({own['strategy']}){over}"
        if warm is not None:
            warm_ratio += first_paired_text(warm, AUTO_LIMITS["warm"])
        lines.append(
            f"| {name} | {ran} "
            f"| {_ratio(auto, fixed, 'first_call_s', AUTO_LIMITS['first call'])}"
            f"{first_paired_text(auto, AUTO_LIMITS['first call'])} "
            f"| {_ratio(auto, fixed, 'first_3_calls_s', AUTO_LIMITS['first 3 calls'])} "
            f"| {_ratio(auto, fixed, 'steady_s', AUTO_LIMITS['steady'])} "
            f"| {paired_text(auto)} | {fits} "
            f"| {warm_ratio} |"
        )
    return "\n".join(lines)


def _growth_check(auto: dict, own: dict | None) -> str:
    """auto's process growth (no result held between calls) against
    ``2 x peak + 256 MiB``, beside the chosen strategy's own growth run fixed
    in its own process (what running it costs anyway), and both growths with
    one result held across each call where they were measured."""
    growth, peak_bytes = auto.get("growth_bytes"), auto.get("peak_bytes")
    if growth is None or peak_bytes is None:
        return "n/a"
    allowed = 2 * peak_bytes + GROWTH_SLACK_BYTES
    fmt = format_bytes
    alone = held = ""
    if own is not None and own.get("growth_bytes") is not None:
        alone = f"; {own['strategy']} alone {fmt(own['growth_bytes'])}"
    if auto.get("held_growth_bytes") is not None:
        held = f"; one result held across calls: {fmt(auto['held_growth_bytes'])}"
        if own is not None and own.get("held_growth_bytes") is not None:
            held += f", {own['strategy']} alone {fmt(own['held_growth_bytes'])}"
    return (
        f"{'yes' if growth <= allowed else '**no**'} "
        f"({fmt(growth)} vs {fmt(allowed)}{alone}{held})"
    )


def first_paired_text(row: dict, limit: float) -> str:
    """The median ratio of first calls in alternating fresh processes
    (``runner._paired_first_calls``), or nothing where none ran."""
    paired = row.get("first_paired")
    if not paired:
        return ""
    mark = "" if paired["ratio"] <= limit else " **over**"
    evidence = ""
    if paired.get("ratios"):
        evidence = _evidence(stats.ratios(paired["ratios"]))
    return (
        f"; paired fresh processes {paired['ratio']:.2f}{evidence} "
        f"({paired['strategy']}, {paired['rounds']} rounds){mark}"
    )


def _evidence(found: stats.Ratios | stats.Speedup) -> str:
    """`` [low, high] p=… two-sided`` for a paired ratio (empty where neither
    is known), as both paired columns print it."""
    parts = [stats.interval_text(found.low, found.high, suffix="")]
    if found.p_value is not None:
        parts.append(f"{stats.p_text(found.p_value)} two-sided")
    evidence = " ".join(part for part in parts if part)
    return f" {evidence}" if evidence else ""


def paired_text(row: dict) -> str:
    """auto's paired-rounds ratio (:func:`benchmarks.suite.paired.paired_rounds`)."""
    paired = row.get("paired")
    if not paired:
        return "n/a"
    mark = "" if paired["ratio"] <= AUTO_LIMITS["steady"] else " **over**"
    evidence = ""
    auto_times, fixed_times = paired.get("auto_times_s"), paired.get("fixed_times_s")
    if auto_times and fixed_times and len(auto_times) == len(fixed_times):
        # auto_s / fixed_s, as the ratio: the fixed strategy is the baseline
        evidence = _evidence(
            stats.speedup(auto_times, fixed_times, paired=True, alternative="two-sided")
        )
    return (
        f"{paired['ratio']:.2f}{evidence} "
        f"({paired['strategy']}, {paired['rounds']} rounds){mark}"
    )


def _ratio(row: dict, fixed: list[dict], key: str, limit: float) -> str:
    """``row[key]`` over the least of ``fixed``, naming it, marked if over
    ``limit``."""
    best = min(fixed, key=lambda r: r.get(key) or float("inf"))
    if not row.get(key) or not best.get(key):
        return "n/a"
    value = row[key] / best[key]
    mark = "" if value <= limit else " **over**"
    return f"{value:.2f} ({best['strategy']}){mark}"


def overhead_table(results: dict[str, Any]) -> str:
    """auto's per-call overhead (its steady call against the strategy it
    runs, called fixed, alternating in one process) and its memory prior
    (each strategy's predicted peak before it ran against the peak
    measured), on the problems flagged ``auto_targets``."""
    lines = [
        "| problem | auto ran | per-call overhead: auto / same strategy fixed "
        "| memory prior: predicted / measured peak |",
        "|---|---|---:|---|",
    ]
    for name, rows, _ in _auto_problems(results):
        auto = by_label(rows).get("auto")
        if auto is None:
            lines.append(f"| {name} | not run | | |")
            continue
        ran = (auto.get("ran") or "").removeprefix("auto: ")
        lines.append(
            f"| {name} | {ran} | {_overhead_text(auto)} | {_prior_text(auto)} |"
        )
    return "\n".join(lines)


def _auto_problems(
    results: dict[str, Any],
) -> Iterator[tuple[str, list[dict[str, Any]], bool]]:
    """Each problem flagged ``auto_targets``: its name, its rows that ran
    without error, and whether any row ran at all."""
    grouped = rows_by_problem(results)
    for problem in results["problems"]:
        if problem.get("auto_targets"):
            rows = grouped[problem["problem"]]
            yield problem["problem"], [r for r in rows if r.get("ok")], bool(rows)


def _overhead_text(row: dict) -> str:
    """Paired steady calls of auto and what it ran: the ratio, the medians
    and the difference in milliseconds."""
    own = row.get("overhead")
    if not own:
        return "n/a"
    mark = "" if own["ratio"] <= OVERHEAD_LIMIT else " **over**"
    extra_ms = (own["auto_s"] - own["fixed_s"]) * 1e3
    return (
        f"{own['ratio']:.2f} ({own['auto_s'] * 1e3:.3g} ms vs "
        f"{own['fixed_s'] * 1e3:.3g} ms, {extra_ms:+.2g} ms; {own['strategy']}, "
        f"{own['rounds']} rounds){mark}"
    )


def _prior_text(row: dict) -> str:
    """Each strategy auto ran: predicted / measured peak, marked where the
    prior is off by more than :data:`PRIOR_LIMIT` either way."""
    parts = []
    for peak in row.get("peaks") or ():
        predicted, measured = peak["predicted_bytes"], peak["measured_bytes"]
        if not predicted or not measured:
            continue
        ratio = predicted / measured
        off = ratio > PRIOR_LIMIT or ratio < 1 / PRIOR_LIMIT
        parts.append(
            f"{peak['strategy']} {ratio:.2f} ({format_bytes(predicted)} / "
            f"{format_bytes(measured)}){' **off**' if off else ''}"
        )
    return "; ".join(parts) or "n/a"
