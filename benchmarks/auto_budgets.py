"""Does ``auto`` pick the fastest strategy that fits, and stay under budget?

For each memory budget, runs ``jacobian(strategy="auto", memory_budget=...)``
and every fixed strategy/chunk size, each in a fresh subprocess (clean peak
memory), and checks: the measured peak of auto's first call (planning probes
included) and of a steady call stay within the budget, and auto's steady time
is within 1.25x of the fastest fixed candidate whose peak also stayed within
that budget. With no budget, auto is compared with ``tape.jacobian``
(``jacobian`` strategy) on each problem.

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
import json, os, sys, time, statistics
import jacobkit as jk
from jacobkit import examples, memory
spec = json.loads(sys.argv[1])
ex = examples.build(spec["problem"], **spec["sizes"])
strategy = spec["strategy"]
if strategy.startswith("chunked("):
    strategy = jk.strategies.Chunked(int(strategy[8:-1]))
kwargs = {"strategy": strategy}
if spec.get("budget"):
    kwargs["memory_budget"] = spec["budget"]
with memory.PeakMemory() as first:
    result = jk.jacobian(ex.model, ex.inputs, ex.layer, **kwargs)
times = []
for _ in range(spec["repeats"]):
    times.append(jk.jacobian(ex.model, ex.inputs, ex.layer, **kwargs).stats.wall_time_s)
with memory.PeakMemory() as steady:
    jk.jacobian(ex.model, ex.inputs, ex.layer, **kwargs)
plan = result.plan
print("RESULT " + json.dumps({
    "chosen": result.strategy + (f"({result.chunk_size})" if result.chunk_size else ""),
    "first_peak": first.extra_bytes, "steady_peak": steady.extra_bytes,
    "steady_s": statistics.median(times),
    "predicted_peak": plan.predicted_peak_bytes if plan else None,
    "predicted_s": plan.predicted_time_s if plan else None,
}))
"""


def _run(spec: dict) -> dict:
    env = {
        **os.environ,
        "TF_CPU_ALLOCATOR_USE_BFC": "true",
        "TF_CPP_MIN_LOG_LEVEL": "3",
    }
    try:
        done = subprocess.run(
            [sys.executable, "-c", _CHILD, json.dumps(spec)],
            capture_output=True,
            text=True,
            timeout=TIMEOUT_S,
            env=env,
        )
    except subprocess.TimeoutExpired:
        return {**spec, "error": f"time limit ({TIMEOUT_S} s)"}
    for line in done.stdout.splitlines():
        if line.startswith("RESULT "):
            return {**spec, **json.loads(line[7:])}
    last = (done.stderr.strip().splitlines() or ["no output"])[-1]
    return {**spec, "error": last[:300]}


def _mib(n: int | None) -> str:
    return "n/a" if n is None else f"{n / 2**20:.1f} MiB"


