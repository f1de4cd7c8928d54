"""jacobkit.privacy: one DP-SGD step against a float64 reference, the
sampler, the accountant, and every refusal.

The reference is written the obvious way, independently of jacobkit's
clipped sum: a float64 copy of the model, one ``tf.GradientTape`` per
example for its weighted loss gradient, each clipped (over all variables, or
layer by layer), summed; the noise drawn as the documented recipe says
(``tf.random.stateless_normal`` in float32, seeded
``stateless_fold_in((seed, step), i)``); divided by ``q * N``; then SGD's or
Adam's update written out in float64 (Keras's formulas).
"""

from __future__ import annotations

import math
import sys

import keras
import numpy as np
import pytest
import tensorflow as tf

import jacobkit as jk
from examples import dp_sgd
from jacobkit.privacy import step as privacy_step
from tests.cases import PerRow, clipped_sums, per_example_gradients

LOSS = keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction=None)
N, Q, SEED = 40, 0.25, 7
#: the largest error of the weights after each of two steps, beyond one
#: float32 spacing of each weight, relative to the update's largest value,
#: over whole/per-layer clipping, the MLP and the conv net, eager and
#: compiled (measured on this version): SGD 1.7e-7, Adam 1.7e-5. Adam
#: divides by ``sqrt(v) + eps``, which magnifies a float32 gradient's error
#: where a coordinate's noisy gradient is near 0 (up to ``1 / (4 eps')``
#: times); SGD applies it as it is. Held to about 10x the measured.
RTOL = {"sgd": 1e-6, "adam": 2e-4}


def _mlp(seed: int = 0) -> keras.Model:
    keras.utils.set_random_seed(seed)
    return keras.Sequential(
        [
            keras.Input((6,)),
            keras.layers.Dense(5, activation="tanh", name="hidden"),
            keras.layers.Dense(3, name="logits"),
        ]
    )


def _conv(seed: int = 0) -> keras.Model:
    keras.utils.set_random_seed(seed)
    inputs = keras.Input((6, 6, 1))
    h = keras.layers.Conv2D(3, 3, activation="relu", name="conv")(inputs)
    h = keras.layers.Flatten()(h)
    return keras.Model(inputs, keras.layers.Dense(3, name="logits")(h))


def _data(model: keras.Model) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(1)
    shape = tuple(model.inputs[0].shape[1:])
    return rng.normal(size=(N, *shape)).astype("float32"), rng.integers(0, 3, N)


def _per_example(copy, x, y, w) -> PerRow:
    """Each example's weighted loss gradient in float64, by tape."""
    return per_example_gradients(
        lambda one: copy(one, training=True), copy.trainable_variables, (x, y, w), LOSS
    )


def _reference_gradient(copy, x, y, w, clipping, step, sigma):
    """(clipped sum + noise) / (q N) in float64, per example by tape."""
    variables = copy.trainable_variables
    rows = _per_example(copy, x, y, w)
    sums, _ = clipped_sums(rows, clipping.clips, clipping.groups)
    std = sigma * math.sqrt(sum(c * c for c in clipping.clips))
    out = []
    for j, v in enumerate(variables):
        seed = tf.random.experimental.stateless_fold_in(
            tf.constant([SEED, step], tf.int64), j
        )
        draw = tf.random.stateless_normal(v.shape, seed=seed, dtype=tf.float32)
        out.append((sums[j] + std * draw.numpy().astype(np.float64)) / (Q * N))
    return out


class _Reference:
    """SGD's and Adam's updates in float64 (Keras 3's formulas)."""

    def __init__(self, kind: str, lr: float, weights: list[np.ndarray]) -> None:
        self.kind, self.lr, self.t = kind, lr, 0
        self.m = [np.zeros_like(w) for w in weights]
        self.v = [np.zeros_like(w) for w in weights]

    def update(self, weights, grads):
        self.t += 1
        if self.kind == "sgd":
            return [w - self.lr * g for w, g in zip(weights, grads)]
        b1, b2, eps = 0.9, 0.999, 1e-7
        lr = self.lr * math.sqrt(1 - b2**self.t) / (1 - b1**self.t)
        out = []
        for k, (w, g) in enumerate(zip(weights, grads)):
            self.m[k] = b1 * self.m[k] + (1 - b1) * g
            self.v[k] = b2 * self.v[k] + (1 - b2) * g * g
            out.append(w - lr * self.m[k] / (np.sqrt(self.v[k]) + eps))
        return out


