"""Grad-CAM through a pooled linear head (``GlobalAveragePooling2D ->
(Dropout) -> Dense(C)``, with or without a softmax or a sigmoid): every
class's map as one matmul of the activation by the head's kernel, no
backward pass.

Each case is checked against the generic path (``shortcut=False``: one
``jacobian`` call) and against a float64 reference that differentiates the
float64 copy of the whole model at the tapped activation by autodiff
(``batch_jacobian``, every class), knowing nothing of the head.

Tolerances (max relative difference to the largest map value), measured
with oneDNN on: shortcut against float64 2.6e-7 (the conv nets, linear,
softmax and sigmoid heads) and 2.7e-6 on MobileNetV2 (1000 classes, linear or softmax:
its float32 forward pass, the generic path's error too, 2.8e-6); shortcut
against the generic path 3.3e-7 (conv nets) and 7.9e-7 (MobileNetV2). We
allow 1e-5 everywhere.
"""

from __future__ import annotations

import keras
import numpy as np
import pytest
import tensorflow as tf

from jacobkit import explain, testing
from jacobkit.keras.graph import LayerTap
from jacobkit.problem import pooled_head
from jacobkit.problem.targets import find_layer
from jacobkit.testing.reference_targets import watched_output

TOL = 1e-5


def _reference(model, layer, x):
    """float64 Grad-CAM of every class, ``(B, C, h, w)``: the gradient of
    each output at ``layer``'s output by autodiff of the whole float64 model."""
    model64 = testing.float64_copy(model)
    tap = LayerTap(model64, find_layer(model64, layer, with_variables=False))
    with tf.GradientTape() as tape:
        y, a = watched_output(tap, tape, tf.constant(x, tf.float64), False)
    grads = tape.batch_jacobian(y, a)  # (B, C, h, w, K)
    weights = tf.reduce_mean(grads, axis=(2, 3))
    return tf.nn.relu(tf.einsum("bkc,bhwc->bkhw", weights, a)).numpy()


def _close(actual, expected):
    actual = np.asarray(actual)
    assert actual.shape == expected.shape
    assert np.abs(expected).max() > 0
    assert testing.max_relative_difference(actual, expected) < TOL


def _convnet(top):
    """A small functional conv net; ``top`` builds what follows the
    feature map ``feat``."""
    keras.utils.set_random_seed(1)
    inp = keras.Input((10, 10, 3))
    h = keras.layers.Conv2D(8, 3, activation="relu", name="c1")(inp)
    h = keras.layers.Conv2D(12, 3, activation="relu", name="feat")(h)
    return keras.Model(inp, top(h))


def _dropout_softmax(h):
    h = keras.layers.Dropout(0.5)(keras.layers.GlobalAveragePooling2D()(h))
    return keras.layers.Dense(7, activation="softmax", name="head")(h)


def _softmax_layer(h):
    h = keras.layers.Dense(7, name="head")(keras.layers.GlobalAveragePooling2D()(h))
    return keras.layers.Softmax()(h)


def _sigmoid_dense(h):
    h = keras.layers.GlobalAveragePooling2D()(h)
    return keras.layers.Dense(7, activation="sigmoid", name="head")(h)


def _sigmoid_layer(h):
    h = keras.layers.Dense(7, name="head")(keras.layers.GlobalAveragePooling2D()(h))
    return keras.layers.Activation("sigmoid")(h)


def _mlp_head(h):
    h = keras.layers.GlobalAveragePooling2D()(h)
    h = keras.layers.Dense(16, activation="relu", name="hidden")(h)
    return keras.layers.Dense(7, name="head")(h)


@pytest.fixture(scope="module")
def images():
    return np.random.default_rng(0).normal(size=(3, 10, 10, 3)).astype("float32")


@pytest.fixture(scope="module")
def mobilenet():
    keras.utils.set_random_seed(0)
    model = keras.applications.MobileNetV2(
        input_shape=(64, 64, 3),
        alpha=0.35,
        weights=None,
        classes=1000,
        classifier_activation=None,
    )
    x = np.random.default_rng(0).normal(size=(2, 64, 64, 3)).astype("float32")
    return model, x


