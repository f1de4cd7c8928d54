"""Copies of a Keras model in another floating dtype, with the same weights:
the float64 copy a reference is computed on, the float32 twin of a
mixed-precision model."""

from __future__ import annotations

import inspect
from typing import Any

import tensorflow as tf

from jacobkit.keras.compat import variable_path

__all__ = ["cast_copy", "dtype_name", "float64_copy"]

#: dtype and dtype-policy names a copy rewrites: every floating one
_FLOATING_DTYPES = frozenset(
    {"float16", "bfloat16", "float32", "float64", "half", "float", "double"}
    | {"mixed_float16", "mixed_bfloat16"}
)


def cast_copy(model: Any, dtype: str = "float64", inputs: Any = None) -> Any:
    """A copy of a Keras functional or Sequential model (Keras 3 or
    ``tf_keras``) whose every layer computes and stores its variables in
    ``dtype``, nested sub-models and ``Input`` layers included, with the same
    weights (cast). ``dtype`` is a floating dtype or a mixed-precision policy
    name (``"mixed_float16"``: float16 computation, float32 variables and
    inputs).

    ``cast_copy(model)`` is the float64 copy
    :func:`jacobkit.testing.reference_jacobian` is meant for;
    ``cast_copy(model, "float32")`` gives the float32-weights twin of a
    mixed-precision model. The copy is built from the model's
    config with every floating dtype and dtype policy in it (layers'
    ``dtype``, ``Input`` dtypes, ``mixed_float16`` ...) replaced by
    ``dtype``; integer inputs keep their dtype. The model itself is not
    touched.

    A subclassed model (its layers made in ``__init__``, not in its config)
    is rebuilt from its constructor's arguments (its config; none for a
    constructor that takes none) under a ``dtype`` default dtype policy, so
    that the layers its constructor makes are ``dtype`` too, then called
    once on ``inputs`` (cast to ``dtype``) to create its variables.

    Raises:
        TypeError: for models that cannot be rebuilt (a ``tf.Module``, a
            subclassed model whose constructor needs arguments its config
            lacks, or one without ``inputs`` to build it on), or when a layer
            of the copy still holds a floating variable of another dtype (a
            custom layer, or a subclassed model's, given a dtype of its own);
            build those yourself in ``dtype``.
    """
    try:
        config = _with_dtype(model.get_config(), dtype)
        if _is_subclassed(model):
            copy = _rebuilt(model, config, dtype, inputs)
        else:
            copy = type(model).from_config(config)
        weights = model.get_weights()
        copied = copy.weights
        if len(weights) != len(copied):
            raise ValueError(f"{len(copied)} variables, expected {len(weights)}")
        copy.set_weights(
            [w.astype(dtype_name(v)) for w, v in zip(weights, copied, strict=True)]
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
            f"{variable_path(v)} ({dtype_name(v)})"
            for v in copy.weights
            if tf.as_dtype(dtype_name(v)).is_floating
            and dtype_name(v) != ("float32" if "mixed" in dtype else dtype)
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


def float64_copy(model: Any, inputs: Any = None) -> Any:
    """``cast_copy(model, "float64", inputs)``: the float64 copy of a Keras
    model (every layer, nested sub-models included) for
    :func:`jacobkit.testing.reference_jacobian` (``inputs``: what a
    subclassed copy is built on).

    Raises:
        TypeError: as :func:`cast_copy`.
    """
    return cast_copy(model, "float64", inputs)


def _is_subclassed(model: Any) -> bool:
    """A Keras model whose layers its own ``__init__`` makes (not rebuilt by
    ``from_config``: neither functional nor ``Sequential``)."""
    if hasattr(model, "_is_graph_network"):  # tf_keras
        return not model._is_graph_network and not _named(model, "Sequential")
    return not _named(model, "Functional", "Sequential")


def _named(model: Any, *names: str) -> bool:
    return any(c.__name__ in names for c in type(model).__mro__)


def _rebuilt(model: Any, config: dict[str, Any], dtype: str, inputs: Any) -> Any:
    """A subclassed ``model`` made anew from its constructor's arguments in
    ``config`` under a ``dtype`` default policy, built on ``inputs``."""
    if inputs is None:
        raise ValueError(
            "a subclassed model creates its variables on its first call; pass "
            "inputs to build the copy on"
        )
    import keras

    if not isinstance(model, keras.Model):
        raise ValueError(
            "only a Keras 3 subclassed model is rebuilt under another dtype policy"
        )
    cls = type(model)
    accepted = inspect.signature(cls.__init__).parameters
    takes_any = any(p.kind is p.VAR_KEYWORD for p in accepted.values())
    arguments = {k: v for k, v in config.items() if takes_any or k in accepted}
    before = keras.config.dtype_policy()
    # the default policy is per thread in Keras 3: other threads see none of it
    keras.config.set_dtype_policy(dtype)
    try:
        copy = cls.from_config(arguments) if takes_any else cls(**arguments)
    finally:
        keras.config.set_dtype_policy(before)
    copy(tf.nest.map_structure(lambda t: _cast_floating(t, dtype), inputs))
    return copy


def _cast_floating(value: Any, dtype: str) -> Any:
    tensor = tf.convert_to_tensor(value)
    return tf.cast(tensor, dtype) if tensor.dtype.is_floating else tensor


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


def dtype_name(variable: Any) -> str:
    """The name of a variable's dtype, e.g. ``"float32"``."""
    return tf.as_dtype(variable.dtype).name
