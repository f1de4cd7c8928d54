"""The ``batch`` strategy's closed form of each reduction kind, one module
per kind: each module names its kind (``KIND``) and contracts every row's
cotangents at the taps' ``z`` with the tapped inputs into that kind's
result (``contract``). The modules are found here: a kind's closed form is
one module, and ``batch`` computes natively exactly the kinds found."""

from __future__ import annotations

import importlib
import pkgutil
from collections.abc import Callable
from typing import Any

from jacobkit.strategies.batch.contract import Cotangents, Taps

#: ``(problem, taps, cotangents, *, summed) -> the kind's values or Output``
Contract = Callable[..., Any]


def _forms() -> dict[str, Contract]:
    found: dict[str, Contract] = {}
    for module in pkgutil.iter_modules(__path__):
        loaded = importlib.import_module(f"{__name__}.{module.name}")
        found[loaded.KIND.name] = loaded.contract
    return found


#: each kind's closed form, by the kind's name
FORMS: dict[str, Contract] = _forms()

__all__ = ["FORMS", "Contract", "Cotangents", "Taps"]