def test_mobilenet_v2_1000_classes_take_the_head_and_agree_with_float64(mobilenet):
    # about 8 s loaded (tracing MobileNetV2 twice: the shortcut's pass, and
    # the float64 reference); the generic path on it: the slow tests below
    model, x = mobilenet
    found = pooled_head.find(model, model.get_layer("out_relu"), False)
    assert found.head.name == "predictions" and not found.softmax
    mine = explain.grad_cam(model, x, "out_relu", resize=False)
    assert mine.shape == (2, 1000, 2, 2)
    _close(mine, _reference(model, "out_relu", x))


@pytest.mark.slow
def test_mobilenet_v2_a_few_classes_against_the_generic_path(mobilenet):
    model, x = mobilenet
    chosen = [0, 17, 999, -2]
    fast = explain.grad_cam(model, x, "out_relu", classes=chosen, resize=False)
    generic = explain.grad_cam(
        model, x, "out_relu", classes=chosen, resize=False, shortcut=False
    )
    _close(fast, np.asarray(generic, np.float64))
    every = explain.grad_cam(model, x, "out_relu", resize=False)
    _close(fast, np.asarray(every)[:, [0, 17, 999, 998]].astype(np.float64))


@pytest.mark.slow
def test_mobilenet_v2_softmax_every_class_against_the_generic_path():
    # about 17 s loaded: the generic path differentiates 1000 classes
    keras.utils.set_random_seed(0)
    model = keras.applications.MobileNetV2(
        input_shape=(64, 64, 3), alpha=0.35, weights=None, classes=1000
    )
    x = np.random.default_rng(0).normal(size=(2, 64, 64, 3)).astype("float32")
    assert pooled_head.find(model, model.get_layer("out_relu"), False).softmax
    mine = explain.grad_cam(model, x, "out_relu", resize=False)
    generic = explain.grad_cam(model, x, "out_relu", resize=False, shortcut=False)
    _close(mine, np.asarray(generic, np.float64))
    _close(mine, _reference(model, "out_relu", x))


@pytest.mark.parametrize(
    "top, after",
    [
        (_dropout_softmax, "a softmax"),
        (_softmax_layer, "a softmax"),
        (_sigmoid_dense, "sigmoid"),
        (_sigmoid_layer, "sigmoid"),
    ],
)
def test_heads_with_an_activation_take_the_head_and_agree_both_ways(top, after, images):
    model = _convnet(top)
    found = pooled_head.find(model, model.get_layer("feat"), False)
    assert found.describe().endswith(f"'head' and {after}")
    mine = explain.grad_cam(model, images, "feat", resize=True)
    generic = explain.grad_cam(model, images, "feat", resize=True, shortcut=False)
    _close(mine, np.asarray(generic, np.float64))
    expected = _reference(model, "feat", images)  # (B, C, 6, 6)
    up = tf.image.resize(expected.reshape(-1, 6, 6, 1), (10, 10), "bilinear")
    _close(mine, up.numpy().reshape(3, 7, 10, 10))
    chosen = explain.grad_cam(model, images, "feat", classes=[5, 1], resize=False)
    _close(chosen, expected[:, [5, 1]])


def test_an_mlp_head_is_refused_and_takes_the_generic_path(images):
    model = _convnet(_mlp_head)
    with pytest.raises(
        pooled_head.NotApplicable, match="'hidden'.*not a GlobalAverage"
    ):
        pooled_head.find(model, model.get_layer("feat"), False)
    expected = _reference(model, "feat", images)
    mine = explain.grad_cam(model, images, "feat", resize=False)
    _close(mine, expected)
    generic = explain.grad_cam(model, images, "feat", resize=False, shortcut=False)
    assert np.array_equal(np.asarray(mine), np.asarray(generic))


def test_a_nested_backbone_in_a_sequential_model_takes_the_head(images):
    keras.utils.set_random_seed(2)
    inp = keras.Input((10, 10, 3))
    h = keras.layers.Conv2D(8, 3, activation="relu", name="c1")(inp)
    backbone = keras.Model(inp, keras.layers.Conv2D(12, 3, name="feat")(h))
    model = keras.Sequential(
        [
            keras.Input((10, 10, 3)),
            backbone,
            keras.layers.GlobalAveragePooling2D(),
            keras.layers.Dense(5, name="head"),
        ]
    )
    layer = backbone.get_layer("feat")
    assert not pooled_head.find(model, layer, False).softmax
    mine = explain.grad_cam(model, images, f"{backbone.name}/feat", resize=False)
    _close(mine, _reference(model, f"{backbone.name}/feat", images))


