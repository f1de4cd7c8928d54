"""Where the conv net's clipped sum and Gram matrix spend their time beyond a
plain step (``benchmarks/results/cpu/conv_reductions_profile.md``); with
``--case gpt2`` (or ``bert``, ``bert_small``), the reductions benchmark's
other models (``benchmarks/results/cpu/gpt2_gram_profile.md``,
``benchmarks/results/cpu/bert_small_gram_profile.md``).

    taskset -c 1 python benchmarks/conv_reductions_profile.py profile
    taskset -c 1 python benchmarks/conv_reductions_profile.py paired \\
        --variants default,filters --rounds 9
    taskset -c 1 python benchmarks/conv_reductions_profile.py paired \\
        --case gpt2 --sides gram --variants default,tied_before,tables_added
    taskset -c 1 python benchmarks/conv_reductions_profile.py paired \\
        --case bert_small --variants default,activation_beside --rounds 11

- ``profile``: TensorFlow's profiler over ``--calls`` steady calls of the
  plain step, the clipped sum (``jk.ClippedSum(1.0)``, loss rows, every
  trainable variable) and ``jk.gram`` (loss rows) of the reductions
  benchmark's conv net (``reductions_models.convnet``, batch 32): per call,
  each op type's milliseconds and count, and the wall time less the ops'
  (the Python side and TensorFlow's dispatch). Each side's compiled
  function runs its ops on one thread, so the op events do not overlap.
- ``paired``: each variant (:data:`VARIANTS`: a setting of jacobkit's
  module constants or functions, read when a call is traced) on its own copy of the
  model (the same weights; its own plan and trace), the clipped sum and
  the Gram matrix of every variant and the plain step timed in rounds of
  ``PAIRED_CALLS`` calls each, the order rotating; per variant the median
  ratio to the plain step of the same round, of wall times and of this
  process's CPU times (on a loaded machine the CPU time leaves out the
  time other processes held the core), and the largest difference from
  the first variant's results.

One JSON line on stdout. Pinned to one core, one TensorFlow thread
(``footing.pin_tensorflow``); with ``TF_ENABLE_ONEDNN_OPTS=0`` in the
environment, TensorFlow's own kernels (the oneDNN-off kind).
"""

from __future__ import annotations

import argparse
import bisect
import collections
import glob
import json
import os
import re
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
#: steady calls per side and round of ``paired``
PAIRED_CALLS = 5

#: each variant: (module, constant, value) settings, applied before its
#: model's first calls trace and kept for its steady calls
VARIANTS: dict[str, tuple[tuple[str, str, Any], ...]] = {
    "default": (),
    # one Conv2DBackpropFilter per example on every CPU kind
    "filters": (
        ("jacobkit.layers.conv", "ONEDNN_EXAMPLE_FILTER_MACS", 0),
        ("jacobkit.layers.conv", "EIGEN_EXAMPLE_FILTER_MACS", 0),
    ),
    # the patches' batched matmul on every CPU kind
    "patches": (
        ("jacobkit.layers.conv", "ONEDNN_EXAMPLE_FILTER_MACS", float("inf")),
        ("jacobkit.layers.conv", "EIGEN_EXAMPLE_FILTER_MACS", float("inf")),
    ),
    # a tied LM head's per-example tables as the einsum they were before
    # (GPT-2; ``reverse_tables`` replaced)
    "einsum_head": (("jacobkit.layers.tables", "reverse_tables", "einsum"),),
    # a tied table's lookups as a table of their own, added to the reverse
    # call's (no ``shared_gradients``: each call's rows formed and added)
    "tables_added": (
        (
            "jacobkit.layers.embedding:ReversibleEmbeddingRule",
            "shared_gradients",
            "none",
        ),
    ),
    # a call whose activation is several ops (GELU) computed again beside
    # the model, its cotangent carried back through that copy, as before
    # ``jacobkit.keras.pre_activation``'s walk to its own z
    "activation_beside": (("jacobkit.keras.pre_activation", "ACTIVATION_OPS", 0),),
    # both: GPT-2's Gram as it was before them
    "tied_before": (
        ("jacobkit.layers.tables", "reverse_tables", "einsum"),
        (
            "jacobkit.layers.embedding:ReversibleEmbeddingRule",
            "shared_gradients",
            "none",
        ),
    ),
}


def _einsum_tables(inputs: Any, g: Any) -> Any:
    """The tied head's per-example tables as they were formed before
    ``reverse_tables``: ``einsum("bpd,bkpv->bkvd")``."""
    import tensorflow as tf

    batch, rows, _, vocabulary = g.shape
    found = tf.einsum("bpd,bkpv->bkvd", inputs, g)
    return tf.reshape(found, (batch * rows, vocabulary, inputs.shape[-1]))


def _no_shared(self: Any, *args: Any, **kwargs: Any) -> None:
    return None


