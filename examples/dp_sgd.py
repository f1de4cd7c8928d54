"""DP-SGD on scikit-learn's digits with jacobkit's clipped sum.

Each step samples a batch (Poisson sampling: every training example joins
independently with probability ``q``), asks ``jk.jacobian(...,
reduce=jk.ClippedSum(C))`` for the sum of the per-example loss gradients
clipped to norm ``C`` (without holding the per-example gradients), adds
Gaussian noise of standard deviation ``noise_multiplier * C`` to every
coordinate, divides by the expected batch size and applies SGD. Google's
``dp-accounting`` library (optional) turns the steps into an epsilon at
``delta = 1e-5``. At the end the same model is trained without privacy for
the same epochs, and a DP step is timed against a plain one.

Run from the repository's root (``docs/dp-sgd.md`` shows the output)::

    python examples/dp_sgd.py --epochs 15 --clip 1.0 --noise 1.1

``jk.jacobian`` is an eager call (it compiles its own ``tf.function`` inside
and reuses it while the batch shape repeats); it cannot be called inside a
``tf.function``. The DP step here is a plain Python function, run by an
eager loop; :class:`DPSGDModel` runs the same step from ``model.fit``, which
then needs ``run_eagerly=True``.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

from jacobkit import runtime

# TensorFlow's C++ start-up lines (oneDNN, CUDA notices) stay off the output
runtime.start_tensorflow_quietly()

import keras  # noqa: E402 - after TensorFlow started quietly
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import jacobkit as jk  # noqa: E402

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


@dataclass(frozen=True)
class StepReport:
    """What one DP step saw.

    Attributes:
        norms: each example's gradient norm before clipping, shape ``(B,)``.
        trace_time_s: seconds jacobkit spent tracing in this step (a new padded
            batch size traces once); 0.0 where it reused a trace.
        jacobian_time_s: seconds of the whole ``jk.jacobian`` call (0.0 for
            an empty batch).
        compute_time_s: of those, seconds of jacobkit's compiled computation
            (the rest is checking the call and choosing the strategy).
    """

    norms: np.ndarray
    trace_time_s: float = 0.0
    jacobian_time_s: float = 0.0
    compute_time_s: float = 0.0

    @classmethod
    def of(cls, result: jk.JacobianResult) -> StepReport:
        """The report of the step whose clipped sum is ``result``."""
        stats = result.stats
        return cls(
            np.asarray(result.norms),
            trace_time_s=stats.trace_time_s if stats.traced else 0.0,
            jacobian_time_s=stats.total_time_s or 0.0,
            compute_time_s=stats.wall_time_s,
        )


def dp_sgd_step(
    model: keras.Model,
    optimizer: keras.optimizers.Optimizer,
    x: np.ndarray,
    y: np.ndarray,
    *,
    clip_norm: float,
    noise_multiplier: float,
    expected_batch_size: float,
    rng: np.random.Generator,
) -> StepReport:
    """One DP-SGD step on the batch ``(x, y)`` (``B`` examples, maybe 0).

    Each example's loss gradient is clipped to L2 norm ``clip_norm`` (over
    all variables together) and summed; noise ``N(0, (noise_multiplier *
    clip_norm)^2)`` per coordinate, drawn by ``rng`` variable by variable,
    is added; ``optimizer`` applies the result divided by
    ``expected_batch_size`` (``q * N``, whichever examples were drawn).
    Returns a :class:`StepReport` (the norms before clipping, shape ``(B,)``).
    """
    variables = model.trainable_variables
    sums = [tf.zeros(v.shape, v.dtype) for v in variables]
    report = StepReport(np.zeros((0,), "float32"))
    if len(x):  # a Poisson sample can be empty: then the noise alone
        result = jk.jacobian(
            model,
            (x, y),
            variables,
            outputs=LOSS,
            # padded with examples of weight 0 to a few sizes (exact): the
            # Poisson samples' sizes trace a few times, not once per size
            reduce=jk.ClippedSum(clip_norm, pad_batches=True),
        )
        # the clipped sums, one per variable in the order given (keyed
        # "hidden/kernel", ...: the variable's path without the model's name)
        sums = list(result.jacobians.values())
        report = StepReport.of(result)
    std = noise_multiplier * clip_norm
    gradients = []
    for variable, clipped in zip(variables, sums, strict=True):
        noise = tf.constant(rng.normal(0.0, std, size=variable.shape), variable.dtype)
        gradients.append((clipped + noise) / expected_batch_size)
    optimizer.apply(gradients, variables)
    return report


class DPSGDModel(keras.Model):
    """A functional Keras model whose ``fit`` takes DP-SGD steps
    (:func:`dp_sgd_step`). Compile it with ``run_eagerly=True``:
    ``jk.jacobian`` does not run inside the ``tf.function`` that ``fit``
    otherwise makes of ``train_step``.

    ``fit`` draws shuffled batches of a fixed size, not Poisson samples: the
    accountant's sampling probability ``q = batch_size / N`` then describes
    a sampling the run did not do (see ``docs/dp-sgd.md``).

    Args:
        inputs: the functional model's inputs.
        outputs: its logits.
        clip_norm: ``C``.
        noise_multiplier: ``sigma``.
        expected_batch_size: the divisor of the noisy sum (``fit``'s
            ``batch_size``).
        seed: seeds the noise.
    """

    def __init__(
        self,
        inputs: object,
        outputs: object,
        *,
        clip_norm: float,
        noise_multiplier: float,
        expected_batch_size: float,
        seed: int = 0,
    ) -> None:
        super().__init__(inputs=inputs, outputs=outputs)
        self.clip_norm = clip_norm
        self.noise_multiplier = noise_multiplier
        self.expected_batch_size = expected_batch_size
        self.rng = np.random.default_rng(seed)

    def train_step(self, data: tuple[tf.Tensor, tf.Tensor]) -> dict[str, float]:
        """One :func:`dp_sgd_step` on ``fit``'s batch; logs the median
        norm before clipping."""
        if not tf.executing_eagerly():
            raise RuntimeError(
                "DPSGDModel.fit: jk.jacobian runs eagerly, not inside the "
                "tf.function that fit makes of train_step; compile with "
                "model.compile(..., run_eagerly=True)."
            )
        x, y = data
        report = dp_sgd_step(
            self,
            self.optimizer,
            np.asarray(x),
            np.asarray(y),
            clip_norm=self.clip_norm,
            noise_multiplier=self.noise_multiplier,
            expected_batch_size=self.expected_batch_size,
            rng=self.rng,
        )
        norms = report.norms
        return {"median_norm": float(np.median(norms)) if len(norms) else 0.0}


def poisson_batches(
    num_examples: int, sampling_probability: float, steps: int, rng: np.random.Generator
) -> Iterator[np.ndarray]:
    """``steps`` batches of indices: each example joins each batch
    independently with probability ``sampling_probability`` (the sampling
    the accountant assumes)."""
    for _ in range(steps):
        yield np.flatnonzero(rng.random(num_examples) < sampling_probability)


def epsilon(
    steps: int, sampling_probability: float, noise_multiplier: float, delta: float
) -> float | None:
    """Epsilon at ``delta`` after ``steps`` Poisson-sampled Gaussian steps,
    by ``dp-accounting``'s RDP accountant; ``None`` without the library."""
    try:
        import dp_accounting
    except ModuleNotFoundError:
        return None
    if noise_multiplier == 0:
        return math.inf
    step = dp_accounting.PoissonSampledDpEvent(
        sampling_probability, dp_accounting.GaussianDpEvent(noise_multiplier)
    )
    accountant = dp_accounting.rdp.RdpAccountant()
    accountant.compose(dp_accounting.SelfComposedDpEvent(step, steps))
    return float(accountant.get_epsilon(delta))


