"""Example models of every other kind jacobkit accepts: several inputs, a
subclassed model, ``tf_keras``, a layer called twice, a plain ``tf.Module``
(frozen backbones: :mod:`jacobkit.testing.example_backbones`)."""

from __future__ import annotations

from typing import Any

import numpy as np
import tensorflow as tf

from jacobkit.testing.example import (
    Example,
    keras_module,
    randomize_weights,
    rng_inputs,
)

__all__ = [
    "Affine",
    "multi_input",
    "shared_layer",
    "subclassed",
    "tf_keras_mlp",
    "tf_module",
]


def multi_input(dtype: str = "float32", seed: int = 0, *, batch: int = 3) -> Example:
    """Two inputs, ``(B, 6)`` and ``(B, 4, 3)``, joined before a Dense head.
    Target: ``"branch_a"``."""
    keras = keras_module()
    layers = keras.layers
    a = keras.Input((6,), dtype=dtype, name="a")
    b = keras.Input((4, 3), dtype=dtype, name="b")
    ha = layers.Dense(5, activation="tanh", name="branch_a", dtype=dtype)(a)
    hb = layers.Flatten(dtype=dtype)(
        layers.Conv1D(2, 2, name="branch_b", dtype=dtype)(b)
    )
    h = layers.Concatenate(dtype=dtype)([ha, hb])
    y = layers.Dense(4, name="head", dtype=dtype)(h)
    model = keras.Model((a, b), y, name="multi_input")
    randomize_weights(model, seed)
    xa, xb = rng_inputs(seed, dtype, (batch, 6), (batch, 4, 3))
    return Example(
        "multi_input",
        model,
        (xa, xb),
        "branch_a",
        "two inputs → Dense",
        {"batch": batch},
    )


def subclassed(dtype: str = "float32", seed: int = 0, *, batch: int = 3) -> Example:
    """A subclassed ``keras.Model`` with Dense layers in ``call``. Target:
    ``"inner"``."""
    keras = keras_module()

    class TwoLayer(keras.Model):  # type: ignore[name-defined]
        def __init__(self) -> None:
            super().__init__(name="subclassed", dtype=dtype)
            self.inner = keras.layers.Dense(
                6, activation="sigmoid", name="inner", dtype=dtype
            )
            self.out = keras.layers.Dense(3, name="head", dtype=dtype)

        def call(self, x: Any, training: Any = False) -> Any:
            return self.out(self.inner(x) * x[:, :1])

    model = TwoLayer()
    (x,) = rng_inputs(seed, dtype, (batch, 5))
    model(x)
    randomize_weights(model, seed)
    return Example(
        "subclassed", model, x, "inner", "subclassed keras.Model", {"batch": batch}
    )


def tf_keras_mlp(dtype: str = "float32", seed: int = 0, *, batch: int = 3) -> Example:
    """A ``tf_keras`` (Keras 2) Sequential model. Target: ``"k2_hidden"``."""
    import tf_keras

    layers = tf_keras.layers
    model = tf_keras.Sequential(
        [
            layers.Dense(
                7, activation="elu", name="k2_hidden", dtype=dtype, input_shape=(5,)
            ),
            layers.Dense(4, name="k2_head", dtype=dtype),
        ]
    )
    randomize_weights(model, seed)
    (x,) = rng_inputs(seed, dtype, (batch, 5))
    return Example(
        "tf_keras", model, x, "k2_hidden", "tf_keras Sequential", {"batch": batch}
    )


def shared_layer(dtype: str = "float32", seed: int = 0, *, batch: int = 3) -> Example:
    """One Dense layer applied at two call sites (its input then depends on
    its own kernel). Target: ``"shared"``."""
    keras = keras_module()
    layers = keras.layers
    x = keras.Input((5,), dtype=dtype)
    shared = layers.Dense(5, activation="tanh", name="shared", dtype=dtype)
    h = shared(shared(x))
    y = layers.Dense(3, name="head", dtype=dtype)(h)
    model = keras.Model(x, y, name="shared_layer")
    randomize_weights(model, seed)
    (inputs,) = rng_inputs(seed, dtype, (batch, 5))
    return Example(
        "shared_layer",
        model,
        inputs,
        "shared",
        "a Dense layer used twice",
        {"batch": batch},
    )


class Affine(tf.Module):
    """``tanh(x @ w + b) @ v``: a plain ``tf.Module`` reading tf.Variables."""

    def __init__(self, dtype: str, seed: int) -> None:
        super().__init__(name="affine")
        rng = np.random.default_rng(seed)
        self.w = tf.Variable(rng.normal(scale=0.5, size=(4, 6)), dtype=dtype, name="w")
        self.b = tf.Variable(rng.normal(scale=0.3, size=(6,)), dtype=dtype, name="b")
        self.v = tf.Variable(rng.normal(scale=0.5, size=(6, 3)), dtype=dtype, name="v")

    def __call__(self, x: Any) -> Any:
        return tf.tanh(x @ self.w + self.b) @ self.v


def tf_module(dtype: str = "float32", seed: int = 0, *, batch: int = 3) -> Example:
    """A ``tf.Module`` (no Keras). Targets: the variables ``[w, b]``."""
    module = Affine(dtype, seed)
    (x,) = rng_inputs(seed, dtype, (batch, 4))
    return Example(
        "tf_module", module, x, [module.w, module.b], "tf.Module", {"batch": batch}
    )
