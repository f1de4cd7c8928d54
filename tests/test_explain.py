"""``jacobkit.explain``: every class in one call, against tf-keras-vis (class
by class, normalization off) and against independent float64 tape references.

Tolerances (measured on the models below): saliency and Grad-CAM against
tf-keras-vis 0 and 9e-8 (both float32); saliency and gradient x input
against float64 1.3e-7 and 1.1e-7. We allow 1e-4 against float64 and 1e-5
against tf-keras-vis.
"""

from __future__ import annotations

import warnings

import keras
import numpy as np
import pytest
import tensorflow as tf

import jacobkit as jk
from jacobkit import explain, testing
from jacobkit.explain import CompletenessWarning
from jacobkit.testing import examples

CLASSES = 4


def _cnn(backbone: bool = False):
    """A small image classifier; with ``backbone``, its convolutions inside a
    nested functional model, as in transfer learning."""
    inp = keras.Input((12, 12, 3))
    h = keras.layers.Conv2D(6, 3, activation="relu", name="c1")(inp)
    h = keras.layers.Conv2D(8, 3, activation="relu", name="c2")(h)
    if backbone:
        inner = keras.Model(inp, h, name="backbone")
        inp = keras.Input((12, 12, 3))
        h = inner(inp)
    h = keras.layers.GlobalAveragePooling2D()(h)
    out = keras.layers.Dense(CLASSES, name="head")(h)
    return keras.Model(inp, out)


def _mlp():
    """Dense layers only: no convolution gradient kernels, whose work space
    (32 MiB per pass without oneDNN) would dwarf a small budget."""
    inp = keras.Input((12, 12, 3))
    h = keras.layers.Dense(16, activation="tanh")(keras.layers.Flatten()(inp))
    return keras.Model(inp, keras.layers.Dense(CLASSES, name="head")(h))


@pytest.fixture(scope="module")
def images():
    return np.random.default_rng(0).normal(size=(3, 12, 12, 3)).astype("float32")


def _input_gradients64(model, x, classes):
    """float64 ``dY[b, k] / dx[b]``, one tape per class: ``(B, K, ...)``."""
    model64 = testing.float64_copy(model)
    x64 = tf.constant(x, tf.float64)
    grads = []
    for k in classes:
        with tf.GradientTape() as tape:
            tape.watch(x64)
            y = model64(x64)[:, k]
        grads.append(tape.gradient(y, x64))
    return np.stack([g.numpy() for g in grads], axis=1)


def _close(actual, expected, tol=1e-4):
    assert actual.shape == expected.shape
    assert testing.max_relative_difference(actual, expected) < tol


# -- against tf-keras-vis -----------------------------------------------------
def test_saliency_equals_tf_keras_vis_for_every_class(images):
    from tf_keras_vis.saliency import Saliency
    from tf_keras_vis.utils.scores import CategoricalScore

    model = _cnn()
    mine = explain.saliency(model, images)
    assert mine.shape == (3, CLASSES, 12, 12)
    theirs = Saliency(model, clone=False)
    for k in range(CLASSES):
        score = CategoricalScore([k] * len(images))
        ref = theirs(score, images, keepdims=False, normalize_map=False)
        _close(np.asarray(mine[:, k]), ref, 1e-5)


def test_grad_cam_equals_tf_keras_vis_for_every_class(images):
    from tf_keras_vis.gradcam import Gradcam
    from tf_keras_vis.utils.scores import CategoricalScore

    model = _cnn()
    mine = explain.grad_cam(model, images, "c2", resize=False)
    assert mine.shape == (3, CLASSES, 8, 8)
    theirs = Gradcam(model, clone=False)
    for k in range(CLASSES):
        score = CategoricalScore([k] * len(images))
        ref = theirs(
            score, images, penultimate_layer="c2", normalize_cam=False, expand_cam=False
        )
        _close(np.asarray(mine[:, k]), ref, 1e-5)