def _optimizer(kind: str, lr: float) -> keras.optimizers.Optimizer:
    return keras.optimizers.SGD(lr) if kind == "sgd" else keras.optimizers.Adam(lr)


@pytest.mark.parametrize(
    "build, kind, per_layer, eager",
    [
        (_mlp, "sgd", False, True),
        pytest.param(_mlp, "sgd", False, False, marks=pytest.mark.slow),
        (_mlp, "adam", True, False),
        (_mlp, "adam", True, True),
        (_conv, "sgd", True, False),
        pytest.param(_conv, "adam", False, True, marks=pytest.mark.slow),
    ],
    ids=[
        "mlp-sgd-whole-eager",
        "mlp-sgd-whole-compiled",
        "mlp-adam-per_layer-compiled",
        "mlp-adam-per_layer-eager",
        "conv-sgd-per_layer-compiled",
        "conv-adam-whole-eager",
    ],
)
def test_two_steps_equal_the_float64_reference(build, kind, per_layer, eager):
    """Two steps of ``train_on_batch``: eager (``run_eagerly=True``:
    ``jk.jacobian``) or compiled (``fit``'s step: ``jk.function``, switched
    on the padded size)."""
    worst, clipped_some = _two_steps(build(), kind, per_layer, eager)
    print(f"largest error relative to the update: {worst:.1e}")
    assert worst <= RTOL[kind]
    assert clipped_some or per_layer


def _two_steps(model, kind: str, per_layer, eager: bool) -> tuple[float, bool]:
    """Two DP steps of ``model`` by ``train_on_batch`` against the float64
    reference: the largest error of the weights beyond one float32 spacing,
    relative to the update's largest value, and whether some example was
    clipped."""
    x, y = _data(model)
    copy = jk.testing.float64_copy(model)
    # draws of 6 and 13 examples: the second padded to 14 (one of weight 0);
    # two sizes (Keras traces the second step with the batch size unknown:
    # the compiled step's switch, one branch per size)
    sampler = jk.privacy.PoissonSampler((x, y), Q, seed=4, sizes=(6, 14))
    assert [len(sampler[t][2]) for t in range(2)] == [6, 14]
    assert sampler[1][2][-1] == 0
    # a clip norm that clips some examples and leaves others: the median norm
    norms = _per_example(copy, *sampler[0]).norms
    clip = float(np.median(norms[norms > 0]))
    sigma, lr = 0.8, 0.05
    private = jk.privacy.make_private(
        model,
        l2_norm_clip=clip,
        noise_multiplier=sigma,
        sampling_rate=Q,
        num_examples=N,
        seed=SEED,
        per_layer=per_layer,
    )
    private.compile(_optimizer(kind, lr), LOSS, run_eagerly=eager)
    if not eager:
        private.prepare(sampler)
    reference = _Reference(kind, lr, [v.numpy() for v in copy.trainable_variables])
    weights = [v.numpy().astype(np.float64) for v in copy.trainable_variables]
    clipped_some = False
    worst = 0.0
    before = weights
    for t in range(2):
        xb, yb, wb = sampler[t]
        clipping = private.clipping or privacy_step.clipping_for(
            model, model.trainable_variables, clip, per_layer
        )
        grads = _reference_gradient(copy, xb, yb, wb, clipping, t, sigma)
        weights = reference.update(weights, grads)
        for v, w in zip(copy.trainable_variables, weights):
            v.assign(w)
        logs = private.train_on_batch(xb, yb, sample_weight=wb, return_dict=True)
        clipped_some |= 0 < logs["clipped"] < 1
        after = [v.numpy().astype(np.float64) for v in model.trainable_variables]
        # the update's largest value (Adam's is about lr whatever the gradient)
        update = max(float(np.abs(w - b).max()) for w, b in zip(weights, before))
        for want, got in zip(weights, after):
            spacing = np.spacing(np.abs(want).astype(np.float32)).astype(np.float64)
            error = np.maximum(np.abs(want - got) - spacing, 0)
            worst = max(worst, float(np.max(error)) / update)
        before = after
    assert int(private.dp_steps.numpy()) == 2
    return worst, clipped_some