def mean_loss(model: keras.Model, x: np.ndarray, y: np.ndarray) -> float:
    """The mean cross-entropy of ``model`` on ``(x, y)``."""
    return float(np.mean(LOSS_FN(y, model.predict_on_batch(x))))


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


def train_private(digits: Digits, settings: Settings) -> keras.Model:
    """DP-SGD for ``settings.epochs`` epochs, printing the train loss, the
    test accuracy and epsilon after each."""
    model = build_model(settings.seed)
    optimizer = keras.optimizers.SGD(settings.learning_rate)
    n = len(digits.x_train)
    q = settings.batch_size / n
    steps_per_epoch = round(1 / q)
    rng = np.random.default_rng(settings.seed)
    steps, traces, trace_s = 0, 0, 0.0
    print("epoch  train loss  test acc  epsilon  step (ms)")
    for epoch in range(1, settings.epochs + 1):
        start = time.perf_counter()
        for batch in poisson_batches(n, q, steps_per_epoch, rng):
            report = dp_sgd_step(
                model,
                optimizer,
                digits.x_train[batch],
                digits.y_train[batch],
                clip_norm=settings.clip_norm,
                noise_multiplier=settings.noise_multiplier,
                expected_batch_size=settings.batch_size,
                rng=rng,
            )
            steps += 1
            traces += report.trace_time_s > 0
            trace_s += report.trace_time_s
        step_ms = 1e3 * (time.perf_counter() - start) / steps_per_epoch
        eps = epsilon(steps, q, settings.noise_multiplier, DELTA)
        print(
            f"{epoch:5d}  {mean_loss(model, digits.x_train, digits.y_train):10.3f}"
            f"  {accuracy(model, digits.x_test, digits.y_test):8.3f}"
            f"  {'n/a' if eps is None else f'{eps:7.2f}':>7}  {step_ms:9.1f}"
        )
    print(
        f"jacobkit traced {traces} times (once per new padded batch size), "
        f"{trace_s:.1f} s in all: the step times above include it"
    )
    return model


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
    """The DP step against a plain step, compiled (what ``model.fit`` runs)
    and eager, on the same batch of ``batch_size`` examples, each on its own
    copy of the model. Every round times one call of each (the order
    rotating); printed: the medians, and the median of the per-round ratios
    with its bootstrap interval."""
    from jacobkit.bench import stats

    x = digits.x_train[: settings.batch_size]
    y = digits.y_train[: settings.batch_size]
    rng = np.random.default_rng(settings.seed)
    private = build_model(settings.seed)
    private_sgd = keras.optimizers.SGD(settings.learning_rate)
    reports: list[StepReport] = []

    def dp_step() -> None:
        report = dp_sgd_step(
            private,
            private_sgd,
            x,
            y,
            clip_norm=settings.clip_norm,
            noise_multiplier=settings.noise_multiplier,
            expected_batch_size=settings.batch_size,
            rng=rng,
        )
        reports.append(report)

    steps = {
        "DP-SGD step (jk.ClippedSum + noise)": dp_step,
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
        if name == dp_name:
            timed = reports[-settings.timing_rounds :]
            call = np.median([r.jacobian_time_s for r in timed])
            compute = np.median([r.compute_time_s for r in timed])
            print(
                f"    of which the jk.jacobian call {1e3 * call:.2f} ms "
                f"(its compiled computation {1e3 * compute:.2f} ms)"
            )


def _plain_step(
    settings: Settings, x: np.ndarray, y: np.ndarray, compiled: bool
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
    inputs, labels = tf.constant(x), tf.constant(y)

    def step() -> None:
        run(inputs, labels)
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
    if epsilon(1, q, settings.noise_multiplier, DELTA) is None:
        print(
            "epsilon: n/a (the accounting needs Google's dp-accounting: "
            "`pip install dp-accounting`)",
            file=sys.stderr,
        )
    private = train_private(digits, settings)
    plain = train_plain(digits, settings)
    private_acc = accuracy(private, digits.x_test, digits.y_test)
    plain_acc = accuracy(plain, digits.x_test, digits.y_test)
    print(
        f"test accuracy after {settings.epochs} epochs: DP-SGD {private_acc:.3f}, "
        f"non-private {plain_acc:.3f}"
    )
    time_steps(digits, settings)


if __name__ == "__main__":
    main()
