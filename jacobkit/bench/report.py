"""``results.md``: the headline table, then one table per problem."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from jacobkit import memory
from jacobkit.bench import machine, stats
from jacobkit.compare import disagrees
from jacobkit.memory import format_bytes

#: how failures read in a table cell
_FAILURE_WORDS = {
    "time_limit": "time limit",
    "out_of_memory": "out of memory",
    "vectorization": "vectorization error",
    "error": "error",
}


def seconds(value: float | None) -> str:
    """``"12.3 ms"`` or ``"1.23 s"`` (three significant digits)."""
    if value is None:
        return ""
    if value < 1:
        return f"{value * 1000:.3g} ms"
    return f"{value:.3g} s"


def speedup(baseline: dict[str, Any] | None, row: dict[str, Any]) -> str:
    """``baseline time / row time`` as ``"4.1x"`` (above 1: faster than the
    baseline); empty when either did not run."""
    if not (baseline and baseline.get("ok") and row.get("ok")):
        return ""
    return f"{baseline['steady_s'] / row['steady_s']:.2g}x"


def speedup_stats(
    baseline: dict[str, Any] | None, row: dict[str, Any]
) -> stats.Speedup | None:
    """The statistics behind :func:`speedup`: the bootstrap interval of the
    ratio of median steady times and the one-sided Mann-Whitney p-value that
    ``row``'s calls are faster; ``None`` where either did not run, for the
    baseline itself, or without the times (older ``results.json``)."""
    if not (baseline and baseline.get("ok") and row.get("ok")) or baseline is row:
        return None
    base, times = baseline.get("steady_times_s"), row.get("steady_times_s")
    if not (base and times):
        return None
    return stats.speedup(base, times)


def speedup_evidence(baseline: dict[str, Any] | None, row: dict[str, Any]) -> str:
    """``"[3.1x, 4.4x] p=0.004"``: the interval and the rank test's p-value
    behind :func:`speedup`, or ``""``."""
    found = speedup_stats(baseline, row)
    if found is None:
        return ""
    return " ".join(
        part
        for part in (
            stats.interval_text(found.low, found.high),
            stats.p_text(found.p_value),
        )
        if part
    )


def failure_text(row: dict[str, Any]) -> str:
    """A short cell for a failed row: ``"time limit"``, ``"skipped (time limit)"``."""
    words = _FAILURE_WORDS.get(row.get("failure") or "error", "error")
    return f"skipped ({words})" if row.get("skipped") else words


def peak(row: dict[str, Any]) -> str:
    return (
        format_bytes(row["peak_bytes"]) if row.get("peak_bytes") is not None else "n/a"
    )


def rows_by_problem(results: dict[str, Any]) -> dict[str, list[dict[str, Any]]]:
    """Result rows grouped by problem id, in suite order."""
    grouped: dict[str, list[dict[str, Any]]] = {
        p["problem"]: [] for p in results["problems"]
    }
    for row in results["rows"]:
        grouped.setdefault(row["problem"], []).append(row)
    return grouped


def default_labels(results: dict[str, Any]) -> list[str]:
    """Labels of the strategies at their defaults (the first row of each
    registered name), in the order they ran."""
    labels: dict[str, str] = {}
    for row in results["rows"]:
        if row["default"]:
            labels.setdefault(row["name"], row["strategy"])
    return list(labels.values())


def _by_label(rows: Sequence[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {row["strategy"]: row for row in rows}


def _problem_title(problem: dict[str, Any]) -> str:
    sizes = ", ".join(f"{k}={v}" for k, v in problem["sizes"].items())
    layer = problem["layer"] or "(the example's target)"
    return (
        f"`{problem['builder']}` ({sizes}); target `{layer}`; "
        f"outputs=`{problem['outputs']}`, {problem['num_rows']} rows"
    )


def headline_table(results: dict[str, Any]) -> str:
    """Problems flagged ``headline`` × strategies at their defaults: median
    time of a call, and the speedup over ``loop`` in brackets."""
    labels = default_labels(results)
    grouped = rows_by_problem(results)
    lines = [
        "| problem | rows | " + " | ".join(labels) + " |",
        "|---|---:|" + "---:|" * len(labels),
    ]
    for problem in results["problems"]:
        if not problem["headline"]:
            continue
        by_label = _by_label(grouped[problem["problem"]])
        loop = by_label.get("loop")
        cells = []
        for label in labels:
            row = by_label.get(label)
            if row is None:
                cells.append("")
            elif row.get("ok"):
                ratio = speedup(loop, row)
                found = speedup_stats(loop, row)
                if ratio and found is not None and found.p_value is not None:
                    ratio += f", {stats.p_text(found.p_value)}"
                cells.append(
                    f"{seconds(row['steady_s'])}" + (f" ({ratio})" if ratio else "")
                )
            else:
                cells.append(failure_text(row))
        lines.append(
            f"| {problem['problem']} | {problem['num_rows']} | "
            + " | ".join(cells)
            + " |"
        )
    return "\n".join(lines)


def headline_memory_table(results: dict[str, Any]) -> str:
    """Headline problems × strategies at their defaults: peak memory of a call."""
    labels = default_labels(results)
    grouped = rows_by_problem(results)
    lines = [
        "| problem | " + " | ".join(labels) + " |",
        "|---|" + "---:|" * len(labels),
    ]
    for problem in results["problems"]:
        if not problem["headline"]:
            continue
        by_label = _by_label(grouped[problem["problem"]])
        cells = []
        for label in labels:
            row = by_label.get(label)
            if row is None:
                cells.append("")
            else:
                cells.append(peak(row) if row.get("ok") else failure_text(row))
        lines.append(f"| {problem['problem']} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def problem_table(rows: Sequence[dict[str, Any]]) -> str:
    """Every strategy configuration on one problem."""
    by_label = _by_label(rows)
    loop, jacobian = by_label.get("loop"), by_label.get("jacobian")
    lines = [
        "| strategy | first call | first 3 calls | median | spread | vs loop "
        "| vs jacobian | vs loop: 95% CI, rank test | vs jacobian: 95% CI, rank test "
        "| peak memory | process growth | max rel. diff | |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for row in rows:
        if not row.get("ok"):
            lines.append(
                f"| {row['strategy']} | | | | | | | | | | | | {failure_text(row)}: "
                f"{_cell(row.get('error') or '')} |"
            )
            continue
        diff = row.get("max_rel_diff")
        flag = "**disagrees**" if disagrees(diff) else ""
        lines.append(
            f"| {row['strategy']} | {seconds(row['first_call_s'])} "
            f"| {seconds(row.get('first_3_calls_s'))} "
            f"| {seconds(row['steady_s'])} | {seconds(row['spread_s'])} "
            f"| {speedup(loop, row)} | {speedup(jacobian, row)} "
            f"| {speedup_evidence(loop, row)} | {speedup_evidence(jacobian, row)} "
            f"| {peak(row)} "
            f"| {_growth(row)} | {'' if diff is None else f'{diff:.1e}'} | {flag} |"
        )
    return "\n".join(lines)


def _growth(row: dict[str, Any]) -> str:
    growth = row.get("growth_bytes")
    return "n/a" if growth is None else memory.format_bytes(growth)


#: auto's targets (issue 8), as (column, limit) pairs
AUTO_LIMITS = {"first call": 1.25, "first 3 calls": 1.2, "steady": 1.1, "warm": 1.1}
#: process growth allowed over the chosen strategy's steady peak (x2, + this)
GROWTH_SLACK_BYTES = 256 * 2**20


def chosen_fixed(fixed: Sequence[dict[str, Any]], ran: str) -> dict[str, Any] | None:
    """The fixed row of the configuration auto ran (``ran``, a label): the
    same label, else the same strategy at its defaults."""
    by_label = _by_label(fixed)
    return by_label.get(ran) or next(
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
    grouped = rows_by_problem(results)
    for problem in results["problems"]:
        if not problem.get("auto_targets"):
            continue
        rows = [r for r in grouped[problem["problem"]] if r.get("ok")]
        fixed = [r for r in rows if r["name"] != "auto"]
        by_label = _by_label(rows)
        auto, warm = by_label.get("auto"), by_label.get("auto, warm cache")
        if auto is None or not fixed:
            what = "failed" if grouped[problem["problem"]] else "not run"
            lines.append(f"| {problem['problem']} | {what} | | | | | | |")
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
            warm_ratio += _first_paired(warm, AUTO_LIMITS["warm"])
        lines.append(
            f"| {problem['problem']} | {ran} "
            f"| {_ratio(auto, fixed, 'first_call_s', AUTO_LIMITS['first call'])}"
            f"{_first_paired(auto, AUTO_LIMITS['first call'])} "
            f"| {_ratio(auto, fixed, 'first_3_calls_s', AUTO_LIMITS['first 3 calls'])} "
            f"| {_ratio(auto, fixed, 'steady_s', AUTO_LIMITS['steady'])} "
            f"| {_paired(auto)} | {fits} "
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
    fmt = memory.format_bytes
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


def _first_paired(row: dict, limit: float) -> str:
    """The median ratio of first calls in alternating fresh processes
    (``runner._paired_first_calls``), or nothing where none ran."""
    paired = row.get("first_paired")
    if not paired:
        return ""
    mark = "" if paired["ratio"] <= limit else " **over**"
    evidence = ""
    if paired.get("ratios"):
        found = stats.ratios(paired["ratios"])
        parts = [stats.interval_text(found.low, found.high, suffix="")]
        if found.p_value is not None:
            parts.append(f"{stats.p_text(found.p_value)} two-sided")
        evidence = " ".join(part for part in parts if part)
        evidence = f" {evidence}" if evidence else ""
    return (
        f"; paired fresh processes {paired['ratio']:.2f}{evidence} "
        f"({paired['strategy']}, {paired['rounds']} rounds){mark}"
    )


def _paired(row: dict) -> str:
    """auto's paired-rounds ratio (:func:`jacobkit.compare.paired_rounds`)."""
    paired = row.get("paired")
    if not paired:
        return "n/a"
    mark = "" if paired["ratio"] <= AUTO_LIMITS["steady"] else " **over**"
    evidence = ""
    auto_times, fixed_times = paired.get("auto_times_s"), paired.get("fixed_times_s")
    if auto_times and fixed_times and len(auto_times) == len(fixed_times):
        # auto_s / fixed_s, as the ratio: the fixed strategy is the baseline
        found = stats.speedup(
            auto_times, fixed_times, paired=True, alternative="two-sided"
        )
        parts = [stats.interval_text(found.low, found.high, suffix="")]
        if found.p_value is not None:
            parts.append(f"{stats.p_text(found.p_value)} two-sided")
        evidence = " ".join(part for part in parts if part)
        evidence = f" {evidence}" if evidence else ""
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


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")[:120]


