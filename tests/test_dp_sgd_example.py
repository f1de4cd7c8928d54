"""The DP-SGD example (``examples/dp_sgd.py``): one compiled step's update
(:func:`make_dp_step`, ``jk.function`` inside a ``tf.function``) against
the float64 reference computed the obvious way, and the same step taken by
``make_private``'s ``fit``.

The reference: the model's weights copied into float64 variables, one
``tf.GradientTape`` per example on its own weighted cross-entropy (weight 0
for padding, as ``jk.Loss`` weighs it), each gradient's norm over all
variables, clipped, summed and divided in NumPy (``tests.cases``), the
noise drawn by the documented recipe (``stateless_normal`` seeded by
``stateless_fold_in((seed, t), i)``), and plain SGD's ``w - lr * update``.

Tolerance: beyond one float32 spacing of each weight (the float32 weight
cannot hold a finer result), the largest error measured for the compiled
step was 3.0e-7 of the update's largest value (3 batches, clip norms from
0.1 to 100 and the median norm, noise 0 and 0.7, two of six examples
padding); with the spacing counted, 1.0e-5 where the update was small
(clip 0.1) and a weight's spacing alone is that much of it. The bound:
1e-5 of the update's largest value, the suite's float32 bound for clipped
sums, plus one float32 spacing of each weight.

The example's data (scikit-learn's digits) is not needed here: the batches
are random.
"""

from __future__ import annotations

import inspect
from pathlib import Path

import keras
import numpy as np
import pytest
import tensorflow as tf

from examples import dp_sgd
from tests.cases import PerRow, clipped_sums, per_example_gradients

RTOL = 1e-5
#: plain SGD's: the update is lr * (clipped sum + noise) / expected batch
LEARNING_RATE = 1.0
BATCH = 6
#: the divisor of the noisy sum (as under Poisson sampling, not the batch's
#: own size)
EXPECTED_BATCH = 8.0


