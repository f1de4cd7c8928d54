"""``jk.privacy``'s DP step under ``model.fit`` against a plain step
(issue 49), in one process, paired.

On scikit-learn's digits (1,437 training examples), a 64-32-10 MLP, an
expected batch of 64 (Poisson, ``q = 64 / 1437``, padded to the sampler's
sizes), ``C = 1``, ``sigma = 1``, SGD:

- ``private compiled``: ``make_private(...).fit(sampler)`` (no
  ``run_eagerly``: the step on ``jk.function``);
- ``private eager``: the same with ``compile(run_eagerly=True)`` (the step
  on ``jk.jacobian``);
- ``plain``: the same model's stock ``fit`` on shuffled batches of 64.

Each is timed per epoch of 22 steps, after a first epoch that traces;
rounds interleave the three; reported: the median epoch and its ratio to
the plain one's.

    python benchmarks/privacy_fit.py --rounds 5
"""

from __future__ import annotations

import argparse
import statistics
import time
import warnings

from jacobkit import runtime

runtime.start_tensorflow_quietly()

import keras  # noqa: E402

import jacobkit as jk  # noqa: E402
from examples import dp_sgd  # noqa: E402

LOSS = keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction=None)


def _model() -> keras.Model:
    keras.utils.set_random_seed(0)
    return keras.Sequential(
        [
            keras.Input((64,)),
            keras.layers.Dense(32, activation="tanh"),
            keras.layers.Dense(10),
        ]
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    digits = dp_sgd.load_digits(0)
    x, y = digits.x_train, digits.y_train
    n = len(x)
    q = 64 / n
    runs = {}
    for name in ("private compiled", "private eager"):
        model = _model()
        private = jk.privacy.make_private(
            model,
            l2_norm_clip=1.0,
            noise_multiplier=1.0,
            sampling_rate=q,
            num_examples=n,
        )
        private.compile(
            keras.optimizers.SGD(0.5), LOSS, run_eagerly=name.endswith("eager")
        )
        sampler = jk.privacy.PoissonSampler((x, y), q, seed=0)
        runs[name] = lambda p=private, s=sampler: p.fit(s, epochs=1, verbose=0)
    plain = _model()
    plain.compile(
        keras.optimizers.SGD(0.5),
        keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    runs["plain"] = lambda: plain.fit(x, y, batch_size=64, epochs=1, verbose=0)
    first = {}
    for name, run in runs.items():
        start = time.perf_counter()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            run()
        first[name] = time.perf_counter() - start
    times: dict[str, list[float]] = {name: [] for name in runs}
    names = list(runs)
    for round_ in range(args.rounds):
        shift = round_ % len(names)
        for name in names[shift:] + names[:shift]:
            start = time.perf_counter()
            runs[name]()
            times[name].append(time.perf_counter() - start)
    base = statistics.median(times["plain"])
    print("| run | first epoch (s) | epoch (s, median) | per step (ms) | x plain |")
    print("|---|---|---|---|---|")
    for name in names:
        median = statistics.median(times[name])
        print(
            f"| {name} | {first[name]:.2f} | {median:.3f} | "
            f"{1e3 * median / 22:.1f} | {median / base:.1f} |"
        )


if __name__ == "__main__":
    main()
