"""What breaks DP-SGD's guarantee, refused in words before a step runs:
a loss that is not per-example, rows not one per example, a loss that
mixes the examples, and ``BatchNormalization`` in training mode. (Random
draws that one step cannot hold fixed are refused by
:meth:`jacobkit.strategies.Strategy.check_draws`, inside the clipped sum.)
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import tensorflow as tf

from jacobkit.keras import layer_tree

#: the relative difference above which a loss row is taken to depend on the
#: other examples of its batch (float32 rows of the same example agree to a
#: few ulps)
MIXING_TOLERANCE = 1e-4


def per_example_loss(loss: Any) -> Callable[[Any, Any], Any]:
    """``compile``'s ``loss`` if it gives one loss per example, else a
    refusal: a Keras loss must be made with ``reduction=None`` (or
    ``"none"``); a name (``"mse"``) makes a reducing one; dicts and lists
    (several outputs) are not taken."""
    how = (
        "Pass a per-example loss: a Keras loss made with reduction=None, e.g. "
        "keras.losses.SparseCategoricalCrossentropy(from_logits=True, "
        "reduction=None), or a function (y_true, y_pred) -> (batch,)."
    )
    if loss is None or isinstance(loss, (str, dict, list, tuple)):
        raise ValueError(
            f"jacobkit.privacy: compile(loss={loss!r}): DP-SGD clips each "
            "example's own gradient, so it needs each example's own loss"
            + (", and one loss (one output)" if isinstance(loss, (dict, list)) else "")
            + (
                "; a name makes a loss that averages over the batch"
                if isinstance(loss, str)
                else ""
            )
            + ". "
            + how
        )
    reduction = getattr(loss, "reduction", None)
    if reduction not in (None, "none"):
        raise ValueError(
            f"jacobkit.privacy: compile(loss={type(loss).__name__}(reduction="
            f"{reduction!r})): this loss averages over the batch, which mixes the "
            "examples' gradients before they can be clipped. " + how
        )
    if not callable(loss):
        raise ValueError(f"jacobkit.privacy: compile(loss={loss!r}). " + how)
    return loss


def check_rows(loss: Callable[[Any, Any], Any], y: Any, y_pred: Any) -> None:
    """Refuse a loss whose values are not one per example (a number for the
    batch, or a first axis other than the batch's) or whose first example's
    value changes when the others are left out (a mean over the batch
    inside the loss)."""
    rows = tf.convert_to_tensor(loss(y, y_pred))
    batch = int(tf.nest.flatten(y_pred)[0].shape[0])
    if rows.shape.rank == 0 or rows.shape[0] != batch:
        raise ValueError(
            f"jacobkit.privacy: the loss gave values of shape {tuple(rows.shape)} "
            f"for a batch of {batch} examples; DP-SGD clips one row per example, "
            "so the loss must give one value per example along the first axis "
            "(shape (batch,), or (batch, ...) summed per example). Make the Keras "
            "loss with reduction=None."
        )
    if batch < 2:
        return
    first = tf.nest.map_structure(lambda t: t[:1], (y, y_pred))
    alone = tf.reshape(tf.convert_to_tensor(loss(*first)), (-1,))
    together = tf.reshape(rows[:1], (-1,))
    scale = float(tf.reduce_max(tf.abs(together))) or 1.0
    if not np.allclose(
        alone.numpy(), together.numpy(), rtol=0, atol=MIXING_TOLERANCE * scale
    ):
        raise ValueError(
            "jacobkit.privacy: the loss of an example depends on the other "
            "examples of its batch (its first example's loss alone differs from "
            "its loss within the batch): a mean or a normalization over the batch "
            "inside the loss mixes the examples, so clipping no longer bounds one "
            "example's contribution. Give each example's own loss."
        )


def refuse_batch_statistics(model: Any, training: bool) -> None:
    """Refuse ``BatchNormalization`` (any subclass) that trains with batch
    statistics: with ``training=True`` each example's output depends on the
    whole batch's mean and variance, so no example's gradient is its own
    (and the padding examples would count). A frozen one
    (``layer.trainable = False``: Keras 3 then runs it in inference mode) is
    taken."""
    if not training:
        return
    found = [
        "/".join(path) or layer.name
        for layer, path in layer_tree.walk(model)
        if any(c.__name__ == "BatchNormalization" for c in type(layer).__mro__)
        and getattr(layer, "trainable", True)
    ]
    if found:
        raise ValueError(
            "jacobkit.privacy: BatchNormalization trains on batch statistics at "
            f"{', '.join(found)}: each example's output then depends on the "
            "others' (the batch's mean and variance), so clipping one example's "
            "gradient bounds nothing and the privacy guarantee fails. Replace it "
            "with keras.layers.GroupNormalization or LayerNormalization, freeze "
            "it (layer.trainable = False: inference mode), or pass "
            "make_private(..., training=False)."
        )