def render(results: dict[str, Any]) -> str:
    """The whole of ``results.md``."""
    settings = results["settings"]
    device = results.get("device", {})
    grouped = rows_by_problem(results)
    failed = [r for r in results["rows"] if not r.get("ok")]
    minutes = results.get("duration_s", 0) / 60
    parts = [
        f"# jacobkit benchmark results ({results['suite']} suite)",
        "",
        f"- Machine: {machine.summary(results['machine'])}.",
        f"- Device: `{device.get('device', settings['device'])}` "
        f"({device.get('device_name', '')}); TensorFlow {device.get('tensorflow')}, "
        f"Keras {device.get('keras')}, Python {results['machine']['python']}.",
        f"- Each configuration ran in a fresh subprocess: one warm-up call (the "
        f"first call, tracing included), then {settings['repeats']} timed calls "
        f"(median and spread = max - min), then one call for peak memory (bytes "
        f"TensorFlow allocated on the device above what was in use before the "
        f"call). Time limit per configuration: {settings['timeout_s']:.0f} s.",
        f"- The suite took {minutes:.1f} min; {len(results['rows'])} rows, "
        f"{len(failed)} of them failures.",
        "- vs loop / vs jacobian: that strategy's median time divided by this "
        "one's (above 1: faster); beside them, the 95% percentile bootstrap "
        "interval of that ratio and the one-sided Mann-Whitney U p-value that "
        "this one's calls are faster (the headline gives the p-value after "
        "the speedup). With 3 timed calls against 3 the exact test gives at "
        "best p=0.05, with 5 against 5 p=0.004. Paired ratios give the "
        "interval of the ratio and the two-sided Wilcoxon signed-rank p-value "
        "(`jacobkit/bench/stats.py`).",
        "- Reference for the max. relative difference: "
        + "; ".join(f"`{k}` = {v}" for k, v in results["references"].items())
        + " (each problem says which).",
        "",
        "## Headline: median time per call (speedup over `loop`)",
        "",
        headline_table(results),
        "",
        "## Headline: peak memory per call",
        "",
        headline_memory_table(results),
        "",
    ]
    if any(p.get("auto_targets") for p in results["problems"]):
        parts += [
            "## auto against the best fixed strategy",
            "",
            "Targets: first call <= 1.25x the fastest fixed strategy's first "
            "call; first 3 calls <= 1.2x the best; steady <= 1.1x the best; "
            "process memory growth <= 2x auto's steady peak + 256 MiB; with a "
            "warm plan cache (a fresh process after the cold one), first call "
            "<= 1.1x the chosen strategy's own first call. Every row ran in a "
            "fresh process; auto's steady calls are timed after it settled. "
            "Then, in auto's process, auto and the fixed strategy with the "
            "least steady time alternate call by call (paired rounds): the "
            "same strategy's steady time moves by up to 1.3x between fresh "
            "processes on a shared machine, which the paired ratio does not "
            "see. First calls are also timed in alternating fresh processes "
            "(the fastest fixed strategy's first call against auto's with an "
            "empty plan cache, and the chosen strategy's against auto's with "
            "the warm one), and the median of the per-round ratios is given "
            "as 'paired fresh processes'. Growth is measured with each "
            "result dropped before the next call, like the peak, which "
            "excludes results held across a call; then again after 3 more "
            "calls each made while the previous result is still held, as a "
            "loop of `res = jacobian(...)` holds it (two results alive "
            "during each call).",
            "",
            auto_table(results),
            "",
        ]
    for problem in results["problems"]:
        rows = grouped[problem["problem"]]
        reference = f"reference: `{problem['reference']}`"
        if rows and rows[0].get("reference_error"):
            reference += f" (failed: {_cell(rows[0]['reference_error'])})"
        parts += [
            f"## {problem['problem']}",
            "",
            f"{_problem_title(problem)}; {reference}.",
            "",
            problem_table(rows),
            "",
        ]
        for row in rows:
            if row.get("plan"):
                parts += [
                    f"`{row['strategy']}`: its plan after the timed calls",
                    "",
                    "```",
                    row["plan"],
                    "```",
                    "",
                ]
    return "\n".join(parts)


def write(results: dict[str, Any], path: str | Path) -> Path:
    """Write :func:`render` to ``path``."""
    path = Path(path)
    path.write_text(render(results))
    return path
