"""A ``tf.function`` whose steady eager calls skip its dispatch.

A ``tf.function`` called eagerly binds its arguments to its signature, builds
their trace types and looks them up among its traces on every call: 0.2-0.4 ms
of a steady ``jacobian`` call on the reductions benchmark's conv net (whose
compiled step is ~6 ms). :class:`Dispatched` keeps, per input signature it has
traced (the nesting, shape and dtype of its tensor arguments), the traced
concrete function, and calls that directly; its binding of the same tensors
to the same trace costs a fifth of it. Everything else (a call inside a
trace, under a ``tf.distribute`` strategy, with keyword or non-tensor
arguments, a new signature) goes to the ``tf.function`` as it is.
"""

from __future__ import annotations

from collections.abc import Hashable
from typing import Any

import tensorflow as tf


class Dispatched:
    """``function`` (a ``tf.function``), its eager calls on a signature it has
    traced run by that trace's concrete function. Its other attributes
    (``get_concrete_function``, ``experimental_get_tracing_count``, ...) are
    ``function``'s."""

    def __init__(self, function: Any) -> None:
        self.function = function
        self._traced: dict[Hashable, Any] = {}

    def __getattr__(self, name: str) -> Any:
        return getattr(self.function, name)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if kwargs or not tf.executing_eagerly() or tf.distribute.has_strategy():
            return self.function(*args, **kwargs)
        key = signature(args)
        traced = None if key is None else self._traced.get(key)
        if traced is not None:
            return traced(*args)
        output = self.function(*args)
        if key is not None:  # traced now, or before: the lookup is cheap
            self._traced[key] = self.function.get_concrete_function(*args)
        return output


def signature(value: Any) -> Hashable | None:
    """The nesting, shapes and dtypes of ``value``'s tensors (tuples, lists
    and dicts of eager ``tf.Tensor``), hashable; ``None`` where any leaf is
    not a tensor (a variable, an array, a Python number: the ``tf.function``
    decides how those trace)."""
    if isinstance(value, tf.Tensor):
        return (tuple(value.shape), value.dtype)
    if isinstance(value, (tuple, list)):
        found = tuple(signature(v) for v in value)
        return None if None in found else (type(value), found)
    if isinstance(value, dict):
        keys = sorted(value)
        found = tuple(signature(value[k]) for k in keys)
        return None if None in found else (dict, tuple(keys), found)
    return None