def _batch(seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    x = rng.uniform(0.0, 1.0, size=(BATCH, 64)).astype("float32")
    y = rng.integers(0, 10, size=BATCH).astype("int32")
    return x, y


def _per_example_float64(
    weights: list[np.ndarray], x: np.ndarray, y: np.ndarray, w: np.ndarray | None = None
) -> PerRow:
    """Each example's (weighted) loss gradient, float64, one tape per
    example: the example's MLP (64 -> tanh 64 -> 10 logits) written out by
    hand."""
    variables = [tf.Variable(v.astype(np.float64)) for v in weights]
    kernel1, bias1, kernel2, bias2 = variables

    def forward(xb):
        return tf.tanh(xb @ kernel1 + bias1) @ kernel2 + bias2

    def loss(labels, logits):
        return tf.nn.sparse_softmax_cross_entropy_with_logits(labels, logits)

    data = (x, y) if w is None else (x, y, w)
    return per_example_gradients(forward, variables, data, loss)


def _noise(weights: list[np.ndarray], seed: int, step: int, std: float):
    """The documented draw: variable ``i``'s noise at step ``t``."""
    found = []
    for i, w in enumerate(weights):
        key = tf.random.experimental.stateless_fold_in(
            tf.constant([seed, step], tf.int64), i
        )
        draw = tf.random.stateless_normal(w.shape, seed=key, dtype=tf.float32)
        found.append(std * np.asarray(draw, np.float64))
    return found


def _reference_update(
    weights: list[np.ndarray],
    x: np.ndarray,
    y: np.ndarray,
    sample_weight: np.ndarray,
    *,
    clip_norm: float,
    noise_multiplier: float,
    seed: int,
    step: int = 0,
) -> list[np.ndarray]:
    """``lr * (clipped sum + noise) / expected batch``, per variable."""
    rows = _per_example_float64(weights, x, y, sample_weight)
    sums, _ = clipped_sums(rows, clip_norm)
    noise = _noise(weights, seed, step, noise_multiplier * clip_norm)
    return [
        LEARNING_RATE * (total + n) / EXPECTED_BATCH
        for total, n in zip(sums, noise, strict=True)
    ]


def _step(
    x: np.ndarray,
    y: np.ndarray,
    w: np.ndarray,
    *,
    clip_norm: float,
    noise_multiplier: float,
    seed: int,
) -> tuple[list[np.ndarray], list[np.ndarray], np.ndarray]:
    """The example's compiled step (step 0) on a fresh model: the weights
    before and after (as float64) and the norms before clipping."""
    model = dp_sgd.build_model(seed=0)
    before = [np.asarray(v, np.float64) for v in model.trainable_variables]
    step = dp_sgd.make_dp_step(
        model,
        keras.optimizers.SGD(LEARNING_RATE),
        (x, y, w),
        clip_norm=clip_norm,
        noise_multiplier=noise_multiplier,
        expected_batch_size=EXPECTED_BATCH,
        seed=seed,
    )
    norms = step(x, y, w, tf.constant(0, tf.int64))
    after = [np.asarray(v, np.float64) for v in model.trainable_variables]
    return before, after, np.asarray(norms)


def _close(
    before: list[np.ndarray], after: list[np.ndarray], update: list[np.ndarray]
) -> float:
    """Assert that ``after`` is ``before - update`` within RTOL of the
    update's largest value, plus one float32 spacing of each weight (the
    float32 weight cannot hold a finer result); the error measured, relative
    to the update's largest value."""
    scale = max(float(np.abs(u).max()) for u in update)
    worst = 0.0
    for b, a, u in zip(before, after, update):
        want = b - u
        error = np.abs(a - want)
        spacing = np.spacing(np.abs(want).astype(np.float32)).astype(np.float64)
        assert np.all(error <= RTOL * scale + spacing), (
            f"relative error {float(error.max()) / scale:.2e} > {RTOL:g}"
        )
        worst = max(worst, float(error.max()) / scale)
    return worst


def _median_norm(x: np.ndarray, y: np.ndarray) -> float:
    """A clip norm that clips some examples and not others."""
    weights = [np.asarray(v) for v in dp_sgd.build_model(seed=0).trainable_variables]
    return float(np.median(_per_example_float64(weights, x, y).norms))


@pytest.mark.parametrize("noise_multiplier", [0.0, 0.7])
def test_one_step_updates_the_weights_as_the_float64_reference(noise_multiplier):
    x, y = _batch()
    w = np.array([1, 1, 1, 1, 0, 0], np.float32)  # the last two: padding
    clip = _median_norm(x, y)
    before, after, norms = _step(
        x, y, w, clip_norm=clip, noise_multiplier=noise_multiplier, seed=3
    )
    update = _reference_update(
        before, x, y, w, clip_norm=clip, noise_multiplier=noise_multiplier, seed=3
    )
    _close(before, after, update)
    # the norms before clipping: some above the clip norm, some below
    assert norms.shape == (BATCH,)
    assert (norms[:4] > clip).any() and (norms[:4] < clip).any()


def test_the_noise_has_the_standard_deviation_asked_for():
    x, y = _batch()
    w = np.ones(BATCH, np.float32)
    clip, sigma = 0.5, 2.0
    _, quiet, _ = _step(x, y, w, clip_norm=clip, noise_multiplier=0.0, seed=0)
    _, noisy, _ = _step(x, y, w, clip_norm=clip, noise_multiplier=sigma, seed=0)
    noise = np.concatenate([(q - n).ravel() for n, q in zip(noisy, quiet)])
    noise *= EXPECTED_BATCH / LEARNING_RATE  # back to the sum's scale
    assert noise.size == 64 * 64 + 64 + 64 * 10 + 10
    # 4,810 draws: the sample's standard deviation is within 3% (3 of its
    # standard errors, 1%), its mean within 3 standard errors of 0
    assert abs(noise.std() / (sigma * clip) - 1) < 0.03
    assert abs(noise.mean()) < 3 * sigma * clip / np.sqrt(noise.size)


def test_an_empty_poisson_sample_applies_the_noise_alone():
    """An empty draw is padded to one example of weight 0 (as the
    sampler pads it): the step applies the noise alone."""
    x, y = _batch()
    w = np.zeros(1, np.float32)
    before, after, _ = _step(
        x[:1], y[:1], w, clip_norm=1.0, noise_multiplier=1.0, seed=5
    )
    noise = _noise(before, 5, 0, 1.0)
    _close(before, after, [LEARNING_RATE * n / EXPECTED_BATCH for n in noise])


def test_make_private_fit_takes_the_same_step():
    """``make_private(...).fit`` (compiled) on one Poisson batch updates the
    weights as the example's step does with the same seed: the page's
    mechanics are what ``fit`` runs."""
    import jacobkit as jk

    x, y = _batch()
    q = 0.5  # each of the 6 examples joins with probability 1/2
    sampler = jk.privacy.PoissonSampler((x, y), q, seed=1, sizes=(BATCH,))
    data = sampler[0]
    model = dp_sgd.build_model(seed=0)
    private = jk.privacy.make_private(
        model,
        l2_norm_clip=1.0,
        noise_multiplier=0.7,
        sampling_rate=q,
        num_examples=BATCH,
        seed=4,
    )
    # fit divides by q * N = 3, the example's step by EXPECTED_BATCH: the
    # learning rate makes the updates equal
    rate = LEARNING_RATE * q * BATCH / EXPECTED_BATCH
    private.compile(keras.optimizers.SGD(rate), dp_sgd.LOSS_FN)
    private.prepare(sampler)
    private.train_on_batch(*data[:2], sample_weight=data[2])
    after = [np.asarray(v, np.float64) for v in model.trainable_variables]
    assert 0 < data[2].sum() < BATCH  # a draw, padded
    before, want, _ = _step(*data, clip_norm=1.0, noise_multiplier=0.7, seed=4)
    _close(before, after, [b - w for b, w in zip(before, want)])


def test_the_page_shows_the_examples_code_verbatim():
    """``docs/dp-sgd.md`` quotes the step as the example has it."""
    page = (Path(__file__).parent.parent / "docs" / "dp-sgd.md").read_text()
    assert inspect.getsource(dp_sgd.make_dp_step) in page
    for line in inspect.getsource(dp_sgd).splitlines():
        if line.startswith(("LOSS_FN =", "LOSS =")):
            assert line in page, line


def test_a_batch_of_another_size_than_the_example():
    """The step planned on a batch of 6 takes a batch of 4 (traced anew),
    as the page says: the same update as the reference on those 4."""
    x, y = _batch()
    w = np.ones(BATCH, np.float32)
    model = dp_sgd.build_model(seed=0)
    before = [np.asarray(v, np.float64) for v in model.trainable_variables]
    step = dp_sgd.make_dp_step(
        model,
        keras.optimizers.SGD(LEARNING_RATE),
        (x, y, w),
        clip_norm=1.0,
        noise_multiplier=0.5,
        expected_batch_size=EXPECTED_BATCH,
        seed=2,
    )
    norms = step(x[:4], y[:4], w[:4], tf.constant(0, tf.int64))
    after = [np.asarray(v, np.float64) for v in model.trainable_variables]
    update = _reference_update(
        before, x[:4], y[:4], w[:4], clip_norm=1.0, noise_multiplier=0.5, seed=2
    )
    _close(before, after, update)
    assert norms.shape == (4,)
