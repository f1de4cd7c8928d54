"""Per-example rows and norms by the layer rules, against the summed call.

On the transformer, attention and mobile blocks of
``tests/test_layer_rules.py`` (random
weights, batch 16), for each layer with a closed form, in one process,
steady (each traced first), alternating rounds (median):

- the summed call (``outputs="features"``): the fastest of ``while`` and
  ``batch``;
- per-example rows: ``batch`` (the closed form), ``while`` and ``jacobian``
  (``tape.jacobian``);
- per-example norms (``reduce="norm"``) by ``batch``;
- the time to write the per-example result's bytes twice (a copy).

Targets (the per-layer rules issue): per-example rows ≤ 1.5x the summed call
+ 2 writes of the result; norms ≤ 1.2x the summed call.

    python benchmarks/layer_rules.py --out benchmarks/results/cpu
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import jacobkit as jk  # noqa: E402
from tests import test_layer_rules as blocks  # noqa: E402

TARGETS = {
    "transformer": ["embedding", "query", "attention_output", "norm", "ffn"],
    "attention": ["mha"],
    "mobile": ["expand", "bn1", "depthwise", "bn2", "project", "separable"],
}


def _batch(x: np.ndarray, size: int) -> np.ndarray:
    reps = -(-size // len(x))
    return np.concatenate([x] * reps)[:size]


def _timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def measure(model, x, layer, rounds):
    def call(strategy, outputs, reduce=None):
        return lambda: jk.jacobian(
            model, x, layer, strategy=strategy, outputs=outputs, reduce=reduce
        )

    calls = {
        "summed while": call("while", "features"),
        "summed batch": call("batch", "features"),
        "per-example batch": call("batch", "per_example"),
        "per-example while": call("while", "per_example"),
        "per-example jacobian": call("jacobian", "per_example"),
        "norms batch": call("batch", "per_example", "norm"),
    }
    result = calls["per-example batch"]()
    arrays = [np.asarray(v) for v in result.jacobians.values()]
    calls["2 writes of the result"] = lambda: [a.copy().copy() for a in arrays]
    for fn in calls.values():
        fn()
    times = {name: [] for name in calls}
    for _ in range(rounds):
        for name, fn in calls.items():
            times[name].append(_timed(fn))
    return {name: statistics.median(t) for name, t in times.items()}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="bench-layer-rules")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--batch", type=int, default=16)
    args = parser.parse_args(argv)
    lines = [
        "# Per-example rows and norms by the layer rules",
        "",
        f"Machine: {platform.processor() or platform.machine()}, TF "
        f"{tf.__version__}; batch {args.batch}; steady ms per call, median of "
        f"{args.rounds} alternating rounds in one process. 'summed' is the "
        "fastest of while and batch on outputs='features'; 'target' is "
        "1.5 x summed + 2 writes for rows, 1.2 x summed for norms.",
        "",
        "| block | layer | summed | per-example batch | while | jacobian "
        "| rows / (summed + 2 writes) | norms | norms / summed |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for block, layers in TARGETS.items():
        model, x = getattr(blocks, f"_{block}")()
        x = _batch(x, args.batch)
        for layer in layers:
            t = measure(model, x, layer, args.rounds)
            summed = min(t["summed while"], t["summed batch"])
            rows = t["per-example batch"] / (summed + t["2 writes of the result"])
            lines.append(
                f"| {block} | {layer} | {summed * 1e3:.2f} | "
                f"{t['per-example batch'] * 1e3:.2f} | "
                f"{t['per-example while'] * 1e3:.2f} | "
                f"{t['per-example jacobian'] * 1e3:.2f} | {rows:.2f}x | "
                f"{t['norms batch'] * 1e3:.2f} | "
                f"{t['norms batch'] / summed:.2f}x |"
            )
            print(lines[-1], flush=True)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "layer_rules.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
