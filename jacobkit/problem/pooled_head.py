"""The pooled linear head: a layer's output ``A`` reaches the model's one
output only through ``GlobalAveragePooling2D -> (Dropout) -> Dense(C)``,
with the ``Dense`` linear or followed by a softmax.

NOTE (why the shortcut is exact). With ``A`` of shape ``(B, h, w, K)`` and
``n = h * w``, the head computes ``z = mean_hw(A) @ W + c`` (``Dropout`` and
its kin are the identity at inference). Each ``z[b, k]`` is linear in
``A[b]``: ``d z[b, k] / d A[b, i, j, :] = W[:, k] / n`` at every position.
With a softmax on top (the ``Dense``'s activation, or a ``Softmax`` or
``Activation("softmax")`` layer after it), ``p = softmax(z)`` and the chain
rule gives ``d p[b, k] / d A[b, i, j, :] = p[b, k] (W[:, k] - W p[b]) / n``.
Both are closed forms in ``W``, ``A`` and (for the softmax) ``p``: every
class's gradient at once, with no backward pass. Anything else on the way
(a normalization, a ``Flatten``, a second ``Dense``, a sigmoid, a
``GlobalMaxPooling2D``) is refused: the gradient is then taken generically.

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
    """``Y = head(mean_hw(A))`` (``softmax``: ``Y = softmax(head(...))``).

    Attributes:
        head: the stock ``Dense(C)`` layer; its kernel is ``(K, C)``.
        softmax: whether a softmax over the ``C`` classes follows it.
    """

    head: Any
    softmax: bool

    def kernel(self, dtype: tf.DType) -> tf.Tensor:
        """The head's kernel, ``(K, C)``, read now (never kept)."""
        return tf.cast(tf.convert_to_tensor(self.head.kernel), dtype)

    def bias(self, dtype: tf.DType) -> tf.Tensor | None:
        """The head's bias, ``(C,)``, or ``None`` without one."""
        bias = getattr(self.head, "bias", None)
        return None if bias is None else tf.cast(tf.convert_to_tensor(bias), dtype)

    def describe(self) -> str:
        tail = " and a softmax" if self.softmax else ""
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
    softmax = False
    if _is_softmax_layer(keras, current):
        softmax = True
        current, node = _before(current, node)
    if functional.linear_kind(current) != "matmul":
        raise NotApplicable(
            f"pooled head: {current.name!r} ({type(current).__name__}) before the "
            "output is not a stock Dense layer"
        )
    head = current
    activation = compat.stock_activation(keras, compat.activation(head))
    if activation == "softmax" and not softmax:
        softmax = True
    elif activation != "linear":
        raise NotApplicable(
            f"pooled head: {head.name!r} has activation "
            f"{compat.activation_name(compat.activation(head))!r}, not linear or "
            "softmax (after a linear head)"
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
    return PooledHead(head, softmax)


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


def _is_softmax_layer(keras: Any, layer: Any) -> bool:
    if type(layer) is keras.layers.Softmax:
        return layer.axis in (-1, [-1], (-1,))
    if type(layer) is keras.layers.Activation:
        return compat.stock_activation(keras, layer.activation) == "softmax"
    return False


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
