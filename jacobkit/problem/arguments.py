"""Checks of ``jacobian()``'s arguments that need no model call, the inputs
as tensors, and jacobkit's message for a model that fails on its inputs."""

from __future__ import annotations

from typing import Any, NoReturn

import numpy as np
import tensorflow as tf

from jacobkit.keras import layer_tree

UNCONNECTED_MODES = ("error", "zero")
#: ``reduce=``: ``None`` (the Jacobians) or ``"norm"`` (each row's L2 norm)
REDUCE_MODES = (None, "norm")


def check_model(model: Any) -> None:
    if not callable(model):
        raise TypeError(
            "jacobian(model=...): expected a Keras model or a callable "
            f"f(inputs) -> tf.Tensor, got {type(model).__name__}."
        )


def check_unconnected(unconnected: Any) -> None:
    if unconnected not in UNCONNECTED_MODES:
        raise ValueError(
            f"jacobian(unconnected={unconnected!r}): expected 'error' (raise "
            "when a target does not influence the outputs) or 'zero' (return "
            "zeros for it)."
        )


def check_training(training: Any) -> bool:
    if not isinstance(training, (bool, np.bool_)):
        raise TypeError(
            f"jacobian(training={training!r}): expected True (training "
            "behaviour: dropout, batch statistics) or False (inference), got "
            f"{type(training).__name__}."
        )
    return bool(training)


def check_reduce(reduce: Any) -> str | None:
    if reduce not in REDUCE_MODES:
        raise ValueError(
            f"jacobian(reduce={reduce!r}): expected None (the Jacobians) or "
            "'norm' (the L2 norm of each row's Jacobian per target, shape "
            "rows_shape)."
        )
    return reduce


def to_tensors(inputs: Any) -> Any:
    """``inputs`` (an array, or a tuple, list or dict of them for a
    multi-input model) as ``tf.Tensor`` of the same structure."""

    def convert(value):
        if isinstance(
            value, (tf.Tensor, tf.Variable, np.ndarray, np.generic, list, float, int)
        ):
            # a tf.Variable input is read: its value is the input tensor
            return tf.convert_to_tensor(value)
        raise TypeError(
            "jacobian(inputs=...): expected NumPy arrays or tf.Tensors (in a "
            f"tuple, list or dict for a multi-input model), got "
            f"{type(value).__name__}."
        )

    # A list of arrays is the inputs of a multi-input model; a list of
    # numbers or of lists (x.tolist()) is one array.
    if isinstance(inputs, (tuple, dict)) or (
        isinstance(inputs, list)
        and inputs
        and all(
            isinstance(v, (tf.Tensor, tf.Variable, np.ndarray, tuple, dict))
            for v in inputs
        )
    ):
        return tf.nest.map_structure(convert, inputs)
    return convert(inputs)


def raise_call_error(model: Any, inputs: Any, err: Exception) -> NoReturn:
    """Raise jacobkit's message for ``model`` failing on ``inputs`` with ``err``."""
    flat = tf.nest.flatten(inputs)
    mismatch = layer_tree.input_mismatch(model, inputs, flat)
    if mismatch is not None:
        # the shapes say it all; the model's traced error would bury them
        raise ValueError(f"jacobian(inputs=...): {mismatch}") from None
    shapes = ", ".join(str(tuple(t.shape)) for t in flat)
    raise ValueError(
        f"jacobian(model=...): calling the model on inputs of shape {shapes} "
        f"failed: {layer_tree.error_summary(err)} Check that the inputs "
        "are what the model takes (batch axis first)."
    ) from err
