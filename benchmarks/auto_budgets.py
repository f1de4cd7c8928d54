"""Does ``auto`` pick the fastest strategy that fits, and stay under budget?

For each memory budget, runs ``jacobian(strategy="auto", memory_budget=...)``
and every fixed strategy/chunk size, each alone in a fresh subprocess (clean
peak memory), and checks that the measured peak of auto's first call
(planning probes included), of every call while it races its shortlist, and
of a steady call stay within the budget. Times come from one more process
that calls every label in interleaved rounds; auto's steady time should be
within 1.25x of the fastest fixed candidate whose peak stayed within that
budget. With no budget, auto is compared with ``tape.jacobian`` (``jacobian``
strategy) on each problem, the two interleaved in one process.

    python benchmarks/auto_budgets.py --out benchmarks/results/cpu
    python benchmarks/auto_budgets.py --quick --out /tmp/auto   # small sizes
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
from pathlib import Path

from tqdm import tqdm

#: the issue's problem: the users' generator, target = the first Conv1D
GENERATOR = {
    "batch": 64,
    "sequence": 128,
    "channels": 8,
    "filters": 32,
    "features": 144,
}
QUICK_GENERATOR = {
    "batch": 8,
    "sequence": 32,
    "channels": 8,
    "filters": 16,
    "features": 32,
}
BUDGETS = ["256MiB", "512MiB", "1GiB", "4GiB"]
QUICK_BUDGETS = ["48MiB", "1GiB"]
#: problems for the no-budget comparison with tape.jacobian: (builder, sizes)
NO_BUDGET_PROBLEMS = [
    ("generator", GENERATOR),
    ("mlp", {"batch": 256, "inputs": 256, "hidden": 512, "features": 64}),
    ("cnn2d", {"batch": 16, "height": 64, "width": 32, "filters": 16, "features": 16}),
    ("frozen_resnet", {"batch": 8, "size": 64, "classes": 3}),
]
TIMEOUT_S = 600

_CHILD = r"""
import json, sys, statistics
import jacobkit as jk
from jacobkit import examples, memory
spec = json.loads(sys.argv[1])
ex = examples.build(spec["problem"], **spec["sizes"])


def call(label):
    if label.startswith("auto"):
        budget = label.partition("@")[2]
        kwargs = {"memory_budget": budget} if budget else {}
    elif label.startswith("chunked("):
        kwargs = {"strategy": jk.strategies.Chunked(int(label[8:-1]))}
    else:
        kwargs = {"strategy": label}
    return jk.jacobian(ex.model, ex.inputs, ex.layer, **kwargs)


found = {}
for label in spec["labels"]:  # first call (auto: planning probes), then settle
    with memory.PeakMemory() as first:
        result = call(label)
    peaks = [first.extra_bytes]
    plan = result.plan
    calls = 1
    while plan is not None and plan.race is not None and plan.race.winner is None:
        with memory.PeakMemory() as racing:
            call(label)
        peaks.append(racing.extra_bytes)
        calls += 1
    found[label] = {
        "first_peak": first.extra_bytes, "max_peak": max(peaks),
        "settle_calls": calls, "times": [],
        "predicted_peak": plan.predicted_peak_bytes if plan else None,
        "predicted_s": plan.predicted_time_s if plan else None,
        "plan": plan.summary() if plan else None,
    }
for _ in range(spec["rounds"]):  # interleaved: load changes hit every label alike
    for label in spec["labels"]:
        found[label]["times"].append(call(label).stats.wall_time_s)
for label in spec["labels"]:
    with memory.PeakMemory() as steady:
        result = call(label)
    size = f"({result.chunk_size})" if result.chunk_size else ""
    found[label].update(
        steady_peak=steady.extra_bytes,
        chosen=result.strategy + size,
        steady_s=statistics.median(found[label]["times"] or [float("nan")]),
    )
