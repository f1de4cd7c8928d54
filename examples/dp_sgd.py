"""DP-SGD on scikit-learn's digits with jacobkit, compiled.

Training: ``jk.privacy.make_private(model, ...)``, then ``compile`` and
``fit`` on a ``jk.privacy.PoissonSampler`` (no ``run_eagerly``), epsilon
per epoch by ``jk.privacy.EpsilonCallback`` (Google's ``dp-accounting``).
The same model is then trained without privacy for the same epochs, and a
DP step is timed against a plain one.

The mechanics, as a custom loop would write them (:func:`make_dp_step`,
what ``make_private``'s step does): ``jk.function(...,
reduce=jk.ClippedSum(C))`` for the sum of the per-example loss gradients
clipped to norm ``C`` (without holding the per-example gradients), planned
once on an example batch and called inside a ``tf.function``; Gaussian
noise of standard deviation ``noise_multiplier * C`` on every coordinate,
drawn from ``(seed, step)``; division by the expected batch size ``q * N``;
the optimizer's update.

Run from the repository's root (``docs/dp-sgd.md`` shows the output)::

    python examples/dp_sgd.py --epochs 15 --clip 1.0 --noise 1.1
"""

from __future__ import annotations

import argparse
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from jacobkit import runtime

# TensorFlow's C++ start-up lines (oneDNN, CUDA notices) stay off the output
runtime.start_tensorflow_quietly()

import keras  # noqa: E402 - after TensorFlow started quietly
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import jacobkit as jk  # noqa: E402

# dp-accounting's RDP accountant logs each order it leaves out (by absl)
logging.getLogger("absl").setLevel(logging.ERROR)

#: the delta the epsilon is reported at (below 1 / the 1,437 training examples)
DELTA = 1e-5
#: each example's own loss (``reduction=None``): one row per example
LOSS_FN = keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction=None)
LOSS = jk.Loss(LOSS_FN)


@dataclass(frozen=True)
class Digits:
    """scikit-learn's 8x8 digits, pixels scaled to [0, 1] and flattened.

    Attributes:
        x_train: shape ``(N, 64)``, float32.
        y_train: shape ``(N,)``, int32 labels 0 to 9.
        x_test: shape ``(M, 64)``, float32.
        y_test: shape ``(M,)``, int32.
    """

    x_train: np.ndarray
    y_train: np.ndarray
    x_test: np.ndarray
    y_test: np.ndarray


def load_digits(seed: int = 0) -> Digits:
    """The 1,797 digits split 80/20, stratified by class (1,437 to train,
    360 to test)."""
    try:
        from sklearn.datasets import load_digits as sklearn_digits
        from sklearn.model_selection import train_test_split
    except ModuleNotFoundError as err:
        raise SystemExit(
            "examples/dp_sgd.py: the digits come from scikit-learn; install it "
            "with `pip install scikit-learn`."
        ) from err
    images, labels = sklearn_digits(return_X_y=True)
    x = (images / 16.0).astype("float32")
    y = labels.astype("int32")
    x_train, x_test, y_train, y_test = train_test_split(
        x, y, test_size=0.2, stratify=y, random_state=seed
    )
    return Digits(x_train, y_train, x_test, y_test)


def build_model(seed: int = 0) -> keras.Model:
    """A small MLP, 64 -> 64 (tanh) -> 10 logits, with weights drawn from
    ``seed`` (the same seed gives the same initial weights)."""
    keras.utils.set_random_seed(seed)
    return keras.Sequential(
        [
            keras.Input((64,)),
            keras.layers.Dense(64, activation="tanh", name="hidden"),
            keras.layers.Dense(10, name="logits"),
        ]
    )


def make_dp_step(
    model: keras.Model,
    optimizer: keras.optimizers.Optimizer,
    example: tuple[Any, Any, Any],
    *,
    clip_norm: float,
    noise_multiplier: float,
    expected_batch_size: float,
    seed: int,
) -> Callable[[Any, Any, Any, Any], tf.Tensor]:
    """A compiled DP-SGD step ``step(x, y, w, t) -> norms`` on batches
    ``(x, y, w)`` of ``B`` examples (``w``: 1, or 0 for padding), ``t`` the
    step's number; planned on ``example``, one such batch.

    Each example's loss gradient is clipped to L2 norm ``clip_norm`` (over
    all variables together) and summed (weight-0 examples add 0); noise
    ``N(0, (noise_multiplier * clip_norm)^2)`` per coordinate, drawn from
    ``(seed, t)`` (``jk.privacy.noise``), is added; ``optimizer`` applies the
    result divided by ``expected_batch_size`` (``q * N``, whichever examples
    were drawn). Returns each example's norm before clipping, shape ``(B,)``.
    """
    variables = model.trainable_variables
    clipped_sum = jk.function(
        model,
        variables,
        example=example,
        outputs=LOSS,
        reduce=jk.ClippedSum(clip_norm),
    )
    std = noise_multiplier * clip_norm

    @tf.function
    def step(x: Any, y: Any, w: Any, t: Any) -> tf.Tensor:
        out = clipped_sum((x, y, w))
        # the clipped sums, keyed "hidden/kernel", ... in the variables' order
        sums = list(out.values.values())
        noise = jk.privacy.noise(variables, seed, t, std)
        gradients = [(s + n) / expected_batch_size for s, n in zip(sums, noise)]
        optimizer.apply(gradients, variables)
        return out.norms

    return step


