"""Per-layer DP-SGD steps (``make_private(..., per_layer=True)``): one
clipped-sum call for every layer (``jk.ClippedSum(groups=...)``) against the
former one call per layer, paired in one process.

Sides, each with its own twin model (same weights), SGD, ``train_on_batch``
on the same Poisson batch (``PoissonSampler(seed=0)[0]``, padded) again and
again:

- ``one``: the compiled step, one ``jk.function`` for every layer (what
  ``fit`` runs now);
- ``per_group``: the compiled step with one ``jk.function`` per layer (the
  former design, refused before this change for its ordering bug: for cost
  only, rebuilt here);
- ``eager_one``: ``run_eagerly=True``, one ``jk.jacobian`` call;
- ``eager_per_group``: ``run_eagerly=True``, one ``jk.jacobian`` per layer
  (what per-layer clipping ran before this change, the only exact way).

A round runs ``--steps`` steps of each side, the sides' order rotating;
reported: each side's median step over its steps, and its ratio to ``one``
(per round, the median over rounds), the first step (the trace, or the
eager plan) apart. Models: ``benchmarks/privacy_fit.py``'s conv net and BERT
tiny. The machine was shared (loaded), so only ratios mean much.

    python benchmarks/privacy_per_layer.py --out benchmarks/results/cpu
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import sys
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE / "peers"))

import protocol  # noqa: E402

SIDES = ("one", "per_group", "eager_one", "eager_per_group")


def _per_group_sums(model, data, variables, clipping, loss, training):
    """The former eager step: one ``jk.jacobian`` per clipping group."""
    import tensorflow as tf

    import jacobkit as jk

    sums = [None] * len(variables)
    squares = None
    for group, clip in zip(clipping.groups, clipping.clips, strict=True):
        result = jk.jacobian(
            model,
            data,
            [variables[i] for i in group],
            outputs=loss,
            reduce=jk.ClippedSum(clip),
            training=training,
        )
        for i, value in zip(group, result.jacobians.values(), strict=True):
            sums[i] = tf.cast(value, variables[i].dtype)
        norms = tf.convert_to_tensor(result.norms)
        squares = norms**2 if squares is None else squares + norms**2
    return sums, tf.sqrt(squares)


def _per_group_traced():
    """The former compiled step: one ``jk.function`` per clipping group."""
    import tensorflow as tf

    import jacobkit as jk
    from jacobkit.privacy.traced import TracedSums

    class PerGroup(TracedSums):
        def __init__(self, model, variables, clipping, loss, training, example, sizes):
            self.sizes = tuple(sizes)
            self.count = len(variables)
            self.functions = []
            for group, clip in zip(clipping.groups, clipping.clips, strict=True):
                fn = jk.function(
                    model,
                    [variables[i] for i in group],
                    example=example,
                    outputs=loss,
                    reduce=jk.ClippedSum(clip),
                    training=training,
                )
                self.functions.append((fn, dict(zip(fn.variables, group))))

        def at_size(self, data, size):
            from jacobkit.privacy.traced import _padded

            x, y, w = data
            fed = (
                tf.nest.map_structure(lambda t: _padded(t, size, False), x),
                tf.nest.map_structure(lambda t: _padded(t, size, False), y),
                _padded(w, size, True),
            )
            sums = [None] * self.count
            squares = 0.0
            rows = []
            for fn, keys in self.functions:
                out = fn(fed)
                for key, i in keys.items():
                    sums[i] = out.values[key]
                squares = squares + tf.square(tf.cast(out.norms, tf.float32))
                rows.append(out.rows)
            given = [] if rows[0] is None else [tf.cast(rows[0], tf.float32)]
            return (*sums, tf.sqrt(squares), *given)

    return PerGroup


def _run(name: str, rounds: int, steps: int) -> dict[str, Any]:
    import keras

    import jacobkit as jk
    from benchmarks import privacy_fit
    from jacobkit.privacy import model as private_model
    from jacobkit.privacy import step as private_step

    build, x, y, loss = privacy_fit._case(name)
    n, expected = privacy_fit.SIZES[name]
    q = expected / n
    sampler = jk.privacy.PoissonSampler((x, y), q, seed=0)
    xb, yb, wb = sampler[0]
    own_sums = private_step.clipped_sums
    own_traced = private_model.TracedSums
    per_group = _per_group_traced()

    models: dict[str, Any] = {}
    for side in SIDES:
        private = jk.privacy.make_private(
            build(),
            l2_norm_clip=1.0,
            noise_multiplier=1.0,
            sampling_rate=q,
            num_examples=n,
            per_layer=True,
        )
        eager = side.startswith("eager")
        private.compile(keras.optimizers.SGD(0.01), loss, run_eagerly=eager)
        if not eager:
            private_model.TracedSums = per_group if side == "per_group" else own_traced
            try:
                private.prepare(sampler)
            finally:
                private_model.TracedSums = own_traced
        models[side] = private

    def step(side: str) -> None:
        if side == "eager_per_group":
            private_step.clipped_sums = _per_group_sums
        try:
            models[side].train_on_batch(xb, yb, sample_weight=wb)
        finally:
            private_step.clipped_sums = own_sums

    sides = {side: functools.partial(step, side) for side in SIDES}
    first = {side: protocol.timed(call) for side, call in sides.items()}
    found = protocol.rotated(sides, rounds, steps)
    times = {side: [t for round_ in found[side] for t in round_] for side in SIDES}
    ratios = {
        side: [
            statistics.median(mine) / statistics.median(one)
            for mine, one in zip(found[side], found["one"])
        ]
        for side in SIDES
    }
    groups = len(models["one"].clipping.groups)
    return {
        "model": name,
        "batch": len(wb),
        "groups": groups,
        "first_s": first,
        "median_ms": {s: 1e3 * statistics.median(t) for s, t in times.items()},
        "ratio_to_one": {s: statistics.median(r) for s, r in ratios.items()},
    }


def _table(rows: list[dict]) -> str:
    lines = [
        "| model | layers | batch | side | median step (ms) | / one | first step (s) |",
        "|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        for side in SIDES:
            lines.append(
                f"| {row['model']} | {row['groups']} | {row['batch']} | {side} | "
                f"{row['median_ms'][side]:.1f} | {row['ratio_to_one'][side]:.2f} | "
                f"{row['first_s'][side]:.1f} |"
            )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="convnet,bert")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    rows = [_run(m, args.rounds, args.steps) for m in args.models.split(",")]
    table = _table(rows)
    print(table)
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "privacy_per_layer.json").write_text(json.dumps(rows, indent=1))
        (args.out / "privacy_per_layer.md").write_text(
            "# Per-layer DP-SGD steps: one call for every layer, or one per layer\n\n"
            "`python benchmarks/privacy_per_layer.py --out benchmarks/results/cpu` "
            f"({args.rounds} rounds of {args.steps} steps per side, the order "
            "rotating; `/ one`: per round, a side's median step over the one-call "
            "compiled step's, the median over rounds). Measured on a shared, "
            "loaded machine (2 cores, other jobs running): absolute times are "
            "inflated, only the paired ratios mean much. `per_group`: the former "
            "compiled step (refused for its ordering bug), for cost only; "
            "`eager_per_group`: what per-layer clipping ran before.\n\n" + table + "\n"
        )


if __name__ == "__main__":
    main()
