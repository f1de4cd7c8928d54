"""Built-in example problems: models shaped like the users' cases.

Each builder makes a model, its inputs and the target layer, deterministic in
``seed``, in float32 or float64 with the *same* weights (the float64 copy is
the tests' reference). The tests, the benchmarks, the notebooks and
``jacobkit compare`` all build their problems here.

>>> ex = build("mlp", batch=2)
>>> ex.model(ex.inputs).shape
TensorShape([2, 10])
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import tensorflow as tf


@dataclass
class Example:
    """A model, its inputs and the layer (or variables) to differentiate.

    Attributes:
        name: the builder's name.
        model: the model (Keras 3, ``tf_keras``, or a ``tf.Module``).
        inputs: NumPy inputs (a tuple for multi-input models).
        layer: a layer name, or a list of variables.
        description: one line for tables.
        sizes: the sizes it was built with.
    """

    name: str
    model: Any
    inputs: Any
    layer: Any
    description: str
    sizes: dict[str, int] = field(default_factory=dict)


def _keras():
    import keras

    return keras


def _rng_inputs(seed: int, dtype: str, *shapes: tuple[int, ...]) -> list[np.ndarray]:
    rng = np.random.default_rng(seed + 1000)
    return [rng.normal(size=shape).astype(dtype) for shape in shapes]


def _randomize_weights(model: Any, seed: int) -> None:
    """Give every weight (batch-norm statistics included) a seeded value, so
    that float32 and float64 builds share weights and no layer is trivial."""
    rng = np.random.default_rng(seed)
    values = []
    for w in model.get_weights():
        fan_in = int(np.prod(w.shape[:-1])) if w.ndim > 1 else 1
        scale = 1.0 / np.sqrt(max(fan_in, 1)) if w.ndim > 1 else 0.3
        value = rng.normal(scale=scale, size=w.shape)
        values.append(value)
    # batch-norm variances must be positive
    names = [w.path if hasattr(w, "path") else w.name for w in model.weights]
    values = [
        np.abs(v) + 0.5 if "variance" in n else v
        for v, n in zip(values, names, strict=True)
    ]
    model.set_weights(
        [v.astype(w.dtype) for v, w in zip(values, model.get_weights(), strict=True)]
    )


def generator(
    dtype: str = "float32",
    seed: int = 0,
    *,
    batch: int = 3,
    sequence: int = 8,
    channels: int = 4,
    filters: int = 6,
    features: int = 5,
    filters2: int | None = None,
    filters3: int | None = None,
) -> Example:
    """The users' core case: Conv1D stack → Dense(features) on
    ``(batch, sequence, channels)``; output ``(batch, sequence, features)``.
    The convolutions have ``filters``, ``filters2`` and ``filters3`` filters
    (the last two default to ``filters``). Target: the first Conv1D
    (``"conv1"``)."""
    keras = _keras()
    layers = keras.layers
    x = keras.Input((sequence, channels), dtype=dtype)
    h = layers.Conv1D(
        filters, 5, padding="same", activation="relu", name="conv1", dtype=dtype
    )(x)
    h = layers.Conv1D(
        filters2 or filters,
        5,
        padding="same",
        activation="relu",
        name="conv2",
        dtype=dtype,
    )(h)
    h = layers.Conv1D(
        filters3 or filters,
        3,
        padding="same",
        activation="tanh",
        name="conv3",
        dtype=dtype,
    )(h)
    y = layers.Dense(features, name="head", dtype=dtype)(h)
    model = keras.Model(x, y, name="generator")
    _randomize_weights(model, seed)
    (inputs,) = _rng_inputs(seed, dtype, (batch, sequence, channels))
    return Example(
        "generator",
        model,
        inputs,
        "conv1",
        "Conv1D x3 → Dense",
        {"batch": batch, "sequence": sequence, "features": features},
    )


def mlp(
    dtype: str = "float32",
    seed: int = 0,
    *,
    batch: int = 4,
    inputs: int = 12,
    hidden: int = 16,
    features: int = 10,
) -> Example:
    """A plain MLP: Dense(relu) → Dense(tanh) → Dense(features). Target:
    ``"hidden1"``."""
    keras = _keras()
    layers = keras.layers
    model = keras.Sequential(
        [
            keras.Input((inputs,), dtype=dtype),
            layers.Dense(hidden, activation="relu", name="hidden1", dtype=dtype),
            layers.Dense(hidden, activation="tanh", name="hidden2", dtype=dtype),
            layers.Dense(features, name="head", dtype=dtype),
        ],
        name="mlp",
    )
    _randomize_weights(model, seed)
    (x,) = _rng_inputs(seed, dtype, (batch, inputs))
    return Example(
        "mlp", model, x, "hidden1", "Dense x3", {"batch": batch, "features": features}
    )


def cnn2d(
    dtype: str = "float32",
    seed: int = 0,
    *,
    batch: int = 2,
    height: int = 8,
    width: int = 7,
    filters: int = 4,
    features: int = 3,
) -> Example:
    """Conv2D → Conv2D → Flatten → Dense → Dense(features); the spectrogram
    CNN of the users' third case at any size. Target: ``"conv1"``."""
    keras = _keras()
    layers = keras.layers
    model = keras.Sequential(
        [
            keras.Input((height, width, 1), dtype=dtype),
            layers.Conv2D(filters, 3, activation="relu", name="conv1", dtype=dtype),
            layers.Conv2D(filters, 3, activation="relu", name="conv2", dtype=dtype),
            layers.Flatten(dtype=dtype),
            layers.Dense(8, activation="relu", name="dense", dtype=dtype),
            layers.Dense(features, name="head", dtype=dtype),
        ],
        name="cnn2d",
    )
    _randomize_weights(model, seed)
    (x,) = _rng_inputs(seed, dtype, (batch, height, width, 1))
    return Example(
        "cnn2d",
        model,
        x,
        "conv1",
        "Conv2D x2 → Dense x2",
        {"batch": batch, "features": features},
    )


