"""Per-example gradient norms of a Conv1D kernel: the Gram ("ghost norm")
form against materializing chunks of rows, over the sequence length.

``jacobkit.layers.norms.use_gram`` predicts the Gram form cheaper where
``P² (I + K O) < K P I O`` (P positions, I kernel inputs per position, O
filters, K rows per example). This measures both forms on random inputs and
cotangents of the generator's first layer (kernel 5, 8 channels, 32 filters,
144 rows per example, B = 16) and records where the measured and predicted
crossovers fall.

    python benchmarks/norms_crossover.py --out benchmarks/results/cpu
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import tensorflow as tf  # noqa: E402

from jacobkit import layers  # noqa: E402
from jacobkit.layers import norms  # noqa: E402
from jacobkit.strategies.chunks import map_chunks  # noqa: E402

BATCH, CHANNELS, FILTERS, KERNEL, ROWS = 16, 8, 32, 5, 144
SEQUENCES = [4, 8, 16, 32, 64, 128]
REPEATS = 5


def measure(sequence: int) -> dict:
    layer = keras.layers.Conv1D(FILTERS, KERNEL, padding="same")
    x = tf.random.normal((BATCH, sequence, CHANNELS), seed=0)
    dz = tf.random.normal((BATCH, ROWS, sequence, FILTERS), seed=1)
    times = {}
    for form in ("gram", "chunks"):
        fn = tf.function(
            lambda x, dz, form=form: layers.rule_for(layer).norms(
                x, dz, summed=False, map_chunks=map_chunks, form=form
            )
        )
        fn(x, dz)  # trace
        samples = []
        for _ in range(REPEATS):
            start = time.perf_counter()
            [t.numpy() for t in fn(x, dz)]
            samples.append(time.perf_counter() - start)
        times[form] = statistics.median(samples)
    return {
        "sequence": sequence,
        "gram_s": times["gram"],
        "chunks_s": times["chunks"],
        "predicted_gram": norms.use_gram(sequence, KERNEL * CHANNELS, FILTERS, ROWS),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    runs = [measure(t) for t in SEQUENCES]
    lines = [
        "# Per-example norms: Gram form vs chunks of rows",
        "",
        "Conv1D(32, 5) on 8 channels, B = 16, 144 rows per example, random "
        "inputs and cotangents; median of 5 traced calls. Measured on a CPU "
        "shared with other jobs (2 cores, loaded): compare within a row.",
        "",
        "| sequence P | Gram | chunks | measured faster | predicted (use_gram) |",
        "|---:|---:|---:|---|---|",
    ]
    for run in runs:
        faster = "Gram" if run["gram_s"] < run["chunks_s"] else "chunks"
        predicted = "Gram" if run["predicted_gram"] else "chunks"
        lines.append(
            f"| {run['sequence']} | {run['gram_s'] * 1e3:.1f} ms | "
            f"{run['chunks_s'] * 1e3:.1f} ms | {faster} | {predicted} |"
        )
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "norms_crossover.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
