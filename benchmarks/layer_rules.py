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

A second table measures the same on layers inside models users load
(``benchmarks/layer_rules_models.py``: keras_hub GPT-2, BERT, Gemma and ViT
blocks, a subclassed model, frozen ConvNeXtTiny and DenseNet121 backbones),
each case in a fresh process: its first call of per-example rows by
``batch`` (tracing and checks included) and the process's resident growth
over its calls are reported beside the steady figures.

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
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

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


def _resident() -> int:
    from jacobkit.bench import resident

    return resident.resident_bytes() or 0


def one_case(name: str, rounds: int) -> dict:
    """One model case, measured in this (fresh) process."""
    import layer_rules_models as models

    build, layer = models.CASES[name]
    model, x, kwargs = build()
    before = _resident()
    start = time.perf_counter()
    jk.jacobian(model, x, layer, strategy="batch", outputs="per_example", **kwargs)
    first = time.perf_counter() - start

    def call(strategy, outputs, reduce=None):
        return lambda: jk.jacobian(
            model, x, layer, strategy=strategy, outputs=outputs, reduce=reduce, **kwargs
        )

    calls = {
        "summed while": call("while", "features"),
        "summed batch": call("batch", "features"),
        "per-example batch": call("batch", "per_example"),
        "norms batch": call("batch", "per_example", "norm"),
        "auto": call("auto", "per_example"),
    }
    result = calls["per-example batch"]()
    arrays = [np.asarray(v) for v in result.jacobians.values()]
    del result
    calls["2 writes of the result"] = lambda: [a.copy().copy() for a in arrays]
    for fn in calls.values():
        fn()
    times: dict[str, list[float]] = {k: [] for k in calls}
    for _ in range(rounds):
        for key, fn in calls.items():
            times[key].append(_timed(fn))
    auto = calls["auto"]().strategy
    grown = _resident() - before
    steady = {key: statistics.median(t) for key, t in times.items()}
    return {"first": first, "growth": grown, "auto runs": auto, **steady}


def models_table(rounds: int) -> list[str]:
    import json
    import subprocess

    import layer_rules_models as models

    lines = [
        "",
        "## Layers inside models users load",
        "",
        f"Batch {models.BATCH}; each case in a fresh process: 'first' is its "
        "first per-example call by `batch` (tracing and the checks included), "
        "'growth' the process's resident growth over all its calls; steady ms "
        f"per call, median of {rounds} alternating rounds; 'auto' what the "
        "default call runs for per-example rows.",
        "",
        "| model / layer | summed | per-example batch | rows / (summed + 2 writes) "
        "| norms | norms / summed | first (s) | growth | auto |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    here = os.path.dirname(os.path.abspath(__file__))
    for name in models.CASES:
        done = subprocess.run(
            [sys.executable, __file__, "--case", name, "--rounds", str(rounds)],
            capture_output=True,
            text=True,
            cwd=os.path.dirname(here),
            check=True,
        )
        t = json.loads(done.stdout.strip().splitlines()[-1])
        summed = min(t["summed while"], t["summed batch"])
        rows = t["per-example batch"] / (summed + t["2 writes of the result"])
        lines.append(
            f"| {name} | {summed * 1e3:.2f} | {t['per-example batch'] * 1e3:.2f} | "
            f"{rows:.2f}x | {t['norms batch'] * 1e3:.2f} | "
            f"{t['norms batch'] / summed:.2f}x | {t['first']:.2f} | "
            f"{t['growth'] / 2**20:.0f} MiB | {t['auto runs']} |"
        )
        print(lines[-1], flush=True)
    return lines


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="bench-layer-rules")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--case", help="measure one model case (a child run)")
    parser.add_argument("--models-only", action="store_true")
    args = parser.parse_args(argv)
    if args.case:
        import json

        print(json.dumps(one_case(args.case, args.rounds)))
        return 0
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
    for block, layers in ({} if args.models_only else TARGETS).items():
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
    lines += models_table(args.rounds)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "layer_rules.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
