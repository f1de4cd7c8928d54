"""Per-layer closed forms, one rule per layer type, registered by class.

>>> import keras
>>> from jacobkit import layers
>>> layers.rule_for(keras.layers.Dense(3)).kind
'dense'
>>> layers.rule_for(keras.layers.LSTM(3)) is None
True

A layer gets the rule of the first registered class it is an instance of
(Keras 3 and ``tf_keras`` classes alike, subclasses included); layers of no
registered class have none, and the ``batch`` strategy refuses them.
"""

from __future__ import annotations

import functools
from typing import Any

from jacobkit.keras import compat
from jacobkit.layers.attention import MultiHeadAttentionRule
from jacobkit.layers.base import LayerRule
from jacobkit.layers.conv import Conv1DRule, Conv2DRule
from jacobkit.layers.dense import DenseRule
from jacobkit.layers.depthwise import DepthwiseConv2DRule
from jacobkit.layers.einsum import EinsumDenseRule
from jacobkit.layers.embedding import EmbeddingRule
from jacobkit.layers.normalization import (
    BatchNormalizationRule,
    LayerNormalizationRule,
)
from jacobkit.layers.separable import SeparableConv2DRule

__all__ = ["LayerRule", "rule_for"]

#: the registry: Keras layer class name -> its rule
_RULES: dict[str, type[LayerRule]] = {
    # subclasses first: tf_keras's DepthwiseConv2D is a Conv2D
    "DepthwiseConv2D": DepthwiseConv2DRule,
    "SeparableConv2D": SeparableConv2DRule,
    "Dense": DenseRule,
    "Conv1D": Conv1DRule,
    "Conv2D": Conv2DRule,
    "EinsumDense": EinsumDenseRule,
    "MultiHeadAttention": MultiHeadAttentionRule,
    "Embedding": EmbeddingRule,
    "LayerNormalization": LayerNormalizationRule,
    "BatchNormalization": BatchNormalizationRule,
}


@functools.cache
def _registry_of(modules: tuple[Any, ...]) -> tuple[tuple[type, type[LayerRule]], ...]:
    """``(layer class, rule)`` for each registered class of each Keras flavour
    in ``modules``."""
    return tuple(
        (cls, rule)
        for module in modules
        for name, rule in _RULES.items()
        if (cls := compat.layer_class(module, name)) is not None
    )


def _registry() -> tuple[tuple[type, type[LayerRule]], ...]:
    """``(layer class, rule)`` for each registered class of each Keras flavour
    imported now (``tf_keras`` counts once it is imported)."""
    return _registry_of(compat.keras_modules())


def rule_for(layer: Any) -> LayerRule | None:
    """The :class:`LayerRule` of ``layer``, or ``None`` where none is
    registered for its class."""
    for cls, rule in _registry():
        if isinstance(layer, cls):
            return rule(layer)
    return None