def accuracy(model: keras.Model, x: np.ndarray, y: np.ndarray) -> float:
    """The fraction of ``x`` whose largest logit is the label ``y``."""
    return float(np.mean(np.argmax(model.predict_on_batch(x), -1) == y))


@dataclass(frozen=True)
class Settings:
    """The run's settings (the command line's).

    Attributes:
        epochs: passes over the training set (``1 / q`` steps each).
        clip_norm: ``C``.
        noise_multiplier: ``sigma``.
        batch_size: the expected batch size ``q * N``.
        learning_rate: plain SGD's.
        seed: weights, sampling and noise.
        timing_rounds: paired rounds of the DP step against a plain step.
    """

    epochs: int
    clip_norm: float
    noise_multiplier: float
    batch_size: int
    learning_rate: float
    seed: int
    timing_rounds: int


class TestAccuracy(keras.callbacks.Callback):
    """Logs ``"test_accuracy"`` after each epoch: ``model``'s on the test set
    (held out: reading it spends no privacy of the training set)."""

    def __init__(self, model: keras.Model, digits: Digits) -> None:
        super().__init__()
        self.evaluated, self.digits = model, digits

    def on_epoch_end(self, epoch: int, logs: Any = None) -> None:
        if logs is not None:
            digits = self.digits
            logs["test_accuracy"] = accuracy(
                self.evaluated, digits.x_test, digits.y_test
            )


def train_private(digits: Digits, settings: Settings) -> keras.Model:
    """DP-SGD for ``settings.epochs`` epochs by ``make_private`` and
    ``fit`` (compiled), printing each epoch's train loss (on the sampled
    batches), test accuracy, epsilon and time per step."""
    model = build_model(settings.seed)
    n = len(digits.x_train)
    q = settings.batch_size / n
    sampler = jk.privacy.PoissonSampler(
        (digits.x_train, digits.y_train), sampling_rate=q, seed=settings.seed
    )
    private = jk.privacy.make_private(
        model,
        l2_norm_clip=settings.clip_norm,
        noise_multiplier=settings.noise_multiplier,
        sampling_rate=q,
        num_examples=n,
        seed=settings.seed,
    )
    private.compile(keras.optimizers.SGD(settings.learning_rate), LOSS_FN)
    times = EpochTimes()
    history = private.fit(
        sampler,
        epochs=settings.epochs,
        verbose=0,
        # times first: its epoch ends before the others' evaluations
        callbacks=[
            times,
            jk.privacy.EpsilonCallback(DELTA),
            TestAccuracy(model, digits),
        ],
    )
    logs = history.history
    print("epoch  train loss  test acc  epsilon  clipped  step (ms)")
    for e in range(settings.epochs):
        print(
            f"{e + 1:5d}  {logs['loss'][e]:10.3f}  {logs['test_accuracy'][e]:8.3f}"
            f"  {logs['epsilon'][e]:7.2f}  {logs['clipped'][e]:7.2f}"
            f"  {1e3 * times.seconds[e] / len(sampler):9.1f}"
        )
    print(
        f"padded sizes {list(sampler.sizes)}: the step traced once per size "
        "met (in the first epochs' step times); epsilon by PLD after "
        f"{int(private.dp_steps.numpy())} steps: "
        f"{private.epsilon(DELTA, 'pld'):.2f}"
    )
    return model


class EpochTimes(keras.callbacks.Callback):
    """Each epoch's wall time (s), in ``seconds``."""

    def __init__(self) -> None:
        super().__init__()
        self.seconds: list[float] = []
        self.started = 0.0

    def on_epoch_begin(self, epoch: int, logs: Any = None) -> None:
        self.started = time.perf_counter()

    def on_epoch_end(self, epoch: int, logs: Any = None) -> None:
        self.seconds.append(time.perf_counter() - self.started)