def test_the_sampler_includes_each_example_with_probability_q():
    n, q, steps = 200, 0.1, 150
    sampler = jk.privacy.PoissonSampler(
        (np.arange(n, dtype="float32")[:, None], np.arange(n)), q, seed=0
    )
    assert len(sampler) == 10 and sampler.expected_batch_size == pytest.approx(20)
    counts = np.zeros(n)
    sizes = []
    for t in range(steps):
        counts[sampler.indices(t)] += 1
        sizes.append(len(sampler.indices(t)))
    # each example's inclusions: binomial(150, 0.1); their mean over 200
    # examples within 3 standard errors of q
    assert abs(counts.mean() / steps - q) < 3 * math.sqrt(q * (1 - q) / steps / n)
    # the sizes: binomial(200, 0.1), standard deviation 4.2
    assert 3.0 < np.std(sizes) < 5.5
    # independent: two examples' inclusions uncorrelated (|r| < 4 / sqrt(150))
    both = np.array([[i in sampler.indices(t) for i in (0, 1)] for t in range(steps)])
    assert abs(np.corrcoef(both.T)[0, 1]) < 4 / math.sqrt(steps)


def test_the_sampler_pads_to_a_few_sizes_with_weight_zero():
    x = np.arange(200, dtype="float32")[:, None]
    sampler = jk.privacy.PoissonSampler((x, np.arange(200)), 0.1, seed=0)
    sizes = set()
    for t in range(len(sampler)):
        drawn = sampler.indices(t)
        xb, yb, wb = sampler[t]
        n = len(drawn)
        sizes.add(len(wb))
        assert len(wb) == sampler.size(n) >= n
        assert len(wb) <= 1.25 * n or len(wb) == sampler.sizes[0]
        np.testing.assert_array_equal(yb[:n], drawn)
        np.testing.assert_array_equal(xb[:n, 0], drawn.astype("float32"))
        np.testing.assert_array_equal(wb, [1.0] * n + [0.0] * (len(wb) - n))
        np.testing.assert_array_equal(yb[n:], drawn[-1])  # the last, repeated
    assert sizes <= set(sampler.sizes)
    # the bucket sizes from the 1e-3 quantile of binomial(200, 0.1), 8, to
    # the bucket of the 1 - 1e-10 quantile's, 51 (a draw beyond 56: 2e-13)
    assert sampler.sizes == (8, 10, 12, 14, 16, 20, 24, 28, 32, 40, 48, 56)
    with pytest.raises(RuntimeError, match="above the largest padded size 56"):
        sampler.size(57)
    # the same seed draws the same; the next epoch draws anew
    again = jk.privacy.PoissonSampler((x, np.arange(200)), 0.1, seed=0)
    np.testing.assert_array_equal(again[3][1], sampler[3][1])
    first = sampler[0][1]
    sampler.on_epoch_end()  # no epoch began: Keras's call before its first
    np.testing.assert_array_equal(sampler[0][1], first)
    sampler.on_epoch_begin()
    sampler.on_epoch_end()
    assert not np.array_equal(sampler[0][1][: len(first)], first)
    step = sampler.steps_per_epoch  # the second epoch's first step
    np.testing.assert_array_equal(sampler[0][1], again.batch(again.indices(step))[1])


def test_fewer_sizes_per_doubling_pad_more():
    """``sizes_per_doubling=2``: the same quantiles' range in half the
    sizes (8 to 64 by 8, 12, 16, 24, ...), each draw padded by at most half
    its size; a spacing not a power of two, or beside ``sizes=``, refused."""
    x = np.arange(200, dtype="float32")[:, None]
    data = (x, np.arange(200))
    sampler = jk.privacy.PoissonSampler(data, 0.1, seed=0, sizes_per_doubling=2)
    assert sampler.sizes == (8, 12, 16, 24, 32, 48, 64)
    for t in range(len(sampler)):
        n = len(sampler.indices(t))
        size = len(sampler[t][2])
        assert size == min(s for s in sampler.sizes if s >= n) <= max(8, 1.5 * n)
    for bad in (3, 0, True, 2.0):
        with pytest.raises(ValueError, match="a power of two"):
            jk.privacy.PoissonSampler(data, 0.1, sizes_per_doubling=bad)
    with pytest.raises(ValueError, match="no sizes= beside it"):
        jk.privacy.PoissonSampler(data, 0.1, sizes=(8, 64), sizes_per_doubling=2)


