"""A call's own pre-activation ``z`` behind an activation of several ops
(:func:`jacobkit.keras.pre_activation.pre_activation`): GELU (stock, and keras_hub's
tanh approximation as BERT calls it), swish (a ``tf.custom_gradient``) and a
user's function of ``z`` alone are walked back to the bias's add, in a traced
pass and in an eager pass's record; the values found are compared with
``x @ W + b`` in float64. Where the walk could take something else for ``z``
(an activation reading a variable of its own, a Dense without a bias), it
finds nothing or ``z`` itself; with nothing found the rule is computed beside
the model as before.

Tolerance: ``z`` is the model's own float32 ``x @ W + b``: 1e-5 of its
largest value (measured: 2.4e-7 oneDNN on, 1.2e-7 off).
"""

from __future__ import annotations

import keras
import numpy as np
import pytest
import tensorflow as tf

import jacobkit as jk
from jacobkit.keras import calls
from jacobkit.keras.pre_activation import pre_activation
from jacobkit.layers.stock import ONE_OP_ACTIVATIONS

RTOL = 1e-5
RNG = np.random.default_rng(3)


def _gelu_approximate(x):
    """keras_hub's ``gelu_approximate``, as BERT's feed-forward layer calls
    it (a function, not a stock activation's name)."""
    return keras.activations.gelu(x, approximate=True)


def _user(x):
    return x * tf.tanh(1.5 * x) + 0.25


ACTIVATIONS = {
    "gelu": "gelu",
    "gelu_approximate": _gelu_approximate,
    "swish": "swish",
    "user": _user,
}


def _layer(activation, use_bias=True) -> tuple[keras.layers.Dense, np.ndarray]:
    layer = keras.layers.Dense(5, activation=activation, use_bias=use_bias)
    x = RNG.normal(size=(3, 4, 6)).astype("float32")
    layer(x)
    if use_bias:  # a bias that is not zero, so that z is not x @ W
        layer.bias.assign(RNG.normal(size=5).astype("float32"))
    return layer, x


def _want(layer, x) -> np.ndarray:
    kernel = np.asarray(layer.kernel, np.float64)
    bias = np.asarray(layer.bias, np.float64) if layer.use_bias else 0.0
    return x.astype(np.float64) @ kernel + bias


def _traced(layer, x):
    """``pre_activation`` of the layer's one call in a traced pass: the
    values of ``z`` (or ``None``) and of the output."""
    found = []

    @tf.function
    def run(inputs):
        y = layer(inputs)
        graph = tf.compat.v1.get_default_graph()
        (call,) = calls.layer_calls(graph, layer, layer.weights)
        out = [t for t in call.outputs if t.dtype.is_floating][-1]
        z = pre_activation(layer, out, ONE_OP_ACTIVATIONS)
        found.append(z is not None)
        return y, z if z is not None else tf.zeros(())

    y, z = run(tf.constant(x))
    return (z.numpy() if found[0] else None), y.numpy()


def _eager(layer, x):
    record = calls.Record()
    inputs = tf.constant(x)
    with record:
        y = layer(inputs)
    (call,) = calls.eager_layer_calls(record, layer, layer.weights, inputs)
    out = [t for t in call.outputs if t.dtype.is_floating][-1]
    assert out is y
    z = pre_activation(layer, out, ONE_OP_ACTIVATIONS, record)
    return None if z is None else z.numpy()


@pytest.mark.parametrize("name", list(ACTIVATIONS))
def test_the_model_s_own_z_is_found_behind_several_ops(name):
    layer, x = _layer(ACTIVATIONS[name])
    want = _want(layer, x)
    traced, y = _traced(layer, x)
    eager = _eager(layer, x)
    assert traced is not None and eager is not None
    scale = np.max(np.abs(want))
    np.testing.assert_allclose(traced, want, rtol=0, atol=RTOL * scale)
    np.testing.assert_allclose(eager, want, rtol=0, atol=RTOL * scale)
    # the activation really is between them: the output is not z
    assert np.max(np.abs(y - want)) > 0.01 * scale


def test_an_activation_reading_a_variable_of_its_own_is_not_taken_for_z():
    """``tanh(z * s)`` with a variable ``s``: in a traced pass the walk stops
    at the read of a variable not the layer's (nothing found); eagerly that
    read is not recorded (its value is a scalar no op made, as a constant
    is), and the walk goes on through the product to ``z`` itself, never
    ``z * s``."""
    scale = tf.Variable(3.0)
    layer, x = _layer(lambda z: tf.tanh(z * scale))
    want = _want(layer, x)
    assert _traced(layer, x)[0] is None
    eager = _eager(layer, x)
    if eager is not None:
        np.testing.assert_allclose(
            eager, want, rtol=0, atol=RTOL * np.max(np.abs(want))
        )


def test_a_dense_without_a_bias_finds_nothing():
    """No bias's add: the walk meets the matmul's two-dimensional product
    (the rule is computed beside the model)."""
    layer, x = _layer("gelu", use_bias=False)
    assert _traced(layer, x)[0] is None
    assert _eager(layer, x) is None


class GeluBlock(keras.Model):
    """A subclassed model whose GELU Dense is called from Python (found in
    the traced pass, its z by the walk), with a second Dense after it."""

    def __init__(self) -> None:
        super().__init__()
        self.ffn = keras.layers.Dense(7, activation=_gelu_approximate, name="ffn")
        self.head = keras.layers.Dense(3, name="head")

    def call(self, x):
        return self.head(self.ffn(x))


def test_gram_through_a_gelu_called_from_python_agrees_with_float64():
    """``jk.gram`` (and so the cotangent at the walked-to ``z``) against
    per-example float64 gradients of every weight, formed with a tape."""
    model = GeluBlock()
    x = RNG.normal(size=(4, 5, 6)).astype("float32")
    model(x)
    model.ffn.bias.assign(RNG.normal(size=7).astype("float32"))
    found = jk.gram(model, x, outputs=lambda y: tf.reduce_sum(y**2, axis=(1, 2)))
    x64 = tf.constant(x, tf.float64)
    weights = [tf.Variable(tf.cast(v, tf.float64)) for v in model.trainable_variables]
    kernel, bias, head_kernel, head_bias = weights
    rows = []
    for b in range(len(x)):
        with tf.GradientTape() as tape:
            h = _gelu_approximate(x64[b] @ kernel + bias)
            y = h @ head_kernel + head_bias
            loss = tf.reduce_sum(y**2)
        grads = tape.gradient(loss, weights)
        rows.append(np.concatenate([g.numpy().ravel() for g in grads]))
    flat = np.stack(rows)
    want = flat @ flat.T
    got = np.asarray(found.matrix)
    # measured: 1.3e-7 of the largest value (oneDNN on and off)
    np.testing.assert_allclose(got, want, rtol=0, atol=RTOL * np.max(np.abs(want)))
