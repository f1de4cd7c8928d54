"""``tf.function`` for jacobkit's computations, with AutoGraph only where the
model's own code needs it.

NOTE (why AutoGraph is off for Keras 3 models). AutoGraph rewrites the Python
source of every function a traced computation calls that is not on its
do-not-convert list, jacobkit's own included: measured on the MLP of the auto
benchmark (2-core CPU, TensorFlow 2.21), converting jacobkit's functions took
1.2 s of a 2.4-3.3 s first call, while tracing the model itself took 0.04 s.
jacobkit's computations need none of it: their loops and conditions are
TensorFlow ops (``tf.while_loop``, ``tf.map_fn``, ``tf.vectorized_map``) or
Python over static values. What the model computes does not change either
for a Keras 3 model: the ``keras`` package is on AutoGraph's do-not-convert
list and Keras 3 does not convert layers itself, so a Keras 3 model's code runs
as written with AutoGraph on or off (checked: a subclassed layer with a Python
``if`` on a tensor fails the same way under both). A ``tf_keras`` model
converts its subclassed layers' ``call`` only while AutoGraph is on, and a
plain callable ``f(x)`` is converted by it: those keep AutoGraph, and their
first call keeps its cost.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

import tensorflow as tf


def needs_autograph(model: Any) -> bool:
    """False for a Keras 3 layer or model, whose code AutoGraph never
    converts; True otherwise (see the NOTE in this module)."""
    keras = sys.modules.get("keras")
    if keras is None or not getattr(keras, "__version__", "").startswith("3"):
        return True
    return not isinstance(model, keras.layers.Layer)


def function(model: Any, fn: Callable[..., Any]) -> Any:
    """``tf.function(fn)`` for a computation that calls ``model``, with
    AutoGraph only where ``model`` needs it."""
    return tf.function(fn, autograph=needs_autograph(model))
