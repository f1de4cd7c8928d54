"""The strategy list and the problem list, each defined once.

The conformance tests take their product. A strategy registered in
``jacobkit.strategies.REGISTRY`` is picked up here with no other change.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import tensorflow as tf

import jacobkit as jk
from jacobkit import examples, testing


@dataclass(frozen=True)
class StrategyCase:
    """A strategy configuration; ``make(R)`` builds it for a problem with R rows."""

    id: str
    make: Callable[[int], jk.strategies.Strategy]


def _chunked(label: str, size: Callable[[int], int]) -> StrategyCase:
    return StrategyCase(
        f"chunked({label})", lambda rows: jk.strategies.Chunked(size(rows))
    )


STRATEGIES = [
    StrategyCase(name, lambda rows, cls=cls: cls())
    for name, cls in jk.strategies.REGISTRY.items()
] + [
    _chunked("1", lambda r: 1),
    _chunked("2", lambda r: 2),
    _chunked("3", lambda r: 3),
    _chunked("7", lambda r: 7),
    _chunked("R", lambda r: r),
    _chunked("R+1000", lambda r: r + 1000),
    # one row in flight: what auto runs under a tight budget
    StrategyCase("while(parallel=1)", lambda rows: jk.strategies.While(1)),
]

#: every test problem (the ResNet one is benchmark-sized; it is tested alone)
PROBLEMS = [name for name in examples.BUILDERS if name != "frozen_resnet"]


def _square_over_batch(y: tf.Tensor) -> tf.Tensor:
    """A callable ``outputs=``: rows are ``sum_b Y[b, ...]**2``."""
    return tf.reduce_sum(y * y, axis=0)


OUTPUTS = {
    "features": "features",
    "per_example": "per_example",
    "full": "full",
    "callable": _square_over_batch,
}

#: (problem, reason) pairs where the batch strategy must refuse, with the
#: start of its message
BATCH_REFUSES = {
    "shared_layer": "runs 2 times per forward pass",
    "tf_module": "supports Dense, Conv1D and Conv2D",
}


#: (problem, outputs) pairs where the structured strategy applies (with the
#: structure it finds); on every other pair it must refuse with
#: STRUCTURED_REFUSES. The residual block ends in Dense(4) on 3 pooled
#: channels (a linear head); dense_head's target is its head, followed only
#: by an elementwise sigmoid (separable channels).
STRUCTURED_APPLIES = {
    **{
        ("residual", mode): "linear head"
        for mode in ("features", "per_example", "full")
    },
    **{
        ("dense_head", mode): "separable channels"
        for mode in ("features", "per_example")
    },
}
STRUCTURED_REFUSES = "no exact shortcut applies"


def call_kwargs(model) -> dict:
    return {} if isinstance(model, examples._Affine) else {"training": False}


def target_variables(example: examples.Example) -> list:
    """The target variables of an example, found the plain Keras way."""
    if isinstance(example.layer, list):
        return example.layer
    layer = example.model.get_layer(example.layer)
    return [layer.kernel, layer.bias]


@functools.cache
def example(name: str, dtype: str = "float32") -> examples.Example:
    return examples.build(name, dtype)


@functools.cache
def reference(name: str, outputs: str, features: tuple | None = None) -> list:
    """float64 reference for a problem and an ``outputs`` mode (cached)."""
    ex = example(name, "float64")
    return testing.reference_jacobian(
        ex.model,
        ex.inputs,
        target_variables(ex),
        outputs=OUTPUTS[outputs],
        features=features,
        call_kwargs=call_kwargs(ex.model),
    )
