"""Per-model state, kept by its owner: what jacobkit finds, compiles or learns
for a model lives as long as the model does, and nowhere else.

Each module that keeps something per model declares its own slot once, at
module level, under a private name that says what it keeps::

    _COMPILED = PerModel("each strategy's compiled computation per problem")

and reads it only there (``_COMPILED.of(model)``: a dict that lives as long as
the model), keyed by the problem's one identity,
:class:`~jacobkit.problem.key.ProblemKey`, and whatever else that owner's
values depend on. A module keeping two kinds of things declares two slots;
no slot is handed to another module (``tests/test_architecture.py`` checks
both).

Nothing is stored on the model itself (jacobkit never sets an attribute of
the user's objects), and a model that is garbage collected takes its state
with it: a compiled function closes over the model, so a cache keyed any
other way would keep every model alive.

:class:`Dispatched` keeps the other thing a steady call reuses: a compiled
computation's traces, per input signature, called without
``tf.function``'s dispatch.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable, Hashable
from typing import Any, final

import tensorflow as tf

from jacobkit.keras import state


@final
class PerModel:
    """One owner's per-model state: model -> ``{key: value}``, weakly keyed
    by the model, safe to use from several threads.

    Attributes:
        what: what the owner keeps, and why (shown in its ``repr``).
    """

    __slots__ = ("what", "_lock", "_models")

    def __init__(self, what: str) -> None:
        self.what = what
        self._lock = threading.Lock()
        self._models: weakref.WeakKeyDictionary[Any, dict[Any, Any]] = (
            weakref.WeakKeyDictionary()
        )

    def of(self, model: Any) -> dict[Any, Any]:
        """``model``'s entry: a dict that lives as long as the model.

        A model that cannot be weakly referenced gets a fresh, unkept dict (no
        caching): keying it by ``id()`` instead could hand a later object that
        reuses the id a computation built for the old one.
        """
        with self._lock:
            try:
                return self._models.setdefault(model, {})
            except TypeError:
                return {}

    def __repr__(self) -> str:
        return f"PerModel({self.what!r})"


def dispatched(function: Any) -> Any:
    """``function`` (:func:`jacobkit.keras.state.function`'s) as a
    :class:`Dispatched`; a computation that returns its passes' assignments
    (``training=True``: a :class:`~jacobkit.keras.state.Compiled`) as it
    is, its collector called on every call."""
    return function if isinstance(function, state.Compiled) else Dispatched(function)


class Dispatched:
    """``function`` (a ``tf.function``), its eager calls on a signature it has
    traced run by that trace's concrete function. Its other attributes
    (``get_concrete_function``, ``experimental_get_tracing_count``, ...) are
    ``function``'s.

    NOTE (measured). A ``tf.function`` called eagerly binds its arguments to
    its signature, builds their trace types and looks them up among its
    traces on every call: 0.15-0.4 ms of a steady call (the reductions
    benchmark's conv net, whose compiled step is ~6 ms); the concrete
    function's flat call of the same tensors costs a sixth of it. A call
    inside a trace, under a ``tf.distribute`` strategy, with keyword or
    non-tensor arguments, or on a new signature goes to the ``tf.function``
    as it is (which traces it: the next call on it is direct)."""

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
            self._traced[key] = _direct(
                self.function.get_concrete_function(*args), args
            )
        return output


def _direct(concrete: Any, args: tuple[Any, ...]) -> Callable[..., Any]:
    """``concrete``'s call on arguments of ``args``' signature: its flat call
    on the flattened tensors and its captures (what its own call reaches
    after binding them to its signature again: half of its Python), where
    its flat inputs are those tensors in that order; else its own call."""
    call = getattr(concrete, "_call_flat", None)
    specs = tf.nest.flatten(concrete.structured_input_signature[0])
    flat = tf.nest.flatten(args)
    if call is None or len(specs) != len(flat):
        return concrete
    for spec, tensor in zip(specs, flat, strict=True):
        if not isinstance(spec, tf.TensorSpec) or not spec.is_compatible_with(tensor):
            return concrete
    return lambda *a: call(tf.nest.flatten(a), concrete.captured_inputs)


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