#: the values :data:`VARIANTS` name by a string (functions)
_VALUES = {"einsum": _einsum_tables, "none": _no_shared}


def _owner(path: str) -> Any:
    """A module, or ``module:Class``."""
    import importlib

    module, _, attribute = path.partition(":")
    found = importlib.import_module(module)
    return getattr(found, attribute) if attribute else found


def _setup() -> tuple[dict, Any]:
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    sys.path.insert(0, str(HERE))
    sys.path.insert(0, str(HERE / "peers"))
    import footing

    record = footing.pin_tensorflow("conv_reductions_profile")
    import reductions_models

    return record, reductions_models


def _sides(built: Any, models: Any) -> dict[str, Callable[[], Any]]:
    import numpy as np
    from reductions import plain_step

    import jacobkit as jk

    loss = jk.Loss(models.loss(built.name))
    variables = built.model.trainable_variables

    def clipped() -> list:
        found = jk.jacobian(
            built.model,
            (built.x, built.y),
            variables,
            outputs=loss,
            reduce=jk.ClippedSum(1.0),
        )
        return [np.asarray(v) for v in found.values()]

    def gram() -> Any:
        return jk.gram(built.model, (built.x, built.y), outputs=loss).matrix

    return {"plain step": plain_step(built), "clipped sum": clipped, "gram": gram}


def _apply(variant: str) -> None:
    for module, name, value in VARIANTS[variant]:
        setattr(_owner(module), name, _VALUES.get(value, value))


def _restore(saved: list[tuple[Any, str, Any]]) -> None:
    for module, name, value in saved:
        setattr(module, name, value)


def _saved(variant: str) -> list[tuple[Any, str, Any]]:
    found = []
    for module, name, _ in VARIANTS[variant]:
        owner = _owner(module)
        found.append((owner, name, getattr(owner, name)))
    return found


#: the clocks ``paired`` reads around each call: the wall, and this
#: process's CPU time (one thread on one core: the wall less the time other
#: processes held the core, what a loaded machine inflates least)
_CLOCKS = {"wall": time.perf_counter, "cpu": time.process_time}
#: the name of each call's own event in the trace, before its side's name
_SIDE = "conv_reductions_profile call "
#: an op's event on the host plane: "name:Type"
_OP = re.compile(r"^(?P<name>[^:]+):(?P<type>_?[A-Z][A-Za-z0-9_]*)$")


def _events(logdir: str) -> list[tuple[str, int, float]]:
    """Every host event of the trace in ``logdir``: ``(name, start in ns
    from the trace's start, ms)``."""
    from tensorflow.tsl.profiler.protobuf import xplane_pb2

    found = []
    for path in glob.glob(os.path.join(logdir, "**", "*.xplane.pb"), recursive=True):
        space = xplane_pb2.XSpace()
        with open(path, "rb") as f:
            space.ParseFromString(f.read())
        for plane in space.planes:
            if not plane.name.startswith("/host:"):
                continue
            names = {k: v.name for k, v in plane.event_metadata.items()}
            for line in plane.lines:
                for event in line.events:
                    begin = line.timestamp_ns + event.offset_ps // 1000
                    found.append(
                        (names[event.metadata_id], begin, event.duration_ps / 1e9)
                    )
    return found


def _durations(windows: list[tuple[int, int, str]]) -> list[float]:
    return [(end - begin) / 1e6 for begin, end, _ in windows]


def profile(rounds: int, variant: str, case: str = "convnet") -> dict:
    """The sides' steady calls alternating (the order rotating every
    round) under one profiler session, each inside an event of its own;
    each op event counted to the call whose event holds its start."""
    import tensorflow as tf

    record, models = _setup()
    _apply(variant)
    built = models.CASES[case]()
    sides = _sides(built, models)
    names = list(sides)
    for call in sides.values():
        for _ in range(5):  # first calls, and auto's trials settled
            call()
    logdir = tempfile.mkdtemp(prefix="conv_profile_")
    tf.profiler.experimental.start(logdir)
    for round_ in range(rounds):
        shift = round_ % len(names)
        for name in names[shift:] + names[:shift]:
            with tf.profiler.experimental.Trace(f"{_SIDE}{name}"):
                sides[name]()
    tf.profiler.experimental.stop()
    events = _events(logdir)
    windows = sorted(
        (begin, begin + int(ms * 1e6), event[len(_SIDE) :])
        for event, begin, ms in events
        if event.startswith(_SIDE)
    )
    starts = [w[0] for w in windows]
    # per side, per call: each op type's ms and count; each op's ms by name
    calls: dict[str, list[dict[str, list[float]]]] = {n: [] for n in names}
    named: dict[str, dict[str, list[float]]] = {n: {} for n in names}
    functions: dict[str, list[float]] = {n: [] for n in names}
    index = {}
    for at, (_, _, name) in enumerate(windows):
        index[at] = len(calls[name])
        calls[name].append(collections.defaultdict(lambda: [0.0, 0.0]))
        functions[name].append(0.0)
    for event, begin, ms in events:
        at = bisect.bisect_right(starts, begin) - 1
        if at < 0 or begin > windows[at][1]:
            continue
        name, k = windows[at][2], index[at]
        match = _OP.match(event)
        if match:
            calls[name][k][match["type"]][0] += ms
            calls[name][k][match["type"]][1] += 1
            named[name].setdefault(event, []).append(ms)
        elif event.startswith("EagerLocalExecute: __inference_"):
            functions[name][k] += ms
    out: dict[str, Any] = {"footing": record, "variant": variant, "rounds": rounds}
    for name in names:
        walls = [ms for (_, _, n), ms in zip(windows, _durations(windows)) if n == name]
        types = {t for call in calls[name] for t in call}
        ops = {
            t: [
                round(min(c[t][0] for c in calls[name]), 4),
                round(statistics.median(c[t][1] for c in calls[name]), 2),
            ]
            for t in types
        }
        out[name] = {
            "wall_ms": min(walls),
            "functions_ms": min(functions[name]),
            "ops_ms": min(sum(v[0] for v in c.values()) for c in calls[name]),
            "ops": ops,
            # each op's least time over the calls (a loaded machine's
            # preemptions land in some calls' events, not in all)
            "by_name": {
                e: round(min(v), 4)
                for e, v in sorted(named[name].items(), key=lambda kv: -min(kv[1]))
            },
        }
    return out