def train_plain(digits: Digits, settings: Settings) -> keras.Model:
    """The same model (same initial weights) trained without privacy by
    ``model.fit``: shuffled batches of ``batch_size``, same SGD, same
    epochs."""
    model = build_model(settings.seed)
    model.compile(
        optimizer=keras.optimizers.SGD(settings.learning_rate),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    model.fit(
        digits.x_train,
        digits.y_train,
        batch_size=settings.batch_size,
        epochs=settings.epochs,
        shuffle=True,
        verbose=0,
    )
    return model


def time_steps(digits: Digits, settings: Settings) -> None:
    """The compiled DP step (:func:`make_dp_step`) against a plain step,
    compiled (what ``model.fit`` runs) and eager, on the same batch of
    ``batch_size`` examples, each on its own copy of the model. Every round
    times one call of each (the order rotating); printed: the medians, and
    the median of the per-round ratios with its bootstrap interval."""
    from jacobkit.bench import stats

    x = tf.constant(digits.x_train[: settings.batch_size])
    y = tf.constant(digits.y_train[: settings.batch_size])
    w = tf.ones((settings.batch_size,), tf.float32)
    private = build_model(settings.seed)
    dp = make_dp_step(
        private,
        keras.optimizers.SGD(settings.learning_rate),
        (x, y, w),
        clip_norm=settings.clip_norm,
        noise_multiplier=settings.noise_multiplier,
        expected_batch_size=settings.batch_size,
        seed=settings.seed,
    )
    counter = iter(range(10**9))

    def dp_step() -> None:
        dp(x, y, w, tf.constant(next(counter), tf.int64))
        float(private.trainable_variables[-1][0])  # the update is written

    steps = {
        "DP-SGD step (jk.function, compiled)": dp_step,
        "plain step (tf.function, as in fit)": _plain_step(settings, x, y, True),
        "plain step (eager GradientTape)": _plain_step(settings, x, y, False),
    }
    for step in steps.values():  # warm up: trace each
        for _ in range(3):
            step()
    times: dict[str, list[float]] = {name: [] for name in steps}
    names = list(steps)
    for round_ in range(settings.timing_rounds):
        shift = round_ % len(names)
        for name in names[shift:] + names[:shift]:
            start = time.perf_counter()
            steps[name]()
            times[name].append(time.perf_counter() - start)
    print(
        f"time per step, batch of {settings.batch_size} "
        f"(medians of {settings.timing_rounds} rounds):"
    )
    dp_name = names[0]
    for name in names:
        line = f"  {name:37s} {1e3 * np.median(times[name]):6.2f} ms"
        if name != dp_name:
            ratio = stats.ratios(
                [d / p for d, p in zip(times[dp_name], times[name], strict=True)]
            )
            interval = stats.interval_text(ratio.low, ratio.high)
            line += f"   DP step / this: {ratio.median:.2f}x {interval}"
        print(line)


def _plain_step(
    settings: Settings, x: tf.Tensor, y: tf.Tensor, compiled: bool
) -> Callable[[], None]:
    """A plain (non-private) SGD step on ``(x, y)`` for a model of its own:
    the batch's mean loss, one backward pass; it returns once the update is
    written."""
    model = build_model(settings.seed)
    optimizer = keras.optimizers.SGD(settings.learning_rate)
    variables = model.trainable_variables

    def update(x: tf.Tensor, y: tf.Tensor) -> None:
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(LOSS_FN(y, model(x, training=True)))
        optimizer.apply(tape.gradient(loss, variables), variables)

    run = tf.function(update) if compiled else update

    def step() -> None:
        run(x, y)
        float(variables[-1][0])  # the update is done once it can be read

    return step


def parse_settings(argv: Sequence[str] | None = None) -> Settings:
    """The command line's :class:`Settings`."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=15)
    parser.add_argument("--clip", type=float, default=1.0, help="clip norm C")
    parser.add_argument(
        "--noise", type=float, default=1.1, help="noise multiplier sigma"
    )
    parser.add_argument(
        "--batch-size", type=int, default=64, help="expected batch size q*N"
    )
    parser.add_argument("--lr", type=float, default=0.5, help="SGD learning rate")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--timing-rounds", type=int, default=30)
    args = parser.parse_args(argv)
    return Settings(
        epochs=args.epochs,
        clip_norm=args.clip,
        noise_multiplier=args.noise,
        batch_size=args.batch_size,
        learning_rate=args.lr,
        seed=args.seed,
        timing_rounds=args.timing_rounds,
    )


def main(argv: Sequence[str] | None = None) -> None:
    """Train privately, then without privacy, then time the steps."""
    settings = parse_settings(argv)
    digits = load_digits(settings.seed)
    n = len(digits.x_train)
    q = settings.batch_size / n
    print(
        f"digits: {n} training and {len(digits.x_test)} test examples; "
        f"C={settings.clip_norm}, sigma={settings.noise_multiplier}, "
        f"q={q:.4f} (expected batch {settings.batch_size}), "
        f"{round(1 / q)} steps per epoch, SGD lr={settings.learning_rate}"
    )
    private = train_private(digits, settings)
    plain = train_plain(digits, settings)
    private_acc = accuracy(private, digits.x_test, digits.y_test)
    plain_acc = accuracy(plain, digits.x_test, digits.y_test)
    print(
        f"test accuracy after {settings.epochs} epochs: DP-SGD {private_acc:.3f}, "
        f"non-private {plain_acc:.3f}"
    )
    if settings.timing_rounds:
        time_steps(digits, settings)


if __name__ == "__main__":
    main()
