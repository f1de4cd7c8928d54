"""The one-channel step (:mod:`jacobkit.problem.conv_channels`) on the
users' wide generator (B=64, T=128, C=16, Conv1D 64/128/128 -> Dense(144),
the first Conv1D's Jacobians for the 144 features): the default call with
the step (``after``) and without it (``before``: the linear head's 128 rows
each through conv3's dense input gradient), paired in one process.

Two copies of the model (the same weights), each planned by its own default
call; rounds alternate them, and each reports the median of the per-round
ratios (after / before). The GEMM probe of ``mlp_limit.py`` runs once a
round, so each time also reads as a share of the GEMM rate on its exact
work: :data:`BEFORE_FLOP` (every row through conv3's and conv2's input
gradients and conv1's kernel gradient) and :data:`AFTER_FLOP` (conv3's part
once, as one channel a row).

    TF_ENABLE_ONEDNN_OPTS=0 taskset -c 0 python benchmarks/conv_channels.py \\
        --rounds 5 --out benchmarks/results/cpu
    TF_ENABLE_ONEDNN_OPTS=1 taskset -c 0 python benchmarks/conv_channels.py \\
        --rounds 5 --out benchmarks/results/cpu

Each run adds its kind's section to ``conv_channels.json`` and the section
"One-channel cotangents" of ``conv_gradients.md`` is rewritten from it.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path
from typing import Any

from conv_gradients import ROWS, SIZES, WORK_FLOP, load_note, save_kind

_POSITIONS = SIZES["batch"] * SIZES["sequence"]
BEFORE_FLOP = WORK_FLOP
#: one row: conv3's one-channel cotangent (k=3, one channel -> 128), conv2's
#: input gradient (k=5, 64 -> 128), conv1's kernel gradient (k=5, 16 -> 64)
AFTER_FLOP = 2 * ROWS * _POSITIONS * (3 * 128 + 5 * 64 * 128 + 5 * 16 * 64)
HEADING = "## One-channel cotangents through conv3"
#: warm-up calls of each copy before the timed rounds (auto's trials)
WARM = 4


def measure(rounds: int) -> dict[str, Any]:
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    import numpy as np
    import tensorflow as tf

    tf.config.threading.set_intra_op_parallelism_threads(1)
    tf.config.threading.set_inter_op_parallelism_threads(1)
    import mlp_limit

    import jacobkit as jk
    from jacobkit import runtime
    from jacobkit.strategies import conv_channels
    from jacobkit.testing import examples

    step = {"on": True}
    own = conv_channels.supports
    # read when a copy's computation is built (its first calls), so each
    # copy keeps the way it was built with
    conv_channels.supports = lambda inner: step["on"] and own(inner)
    base = examples.build("generator", **SIZES)
    copies = {}
    for key in ("before", "after"):
        copy = examples.build("generator", **SIZES)
        copy.model.set_weights(base.model.get_weights())
        copies[key] = copy

    def call(key: str) -> tuple[np.ndarray, str]:
        step["on"] = key == "after"
        ex = copies[key]
        result = jk.jacobian(ex.model, ex.inputs, "conv1", outputs="features")
        # the strategy auto ran ("auto -> structured(while)")
        return np.asarray(result.kernel), str(result.plan).split(":")[0]

    first: dict[str, float] = {}
    found: dict[str, np.ndarray] = {}
    plans: dict[str, str] = {}
    for key in copies:
        for w in range(WARM):
            start = time.perf_counter()
            found[key], plans[key] = call(key)
            took = time.perf_counter() - start
            first.setdefault(key, took)
            print(f"warm {w} {key}: {took:.3f} s ({plans[key]})", flush=True)
    times: dict[str, list[float]] = {k: [] for k in copies}
    rates: list[float] = []
    for r in range(rounds):
        for key in copies:
            start = time.perf_counter()
            _, plan = call(key)
            took = time.perf_counter() - start
            times[key].append(took)
            assert plan == plans[key], (plan, plans[key])  # settled
            print(f"round {r} {key}: {took:.3f} s", flush=True)
        rates.append(mlp_limit.gemm_rate())
    scale = float(np.abs(found["before"]).max())
    work = {"before": BEFORE_FLOP, "after": AFTER_FLOP}
    rows = {
        key: {
            "plan": plans[key],
            "first_s": first[key],
            "steady_s": statistics.median(times[key]),
            "work_gflop": work[key] / 1e9,
            "of_gemm_rate": statistics.median(
                work[key] / t / 1e9 / g for t, g in zip(times[key], rates)
            ),
            "max_rel_diff": float(np.abs(found[key] - found["before"]).max()) / scale,
        }
        for key in copies
    }
    ratios = [a / b for a, b in zip(times["after"], times["before"])]
    rows["after"]["ratio_to_before"] = statistics.median(ratios)
    rows["after"]["ratios"] = ratios
    return {
        "kind": runtime.cpu_kind().describe(),
        "onednn": runtime.cpu_kind().onednn,
        "gemm_gflops": statistics.median(rates),
        "rounds": rounds,
        "rows": rows,
    }


def section(out: Path) -> list[str]:
    """The markdown section rendered from ``conv_channels.json`` (none if
    it is not there)."""
    path = out / "conv_channels.json"
    if not path.exists():
        return []
    every = json.loads(path.read_text())
    lines = [
        HEADING,
        "",
        "`python benchmarks/conv_channels.py` (see its docstring): the default "
        "call on the same wide generator with the one-channel step "
        "(`after`: each of the linear head's 128 rows is one channel of "
        "conv3's output, taken to conv3's input by a one-channel "
        "convolution) and without it (`before`: every row through conv3's "
        "dense input gradient); two copies of the model, alternating, one "
        "core, one thread; ratio = median of the rounds' after/before (their range). "
        "The share of the GEMM rate is on each one's exact work: before "
        f"{BEFORE_FLOP / 1e9:.1f} GFLOP, after {AFTER_FLOP / 1e9:.1f} GFLOP.",
        "",
    ]
    for name, data in sorted(every.items()):
        lines += [
            f"### {name}: {data['kind']}",
            "",
            f"GEMM probe {data['gemm_gflops']:.0f} GFLOP/s (median of one probe "
            f"a round); {data['rounds']} rounds after {WARM} warm-up calls "
            "each." + load_note(data),
            "",
            "| run | auto's plan | steady | first call | work | of the GEMM "
            "rate | after / before (paired) | max rel. diff |",
            "|---|---|---:|---:|---:|---:|---:|---:|",
        ]
        for key, row in data["rows"].items():
            ratio = row.get("ratio_to_before")
            spread = (
                f" ({min(row['ratios']):.2f}-{max(row['ratios']):.2f})"
                if "ratios" in row
                else ""
            )
            lines.append(
                f"| {key} | `{row['plan']}` | {row['steady_s']:.2f} s | "
                f"{row['first_s']:.2f} s | {row['work_gflop']:.1f} GFLOP | "
                f"{100 * row['of_gemm_rate']:.0f}% | "
                f"{'' if ratio is None else f'{ratio:.2f}{spread}'} | "
                f"{row['max_rel_diff']:.1e} |"
            )
        lines.append("")
    return lines


def write(out: Path, data: dict[str, Any], loaded: bool) -> None:
    """Add ``data`` to the kind's section of ``conv_channels.json``, and
    rewrite this section of ``conv_gradients.md`` (kept after the rest)."""
    save_kind(out / "conv_channels.json", data, loaded)
    render(out)


def render(out: Path) -> None:
    """This section of ``conv_gradients.md`` rewritten from
    ``conv_channels.json`` (kept after the rest)."""
    md = out / "conv_gradients.md"
    text = md.read_text() if md.exists() else ""
    text = text.split(HEADING)[0].rstrip("\n")
    md.write_text(text + "\n\n" + "\n".join(section(out)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--out", type=Path, default=Path("."))
    parser.add_argument("--loaded", action="store_true")
    parser.add_argument(
        "--render", action="store_true", help="only rewrite the markdown section"
    )
    args = parser.parse_args()
    if args.render:
        return render(args.out)
    write(args.out, measure(args.rounds), args.loaded)


if __name__ == "__main__":
    main()
