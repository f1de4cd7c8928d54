"""The Python side of steady calls on the reductions benchmark's conv net.

Per call, the wall time less the time spent executing the compiled
function (TensorFlow's ``Context.call_function``, timed by wrapping it): what
jacobkit's Python and TensorFlow's dispatch add around the computation.
Four calls, alternating in one process (rounds of ``CALLS`` steady calls
each, the order reversed every other round, after three first calls):

- ``clipped``: ``jk.jacobian(model, (x, y), model.trainable_variables,
  outputs=jk.Loss(...), reduce=jk.ClippedSum(1.0))``, values fetched;
- ``gram``: ``jk.gram(model, (x, y), outputs=jk.Loss(...)).matrix``;
- ``jacobian``: a plain ``jk.jacobian(model, x, "head")``;
- ``plain step``: the summed-gradient ``tf.function`` step of
  ``reductions.py`` (its Python side: converting the batch, the dispatch,
  fetching the gradients).

Prints one JSON line: per call, the median wall and Python milliseconds,
and each call's Python side beyond the plain step's. Run it pinned to one
core (``taskset -c 1``) with the jacobkit to measure on ``PYTHONPATH``.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
CALLS = 50
ROUNDS = 6


def main() -> None:
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    sys.path.insert(0, str(HERE))
    import numpy as np
    import reductions_models
    import tensorflow as tf
    from reductions import plain_step
    from tensorflow.python.eager import context

    import jacobkit as jk

    inside = [0.0]
    run = context.Context.call_function

    def timed(*args, **kwargs):
        start = time.perf_counter()
        try:
            return run(*args, **kwargs)
        finally:
            inside[0] += time.perf_counter() - start

    context.Context.call_function = timed
    built = reductions_models.convnet()
    model, x, y = built.model, built.x, built.y
    loss = jk.Loss(reductions_models.loss())
    variables = model.trainable_variables
    calls = {
        "clipped": lambda: [
            np.asarray(v)
            for v in jk.jacobian(
                model, (x, y), variables, outputs=loss, reduce=jk.ClippedSum(1.0)
            ).values()
        ],
        "gram": lambda: jk.gram(model, (x, y), outputs=loss).matrix,
        "jacobian": lambda: np.asarray(jk.jacobian(model, x, "head").kernel),
        "plain step": plain_step(built),
    }
    for call in calls.values():  # first calls
        for _ in range(3):
            call()
    wall: dict[str, list[float]] = {name: [] for name in calls}
    python: dict[str, list[float]] = {name: [] for name in calls}
    names = list(calls)
    for round_ in range(ROUNDS):
        for name in names if round_ % 2 == 0 else names[::-1]:
            for _ in range(CALLS):
                inside[0] = 0.0
                start = time.perf_counter()
                calls[name]()
                took = time.perf_counter() - start
                wall[name].append(took)
                python[name].append(took - inside[0])
    ms = {name: 1e3 * statistics.median(python[name]) for name in calls}
    print(
        json.dumps(
            {
                "tensorflow": tf.__version__,
                "calls": {
                    name: {
                        "wall_ms": 1e3 * statistics.median(wall[name]),
                        "python_ms": ms[name],
                        "beyond_plain_ms": ms[name] - ms["plain step"],
                    }
                    for name in calls
                },
            }
        )
    )


if __name__ == "__main__":
    main()
