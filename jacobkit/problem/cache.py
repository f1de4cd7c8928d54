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
"""

from __future__ import annotations

import threading
import weakref
from typing import Any, final


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
