"""What jacobkit knows about layer types: per-layer closed forms and facts,
one registry of layer kinds (:mod:`.registry`, filled from :mod:`.stock`).

>>> import keras
>>> from jacobkit import layers
>>> layers.rule_for(keras.layers.Dense(3)).kind
'dense'
>>> layers.rule_for(keras.layers.LSTM(3)) is None
True
>>> layers.pfor_cannot_vectorize(keras.layers.DepthwiseConv2D(3))
True

A layer gets the kind of its class or of its nearest registered base class
(Keras 3 and ``tf_keras`` classes alike, subclasses included); layers of no
registered class have none, and the ``batch`` strategy refuses them. What
the rest of jacobkit asks about a layer type, it asks here:

- :func:`rule_for`: the closed forms of the ``batch`` strategy;
- :func:`pfor_cannot_vectorize`: the depthwise check (``chunked`` refuses
  such layers, ``batch`` lets pfor fall back to a loop for their ops);
- :func:`stock_kind`, :func:`elementwise_activation`: the structure finder's
  facts (linear, elementwise, identity at inference);
- :func:`with_rules`: what ``batch``'s refusal lists;
- :mod:`.convolutions`: the convolution kinds (the traced pass, the scratch
  probe).
"""

from __future__ import annotations

from types import ModuleType
from typing import Any

from jacobkit.keras import compat
from jacobkit.layers import stock
from jacobkit.layers.base import LayerRule
from jacobkit.layers.registry import LayerKind, LayerRegistry

# REGISTRY itself is not public yet: a public ``register(layer_class, rule)``
# will add a kind with one call (``REGISTRY.add(LayerKind(cls, rule))``)
__all__ = [
    "LayerKind",
    "LayerRule",
    "elementwise_activation",
    "kind_of",
    "pfor_cannot_vectorize",
    "rule_for",
    "stock_kind",
    "with_rules",
]

#: the one registry of layer kinds
REGISTRY = LayerRegistry(stock.KINDS)


def kind_of(layer: Any) -> LayerKind | None:
    """The :class:`LayerKind` of ``layer``'s class or of its nearest
    registered base class, or ``None``."""
    return REGISTRY.of(layer)


def stock_kind(layer: Any) -> LayerKind | None:
    """The :class:`LayerKind` registered for exactly ``layer``'s class (a
    subclass may change ``call``: its facts are not certain), or ``None``."""
    return REGISTRY.stock(layer)


def rule_for(layer: Any) -> LayerRule | None:
    """The :class:`LayerRule` of ``layer``, or ``None`` where none is
    registered for its class."""
    kind = REGISTRY.of(layer)
    return None if kind is None or kind.rule is None else kind.rule(layer)


def pfor_cannot_vectorize(layer: Any) -> bool:
    """Whether TensorFlow's vectorization (pfor) has no rule for ``layer``'s
    gradient (depthwise and separable convolutions, subclasses included)."""
    kind = REGISTRY.of(layer)
    return kind is not None and not kind.pfor_vectorizes


def runs_a_loop(layer: Any) -> bool:
    """Whether ``layer`` loops over time steps (a recurrent layer: ``RNN``
    and its subclasses such as ``LSTM``, ``Bidirectional``)."""
    kind = REGISTRY.of(layer)
    return kind is not None and kind.recurrent


def elementwise_activation(keras: ModuleType, function: Any) -> bool:
    """Whether ``function`` is a stock activation of the Keras flavour
    ``keras`` that acts on each element alone."""
    return compat.stock_activation(keras, function) in stock.ELEMENTWISE_ACTIVATIONS


def with_rules() -> str:
    """The layers with a closed form, in words (``batch``'s refusal)."""
    return f"{REGISTRY.with_rules()} (Keras 3 or tf_keras)"