def spectrogram(
    dtype: str = "float32",
    seed: int = 0,
    *,
    batch: int = 2,
    frames: int = 7,
    bins: int = 6,
    filters: int = 16,
    hidden: int = 128,
    features: int = 3,
) -> Example:
    """The users' third case with its widths: Conv2D(filters, 3) →
    Conv2D(filters, 3) → Flatten → Dense(hidden, relu) → Dense(features) on
    spectrograms ``(batch, frames, bins, 1)``. Target: the wide Dense layer
    (``"dense"``), whose kernel has ``(frames-4)*(bins-4)*filters*hidden``
    elements. The defaults are small; the benchmarks scale ``frames`` and
    ``bins``."""
    keras = _keras()
    layers = keras.layers
    model = keras.Sequential(
        [
            keras.Input((frames, bins, 1), dtype=dtype),
            layers.Conv2D(filters, 3, activation="relu", name="conv1", dtype=dtype),
            layers.Conv2D(filters, 3, activation="relu", name="conv2", dtype=dtype),
            layers.Flatten(dtype=dtype),
            layers.Dense(hidden, activation="relu", name="dense", dtype=dtype),
            layers.Dense(features, name="head", dtype=dtype),
        ],
        name="spectrogram",
    )
    _randomize_weights(model, seed)
    (x,) = _rng_inputs(seed, dtype, (batch, frames, bins, 1))
    return Example(
        "spectrogram",
        model,
        x,
        "dense",
        "spectrogram CNN: Conv2D x2 → Dense(hidden) → Dense",
        {"batch": batch, "frames": frames, "bins": bins, "features": features},
    )


def residual(
    dtype: str = "float32", seed: int = 0, *, batch: int = 2, size: int = 6
) -> Example:
    """A residual block with BatchNormalization (inference mode) and a Dense
    head on a GlobalAveragePooling. Target: ``"conv_a"``."""
    keras = _keras()
    layers = keras.layers
    x = keras.Input((size, size, 3), dtype=dtype)
    h = layers.Conv2D(4, 3, padding="same", name="conv_a", dtype=dtype)(x)
    h = layers.BatchNormalization(name="bn", dtype=dtype)(h)
    h = layers.Activation("relu", dtype=dtype)(h)
    h = layers.Conv2D(3, 3, padding="same", name="conv_b", dtype=dtype)(h)
    h = layers.Add(dtype=dtype)([x, h])
    h = layers.GlobalAveragePooling2D(dtype=dtype)(h)
    y = layers.Dense(4, name="head", dtype=dtype)(h)
    model = keras.Model(x, y, name="residual")
    _randomize_weights(model, seed)
    (inputs,) = _rng_inputs(seed, dtype, (batch, size, size, 3))
    return Example(
        "residual",
        model,
        inputs,
        "conv_a",
        "Conv-BN-ReLU-Conv + skip",
        {"batch": batch},
    )


def multi_input(dtype: str = "float32", seed: int = 0, *, batch: int = 3) -> Example:
    """Two inputs, ``(B, 6)`` and ``(B, 4, 3)``, joined before a Dense head.
    Target: ``"branch_a"``."""
    keras = _keras()
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
    _randomize_weights(model, seed)
    xa, xb = _rng_inputs(seed, dtype, (batch, 6), (batch, 4, 3))
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
    keras = _keras()

    class TwoLayer(keras.Model):
        def __init__(self):
            super().__init__(name="subclassed", dtype=dtype)
            self.inner = keras.layers.Dense(
                6, activation="sigmoid", name="inner", dtype=dtype
            )
            self.out = keras.layers.Dense(3, name="head", dtype=dtype)

        def call(self, x, training=False):
            return self.out(self.inner(x) * x[:, :1])

    model = TwoLayer()
    (x,) = _rng_inputs(seed, dtype, (batch, 5))
    model(x)
    _randomize_weights(model, seed)
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
    _randomize_weights(model, seed)
    (x,) = _rng_inputs(seed, dtype, (batch, 5))
    return Example(
        "tf_keras", model, x, "k2_hidden", "tf_keras Sequential", {"batch": batch}
    )


