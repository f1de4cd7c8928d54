"""What jacobkit knows about layer types: per-layer closed forms and facts,
one registry of layer kinds (:mod:`.registry`, filled from :mod:`.stock`);
:func:`register` adds a user's layer class.

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
from jacobkit.layers import normalization, stock
from jacobkit.layers.base import LayerRule, MaterializedNorms, Tapped, UnfoldedMatmul
from jacobkit.layers.registry import LayerKind, LayerRegistry

__all__ = [
    "LayerKind",
    "LayerRule",
    "MaterializedNorms",
    "Tapped",
    "UnfoldedMatmul",
    "divides_by_rms",
    "elementwise_activation",
    "kind_of",
    "pfor_cannot_vectorize",
    "register",
    "rule_for",
    "stock_kind",
    "with_rules",
]

#: the one registry of layer kinds
REGISTRY = LayerRegistry(stock.KINDS)


def register(
    layer_class: type | str, rule: type[LayerRule] | None = None, **facts: Any
) -> LayerKind:
    """Teach jacobkit a layer class: its closed forms for the ``batch``
    strategy (and so for ``reduce="norm"`` and ``auto``'s per-example rows),
    and optionally its facts (``linear=``, ``elementwise=``,
    ``inference_identity=``, ``convolutions=``, ``recurrent=``, ``lora=``: see
    :class:`LayerKind`).

    Args:
        layer_class: the layer class (or ``"package.module:ClassName"``, known
            once that module is imported). Its subclasses get its rule too
            unless they are registered themselves.
        rule: a :class:`LayerRule` subclass: the layer's output before its
            activation as a function of its input and weights, and the
            per-row gradients from the cotangents there (see the docs' "Adding
            a layer"). Before ``batch`` first runs on a layer, it checks the
            rule's output against the layer's own at every call, and that
            examples do not mix, so a subclass whose ``call`` does more is
            refused, not answered wrongly.

    Returns:
        The registered :class:`LayerKind`.

    Raises:
        ValueError: the class is registered already, or a fact is unknown.
        TypeError: ``rule`` is not a ``LayerRule`` subclass.

    Example (a layer ``z = x * w`` over the last axis, its rule the
    per-row ``sum_p x[b, p] * G[b, p]``; ``MaterializedNorms`` gives its
    norms from those gradients)::

        class Scale(keras.layers.Layer):
            def build(self, shape):
                self.w = self.add_weight(shape=(shape[-1],), initializer="ones")

            def call(self, x):
                return x * self.w

        class ScaleRule(layers.MaterializedNorms):
            kind = "scale"
            kernel_attrs = ("w",)
            bias_attrs = ()

            def pre_activation(self, x, kernel, bias):
                return x * kernel

            def activation(self, z):
                return z

            def gradients(self, x, dz, kernel_shape, *, summed):
                n = kernel_shape[-1]
                x = tf.reshape(x, (x.shape[0], -1, n))
                g = tf.reshape(dz, (dz.shape[0], dz.shape[1], -1, n))
                per = tf.einsum("bpc,bkpc->bkc", x, g)  # (B, K, n)
                w = tf.reduce_sum(per, 0) if summed else tf.reshape(per, (-1, n))
                return w, tf.zeros((w.shape[0], 0), w.dtype)

        jacobkit.layers.register(Scale, ScaleRule)
    """
    return REGISTRY.add(LayerKind(layer_class, rule, **facts))


def divides_by_rms(layer: Any) -> bool:
    """Whether ``layer`` is an RMS normalization, ``x / sqrt(mean(x^2) +
    eps)`` (times a scale): of a registered RMS kind (Keras's, keras_hub
    Gemma's, Llama's and their copies), or a ``LayerNormalization`` with
    ``rms_scaling=True``. Its gradient at ``x = 0`` is ``1 / sqrt(eps)``:
    integrated gradients avoid a zero baseline into it
    (:mod:`jacobkit.explain.token_paths`)."""
    kind = REGISTRY.of(layer)
    rule = None if kind is None else kind.rule
    if rule is not None and issubclass(rule, normalization.RMSBase):
        return True
    return bool(getattr(layer, "rms_scaling", False))


def kind_of(layer: Any) -> LayerKind | None:
    """The :class:`LayerKind` of ``layer``'s class or of its nearest
    registered base class, or ``None``."""
    return REGISTRY.of(layer)


def stock_kind(layer: Any) -> LayerKind | None:
    """The :class:`LayerKind` registered for exactly ``layer``'s class (a
    subclass may change ``call``: its facts are not certain), or ``None``."""
    return REGISTRY.stock(layer)


def rule_for(layer: Any) -> LayerRule | None:
    """The :class:`LayerRule` of ``layer`` (its kind's ``lora`` rule where
    it has LoRA enabled), or ``None`` where none is registered for its
    class."""
    kind = REGISTRY.of(layer)
    if kind is None:
        return None
    if kind.lora is not None and compat.lora_enabled(layer):
        return kind.lora(layer)
    return None if kind.rule is None else kind.rule(layer)


def pfor_cannot_vectorize(layer: Any) -> bool:
    """Whether TensorFlow's vectorization (pfor) has no rule for ``layer``'s
    gradient (depthwise, separable and 3-D convolutions, subclasses included)."""
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
    lora = REGISTRY.with_lora_rules()
    also = f"; with LoRA enabled: {lora}" if lora else ""
    return f"{REGISTRY.with_rules()} (Keras 3 or tf_keras{also})"