def test_an_empty_draw_is_padded_with_weight_zero():
    sampler = jk.privacy.PoissonSampler((np.ones((3, 2)), np.zeros(3)), 1e-6)
    xb, yb, wb = sampler[0]
    assert xb.shape == (1, 2) and wb.tolist() == [0.0]


def test_a_tf_data_set_samples_as_its_arrays():
    x, y = np.arange(30, dtype="float32")[:, None], np.arange(30)
    dataset = tf.data.Dataset.from_tensor_slices((x, y))
    a = jk.privacy.PoissonSampler(dataset, 0.2, seed=1)
    b = jk.privacy.PoissonSampler((x, y), 0.2, seed=1)
    for t in range(3):
        for got, want in zip(a[t], b[t]):
            np.testing.assert_array_equal(got, want)
    with pytest.raises(ValueError, match="infinite"):
        jk.privacy.PoissonSampler(dataset.repeat(), 0.2)
    with pytest.raises(ValueError, match="sampling_rate"):
        jk.privacy.PoissonSampler((x, y), 1.5)


@pytest.mark.parametrize("accountant", ["rdp", "pld"])
def test_epsilon_equals_dp_accountings(accountant):
    dp = pytest.importorskip("dp_accounting")
    q, sigma, steps, delta = 0.01, 1.1, 500, 1e-5
    event = dp.SelfComposedDpEvent(
        dp.PoissonSampledDpEvent(q, dp.GaussianDpEvent(sigma)), steps
    )
    ledger = dp.rdp.RdpAccountant() if accountant == "rdp" else dp.pld.PLDAccountant()
    ledger.compose(event)
    want = ledger.get_epsilon(delta)
    assert jk.privacy.epsilon(q, sigma, steps, delta, accountant) == want
    assert jk.privacy.epsilon(q, sigma, 0, delta, accountant) == 0.0
    assert jk.privacy.epsilon(q, 0.0, steps, delta, accountant) == math.inf


def test_epsilon_refuses_bad_arguments_and_names_the_extra(monkeypatch):
    with pytest.raises(ValueError, match="accountant"):
        jk.privacy.epsilon(0.1, 1.0, 10, 1e-5, "moments")
    with pytest.raises(ValueError, match="delta"):
        jk.privacy.epsilon(0.1, 1.0, 10, 0.0)
    with pytest.raises(ValueError, match="steps"):
        jk.privacy.epsilon(0.1, 1.0, -1, 1e-5)
    monkeypatch.setitem(sys.modules, "dp_accounting", None)
    with pytest.raises(ModuleNotFoundError, match=r"jacobkit\[privacy\]"):
        jk.privacy.epsilon(0.1, 1.0, 10, 1e-5)


def _private(model=None, **kwargs):
    model = model or _mlp()
    settings = dict(
        l2_norm_clip=1.0, noise_multiplier=1.0, sampling_rate=Q, num_examples=N
    )
    return jk.privacy.make_private(model, **{**settings, **kwargs})


@pytest.mark.parametrize(
    "loss, match",
    [
        ("sparse_categorical_crossentropy", "a name makes a loss that averages"),
        (keras.losses.SparseCategoricalCrossentropy(from_logits=True), "averages"),
        (None, "each example's own loss"),
        ({"logits": LOSS}, "one output"),
    ],
    ids=["name", "reducing", "none", "dict"],
)
def test_compile_refuses_a_loss_that_is_not_per_example(loss, match):
    with pytest.raises(ValueError, match=match):
        _private().compile("sgd", loss)


def _mean_loss(y, y_pred):
    return tf.reduce_mean(LOSS(y, y_pred))


def _flat_loss(y, y_pred):
    return tf.reshape(tf.repeat(LOSS(y, y_pred)[:, None], 2, axis=1), (-1,))


def _centred_loss(y, y_pred):
    rows = LOSS(y, y_pred)
    return rows - tf.reduce_mean(rows) + 1.0


