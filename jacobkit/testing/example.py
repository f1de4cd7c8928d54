"""What an example problem is, and the helpers every builder shares: seeded
inputs and seeded weights, the same in float32 and float64."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np


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


def keras_module() -> Any:
    """The ``keras`` module, imported when a builder first needs it."""
    import keras

    return keras


def rng_inputs(seed: int, dtype: str, *shapes: tuple[int, ...]) -> list[np.ndarray]:
    """One seeded normal array per shape, in ``dtype``."""
    rng = np.random.default_rng(seed + 1000)
    return [rng.normal(size=shape).astype(dtype) for shape in shapes]


def randomize_weights(model: Any, seed: int) -> None:
    """Give every weight (batch-norm statistics included) a seeded value, so
    that float32 and float64 builds share weights and no layer is trivial."""
    from jacobkit.keras import compat

    rng = np.random.default_rng(seed)
    values = []
    for w in model.get_weights():
        fan_in = int(np.prod(w.shape[:-1])) if w.ndim > 1 else 1
        scale = 1.0 / np.sqrt(max(fan_in, 1)) if w.ndim > 1 else 0.3
        value = rng.normal(scale=scale, size=w.shape)
        values.append(value)
    # batch-norm variances must be positive
    names = [compat.variable_path(w) for w in model.weights]
    values = [
        np.abs(v) + 0.5 if "variance" in n else v
        for v, n in zip(values, names, strict=True)
    ]
    model.set_weights(
        [v.astype(w.dtype) for v, w in zip(values, model.get_weights(), strict=True)]
    )
