"""A slow, obvious reference, and comparisons, so anyone can check a result.

The reference is written independently of the strategies and of
:mod:`jacobkit.problem`: one eager ``tape.gradient`` per row, with the rows
formed by plain indexing inside the tape. Give it a float64 copy of the model
(same weights) for a reference that float32 strategies can be held to.

- :mod:`~jacobkit.testing.reference`: :func:`reference_jacobian`,
  :func:`float64_reference`, :class:`Reference`,
  :func:`max_relative_difference`, :func:`largest_value`;
- :mod:`~jacobkit.testing.reference_targets`: what the reference
  differentiates, for every ``layer=`` that :func:`jacobkit.jacobian` takes;
- :mod:`~jacobkit.testing.close`: :func:`assert_close`,
  :data:`BASELINE_FACTOR`, :data:`MAX_DERIVED_TOLERANCE`;
- :mod:`~jacobkit.testing.tolerance`: :data:`TOLERANCE`;
- :mod:`~jacobkit.testing.examples`: the built-in example problems;
- :func:`cast_copy`, :func:`float64_copy` (from :mod:`jacobkit.keras.cast`)
  and :func:`verify` (from :mod:`jacobkit.verification`), re-exported;
- :func:`bfloat16_check` and :data:`FAR_OFF`: how far this CPU's bfloat16
  convolution gradients are from float64 (from the strategies' precision
  rules), re-exported.

This package only re-exports; its modules import each other directly.
"""

from __future__ import annotations

from jacobkit.keras.cast import cast_copy, float64_copy
from jacobkit.strategies.precision import FAR_OFF, Bfloat16Check, bfloat16_check
from jacobkit.testing.close import (
    BASELINE_FACTOR,
    MAX_DERIVED_TOLERANCE,
    assert_close,
)
from jacobkit.testing.reference import (
    Reference,
    float64_reference,
    largest_value,
    max_relative_difference,
    reference_jacobian,
    reference_tensor_jacobian,
)
from jacobkit.testing.tolerance import TOLERANCE
from jacobkit.verification import VerificationError, verify

__all__ = [
    "BASELINE_FACTOR",
    "FAR_OFF",
    "MAX_DERIVED_TOLERANCE",
    "Bfloat16Check",
    "TOLERANCE",
    "Reference",
    "VerificationError",
    "assert_close",
    "bfloat16_check",
    "cast_copy",
    "float64_copy",
    "float64_reference",
    "largest_value",
    "max_relative_difference",
    "reference_jacobian",
    "reference_tensor_jacobian",
    "verify",
]