def shared_layer(dtype: str = "float32", seed: int = 0, *, batch: int = 3) -> Example:
    """One Dense layer applied at two call sites (its input then depends on
    its own kernel). Target: ``"shared"``."""
    keras = _keras()
    layers = keras.layers
    x = keras.Input((5,), dtype=dtype)
    shared = layers.Dense(5, activation="tanh", name="shared", dtype=dtype)
    h = shared(shared(x))
    y = layers.Dense(3, name="head", dtype=dtype)(h)
    model = keras.Model(x, y, name="shared_layer")
    _randomize_weights(model, seed)
    (inputs,) = _rng_inputs(seed, dtype, (batch, 5))
    return Example(
        "shared_layer",
        model,
        inputs,
        "shared",
        "a Dense layer used twice",
        {"batch": batch},
    )


class _Affine(tf.Module):
    """``tanh(x @ w + b) @ v``: a plain ``tf.Module`` reading tf.Variables."""

    def __init__(self, dtype: str, seed: int) -> None:
        super().__init__(name="affine")
        rng = np.random.default_rng(seed)
        self.w = tf.Variable(rng.normal(scale=0.5, size=(4, 6)), dtype=dtype, name="w")
        self.b = tf.Variable(rng.normal(scale=0.3, size=(6,)), dtype=dtype, name="b")
        self.v = tf.Variable(rng.normal(scale=0.5, size=(6, 3)), dtype=dtype, name="v")

    def __call__(self, x):
        return tf.tanh(x @ self.w + self.b) @ self.v


def tf_module(dtype: str = "float32", seed: int = 0, *, batch: int = 3) -> Example:
    """A ``tf.Module`` (no Keras). Targets: the variables ``[w, b]``."""
    module = _Affine(dtype, seed)
    (x,) = _rng_inputs(seed, dtype, (batch, 4))
    return Example(
        "tf_module", module, x, [module.w, module.b], "tf.Module", {"batch": batch}
    )


def frozen_resnet(
    dtype: str = "float32",
    seed: int = 0,
    *,
    batch: int = 2,
    size: int = 32,
    classes: int = 3,
) -> Example:
    """The users' second case: a frozen ResNet50 backbone (``weights=None``,
    no download) with a pooling + Dropout + Dense(classes, softmax) head.
    Target: ``"head"``."""
    keras = _keras()
    layers = keras.layers
    keras.utils.set_random_seed(seed)  # before building: same weights every time
    backbone = keras.applications.ResNet50(
        weights=None, include_top=False, input_shape=(size, size, 3)
    )
    backbone.trainable = False
    x = keras.Input((size, size, 3), dtype=dtype)
    h = backbone(x, training=False)
    h = layers.GlobalAveragePooling2D(dtype=dtype)(h)
    h = layers.Dropout(0.2, name="dropout", dtype=dtype)(h)
    y = layers.Dense(classes, activation="softmax", name="head", dtype=dtype)(h)
    model = keras.Model(x, y, name="frozen_resnet")
    (inputs,) = _rng_inputs(seed, dtype, (batch, size, size, 3))
    return Example(
        "frozen_resnet",
        model,
        inputs,
        "head",
        "frozen ResNet50 + Dense head",
        {"batch": batch, "size": size, "classes": classes},
    )


#: name -> builder(dtype="float32", seed=0, **sizes) -> Example
BUILDERS: dict[str, Callable[..., Example]] = {
    "mlp": mlp,
    "generator": generator,
    "cnn2d": cnn2d,
    "spectrogram": spectrogram,
    "residual": residual,
    "multi_input": multi_input,
    "subclassed": subclassed,
    "tf_keras": tf_keras_mlp,
    "shared_layer": shared_layer,
    "tf_module": tf_module,
    "frozen_resnet": frozen_resnet,
}


def build(name: str, dtype: str = "float32", seed: int = 0, **sizes: int) -> Example:
    """Build the example ``name`` (see :data:`BUILDERS`)."""
    if name not in BUILDERS:
        raise ValueError(
            f"examples.build(name={name!r}): unknown example. Choose one of "
            f"{', '.join(map(repr, BUILDERS))}."
        )
    return BUILDERS[name](dtype, seed, **sizes)