def test_grad_cam_agrees_with_tf_keras_vis_exactly_when_it_takes_the_same_layer(
    images,
):
    """tf-keras-vis's ``Gradcam`` seeks back from ``penultimate_layer`` to the
    last Keras ``Conv1D``/``Conv2D``/``Conv3D`` at or before it
    (``seek_penultimate_conv_layer=True``, its default); jacobkit takes the
    layer it is given. On a separate ReLU after a convolution, they agree with
    ``seek_penultimate_conv_layer=False`` and not with the default, which
    gives the convolution's map."""
    from tf_keras_vis.gradcam import Gradcam
    from tf_keras_vis.utils.scores import CategoricalScore

    inp = keras.Input((12, 12, 3))
    h = keras.layers.Conv2D(6, 3, activation="relu", name="c1")(inp)
    h = keras.layers.Conv2D(8, 3, name="c2")(h)
    h = keras.layers.ReLU(name="relu")(keras.layers.BatchNormalization(name="bn")(h))
    h = keras.layers.GlobalAveragePooling2D()(h)
    model = keras.Model(inp, keras.layers.Dense(CLASSES, name="head")(h))
    examples.randomize_weights(model, seed=0)
    on_relu = np.asarray(explain.grad_cam(model, images, "relu", resize=False))
    on_conv = np.asarray(explain.grad_cam(model, images, "c2", resize=False))
    theirs = Gradcam(model, clone=False)
    off = dict(normalize_cam=False, expand_cam=False, penultimate_layer="relu")
    exact, sought = [], []
    for k in range(CLASSES):
        score = CategoricalScore([k] * len(images))
        exact.append(theirs(score, images, seek_penultimate_conv_layer=False, **off))
        sought.append(theirs(score, images, **off))  # the default: c2's map
    # measured 7e-8 to 1.8e-7 against tf-keras-vis (both float32)
    _close(on_relu, np.stack(exact, axis=1), 1e-5)
    _close(on_conv, np.stack(sought, axis=1), 1e-5)
    # the two layers' maps differ: measured 0.38 of the largest value (0.11 to
    # 2.9 class by class)
    assert testing.max_relative_difference(on_relu, np.stack(sought, axis=1)) > 0.1


# -- against float64 tape references -----------------------------------------
@pytest.mark.parametrize("classes", [None, [3, 1]])
def test_input_methods_agree_with_float64(images, classes):
    model = _cnn()
    chosen = list(range(CLASSES)) if classes is None else classes
    grads = _input_gradients64(model, images, chosen)
    _close(
        np.asarray(explain.saliency(model, images, classes=classes)),
        np.abs(grads).max(axis=-1),
    )
    _close(
        np.asarray(explain.gradient_x_input(model, images, classes=classes)),
        grads * images[:, None],
    )


def _gauss_legendre(steps):
    """Gauss-Legendre's points on ``[0, 1]`` and their weights, from
    scipy's roots (jacobkit takes numpy's)."""
    from scipy.special import roots_legendre

    nodes, weights = roots_legendre(steps)
    return (1 + nodes) / 2, weights / 2


@pytest.mark.parametrize("rule", ["gauss_legendre", "riemann"])
def test_integrated_gradients_rules_and_a_budget(images, rule):
    """The default is Gauss-Legendre (captum's): ``steps`` points inside the
    path, weighted; ``"riemann"`` the plain mean over ``linspace(0, 1,
    steps)``. Measured against float64 1.3e-7; 1e-4 allowed."""
    model = _mlp()
    # 480 KiB: the gradients of 5 of the 6 steps' copies fit a quarter of it,
    # so the steps run in 2 chunks of 3
    steps, budget = 6, 480 * 1024
    if rule == "riemann":
        alphas, weights = np.linspace(0.0, 1.0, steps), np.full(steps, 1 / steps)
        call = dict(steps=steps, rule="riemann")
    else:
        alphas, weights = _gauss_legendre(steps)
        call = dict(steps=steps)  # the default
    path = [_input_gradients64(model, a * images, range(CLASSES)) for a in alphas]
    expected = np.tensordot(weights, path, axes=1) * images[:, None]
    found = explain.integrated_gradients(model, images, **call)
    assert found.rule == rule
    _close(np.asarray(found.maps), expected)
    # under a budget that holds fewer steps' gradients than all: chunks, the
    # same numbers, and a peak within the budget
    with jk.memory.PeakMemory() as peak:
        chunked = explain.integrated_gradients(
            model, images, memory_budget=budget, **call
        )
    _close(np.asarray(chunked.maps), expected)
    if peak.extra_bytes is not None:
        assert peak.extra_bytes <= budget


