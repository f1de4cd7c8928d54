"""The ``structured`` strategy against the strategies without structure.

Within one process, on the built-in generator (Conv1D x3 with D filters →
linear Dense(F)): every strategy is called once (tracing, and for
``structured`` its first-call check), then the strategies are timed in
interleaved rounds, so that load on the machine hits them alike; each round
gives a paired ratio (best strategy without structure / structured), and the
table reports the median ratio. Peak memory is the median of three steady
calls (``jacobkit.memory.PeakMemory``; it moves between calls with the rows
in flight), and every result is checked against the fastest strategy without
structure (max relative difference) and with ``jk.verify``.

    python benchmarks/structure.py --out benchmarks/results/cpu   # ~10 min, 2 cores
    python benchmarks/structure.py --quick --out /tmp/structure   # ~1 min
    python benchmarks/structure.py --render --out benchmarks/results/cpu

Writes ``structure.json`` and ``structure.md`` to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path

import numpy as np
import tensorflow as tf

import jacobkit as jk
from jacobkit import memory, testing
from jacobkit.testing import examples

#: the issue's generator: B=64, T=128, D=32 filters, F=144 features
GENERATOR = {
    "batch": 64,
    "sequence": 128,
    "channels": 8,
    "filters": 32,
    "features": 144,
}
#: steady calls whose peak memory is measured (the median is reported)
PEAK_CALLS = 3
QUICK = {"batch": 8, "sequence": 32, "channels": 8, "filters": 8, "features": 32}

BASELINES = {
    "chunked(16)": lambda: jk.strategies.Chunked(16),
    "chunked(32)": lambda: jk.strategies.Chunked(32),
    "while": lambda: jk.strategies.While(),
    "batch": lambda: jk.strategies.Batch(),
    "jacobian": lambda: jk.strategies.Jacobian(),
}
STRUCTURED = {
    "structured(chunked)": lambda: jk.strategies.Structured("chunked"),
    "structured(while)": lambda: jk.strategies.Structured("while"),
    "structured(batch)": lambda: jk.strategies.Structured("batch"),
}

#: the peers' generator of the issue: C=16, Conv1D 64/128/128 -> Dense(144)
WIDE = {"channels": 16, "filters": 64, "filters2": 128, "filters3": 128}

#: (case id, target layer, outputs, size overrides, baselines, structured
#: configurations, the issue's target speedup or None)
CASES = [
    (
        "conv1-features",
        "conv1",
        "features",
        {},
        list(BASELINES),
        list(STRUCTURED),
        3.0,
    ),
    # separable channels: no inner strategy runs, one configuration says it all
    (
        "head-features",
        "head",
        "features",
        {},
        ["jacobian"],
        ["structured(while)"],
        9.0,
    ),
    # per-example rows: B x F of them; B=8 keeps the baselines' 1152 rows
    # within minutes on two cores
    (
        "conv1-per_example",
        "conv1",
        "per_example",
        {"batch": 8},
        list(BASELINES),
        list(STRUCTURED),
        2.0,
    ),
    # the peers' generator: D=128 of 144 leaves little to the linear head;
    # the head target is the side-by-side table (TF tape.jacobian
    # 313 ms, jacobkit while 311 ms, best peer 267 ms)
    (
        "wide-head-features",
        "head",
        "features",
        WIDE,
        ["jacobian", "while"],
        ["structured(while)"],
        None,
    ),
    (
        "wide-conv1-features",
        "conv1",
        "features",
        WIDE,
        ["while"],
        ["structured(while)"],
        None,
    ),
]


def _measure(ex, layer, outputs, labels, makers, rounds):
    found = {}
    for label in labels:
        strategy = makers[label]()
        start = time.perf_counter()
        try:
            result = jk.jacobian(
                ex.model, ex.inputs, layer, strategy=strategy, outputs=outputs
            )
        except (ValueError, tf.errors.ResourceExhaustedError) as err:
            found[label] = {"error": str(err)[:200]}
            continue
        found[label] = {
            "strategy": strategy,
            "first_s": time.perf_counter() - start,
            "times": [],
            "result": result,
        }
    ok = [label for label in labels if "error" not in found[label]]
    for _ in range(rounds):
        for label in ok:
            strategy = found[label]["strategy"]
            result = jk.jacobian(
                ex.model, ex.inputs, layer, strategy=strategy, outputs=outputs
            )
            found[label]["times"].append(result.stats.wall_time_s)
    # peaks move between calls (rows in flight depend on scheduling): the
    # median of PEAK_CALLS rounds, interleaved like the times
    peaks = {label: [] for label in ok}
    for _ in range(PEAK_CALLS):
        for label in ok:
            strategy = found[label]["strategy"]
            with memory.PeakMemory() as peak:
                jk.jacobian(
                    ex.model, ex.inputs, layer, strategy=strategy, outputs=outputs
                )
            peaks[label].append(peak.extra_bytes)
    for label in ok:
        found[label]["peak_bytes"] = int(statistics.median(peaks[label]))
        found[label]["peaks"] = peaks[label]
        found[label]["median_s"] = statistics.median(found[label]["times"])
    return found


def run_case(case, sizes, rounds):
    case_id, layer, outputs, changes, baselines, structured, target = case
    sizes = {**sizes, **changes}
    ex = examples.build("generator", **sizes)
    makers = {**BASELINES, **STRUCTURED}
    labels = baselines + structured
    found = _measure(ex, layer, outputs, labels, makers, rounds)
    base_ok = [b for b in baselines if "error" not in found[b]]
    best_base = min(base_ok, key=lambda b: found[b]["median_s"])
    struct_ok = [s for s in structured if "error" not in found[s]]
    best_struct = min(struct_ok, key=lambda s: found[s]["median_s"])
    reference = list(found[best_base]["result"].jacobians.values())
    rows = []
    for label in labels:
        entry = found[label]
        if "error" in entry:
            rows.append({"label": label, "error": entry["error"]})
            continue
        result = entry["result"]
        rows.append(
            {
                "label": label,
                "first_s": entry["first_s"],
                "median_s": entry["median_s"],
                "times": entry["times"],
                "peak_bytes": entry["peak_bytes"],
                "peaks": entry["peaks"],
                "max_rel_diff": max(
                    testing.max_relative_difference(a, b)
                    for a, b in zip(result.jacobians.values(), reference)
                ),
                "verify": jk.verify(
                    result, ex.model, ex.inputs, layer, outputs=outputs
                ),
            }
        )
    paired = [
        b / s for b, s in zip(found[best_base]["times"], found[best_struct]["times"])
    ]
    return {
        "case": case_id,
        "layer": layer,
        "outputs": outputs,
        "sizes": sizes,
        "num_rows": int(np.prod(found[best_base]["result"].rows_shape)),
        "best_baseline": best_base,
        "best_structured": best_struct,
        "speedup": statistics.median(paired),
        "speedup_range": [min(paired), max(paired)],
        "target": target,
        "peak_ratio": (
            found[best_struct]["peak_bytes"] / max(found[best_base]["peak_bytes"], 1)
        ),
        "rows": rows,
    }


def _changed(results, case) -> str:
    changed = {k: v for k, v in case["sizes"].items() if results["sizes"].get(k) != v}
    shown = {"batch": case["sizes"]["batch"], **changed}
    return ", ".join(f"{k}={v}" for k, v in shown.items())


def _target(case) -> str:
    return "—" if case["target"] is None else f"≥{case['target']:.0f}x"


def _mib(case, label) -> str:
    row = next(r for r in case["rows"] if r["label"] == label)
    return f"{row['peak_bytes'] / 2**20:.1f}"


def render(results) -> str:
    lines = [
        "# Structure: `structured` against the strategies without structure",
        "",
        f"Machine: {results['machine']}, TensorFlow {results['tensorflow']}, "
        f"{results['rounds']} interleaved rounds. **The machine was loaded** "
        "(two cores shared with other jobs while this ran): absolute times are "
        "noisy; the ratios are paired per round and their median is reported.",
        "",
        "Model: the built-in generator (`jacobkit.testing.examples.generator`), "
        + ", ".join(f"{k}={v}" for k, v in results["sizes"].items())
        + ". `structured` finds the linear head (D filters before Dense(F)) "
        "for `conv1`, and separable channels for the head itself. Per-example "
        "rows use B=8 (1152 rows), so that the strategies without structure run "
        "in minutes. A first call includes tracing and, for `structured`, its "
        "`jk.verify` check.",
        "",
        "| case | rows | best without structure | best structured | speedup "
        "(median, range) | issue's target | median peak (structured vs baseline) |",
        "|---|---:|---|---|---:|---:|---:|",
    ]
    for case in results["cases"]:
        low, high = case["speedup_range"]
        lines.append(
            f"| {case['case']} ({_changed(results, case)}) | {case['num_rows']} | "
            f"{case['best_baseline']} | {case['best_structured']} | "
            f"{case['speedup']:.1f}x ({low:.1f}-{high:.1f}) | "
            f"{_target(case)} | {_mib(case, case['best_structured'])} vs "
            f"{_mib(case, case['best_baseline'])} MiB |"
        )
    higher = [case["case"] for case in results["cases"] if case["peak_ratio"] > 1]
    if higher:
        lines += [
            "",
            f"Median peak above the baseline's in: {', '.join(higher)}. Peaks of "
            "strategies with several rows in flight (`while`) move between calls "
            "and processes with the scheduling (the per-call peaks are in "
            "`structure.json`); treat these as not shown to be lower.",
        ]
    for case in results["cases"]:
        lines += [
            "",
            f"## {case['case']}",
            "",
            "| strategy | first call s | median s | peak MiB | max rel diff vs "
            "best baseline | jk.verify |",
            "|---|---:|---:|---:|---:|---:|",
        ]
        for row in case["rows"]:
            if "error" in row:
                lines.append(f"| {row['label']} | refused: {row['error'][:90]} |||||")
                continue
            lines.append(
                f"| {row['label']} | {row['first_s']:.2f} | {row['median_s']:.4f} | "
                f"{row['peak_bytes'] / 2**20:.1f} | {row['max_rel_diff']:.1e} | "
                f"{row['verify']:.1e} |"
            )
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--rounds", type=int, default=None)
    parser.add_argument("--cases", nargs="*", default=None)
    parser.add_argument(
        "--render", action="store_true", help="only rewrite structure.md from the JSON"
    )
    args = parser.parse_args()
    out = Path(args.out)
    if args.render:
        results = json.loads((out / "structure.json").read_text())
        (out / "structure.md").write_text(render(results))
        return
    sizes = QUICK if args.quick else GENERATOR
    rounds = args.rounds or (3 if args.quick else 7)
    chosen = [c for c in CASES if args.cases is None or c[0] in args.cases]
    earlier = []
    if args.cases is not None and (out / "structure.json").exists():
        earlier = json.loads((out / "structure.json").read_text())["cases"]
    results = {
        "machine": f"{platform.machine()}, {platform.processor() or 'cpu'}, "
        f"{__import__('os').cpu_count()} CPUs",
        "tensorflow": tf.__version__,
        "rounds": rounds,
        "sizes": sizes,
        "cases": [run_case(case, sizes, rounds) for case in chosen],
    }
    ran = {case["case"] for case in results["cases"]}
    results["cases"] = [c for c in earlier if c["case"] not in ran] + results["cases"]
    out.mkdir(parents=True, exist_ok=True)
    (out / "structure.json").write_text(json.dumps(results, indent=1, default=str))
    (out / "structure.md").write_text(render(results))
    print(render(results))


if __name__ == "__main__":
    main()
