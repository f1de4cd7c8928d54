"""What ``while``'s rows in flight (``parallel_iterations``) change on the
MLP at the FLOP limit (Dense 512→1024 relu → 1024 tanh → 144, B=256, every
feature's gradient summed over the batch with respect to the first Dense:
a 288 MiB result): each count's peak (TensorFlow's own count, its pooled
allocator) and steady time, against ``while(10)`` and ``batch``, paired in
one process.

Every strategy's first call (its trace) runs first; then each round calls
every strategy once, the order reversed from round to round, and each
strategy's time is the median of its rounds (its ratio to ``while(10)`` the
median of the rounds' ratios). Run it pinned to one core, as
``mlp_limit.py`` runs its children, with ``TF_ENABLE_ONEDNN_OPTS=0`` for
TensorFlow's own kernels::

    taskset -c 0 python benchmarks/while_parallel.py --rounds 7

Prints one JSON line, then a line per strategy.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
os.environ["JACOBKIT_CACHE_DIR"] = ""
# TensorFlow reports peaks on CPU with its pooled allocator only
os.environ.setdefault("TF_CPU_ALLOCATOR_USE_BFC", "true")

SIZES = {"batch": 256, "inputs": 512, "hidden": 1024, "features": 144}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()

    import tensorflow as tf

    import jacobkit as jk
    from jacobkit.strategies import Batch, While
    from jacobkit.testing import example_models

    example = example_models.mlp(**SIZES)
    model, x = example.model, example.inputs
    runs = {f"while({p})": While(p) for p in (1, 2, 4, 10)}
    runs["batch"] = Batch()

    def call(strategy: object) -> list:
        result = jk.jacobian(model, x, "hidden1", strategy=strategy)
        return [result.kernel.numpy(), result.bias.numpy()]

    first = {}
    for label, strategy in runs.items():
        start = time.perf_counter()
        call(strategy)
        first[label] = time.perf_counter() - start
    times: dict[str, list[float]] = {label: [] for label in runs}
    peaks: dict[str, list[float]] = {label: [] for label in runs}
    for round_ in range(args.rounds):
        order = list(runs) if round_ % 2 == 0 else list(runs)[::-1]
        for label in order:
            tf.config.experimental.reset_memory_stats("CPU:0")
            base = tf.config.experimental.get_memory_info("CPU:0")["current"]
            start = time.perf_counter()
            result = call(runs[label])
            times[label].append(time.perf_counter() - start)
            peak = tf.config.experimental.get_memory_info("CPU:0")["peak"] - base
            peaks[label].append(peak / 2**20)
            del result
    reference = times["while(10)"]
    out = {
        label: {
            "first_s": first[label],
            "steady_s": statistics.median(times[label]),
            "ratio_to_while10": statistics.median(
                a / b for a, b in zip(times[label], reference, strict=True)
            ),
            "peak_mib": max(peaks[label]),
            "peak_min_mib": min(peaks[label]),
        }
        for label in runs
    }
    onednn = os.environ.get("TF_ENABLE_ONEDNN_OPTS") != "0"
    print(
        json.dumps(
            {
                "onednn": onednn,
                "rounds": args.rounds,
                "load": os.getloadavg(),
                "runs": out,
            }
        )
    )
    for label, row in out.items():
        print(
            f"{label:10s} first {row['first_s']:.2f} s, steady "
            f"{row['steady_s']:.2f} s ({row['ratio_to_while10']:.2f}x while(10)), "
            f"peak {row['peak_min_mib']:.0f}-{row['peak_mib']:.0f} MiB"
        )


if __name__ == "__main__":
    main()
