"""The one per-model cache: what is found or compiled for a model lives as
long as the model does."""

from __future__ import annotations

import weakref
from typing import Any


def per_model(cache: weakref.WeakKeyDictionary, model: Any) -> dict:
    """``model``'s entry in a cache that lives as long as the model does.

    A model that cannot be weakly referenced gets a fresh, unkept dict (no
    caching): keying it by ``id()`` instead could hand a later object that
    reuses the id a computation built for the old one.
    """
    try:
        return cache.setdefault(model, {})
    except TypeError:
        return {}