def budget_section(sizes: dict, budgets: list[str], repeats: int) -> tuple[list, str]:
    from jacobkit.memory import parse_budget

    chunks = sorted({c for c in (1, 2, 4, 8, 16, 32, 64, 128) if c < sizes["features"]})
    fixed = [f"chunked({c})" for c in chunks + [sizes["features"]]]
    fixed += ["jacobian", "while", "batch"]
    specs = [
        {"problem": "generator", "sizes": sizes, "strategy": s, "repeats": repeats}
        for s in fixed
    ]
    specs += [
        {
            "problem": "generator",
            "sizes": sizes,
            "strategy": "auto",
            "budget": b,
            "repeats": repeats,
        }
        for b in budgets
    ]
    rows = [_run(spec) for spec in tqdm(specs, desc="auto vs budgets", file=sys.stderr)]
    by_strategy = {r["strategy"]: r for r in rows if r["strategy"] != "auto"}
    lines = [
        "| budget | auto chose | first-call peak | steady peak | predicted peak "
        "| auto time (s) | fastest within budget | its time (s) | auto / fastest "
        "| peak <= budget |",
        "|---|---|---:|---:|---:|---:|---|---:|---:|---|",
    ]
    for row in (r for r in rows if r["strategy"] == "auto"):
        limit = parse_budget(row["budget"])
        fits = [
            r
            for r in by_strategy.values()
            if "error" not in r and r["steady_peak"] <= limit
        ]
        best = min(fits, key=lambda r: r["steady_s"]) if fits else None
        if "error" in row:
            lines.append(
                f"| {row['budget']} | failed: {row['error']} | | | | | | | | |"
            )
            continue
        within = row["first_peak"] <= limit and row["steady_peak"] <= limit
        ratio = row["steady_s"] / best["steady_s"] if best else float("nan")
        row.update(
            {
                "fastest_within": best and best["strategy"],
                "ratio": ratio,
                "within": within,
            }
        )
        lines.append(
            f"| {row['budget']} | {row['chosen']} | {_mib(row['first_peak'])} | "
            f"{_mib(row['steady_peak'])} | {_mib(row['predicted_peak'])} | "
            f"{row['steady_s']:.3f} | {best and best['strategy']} | "
            f"{best['steady_s'] if best else float('nan'):.3f} | {ratio:.2f}x | "
            f"{'yes' if within else 'NO'} |"
        )
    lines += [
        "",
        "Every fixed candidate on the same problem, same run:",
        "",
        "| strategy | steady time (s) | steady peak |",
        "|---|---:|---:|",
    ]
    for r in by_strategy.values():
        if "error" in r:
            lines.append(f"| {r['strategy']} | failed: {r['error'][:80]} | |")
        else:
            lines.append(
                f"| {r['strategy']} | {r['steady_s']:.3f} | {_mib(r['steady_peak'])} |"
            )
    return rows, "\n".join(lines)


def no_budget_section(problems: list, repeats: int) -> tuple[list, str]:
    specs = []
    for name, sizes in problems:
        for strategy in ("auto", "jacobian"):
            specs.append(
                {
                    "problem": name,
                    "sizes": sizes,
                    "strategy": strategy,
                    "repeats": repeats,
                }
            )
    rows = [
        _run(spec)
        for spec in tqdm(specs, desc="auto vs tape.jacobian", file=sys.stderr)
    ]
    lines = [
        "| problem | auto chose | auto time (s) | tape.jacobian time (s) "
        "| jacobian / auto | auto peak | jacobian peak |",
        "|---|---|---:|---:|---:|---:|---:|",
    ]
    for auto, jac in zip(rows[::2], rows[1::2], strict=True):
        if "error" in auto or "error" in jac:
            lines.append(
                f"| {auto['problem']} | {auto.get('chosen', auto.get('error'))} | | "
                f"{jac.get('error', '')} | | | |"
            )
            continue
        lines.append(
            f"| {auto['problem']} | {auto['chosen']} | {auto['steady_s']:.4f} | "
            f"{jac['steady_s']:.4f} | {jac['steady_s'] / auto['steady_s']:.2f}x | "
            f"{_mib(auto['steady_peak'])} | {_mib(jac['steady_peak'])} |"
        )
    return rows, "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--quick", action="store_true", help="small sizes, two budgets")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    sizes = QUICK_GENERATOR if args.quick else GENERATOR
    budgets = QUICK_BUDGETS if args.quick else BUDGETS
    problems = [("generator", QUICK_GENERATOR)] if args.quick else NO_BUDGET_PROBLEMS
    budget_rows, budget_table = budget_section(sizes, budgets, args.repeats)
    free_rows, free_table = no_budget_section(problems, args.repeats)
    import tensorflow as tf

    python = platform.python_version()
    machine = f"{platform.machine()}, {os.cpu_count()} cores, Python {python}"
    text = "\n".join(
        [
            "# auto under memory budgets",
            "",
            f"Machine: {machine}; TensorFlow {tf.__version__}. "
            f"Generator sizes: {sizes}; target = the first Conv1D; each cell a "
            "fresh process.",
            "",
            budget_table,
            "",
            "## No budget: auto against tape.jacobian (pfor, inside tf.function)",
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
    bad = [
        r for r in budget_rows if r["strategy"] == "auto" and not r.get("within", False)
    ]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
