"""The pooled linear head: a layer's output ``A`` reaches the model's one
output only through ``GlobalAveragePooling2D -> (Dropout) -> Dense(C)``,
with the ``Dense`` linear or followed by a softmax or one stock elementwise
activation (a sigmoid).

NOTE (why the shortcut is exact). With ``A`` of shape ``(B, h, w, K)`` and
``n = h * w``, the head computes ``z = mean_hw(A) @ W + c`` (``Dropout`` and
its kin are the identity at inference). Each ``z[b, k]`` is linear in
``A[b]``: ``d z[b, k] / d A[b, i, j, :] = W[:, k] / n`` at every position.
With a softmax on top (the ``Dense``'s activation, or a ``Softmax`` or
``Activation("softmax")`` layer after it), ``p = softmax(z)`` and the chain
rule gives ``d p[b, k] / d A[b, i, j, :] = p[b, k] (W[:, k] - W p[b]) / n``.
With an elementwise ``f`` (a sigmoid) instead, ``d f(z[b, k]) / d A[b, i,
j, :] = f'(z[b, k]) W[:, k] / n``. All are closed forms in ``W``, ``A`` and
``p`` or ``f'(z)``: every class's gradient at once, with no backward pass
through the head. Anything else on the way (a normalization, a
``Flatten``, a second ``Dense``, a ``GlobalMaxPooling2D``) is refused: the
gradient is then taken generically.

Found only where it is certain, as :mod:`.linear_head`: a Keras 3
functional or ``Sequential`` model with one output, each layer on the path
an exact stock class called as ``layer(x)``, the layer itself (or the nested
functional model that ends in it) feeding the pooling.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import tensorflow as tf

from jacobkit import layers
from jacobkit.keras import compat
from jacobkit.keras import graph as keras_graph
from jacobkit.problem import functional
from jacobkit.problem.functional import NotApplicable

__all__ = ["NotApplicable", "PooledHead", "find"]


@dataclass(frozen=True)
class PooledHead:
    """``Y = after(head(mean_hw(A)))``.

    Attributes:
        head: the stock ``Dense(C)`` layer; its kernel is ``(K, C)``.
        softmax: whether a softmax over the ``C`` classes follows it.
        elementwise: the stock elementwise activation that follows it (a
            sigmoid: the Dense's own, or an ``Activation`` layer's), or
            ``None``.
    """

    head: Any
    softmax: bool
    elementwise: Any = None

    def kernel(self, dtype: tf.DType) -> tf.Tensor:
        """The head's kernel, ``(K, C)``, read now (never kept)."""
        return tf.cast(tf.convert_to_tensor(self.head.kernel), dtype)

    def bias(self, dtype: tf.DType) -> tf.Tensor | None:
        """The head's bias, ``(C,)``, or ``None`` without one."""
        bias = getattr(self.head, "bias", None)
        return None if bias is None else tf.cast(tf.convert_to_tensor(bias), dtype)

    def describe(self) -> str:
        tail = " and a softmax" if self.softmax else ""
        if self.elementwise is not None:
            tail = f" and {compat.activation_name(self.elementwise)}"
        return f"average pooling into linear head {self.head.name!r}{tail}"


def find(model: Any, layer: Any, training: bool) -> PooledHead:
    """The pooled linear head through which ``layer``'s output reaches
    ``model``'s one output.

    Raises:
        NotApplicable: there is none, or not certainly; the message says why.
    """
    if training:
        raise NotApplicable(
            "pooled head: training=True (dropout is not the identity, and the "
            "activations' draw is not the gradient's)"
        )
    keras = _keras(model)
    current, node = keras_graph.producer(model.outputs[0])
    after = _after_layer(keras, current)
    if after is not None:
        current, node = _before(current, node)
    if functional.linear_kind(current) != "matmul":
        raise NotApplicable(
            f"pooled head: {current.name!r} ({type(current).__name__}) before the "
            "output is not a stock Dense layer"
        )
    head = current
    own = compat.activation(head)
    name = compat.stock_activation(keras, own)
    if name != "linear":
        if after is None and name == "softmax":
            after = "softmax"
        elif after is None and layers.elementwise_activation(keras, own):
            after = own
        else:
            raise NotApplicable(
                f"pooled head: {head.name!r} has activation "
                f"{compat.activation_name(own)!r}, not linear, softmax or a stock "
                "elementwise one (alone after a linear head)"
            )
    if functional.lora_or_quantized(head):
        raise NotApplicable(f"pooled head: {head.name!r} is LoRA/quantized")
    current, node = _before(current, node)
    while _identity_at_inference(current):
        current, node = _before(current, node)
    if type(current) is not keras.layers.GlobalAveragePooling2D:
        raise NotApplicable(
            f"pooled head: {current.name!r} ({type(current).__name__}) before "
            f"{head.name!r} is not a GlobalAveragePooling2D"
        )
    if compat.data_format(current) != "channels_last" or current.keepdims:
        raise NotApplicable(
            f"pooled head: {current.name!r} is not channels_last without keepdims"
        )
    if node.arguments.kwargs.get("mask") is not None:
        raise NotApplicable(f"pooled head: {current.name!r} is called with a mask")
    _ends_in(keras, keras_graph.single_input(current, node), layer)
    if after == "softmax":
        return PooledHead(head, softmax=True)
    return PooledHead(head, softmax=False, elementwise=after)


def _keras(model: Any) -> Any:
    import keras

    if not isinstance(model, keras.Model):
        raise NotApplicable(f"pooled head: {type(model).__name__} is not Keras 3")
    try:
        outputs = model.outputs
    except AttributeError as err:
        raise NotApplicable("pooled head: a subclassed model has no graph") from err
    if not outputs or len(outputs) != 1:
        raise NotApplicable("pooled head: the model has not exactly one output")
    return keras


def _before(layer: Any, node: Any) -> tuple[Any, Any]:
    """The producer of ``layer``'s one input at ``node``."""
    return keras_graph.producer(keras_graph.single_input(layer, node))


def _after_layer(keras: Any, layer: Any) -> Any:
    """What the output layer applies after the head, where it is a stock
    ``Softmax`` (last axis) or ``Activation`` layer: ``"softmax"``, an
    elementwise activation, or ``None`` (another layer: maybe the head)."""
    if type(layer) is keras.layers.Softmax and layer.axis in (-1, [-1], (-1,)):
        return "softmax"
    if type(layer) is not keras.layers.Activation:
        return None
    name = compat.stock_activation(keras, layer.activation)
    if name == "softmax":
        return "softmax"
    if name != "linear" and layers.elementwise_activation(keras, layer.activation):
        return layer.activation
    return None


def _identity_at_inference(layer: Any) -> bool:
    kind = layers.stock_kind(layer)
    return kind is not None and kind.inference_identity


def _ends_in(keras: Any, tensor: Any, layer: Any) -> None:
    """``tensor`` is ``layer``'s output, or the output of a nested
    functional model that ends in it (recursively)."""
    current, _ = keras_graph.producer(tensor)
    while current is not layer:
        try:
            outputs = current.outputs if isinstance(current, keras.Model) else None
        except AttributeError:  # a subclassed model: no graph
            outputs = None
        if not outputs or len(outputs) != 1:
            raise NotApplicable(
                f"pooled head: the pooling's input comes from {current.name!r}, "
                f"not from {layer.name!r}"
            )
        current, _ = keras_graph.producer(outputs[0])
