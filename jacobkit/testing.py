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
from dataclasses import dataclass
from typing import Any

import numpy as np
import tensorflow as tf

from jacobkit.verification import VerificationError, verify  # noqa: F401 - re-exported

#: Tolerances on :func:`max_relative_difference` by the dtype of the result
#: under test, against the float64 reference. Measured over every strategy
#: configuration in ``tests/cases.py`` (``STRATEGIES``) x every problem
#: (``PROBLEMS``) x every ``outputs`` mode (TF 2.21 CPU, Keras 3.15):
#: float32: at most 7.0e-7 (the residual block with the callable ``outputs``;
#: every reverse-mode strategy gives the same 6.99e-7, so it is the float32
#: forward pass, not the strategy); median 1.6e-7. 1e-5 leaves a margin of 14x.
#: float64: at most 6.9e-16 (the residual block, ``per_example``); 1e-12 only
#: guards against a float32 computation slipping in.
#: Reduced precision, measured over ``tests/test_mixed_precision.py`` (every
#: strategy configuration x the generator, cnn2d and mlp examples, against
#: the float64 copy of the model under test; strategies that refuse left out):
#: ``"mixed_float16"`` (float32 results): at most 2.2e-3 (loop and while; batch
#: 1.2e-3); 5e-3 leaves 2.3x. ``"mixed_bfloat16"``: at most 8.6e-3 (while,
#: per_example); 2e-2 leaves 2.3x. float16 layers: at most 2.5e-3 (loop);
#: bfloat16 layers: at most 5.8e-3.
#: bfloat16 on a Conv2D model (cnn2d) depends on the CPU's kernels, measured
#: per instruction set (TF 2.21; ``jacobkit.precision.bfloat16_check`` finds
#: the same figures on a tiny model at first use):
#: - AVX-512 with VNNI/BF16 (AMD EPYC Zen 4; oneDNN on, TensorFlow's default
#:   there): every compiled strategy 3.1e-3 to 7.4e-3; the eager ``loop``
#:   0.31-0.33 (eager ops skip oneDNN's float32 accumulation).
#: - AVX2 only (AMD EPYC Zen 3: 0.31-0.37 reported, 27 failures), and the
#:   same Zen 4 with ``TF_ENABLE_ONEDNN_OPTS=0`` (oneDNN off, as TensorFlow
#:   defaults on a CPU without VNNI/BF16/AMX): every strategy 0.31-0.33,
#:   compiled or not, but ``batch`` under mixed_bfloat16 (6.7e-3: it
#:   contracts in float32). Its kernels round every intermediate gradient to
#:   bfloat16, and cnn2d's gradients cancel.
#: ``tests/test_mixed_precision.py`` holds each strategy to 2x the plain
#: loop's error on the same path (eager, or compiled), and to these floors
#: where that loop is within ``jacobkit.precision.FAR_OFF`` (0.1); where it is
#: not, the test is an expected failure naming the CPU and the figure.
TOLERANCE = {
    tf.float16: 5e-3,
    tf.bfloat16: 2e-2,
    tf.float32: 1e-5,
    tf.float64: 1e-12,
    "mixed_float16": 5e-3,
    "mixed_bfloat16": 2e-2,
}


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


