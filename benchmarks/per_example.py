"""Per-example Jacobians at the price of summed ones (the batch strategy's
closed-form contraction, alone or inside the structured shortcut).

For the built-in generator (target ``conv1``), the MLP (target
``hidden1``) and a Conv1D model whose linear head has fewer inputs than
outputs (D=48 < F=64, target ``conv1``), at B = 16 and B = 64, measures in
one process:

- the default ``outputs="per_example"`` call (``auto``, what users get), and
  the closed forms it chooses between (``batch``, and ``structured(batch)``
  where a linear head applies),
- the same model's ``outputs="features"`` calls (``auto``, ``batch``,
  ``chunked(16)``, ``structured(batch)`` where it applies),
- ``outputs="per_example"`` with ``strategy="jacobian"`` (``tape.jacobian``),
  unless its predicted peak is too large for a shared machine,
- the time this machine takes to write the per-example result's bytes,

each traced first, then timed in interleaved rounds (median), and its peak
memory measured on one more call. All of it runs ``--processes`` times (3 by
default), each in a fresh process: these millisecond calls move by up to
1.4x between processes (the MLP's per-example call writes a 19-76 MB result,
and its time follows the machine's memory bandwidth), so each ratio is given
as the median over processes with its range. The targets (issue 10) are:
per-example steady time ≤ 1.5× the features call (here: the fastest one
measured), ≥ 10× faster than ``jacobian``, peak ≤ 2× the result + the
features call's peak. After timing, the per-example result is verified:
summed over the batch it must equal the features result, and it must equal
``jacobian``'s where that ran.

    python benchmarks/per_example.py --out benchmarks/results/cpu
    python benchmarks/per_example.py --quick --processes 1 --out /tmp/per_example
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import jacobkit as jk  # noqa: E402
from jacobkit import memory  # noqa: E402
from jacobkit.problem import Problem  # noqa: E402
from jacobkit.testing import examples

PROBLEMS = {
    "generator": {"sequence": 64, "channels": 8, "filters": 32, "features": 144},
    "mlp": {"inputs": 32, "hidden": 64, "features": 144},
    # issue 20's Conv1D model: a linear head on D=48 < F=64 channels makes
    # the summed call cheap (the structured shortcut computes 48 rows)
    "conv1d-head48": {
        "builder": "generator",
        "sequence": 64,
        "channels": 8,
        "filters": 32,
        "filters3": 48,
        "features": 64,
    },
}
BATCHES = [16, 64]
#: skip tape.jacobian when its predicted peak (from the B=16 run, growing as
#: B², rows × batch) exceeds this on a shared machine
JACOBIAN_LIMIT_BYTES = 4 * 2**30
ROUNDS = 5


def _call(ex, outputs, strategy):
    return jk.jacobian(
        ex.model, ex.inputs, ex.layer, outputs=outputs, strategy=strategy, cache=False
    )


def _peak(fn) -> int | None:
    try:
        with memory.PeakMemory("CPU:0") as peak:
            fn()
    except RuntimeError:
        return None
    return peak.extra_bytes


def write_seconds(num_bytes: int, repeats: int = 15) -> float:
    """The time this machine takes to write ``num_bytes`` into a fresh float32
    tensor (one ``tf.fill`` of a value passed in, so it is not folded into a
    constant): the least any call returning that many bytes can take."""
    fill = tf.function(lambda value: tf.fill([num_bytes // 4], value))
    value = tf.constant(1.0)
    fill(value)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        out = fill(value)
        times.append(time.perf_counter() - start)
        del out
    return statistics.median(times)


def _labels(ex, skip_jacobian: bool) -> dict:
    """label -> (outputs, strategy): the default calls (``auto``), each
    closed form alone, and ``tape.jacobian`` on the same rows."""
    labels = {
        "per_example (auto)": ("per_example", "auto"),
        "per_example (batch)": ("per_example", "batch"),
        "features (auto)": ("features", "auto"),
        "features (batch)": ("features", "batch"),
        "features (chunked 16)": ("features", jk.strategies.Chunked(16)),
    }
    with_batch = jk.strategies.Structured("batch")
    try:
        with_batch.check(Problem(ex.model, ex.inputs, ex.layer))
    except ValueError:
        pass  # no exact shortcut here
    else:
        labels["per_example (structured(batch))"] = ("per_example", with_batch)
        labels["features (structured(batch))"] = ("features", with_batch)
    if not skip_jacobian:
        labels["per_example (jacobian)"] = ("per_example", "jacobian")
    return labels


def measure(name: str, batch: int, sizes: dict, skip_jacobian: bool) -> dict:
    sizes = dict(sizes)
    ex = examples.build(sizes.pop("builder", name), batch=batch, **sizes)
    labels = _labels(ex, skip_jacobian)
    first, results = {}, {}
    for label, (outputs, strategy) in labels.items():
        start = time.perf_counter()
        results[label] = _call(ex, outputs, strategy)
        first[label] = time.perf_counter() - start
    times: dict[str, list[float]] = {label: [] for label in labels}
    for _ in range(ROUNDS):  # interleaved: load on the machine hits all alike
        for label, (outputs, strategy) in labels.items():
            start = time.perf_counter()
            _call(ex, outputs, strategy)
            times[label].append(time.perf_counter() - start)
    peaks = {
        label: _peak(lambda o=outputs, s=strategy: _call(ex, o, s))
        for label, (outputs, strategy) in labels.items()
    }
    per_example = results["per_example (auto)"]
    summed = [tf.reduce_sum(t, axis=0) for t in per_example.jacobians.values()]
    features = list(results["features (batch)"].jacobians.values())
    errors = {
        "sum over batch vs features": max(
            float(tf.reduce_max(tf.abs(a - b)) / tf.reduce_max(tf.abs(b)))
            for a, b in zip(summed, features)
        )
    }
    if "per_example (jacobian)" in results:
        errors["vs jacobian"] = max(
            float(tf.reduce_max(tf.abs(a - b)) / tf.reduce_max(tf.abs(b)))
            for a, b in zip(
                per_example.jacobians.values(),
                results["per_example (jacobian)"].jacobians.values(),
            )
        )
    result_bytes = sum(
        t.shape.num_elements() * t.dtype.size for t in per_example.jacobians.values()
    )
    return {
        "problem": name,
        "batch": batch,
        "sizes": sizes,
        "rows": int(np.prod(per_example.rows_shape)),
        "result_bytes": result_bytes,
        "write_s": write_seconds(result_bytes),
        "auto_ran": {
            label: str(results[label].strategy_config.label)
            for label in labels
            if labels[label][1] == "auto"
        },
        "steady_s": {k: statistics.median(v) for k, v in times.items()},
        "first_s": first,
        "peak_bytes": peaks,
        "relative_error": errors,
    }


def _fastest_features(run: dict) -> str:
    """The label of the fastest features call in this process."""
    found = [k for k in run["steady_s"] if k.startswith("features")]
    return min(found, key=run["steady_s"].get)


def _ratios(run: dict) -> dict[str, float | None]:
    """One process's ratios for one (problem, B), for the default
    per-example call (``auto``)."""
    steady, peaks = run["steady_s"], run["peak_bytes"]
    mine = steady["per_example (auto)"]
    fastest = _fastest_features(run)
    jac = steady.get("per_example (jacobian)")
    ratios: dict[str, float | None] = {
        "fastest": mine / steady[fastest],
        "auto": mine / steady["features (auto)"],
        # per-example beyond the fastest features call, in result writes
        "writes": (mine - steady[fastest]) / run["write_s"],
        "jacobian": jac / mine if jac else None,
    }
    mine_peak, theirs = peaks["per_example (auto)"], peaks[fastest]
    if mine_peak is None or theirs is None:
        ratios["peak"] = None
    else:
        ratios["peak"] = mine_peak / (2 * run["result_bytes"] + theirs)
    return ratios


def _spread(values: list[float | None], fmt: str) -> str:
    """``median (min-max)`` over processes, or ``?``."""
    values = [v for v in values if v is not None]
    if not values:
        return "?"
    median = format(statistics.median(values), fmt)
    if len(values) == 1:
        return median
    return f"{median} ({format(min(values), fmt)}-{format(max(values), fmt)})"


def render(processes: list[list[dict]], note: str) -> str:
    """``processes[i]`` holds process ``i``'s runs, one per (problem, B)."""
    lines = [
        "# Per-example Jacobians: closed-form batch strategy",
        "",
        note,
        "",
        "Steady time = median of interleaved calls of `jk.jacobian` after a "
        "first (tracing) call; peak = extra CPU memory of one more call "
        "(`jacobkit.memory.PeakMemory`, BFC allocator). Each measurement ran "
        f"in {len(processes)} fresh process(es): times and ratios are the "
        "median over processes, the range in brackets. Targets (issue 10): "
        "per-example ≤ 1.5× the features call, ≥ 10× faster than `jacobian`, "
        "peak ≤ 2× result + the features call's peak.",
        "",
        "| problem | B | rows | label | steady | first call | peak |",
        "|---|---:|---:|---|---:|---:|---:|",
    ]
    for same in zip(*processes):  # one (problem, B) in every process
        run = same[0]
        for label in run["steady_s"]:
            peaks = [r["peak_bytes"][label] for r in same]
            peak = max((p for p in peaks if p is not None), default=None)
            steady = _spread([r["steady_s"][label] * 1e3 for r in same], ".1f")
            first = statistics.median(r["first_s"][label] for r in same)
            lines.append(
                f"| {run['problem']} | {run['batch']} | {run['rows']} | {label} | "
                f"{steady} ms | {first:.2f} s | "
                f"{memory.format_bytes(peak) if peak is not None else '?'} |"
            )
    lines += [
        "",
        "The default per-example call (`auto`) against the fastest features "
        "call of the same process (`fastest`, named below), against the "
        "default features call, and against `jacobian` on the same rows. "
        "*Writes* = (per-example − fastest features) / the time this machine "
        "takes to write the per-example result's bytes (`tf.fill`, measured "
        "in the same process): what the per-example call costs beyond the "
        "features call, in result writes (1 = nothing beyond writing a "
        "B-times-larger result).",
        "",
        "| problem | B | auto ran | fastest features | per-example / fastest "
        "features | / features (auto) | writes | result write | jacobian / "
        "per-example | peak / (2 × result + fastest features' peak) | max rel. "
        "error |",
        "|---|---:|---|---|---:|---:|---:|---:|---:|---:|---|",
    ]
    for same in zip(*processes):
        run = same[0]
        ratios = [_ratios(r) for r in same]
        jac = _spread([r["jacobian"] for r in ratios], ".0f")
        fastest = sorted({_fastest_features(r) for r in same})
        ran = sorted({r["auto_ran"]["per_example (auto)"] for r in same})
        write = _spread([r["write_s"] * 1e3 for r in same], ".1f")
        errors = ", ".join(
            f"{k}: {max(r['relative_error'][k] for r in same):.1e}"
            for k in run["relative_error"]
        )
        lines.append(
            f"| {run['problem']} | {run['batch']} | {', '.join(ran)} | "
            f"{', '.join(f.split(' ', 1)[1][1:-1] for f in fastest)} | "
            f"{_spread([r['fastest'] for r in ratios], '.2f')} | "
            f"{_spread([r['auto'] for r in ratios], '.2f')} | "
            f"{_spread([r['writes'] for r in ratios], '.2f')} | {write} ms | "
            f"{f'{jac}×' if jac != '?' else 'not run (predicted peak too large)'}"
            f" | {_spread([r['peak'] for r in ratios], '.2f')} | {errors} |"
        )
    lines += ["", LAYER_RULES]
    return "\n".join(lines) + "\n"


