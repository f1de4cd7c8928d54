"""Integrated gradients' completeness gap: how far each row's attributions
miss what they must add up to.

Integrated gradients are complete: row ``r``'s attributions sum to ``f_r(x)
- f_r(x0)``, the row's change from the baseline ``x0`` to the input ``x``,
exactly for the integral, up to the quadrature's error for ``steps`` points.
The gap ``sum(attributions) - (f(x) - f(x0))`` is that error, per row: the
same number as captum's convergence delta
(``IntegratedGradients.attribute(..., return_convergence_delta=True)``:
``attributions.sum() - (f(input) - f(baseline))``, signed).

A row's gap is *large* above :data:`GAP_SHARE` (5%) of its ``|f(x) -
f(x0)|``: the bound Sundararajan et al. (2017, section 5) give for a good
approximation ("within 5%", reached with 20 to 300 steps). A row whose
change is below :data:`FLOOR_SHARE` (1%) of the largest row's in the call
is judged against that floor instead: its own change is too small to judge
by (a class the input hardly moves), and relative to it any gap is large.

The gap shrinks as ``steps`` grows: about as ``1 / steps`` with the mean of
the path's points (``rule="riemann"``), as ``1 / steps^2`` with the
trapezoid rule where the gradient is smooth along the path, faster still
with Gauss-Legendre's points (the default), exact for a gradient polynomial
of degree ``2 steps - 1`` along the path; neither of those two
evaluates the gradient at an end, where a ReLU network's can be degenerate
(at a zero baseline with zero biases every unit sits at its kink). Where it
does
not shrink, the path crosses a region where the model is steep: a zero
embedding into an RMS normalization (``x / sqrt(mean(x^2) + eps)``, whose
gradient at 0 is ``1 / sqrt(eps)``) is one; another baseline helps there.
"""

from __future__ import annotations

import warnings

import numpy as np

from jacobkit import runtime

#: a row's gap is large above this share of its ``|f(x) - f(x0)|``
GAP_SHARE = 0.05
#: rows whose ``|f(x) - f(x0)|`` is below this share of the call's largest
#: are judged against that share of the largest instead
FLOOR_SHARE = 0.01


class CompletenessWarning(UserWarning):
    """Integrated gradients whose attributions miss ``f(x) - f(x0)`` by more
    than :data:`GAP_SHARE` of it on some row (silence it with
    ``warnings.filterwarnings("ignore", category=CompletenessWarning)``)."""


def gap_of(attributed: np.ndarray, change: np.ndarray) -> np.ndarray:
    """``attributed - change``: every row's attributions summed, minus its
    ``f(x) - f(x0)`` (both ``(B, rows)``; float64)."""
    return np.asarray(attributed, np.float64) - np.asarray(change, np.float64)


def relative_gaps(gap: np.ndarray, change: np.ndarray) -> np.ndarray:
    """``|gap| / max(|change|, FLOOR_SHARE * max |change|)`` per row
    (``(B, rows)``); 0 where every change and gap is 0."""
    size = np.abs(np.asarray(change, np.float64))
    floor = FLOOR_SHARE * (float(size.max()) if size.size else 0.0)
    scale = np.maximum(size, floor)
    magnitude = np.abs(gap)
    with np.errstate(divide="ignore", invalid="ignore"):
        ratio = np.where(scale > 0, magnitude / np.where(scale > 0, scale, 1.0), 0.0)
    return np.where((scale == 0) & (magnitude > 0), np.inf, ratio)


def warn_if_large(
    call: str, gap: np.ndarray, change: np.ndarray, *, steps: int, hint: str
) -> None:
    """Warn (:class:`CompletenessWarning`) where a row's gap is above
    :data:`GAP_SHARE` of its change (see the module docstring); ``hint``
    names what else to try (a baseline)."""
    ratio = relative_gaps(gap, change)
    if not ratio.size:
        return
    finite = np.isfinite(gap).all() and np.isfinite(change).all()
    large = ~(ratio <= GAP_SHARE)  # NaN counts as large
    if finite and not large.any():
        return
    worst = np.unravel_index(
        int(np.nanargmax(np.where(np.isnan(ratio), np.inf, ratio))), ratio.shape
    )
    where = "[" + ", ".join(str(int(i)) for i in worst) + "]"
    warnings.warn(
        f"{call}: the attributions of {int(large.sum())} of {ratio.size} rows "
        f"miss f(x) - f(baseline) by more than {GAP_SHARE:.0%} of it (the "
        f"completeness gap; worst: row {where}, gap {float(gap[worst]):.3g} "
        f"against f(x) - f(baseline) = {float(change[worst]):.3g}). The "
        f"integral is approximated with steps={steps}: more steps shrink the "
        f"gap (rule='riemann' about as 1/steps, 'trapezoid' as 1/steps^2, "
        f"'gauss_legendre' faster on a smooth path); if it does not shrink, "
        f"the path runs through a steep region: "
        f"{hint} The gap is in the result's .gap.",
        CompletenessWarning,
        stacklevel=runtime.caller_stacklevel(),
    )
