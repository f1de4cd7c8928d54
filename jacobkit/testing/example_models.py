"""The example models shaped like the users' cases: Conv1D generators, Dense
heads, MLPs, Conv2D and spectrogram models, a residual block."""

from __future__ import annotations

from jacobkit.testing.example import (
    Example,
    keras_module,
    randomize_weights,
    rng_inputs,
)

__all__ = ["cnn2d", "dense_head", "generator", "mlp", "residual", "spectrogram"]


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
    keras = keras_module()
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
    randomize_weights(model, seed)
    (inputs,) = rng_inputs(seed, dtype, (batch, sequence, channels))
    return Example(
        "generator",
        model,
        inputs,
        "conv1",
        "Conv1D x3 → Dense",
        {"batch": batch, "sequence": sequence, "features": features},
    )


def dense_head(
    dtype: str = "float32",
    seed: int = 0,
    *,
    batch: int = 3,
    sequence: int = 8,
    channels: int = 4,
    filters: int = 6,
    features: int = 5,
) -> Example:
    """A Conv1D → Dense(features, tanh) → Activation(sigmoid) tagger on
    ``(batch, sequence, channels)``. Target: the Dense head (``"head"``),
    whose output channel ``f`` reaches only output feature ``f`` (the rows'
    Jacobians have disjoint support: row colouring applies)."""
    keras = keras_module()
    layers = keras.layers
    x = keras.Input((sequence, channels), dtype=dtype)
    h = layers.Conv1D(
        filters, 3, padding="same", activation="relu", name="conv1", dtype=dtype
    )(x)
    h = layers.Dense(features, activation="tanh", name="head", dtype=dtype)(h)
    y = layers.Activation("sigmoid", name="squash", dtype=dtype)(h)
    model = keras.Model(x, y, name="dense_head")
    randomize_weights(model, seed)
    (inputs,) = rng_inputs(seed, dtype, (batch, sequence, channels))
    return Example(
        "dense_head",
        model,
        inputs,
        "head",
        "Conv1D → Dense head (target) → sigmoid",
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
    keras = keras_module()
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
    randomize_weights(model, seed)
    (x,) = rng_inputs(seed, dtype, (batch, inputs))
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
    keras = keras_module()
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
    randomize_weights(model, seed)
    (x,) = rng_inputs(seed, dtype, (batch, height, width, 1))
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
    keras = keras_module()
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
    randomize_weights(model, seed)
    (x,) = rng_inputs(seed, dtype, (batch, frames, bins, 1))
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
    keras = keras_module()
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
    randomize_weights(model, seed)
    (inputs,) = rng_inputs(seed, dtype, (batch, size, size, 3))
    return Example(
        "residual",
        model,
        inputs,
        "conv_a",
        "Conv-BN-ReLU-Conv + skip",
        {"batch": batch},
    )
