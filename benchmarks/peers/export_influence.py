"""Write the training-data attribution benchmark's data, its models' weights
and jacobkit's own scores (``jacobkit.explain``) to an ``.npz``, so the
PyTorch anchor (``influence_torch.py``) scores the very same models and checks
that it computes the same numbers.

The setup is ``notebooks/07_data_attribution.ipynb``'s: scikit-learn's digits
(``data / 16``, 64 features, float32), split by ``np.random.default_rng(0)``
into 1,000 training and 100 test examples, 10% of the training labels
flipped to another class; the MLP Dense 64→32 (relu, ``hidden``) → Dense
32→10 (logits, ``logits``), SGD(0.1, momentum 0.9), batch 64, sparse
cross-entropy from logits:

- the TracIn checkpoints: one training run (seed 0), kept after epochs 10, 20
  and 30;
- the TRAK ensemble: 10 models, model ``m`` trained for 30 epochs (seed
  ``5000 + m``) on the random half ``default_rng(5000 + m)`` picks.

The file holds ``x_train``, ``y_train``, ``x_test``, ``y_test``,
``flipped`` (the mask of flipped training labels), in Keras layouts (kernels
``(in, out)``) the checkpoints' weights stacked ``(3, ...)`` as
``checkpoint_<layer>_kernel`` / ``checkpoint_<layer>_bias`` and the
ensemble's ``(10, ...)`` as ``ensemble_<layer>_kernel`` /
``ensemble_<layer>_bias``, ``epochs`` (the checkpoints'), ``learning_rates``
(1 each, as passed) and ``dim`` (TRAK's); and jacobkit's references, all
float64: ``tracin`` ``(N_test, N_train)`` (``explain.tracin``),
``self_influence`` ``(N_train,)`` (``explain.self_influence``) and ``trak``
``(N_test, N_train)`` (``explain.trak(dim=dim, seed=0)``).

And, so that TRAK's own code can run with jacobkit's projections (the
projections are otherwise the only difference), ensemble model ``m``'s map
of each variable's gradient (flattened in its Keras layout) under
``jk.Project(dim, seed=m)``, as ``explain.trak`` draws it
(``jacobkit.problem.sketch.target_map``, internal), in the form jacobkit
applies it: a CountSketch's ``trak_map_<layer>_<part>_buckets`` ``(10,
size)`` int32 in ``[0, dim)`` and ``_signs`` ``(10, size)`` float32 ``±1``
(coordinate ``i`` times its sign added to its bucket: the peer applies them
so, one add per coordinate, not as the ``(size, dim)`` matrix they stand
for), or a Gaussian map's ``_dense`` ``(10, size, dim)`` (``jk.Project``'s
``small="gaussian"``); ``<part>`` is ``kernel`` or ``bias``. Checked here
against ``jk.jacobian(reduce=jk.Project)`` on a few examples.

    python benchmarks/peers/export_influence.py --out /tmp/influence.npz
"""

from __future__ import annotations

import argparse
import os
import time
from typing import Any

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402
from sklearn.datasets import load_digits  # noqa: E402

import jacobkit as jk  # noqa: E402
from jacobkit import explain  # noqa: E402
from jacobkit.explain.trak import MARGIN  # noqa: E402
from jacobkit.problem.sketch import target_map  # noqa: E402

LAYERS = ("hidden", "logits")
TRAIN, TEST = 1000, 100
EPOCHS = 30
KEEP = (EPOCHS // 3, 2 * EPOCHS // 3, EPOCHS)
ENSEMBLE = 10

Data = tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]