@pytest.mark.parametrize(
    "loss, match",
    [
        (_mean_loss, "one value per example"),
        (_flat_loss, "one value per example"),
        (_centred_loss, "depends on the other examples"),
    ],
    ids=["scalar", "two_rows_per_example", "mixing"],
)
@pytest.mark.parametrize("eager", [True, False], ids=["eager", "compiled"])
def test_the_first_step_refuses_rows_not_one_per_example(loss, match, eager):
    model = _mlp()
    before = [v.numpy() for v in model.trainable_variables]
    private = _private(model)
    private.compile("sgd", loss, run_eagerly=eager)
    x, y = _data(model)
    with pytest.raises(ValueError, match=match):
        if eager:
            private.train_on_batch(x[:8], y[:8])
        else:
            sampler = jk.privacy.PoissonSampler((x, y), Q, sizes=(16,))
            private.fit(sampler, verbose=0)
    for v, b in zip(model.trainable_variables, before):
        np.testing.assert_array_equal(v.numpy(), b)


def _with_batch_norm(trainable=True):
    keras.utils.set_random_seed(0)
    model = keras.Sequential(
        [
            keras.Input((6,)),
            keras.layers.Dense(5, name="hidden"),
            keras.layers.BatchNormalization(name="norm"),
            keras.layers.Dense(3, name="logits"),
        ]
    )
    model.get_layer("norm").trainable = trainable
    return model


def test_batch_normalization_in_training_mode_is_refused():
    with pytest.raises(ValueError, match="BatchNormalization trains on batch"):
        _private(_with_batch_norm())
    # frozen (inference mode), or the whole model with training=False: taken
    _private(_with_batch_norm(trainable=False))
    _private(_with_batch_norm(), training=False)


class _Noisy(keras.layers.Layer):
    """A scale after noise drawn by a stateful TensorFlow op (no Keras
    seed generator): no strategy holds it fixed across passes."""

    def build(self, shape):
        self.scale = self.add_weight(shape=(shape[-1],), initializer="ones")

    def call(self, x, training=None):
        if training:
            x = x + tf.random.uniform(tf.shape(x))
        return self.scale * x


def test_draws_one_step_cannot_hold_fixed_are_refused():
    keras.utils.set_random_seed(0)
    model = keras.Sequential(
        [keras.Input((6,)), keras.layers.Dense(5), _Noisy(), keras.layers.Dense(3)]
    )
    private = _private(model)
    private.compile("sgd", LOSS)
    x, y = _data(_mlp())
    with pytest.raises(ValueError, match="cannot hold fixed across forward passes"):
        private.fit(jk.privacy.PoissonSampler((x, y), Q, sizes=(16,)), verbose=0)


def test_settings_that_break_the_step_are_refused():
    with pytest.raises(ValueError, match="noise_multiplier"):
        _private(noise_multiplier=-1.0)
    with pytest.raises(ValueError, match="l2_norm_clip"):
        _private(l2_norm_clip=0.0)
    with pytest.raises(ValueError, match="missing: logits"):
        _private(per_layer={"hidden": 1.0})
    unbuilt = keras.Sequential([keras.layers.Dense(3)])
    with pytest.raises(ValueError, match="build it first"):
        _private(unbuilt)
    model = _mlp()
    x, y = _data(model)
    private = _private(model)
    private.compile("sgd", LOSS)
    with pytest.raises(ValueError, match="Make them agree"):
        private.fit(jk.privacy.PoissonSampler((x, y), 0.5), verbose=0)
    with (
        pytest.warns(UserWarning, match="not a PoissonSampler"),
        pytest.raises(RuntimeError, match="planned on a PoissonSampler"),
    ):
        private.fit(x, y, batch_size=10, epochs=1, verbose=0)