def test_heads_that_are_not_linear_pooling_are_refused():
    flat = _convnet(lambda h: keras.layers.Dense(4)(keras.layers.Flatten()(h)))
    with pytest.raises(pooled_head.NotApplicable, match="not a GlobalAveragePool"):
        pooled_head.find(flat, flat.get_layer("feat"), False)
    model = _convnet(_dropout_softmax)
    with pytest.raises(pooled_head.NotApplicable, match="training=True"):
        pooled_head.find(model, model.get_layer("feat"), True)
    with pytest.raises(pooled_head.NotApplicable, match="not from 'c1'"):
        pooled_head.find(model, model.get_layer("c1"), False)


def test_classes_out_of_range_are_refused_in_jacobkits_words(images):
    model = _convnet(_softmax_layer)
    with pytest.raises(ValueError, match="class 7 is out of range .* 7 classes"):
        explain.grad_cam(model, images, "feat", classes=[7])
    with pytest.raises(ValueError, match=r"expects shape \(None, 10, 10, 3\)"):
        explain.grad_cam(model, images[..., :2], "feat")


def test_mixed_precision_maps_in_the_kernels_dtype(images):
    # float16 activations: measured 6.3e-4 from float64 (the generic path
    # 9.1e-4) and 5.1e-4 from the generic path; we allow 5e-3
    keras.utils.set_random_seed(1)
    mixed = "mixed_float16"
    inp = keras.Input((10, 10, 3))
    h = keras.layers.Conv2D(8, 3, activation="relu", dtype=mixed)(inp)
    h = keras.layers.Conv2D(12, 3, activation="relu", name="feat", dtype=mixed)(h)
    h = keras.layers.GlobalAveragePooling2D(dtype=mixed)(h)
    out = keras.layers.Dense(7, activation="softmax", name="head", dtype=mixed)(h)
    model = keras.Model(inp, out)
    assert pooled_head.find(model, model.get_layer("feat"), False).softmax
    mine = explain.grad_cam(model, images, "feat", resize=False)
    generic = explain.grad_cam(model, images, "feat", resize=False, shortcut=False)
    assert mine.dtype == generic.dtype == tf.float32
    expected = _reference(model, "feat", images)
    assert testing.max_relative_difference(np.asarray(mine), expected) < 5e-3
    assert testing.max_relative_difference(np.asarray(mine), np.asarray(generic)) < 5e-3


def test_a_keras_hub_image_classifier_takes_the_head():
    # keras_hub's ImageClassifier: backbone -> pooler -> output_dropout ->
    # predictions; measured 6.8e-7 from float64 (and 0 from the generic path,
    # not rechecked here: the conv nets above check it)
    import keras_hub

    keras.utils.set_random_seed(0)
    backbone = keras_hub.models.ResNetBackbone(
        input_conv_filters=[64],
        input_conv_kernel_sizes=[3],
        stackwise_num_filters=[64, 8],
        stackwise_num_blocks=[1, 1],
        stackwise_num_strides=[1, 2],
        block_type="basic_block",
        use_pre_activation=False,
        image_shape=(16, 16, 3),
    )
    model = keras_hub.models.ResNetImageClassifier(
        backbone=backbone, num_classes=5, preprocessor=None, activation=None
    )
    last = backbone.layers[-1]
    found = pooled_head.find(model, last, False)
    assert found.head.name == "predictions" and not found.softmax
    x = np.random.default_rng(0).normal(size=(2, 16, 16, 3)).astype("float32")
    path = f"{backbone.name}/{last.name}"
    mine = explain.grad_cam(model, x, path, resize=False)
    _close(mine, _reference(model, path, x))


def test_the_compiled_maps_read_the_heads_kernel_at_each_call(images):
    # the kernel is read inside the compiled call, never kept: new weights
    # (a training step, here an assignment) give new maps
    model = _convnet(_softmax_layer)
    explain.grad_cam(model, images, "feat", resize=False)
    kernel = model.get_layer("head").kernel
    kernel.assign(np.random.default_rng(3).normal(size=kernel.shape))
    mine = explain.grad_cam(model, images, "feat", resize=False)
    _close(mine, _reference(model, "feat", images))
