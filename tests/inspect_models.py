"""Small Keras models both inspections' tests read (the eager passes',
:mod:`tests.test_eager_inspect`, and the structure's,
:mod:`tests.test_structural_inspect`): the same models, so that each
inspection is compared on what the other is."""

from __future__ import annotations

import keras


def convnet() -> keras.Model:
    inputs = keras.Input((12, 12, 3))
    h = keras.layers.Conv2D(8, 3, activation="relu", name="conv1")(inputs)
    h = keras.layers.Conv2D(16, 3, strides=2, activation="relu", name="conv2")(h)
    h = keras.layers.GlobalAveragePooling2D()(h)
    return keras.Model(inputs, keras.layers.Dense(5, name="head")(h))


def mlp() -> keras.Model:
    return keras.Sequential(
        [
            keras.Input((7,)),
            keras.layers.Dense(16, activation="tanh", name="hidden"),
            keras.layers.LayerNormalization(),
            keras.layers.Dropout(0.5),
            keras.layers.Dense(5, name="head"),
        ]
    )