def test_fit_logs_epsilon_after_each_epoch():
    pytest.importorskip("dp_accounting")
    model = _mlp()
    x, y = _data(model)
    q = 0.1
    # two sizes (two branches of the compiled step; a draw above 16 of
    # binomial(40, 0.1): 2e-6)
    sampler = jk.privacy.PoissonSampler(
        (x, y), q, seed=0, steps_per_epoch=1, sizes=(4, 16)
    )
    private = _private(model, noise_multiplier=1.3, sampling_rate=q)
    private.compile(keras.optimizers.SGD(0.1), LOSS, metrics=["accuracy"])
    history = private.fit(
        sampler, epochs=2, callbacks=[jk.privacy.EpsilonCallback(1e-5)], verbose=0
    )
    want = [jk.privacy.epsilon(q, 1.3, steps, 1e-5) for steps in (1, 2)]
    assert history.history["epsilon"] == want
    assert private.epsilon(1e-6) == jk.privacy.epsilon(q, 1.3, 2, 1e-6)
    assert {"loss", "accuracy", "clipped"} <= set(history.history)
    # calling the private model calls the user's; the user's model is not
    # compiled by it, nor its layers replaced
    np.testing.assert_array_equal(private(x[:3]), model(x[:3]))
    assert not getattr(model, "compiled", False)
    assert [layer.name for layer in model.layers] == ["hidden", "logits"]


@pytest.mark.slow
def test_fit_trains_digits_privately():
    """scikit-learn's digits, a 64-32-10 MLP, 4 epochs of 22 steps at
    ``q = 64 / 1437``, ``C = 1``, ``sigma = 1``: test accuracy 0.892
    measured (seed 0), epsilon 3.46 at ``delta = 1e-5``; held to 0.8."""
    digits = dp_sgd.load_digits(0)
    keras.utils.set_random_seed(0)
    model = keras.Sequential(
        [
            keras.Input((64,)),
            keras.layers.Dense(32, activation="tanh"),
            keras.layers.Dense(10),
        ]
    )
    n = len(digits.x_train)
    q = 64 / n
    sampler = jk.privacy.PoissonSampler((digits.x_train, digits.y_train), q, seed=0)
    private = jk.privacy.make_private(
        model, l2_norm_clip=1.0, noise_multiplier=1.0, sampling_rate=q, num_examples=n
    )
    private.compile(keras.optimizers.SGD(0.5, momentum=0.5), LOSS)
    history = private.fit(
        sampler, epochs=4, callbacks=[jk.privacy.EpsilonCallback(1e-5)], verbose=0
    )
    predicted = np.argmax(model.predict(digits.x_test, verbose=0), -1)
    assert np.mean(predicted == digits.y_test) > 0.8
    assert history.history["epsilon"][-1] == pytest.approx(3.46, abs=0.01)


def test_per_layer_clip_norms_in_the_models_order():
    model = _mlp()
    variables = model.trainable_variables
    found = privacy_step.clipping_for(
        model, variables, 1.0, {"logits": 0.3, "hidden": 0.4}
    )
    assert found.names == ("hidden", "logits")
    assert found.clips == (0.4, 0.3) and found.total == pytest.approx(0.5)
    assert found.groups == ((0, 1), (2, 3))
    even = privacy_step.clipping_for(model, variables, 2.0, True)
    assert even.clips == pytest.approx((2 / math.sqrt(2),) * 2)
    assert even.total == pytest.approx(2.0)


class _Subclassed(keras.Model):
    def __init__(self, **kwargs):
        super().__init__(**{"name": "subclassed", **kwargs})
        self.hidden = keras.layers.Dense(5, activation="tanh")
        self.logits = keras.layers.Dense(3)

    def call(self, x, training=None):
        return self.logits(self.hidden(x))


@pytest.mark.slow
def test_a_subclassed_model_steps_as_the_float64_reference():
    keras.utils.set_random_seed(0)
    model = _Subclassed()
    x, y = _data(_mlp())
    model(x[:2])
    copy = jk.testing.float64_copy(model, x[:2])
    sampler = jk.privacy.PoissonSampler((x, y), Q, seed=4, sizes=(6, 14))
    private = _private(model, l2_norm_clip=0.3, noise_multiplier=0.5, seed=SEED)
    private.compile(keras.optimizers.SGD(0.05), LOSS)
    private.prepare(sampler)
    data = sampler[1]
    clipping = privacy_step.clipping_for(model, model.trainable_variables, 0.3, False)
    grads = _reference_gradient(copy, *data, clipping, 0, 0.5)
    before = [v.numpy().astype(np.float64) for v in model.trainable_variables]
    private.train_on_batch(*data[:2], sample_weight=data[2])
    update = max(float(np.abs(0.05 * g).max()) for g in grads)
    for b, v, g in zip(before, model.trainable_variables, grads):
        want = b - 0.05 * g
        spacing = np.spacing(np.abs(want).astype(np.float32)).astype(np.float64)
        assert np.all(np.abs(v.numpy() - want) <= RTOL["sgd"] * update + spacing)


