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

from jacobkit.testing.example import Example, randomize_weights, rng_inputs
from jacobkit.testing.example_backbones import (
    bert_classifier,
    frozen_efficientnet,
    frozen_mobilenet,
    frozen_resnet,
)
from jacobkit.testing.example_kinds import (
    Affine,
    multi_input,
    shared_layer,
    subclassed,
    tf_keras_mlp,
    tf_module,
)
from jacobkit.testing.example_models import (
    cnn2d,
    dense_head,
    generator,
    mlp,
    residual,
    spectrogram,
)

__all__ = [
    "BUILDERS",
    "Affine",
    "Example",
    "bert_classifier",
    "build",
    "cnn2d",
    "dense_head",
    "frozen_efficientnet",
    "frozen_mobilenet",
    "frozen_resnet",
    "generator",
    "mlp",
    "multi_input",
    "randomize_weights",
    "residual",
    "rng_inputs",
    "shared_layer",
    "spectrogram",
    "subclassed",
    "tf_keras_mlp",
    "tf_module",
]


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
    "frozen_mobilenet": frozen_mobilenet,
    "frozen_efficientnet": frozen_efficientnet,
    "bert_classifier": bert_classifier,
    "dense_head": dense_head,
}


def build(name: str, dtype: str = "float32", seed: int = 0, **sizes: int) -> Example:
    """Build the example ``name`` (see :data:`BUILDERS`)."""
    if name not in BUILDERS:
        raise ValueError(
            f"examples.build(name={name!r}): unknown example. Choose one of "
            f"{', '.join(map(repr, BUILDERS))}."
        )
    return BUILDERS[name](dtype, seed, **sizes)
