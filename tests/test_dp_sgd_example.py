"""The DP-SGD example (``examples/dp_sgd.py``): one step's update against the
float64 reference computed the obvious way, and its privacy accounting.

The reference: the model's weights copied into float64 variables, one
``tf.GradientTape`` per example on its own cross-entropy, each gradient's
norm over all variables, clipped, summed and divided in NumPy, the same
noise drawn from the same seed, and plain SGD's ``w - lr * update``.

Tolerance: the largest error measured in these tests was 1.6e-7 of the
update's largest value (noise 0; 1.0e-7 with noise; oneDNN on and off): one
float32 spacing of the weights the update is added to (1.5e-7 of it here), so
the step is as exact as the float32 weights can show. Across batches and clip
norms (0.1 to 100) the largest was 8.4e-6, where the update was 0.003 and a
weight's spacing alone is 1e-5 of it. The bound: 1e-5 of the update's
largest value, the suite's float32 bound for clipped sums, plus one float32
spacing of each weight.

The example's data (scikit-learn's digits) is not needed here: the batches
are random.
"""

from __future__ import annotations

import inspect
import sys
from pathlib import Path

import keras
import numpy as np
import pytest
import tensorflow as tf

from examples import dp_sgd

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
    weights: list[np.ndarray], x: np.ndarray, y: np.ndarray
) -> list[np.ndarray]:
    """Each example's loss gradient, float64, one tape per example: the
    example's MLP (64 -> tanh 64 -> 10 logits) written out by hand."""
    variables = [tf.Variable(w.astype(np.float64)) for w in weights]
    kernel1, bias1, kernel2, bias2 = variables
    rows: list[list[np.ndarray]] = []
    for b in range(len(x)):
        xb = tf.constant(x[b : b + 1], tf.float64)
        with tf.GradientTape() as tape:
            logits = tf.tanh(xb @ kernel1 + bias1) @ kernel2 + bias2
            loss = tf.nn.sparse_softmax_cross_entropy_with_logits(y[b : b + 1], logits)
        rows.append([g.numpy() for g in tape.gradient(loss, variables)])
    return [np.stack(parts) for parts in zip(*rows)]  # per variable: (B, *shape)


def _reference_update(
    weights: list[np.ndarray],
    x: np.ndarray,
    y: np.ndarray,
    *,
    clip_norm: float,
    noise_multiplier: float,
    seed: int,
) -> list[np.ndarray]:
    """``lr * (clipped sum + noise) / expected batch``, per variable."""
    grads = _per_example_float64(weights, x, y)
    flat = np.concatenate([g.reshape(len(x), -1) for g in grads], axis=1)
    scales = np.minimum(1.0, clip_norm / np.linalg.norm(flat, axis=1))
    rng = np.random.default_rng(seed)
    updates = []
    for g, w in zip(grads, weights):
        noise = rng.normal(0.0, noise_multiplier * clip_norm, size=w.shape)
        clipped_sum = np.tensordot(scales, g, 1)
        updates.append(LEARNING_RATE * (clipped_sum + noise) / EXPECTED_BATCH)
    return updates


def _step(
    x: np.ndarray,
    y: np.ndarray,
    *,
    clip_norm: float,
    noise_multiplier: float,
    seed: int,
) -> tuple[list[np.ndarray], list[np.ndarray], dp_sgd.StepReport]:
    """The example's step on a fresh model: the weights before and after
    (as float64) and the step's report."""
    model = dp_sgd.build_model(seed=0)
    before = [np.asarray(v, np.float64) for v in model.trainable_variables]
    report = dp_sgd.dp_sgd_step(
        model,
        keras.optimizers.SGD(LEARNING_RATE),
        x,
        y,
        clip_norm=clip_norm,
        noise_multiplier=noise_multiplier,
        expected_batch_size=EXPECTED_BATCH,
        rng=np.random.default_rng(seed),
    )
    after = [np.asarray(v, np.float64) for v in model.trainable_variables]
    return before, after, report


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
    grads = _per_example_float64(weights, x, y)
    flat = np.concatenate([g.reshape(len(x), -1) for g in grads], axis=1)
    return float(np.median(np.linalg.norm(flat, axis=1)))


@pytest.mark.parametrize("noise_multiplier", [0.0, 0.7])
def test_one_step_updates_the_weights_as_the_float64_reference(noise_multiplier):
    x, y = _batch()
    clip = _median_norm(x, y)
    before, after, report = _step(
        x, y, clip_norm=clip, noise_multiplier=noise_multiplier, seed=3
    )
    update = _reference_update(
        before, x, y, clip_norm=clip, noise_multiplier=noise_multiplier, seed=3
    )
    _close(before, after, update)
    # the norms before clipping: some above the clip norm, some below
    assert report.norms.shape == (BATCH,)
    assert (report.norms > clip).any() and (report.norms < clip).any()