@pytest.mark.slow
def test_a_keras_application_with_batch_normalization_is_refused():
    model = keras.applications.MobileNetV3Small(
        input_shape=(32, 32, 3), weights=None, classes=3, include_preprocessing=False
    )
    with pytest.raises(ValueError, match="BatchNormalization trains on batch"):
        _private(model)
    _private(model, training=False)  # its moving statistics: taken


class _Counted(keras.Model):
    """The MLP, counting the forward passes its traced steps run."""

    def __init__(self) -> None:
        super().__init__(name="counted")
        self.inner = _mlp()
        self.passes = 0

    def call(self, x, training=None):
        self.passes += 1
        return self.inner(x, training=training)


def test_the_compiled_step_logs_its_own_passes_loss_without_another_pass():
    """The logged loss comes from the clipped sum's own forward pass: the
    weighted mean of the examples' losses before the step, in float64, each
    step; and with no ``metrics`` the traced step runs the model once per
    branch and group (no inference pass). Measured: 6e-8 relative."""
    model = _Counted()
    model(np.zeros((1, 6), "float32"))
    x, y = _data(_mlp())
    sampler = jk.privacy.PoissonSampler((x, y), Q, seed=SEED, sizes=(8, 16))
    private = jk.privacy.make_private(
        model, l2_norm_clip=1.0, noise_multiplier=0.5, sampling_rate=Q, num_examples=N
    )
    private.compile(keras.optimizers.SGD(0.1), LOSS)
    private.prepare(sampler)
    for t in range(2):
        data = sampler[t]
        copy = _mlp()
        copy.set_weights(model.get_weights())
        logits = np.asarray(copy(data[0]), np.float64)
        shifted = logits - logits.max(-1, keepdims=True)
        log_p = shifted - np.log(np.exp(shifted).sum(-1, keepdims=True))
        losses = -log_p[np.arange(len(data[1])), data[1]]
        want = float(np.sum(losses * data[2]) / np.sum(data[2]))
        private.reset_metrics()
        logs = private.train_on_batch(
            *data[:2], sample_weight=data[2], return_dict=True
        )
        print(f"loss's relative error: {abs(logs['loss'] - want) / want:.1e}")
        assert logs["loss"] == pytest.approx(want, rel=1e-6)
    before = model.passes
    private.train_function = None  # the step traced anew
    private.train_on_batch(*sampler[2][:2], sample_weight=sampler[2][2])
    assert model.passes == before


#: models of the per-layer stress test (each its own weights and trace)
STRESS_MODELS = 10


def test_compiled_per_layer_steps_of_many_models_equal_the_reference():
    """A bug the one computation removed: the compiled step with one
    ``jk.function`` per clipping group sometimes computed a group's clipped
    sums (relative error 1e-2) with a variable of another group read after
    this step's update of it (the eager step always matched; TF's graph
    optimizations reordered the read, although the control edges were
    there). It showed in about 1 model in 10 (machine loaded), so here
    ``STRESS_MODELS`` models of their own weights, Adam (an update of one
    group changes what another reads), two compiled steps each against the
    float64 reference. Measured by hand (100 models each, the machine
    loaded / more loaded): the per-group path failed 8 and 15 models, and
    this test (10 models) in 2 runs of 2; the one computation, 0 and 0."""
    failed = []
    for seed in range(STRESS_MODELS):
        build = _mlp if seed % 2 == 0 else _conv
        worst, _ = _two_steps(build(seed + 1), "adam", True, False)
        if worst > RTOL["adam"]:
            failed.append((seed, worst))
    assert not failed, failed