print("RESULT " + json.dumps(found))
"""


def _run(problem: str, sizes: dict, labels: list[str], rounds: int) -> dict:
    """Run ``labels`` in one fresh process; ``{label: measurements}``, or
    ``{label: {"error": ...}}`` for each if the process failed."""
    env = {
        **os.environ,
        "TF_CPU_ALLOCATOR_USE_BFC": "true",
        "TF_CPP_MIN_LOG_LEVEL": "3",
    }
    spec = {"problem": problem, "sizes": sizes, "labels": labels, "rounds": rounds}
    try:
        done = subprocess.run(
            [sys.executable, "-c", _CHILD, json.dumps(spec)],
            capture_output=True,
            text=True,
            timeout=TIMEOUT_S,
            env=env,
        )
    except subprocess.TimeoutExpired:
        return {label: {"error": f"time limit ({TIMEOUT_S} s)"} for label in labels}
    for line in done.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[7:])
    last = (done.stderr.strip().splitlines() or ["no output"])[-1]
    return {label: {"error": last[:300]} for label in labels}


def _mib(n: int | None) -> str:
    return "n/a" if n is None else f"{n / 2**20:.1f} MiB"


def budget_section(sizes: dict, budgets: list[str], rounds: int) -> tuple[list, str]:
    from jacobkit.memory import parse_budget

    chunks = sorted({c for c in (1, 2, 4, 8, 16, 32, 64, 128) if c < sizes["features"]})
    fixed = [f"chunked({c})" for c in chunks + [sizes["features"]]]
    fixed += ["jacobian", "while", "batch"]
    autos = [f"auto@{b}" for b in budgets]
    # peaks: each label alone in a fresh process (clean allocator statistics)
    alone = {}
    for label in tqdm(fixed + autos, desc="peaks, fresh processes", file=sys.stderr):
        alone.update(_run("generator", sizes, [label], 0))
    # times: every label in one process, in interleaved rounds
    print(f"timing {len(fixed + autos)} labels x {rounds} rounds...", file=sys.stderr)
    timed = _run("generator", sizes, fixed + autos, rounds)
    lines = [
        "| budget | auto chose | first-call peak | max peak while racing "
        "| steady peak | predicted peak | auto time (s) | fastest within budget "
        "| its time (s) | auto / fastest | peak <= budget |",
        "|---|---|---:|---:|---:|---:|---:|---|---:|---:|---|",
    ]
    rows = []
    for budget, label in zip(budgets, autos, strict=True):
        limit = parse_budget(budget)
        peak, time = alone[label], timed[label]
        row = {"budget": budget, "alone": peak, "timed": time}
        rows.append(row)
        if "error" in peak or "error" in time:
            why = peak.get("error") or time.get("error")
            lines.append(f"| {budget} | failed: {why} | | | | | | | | | |")
            continue
        fits = [
            f
            for f in fixed
            if "error" not in alone[f]
            and "error" not in timed[f]
            and alone[f]["steady_peak"] <= limit
        ]
        best = min(fits, key=lambda f: timed[f]["steady_s"]) if fits else None
        best_s = timed[best]["steady_s"] if best else float("nan")
        peaks = (peak["first_peak"], peak["max_peak"], peak["steady_peak"])
        within = max(peaks) <= limit
        ratio = time["steady_s"] / best_s if best else float("nan")
        row.update({"fastest_within": best, "ratio": ratio, "within": within})
        chose = peak["chosen"]
        if time["chosen"] != chose:
            chose += f" (timed run: {time['chosen']})"
        lines.append(
            f"| {budget} | {chose} | {_mib(peaks[0])} | {_mib(peaks[1])} | "
            f"{_mib(peaks[2])} | {_mib(peak['predicted_peak'])} | "
            f"{time['steady_s']:.3f} | {best} | {best_s:.3f} | {ratio:.2f}x | "
            f"{'yes' if within else 'NO'} |"
        )
    lines += [
        "",
        "Every fixed candidate on the same problem: time from the same interleaved",
        "run as auto's, peak from a fresh process of its own:",
        "",
        "| strategy | steady time (s) | steady peak |",
        "|---|---:|---:|",
    ]
    for f in fixed:
        if "error" in alone[f] or "error" in timed[f]:
            why = alone[f].get("error") or timed[f].get("error")
            lines.append(f"| {f} | failed: {why[:80]} | |")
        else:
            lines.append(
                f"| {f} | {timed[f]['steady_s']:.3f} | "
                f"{_mib(alone[f]['steady_peak'])} |"
            )
    lines += ["", "What auto planned (fresh processes):", ""]
    for budget, label in zip(budgets, autos, strict=True):
        if "error" not in alone[label]:
            lines += [f"{budget}:", "```", alone[label]["plan"], "```"]
    rows.append({"fixed": {f: {"alone": alone[f], "timed": timed[f]} for f in fixed}})
    return rows, "\n".join(lines)


def no_budget_section(problems: list, rounds: int) -> tuple[list, str]:
    rows = []
    lines = [
        "| problem | auto chose | auto time (s) | tape.jacobian time (s) "
        "| jacobian / auto | auto peak | jacobian peak |",
        "|---|---|---:|---:|---:|---:|---:|",
    ]
    for name, sizes in tqdm(problems, desc="auto vs tape.jacobian", file=sys.stderr):
        found = _run(name, sizes, ["auto", "jacobian"], rounds)
        rows.append({"problem": name, "sizes": sizes, **found})
        auto, jac = found["auto"], found["jacobian"]
        if "error" in auto or "error" in jac:
            why = auto.get("error") or jac.get("error")
            lines.append(f"| {name} | failed: {why} | | | | | |")
            continue
        lines.append(
            f"| {name} | {auto['chosen']} | {auto['steady_s']:.4f} | "
            f"{jac['steady_s']:.4f} | {jac['steady_s'] / auto['steady_s']:.2f}x | "
            f"{_mib(auto['steady_peak'])} | {_mib(jac['steady_peak'])} |"
        )
    return rows, "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--quick", action="store_true", help="small sizes, two budgets")
    parser.add_argument(
        "--rounds", type=int, default=7, help="interleaved timing rounds (median)"
    )
    args = parser.parse_args()
    sizes = QUICK_GENERATOR if args.quick else GENERATOR
    budgets = QUICK_BUDGETS if args.quick else BUDGETS
    problems = [("generator", QUICK_GENERATOR)] if args.quick else NO_BUDGET_PROBLEMS
    budget_rows, budget_table = budget_section(sizes, budgets, args.rounds)
    free_rows, free_table = no_budget_section(problems, args.rounds)
    import tensorflow as tf

    python = platform.python_version()
    machine = f"{platform.machine()}, {os.cpu_count()} cores, Python {python}"
    text = "\n".join(
        [
            "# auto under memory budgets",
            "",
            f"Machine: {machine}; TensorFlow {tf.__version__}. "
            f"Generator sizes: {sizes}; target = the first Conv1D.",
            "",
            "Peaks: each strategy, and auto at each budget, alone in a fresh "
            "process: its first call (auto: planning probes included), every "
            "call while auto races its shortlist, and a steady call. Times: "
            f"the median of {args.rounds} interleaved rounds in one process "
            "(each round calls every label once, so a load change on this "
            "shared machine hits every label alike), after auto's race has "
            "settled.",
            "",
            budget_table,
            "",
            "## No budget: auto against tape.jacobian (pfor, inside tf.function)",
            "",
            f"Each problem in one process, {args.rounds} interleaved rounds.",
            "",
            free_table,
            "",
        ]
    )
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "auto_budgets.md").write_text(text)
    (args.out / "auto_budgets.json").write_text(
        json.dumps({"budgets": budget_rows, "no_budget": free_rows}, indent=1)
    )
    print(text)
    bad = [r for r in budget_rows if "budget" in r and not r.get("within", False)]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
