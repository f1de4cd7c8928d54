"""``reduce=``: what each row's gradient is reduced to, one kind per module
(:class:`~jacobkit.problem.reduction.base.Reduction`).

- :mod:`.rows`: ``None``, the Jacobians themselves;
- :mod:`.norms`: ``"norm"``, each row's L2 norm per target;
- :mod:`.clipped_sum`: ``jk.ClippedSum``, DP-SGD's clipped sum;
- :mod:`.project`: ``jk.Project``, each row's gradient by a fixed random map;
- :mod:`.factors`: ``jk.gram``'s per-target factors (internal).

The kinds are found here, module by module (:data:`KINDS`): a new kind is
one module with one final :class:`Reduction` subclass, and strategies,
tests and ``auto`` take it from this table.
"""

from __future__ import annotations

import importlib
import pkgutil

from jacobkit.problem.reduction.base import Computation, Output, Reduction
from jacobkit.problem.reduction.clipped_sum import ClippedSum
from jacobkit.problem.reduction.factors import Factors, Feature, Flat, Ghost, Lookup
from jacobkit.problem.reduction.norms import Norms
from jacobkit.problem.reduction.project import Project
from jacobkit.problem.reduction.rows import Rows


def _kinds() -> dict[str, type[Reduction]]:
    """Every kind defined in this package's modules, by name."""
    found: dict[str, type[Reduction]] = {}
    for module in pkgutil.iter_modules(__path__):
        loaded = importlib.import_module(f"{__name__}.{module.name}")
        for value in vars(loaded).values():
            if (
                isinstance(value, type)
                and issubclass(value, Reduction)
                and value is not Reduction
                and value.__module__ == loaded.__name__
            ):
                if value.name in found:
                    raise TypeError(f"two reduction kinds named {value.name!r}")
                found[value.name] = value
    return found


#: every reduction kind, by name (rows first)
KINDS: dict[str, type[Reduction]] = _kinds()
__all__ = [
    "KINDS",
    "ClippedSum",
    "Computation",
    "Factors",
    "Feature",
    "Flat",
    "Ghost",
    "Lookup",
    "Norms",
    "Output",
    "Project",
    "Reduction",
    "Rows",
]