#: where the per-layer rules' rows are recorded
LAYER_RULES = (
    "Per-example rows and norms of the transformer, attention and mobile "
    "blocks' layers (Embedding, EinsumDense, MultiHeadAttention, "
    "LayerNormalization, BatchNormalization, DepthwiseConv2D, SeparableConv2D) "
    "by their closed forms, next to `while` and `jacobian`: "
    "[layer_rules.md](layer_rules.md) (`benchmarks/layer_rules.py`)."
)


def measure_all(batches: list[int]) -> list[dict]:
    """Every (problem, B) in this process."""
    runs = []
    for name, sizes in PROBLEMS.items():
        jacobian_peak = None
        for batch in batches:
            skip = (
                jacobian_peak is not None
                and jacobian_peak * (batch / batches[0]) ** 2 > JACOBIAN_LIMIT_BYTES
            )
            run = measure(name, batch, sizes, skip)
            jacobian_peak = run["peak_bytes"].get("per_example (jacobian)")
            runs.append(run)
            print(json.dumps(run["steady_s"]), flush=True)
    return runs


def _in_fresh_process(quick: bool) -> list[dict]:
    """:func:`measure_all` in a child process (this script, ``--child``)."""
    with tempfile.TemporaryDirectory() as scratch:
        path = Path(scratch) / "runs.json"
        command = [sys.executable, __file__, "--child", str(path)]
        subprocess.run([*command, *(["--quick"] if quick else [])], check=True)
        return json.loads(path.read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path)
    parser.add_argument("--quick", action="store_true", help="B = 4 only")
    parser.add_argument(
        "--processes", type=int, default=3, help="fresh processes (default 3)"
    )
    parser.add_argument("--child", type=Path, help=argparse.SUPPRESS)
    parser.add_argument(
        "--note",
        default="Ratios within one process are meaningful; absolute times move "
        "with the machine's load (the load average below).",
    )
    args = parser.parse_args()
    batches = [4] if args.quick else BATCHES
    if args.child is not None:
        args.child.write_text(json.dumps(measure_all(batches)))
        return
    if args.out is None or args.processes < 1:
        parser.error("--out DIR is required, and --processes must be >= 1")
    processes = [_in_fresh_process(args.quick) for _ in range(args.processes)]
    args.out.mkdir(parents=True, exist_ok=True)
    machine = f"{platform.processor() or platform.machine()}, TF {tf.__version__}"
    if hasattr(os, "getloadavg"):
        machine += ", load average {:.1f} / {:.1f} / {:.1f} (1 / 5 / 15 min)".format(
            *os.getloadavg()
        )
    (args.out / "per_example.json").write_text(
        json.dumps({"machine": machine, "processes": processes}, indent=1) + "\n"
    )
    (args.out / "per_example.md").write_text(
        render(processes, f"{args.note} Machine: {machine}.")
    )


if __name__ == "__main__":
    main()
