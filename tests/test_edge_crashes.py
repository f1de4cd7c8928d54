"""Issue 48's crashes and raw errors: each either works now (checked against
an independent float64 reference) or ends in jacobkit's own words."""

from __future__ import annotations

import importlib
import subprocess
import sys

import keras
import numpy as np
import pytest
import tensorflow as tf

import jacobkit as jk
from jacobkit import testing

RNG = np.random.default_rng(48)


def embedding_model() -> keras.Model:
    tokens = keras.Input((5,), dtype="int32")
    h = keras.layers.Embedding(11, 4, name="emb")(tokens)
    h = keras.layers.GlobalAveragePooling1D()(h)
    return keras.Model(tokens, keras.layers.Dense(3, name="head")(h))


@pytest.mark.parametrize("every_variable", [False, True], ids=["layer", "all"])
def test_verify_on_an_embedding_reads_its_indexed_slices(every_variable):
    """The table's gradient is IndexedSlices; verify compared it as an array
    (TypeError). A float64 reference passes, a wrong one is refused."""
    model = embedding_model()
    tokens = RNG.integers(0, 11, size=(2, 5)).astype("int32")
    layer = model.trainable_variables if every_variable else "emb"
    reference = testing.float64_reference(model, tokens, layer, baseline=False)
    assert jk.verify(list(reference), model, tokens, layer) < 1e-5
    wrong = [array.copy() for array in reference]
    wrong[0] = wrong[0] * 1.5
    with pytest.raises(jk.VerificationError, match="^verify: the Jacobian for "):
        jk.verify(wrong, model, tokens, layer)


class Centre(keras.layers.Layer):
    """Subtracts the batch mean: every example's output mixes the batch's."""

    def call(self, x):
        return x - tf.reduce_mean(x, axis=0, keepdims=True)


def mixing_model() -> keras.Model:
    x = keras.Input((3,))
    h = Centre()(keras.layers.Dense(4, name="m1")(x))
    return keras.Model(x, keras.layers.Dense(2, name="m2")(h))


def test_a_mixing_model_with_variables_is_refused_in_words_and_auto_falls_back():
    """With a list of variables there is no target layer; the refusal named
    ``problem.layer.name`` (AttributeError), so auto and jk.gram crashed."""
    model = mixing_model()
    x = RNG.normal(size=(4, 3)).astype("float32")
    y = np.zeros(4, "float32")
    loss = jk.Loss(lambda _, out: tf.reduce_sum(out**2, axis=-1))
    variables = model.trainable_variables
    with pytest.raises(ValueError, match="mixes examples across the batch") as info:
        jk.jacobian(model, (x, y), variables, outputs=loss, strategy="batch")
    assert "at the targets (m1/kernel, m1/bias, m2/kernel, ...)" in str(info.value)
    reference = testing.float64_reference(
        model, (x, y), variables, outputs=loss, baseline=False
    )
    norms = jk.jacobian(model, (x, y), variables, outputs=loss, reduce="norm")
    largest = max(abs(rows).max() for rows in reference)
    for norm, rows in zip(norms.jacobians.values(), reference):
        expected = np.linalg.norm(rows.reshape(4, -1), axis=1)
        np.testing.assert_allclose(norm, expected, rtol=1e-5, atol=1e-6 * largest)
    gram = jk.gram(model, (x, y), layer=variables, outputs=loss, chunk_examples=4)
    flat = np.concatenate([r.reshape(4, -1) for r in reference], axis=1)
    expected = flat @ flat.T
    np.testing.assert_allclose(
        gram.matrix, expected, rtol=1e-5, atol=1e-6 * abs(expected).max()
    )


def test_separable_conv2d_under_keras_default_name_keeps_its_closed_form():
    """``tf.nn.separable_conv2d`` opens a scope named ``separable_conv2d``
    inside the layer's; the layer's call was taken for that inner scope."""
    x = keras.Input((6, 6, 2))
    h = keras.layers.SeparableConv2D(3, 3)(x)
    h = keras.layers.SeparableConv2D(3, 3)(h)
    model = keras.Model(x, keras.layers.Dense(2)(keras.layers.Flatten()(h)))
    assert model.layers[1].name.startswith("separable_conv2d")
    inputs = RNG.normal(size=(2, 6, 6, 2)).astype("float32")
    variables = model.trainable_variables
    result = jk.jacobian(model, inputs, variables, strategy="batch")
    testing.assert_close(result, testing.float64_reference(model, inputs, variables))


@pytest.mark.parametrize(
    "clip",
    [tf.constant(1.5), np.float32(1.5), np.array(1.5), tf.constant(3, tf.int32)],
    ids=["tf-scalar", "np-float32", "np-0d", "tf-int"],
)
def test_clipped_sum_takes_scalar_tensors(clip):
    reduction = jk.ClippedSum(clip)
    assert type(reduction.clip_norm) is float
    assert reduction.clip_norm == float(np.asarray(clip))


@pytest.mark.parametrize(
    "clip",
    [tf.constant([1.0, 2.0]), tf.constant(True), tf.constant(-1.0), "1.0"],
    ids=["vector", "bool", "negative", "string"],
)
def test_clipped_sum_still_refuses_what_is_not_a_positive_number(clip):
    with pytest.raises(ValueError, match=r"^jk\.ClippedSum\(clip_norm="):
        jk.ClippedSum(clip)


def test_testing_is_an_attribute_of_jacobkit_before_it_is_imported():
    code = "import jacobkit as jk; print(jk.testing.__name__)"
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    )
    assert done.stdout.strip() == "jacobkit.testing"
    assert "testing" in dir(importlib.import_module("jacobkit"))
