"""``verify``: a cheap check of any result, a few backward passes instead of R.

NOTE (Freivalds' check, and what it can miss). Write the result as a matrix
``J`` of shape ``(R, P)`` (one row per row of the Jacobian, P = parameters of
a target). For a random cotangent ``v`` over the rows, ``v^T J`` is the
gradient of ``sum_r v_r * row_r``: one backward pass computes it directly,
and contracting the result with ``v`` computes it from ``J``. A wrong result
``J' = J + E`` gives a difference ``v^T E``. With ``v`` standard Gaussian,
``v^T E`` is Gaussian with covariance ``E^T E``, so for ``E != 0`` it is
nonzero with probability 1: in exact arithmetic no error is missed.

In floating point the check compares with a tolerance, so an error is seen
only when ``max |v^T E|`` exceeds ``tolerance * max |v^T J|``. Take one wrong
element, ``E[r, p] = delta``: then ``(v^T E)_p = v_r * delta`` and the check
misses it when ``|v_r| < a``, ``a = tolerance * max|v^T J| / |delta|``, which
has probability ``P(|N(0, 1)| < a) <= a * sqrt(2 / pi)`` per probe, and at
most ``(0.8 * a)^k`` over ``k`` independent probes. ``max |v^T J|`` grows
like ``sqrt(R)`` times a typical row's largest entry, so with the float32
tolerance (:data:`TOLERANCE`) and R = 144 an element wrong by 1% of the
largest entry has ``a ~ 1e-4 * 12 / 1e-2 = 0.12`` and is missed with
probability below ``0.1^2 = 1%`` at ``probes=2``. A whole wrong row (a
transposed, shifted or zeroed row) has ``|delta| ~ max|J|`` in many
elements at once and is caught with probability indistinguishable from 1.
Errors below ``tolerance * max |v^T J|`` in size (rounding-level errors) are
not seen at all: this is a check for wrong results, not for precision.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import tensorflow as tf

from jacobkit.problem import Problem

#: Default tolerances on the worst relative difference, by the result's dtype.
#: Measured (TF 2.21 CPU, probes=2, seed 0) over every strategy configuration
#: x every conformance problem x every ``outputs`` mode (560 results each):
#: float32 at most 6.9e-7 (median 1.8e-7); float64 at most 1.5e-15 (median
#: 3e-16). The difference grows with the size of the sums in the backward
#: pass: 2.5e-6 on a generator with B=8, T=32, 32 features. float32: 1e-4
#: leaves room for larger problems (see the NOTE for what it can miss);
#: float64: 1e-10. float16/bfloat16 are not measured.
TOLERANCE = {tf.float16: 5e-2, tf.bfloat16: 1e-1, tf.float32: 1e-4, tf.float64: 1e-10}


class VerificationError(AssertionError):
    """A result failed :func:`verify`: it is not the Jacobian of the rows."""


def verify(
    result: Any,
    model: Any,
    inputs: Any,
    layer: Any,
    probes: int = 2,
    *,
    outputs: str | Callable[[Any], tf.Tensor] = "features",
    features: Sequence[int] | None = None,
    training: bool = False,
    tolerance: float | None = None,
    seed: int = 0,
) -> float:
    """Check a result against ``probes`` backward passes with random cotangents.

    For each probe, a standard Gaussian ``v`` over the rows (shape
    ``rows_shape``): ``v^T J`` from one backward pass of
    ``sum(v * rows)`` is compared with the same contraction of the result,
    for every target. The cost is one forward and ``probes`` backward
    passes, whatever the number of rows R. See the NOTE in this module for
    the probability of missing an error.

    Args:
        result: a :class:`~jacobkit.JacobianResult`, or a list of arrays
            (one per target, shape ``rows_shape + v.shape``).
        model, inputs, layer: as given to :func:`jacobkit.jacobian`.
        probes: the number of random cotangents (>= 1).
        outputs, features, training: the rows, as given to
            :func:`jacobkit.jacobian` (they must match the result's).
        tolerance: the largest relative difference accepted; default by
            the result's dtype (:data:`TOLERANCE`).
        seed: seeds the random cotangents.

    Returns:
        The worst relative difference ``max |a - b| / max(|a|, |b|)`` over
        probes and targets (``a`` from the backward pass, ``b`` from the
        result).

    Raises:
        VerificationError: the difference exceeds the tolerance (an
            ``AssertionError``).
        ValueError: the result's shapes do not fit the problem.

    Example:
        >>> import keras, numpy as np, jacobkit as jk
        >>> model = keras.Sequential([keras.Input((4,)),
        ...                           keras.layers.Dense(3, name="head")])
        >>> x = np.ones((2, 4), "float32")
        >>> res = jk.jacobian(model, x, "head", strategy="loop")
        >>> jk.verify(res, model, x, "head") < 1e-4
        True
    """
    problem = Problem(
        model,
        inputs,
        layer,
        outputs=outputs,
        features=features,
        training=training,
        unconnected="zero",
    )
    actual = (
        list(result.jacobians.values())
        if hasattr(result, "jacobians")
        else list(result)
    )
    flat = _flatten(problem, actual)
    return check(problem, flat, probes=probes, tolerance=tolerance, seed=seed)


def _flatten(problem: Problem, jacobians: list[Any]) -> list[tf.Tensor]:
    """The result's Jacobians as ``(R, *v.shape)``, after checking shapes."""
    if len(jacobians) != len(problem.targets):
        raise ValueError(
            f"verify(result=...): the result has {len(jacobians)} Jacobian(s) "
            f"but layer= gives {len(problem.targets)} target(s) "
            f"({', '.join(problem.target_names)}). Pass the layer the result "
            "was computed for."
        )
    flat = []
    for jac, target, name in zip(jacobians, problem.targets, problem.target_names):
        expected = problem.rows_shape + tuple(target.shape)
        if tuple(jac.shape) != expected:
            raise ValueError(
                f"verify(result=...): the Jacobian for {name} has shape "
                f"{tuple(jac.shape)}, but the rows and target give {expected} "
                f"(rows_shape {problem.rows_shape}). Pass the outputs= and "
                "features= the result was computed with."
            )
        flat.append(tf.reshape(jac, (problem.num_rows, *target.shape)))
    return flat


def check(
    problem: Problem,
    jacobians: list[Any],
    *,
    probes: int = 2,
    tolerance: float | None = None,
    seed: int = 0,
) -> float:
    """:func:`verify` on a resolved problem and flat ``(R, *v.shape)``
    Jacobians (what strategies return). Raises :class:`VerificationError`."""
    if isinstance(probes, bool) or not isinstance(probes, (int, np.integer)):
        raise TypeError(f"verify(probes={probes!r}): expected an int >= 1.")
    if probes < 1:
        raise ValueError(
            f"verify(probes={probes}): need at least one probe; 2 is the default."
        )
    rng = np.random.default_rng(seed)
    cotangents = rng.standard_normal((int(probes), problem.num_rows))
    targets = problem.targets
    with tf.GradientTape(persistent=True, watch_accessed_variables=False) as tape:
        tape.watch(targets)
        rows = problem.rows(problem.inputs)
    matrices = [
        np.asarray(jac, dtype=np.float64).reshape(problem.num_rows, -1)
        for jac in jacobians
    ]
    worst = 0.0
    for probe, v in enumerate(cotangents):
        direct = tape.gradient(
            rows,
            targets,
            output_gradients=tf.constant(v, dtype=rows.dtype),
            unconnected_gradients=tf.UnconnectedGradients.ZERO,
        )
        for i, (grad, matrix) in enumerate(zip(direct, matrices)):
            a = np.asarray(grad, dtype=np.float64).reshape(-1)
            b = v @ matrix
            diff = _relative(a, b)
            worst = max(worst, diff)
            tol = (
                tolerance
                if tolerance is not None
                else TOLERANCE[tf.as_dtype(jacobians[i].dtype)]
            )
            if not diff <= tol:
                raise VerificationError(
                    f"verify: the Jacobian for {problem.target_names[i]} is "
                    f"wrong: probe {probe} (a random combination of the rows) "
                    f"differs from one backward pass by {diff:.2e} relative, "
                    f"more than the tolerance {tol:.1e}. The result is not "
                    "the Jacobian of these rows (or was computed for other "
                    "outputs=/features=/inputs)."
                )
    del tape
    return worst


def _relative(a: np.ndarray, b: np.ndarray) -> float:
    """``max |a - b| / max(max |a|, max |b|)``; 0 when both are zero."""
    if a.size == 0:
        return 0.0
    scale = max(float(np.max(np.abs(a))), float(np.max(np.abs(b))))
    error = float(np.max(np.abs(a - b)))
    return error / scale if scale > 0 else error
