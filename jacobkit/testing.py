"""A slow, obvious reference, and comparisons, so anyone can check a result.

The reference is written independently of the strategies and of
:mod:`jacobkit.problem`: one eager ``tape.gradient`` per row, with the rows
formed by plain indexing inside the tape. Give it a float64 copy of the model
(same weights) for a reference that float32 strategies can be held to.

>>> import numpy as np, keras
>>> layer = keras.layers.Dense(2, dtype="float64")
>>> model = keras.Sequential([keras.Input((3,), dtype="float64"), layer])
>>> x = np.ones((4, 3))
>>> ref = reference_jacobian(model, x, [layer.kernel, layer.bias])
>>> ref[1]          # d(sum_b Y[b, f]) / d bias = B where f matches
array([[4., 0.],
       [0., 4.]])
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
import tensorflow as tf

from jacobkit.verify import VerificationError, verify  # noqa: F401 - re-exported

#: Tolerances on :func:`max_relative_difference` by the dtype of the result
#: under test, against the float64 reference. Measured over every strategy
#: configuration in ``tests/cases.py`` (``STRATEGIES``) x every problem
#: (``PROBLEMS``) x every ``outputs`` mode (TF 2.21 CPU, Keras 3.15):
#: float32: at most 7.0e-7 (the residual block with the callable ``outputs``;
#: every reverse-mode strategy gives the same 6.99e-7, so it is the float32
#: forward pass, not the strategy); median 1.6e-7. 1e-5 leaves a margin of 14x.
#: float64: at most 6.9e-16 (the residual block, ``per_example``); 1e-12 only
#: guards against a float32 computation slipping in.
#: float16 and bfloat16 are not measured (no test problem uses them).
TOLERANCE = {tf.float16: 5e-3, tf.bfloat16: 5e-2, tf.float32: 1e-5, tf.float64: 1e-12}


def _row_tensors(
    outputs: tf.Tensor,
    mode: str | Callable[[Any], tf.Tensor],
    features: Sequence[int] | None,
) -> tuple[tuple[int, ...], list[tf.Tensor]]:
    """Every row as a scalar tensor, built by indexing (inside a tape)."""
    if features is not None:
        outputs = tf.stack([outputs[..., f] for f in features], axis=-1)
    if callable(mode):
        values = tf.convert_to_tensor(mode(outputs))
        shape = tuple(values.shape)
        return shape, [values[index] for index in np.ndindex(*shape)]
    shape = tuple(outputs.shape)
    num_features = shape[-1]
    if mode == "features":
        return (num_features,), [
            tf.reduce_sum(outputs[..., f]) for f in range(num_features)
        ]
    if mode == "per_example":
        rows = [
            tf.reduce_sum(outputs[b, ..., f])
            for b, f in itertools.product(range(shape[0]), range(num_features))
        ]
        return (shape[0], num_features), rows
    if mode == "full":
        return shape, [outputs[index] for index in np.ndindex(*shape)]
    raise ValueError(f"reference_jacobian(outputs={mode!r}): unknown mode.")


def reference_jacobian(
    model: Callable[[Any], tf.Tensor],
    inputs: Any,
    variables: Sequence[Any],
    *,
    outputs: str | Callable[[Any], tf.Tensor] = "features",
    features: Sequence[int] | None = None,
    call_kwargs: Mapping[str, Any] | None = None,
) -> list[np.ndarray]:
    """The Jacobian of every row with respect to each variable, one gradient
    per row, eagerly. Slow on purpose: this is the obvious computation.

    Args:
        model: called as ``model(inputs, **call_kwargs)``.
        inputs: what the model takes.
        variables: ``tf.Variable`` or ``keras.Variable`` objects.
        outputs, features: as in :func:`jacobkit.jacobian`.

    Returns:
        One array per variable, shape ``rows_shape + variable.shape``; zeros
        where a row does not depend on the variable.
    """
    call_kwargs = dict(call_kwargs or {})
    # A keras.Variable's .value is the tf.Variable every read goes through.
    watched = [v if isinstance(v, tf.Variable) else v.value for v in variables]
    with tf.GradientTape(persistent=True) as tape:
        tape.watch(watched)
        y = model(inputs, **call_kwargs)
        rows_shape, rows = _row_tensors(y, outputs, features)
    result = []
    for v in watched:
        grads = [
            tape.gradient(row, v, unconnected_gradients=tf.UnconnectedGradients.ZERO)
            for row in rows
        ]
        stacked = np.stack([np.asarray(g) for g in grads])
        result.append(stacked.reshape(rows_shape + tuple(v.shape)))
    return result


def float64_copy(model: Any) -> Any:
    """A float64 copy of a Keras 3 functional or Sequential model, with the
    same weights (cast), for :func:`reference_jacobian`.

    Raises:
        TypeError: for models Keras cannot clone from their config
            (subclassed models, ``tf.Module``); build those in float64 yourself.
    """
    import keras

    def clone(layer):
        return layer.__class__.from_config({**layer.get_config(), "dtype": "float64"})

    try:
        copy = keras.models.clone_model(model, clone_function=clone)
    except (ValueError, TypeError, NotImplementedError) as err:
        raise TypeError(
            f"float64_copy(model): cannot clone {type(model).__name__} from its "
            "config; build a float64 copy of the model and copy its weights."
        ) from err
    copy.set_weights([w.astype("float64") for w in model.get_weights()])
    return copy


def max_relative_difference(actual: Any, expected: Any) -> float:
    """``max|actual - expected| / max|expected|`` (0 when both are all zero).

    Relative to the largest reference entry rather than entry by entry, so
    that entries that are zero in exact arithmetic do not divide by zero.
    """
    actual = np.asarray(actual, dtype=np.float64)
    expected = np.asarray(expected, dtype=np.float64)
    if actual.shape != expected.shape:
        raise ValueError(
            f"shapes differ: actual {actual.shape} vs expected {expected.shape}"
        )
    scale = np.max(np.abs(expected)) if expected.size else 0.0
    error = np.max(np.abs(actual - expected)) if expected.size else 0.0
    if scale == 0.0:
        return float(error)
    return float(error / scale)


def assert_close(
    result: Any, reference: Sequence[Any], *, tolerance: float | None = None
) -> float:
    """Assert each Jacobian in ``result`` (a :class:`JacobianResult` or a list)
    is within ``tolerance`` of ``reference`` in :func:`max_relative_difference`.

    The default tolerance depends on the result's dtype (:data:`TOLERANCE`).
    Returns the largest difference found.
    """
    actual = (
        list(result.jacobians.values())
        if hasattr(result, "jacobians")
        else list(result)
    )
    if len(actual) != len(reference):
        raise AssertionError(
            f"{len(actual)} Jacobians to compare with {len(reference)} references"
        )
    worst = 0.0
    for i, (a, e) in enumerate(zip(actual, reference, strict=True)):
        tol = tolerance if tolerance is not None else TOLERANCE[tf.as_dtype(a.dtype)]
        diff = max_relative_difference(a, e)
        worst = max(worst, diff)
        if not diff <= tol:
            raise AssertionError(
                f"Jacobian {i} differs from the reference: max relative "
                f"difference {diff:.3e} > tolerance {tol:.1e}"
            )
    return worst