class _Recording(jk.privacy.PoissonSampler):
    """A sampler recording the size of each batch ``fit`` trains on (from
    its first epoch on: not the batches Keras peeks at for the dataset's
    shapes before it)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.drawn = None

    def on_epoch_begin(self):
        if self.drawn is None:
            self.drawn = []

    def __getitem__(self, index):
        found = super().__getitem__(index)
        if self.drawn is not None:
            self.drawn.append(len(found[2]))
        return found


class _Traces(keras.callbacks.Callback):
    """The step's traces after each step."""

    def __init__(self):
        super().__init__()
        self.counts = []

    def on_train_batch_end(self, batch, logs=None):
        self.counts.append(self.model.train_function.tracing_count)


def test_fit_traces_only_the_sizes_its_batches_come_in(caplog):
    """``fit``'s step is traced once per batch size that comes, when it
    first comes (the first step: one size), not once per padded size of the
    sampler: after a few steps, the step's traces and each planned
    ``jk.function``'s equal the distinct sizes of the batches drawn; and
    TensorFlow does not warn of frequent retracing (5 traces in the last 10
    calls of one function would)."""
    model = _mlp()
    x, y = _data(model)
    sampler = _Recording((x, y), Q, seed=SEED, steps_per_epoch=4)
    private = _private(model, seed=SEED)
    # with metrics: their variables, made in a trace, would trace it twice
    private.compile(keras.optimizers.SGD(0.1), LOSS, metrics=["accuracy"])
    traces = _Traces()
    with caplog.at_level("WARNING", logger="tensorflow"):
        private.fit(sampler, epochs=2, verbose=0, callbacks=[traces])
    assert "retracing" not in caplog.text
    drawn = sampler.drawn
    assert len(drawn) == int(private.dp_steps.numpy()) == 8
    sizes = set(drawn)
    # draws of binomial(40, 0.25): several sizes, far fewer than the ladder's
    assert 1 < len(sizes) < len(sampler.sizes) == 15
    assert private.train_function.tracing_count == len(sizes)
    assert private.traced.function.tracing_count == len(sizes)
    # traced when first met: the count after step t is the sizes up to t
    assert traces.counts == [len(set(drawn[: t + 1])) for t in range(8)]


class _Steps(jk.privacy.PoissonSampler):
    """A sampler recording the run's step of each batch drawn in an epoch."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.steps = []
        self.inside = False

    def on_epoch_begin(self):
        super().on_epoch_begin()
        self.inside = True

    def on_epoch_end(self):
        super().on_epoch_end()
        self.inside = False

    def __getitem__(self, index):
        if self.inside:
            self.steps.append(self.epoch * self.steps_per_epoch + index)
        return super().__getitem__(index)


def test_fit_draws_the_runs_steps_in_order():
    """Two ``fit`` calls of two epochs of 3 steps draw steps 0 to 11 of the
    run, each epoch its own three (Keras's ``on_epoch_end`` before a first
    epoch moves nothing; before, the first epoch drew steps 3 to 5)."""
    model = _mlp()
    x, y = _data(model)
    sampler = _Steps((x, y), Q, seed=SEED, steps_per_epoch=3)
    private = _private(model, seed=SEED)
    private.compile(keras.optimizers.SGD(0.1), LOSS)
    private.fit(sampler, epochs=2, verbose=0)
    private.fit(sampler, epochs=2, verbose=0)
    # fit's shuffle=True permutes the batches within each epoch
    epochs = [sorted(sampler.steps[i : i + 3]) for i in range(0, 12, 3)]
    assert epochs == [list(range(i, i + 3)) for i in range(0, 12, 3)]
    assert int(private.dp_steps.numpy()) == 12
    assert sampler.epoch == 4


def test_steps_per_execution_takes_the_same_steps():
    """``compile(steps_per_execution=3)``: each call of the train function
    takes three DP steps (the last call of an epoch of 4 steps, one): the
    same weights as one step per call, bit for bit (the same traced step on
    the same batches)."""
    weights = []
    for each in (1, 3):
        model = _mlp()
        x, y = _data(model)
        sampler = jk.privacy.PoissonSampler((x, y), Q, seed=SEED, steps_per_epoch=4)
        private = _private(model, seed=SEED)
        private.compile(keras.optimizers.SGD(0.1), LOSS, steps_per_execution=each)
        private.fit(sampler, epochs=2, verbose=0)
        assert int(private.dp_steps.numpy()) == 8
        weights.append([v.numpy() for v in model.trainable_variables])
    for one, three in zip(*weights):
        np.testing.assert_array_equal(one, three)
