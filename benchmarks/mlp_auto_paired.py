"""``auto`` after its tries against each fixed strategy on the MLP at the
FLOP limit (Dense 512→1024 relu → 1024 tanh → 144, B=256, rows summed over
the batch, target the first Dense), paired in one process: on a loaded
machine, separate processes run at different moments, and their times
differ by more than the strategies do.

``auto`` is called until its plan settles (its tries done, at most
``--calls`` calls; no plan cache), every fixed strategy is traced, then each
round times one call of each (the order reversed from round to round), and
each time is the median of its rounds, each ratio the median of the rounds'
ratios to ``auto``'s. Pinned to one core as ``mlp_limit.py``'s runs are::

    taskset -c 0 python benchmarks/mlp_auto_paired.py --rounds 7

With the pooled allocator (jacobkit's default) ``auto`` measures peaks; set
``TF_CPU_ALLOCATOR_USE_BFC=false`` and ``--one-thread`` for
``mlp_limit.py``'s setting. Beside each wall time, each call's user CPU
time (what the call computed, less moved by other work on a loaded
machine) and how many of the timed calls traced. ``kept`` is the
configuration ``auto`` kept, called as a fixed strategy; ``while`` the
fixed strategy by name, as ``mlp_limit.py`` calls it. Prints one JSON
line.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import time
from typing import Any

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
os.environ["JACOBKIT_CACHE_DIR"] = ""

SIZES = {"batch": 256, "inputs": 512, "hidden": 1024, "features": 144}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--calls", type=int, default=60)
    parser.add_argument(
        "--one-thread",
        action="store_true",
        help="one intra- and inter-op thread, as mlp_limit.py's runs",
    )
    args = parser.parse_args()

    import jacobkit as jk
    from jacobkit.strategies import Batch, While
    from jacobkit.testing import example_models

    if args.one_thread:  # mlp_limit.py's footing: one intra- and inter-op thread
        import tensorflow as tf

        tf.config.threading.set_intra_op_parallelism_threads(1)
        tf.config.threading.set_inter_op_parallelism_threads(1)

    example = example_models.mlp(**SIZES)
    model, x = example.model, example.inputs

    def call(strategy: object, stats: bool = False) -> Any:
        result = jk.jacobian(model, x, "hidden1", strategy=strategy)
        result.kernel.numpy()
        return result.stats if stats else result.plan

    calls = 0
    plan = None
    while calls < args.calls and (plan is None or not plan.settled or calls < 3):
        plan = call("auto")
        calls += 1
    # "kept": the configuration auto kept, called as a fixed strategy (it
    # shares auto's compiled computation); "while": the fixed strategy by
    # name, as mlp_limit.py calls it (While(), a computation of its own)
    runs = {
        "auto": "auto",
        "kept": plan.strategy,
        "batch": Batch(),
        "while(10)": While(10),
        "while": "while",
    }
    for strategy in runs.values():
        call(strategy)  # traced (auto: one more steady call)
    times: dict[str, list[float]] = {label: [] for label in runs}
    # user CPU time per call: what the call computed, which other work on
    # a loaded machine slows less than the wall clock
    cpu: dict[str, list[float]] = {label: [] for label in runs}
    traced = {label: 0 for label in runs}
    for round_ in range(args.rounds):
        order = list(runs) if round_ % 2 == 0 else list(runs)[::-1]
        for label in order:
            before = resource.getrusage(resource.RUSAGE_SELF).ru_utime
            start = time.perf_counter()
            ran = call(runs[label], stats=True)
            times[label].append(time.perf_counter() - start)
            after = resource.getrusage(resource.RUSAGE_SELF).ru_utime
            cpu[label].append(after - before)
            traced[label] += int(ran.traced)
    assert plan is not None
    out = {
        "onednn": os.environ.get("TF_ENABLE_ONEDNN_OPTS") != "0",
        "pooled_allocator": os.environ.get("TF_CPU_ALLOCATOR_USE_BFC") != "false",
        "one_thread": args.one_thread,
        "load": os.getloadavg(),
        "auto_calls_to_settle": calls,
        "auto_ran": plan.strategy.label,
        "auto_settled": plan.settled,
        "switches": [str(s) for s in plan.switches],
        "steady_s": {k: statistics.median(v) for k, v in times.items()},
        "ratio_to_auto": {
            k: statistics.median(a / b for a, b in zip(v, times["auto"], strict=True))
            for k, v in times.items()
        },
        "user_cpu_s": {k: statistics.median(v) for k, v in cpu.items()},
        "user_cpu_ratio_to_auto": {
            k: statistics.median(a / b for a, b in zip(v, cpu["auto"], strict=True))
            for k, v in cpu.items()
        },
        "traced_in_rounds": traced,
    }
    print(json.dumps(out))


if __name__ == "__main__":
    main()