def paired(
    variants: list[str], rounds: int, sides_wanted: list[str], case: str = "convnet"
) -> dict:

    record, models = _setup()
    from jacobkit.bench import stats

    calls: dict[str, Callable[[], Any]] = {}
    results: dict[str, Any] = {}
    plain = None
    for variant in variants:
        saved = _saved(variant)
        _apply(variant)
        built = models.CASES[case]()
        sides = _sides(built, models)
        plain = plain or sides["plain step"]
        for side in sides_wanted:
            key = f"{variant} / {side}"
            calls[key] = sides[side]
            for _ in range(5):  # traced under the variant's settings
                results[key] = sides[side]()
        _restore(saved)
    assert plain is not None
    calls["plain step"] = plain
    for _ in range(3):
        plain()
    errors = {}
    for key, found in results.items():
        variant, side = key.split(" / ")
        want = results[f"{variants[0]} / {side}"]
        errors[key] = _difference(found, want)
    names = list(calls)
    # per round and side, the median wall and process CPU time of its calls
    medians: dict[str, dict[str, list[float]]] = {
        clock: {k: [] for k in names} for clock in _CLOCKS
    }
    for round_ in range(rounds):
        shift = round_ % len(names)
        order = names[shift:] + names[:shift]
        if round_ % 2:
            order = order[::-1]
        for name in order:
            times: dict[str, list[float]] = {clock: [] for clock in _CLOCKS}
            for _ in range(PAIRED_CALLS):
                start = {k: clock() for k, clock in _CLOCKS.items()}
                calls[name]()
                for k, clock in _CLOCKS.items():
                    times[k].append(clock() - start[k])
            for k in _CLOCKS:
                medians[k][name].append(statistics.median(times[k]))
    out: dict[str, Any] = {"footing": record, "rounds": rounds, "runs": {}}
    for name in names:
        row: dict[str, Any] = {"relative_difference": errors.get(name)}
        for k in _CLOCKS:
            mine, base = medians[k][name], medians[k]["plain step"]
            row[f"{k}_ms"] = 1e3 * statistics.median(mine)
            if name != "plain step":
                found = stats.ratios([a / b for a, b in zip(mine, base)])
                row[k] = [found.median, found.low, found.high]
        out["runs"][name] = row
    return out


def _difference(found: Any, want: Any) -> float:
    """The largest absolute difference of two results (an array, or a list
    of arrays) over the largest magnitude of ``want``'s array."""
    import numpy as np

    pairs = zip(found, want) if isinstance(want, list) else [(found, want)]
    worst = 0.0
    for a, b in pairs:
        a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
        scale = max(float(np.max(np.abs(b))), 1e-30)
        worst = max(worst, float(np.max(np.abs(a - b))) / scale)
    return worst


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("mode", choices=("profile", "paired"))
    parser.add_argument("--calls", type=int, default=20, help="profile: rounds")
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--variant", default="default", choices=sorted(VARIANTS))
    parser.add_argument("--variants", default="default,filters")
    parser.add_argument("--sides", default="clipped sum,gram")
    parser.add_argument(
        "--case",
        default="convnet",
        choices=("convnet", "bert", "gpt2", "bert_small"),
    )
    args = parser.parse_args()
    if args.mode == "profile":
        found = profile(args.calls, args.variant, args.case)
    else:
        found = paired(
            args.variants.split(","), args.rounds, args.sides.split(","), args.case
        )
    print(json.dumps(found))


if __name__ == "__main__":
    main()