def test_the_noise_has_the_standard_deviation_asked_for():
    x, y = _batch()
    clip, sigma = 0.5, 2.0
    _, quiet, _ = _step(x, y, clip_norm=clip, noise_multiplier=0.0, seed=0)
    _, noisy, _ = _step(x, y, clip_norm=clip, noise_multiplier=sigma, seed=0)
    noise = np.concatenate([(q - n).ravel() for n, q in zip(noisy, quiet)])
    noise *= EXPECTED_BATCH / LEARNING_RATE  # back to the sum's scale
    assert noise.size == 64 * 64 + 64 + 64 * 10 + 10
    # 4,810 draws: the sample's standard deviation is within 3% (3 of its
    # standard errors, 1%), its mean within 3 standard errors of 0
    assert abs(noise.std() / (sigma * clip) - 1) < 0.03
    assert abs(noise.mean()) < 3 * sigma * clip / np.sqrt(noise.size)


def test_an_empty_poisson_sample_applies_the_noise_alone():
    x, y = _batch()
    before, after, report = _step(
        x[:0], y[:0], clip_norm=1.0, noise_multiplier=1.0, seed=5
    )
    rng = np.random.default_rng(5)
    noise = [rng.normal(0.0, 1.0, size=w.shape) for w in before]
    _close(before, after, [LEARNING_RATE * n / EXPECTED_BATCH for n in noise])
    assert report.norms.shape == (0,)


def test_fit_with_the_dp_model_takes_the_same_step():
    """``DPSGDModel.fit(run_eagerly=True)`` on one batch updates the weights
    as the step function does with the same seed."""
    x, y = _batch()
    before, want, _ = _step(x, y, clip_norm=1.0, noise_multiplier=0.7, seed=4)
    layers = dp_sgd.build_model(seed=0)
    model = dp_sgd.DPSGDModel(
        layers.inputs,
        layers.outputs,
        clip_norm=1.0,
        noise_multiplier=0.7,
        expected_batch_size=EXPECTED_BATCH,
        seed=4,
    )
    model.compile(optimizer=keras.optimizers.SGD(LEARNING_RATE), run_eagerly=True)
    model.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
    after = [np.asarray(v, np.float64) for v in model.trainable_variables]
    _close(before, after, [b - w for b, w in zip(before, want)])


def test_fit_without_run_eagerly_says_how_to_fix_it():
    layers = dp_sgd.build_model(seed=0)
    model = dp_sgd.DPSGDModel(
        layers.inputs,
        layers.outputs,
        clip_norm=1.0,
        noise_multiplier=1.0,
        expected_batch_size=EXPECTED_BATCH,
    )
    model.compile(optimizer=keras.optimizers.SGD(LEARNING_RATE))
    x, y = _batch()
    with pytest.raises(RuntimeError, match="run_eagerly=True"):
        model.fit(x, y, batch_size=BATCH, epochs=1, verbose=0)


def test_poisson_batches_sample_each_example_independently():
    rng = np.random.default_rng(0)
    sizes = [len(b) for b in dp_sgd.poisson_batches(1000, 0.05, 400, rng)]
    # binomial(1000, 0.05): mean 50, standard deviation 6.9
    assert abs(np.mean(sizes) - 50) < 3 * 6.9 / np.sqrt(400)
    assert 5.5 < np.std(sizes) < 8.5


def test_epsilon_from_the_rdp_accountant():
    dp_accounting = pytest.importorskip("dp_accounting")
    q, sigma, steps = 64 / 1437, 1.1, 22 * 15
    eps = dp_sgd.epsilon(steps, q, sigma, dp_sgd.DELTA)
    assert eps is not None and 0 < eps < np.inf
    # more steps spend more; more noise spends less; no noise, no privacy
    assert dp_sgd.epsilon(2 * steps, q, sigma, dp_sgd.DELTA) > eps
    assert dp_sgd.epsilon(steps, q, 2 * sigma, dp_sgd.DELTA) < eps
    assert dp_sgd.epsilon(steps, q, 0.0, dp_sgd.DELTA) == np.inf
    # the PLD accountant's bound is tighter than RDP's, and close to it
    pld = dp_accounting.pld.PLDAccountant()
    event = dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(sigma))
    pld.compose(dp_accounting.SelfComposedDpEvent(event, steps))
    tighter = pld.get_epsilon(dp_sgd.DELTA)
    assert tighter <= eps < 1.5 * tighter


def test_without_dp_accounting_epsilon_is_none(monkeypatch):
    monkeypatch.setitem(sys.modules, "dp_accounting", None)
    assert dp_sgd.epsilon(10, 0.05, 1.0, dp_sgd.DELTA) is None


def test_the_page_shows_the_examples_code_verbatim():
    """``docs/dp-sgd.md`` quotes the step, the sampling and the accounting
    as the example has them."""
    page = (Path(__file__).parent.parent / "docs" / "dp-sgd.md").read_text()
    for function in (dp_sgd.dp_sgd_step, dp_sgd.poisson_batches, dp_sgd.epsilon):
        assert inspect.getsource(function) in page, function.__name__
    for line in inspect.getsource(dp_sgd).splitlines():
        if line.startswith(("LOSS_FN =", "LOSS =")):
            assert line in page, line
