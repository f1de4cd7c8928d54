"""Does ``auto`` pick the fastest strategy that fits, and stay under budget?

For each memory budget, runs ``jacobian(strategy="auto", memory_budget=...)``
and every fixed strategy/chunk size, each alone in a fresh subprocess (clean
peak memory), and checks that the measured peak of auto's first call
(every segment it times included), of every call until it settles, and of
a steady call stay within the budget. The child program is
:mod:`benchmarks.suite.budget_child`. Times come from one more process
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
import statistics
import subprocess
import sys
from pathlib import Path

# the repository's root: this checkout's jacobkit, and the child's module
ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tqdm import tqdm  # noqa: E402

from jacobkit import runtime  # noqa: E402

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
#: 32-64MiB: about 1.5-3x the measured first call, and where this CPU's
#: convolution kernels' scratch space matters (32 MiB per backward pass in
#: flight without oneDNN, see jacobkit.planner.scratch)
BUDGETS = ["32MiB", "64MiB", "128MiB", "256MiB", "1GiB"]
QUICK_BUDGETS = ["48MiB", "1GiB"]
#: problems for the no-budget comparison with tape.jacobian: (builder, sizes)
NO_BUDGET_PROBLEMS = [
    ("generator", GENERATOR),
    ("mlp", {"batch": 256, "inputs": 256, "hidden": 512, "features": 64}),
    ("cnn2d", {"batch": 16, "height": 64, "width": 32, "filters": 16, "features": 16}),
    ("frozen_resnet", {"batch": 8, "size": 64, "classes": 3}),
]
TIMEOUT_S = 600
#: chunked's chunk sizes measured beside auto (and every row at once)
CHUNK_SIZES = (1, 2, 4, 8, 16, 32, 64, 128)


def _run(
    problem: str,
    sizes: dict,
    labels: list[str],
    rounds: int,
    chunk_sizes: tuple[int, ...] = (),
) -> dict:
    """Run ``labels`` in one fresh process; ``{label: measurements}``, or
    ``{label: {"error": ...}}`` for each if the process failed."""
    env = {
        **os.environ,
        **runtime.bfc_environment(),
        "TF_CPP_MIN_LOG_LEVEL": "3",
        "PYTHONPATH": os.pathsep.join(
            [str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])]
        ),
    }
    spec = {
        "problem": problem,
        "sizes": sizes,
        "labels": labels,
        "rounds": rounds,
        "chunk_sizes": list(chunk_sizes),
    }
    try:
        done = subprocess.run(
            [sys.executable, "-m", "benchmarks.suite.budget_child", json.dumps(spec)],
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


def _paired(numerator: list[float], denominator: list[float]) -> float:
    """Median over rounds of ``numerator[i] / denominator[i]``: the two were
    timed in the same round, so a load change hits both."""
    pairs = zip(numerator, denominator, strict=True)
    return statistics.median([a / b for a, b in pairs])


def measure_budgets(sizes: dict, budgets: list[str], rounds: int) -> dict:
    """Peaks of every label alone in a fresh process, and times of every label
    in one process in interleaved rounds."""
    from jacobkit.bench.candidates import configurations

    fixed = [
        s.label
        for s in configurations(sizes["features"], CHUNK_SIZES)
        if s.name not in ("loop", "forward")  # minutes per call at these sizes
    ]
    autos = [f"auto@{b}" for b in budgets]
    alone = {}
    for label in tqdm(fixed + autos, desc="peaks, fresh processes", file=sys.stderr):
        alone.update(_run("generator", sizes, [label], 0, CHUNK_SIZES))
    print(f"timing {len(fixed + autos)} labels x {rounds} rounds...", file=sys.stderr)
    timed = _run("generator", sizes, fixed + autos, rounds, CHUNK_SIZES)
    return {"budgets": budgets, "fixed": fixed, "alone": alone, "timed": timed}


def _prior_table(raw: dict) -> list[str]:
    """The memory prior against the first call: what ``jk.plan`` predicted
    before it (the strategy and peak the first call starts on) and the peak
    the first call measured, per budget."""
    lines = [
        "",
        "The memory prior against the first call (`jk.plan` before it, then the call):",
        "",
        "| budget | first call started on | predicted peak (prior) "
        "| first-call peak | measured / predicted |",
        "|---|---|---:|---:|---:|",
    ]
    for budget in raw["budgets"]:
        peak = raw["alone"][f"auto@{budget}"]
        if "error" in peak or "refused" in peak or peak.get("prior_peak") is None:
            continue
        ratio = peak["first_peak"] / peak["prior_peak"]
        lines.append(
            f"| {budget} | {peak['prior_strategy']} | {_mib(peak['prior_peak'])} "
            f"| {_mib(peak['first_peak'])} | {ratio:.2f} |"
        )
    return lines


def render_budgets(raw: dict) -> tuple[list[dict], str]:
    """The budget table: one verdict row per budget, and the text."""
    from jacobkit.memory import parse_budget

    alone, timed, fixed = raw["alone"], raw["timed"], raw["fixed"]
    lines = [
        "| budget | auto ran | first-call peak | max peak while racing "
        "| steady peak | predicted peak | auto time (s) | fastest within budget "
        "| its time (s) | auto / fastest (medians) | auto / fastest (paired) "
        "| peak <= budget |",
        "|---|---|---:|---:|---:|---:|---:|---|---:|---:|---:|---|",
    ]
    verdicts = []
    for budget in raw["budgets"]:
        label = f"auto@{budget}"
        limit = parse_budget(budget)
        peak, time = alone[label], timed[label]
        if "refused" in peak:  # nothing ran: nothing over the budget
            lines.append(
                f"| {budget} | refused: {peak['refused']} | | | | | | | | | | |"
            )
            verdicts.append({"budget": budget, "within": True, "refused": True})
            continue
        if "error" in peak or "error" in time:
            why = peak.get("error") or time.get("error")
            lines.append(f"| {budget} | failed: {why} | | | | | | | | | | |")
            verdicts.append({"budget": budget, "within": False, "error": why})
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
        paired = _paired(time["times"], timed[best]["times"]) if best else ratio
        verdicts.append(
            {
                "budget": budget,
                "fastest_within": best,
                "ratio": ratio,
                "paired_ratio": paired,
                "within": within,
            }
        )
        chose = peak.get("ran", peak["chosen"])
        if time.get("ran", time["chosen"]) != chose:
            chose += f" (timed run: {time.get('ran', time['chosen'])})"
        lines.append(
            f"| {budget} | {chose} | {_mib(peaks[0])} | {_mib(peaks[1])} | "
            f"{_mib(peaks[2])} | {_mib(peak['predicted_peak'])} | "
            f"{time['steady_s']:.3f} | {best} | {best_s:.3f} | {ratio:.2f}x | "
            f"{paired:.2f}x | {'yes' if within else 'NO'} |"
        )
    lines += _prior_table(raw)
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
    for budget in raw["budgets"]:
        if not {"error", "refused"} & set(alone[f"auto@{budget}"]):
            lines += [f"{budget}:", "```", alone[f"auto@{budget}"]["plan"], "```"]
    return verdicts, "\n".join(lines)


def measure_no_budget(problems: list, rounds: int) -> list[dict]:
    """auto and tape.jacobian on each problem, interleaved in one process."""
    return [
        {
            "problem": name,
            "sizes": sizes,
            **_run(name, sizes, ["auto", "jacobian"], rounds),
        }
        for name, sizes in tqdm(problems, desc="auto vs tape.jacobian", file=sys.stderr)
    ]


def render_no_budget(raw: list[dict]) -> str:
    lines = [
        "| problem | auto ran | auto time (s) | tape.jacobian time (s) "
        "| jacobian / auto (medians) | jacobian / auto (paired) | auto peak "
        "| jacobian peak |",
        "|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    for found in raw:
        name, auto, jac = found["problem"], found["auto"], found["jacobian"]
        if "error" in auto or "error" in jac:
            why = auto.get("error") or jac.get("error")
            lines.append(f"| {name} | failed: {why} | | | | | | |")
            continue
        lines.append(
            f"| {name} | {auto.get('ran', auto['chosen'])} | {auto['steady_s']:.4f} | "
            f"{jac['steady_s']:.4f} | {jac['steady_s'] / auto['steady_s']:.2f}x | "
            f"{_paired(jac['times'], auto['times']):.2f}x | "
            f"{_mib(auto['steady_peak'])} | {_mib(jac['steady_peak'])} |"
        )
    return "\n".join(lines)


def render(raw: dict) -> tuple[list[dict], str]:
    verdicts, budget_table = render_budgets(raw["budgets"])
    rounds = raw["rounds"]
    text = "\n".join(
        [
            "# auto under memory budgets",
            "",
            f"Machine: {raw['machine']}. Generator sizes: {raw['sizes']}; "
            "target = the first Conv1D.",
            "",
            "Peaks: each strategy, and auto at each budget, alone in a fresh "
            "process: its first call, every call until auto settles (every "
            "candidate tried, or none worth its tracing), and a steady call. "
            "Times: "
            f"{rounds} interleaved rounds in one process (each round calls "
            "every label once, so a load change on this shared machine hits "
            "every label alike), after auto has settled. Ratios: of the "
            "medians, and the median of the per-round (paired) ratios.",
            "",
            budget_table,
            "",
            "## No budget: auto against tape.jacobian (pfor, inside tf.function)",
            "",
            f"Each problem in one process, {rounds} interleaved rounds.",
            "",
            render_no_budget(raw["no_budget"]),
            "",
        ]
    )
    return verdicts, text


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--quick", action="store_true", help="small sizes, two budgets")
    parser.add_argument(
        "--rounds", type=int, default=7, help="interleaved timing rounds (median)"
    )
    parser.add_argument(
        "--render",
        action="store_true",
        help="only rewrite OUT/auto_budgets.md from OUT/auto_budgets.json",
    )
    args = parser.parse_args()
    if args.render:
        raw = json.loads((args.out / "auto_budgets.json").read_text())
    else:
        import tensorflow as tf

        sizes = QUICK_GENERATOR if args.quick else GENERATOR
        budgets = QUICK_BUDGETS if args.quick else BUDGETS
        problems = (
            [("generator", QUICK_GENERATOR)] if args.quick else NO_BUDGET_PROBLEMS
        )
        python = platform.python_version()
        raw = {
            "machine": f"{platform.machine()}, {os.cpu_count()} cores, Python "
            f"{python}; TensorFlow {tf.__version__}; "
            f"CPU {runtime.cpu_kind().describe()}",
            "sizes": sizes,
            "rounds": args.rounds,
            "budgets": measure_budgets(sizes, budgets, args.rounds),
            "no_budget": measure_no_budget(problems, args.rounds),
        }
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "auto_budgets.json").write_text(json.dumps(raw, indent=1))
    verdicts, text = render(raw)
    (args.out / "auto_budgets.md").write_text(text)
    print(text)
    return 0 if all(v["within"] for v in verdicts) else 1


if __name__ == "__main__":
    sys.exit(main())
