"""The batch strategy's closed-form contraction (unfolded patches and one
einsum) on every Dense/Conv configuration it accepts, against the float64
reference, and its refusals."""

from __future__ import annotations

import keras
import numpy as np
import pytest
import tensorflow as tf

import jacobkit as jk
from jacobkit import testing

LAYERS = {
    "dense-rank3": (lambda: keras.layers.Dense(4, activation="tanh"), (7, 3)),
    "conv1d-same-stride2": (
        lambda: keras.layers.Conv1D(4, 3, strides=2, padding="same"),
        (9, 3),
    ),
    "conv1d-valid-dilation2": (
        lambda: keras.layers.Conv1D(4, 3, dilation_rate=2, activation="relu"),
        (9, 3),
    ),
    "conv1d-causal": (
        lambda: keras.layers.Conv1D(4, 3, padding="causal", dilation_rate=2),
        (8, 3),
    ),
    "conv2d-same-stride2": (
        lambda: keras.layers.Conv2D(3, (3, 2), strides=(2, 1), padding="same"),
        (7, 6, 2),
    ),
    "conv2d-valid-dilation": (
        lambda: keras.layers.Conv2D(3, 2, dilation_rate=(2, 1), use_bias=False),
        (7, 6, 2),
    ),
}


def _model(make, shape, dtype):
    x = keras.Input(shape, dtype=dtype)
    layer = make()
    layer.dtype_policy = keras.DTypePolicy(dtype)
    h = layer(x)
    h = keras.layers.Flatten(dtype=dtype)(h) if len(shape) > 2 else h
    y = keras.layers.Dense(3, activation="tanh", dtype=dtype)(h)
    return keras.Model(x, y), layer


@pytest.mark.parametrize("outputs", ["features", "per_example", "full"])
@pytest.mark.parametrize("config", list(LAYERS))
def test_closed_form_agrees_with_float64_reference(config, outputs):
    make, shape = LAYERS[config]
    keras.utils.set_random_seed(0)
    model, layer = _model(make, shape, "float32")
    model64, layer64 = _model(make, shape, "float64")
    model64.set_weights([w.astype("float64") for w in model.get_weights()])
    x = np.random.default_rng(1).normal(size=(3, *shape))
    result = jk.jacobian(
        model, x.astype("float32"), layer, strategy="batch", outputs=outputs
    )
    expected = testing.reference_jacobian(
        model64, x, layer64.trainable_weights, outputs=outputs
    )
    # measured: at most 3.2e-7 relative (conv1d-causal, features; float32
    # rounding), within the default float32 tolerance of 1e-5
    testing.assert_close(result, expected)


def test_grouped_convolution_is_refused():
    grouped = lambda: keras.layers.Conv1D(4, 3, groups=2)  # noqa: E731
    model, layer = _model(grouped, (8, 4), "float32")
    x = np.ones((2, 8, 4), "float32")
    with pytest.raises(ValueError) as err:
        jk.jacobian(model, x, layer, strategy="batch", outputs="per_example")
    assert str(err.value) == (
        f"jacobian(strategy='batch'): layer {layer.name!r} is not supported: "
        "groups=2 (only groups=1). Use strategy='chunked' or 'jacobian'."
    )


def test_conv_under_a_narrower_linear_head_starts_on_the_shortcut():
    """Per-example rows of a convolution under a linear head on D=6 < F=8
    channels: auto starts on the structured shortcut with batch inside (its
    backward passes shrink from F rows to D), and agrees with float64
    (assert_close's derived tolerance; measured ~3e-7 relative)."""
    from jacobkit.testing import examples

    sizes = {
        "batch": 3,
        "sequence": 12,
        "channels": 4,
        "filters": 5,
        "filters3": 6,
        "features": 8,
    }
    ex = examples.build("generator", **sizes)
    wide = examples.build("generator", "float64", **sizes)
    result = jk.jacobian(ex.model, ex.inputs, "conv1", outputs="per_example")
    assert result.strategy_config.label == "structured(batch)"
    expected = testing.reference_jacobian(
        wide.model,
        wide.inputs,
        wide.model.get_layer("conv1").trainable_weights,
        outputs="per_example",
    )
    testing.assert_close(result, expected)


def test_per_example_loss_norms_for_clipping():
    """docs/per-example.md's recipe: rows are each example's loss (labels
    bound in ``outputs=``), ``reduce="norm"`` their gradients' norms over
    every trainable variable; against one float64 tape per example."""
    keras.utils.set_random_seed(0)
    model = keras.Sequential(
        [
            keras.Input((4,)),
            keras.layers.Dense(8, activation="tanh", name="hidden"),
            keras.layers.Dense(3, name="logits"),
        ]
    )
    rng = np.random.default_rng(0)
    x = rng.normal(size=(5, 4)).astype("float32")
    y = rng.integers(0, 3, size=5)

    def losses(logits):
        return keras.losses.sparse_categorical_crossentropy(y, logits, from_logits=True)

    norms = jk.jacobian(
        model, x, model.trainable_variables, outputs=losses, reduce="norm"
    )
    per_example = np.sqrt(sum(np.square(n) for n in norms.jacobians.values()))
    copy = testing.float64_copy(model)
    expected = []
    for b in range(len(x)):
        with tf.GradientTape() as tape:
            logits = copy(x[b : b + 1].astype("float64"))
            loss = keras.losses.sparse_categorical_crossentropy(
                y[b : b + 1], logits, from_logits=True
            )[0]
        grads = tape.gradient(loss, copy.trainable_variables)
        expected.append(np.sqrt(sum(float(np.sum(np.square(g))) for g in grads)))
    # measured 3.7e-8 relative (float32 against float64); 1e-5 allowed
    assert testing.max_relative_difference(per_example, expected) < 1e-5
