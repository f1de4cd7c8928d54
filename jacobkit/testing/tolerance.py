"""The tolerance floors results are held to against the float64 reference.

The values (and how they were measured) live in the one tolerance table,
:data:`jacobkit.verification.TOLERANCES`, beside
:func:`jacobkit.verification.verify`'s own
row: that table is below both ``verify`` and this package, so both read it
without an import cycle.
"""

from __future__ import annotations

from typing import Any

import tensorflow as tf

from jacobkit.verification import TOLERANCES

__all__ = ["TOLERANCE", "tolerance_key"]

#: The floor on :func:`jacobkit.testing.max_relative_difference` against the
#: float64 reference, by the result's dtype or by mixed-precision policy name:
#: the ``"reference"`` row of :data:`jacobkit.verification.TOLERANCES`.
TOLERANCE: dict[Any, float] = TOLERANCES["reference"]


def tolerance_key(precision: Any) -> Any:
    """The key of ``precision`` in :data:`TOLERANCE`: a policy name as is; a
    dtype (or its name) as a ``tf.DType``."""
    return precision if precision in TOLERANCE else tf.as_dtype(precision)