@pytest.mark.parametrize("baseline", [None, 0.5])
def test_integrated_gradients_trapezoid_is_xpliques_rule(images, baseline):
    """xplique's ``IntegratedGradients._average_gradients``: the mean over the
    ``steps - 1`` intervals of the mean of their two ends' gradients, on the
    same ``linspace(0, 1, steps)`` path; computed here in float64."""
    model = _mlp()
    steps, budget = 5, 480 * 1024
    x0 = np.zeros_like(images) if baseline is None else np.full_like(images, 0.5)
    alphas = np.linspace(0.0, 1.0, steps)
    path = [
        _input_gradients64(model, x0 + a * (images - x0), range(CLASSES))
        for a in alphas
    ]
    intervals = [(path[i] + path[i + 1]) / 2 for i in range(steps - 1)]
    trapezoid = np.mean(intervals, axis=0) * (images - x0)[:, None]
    call = dict(steps=steps, baseline=baseline, rule="trapezoid")
    # measured 1.8e-7 (whole and in chunks under the budget); 1e-4 allowed
    found = explain.integrated_gradients(model, images, **call)
    _close(np.asarray(found.maps), trapezoid)
    chunked = explain.integrated_gradients(model, images, memory_budget=budget, **call)
    _close(np.asarray(chunked.maps), trapezoid)
    # the plain mean differs at 5 steps (measured 7.9e-3 to 4.8e-2 here, by
    # the random model the test order draws): the two rules are told apart
    # 10x above _close's 1e-4; xplique's numbers need rule="trapezoid", not
    # the default (Gauss-Legendre: other points)
    riemann = np.mean(path, axis=0) * (images - x0)[:, None]
    assert testing.max_relative_difference(trapezoid, riemann) > 1e-3
    mean = explain.integrated_gradients(
        model, images, steps=steps, baseline=baseline, rule="riemann"
    )
    _close(np.asarray(mean.maps), riemann)


def _rows64(model, x):
    """float64 ``Y[b, k]`` of a float64 copy of ``model``: ``(B, K)``."""
    return testing.float64_copy(model)(tf.constant(x, tf.float64)).numpy()


@pytest.mark.parametrize("rule", ["riemann", "trapezoid", "gauss_legendre"])
def test_integrated_gradients_gap_is_the_completeness_error(images, rule):
    """``gap[b, k]`` is captum's convergence delta: the maps' sum minus ``f(x)
    - f(x0)``, here against float64 (rows by a float64 copy, the maps by
    float64 tape gradients on the same path with the same weights). It
    shrinks as steps grow: riemann about as 1 / steps, trapezoid as 1 /
    steps^2, Gauss-Legendre faster on this smooth (tanh) model; a large one
    warns, in jacobkit's words."""
    model = _mlp()
    x0 = np.full_like(images, 0.25)
    change = _rows64(model, images) - _rows64(model, x0)
    largest = []
    for steps in (4, 16):
        alphas = np.linspace(0.0, 1.0, steps)
        weights = np.full(steps, 1.0 / steps)
        if rule == "trapezoid":
            weights = np.full(steps, 1.0 / (steps - 1))
            weights[[0, -1]] = 0.5 / (steps - 1)
        elif rule == "gauss_legendre":
            alphas, weights = _gauss_legendre(steps)
        path = [_input_gradients64(model, x0 + a * (images - x0), range(CLASSES))
                for a in alphas]  # fmt: skip
        maps = np.tensordot(weights, path, axes=1) * (images - x0)[:, None]
        expected = maps.reshape(*maps.shape[:2], -1).sum(-1) - change
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            found = explain.integrated_gradients(
                model, images, steps=steps, baseline=x0[0], rule=rule
            )
        assert found.gap.shape == (3, CLASSES) == found.relative_gap.shape
        bound = 1e-5 * np.abs(change).max()
        found_change = found.outputs - found.baseline_outputs
        np.testing.assert_allclose(found_change, change, rtol=0, atol=bound)
        # float32 maps and rows against float64: measured at most 6.7e-7 of
        # the largest change (the ends 6.0e-7; riemann and trapezoid, 4 and
        # 16 steps; Gauss-Legendre within the same bound); 1e-5 allowed
        np.testing.assert_allclose(found.gap, expected, rtol=0, atol=bound)
        # the warning's rule, written out: a row whose change is below 1% of
        # the call's largest is judged against that 1% (a CI run's random
        # model had a row of gap 7.2e-2 of its own, tiny, change, which the
        # warning rightly let pass and a division by the row's own failed)
        size = np.abs(change)
        relative = np.abs(expected) / np.maximum(size, 0.01 * size.max())
        large = [w for w in caught if issubclass(w.category, CompletenessWarning)]
        assert bool(large) == bool((relative > 0.05).any()), relative
        if large:
            assert "more steps shrink the gap" in str(large[0].message)
        largest.append(np.abs(found.gap).max())
    print(f"{rule}: largest gap at 4 and 16 steps {largest[0]:.1e}, {largest[1]:.1e}")
    # measured 4 -> 16 steps: riemann's largest gap 4.6x smaller (8.5e-2 ->
    # 1.9e-2 in one run), trapezoid's 36x (its worst row 48% -> 1.3% of its
    # change, no warning at 16), Gauss-Legendre's 1.3e-3 -> 8.3e-7 (1600x,
    # down to float32's rounding of the rows)
    shrink = {"riemann": 3, "trapezoid": 12, "gauss_legendre": 200}[rule]
    assert largest[1] < largest[0] / shrink, largest


