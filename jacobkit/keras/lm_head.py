"""A causal LM split at its output head: ``logits = head(body(x))``, where
``body`` is a functional backbone (``x -> (B, T, D)`` hidden states) and
``head`` a per-position linear layer (keras_hub's tied
``ReversibleEmbedding`` called in reverse, or a ``Dense``/``EinsumDense``).

Token attribution differentiates each target position's log-probability at
the token embeddings. Through the head, a row's backward pass multiplies a
``(T, vocabulary)`` cotangent that is zero but for one position by the
``(vocabulary, D)`` table, for every row. Split at the head, each row's
cotangent at the hidden states is known in closed form from one forward
pass (``d log p / d h = Wᵀ (onehot - softmax)`` at its position, zero
elsewhere), and the rows are ``<g, h>``: the same gradients, without the
head's backward pass, the log-softmax over the vocabulary, or the
``(T, vocabulary)`` cotangent per row (:mod:`jacobkit.explain.tokens`).

The split is read from the model's functional graph: its one output is the
head's call on the body's one output, and the body's call takes the model's
own inputs. Nothing is set on the model or its layers.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import tensorflow as tf

#: class names of the per-position linear layers accepted as a head
_HEADS = ("ReversibleEmbedding", "Dense", "EinsumDense")


@dataclass(frozen=True)
class LinearHead:
    """A causal LM as ``head(body(x), **kwargs)``.

    Attributes:
        body: the functional model that makes the hidden states ``(B, T, D)``.
        head: the per-position linear layer that makes the logits.
        kwargs: the head's call arguments other than its input, as pairs
            (``(("reverse", True),)`` for a tied embedding).
    """

    body: Any
    head: Any
    kwargs: tuple[tuple[str, Any], ...]

    def logits(self, hidden: tf.Tensor) -> tf.Tensor:
        """The head's logits of hidden states ``(..., D)`` (the layer called,
        read only, as the model calls it)."""
        return self.head(hidden, **dict(self.kwargs))

    def cotangents(self, hidden: tf.Tensor, targets: tf.Tensor) -> tf.Tensor:
        """``d log softmax(head(h))[target] / d h`` per position: ``hidden``
        ``(B, K, D)`` and ``targets`` ``(B, K)`` token ids -> ``(B, K, D)``
        float32 (positions are independent through a per-position head, so
        one gradient of the sum gives every position its own)."""
        hidden = tf.convert_to_tensor(hidden)
        with tf.GradientTape() as tape:
            tape.watch(hidden)
            logits = tf.cast(self.logits(hidden), tf.float32)
            log_p = tf.nn.log_softmax(logits, axis=-1)
            chosen = tf.gather(log_p, tf.cast(targets, tf.int32), batch_dims=2)
            total = tf.reduce_sum(chosen)
        return tf.cast(tape.gradient(total, hidden), tf.float32)


def linear_head(model: Any) -> LinearHead | None:
    """``model`` split at its head (see the module docstring), or ``None``
    where its graph is not ``head(body(inputs))`` as described."""
    outputs = getattr(model, "outputs", None)
    if not isinstance(outputs, list) or len(outputs) != 1:
        return None
    history: Any = getattr(outputs[0], "_keras_history", None)
    head = getattr(history, "operation", None)
    if head is None or not any(cls.__name__ in _HEADS for cls in type(head).__mro__):
        return None
    node = head._inbound_nodes[history.node_index]
    tensors = node.arguments.keras_tensors
    if len(tensors) != 1:
        return None
    made: Any = getattr(tensors[0], "_keras_history", None)
    body: Any = getattr(made, "operation", None)
    body_outputs = getattr(body, "outputs", None)
    if not isinstance(body_outputs, list) or len(body_outputs) != 1:
        return None
    body_node = body._inbound_nodes[made.node_index]
    if not _same_inputs(body_node.arguments.keras_tensors, model.inputs):
        return None
    kwargs = tuple(sorted(node.arguments.kwargs.items()))
    if any(not isinstance(v, (bool, int, float, str, type(None))) for _, v in kwargs):
        return None
    return LinearHead(body, head, kwargs)


def _same_inputs(given: Any, inputs: Any) -> bool:
    """Whether the body is called on exactly the model's own inputs."""
    ids = {id(t) for t in inputs}
    return len(given) == len(inputs) and all(id(t) in ids for t in given)
