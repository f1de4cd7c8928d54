"""Reduced precision: where a strategy cannot keep the loop's accuracy.

NOTE (why vectorized reverse mode refuses float16). A layer that computes in
float16 (``mixed_float16``, or ``dtype="float16"``) has its weight gradient
summed over the batch (and over positions, for a convolution) by ops such as
``BiasAddGrad``, whose kernels accumulate float16 in float32 and round once.
The ``loop`` and ``while`` strategies run those kernels. TensorFlow's
vectorization (pfor), which ``jacobian``, ``chunked`` and ``batch``'s
contraction use, rewrites ``BiasAddGrad`` as a ``reduce_sum`` over a middle
axis, and TensorFlow's CPU kernel for that sums float16 in float16.
Measured (TF 2.21 CPU, ``mixed_float16``, Conv2D(relu) →
GlobalAveragePooling → Dense(softmax), relative to the float64 reference),
bias Jacobian: on a ``(4, 8, 8, 3)`` batch 5.5e-04 for the loop and
3.0e-03 for ``chunked``/``jacobian``; on ``(8, 32, 32, 3)`` 5.6e-04 for the
loop, ``while`` and 4.6e-04 for ``batch``, 8.2e-02 for ``chunked`` and
``jacobian`` (:data:`MEASURED`). So ``jacobian`` and ``chunked`` refuse a
target layer that computes in float16, and ``batch`` one whose variables
are float16 (under ``mixed_float16`` the variables are float32 and its
contraction runs in float32, which keeps the loop's accuracy).

bfloat16 is allowed: there the loop's own kernels accumulate in bfloat16 as
well (measured: a Conv2D bias 3.8e-02 for the eager loop, 7.1e-03 for every
vectorized strategy), so no strategy is further from float32 than the loop.
How far bfloat16 convolution gradients are from float64 depends on the CPU:
with oneDNN (on by default where the CPU has VNNI, BF16 or AMX) compiled
gradients keep float32 accumulators and round once; without it (AVX2-only
CPUs) TensorFlow's kernels round every intermediate gradient to bfloat16,
and a small Conv2D model's Jacobian ends 0.32 from float64 whatever the
strategy (:data:`MEASURED_BFLOAT16`). :func:`warn_if_bfloat16_far_off` says
so once per process.

Measured on CPU only. TensorFlow's GPU reductions may accumulate float16 in
float32, which would make the refusal unneeded there (not measured yet).
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Any

import numpy as np
import tensorflow as tf

from jacobkit import runtime
from jacobkit.keras import compat
from jacobkit.strategies import vectorize

#: relative errors to the float32-weights result, measured as in the NOTE
MEASURED = {
    "Conv2D bias, batch (4, 8, 8, 3)": {"loop": 5.5e-4, "chunked": 3.0e-3},
    "Conv2D bias, batch (8, 32, 32, 3)": {
        "loop": 5.6e-4,
        "while": 5.6e-4,
        "batch": 4.6e-4,
        "chunked": 8.2e-2,
    },
}


def gradient_dtype(problem: Any) -> tf.DType:
    """The dtype the targets' gradients are computed in: the target layer's
    compute dtype (``float16`` under ``mixed_float16``); for a list of
    variables, the lowest compute dtype of the Keras layers that own them,
    else of the variables themselves."""
    compute = compat.compute_dtype(problem.layer)
    if compute is not None:
        return tf.as_dtype(compute)
    dtypes = [t.dtype for t in problem.targets]
    targets = {id(t) for t in problem.targets}
    for owner in compat.flatten_layers(problem.model):
        owned = [compat.unwrap(w) for w in compat.weights(owner)]
        compute = compat.compute_dtype(owner)
        if compute is not None and any(id(w) in targets for w in owned):
            dtypes.append(tf.as_dtype(compute))
    return min(dtypes, key=lambda d: d.size)


def refuse_float16_vectorized(problem: Any, name: str) -> None:
    """Raise for a vectorized reverse-mode strategy ``name`` on a target layer
    that computes in float16 (see the NOTE above)."""
    if gradient_dtype(problem) != tf.float16:
        return
    raise ValueError(
        f"jacobian(strategy={name!r}): {_what(problem)} computes in float16 "
        "(mixed precision). Vectorized gradients sum its weight gradient over "
        "the batch in float16, where the loop sums in float32: measured "
        "8.2e-02 from the float32 result on a Conv2D bias, against 5.6e-04 "
        "for the loop. Use strategy='batch' (Dense and Conv "
        "layers; it contracts in float32) or 'while' (the loop's accuracy), or "
        "give that layer dtype='float32'."
    )


def refuse_float16_variables(problem: Any, name: str) -> None:
    """Raise for ``name`` (``batch``) when a target variable is float16: its
    contraction would run in float16 (see the NOTE above)."""
    if not any(t.dtype == tf.float16 for t in problem.targets):
        return
    raise ValueError(
        f"jacobian(strategy={name!r}): {_what(problem)} stores its variables in "
        "float16, so the contraction would sum over the batch in float16, "
        "where the loop sums in float32. Use strategy='while' (the loop's "
        "accuracy), or mixed precision (dtype='mixed_float16': float32 "
        "variables) for that layer."
    )


def _what(problem: Any) -> str:
    if problem.layer is None:
        return "the target"
    return f"layer {problem.layer.name!r}"


# -- bfloat16 on this CPU -----------------------------------------------------
#: a bfloat16 Jacobian this far from float64 (max relative difference) is
#: "far off": :func:`warn_if_bfloat16_far_off` says so once per process
FAR_OFF = 0.1


#: :func:`bfloat16_check` as measured (TF 2.21, 2-core AMD EPYC with
#: avx2 avx512f avx512_vnni avx512_bf16; oneDNN off is what TensorFlow picks
#: by default on a CPU without VNNI/BF16/AMX, such as an AVX2-only EPYC)
MEASURED_BFLOAT16 = {
    "oneDNN on": {"compiled": 4.3e-3, "eager": 0.33},
    "oneDNN off": {"compiled": 0.32, "eager": 0.32},
}


class PrecisionWarning(UserWarning):
    """This CPU's kernels compute a target's gradients far from float64."""


@dataclass(frozen=True)
class Bfloat16Check:
    """How far this CPU's bfloat16 kernels put a small Conv2D model's
    Jacobian from float64 (:func:`bfloat16_check`).

    Attributes:
        compiled: max relative difference of the Jacobian computed in a
            ``tf.function`` (every strategy but ``loop``).
        eager: the same, one eager ``tape.gradient`` per row (``loop``).
        cpu: the CPU, its instruction sets and whether oneDNN is on.
    """

    compiled: float
    eager: float
    cpu: str


def bfloat16_check() -> Bfloat16Check:
    """Measure this CPU's bfloat16 convolution gradients, once per process
    (about 0.3 s): the Jacobian of ``examples.cnn2d`` (Conv2D → Conv2D →
    Dense → Dense, batch 2 of 8×7 images) with respect to its first Conv2D's
    kernel and bias, in bfloat16, against float64 on the same rounded weights
    and inputs. See :data:`MEASURED_BFLOAT16` for what it found."""
    return runtime.measured_once("bfloat16 check", _measure_bfloat16)


def _measure_bfloat16() -> Bfloat16Check:
    inputs, weights = _cnn2d_values()

    def as_dtype(dtype: tf.DType) -> tuple[tf.Tensor, list[tf.Tensor]]:
        rounded = [tf.constant(w, tf.bfloat16) for w in (inputs, *weights)]
        cast = [tf.cast(t, dtype) for t in rounded]
        return cast[0], cast[1:]

    x64, w64 = as_dtype(tf.float64)
    expected = _cnn2d_jacobian(x64, w64)
    x, w = as_dtype(tf.bfloat16)
    compiled = tf.function(_cnn2d_jacobian, autograph=False)(x, w)
    eager = _cnn2d_rows(x, w)
    return Bfloat16Check(
        compiled=_worst(compiled, expected),
        eager=_worst(eager, expected),
        cpu=runtime.cpu_kind().describe(),
    )


#: ``examples.cnn2d``'s weight shapes: two 3x3 Conv2D (1 -> 4 -> 4 channels),
#: Dense(48 -> 8), Dense(8 -> 3), each kernel then bias
_CNN2D_SHAPES = ((3, 3, 1, 4), (4,), (3, 3, 4, 4), (4,), (48, 8), (8,), (8, 3), (3,))


def _cnn2d_values(seed: int = 0) -> tuple[np.ndarray, list[np.ndarray]]:
    """``examples.cnn2d(seed=0)``'s inputs ``(2, 8, 7, 1)`` and weights, drawn
    the same way (float32), without building the Keras model."""
    rng = np.random.default_rng(seed)
    weights = []
    for shape in _CNN2D_SHAPES:
        fan_in = int(np.prod(shape[:-1])) if len(shape) > 1 else 1
        scale = 1.0 / np.sqrt(max(fan_in, 1)) if len(shape) > 1 else 0.3
        weights.append(rng.normal(scale=scale, size=shape).astype("float32"))
    inputs = np.random.default_rng(seed + 1000).normal(size=(2, 8, 7, 1))
    return inputs.astype("float32"), weights


def _cnn2d(x: tf.Tensor, weights: list[tf.Tensor]) -> tf.Tensor:
    """``examples.cnn2d``'s forward pass, in plain ops: the rows, one per
    feature summed over the batch."""
    h = x
    for kernel, bias in (weights[0:2], weights[2:4]):
        h = tf.nn.relu(tf.nn.bias_add(tf.nn.convolution(h, kernel), bias))
    h = tf.reshape(h, (h.shape[0], -1))
    h = tf.nn.relu(h @ weights[4] + weights[5])
    return tf.reduce_sum(h @ weights[6] + weights[7], axis=0)


def _cnn2d_jacobian(x: tf.Tensor, weights: list[tf.Tensor]) -> list[tf.Tensor]:
    with tf.GradientTape() as tape:
        tape.watch(weights[:2])
        rows = _cnn2d(x, weights)
    jacobians: list[tf.Tensor] = vectorize.jacobian(tape, rows, weights[:2])
    return jacobians


def _cnn2d_rows(x: tf.Tensor, weights: list[tf.Tensor]) -> list[tf.Tensor]:
    with tf.GradientTape(persistent=True) as tape:
        tape.watch(weights[:2])
        rows = _cnn2d(x, weights)
        each = [rows[i] for i in range(rows.shape[0])]
    grads = [tape.gradient(row, weights[:2]) for row in each]
    return [tf.stack([g[i] for g in grads]) for i in range(2)]


def _worst(actual: list[tf.Tensor], expected: list[tf.Tensor]) -> float:
    worst = 0.0
    for a, e in zip(actual, expected, strict=True):
        e = e.numpy()
        diff = np.abs(tf.cast(a, tf.float64).numpy() - e)
        worst = max(worst, float(diff.max() / max(np.abs(e).max(), 1e-300)))
    return worst


def warn_if_bfloat16_far_off(problem: Any, compiled: bool) -> None:
    """Warn once per process (per compiled/eager path) where ``problem``'s
    gradients run bfloat16 convolutions and :func:`bfloat16_check` finds this
    CPU's kernels more than :data:`FAR_OFF` from float64 on that path."""
    if not problem.convolutions or gradient_dtype(problem) != tf.bfloat16:
        return
    check = bfloat16_check()
    error = check.compiled if compiled else check.eager
    if error <= FAR_OFF or not runtime.first_notice(("bfloat16 far off", compiled)):
        return
    path = (
        "every strategy but 'loop'"
        if compiled
        else f"strategy='loop', which runs eagerly; compiled: {check.compiled:.2g}"
    )
    warnings.warn(
        f"bfloat16 convolution gradients on this CPU, {check.cpu}, are far from "
        f"float64: {error:.2f} max relative difference on a small Conv2D "
        f"model's Jacobian ({path}). TensorFlow's bfloat16 kernels on this path "
        "round every intermediate gradient to bfloat16. Use float32 or "
        "mixed_float16 for the target's layers where that matters.",
        PrecisionWarning,
        stacklevel=runtime.caller_stacklevel(),
    )