def test_smoothgrad_is_the_mean_over_the_same_noisy_copies(images):
    model = _cnn()
    samples, noise = 3, 0.3
    x = tf.constant(images)
    copies = [
        x + tf.random.stateless_normal(x.shape, (7, i), stddev=noise)
        for i in range(samples)
    ]
    expected = np.mean(
        [_input_gradients64(model, c.numpy(), range(CLASSES)) for c in copies], axis=0
    )
    mine = explain.smoothgrad(model, images, samples=samples, noise=noise, seed=7)
    _close(np.asarray(mine), expected)


def test_grad_cam_on_a_nested_backbone_agrees_with_float64(images):
    model = _cnn(backbone=True)
    backbone = model.get_layer("backbone")
    mine = explain.grad_cam(model, images, "backbone/c2", resize=True)
    assert mine.shape == (3, CLASSES, 12, 12)
    # reference: A = the backbone's output (its last layer is c2), the rest
    # of the model as a function of A, in float64
    model64 = testing.float64_copy(model)
    a = tf.constant(backbone(images).numpy(), tf.float64)
    pool = keras.layers.GlobalAveragePooling2D(dtype="float64")
    head = model64.get_layer("head")
    cams = []
    for k in range(CLASSES):
        with tf.GradientTape() as tape:
            tape.watch(a)
            y = head(pool(a))[:, k]
        weights = tf.reduce_mean(tape.gradient(y, a), axis=(1, 2))
        cam = tf.nn.relu(tf.einsum("bc,bhwc->bhw", weights, a))
        cams.append(tf.image.resize(cam[..., None], (12, 12))[..., 0].numpy())
    _close(np.asarray(mine), np.stack(cams, axis=1))


def test_a_plain_callable_and_a_tf_keras_model(images):
    import tf_keras

    w = tf.constant(np.random.default_rng(1).normal(size=(12 * 12 * 3, CLASSES)))

    def f(x):
        flat = tf.reshape(tf.cast(x, tf.float64), (x.shape[0], -1))
        return tf.cast(tf.tanh(flat @ w), x.dtype)

    x64 = tf.constant(images, tf.float64)
    grads = []
    for k in range(CLASSES):
        with tf.GradientTape() as tape:
            tape.watch(x64)
            y = tf.tanh(tf.reshape(x64, (3, -1)) @ w)[:, k]
        grads.append(tape.gradient(y, x64).numpy())
    _close(
        np.asarray(explain.gradient_x_input(f, images)),
        np.stack(grads, 1) * images[:, None],
    )

    old = tf_keras.Sequential(
        [
            tf_keras.Input((12, 12, 3)),
            tf_keras.layers.Conv2D(5, 3, activation="relu", name="c1"),
            tf_keras.layers.GlobalAveragePooling2D(),
            tf_keras.layers.Dense(CLASSES, name="head"),
        ]
    )
    ref = _input_gradients64(old, images, range(CLASSES))
    _close(np.asarray(explain.saliency(old, images)), np.abs(ref).max(axis=-1))
    cam = explain.grad_cam(old, images, "c1", resize=False)
    assert cam.shape == (3, CLASSES, 10, 10) and float(tf.reduce_min(cam)) >= 0


def test_mistakes_are_refused_in_one_sentence(images):
    model = _cnn()
    with pytest.raises(TypeError, match="floating"):
        explain.saliency(model, images.astype("int32"))
    with pytest.raises(ValueError, match="batch"):
        explain.saliency(model, images[0, 0, 0])
    with pytest.raises(ValueError, match="steps"):
        explain.integrated_gradients(model, images, steps=1)
    with pytest.raises(ValueError, match=r"rule='simpson'\): expected 'gauss_"):
        explain.integrated_gradients(model, images, rule="simpson")
    with pytest.raises(ValueError, match="c9"):
        explain.grad_cam(model, images, "c9")


def test_plot_draws_images_by_classes(images):
    import matplotlib

    matplotlib.use("Agg")
    maps = explain.saliency(_cnn(), images, classes=[0, 2])
    fig = explain.plot(maps, images, classes=["cat", "dog"])
    axes = fig.get_axes()
    assert len(axes) == 3 * 2
    assert [ax.get_title() for ax in axes[:2]] == ["cat", "dog"]


def test_plot_wants_one_name_per_class(images):
    """Fewer names than classes was a bare IndexError from the grid."""
    import matplotlib

    matplotlib.use("Agg")
    maps = np.zeros((3, 4, 12, 12), "float32")
    with pytest.raises(ValueError, match=r"2 names for 4 classes .*maps\[:, :2\]"):
        explain.plot(maps, images, classes=["cat", "dog"])
    with pytest.raises(ValueError, match="5 names for 4 classes"):
        explain.plot(maps, classes=["a", "b", "c", "d", "e"])
