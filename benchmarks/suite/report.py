"""``results.md``: the headline table, then one table per problem."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from benchmarks.suite import machine
from benchmarks.suite.auto_report import (
    OVERHEAD_LIMIT,
    PRIOR_LIMIT,
    auto_table,
    overhead_table,
)
from benchmarks.suite.rows import by_label, default_labels, rows_by_problem
from jacobkit import memory
from jacobkit.bench import stats
from jacobkit.bench.disagreement import disagrees
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
        labelled = by_label(grouped[problem["problem"]])
        loop = labelled.get("loop")
        cells = []
        for label in labels:
            row = labelled.get(label)
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
        labelled = by_label(grouped[problem["problem"]])
        cells = []
        for label in labels:
            row = labelled.get(label)
            if row is None:
                cells.append("")
            else:
                cells.append(peak(row) if row.get("ok") else failure_text(row))
        lines.append(f"| {problem['problem']} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def problem_table(rows: Sequence[dict[str, Any]]) -> str:
    """Every strategy configuration on one problem."""
    labelled = by_label(rows)
    loop, jacobian = labelled.get("loop"), labelled.get("jacobian")
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
            "auto's per-call overhead: its steady call against the strategy it "
            "runs, called fixed, alternating call by call in auto's process "
            f"(target <= {OVERHEAD_LIMIT}x). Its memory prior: for each "
            "strategy it ran, the peak it predicted before the run against the "
            f"peak it measured (within {PRIOR_LIMIT:g}x either way, else "
            "marked).",
            "",
            overhead_table(results),
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
