"""``outputs=jk.Loss(loss_fn)``: one row per example, its loss.

With it, the inputs are ``(x, y)`` or ``(x, y, sample_weight)`` (or a
dataset of such batches): the model gets ``x``, and row ``b`` is
``loss_fn(y, model(x))[b]`` (times ``sample_weight[b]``). Its Jacobian is
each example's loss gradient, shape ``(B, *v.shape)``: what differential
privacy clips and training-data attribution compares.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import tensorflow as tf


@dataclass(frozen=True)
class Loss:
    """Per-example losses as rows (``outputs=jk.Loss(loss_fn)``).

    Args:
        fn: ``fn(y_true, y_pred)`` returning one loss per example, shape
            ``(B,)``: a Keras loss made with ``reduction=None``
            (``keras.losses.SparseCategoricalCrossentropy(from_logits=True,
            reduction=None)``) or any function. A loss with more axes (one per
            token of a sequence) is summed over them: one row per example.
        each: keep every element of such a loss as its own row: rows
            ``(B, K)``, ``K`` the product of the loss's axes after the batch
            (each token's loss of a sequence model, each its own gradient).
            A ``sample_weight`` of the loss's shape weighs each element (0:
            a padded token's row is exactly zero).

    Example:
        >>> import keras, numpy as np, jacobkit as jk
        >>> model = keras.Sequential([keras.Input((4,)),
        ...                           keras.layers.Dense(3, name="head")])
        >>> loss = keras.losses.SparseCategoricalCrossentropy(
        ...     from_logits=True, reduction=None)
        >>> x, y = np.ones((5, 4), "float32"), np.arange(5) % 3
        >>> res = jk.jacobian(model, (x, y), "head", outputs=jk.Loss(loss))
        >>> tuple(res.kernel.shape)
        (5, 4, 3)
    """

    fn: Callable[[Any, Any], Any]
    each: bool = False

    def __post_init__(self) -> None:
        if not callable(self.fn):
            raise TypeError(
                f"jk.Loss({self.fn!r}): expected a loss function fn(y_true, "
                "y_pred), such as keras.losses.SparseCategoricalCrossentropy("
                "reduction=None)."
            )

    def rows(self, y_pred: tf.Tensor, labels: tuple[Any, ...]) -> tf.Tensor:
        """The per-example losses ``(B,)`` (``(B, K)`` with :attr:`each`) of
        ``y_pred`` against ``labels`` (``(y,)`` or ``(y, sample_weight)``)."""
        y_true = labels[0]
        losses = tf.convert_to_tensor(self.fn(y_true, y_pred))
        if losses.dtype != y_pred.dtype:
            losses = tf.cast(losses, y_pred.dtype)
        if losses.shape.rank == 0:
            raise ValueError(
                f"jk.Loss({_name(self.fn)}): the loss function returned one "
                "number for the whole batch; rows need one loss per example. "
                "Make the Keras loss with reduction=None."
            )
        if len(labels) > 1:
            weights = tf.cast(labels[1], losses.dtype)
            if weights.shape.rank < losses.shape.rank:  # one weight per example
                extra = [1] * (losses.shape.rank - weights.shape.rank)
                weights = tf.reshape(weights, (*weights.shape, *extra))
            losses = losses * weights
        if losses.shape.rank > 1:
            if self.each:
                return tf.reshape(losses, (losses.shape[0], -1))
            losses = tf.reduce_sum(losses, axis=list(range(1, losses.shape.rank)))
        return losses


def split(inputs: Any) -> tuple[Any, tuple[Any, ...]]:
    """``(x, (y,))`` or ``(x, (y, sample_weight))`` from ``(x, y)`` or
    ``(x, y, sample_weight)``; a clear error for anything else."""
    if not isinstance(inputs, (tuple, list)) or len(inputs) not in (2, 3):
        raise ValueError(
            "jacobian(outputs=jk.Loss(...)): the inputs must be (x, y) or (x, y, "
            f"sample_weight), got {type(inputs).__name__}"
            + (f" of {len(inputs)}" if isinstance(inputs, (tuple, list)) else "")
            + ". Pass the labels with the inputs: jacobian(model, (x, y), ...)."
        )
    _check_lengths(inputs)
    return inputs[0], tuple(inputs[1:])


def _check_lengths(inputs: Any) -> None:
    """Refuse ``y`` or ``sample_weight`` with another number of examples than
    ``x`` (where the shapes are known), before the loss broadcasts them."""
    names = ("x", "y", "sample_weight")
    lengths = []
    for name, value in zip(names, inputs):
        first = [_length(t) for t in tf.nest.flatten(value)]
        lengths.append((name, first[0] if first else None))
    x_length = lengths[0][1]
    for name, length in lengths[1:]:
        if x_length is not None and length is not None and length != x_length:
            raise ValueError(
                f"jacobian(inputs=(x, y{', sample_weight' if len(inputs) > 2 else ''})"
                f"): {name} holds {length} example(s) along its first axis, "
                f"x holds {x_length}. Pass one {'label' if name == 'y' else 'weight'} "
                "per example."
            )


def _length(value: Any) -> int | None:
    """The first axis's size of an array or tensor, where it is known."""
    shape = getattr(value, "shape", None)
    if shape is None or len(shape) == 0:
        return None
    return None if shape[0] is None else int(shape[0])


def _name(fn: Any) -> str:
    return str(getattr(fn, "name", None) or getattr(fn, "__name__", type(fn).__name__))
