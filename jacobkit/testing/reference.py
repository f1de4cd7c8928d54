"""A slow, obvious reference, and comparisons, so anyone can check a result.

The reference is written independently of the strategies and of how
:mod:`jacobkit.problem` forms rows: one eager ``tape.gradient`` per row, with
the rows formed by plain indexing inside the tape. Give it a float64 copy of
the model (same weights) for a reference that float32 strategies can be held
to. Only what ``layer=`` names is read by jacobkit's own resolver
(:mod:`jacobkit.testing.reference_targets`), so that a name names the same
layer here as in :func:`jacobkit.jacobian`.

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
from dataclasses import dataclass
from typing import Any

import numpy as np
import tensorflow as tf

from jacobkit.keras.cast import float64_copy
from jacobkit.problem.loss import Loss
from jacobkit.problem.loss import split as split_loss_inputs
from jacobkit.testing.reference_targets import ReferenceTarget, resolve

__all__ = [
    "Reference",
    "float64_reference",
    "largest_value",
    "max_relative_difference",
    "reference_jacobian",
    "reference_tensor_jacobian",
]


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
    outputs: str | Callable[[Any], tf.Tensor] | Loss = "features",
    features: Sequence[int] | None = None,
    call_kwargs: Mapping[str, Any] | None = None,
) -> list[np.ndarray]:
    """The Jacobian of every row with respect to each variable, one gradient
    per row, eagerly. Slow on purpose: this is the obvious computation.

    Args:
        model: called as ``model(inputs, **call_kwargs)``.
        inputs: what the model takes.
        variables: ``tf.Variable`` or ``keras.Variable`` objects.
        outputs: as in :func:`jacobkit.jacobian`.
        features: as in :func:`jacobkit.jacobian`.

    Returns:
        One array per variable, shape ``rows_shape + variable.shape``; zeros
        where a row does not depend on the variable.
    """
    target = ReferenceTarget((), variables=tuple(variables))
    return _jacobians(target, model, inputs, outputs, features, call_kwargs)


def _jacobians(
    target: ReferenceTarget,
    model: Any,
    inputs: Any,
    outputs: str | Callable[[Any], tf.Tensor] | Loss,
    features: Sequence[int] | None,
    call_kwargs: Mapping[str, Any] | None,
) -> list[np.ndarray]:
    """One gradient per row of each of ``target``'s sources, eagerly: shape
    ``rows_shape + source.shape``, or each example's own block
    (``rows_shape + source.shape[1:]``) for per-example and full rows of a
    tensor target, as :func:`jacobkit.jacobian` returns them."""
    kwargs = dict(call_kwargs or {})
    labels: tuple[Any, ...] = ()
    if isinstance(outputs, Loss):  # the model takes x of (x, y[, w])
        inputs, labels = split_loss_inputs(inputs)
    with tf.GradientTape(persistent=True, watch_accessed_variables=False) as tape:
        y, sources = target.sources(model, inputs, kwargs, tape)
        if isinstance(outputs, Loss):
            if features is not None:
                y = tf.stack([y[..., f] for f in features], axis=-1)
            losses = outputs.rows(y, labels)
            rows_shape = tuple(losses.shape)
            rows = [losses[index] for index in np.ndindex(*rows_shape)]
        else:
            rows_shape, rows = _row_tensors(y, outputs, features)
    result = []
    for source in sources:
        grads = [
            tape.gradient(
                row, source, unconnected_gradients=tf.UnconnectedGradients.ZERO
            )
            for row in rows
        ]
        # an embedding's gradient is tf.IndexedSlices: made dense first
        stacked = np.stack([np.asarray(tf.convert_to_tensor(g)) for g in grads])
        full = stacked.reshape(rows_shape + tuple(source.shape))
        blocked = target.is_tensor and (
            isinstance(outputs, Loss) or outputs in ("per_example", "full")
        )
        result.append(_own_blocks(full, rows_shape) if blocked else full)
    return result


def _own_blocks(full: np.ndarray, rows_shape: tuple[int, ...]) -> np.ndarray:
    """Row ``[b, ...]`` with respect to ``tensor[b]`` only: ``rows_shape +
    tensor.shape[1:]`` from ``rows_shape + tensor.shape``."""
    middle = (slice(None),) * (len(rows_shape) - 1)
    return np.stack([full[b][middle + (b,)] for b in range(rows_shape[0])])


def reference_tensor_jacobian(
    model: Callable[[Any], tf.Tensor],
    tensor: Any,
    *,
    outputs: str | Callable[[Any], tf.Tensor] | Loss = "features",
    features: Sequence[int] | None = None,
) -> np.ndarray:
    """The Jacobian of every row with respect to the tensor ``model`` is
    called on, one gradient per row, eagerly (the reference for
    ``jacobkit.Inputs()`` and, with ``model`` the rest of a network after a
    layer, ``jacobkit.Output(layer)``).

    Returns:
        ``rows_shape + tensor.shape``; for ``"per_example"`` and ``"full"``
        rows, each example's own block only: ``rows_shape + tensor.shape[1:]``
        (row ``[b, ...]`` with respect to ``tensor[b]``).
    """
    target = ReferenceTarget(("inputs",), inputs=(0,))
    (found,) = _jacobians(target, model, tensor, outputs, features, None)
    return found


def max_relative_difference(
    actual: Any, expected: Any, *, scale: float | None = None
) -> float:
    """``max|actual - expected| / scale``, by default ``scale = max|expected|``
    (the plain difference when the scale is 0).

    Relative to the largest reference entry rather than entry by entry, so
    that entries that are zero in exact arithmetic do not divide by zero. For
    a result of several targets, pass the largest of them all
    (:func:`largest_value`): a target whose exact Jacobian is zero holds only
    round-off, which relative to its own largest entry is 100% (see
    :func:`jacobkit.testing.assert_close`).
    """
    actual = np.asarray(actual, dtype=np.float64)
    expected = np.asarray(expected, dtype=np.float64)
    if actual.shape != expected.shape:
        raise ValueError(
            f"shapes differ: actual {actual.shape} vs expected {expected.shape}"
        )
    if scale is None:
        scale = largest_value([expected])
    error = np.max(np.abs(actual - expected)) if expected.size else 0.0
    if scale == 0.0:
        return float(error)
    return float(error / scale)


def largest_value(arrays: Sequence[Any]) -> float:
    """``max |a|`` over every entry of every array (0 for none): the scale
    of a whole result."""
    found = [float(np.max(np.abs(np.asarray(a)))) for a in arrays if np.size(a)]
    return max(found, default=0.0)


@dataclass(frozen=True)
class Reference(Sequence[np.ndarray]):
    """A reference Jacobian per target, what it was computed on, and how far
    the obvious computation at the model's own precision is from it.

    A sequence of the reference arrays (``ref[i]``, ``len(ref)``), so it goes
    wherever a list of arrays does.

    Attributes:
        jacobians: one array per target, shape ``rows_shape + v.shape``.
        baseline_errors: per target, :func:`max_relative_difference` of the
            plain tape loop on the model itself (float32, or its mixed
            precision) to ``jacobians``, relative to the largest value of
            every target (:func:`largest_value`); ``None`` without a float64
            copy.
        description: in words, e.g. ``"float64 loop on a float64 copy of the
            model (every variable float64)"``.
        names: the result name of each array, as :func:`jacobkit.jacobian`
            names them (empty where not known).
    """

    jacobians: tuple[np.ndarray, ...]
    baseline_errors: tuple[float, ...] | None
    description: str
    names: tuple[str, ...] = ()

    def __getitem__(self, index: Any) -> Any:
        return self.jacobians[index]

    def __len__(self) -> int:
        return len(self.jacobians)


def float64_reference(
    model: Any,
    inputs: Any,
    layer: Any,
    *,
    outputs: str | Callable[[Any], tf.Tensor] | Loss = "features",
    features: Sequence[int] | None = None,
    call_kwargs: Mapping[str, Any] | None = None,
    baseline: bool = True,
) -> Reference:
    """The float64 reference for ``layer=`` of ``model``, and the error of the
    obvious loop on ``model`` itself, from which
    :func:`jacobkit.testing.assert_close` derives its tolerance.

    ``layer`` is anything :func:`jacobkit.jacobian` takes: a layer object, its
    name or path (``"vit_encoder/transformer_block_2/mlp/dense_1"``), a list
    of variables, ``Inputs()``, ``Inputs("name")`` or ``Output("layer")``
    (:mod:`jacobkit.testing.reference_targets`). The arrays have the shapes
    :func:`jacobkit.jacobian` gives, in its order (``names``): per-example
    and full rows of ``Inputs``/``Output`` keep each example's own block.

    The reference is the one-gradient-per-row loop on :func:`float64_copy` of
    the model (floating inputs cast to float64; a subclassed model is made
    anew from its constructor's arguments under a float64 default policy and
    built on the inputs). Where no float64 copy can be built (a ``tf.Module``,
    a subclassed model whose layers are given a dtype of their own or whose
    constructor needs arguments its config lacks) it raises ``TypeError``:
    a loop on the model itself would hold the model to itself.
    ``baseline=False`` skips the loop on the model itself
    (``baseline_errors`` is then ``None``).

    It is slow on purpose, and float64 convolutions are slower still where
    Keras groups them: 96-183 s per target on ConvNeXtTiny (see
    ``docs/checking.md``).
    """
    try:
        return _float64_reference(
            model, inputs, layer, outputs, features, call_kwargs, baseline
        )
    except (ValueError, TypeError, tf.errors.OpError) as err:
        if "float64_reference(" not in str(err) and not call_kwargs:
            _refuse_in_words(model, inputs, layer, outputs, features, err)
        raise


def _refuse_in_words(
    model: Any, inputs: Any, layer: Any, outputs: Any, features: Any, err: Exception
) -> None:
    """Raise jacobkit's own message for what made the reference fail (a
    model's raw error on inputs of the wrong shape, features out of range),
    from the checks :func:`jacobkit.jacobian` runs on the same arguments;
    return where they find nothing wrong."""
    from jacobkit.problem.call import Call

    try:
        Call(
            model, layer, outputs=outputs, features=features, unconnected="zero"
        ).problem(inputs)
    except (ValueError, TypeError) as found:
        message = str(found).replace("jacobian(", "float64_reference(", 1)
        raise type(found)(message) from err


def _float64_reference(
    model: Any,
    inputs: Any,
    layer: Any,
    outputs: Any,
    features: Any,
    call_kwargs: Mapping[str, Any] | None,
    baseline: bool,
) -> Reference:
    kwargs = dict(call_kwargs or {})
    # loss rows take (x, y[, w]); the targets are found in what the model takes
    model_inputs = split_loss_inputs(inputs)[0] if isinstance(outputs, Loss) else inputs
    target = resolve(layer, model, model_inputs)

    def own() -> list[np.ndarray]:
        return _jacobians(target, model, inputs, outputs, features, kwargs)

    try:
        copy = float64_copy(model, model_inputs)
    except TypeError as err:
        # a loop on the model itself would be held to itself: a check
        # against nothing, under a float64 name
        raise TypeError(
            f"float64_reference(model={_model_name(model)}): no float64 copy of "
            f"the model can be built ({str(err).split(': ', 1)[-1][:200]}), and "
            "a reference in the model's own precision would compare it with "
            "itself. Build a float64 copy yourself (the same model made with "
            "dtype='float64', its weights copied) and pass it to "
            "testing.reference_jacobian(copy, inputs, the copy's variables)."
        ) from err
    inputs64 = tf.nest.map_structure(_as_float64, inputs)
    jacobians = _jacobians(
        target.on_copy(model, copy), copy, inputs64, outputs, features, kwargs
    )
    errors = None
    if baseline:
        # relative to the whole result, as assert_close compares
        scale = largest_value(jacobians)
        errors = tuple(
            max_relative_difference(a, e, scale=scale)
            for a, e in zip(own(), jacobians, strict=True)
        )
    return Reference(
        tuple(jacobians),
        errors,
        "float64 loop on a float64 copy of the model (every variable float64)",
        target.names,
    )


def _model_name(model: Any) -> str:
    return f"{type(model).__name__} {getattr(model, 'name', '')!r}".strip()


def _as_float64(value: Any) -> Any:
    array = np.asarray(value)
    return array.astype("float64") if array.dtype.kind == "f" else value
