"""Per-model state, in one place: what jacobkit finds, compiles or learns
for a model lives as long as the model does, and nowhere else.

Every kind of per-model state is a :class:`Slot`, and its values live in one
weak mapping, model -> slot -> ``{key: value}``
(:func:`model_state`). Nothing is stored on the model itself (jacobkit never
sets an attribute of the user's objects), and a model that is garbage
collected takes its state with it: a compiled function closes over the
model, so a cache keyed any other way would keep every model alive.
"""

from __future__ import annotations

import enum
import threading
import weakref
from typing import Any


class Slot(enum.Enum):
    """The kinds of per-model state (the value says who keeps what)."""

    COMPILED = "strategies: each strategy's compiled computation per problem"
    FLAT = "strategies.base: a computation's output flattened, for replicas"
    PRODUCTS = "reductions.features: a Gram's factors and their products"
    GRAM_CHUNKS = "reductions.grams: a Gram's examples per chunk"
    CHECKS = "strategies.batch.checks: batch's numeric checks' verdicts"
    INSPECTED = "problem.inspect: the one traced pass per problem signature"
    STRUCTURE = "problem.structure: the exact shortcut found, or why none"
    HEADS = "problem.structure: the linear head found at any width"
    VERIFIED = "strategies.structured: the first call's check per problem"
    DELTAS = "problem.tensor_targets: an Output() target's compiled tap"
    OUTPUT_SPECS = "problem.tensor_targets: an Output() target's shape"
    INDEPENDENT = "problem.tensor_targets: whether examples are independent"
    SESSIONS = "planner.Auto: its planning sessions and norm choices"
    CAM_FORWARD = "explain.cam: Grad-CAM's compiled forward pass"
    TARGET_KEYS = "problem.targets: the result keys of each set of target variables"


#: model -> {slot: {key: value}}; the one module-level per-model cache
_STATE: weakref.WeakKeyDictionary[Any, dict[Slot, dict[Any, Any]]] = (
    weakref.WeakKeyDictionary()
)
_LOCK = threading.Lock()


def model_state(model: Any, slot: Slot) -> dict[Any, Any]:
    """``model``'s entry in ``slot``: a dict that lives as long as the model.

    A model that cannot be weakly referenced gets a fresh, unkept dict (no
    caching): keying it by ``id()`` instead could hand a later object that
    reuses the id a computation built for the old one.
    """
    with _LOCK:
        try:
            slots = _STATE.setdefault(model, {})
        except TypeError:
            return {}
        return slots.setdefault(slot, {})