def data() -> Data:
    """``x_train, y_train, x_test, y_test, flipped``, split as the notebook
    splits them."""
    digits = load_digits()
    x = (digits.data / 16.0).astype("float32")
    y = digits.target.astype("int64")
    rng = np.random.default_rng(0)
    order = rng.permutation(len(x))
    x_train, y_clean = x[order[:TRAIN]], y[order[:TRAIN]]
    test = order[TRAIN : TRAIN + TEST]
    flipped = rng.choice(TRAIN, TRAIN // 10, replace=False)
    y_train = y_clean.copy()
    y_train[flipped] = (y_train[flipped] + rng.integers(1, 10, len(flipped))) % 10
    mask = np.zeros(TRAIN, bool)
    mask[flipped] = True
    return x_train, y_train, x[test], y[test], mask


def build(seed: int) -> keras.Model:
    keras.utils.set_random_seed(seed)
    model = keras.Sequential(
        [
            keras.Input((64,)),
            keras.layers.Dense(32, activation="relu", name="hidden"),
            keras.layers.Dense(10, name="logits"),
        ]
    )
    model.compile(
        keras.optimizers.SGD(0.1, momentum=0.9),
        keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    return model


def fit(
    x: np.ndarray, y: np.ndarray, seed: int, keep: tuple[int, ...] = ()
) -> tuple[keras.Model, list[keras.Model]]:
    """The model after ``EPOCHS`` epochs, and copies kept after the epochs
    in ``keep``."""
    model, kept = build(seed), []
    for epoch in range(1, EPOCHS + 1):
        model.fit(x, y, batch_size=64, epochs=1, verbose=0)
        if epoch in keep:
            copy = keras.models.clone_model(model)
            copy.set_weights(model.get_weights())
            kept.append(copy)
    return model, kept


def stacked(prefix: str, models: list[keras.Model]) -> dict[str, np.ndarray]:
    """Each layer's kernel and bias over ``models``, stacked on a new first
    axis."""
    arrays = {}
    for name in LAYERS:
        layers = [model.get_layer(name) for model in models]
        arrays[f"{prefix}_{name}_kernel"] = np.stack(
            [np.asarray(v.kernel) for v in layers]
        )
        arrays[f"{prefix}_{name}_bias"] = np.stack([np.asarray(v.bias) for v in layers])
    return arrays


def trak_maps(
    ensemble: list[keras.Model], x: np.ndarray, y: np.ndarray, dim: int
) -> dict[str, np.ndarray]:
    """Each ensemble model's projection map per variable, as ``explain.trak``
    (seed 0) draws them, as jacobkit holds them: a CountSketch's buckets and
    signs (a Gaussian map dense). Checked on the first examples of ``x``: the
    gradients mapped by these parts (in float64, one add per coordinate, by
    NumPy's ``bincount``) must give what ``jk.Project`` gives."""
    maps: dict[str, list[np.ndarray]] = {}
    for m, model in enumerate(ensemble):
        project = jk.Project(dim, m)
        few = (x[:8], y[:8])
        found = jk.jacobian(
            model, few, model.trainable_variables, outputs=MARGIN, progress=False
        )
        projected = jk.jacobian(
            model,
            few,
            model.trainable_variables,
            outputs=MARGIN,
            reduce=project,
            progress=False,
        ).projection
        total = np.zeros((len(few[0]), dim))
        for key in found.jacobians:  # "hidden/kernel"
            gradients = np.asarray(found[key], np.float64).reshape(len(few[0]), -1)
            shape = tuple(np.shape(found[key])[1:])
            mapped = target_map(project, key, shape)
            if mapped.kronecker:
                raise SystemExit(f"export_influence: {key}'s map is Kronecker")
            if mapped.sparse:  # a CountSketch: exported as jacobkit applies it
                assert mapped.buckets is not None and mapped.signs is not None
                parts = {"buckets": mapped.buckets, "signs": mapped.signs}
                total += np.stack(
                    [
                        np.bincount(mapped.buckets, row * mapped.signs, minlength=dim)
                        for row in gradients
                    ]
                )
            else:
                parts = {"dense": mapped.matrix()}
                total += gradients @ parts["dense"]
            name = "trak_map_" + key.replace("/", "_")
            for part, array in parts.items():
                maps.setdefault(f"{name}_{part}", []).append(array)
        want = np.asarray(projected)
        err = np.max(np.abs(total - want)) / np.max(np.abs(want))
        print(f"export_influence: model {m}'s maps give jk.Project's to {err:.1e}")
        if not err <= 1e-4:
            raise SystemExit(
                f"export_influence: the maps drawn here give model {m}'s "
                f"projections to {err:.1e}, not jk.Project's"
            )
    return {k: np.stack(v) for k, v in maps.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="influence.npz")
    parser.add_argument("--dim", type=int, default=64, help="TRAK's projection")
    args = parser.parse_args()
    start = time.perf_counter()
    x_train, y_train, x_test, y_test, flipped = data()
    train, test = (x_train, y_train), (x_test, y_test)
    _, checkpoints = fit(x_train, y_train, 0, keep=KEEP)
    ensemble = []
    for m in range(ENSEMBLE):
        half = np.random.default_rng(5000 + m).choice(TRAIN, TRAIN // 2, replace=False)
        ensemble.append(fit(x_train[half], y_train[half], 5000 + m)[0])
    print(f"trained in {time.perf_counter() - start:.1f} s")
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction=None)
    rates = [1.0] * len(checkpoints)
    arrays: dict[str, Any] = {
        "x_train": x_train,
        "y_train": y_train,
        "x_test": x_test,
        "y_test": y_test,
        "flipped": flipped,
        **stacked("checkpoint", checkpoints),
        **stacked("ensemble", ensemble),
        "epochs": np.asarray(KEEP),
        "learning_rates": np.asarray(rates),
        "dim": np.asarray(args.dim),
    }
    tracin = explain.tracin(checkpoints, train, test, loss=loss, learning_rates=rates)
    assert tracin.scores is not None, "the full matrix (no top_k)"
    arrays["tracin"] = np.asarray(tracin.scores, np.float64)
    arrays["self_influence"] = np.asarray(
        explain.self_influence(checkpoints, train, loss=loss, learning_rates=rates),
        np.float64,
    )
    trak = explain.trak(ensemble, train, test, dim=args.dim, seed=0)
    assert trak.scores is not None, "the full matrix"
    arrays["trak"] = np.asarray(trak.scores, np.float64)
    arrays.update(trak_maps(ensemble, x_train, y_train, args.dim))
    np.savez(args.out, **arrays)
    print(f"wrote {args.out} ({time.perf_counter() - start:.1f} s)")


if __name__ == "__main__":
    main()
