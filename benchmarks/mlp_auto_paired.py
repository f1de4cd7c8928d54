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
``TF_CPU_ALLOCATOR_USE_BFC=false`` for ``mlp_limit.py``'s setting. Prints
one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
os.environ["JACOBKIT_CACHE_DIR"] = ""

SIZES = {"batch": 256, "inputs": 512, "hidden": 1024, "features": 144}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--calls", type=int, default=60)
    args = parser.parse_args()

    import jacobkit as jk
    from jacobkit.strategies import Batch, While
    from jacobkit.testing import example_models

    example = example_models.mlp(**SIZES)
    model, x = example.model, example.inputs

    def call(strategy: object) -> object:
        result = jk.jacobian(model, x, "hidden1", strategy=strategy)
        result.kernel.numpy()
        return result.plan

    calls = 0
    plan = None
    while calls < args.calls and (plan is None or not plan.settled or calls < 3):
        plan = call("auto")
        calls += 1
    runs = {"auto": "auto", "batch": Batch(), "while(10)": While(10)}
    for strategy in runs.values():
        call(strategy)  # traced (auto: one more steady call)
    times: dict[str, list[float]] = {label: [] for label in runs}
    for round_ in range(args.rounds):
        order = list(runs) if round_ % 2 == 0 else list(runs)[::-1]
        for label in order:
            start = time.perf_counter()
            call(runs[label])
            times[label].append(time.perf_counter() - start)
    assert plan is not None
    out = {
        "onednn": os.environ.get("TF_ENABLE_ONEDNN_OPTS") != "0",
        "pooled_allocator": os.environ.get("TF_CPU_ALLOCATOR_USE_BFC") != "false",
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
    }
    print(json.dumps(out))


if __name__ == "__main__":
    main()
