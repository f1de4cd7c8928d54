"""Whether a result is close enough to a reference: :func:`assert_close`."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from jacobkit.testing.reference import max_relative_difference
from jacobkit.testing.tolerance import TOLERANCE, tolerance_key

__all__ = ["BASELINE_FACTOR", "assert_close"]

#: A derived tolerance is this many times the error of the obvious loop at
#: the model's own precision (see :func:`assert_close`).
BASELINE_FACTOR = 2.0


def assert_close(
    result: Any,
    reference: Sequence[Any],
    *,
    tolerance: float | None = None,
    precision: str | None = None,
) -> float:
    """Assert each Jacobian in ``result`` (a :class:`JacobianResult` or a list)
    is within tolerance of ``reference`` in :func:`max_relative_difference`.

    The tolerance, per target:

    - ``tolerance`` if given;
    - else, for a :class:`~jacobkit.testing.reference.Reference` from
      :func:`~jacobkit.testing.reference.float64_reference`:
      ``max(floor, BASELINE_FACTOR × the obvious loop's own error)``, so a
      model whose float32 forward pass is itself far from float64 (deep,
      nested, wide) gets a tolerance it can meet, and a small one keeps a
      tight one. Measured on the nested and deep models of
      ``tests/test_reference.py``, every strategy is within 1.2x of the
      loop's own error (float32) or refuses (float16, see
      :mod:`jacobkit.strategies._precision`), which ``BASELINE_FACTOR = 2`` covers. The
      derived tolerance is only as tight as that loop: under bfloat16 on CPU
      the eager loop can be far off (0.33 on a Conv2D model, see
      :data:`TOLERANCE`), so pass ``precision=`` with a plain list of arrays
      there;
    - else the floor: :data:`TOLERANCE` for ``precision`` if given
      (``"mixed_float16"``, ``"mixed_bfloat16"``), else for the result's dtype.

    Returns the largest difference found.
    """
    actual = (
        list(result.jacobians.values())
        if hasattr(result, "jacobians")
        else list(result)
    )
    if len(actual) != len(reference):
        raise AssertionError(
            f"{len(actual)} Jacobians to compare with {len(reference)} references"
        )
    baseline = getattr(reference, "baseline_errors", None)
    worst = 0.0
    for i, (a, e) in enumerate(zip(actual, reference, strict=True)):
        floor = TOLERANCE[tolerance_key(precision or a.dtype)]
        tol, why = floor, "the floor for this precision"
        if tolerance is not None:
            tol, why = tolerance, "given"
        elif baseline is not None and BASELINE_FACTOR * baseline[i] > floor:
            tol = BASELINE_FACTOR * baseline[i]
            why = (
                f"{BASELINE_FACTOR:g} x the obvious loop's own error {baseline[i]:.1e}"
            )
        diff = max_relative_difference(a, e)
        worst = max(worst, diff)
        if not diff <= tol:
            raise AssertionError(
                f"Jacobian {i} differs from the reference: max relative "
                f"difference {diff:.3e} > tolerance {tol:.1e} ({why})"
            )
    return worst
