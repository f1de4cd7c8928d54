"""``jk.function`` in a compiled Keras ``train_step`` (issue 49).

On the reductions benchmark's conv net (``benchmarks/reductions_models.py``,
batch 32), in one process, paired:

- ``dp``: a model whose custom ``train_step`` takes the clipped sum of the
  per-example losses' gradients from a ``jk.function``
  (``jk.Loss``, ``jk.ClippedSum(1.0)``, every trainable variable) and
  applies it with SGD; ``plain``: the same model's stock ``train_step``
  (the mean loss's gradient, SGD). Both compiled (no ``run_eagerly``),
  stepped with ``train_on_batch``: the first step (tracing the step
  function, and for ``dp`` tracing the planned computation) and the
  steady step (median of interleaved rounds).
- the Python overhead of one compiled call: a ``tf.function`` around a
  ``jk.function`` on a tiny MLP (one example), against a trivial
  ``tf.function`` (``x + 1``) and the eager ``jk.jacobian`` of the same
  problem (which plans on every call).

    python benchmarks/compiled.py --out benchmarks/results/cpu
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path

import numpy as np


def _timed(fn, *args) -> float:
    start = time.perf_counter()
    out = fn(*args)
    _ = [np.asarray(v) for v in _leaves(out)]
    return time.perf_counter() - start


def _leaves(out):
    import tensorflow as tf

    return [t for t in tf.nest.flatten(out) if t is not None]


def _models(case_fn):
    import keras

    import jacobkit as jk

    def per_example_loss(y, logits):
        return keras.losses.sparse_categorical_crossentropy(y, logits, from_logits=True)

    class DP(keras.Model):
        def train_step(self, data):
            x, y, w = data
            out = self.fn((x, y, w))
            names = list(self.fn.variables)
            scale = 1.0 / 32
            self.optimizer.apply(
                [scale * out.values[n] for n in names],
                [self.fn.variables[n] for n in names],
            )
            return {"largest_norm": keras.ops.max(out.norms)}

    class EagerDP(keras.Model):
        """Before ``jk.function``: ``jk.jacobian`` in a step run eagerly."""

        def train_step(self, data):
            x, y, w = data
            found = jk.jacobian(
                self,
                (x, y, w),
                self.trainable_variables,
                outputs=jk.Loss(per_example_loss),
                reduce=jk.ClippedSum(1.0),
                cache=False,
            )
            self.optimizer.apply(
                [v / 32 for v in found.jacobians.values()], self.trainable_variables
            )
            return {"largest_norm": keras.ops.max(found.norms)}

    case = case_fn()
    plain = case.model
    dp = DP(plain.inputs, plain.outputs)
    dp.set_weights(plain.get_weights())
    w = np.ones(len(case.y), "float32")
    start = time.perf_counter()
    dp.fn = jk.function(
        dp,
        dp.trainable_variables,
        example=(case.x, case.y, w),
        outputs=jk.Loss(per_example_loss),
        reduce=jk.ClippedSum(1.0),
        cache=False,
    )
    dp.plan_s = time.perf_counter() - start
    dp.compile(optimizer=keras.optimizers.SGD(0.01))
    eager = EagerDP(plain.inputs, plain.outputs)
    eager.set_weights(plain.get_weights())
    eager.compile(optimizer=keras.optimizers.SGD(0.01), run_eagerly=True)
    plain.compile(
        optimizer=keras.optimizers.SGD(0.01),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    return case, {"dp": dp, "eager": eager, "plain": plain}, w


def steps(rounds: int) -> dict[str, float | str]:
    from benchmarks import reductions_models

    case, models, w = _models(reductions_models.convnet)
    first = {
        name: _timed(model.train_on_batch, case.x, case.y, w)
        for name, model in models.items()
    }
    times: dict[str, list[float]] = {name: [] for name in models}
    for _ in range(rounds):
        for name, model in models.items():
            times[name].append(_timed(model.train_on_batch, case.x, case.y, w))
    steady = {k: statistics.median(v) for k, v in times.items()}
    found: dict[str, float | str] = {"strategy": models["dp"].fn.strategy.label}
    found["dp_plan_s"] = models["dp"].plan_s
    for name in models:
        found[f"{name}_first_s"] = first[name]
        found[f"{name}_steady_ms"] = 1e3 * steady[name]
        found[f"{name}_ratio"] = steady[name] / steady["plain"]
    return found


def overhead(rounds: int) -> dict[str, float]:
    import keras
    import tensorflow as tf

    import jacobkit as jk

    keras.utils.set_random_seed(0)
    model = keras.Sequential(
        [keras.Input((4,)), keras.layers.Dense(3, name="head")], name="tiny"
    )
    x = np.ones((1, 4), "float32")
    kwargs = dict(reduce="norm", outputs="per_example", cache=False)
    compiled = tf.function(jk.function(model, "head", example=x, **kwargs))
    trivial = tf.function(lambda a: a + 1.0)
    xt = tf.constant(x)
    calls = {
        "compiled": lambda: compiled(xt),
        "trivial": lambda: trivial(xt),
        "eager": lambda: jk.jacobian(model, xt, "head", **kwargs).jacobians,
    }
    for call in calls.values():  # traced, planned
        call()
        call()
    times: dict[str, list[float]] = {k: [] for k in calls}
    for _ in range(rounds):  # blocks of 20 calls, interleaved
        for name, call in calls.items():
            start = time.perf_counter()
            for _ in range(20):
                out = call()
            _ = [np.asarray(v) for v in _leaves(out)]
            times[name].append((time.perf_counter() - start) / 20)
    found = {f"{k}_us": 1e6 * statistics.median(v) for k, v in times.items()}
    found |= {f"{k}_min_us": 1e6 * min(v) for k, v in times.items()}
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    import tensorflow as tf

    from jacobkit import runtime

    cpu = runtime.cpu_kind()
    found = steps(args.rounds)
    calls = overhead(args.rounds)
    lines = [
        "# jk.function in a compiled train_step (benchmarks/compiled.py)",
        "",
        f"Machine: {cpu.model} ({', '.join(cpu.flags) or 'no listed ISA flags'}), "
        f"{os.cpu_count()} cores shared with other jobs (loaded); TensorFlow "
        f"{tf.__version__}, oneDNN {'on' if cpu.onednn else 'off'}. Times move "
        "with the load: compare within a table, not across runs.",
        "",
        f"Conv net (batch 32), every variable, strategy `{found['strategy']}`; "
        f"`train_on_batch`, {args.rounds} interleaved rounds (median):",
        "",
        "| step | first (s, traced) | steady (ms) | x plain |",
        "|---|---:|---:|---:|",
    ]
    rows = {
        "plain": "plain Keras train_step (compiled)",
        "dp": "DP-SGD train_step, jk.function clipped sum (compiled)",
        "eager": "DP-SGD train_step, jk.jacobian clipped sum (run_eagerly=True)",
    }
    lines += [
        f"| {label} | {found[k + '_first_s']:.2f} | {found[k + '_steady_ms']:.1f} "
        f"| {found[k + '_ratio']:.2f} |"
        for k, label in rows.items()
    ]
    lines += [
        "",
        f"Planning the jk.function (eagerly, before fit): {found['dp_plan_s']:.2f} s.",
        "",
        "One call on a tiny model (Dense 4 -> 3, one example, norms): "
        f"{args.rounds} interleaved blocks of 20 calls, per call (median of "
        "the blocks; the fastest block, less moved by the load):",
        "",
        "| call | median (us) | fastest (us) |",
        "|---|---:|---:|",
    ]
    names = {
        "trivial": "trivial tf.function (x + 1)",
        "compiled": "tf.function around jk.function",
        "eager": "eager jk.jacobian (plans each call)",
    }
    lines += [
        f"| {label} | {calls[k + '_us']:.0f} | {calls[k + '_min_us']:.0f} |"
        for k, label in names.items()
    ]
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "compiled.md").write_text(text)


if __name__ == "__main__":
    main()
