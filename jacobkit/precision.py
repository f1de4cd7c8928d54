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

Measured on CPU only. TensorFlow's GPU reductions may accumulate float16 in
float32, which would make the refusal unneeded there (not measured yet).
"""

from __future__ import annotations

from typing import Any

import tensorflow as tf

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
    layer = getattr(problem, "layer", None)
    compute = getattr(layer, "compute_dtype", None)
    if compute is not None:
        return tf.as_dtype(compute)
    dtypes = [t.dtype for t in problem.targets]
    targets = {id(t) for t in problem.targets}
    flatten = getattr(problem.model, "_flatten_layers", None)
    for owner in flatten(include_self=False, recursive=True) if flatten else ():
        owned = [_unwrapped(w) for w in getattr(owner, "weights", ())]
        compute = getattr(owner, "compute_dtype", None)
        if compute is not None and any(id(w) in targets for w in owned):
            dtypes.append(tf.as_dtype(compute))
    return min(dtypes, key=lambda d: d.size)


def _unwrapped(variable: Any) -> Any:
    """The ``tf.Variable`` behind a Keras 3 variable; others as they are."""
    inner = getattr(variable, "_value", None)
    return inner if isinstance(inner, tf.Variable) else variable


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
    layer = getattr(problem, "layer", None)
    if layer is None:
        return "the target"
    return f"layer {layer.name!r}"
