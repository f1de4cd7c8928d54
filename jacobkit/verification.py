"""``verify``: a cheap check of any result, a few backward passes instead of R.

NOTE (Freivalds' check, and what it can miss). Write the result as a matrix
``J`` of shape ``(R, P)`` (one row per row of the Jacobian, P = parameters of
a target). For a random cotangent ``v`` over the rows, ``v^T J`` is the
gradient of ``sum_r v_r * row_r``: one backward pass computes it directly,
and contracting the result with ``v`` computes it from ``J``. A wrong result
``J' = J + E`` gives a difference ``v^T E``.

*Which cotangents.* Each ``v_r`` is drawn uniformly from the nonzero
integers ``-16..16`` (:data:`COTANGENT_RANGE`), not from a Gaussian: the
backward pass sums the cotangent over every position of the batch (a bias
gradient sums ``B*T`` copies of ``v_f``), and in float32 a Gaussian
cotangent made that sum itself wrong by 8.4e-5 relative on a generator
with B=64, T=128 (every strategy's result "failed" against it), while
small integers sum exactly. With Gaussian ``v`` a wrong ``J`` would be
missed with probability 0 in exact arithmetic; with these integers:

- *In exact arithmetic*, for any ``E != 0`` pick a column ``e`` of ``E``
  and a row ``r`` with ``e_r != 0``; whatever the other entries of ``v``,
  at most one of the 32 values of ``v_r`` makes ``v^T e = 0``. So a probe
  misses with probability at most 1/32, and ``k`` independent probes with
  at most ``32^-k`` (``probes=2``: < 0.1%). Errors that cancel that way
  need several wrong entries in one column with tuned ratios; a single
  wrong element, or a whole wrong row, always gives ``v^T E != 0``
  (``|v_r| >= 1``).
- *With a tolerance* (floating point), an error is seen only where
  ``max |v^T E| > tolerance * max |v^T J|``. One wrong element
  ``E[r, p] = delta`` gives ``|(v^T E)_p| = |v_r| * |delta|`` with
  ``|v_r|`` between 1 and 16: it is always caught when
  ``|delta| > tolerance * max |v^T J|`` and never when it is 16 times
  smaller. ``max |v^T J|`` grows like ``sqrt(R)`` times the largest entry
  of ``J`` times ~10 (the size of ``v``): with the float32 tolerance and
  R = 144, an element wrong by more than ~1.2% of ``J``'s largest entry is
  always caught. Rounding-level errors are not seen at all: this is a
  check for wrong results, not for precision.
- *Relative to the whole result.* The scale ``max |v^T J|`` is the largest
  over every target of the probe, not each target's own: a target whose
  exact Jacobian is zero holds only round-off, which relative to itself is
  100% (keras_hub GPT-2's attention key bias, which the softmax cancels:
  1.5e-9 in float32 against a kernel of 3.4e-2, "wrong" by 1.09 relative to
  its own scale, 4e-8 relative to the result's). The price: an error in a
  target is seen only where it exceeds the tolerance times the largest
  target's scale, so a target far smaller than the others is checked to
  that absolute level, not to its own size.

*Per-example rows of ``Inputs()``/``Output()`` targets* keep only each
example's own block (:mod:`jacobkit.problem.tensor_targets`): row ``(b, k)``
depends on example ``b`` alone, so the ``K`` batch-summed rows' Jacobian holds
every block, ``J[k, b] = block[b, k]``. :func:`verify` puts the blocks back
in that form and checks it against the batch-summed rows, as a strategy's
own result is checked.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import tensorflow as tf

from jacobkit.keras import compat
from jacobkit.problem import Call, Problem
from jacobkit.problem.loss import Loss

#: Tolerances on a worst relative difference, keyed by purpose, then by
#: precision (a ``tf.DType``, or a mixed-precision policy name). One table,
#: the one source of truth for how far a result may be from another
#: computation; one row per purpose, because the two purposes measure
#: different differences and so hold different values:
#:
#: - ``"verify"``: :func:`verify`'s random-cotangent check, ``v^T J`` from the
#:   result against one backward pass. Its backward pass sums up to ``B*T``
#:   products, so it sees more rounding than the result itself: looser.
#: - ``"reference"``: :func:`jacobkit.testing.assert_close`'s floor, every
#:   entry of the result against the float64 reference
#:   (:data:`jacobkit.testing.TOLERANCE` is this row).
TOLERANCES: dict[str, dict[Any, float]] = {
    # verify(): the worst relative difference of v^T J computed two ways, by
    # the result's dtype. Measured (TF 2.21 CPU, probes=2, seed 0) over every
    # strategy configuration x every conformance problem x every ``outputs``
    # mode (560 results each):
    # float32 at most 6.7e-7 (median 2.0e-7); float64 at most 2.1e-15 (median
    # 3.9e-16). The difference grows with the sums in the backward pass: up to
    # 1.6e-6 on the generator with B=64, T=128, D=32, F=144 (``conv1``, three
    # seeds). float32: 1e-4 keeps a margin of 60x there for larger problems (a
    # failed check makes ``structured`` fall back); float64: 1e-10.
    # float16: a ``mixed_float16`` Conv1D -> Dense model (compute float16,
    # float32 results) gave at most 1.3e-3 (loop, chunked, structured): 5e-2.
    # bfloat16 is not measured.
    "verify": {
        tf.float16: 5e-2,
        tf.bfloat16: 1e-1,
        tf.float32: 1e-4,
        tf.float64: 1e-10,
    },
    # assert_close: :func:`jacobkit.testing.max_relative_difference` by the
    # dtype of the result under test, against the float64 reference. Measured
    # over every strategy configuration in ``tests/cases.py`` (``STRATEGIES``)
    # x every problem (``PROBLEMS``) x every ``outputs`` mode (TF 2.21 CPU, Keras 3.15):
    # float32: at most 7.0e-7 (the residual block with the callable ``outputs``;
    # every reverse-mode strategy gives the same 6.99e-7, so it is the float32
    # forward pass, not the strategy); median 1.6e-7. 1e-5 leaves a margin of 14x.
    # float64: at most 6.9e-16 (the residual block, ``per_example``); 1e-12 only
    # guards against a float32 computation slipping in.
    # Reduced precision, measured over ``tests/test_mixed_precision.py`` (every
    # strategy configuration x the generator, cnn2d and mlp examples, against
    # the float64 copy of the model under test; strategies that refuse left out):
    # ``"mixed_float16"`` (float32 results): at most 2.2e-3 (loop and while; batch
    # 1.2e-3); 5e-3 leaves 2.3x. ``"mixed_bfloat16"``: at most 8.6e-3 (while,
    # per_example); 2e-2 leaves 2.3x. float16 layers: at most 2.5e-3 (loop);
    # bfloat16 layers: at most 5.8e-3.
    # bfloat16 on a Conv2D model (cnn2d) depends on the CPU's kernels, measured
    # per instruction set (TF 2.21; ``jacobkit.testing.bfloat16_check`` finds
    # the same figures on a tiny model at first use):
    # - AVX-512 with VNNI/BF16 (AMD EPYC Zen 4; oneDNN on, TensorFlow's default
    #   there): every compiled strategy 3.1e-3 to 7.4e-3; the eager ``loop``
    #   0.31-0.33 (eager ops skip oneDNN's float32 accumulation).
    # - AVX2 only (AMD EPYC Zen 3: 0.31-0.37 reported, 27 failures), and the
    #   same Zen 4 with ``TF_ENABLE_ONEDNN_OPTS=0`` (oneDNN off, as TensorFlow
    #   defaults on a CPU without VNNI/BF16/AMX): every strategy 0.31-0.33,
    #   compiled or not, but ``batch`` under mixed_bfloat16 (6.7e-3: it
    #   contracts in float32). Its kernels round every intermediate gradient to
    #   bfloat16, and cnn2d's gradients cancel.
    # ``tests/test_mixed_precision.py`` holds each strategy to 2x the plain
    # loop's error on the same path (eager, or compiled), and to these floors
    # where that loop is within ``jacobkit.testing.FAR_OFF`` (0.1); where it is
    # not, the test is an expected failure naming the CPU and the figure.
    "reference": {
        tf.float16: 5e-3,
        tf.bfloat16: 2e-2,
        tf.float32: 1e-5,
        tf.float64: 1e-12,
        "mixed_float16": 5e-3,
        "mixed_bfloat16": 2e-2,
    },
}

#: cotangents are drawn from the nonzero integers in ``-16..16`` (see the NOTE)
COTANGENT_RANGE = 16


class VerificationError(AssertionError):
    """A result failed :func:`verify`: it is not the Jacobian of the rows."""


def verify(
    result: Any,
    model: Any,
    inputs: Any,
    layer: Any,
    probes: int = 2,
    *,
    outputs: str | Callable[[Any], tf.Tensor] | Loss = "features",
    features: Sequence[int] | None = None,
    training: bool = False,
    tolerance: float | None = None,
    seed: int = 0,
) -> float:
    """Check a result against ``probes`` backward passes with random cotangents.

    For each probe, a random ``v`` over the rows (shape ``rows_shape``, each
    entry a nonzero integer in ``-16..16``): ``v^T J`` from one backward pass of
    ``sum(v * rows)`` is compared with the same contraction of the result,
    for every target. The cost is one forward and ``probes`` backward
    passes, whatever the number of rows R. See the NOTE in this module for
    the probability of missing an error.

    Args:
        result: a :class:`~jacobkit.JacobianResult` of rows (``reduce=None``),
            or a list of arrays
            (one per target, shape ``rows_shape + v.shape``; for
            per-example or full rows of ``Inputs()``/``Output()`` targets,
            each example's own block, ``rows_shape + v.shape[1:]``).
        model: as given to :func:`jacobkit.jacobian`.
        inputs: as given to :func:`jacobkit.jacobian`.
        layer: as given to :func:`jacobkit.jacobian`: a layer, its name or
            path, a list of variables, ``Inputs()``, ``Inputs("name")`` or
            ``Output("layer")``.
        probes: the number of random cotangents (>= 1).
        outputs: the rows, as given to :func:`jacobkit.jacobian` (they
            must match the result's).
        features: as given to :func:`jacobkit.jacobian`.
        training: as given to :func:`jacobkit.jacobian`. A model that is
            random when ``training=True`` (dropout) gives other rows in the
            check than in the result: it cannot be checked.
        tolerance: the largest relative difference accepted; default: the
            loosest ``TOLERANCES["verify"]`` of the result's, the rows' and the
            target layer's compute dtype.
        seed: seeds the random cotangents.

    Returns:
        The worst relative difference ``max |a - b| / max(|a|, |b|)`` over
        probes and targets (``a`` from the backward pass, ``b`` from the
        result; the maximum in the denominator over every target of the
        probe, see the NOTE).

    Raises:
        VerificationError: the difference exceeds the tolerance (an
            ``AssertionError``).
        ValueError: the result's shapes do not fit the problem, or it is
            reduced (``reduce=``: norms, a clipped sum, a projection) or a
            :func:`jacobkit.gram` result, which are not checked.

    Example:
        >>> import keras, numpy as np, jacobkit as jk
        >>> model = keras.Sequential([keras.Input((4,)),
        ...                           keras.layers.Dense(3, name="head")])
        >>> x = np.ones((2, 4), "float32")
        >>> res = jk.jacobian(model, x, "head", strategy="loop")
        >>> jk.verify(res, model, x, "head") < 1e-4
        True
    """
    _refuse_reduced(result)
    call = Call(
        model,
        layer,
        outputs=outputs,
        features=features,
        training=training,
        unconnected="zero",
    )
    problem = call.problem(inputs)
    # a JacobianResult's are a dict; a float64 reference's a tuple (it is a
    # sequence of its arrays, as a list of arrays is)
    held = getattr(result, "jacobians", None)
    actual = list(held.values()) if isinstance(held, dict) else list(result)
    flat = _flatten(problem, actual)
    return check(problem, flat, probes=probes, tolerance=tolerance, seed=seed)


def _refuse_reduced(result: Any) -> None:
    """Refuse what :func:`verify` does not check: a result reduced by
    ``reduce=`` (its ``reduce`` field) or a :func:`jacobkit.gram` result (its
    ``matrix``). Read by field: both types rank above this module."""
    reduced = getattr(result, "reduce", None)
    if reduced is None and getattr(result, "matrix", None) is None:
        return
    what = (
        f"a result of reduce={reduced!r}"
        if reduced is not None
        else f"a jk.gram result ({type(result).__name__})"
    )
    raise ValueError(
        "verify(result=...): checks rows of Jacobians (a jacobian() result "
        f"with reduce=None, or arrays), got {what}. Norms, clipped sums, "
        "projections and Gram matrices are not checked: verify the rows they "
        "are computed from (the same jacobian() call without reduce=, on a "
        "few examples where they are many)."
    )


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
        shape = tuple(target.shape)
        # per-example rows of a tensor target: each example's own block only
        expected = problem.rows_shape + (shape[1:] if problem.blocked else shape)
        if tuple(jac.shape) != expected:
            blocks = " (own-example blocks)" if problem.blocked else ""
            raise ValueError(
                f"verify(result=...): the Jacobian for {name} has shape "
                f"{tuple(jac.shape)}, but the rows and target give {expected}"
                f"{blocks} (rows_shape {problem.rows_shape}). Pass the outputs= "
                "and features= the result was computed with."
            )
        if problem.blocked:  # (B, K, *block) -> the K summed rows' (K, B, *block)
            batch = problem.rows_shape[0]
            jac = tf.reshape(jac, (batch, problem.num_rows, *shape[1:]))
            jac = tf.transpose(jac, [1, 0, *range(2, len(shape) + 1)])
        flat.append(tf.reshape(jac, (problem.num_rows, *shape)))
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
    shape = (int(probes), problem.num_rows)
    magnitudes = rng.integers(1, COTANGENT_RANGE + 1, size=shape)
    cotangents = magnitudes * rng.choice([-1.0, 1.0], size=shape)
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
        # an embedding table's gradient is IndexedSlices: made dense here
        pairs = [
            (np.asarray(_dense(grad), dtype=np.float64).reshape(-1), v @ matrix)
            for grad, matrix in zip(direct, matrices)
        ]
        # the whole result's scale, not each target's (see the NOTE)
        scale = max(_largest(a, b) for a, b in pairs)
        for i, (a, b) in enumerate(pairs):
            diff = _relative(a, b, scale)
            worst = max(worst, diff)
            tol = (
                tolerance
                if tolerance is not None
                else _default_tolerance(problem, jacobians[i].dtype)
            )
            if not diff <= tol:
                raise VerificationError(
                    f"verify: the Jacobian for {problem.target_names[i]} is "
                    f"wrong: probe {probe} (a random combination of the rows) "
                    f"differs from one backward pass by {diff:.2e} relative "
                    f"to the result's largest value {scale:.2e}, more than "
                    f"the tolerance {tol:.1e}. The result is not the Jacobian "
                    "of these rows (or was computed for other "
                    "outputs=/features=/inputs)."
                )
    del tape
    return worst


def _dense(grad: Any) -> Any:
    """A gradient as a dense tensor (an embedding table's is
    ``tf.IndexedSlices``, which NumPy cannot read)."""
    if isinstance(grad, tf.IndexedSlices):
        return tf.convert_to_tensor(grad)
    return grad


def _default_tolerance(problem: Problem, dtype: Any) -> float:
    """The loosest ``TOLERANCES["verify"]`` of the result's dtype, the rows' dtype
    and the target layer's compute dtype (a mixed-precision layer computes in
    float16 what it stores in float32)."""
    dtypes = {tf.as_dtype(dtype), tf.as_dtype(problem.output_dtype)}
    compute = compat.compute_dtype(problem.layer)
    if compute is not None:
        dtypes.add(tf.as_dtype(compute))
    table = TOLERANCES["verify"]
    return max(table.get(d, table[tf.float32]) for d in dtypes)


def _largest(a: np.ndarray, b: np.ndarray) -> float:
    """``max(max |a|, max |b|)``; 0 for empty arrays."""
    if a.size == 0:
        return 0.0
    return max(float(np.max(np.abs(a))), float(np.max(np.abs(b))))


def _relative(a: np.ndarray, b: np.ndarray, scale: float) -> float:
    """``max |a - b| / scale``; the plain difference where ``scale`` is 0."""
    if a.size == 0:
        return 0.0
    error = float(np.max(np.abs(a - b)))
    return error / scale if scale > 0 else error