def reference_tensor_jacobian(
    model: Callable[[Any], tf.Tensor],
    tensor: Any,
    *,
    outputs: str | Callable[[Any], tf.Tensor] = "features",
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
    x = tf.convert_to_tensor(tensor)
    with tf.GradientTape(persistent=True) as tape:
        tape.watch(x)
        y = model(x)
        rows_shape, rows = _row_tensors(y, outputs, features)
    grads = [
        tape.gradient(row, x, unconnected_gradients=tf.UnconnectedGradients.ZERO)
        for row in rows
    ]
    full = np.stack([np.asarray(g) for g in grads]).reshape(rows_shape + x.shape)
    if outputs not in ("per_example", "full"):
        return full
    middle = (slice(None),) * (len(rows_shape) - 1)
    return np.stack([full[b][(*middle, b)] for b in range(rows_shape[0])])


#: dtype and dtype-policy names a copy rewrites: every floating one
_FLOATING_DTYPES = frozenset(
    {"float16", "bfloat16", "float32", "float64", "half", "float", "double"}
    | {"mixed_float16", "mixed_bfloat16"}
)


def cast_copy(model: Any, dtype: str = "float64") -> Any:
    """A copy of a Keras functional or Sequential model (Keras 3 or
    ``tf_keras``) whose every layer computes and stores its variables in
    ``dtype``, nested sub-models and ``Input`` layers included, with the same
    weights (cast). ``dtype`` is a floating dtype or a mixed-precision policy
    name (``"mixed_float16"``: float16 computation, float32 variables and
    inputs).

    ``cast_copy(model)`` is the float64 copy :func:`reference_jacobian` is
    meant for; ``cast_copy(model, "float32")`` gives the float32-weights
    twin of a mixed-precision model. The copy is built from the model's
    config with every floating dtype and dtype policy in it (layers'
    ``dtype``, ``Input`` dtypes, ``mixed_float16`` ...) replaced by
    ``dtype``; integer inputs keep their dtype. The model itself is not
    touched.

    Raises:
        TypeError: for models that cannot be rebuilt from their config
            (subclassed models, ``tf.Module``), or when a layer of the copy
            still holds a floating variable of another dtype (a custom layer
            that ignores ``dtype=``); build those yourself in ``dtype``.
    """
    try:
        config = _with_dtype(model.get_config(), dtype)
        copy = type(model).from_config(config)
        weights = model.get_weights()
        copied = copy.weights
        if len(weights) != len(copied):
            raise ValueError(f"{len(copied)} variables, expected {len(weights)}")
        copy.set_weights(
            [w.astype(_dtype_name(v)) for w, v in zip(weights, copied, strict=True)]
        )
    except (
        AttributeError,
        KeyError,
        NotImplementedError,
        TypeError,
        ValueError,
    ) as err:
        reason = (str(err).strip().splitlines() or [""])[0][:200]
        raise TypeError(
            f"cast_copy(model, {dtype!r}): cannot rebuild {type(model).__name__} "
            f"from its config ({type(err).__name__}: {reason}); build a {dtype} "
            "copy of the model yourself and copy its weights."
        ) from err
    kept = sorted(
        {
            f"{_variable_path(v)} ({_dtype_name(v)})"
            for v in copy.weights
            if tf.as_dtype(_dtype_name(v)).is_floating
            and _dtype_name(v) != ("float32" if "mixed" in dtype else dtype)
        }
    )
    if kept:
        raise TypeError(
            f"cast_copy(model, {dtype!r}): the copy still holds variables of "
            f"another dtype: {', '.join(kept[:5])}"
            + (f" and {len(kept) - 5} more" if len(kept) > 5 else "")
            + f". Their layers ignore dtype=; build a {dtype} copy yourself."
        )
    return copy


def float64_copy(model: Any) -> Any:
    """``cast_copy(model, "float64")``: the float64 copy of a Keras model
    (every layer, nested sub-models included) for :func:`reference_jacobian`.

    Raises:
        TypeError: as :func:`cast_copy`.
    """
    return cast_copy(model, "float64")


def _with_dtype(config: Any, dtype: str, tensor: bool = False) -> Any:
    """``config`` with every floating dtype or dtype policy set to ``dtype``.

    ``Input`` layers and recorded tensors (``tensor=True``) hold a tensor
    dtype, not a policy: a mixed policy gives them its variable dtype
    (``"mixed_float16"`` -> ``"float32"``, as ``keras.Input`` under that policy).
    """
    if isinstance(config, list):
        return [_with_dtype(c, dtype, tensor) for c in config]
    if not isinstance(config, dict):
        return config
    holds_tensor = config.get("class_name") in ("InputLayer", "__keras_tensor__")
    rewritten = {}
    for key, value in config.items():
        if key == "dtype" and _is_floating_dtype(value):
            rewritten[key] = "float32" if tensor and "mixed" in dtype else dtype
        else:
            rewritten[key] = _with_dtype(value, dtype, tensor or holds_tensor)
    return rewritten


def _is_floating_dtype(value: Any) -> bool:
    """A dtype name, or a serialized dtype policy, that is floating."""
    if isinstance(value, dict):  # {"class_name": "DTypePolicy", "config": {...}}
        value = (value.get("config") or {}).get("name")
    return isinstance(value, str) and value in _FLOATING_DTYPES


def _dtype_name(variable: Any) -> str:
    return tf.as_dtype(variable.dtype).name


def _variable_path(variable: Any) -> str:
    return getattr(variable, "path", None) or variable.name


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


#: A derived tolerance is this many times the error of the obvious loop at
#: the model's own precision (see :func:`assert_close`).
BASELINE_FACTOR = 2.0


@dataclass(frozen=True)
class Reference(Sequence):
    """A reference Jacobian per target, what it was computed on, and how far
    the obvious computation at the model's own precision is from it.

    A sequence of the reference arrays (``ref[i]``, ``len(ref)``), so it goes
    wherever a list of arrays does.

    Attributes:
        jacobians: one array per target, shape ``rows_shape + v.shape``.
        baseline_errors: per target, :func:`max_relative_difference` of the
            plain tape loop on the model itself (float32, or its mixed
            precision) to ``jacobians``; ``None`` without a float64 copy.
        description: in words, e.g. ``"float64 loop on a float64 copy of the
            model (every variable float64)"``.
    """

    jacobians: tuple[np.ndarray, ...]
    baseline_errors: tuple[float, ...] | None
    description: str

    def __getitem__(self, index):
        return self.jacobians[index]

    def __len__(self) -> int:
        return len(self.jacobians)


def float64_reference(
    model: Any,
    inputs: Any,
    variables: Sequence[Any],
    *,
    outputs: str | Callable[[Any], tf.Tensor] = "features",
    features: Sequence[int] | None = None,
    call_kwargs: Mapping[str, Any] | None = None,
    baseline: bool = True,
) -> Reference:
    """The float64 reference for ``model``'s ``variables``, and the error of
    the obvious loop on ``model`` itself, from which :func:`assert_close`
    derives its tolerance.

    The reference is :func:`reference_jacobian` on :func:`float64_copy` of the
    model (floating inputs cast to float64). Where no float64 copy can be
    built (a subclassed model, a ``tf.Module``), it is the loop on the model
    itself, and ``description`` says so. ``baseline=False`` skips the loop
    on the model itself (``baseline_errors`` is then ``None``).
    """
    kwargs = dict(call_kwargs or {})

    def own() -> list[np.ndarray]:
        return reference_jacobian(
            model,
            inputs,
            variables,
            outputs=outputs,
            features=features,
            call_kwargs=kwargs,
        )

    try:
        copy = float64_copy(model)
    except TypeError as err:
        dtypes = sorted({_dtype_name(v) for v in variables})
        return Reference(
            tuple(own()),
            None,
            f"{'/'.join(dtypes)} loop on the model itself (no float64 copy: "
            f"{str(err).split(': ', 1)[-1][:120]})",
        )
    copied = [copy.weights[_position(model, v)] for v in variables]
    inputs64 = tf.nest.map_structure(_as_float64, inputs)
    jacobians = reference_jacobian(
        copy, inputs64, copied, outputs=outputs, features=features, call_kwargs=kwargs
    )
    errors = None
    if baseline:
        errors = tuple(
            max_relative_difference(a, e) for a, e in zip(own(), jacobians, strict=True)
        )
    return Reference(
        tuple(jacobians),
        errors,
        "float64 loop on a float64 copy of the model (every variable float64)",
    )


def _position(model: Any, variable: Any) -> int:
    """Where ``variable`` is in ``model.weights`` (a copy keeps the order)."""
    handle = _handle(variable)
    for i, weight in enumerate(model.weights):
        if _handle(weight) is handle:
            return i
    raise ValueError(
        f"float64_reference(variables=...): {_variable_path(variable)} is not a "
        "variable of the model; pass the model's own variables."
    )


def _tolerance_key(precision: Any) -> Any:
    """A policy name as is; a dtype (or its name) as a ``tf.DType``."""
    return precision if precision in TOLERANCE else tf.as_dtype(precision)


def _handle(variable: Any) -> tf.Variable:
    """The ``tf.Variable`` behind a Keras 3 variable (identity for others)."""
    return variable if isinstance(variable, tf.Variable) else variable.value


def _as_float64(value: Any) -> Any:
    array = np.asarray(value)
    return array.astype("float64") if array.dtype.kind == "f" else value


def assert_close(
    result: Any,
    reference: Sequence[Any],
    *,
    tolerance: float | None = None,
    precision: str | None = None,
) -> float:
    """Assert each Jacobian in ``result`` (a :class:`JacobianResult` or a list)
    is within tolerance of ``reference`` in :func:`max_relative_difference`.

    The tolerance, per target:

    - ``tolerance`` if given;
    - else, for a :class:`Reference` from :func:`float64_reference`:
      ``max(floor, BASELINE_FACTOR × the obvious loop's own error)``, so a
      model whose float32 forward pass is itself far from float64 (deep,
      nested, wide) gets a tolerance it can meet, and a small one keeps a
      tight one. Measured on the nested and deep models of
      ``tests/test_reference.py``, every strategy is within 1.2x of the
      loop's own error (float32) or refuses (float16, see
      :mod:`jacobkit.precision`), which ``BASELINE_FACTOR = 2`` covers. The
      derived tolerance is only as tight as that loop: under bfloat16 on CPU
      the eager loop can be far off (0.33 on a Conv2D model, see
      :data:`TOLERANCE`), so pass ``precision=`` with a plain list of arrays
      there;
    - else the floor: :data:`TOLERANCE` for ``precision`` if given
      (``"mixed_float16"``, ``"mixed_bfloat16"``), else for the result's dtype.

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
    baseline = getattr(reference, "baseline_errors", None)
    worst = 0.0
    for i, (a, e) in enumerate(zip(actual, reference, strict=True)):
        floor = TOLERANCE[_tolerance_key(precision or a.dtype)]
        tol, why = floor, "the floor for this precision"
        if tolerance is not None:
            tol, why = tolerance, "given"
        elif baseline is not None and BASELINE_FACTOR * baseline[i] > floor:
            tol = BASELINE_FACTOR * baseline[i]
            why = (
                f"{BASELINE_FACTOR:g} x the obvious loop's own error {baseline[i]:.1e}"
            )
        diff = max_relative_difference(a, e)
        worst = max(worst, diff)
        if not diff <= tol:
            raise AssertionError(
                f"Jacobian {i} differs from the reference: max relative "
                f"difference {diff:.3e} > tolerance {tol:.1e} ({why})"
            )
    return worst
