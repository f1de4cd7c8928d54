"""Keras 3, ``tf_keras`` or a plain ``tf.Module``: what kind of model or layer
an object is, the ``tf.Variable`` behind a Keras variable and every layer a
model holds. The one place jacobkit probes the Keras flavour.
"""

from __future__ import annotations

from types import ModuleType
from typing import Any

import tensorflow as tf


def keras3() -> ModuleType | None:
    """The ``keras`` package if it is Keras 3, else ``None``."""
    try:
        import keras

        return keras if keras.__version__.startswith("3") else None
    except ImportError:  # pragma: no cover - keras ships with tensorflow
        return None


def tf_keras() -> ModuleType | None:
    """The ``tf_keras`` package (Keras 2), or ``None`` where not installed."""
    try:
        import tf_keras

        return tf_keras
    except ImportError:
        return None


def keras_modules() -> tuple[ModuleType, ...]:
    """The installed Keras flavours: Keras 3 and ``tf_keras``, where present."""
    return tuple(m for m in (keras3(), tf_keras()) if m is not None)


def needs_autograph(model: Any) -> bool:
    """False for a Keras 3 layer or model, whose code AutoGraph never
    converts; True otherwise.

    NOTE (why AutoGraph is off for Keras 3 models). AutoGraph rewrites the
    Python source of every function a traced computation calls that is not on
    its do-not-convert list, jacobkit's own included: measured on the MLP of
    the auto benchmark (2-core CPU, TensorFlow 2.21), converting jacobkit's
    functions took 1.2 s of a 2.4-3.3 s first call, while tracing the model
    itself took 0.04 s. jacobkit's computations need none of it: their loops
    and conditions are TensorFlow ops (``tf.while_loop``, ``tf.map_fn``,
    ``tf.vectorized_map``) or Python over static values. What the model
    computes does not change either for a Keras 3 model: the ``keras``
    package is on AutoGraph's do-not-convert list and Keras 3 does not convert
    layers itself, so a Keras 3 model's code runs as written with AutoGraph on
    or off (checked: a subclassed layer with a Python ``if`` on a tensor fails
    the same way under both). A ``tf_keras`` model converts its subclassed
    layers' ``call`` only while AutoGraph is on, and a plain callable ``f(x)``
    is converted by it: those keep AutoGraph, and their first call keeps its
    cost.
    """
    keras = keras3()
    return keras is None or not isinstance(model, keras.layers.Layer)


def is_keras_layer(obj: Any) -> bool:
    """True for a Keras 3 or ``tf_keras`` layer (models are layers too)."""
    return any(isinstance(obj, module.layers.Layer) for module in keras_modules())


def is_layer(obj: Any) -> bool:
    """True for a Keras layer or any other ``tf.Module``."""
    return is_keras_layer(obj) or isinstance(obj, tf.Module)


def unwrap(variable: Any) -> Any:
    """The ``tf.Variable`` behind a Keras 3 variable; anything else as it is.

    Keras 3 variables are not ``tf.Variable`` objects: ``tape.watch`` and
    ``tf.autodiff.ForwardAccumulator`` reject them. With the TensorFlow
    backend each one wraps a ``tf.Variable`` that every read goes through, so
    watching that one is watching the Keras variable. This is the one place
    jacobkit unwraps them.
    """
    if isinstance(variable, tf.Variable):
        return variable
    inner = getattr(variable, "_value", None)
    return inner if isinstance(inner, tf.Variable) else variable


def as_tf_variable(variable: Any) -> tf.Variable:
    """The ``tf.Variable`` behind ``variable`` (see :func:`unwrap`); raises
    ``TypeError`` for anything that is not a variable."""
    inner = unwrap(variable)
    if isinstance(inner, tf.Variable):
        return inner
    raise TypeError(
        "jacobian(layer=...): expected a tf.Variable or keras.Variable in the "
        f"list of targets, got {type(variable).__name__}: {variable!r}. Pass a "
        "layer, a layer name, or a list of the model's variables."
    )


def flatten_layers(model: Any, *, recursive: bool = True) -> list[Any]:
    """The layers (or sub-modules) inside ``model``, itself excluded: every
    nested one, or with ``recursive=False`` the ones it holds directly
    (sub-models, wrapped layers, cells). A plain ``tf.Module`` lists its
    ``submodules``; anything else has none."""
    flatten = getattr(model, "_flatten_layers", None)
    if flatten is not None:
        return list(flatten(include_self=False, recursive=recursive))
    if recursive and isinstance(model, tf.Module):
        return list(model.submodules)
    return []
