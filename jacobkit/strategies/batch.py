"""``batch``: per-example Jacobian at the layer's output, contracted with its input.

NOTE (why the contraction is exact). Let the target layer compute
``z = linear(x; W, b)`` (Dense: ``x @ W + b``; Conv: ``conv(x, W) + b``) and
then ``a = activation(z)``. ``x`` does not depend on ``W`` or ``b`` (checked:
the layer must run once per forward pass), so by the chain rule every row ``r``
has ``dr/dW = VJP of linear at x, applied to the cotangent dr/dz``, and the
VJP of a map that is linear in ``(W, b)`` is exact, not a linearization.
For rows that depend on a single example ``b`` only (``"per_example"`` and
``"full"``), ``dr/dz`` is zero outside example ``b``, so the VJP only needs
``x[b]``; ``"features"`` rows are sums over examples, so their VJP is taken
over the whole batch at once. ``dr/dz`` itself comes from
``tape.batch_jacobian`` of the per-example rows ``P (B, K)`` with respect to
``z``, which is correct only when examples do not mix (no batch statistics,
no attention across the batch): that is checked once, numerically, before
the first run.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import final

import tensorflow as tf

from jacobkit.problem import Problem
from jacobkit.strategies.base import ZERO, Strategy

_SUPPORTED = "Dense, Conv1D and Conv2D (Keras 3 or tf_keras)"


@final
@dataclass(frozen=True)
class Batch(Strategy):
    """Batched Jacobian with respect to the target layer's own pre-activation
    output ``z``, then the kernel/bias Jacobian by contracting with the layer's
    input (see the NOTE in this module). Vectorized over rows with no per-row
    pass through the layers before the target; extra memory R × B × size(z)
    per example.
    """

    name = "batch"

    trace_weight = 2.0

    @classmethod
    def for_auto(cls, num_rows: int) -> Batch:
        return Batch()

    def check(self, problem: Problem) -> None:
        if problem.linear_layer_kind is None:
            what = (
                "a list of variables"
                if problem.layer is None
                else f"layer {problem.layer.name!r} ({type(problem.layer).__name__})"
            )
            raise ValueError(
                f"jacobian(strategy='batch'): supports {_SUPPORTED} layers, got "
                f"{what}. Use strategy='chunked' or 'jacobian' for this target."
            )
        if not problem.rows_spec.decomposes_per_example:
            raise ValueError(
                "jacobian(strategy='batch'): needs rows that each belong to one "
                "example or sum over examples (outputs='features', "
                "'per_example' or 'full'); a callable outputs= may mix "
                "examples. Use strategy='chunked'."
            )
        if set(problem.roles.values()) != set(range(len(problem.targets))):
            raise ValueError(
                "jacobian(strategy='batch'): every target must be the layer's own "
                "kernel or bias."
            )
        leak = _cross_example_leak(problem)
        if leak > 1e-6:
            raise ValueError(
                "jacobian(strategy='batch'): the model mixes examples across the "
                f"batch: example 0's outputs depend on other examples' values at "
                f"layer {problem.layer.name!r} (relative size {leak:.1e}), as "
                "BatchNormalization with training=True does. The batch strategy "
                "assumes independent examples; use strategy='chunked' or "
                "'jacobian'."
            )

    def build(self, problem: Problem):
        targets = problem.targets
        summed = problem.rows_spec.summed_over_batch

        def compute(inputs):
            layer_inputs, z, per_example, tape = _tapped_forward(problem, inputs)
            # (B, K, *z.shape[1:]): d P[b, k] / d z[b]
            dz = tape.batch_jacobian(per_example, z, unconnected_gradients=ZERO)
            if summed:
                return _contract_summed(problem, layer_inputs, dz, targets)
            return _contract_per_example(problem, layer_inputs, dz, targets)

        return compute


def _tapped_forward(problem: Problem, inputs):
    """Forward pass recording the target layer's input and output ``z``."""
    taps = []

    def on_output(layer_inputs, z):
        tape.watch(z)
        taps.append((layer_inputs, z))
        return z

    tape = tf.GradientTape(persistent=True, watch_accessed_variables=False)
    with tape, problem.tap_layer(on_output):
        per_example = problem.per_example_rows(inputs)
    if len(taps) != 1:
        raise ValueError(
            f"jacobian(strategy='batch'): layer {problem.layer.name!r} runs "
            f"{len(taps)} times per forward pass (a shared layer); its input then "
            "depends on its own kernel and the contraction would be wrong. Use "
            "strategy='chunked' or 'jacobian'."
        )
    layer_inputs, z = taps[0]
    return layer_inputs, z, per_example, tape


def _contract_summed(problem, layer_inputs, dz, targets):
    """Rows summed over examples: one VJP over the whole batch per row."""
    with tf.GradientTape(persistent=True, watch_accessed_variables=False) as tape:
        tape.watch(targets)
        z = problem.layer_linear(layer_inputs)
    cotangents = tf.experimental.numpy.moveaxis(dz, 1, 0)  # (K, B, ...)
    return tf.vectorized_map(
        lambda ct: tape.gradient(
            z, targets, output_gradients=ct, unconnected_gradients=ZERO
        ),
        cotangents,
        fallback_to_while_loop=False,
    )


def _contract_per_example(problem, layer_inputs, dz, targets):
    """Rows of single examples: one VJP per (example, row) with ``x[b]`` only."""
    batch, per_row = dz.shape[0], dz.shape[1]
    examples = tf.repeat(tf.range(batch), per_row)  # (B*K,), row-major (b, k)
    cotangents = tf.reshape(dz, (batch * per_row, 1, *dz.shape[2:]))

    def one(elems):
        example, cotangent = elems
        with tf.GradientTape(watch_accessed_variables=False) as tape:
            tape.watch(targets)
            z = problem.layer_linear(tf.gather(layer_inputs, example[None]))
        return tape.gradient(
            z, targets, output_gradients=cotangent, unconnected_gradients=ZERO
        )

    return tf.vectorized_map(one, (examples, cotangents), fallback_to_while_loop=False)


def _cross_example_leak(problem: Problem) -> float:
    """How much example 0's rows depend on other examples at the layer's output
    (0 when examples are independent; exactly 0 up to rounding)."""
    if not problem.batch_size or problem.batch_size < 2:
        return 0.0
    _, z, per_example, tape = _tapped_forward(problem, problem.inputs)
    weights = tf.random.stateless_normal(
        per_example.shape[1:], seed=(0, 1), dtype=per_example.dtype
    )
    # Select example 0 with the cotangent, not by slicing: the tape has
    # stopped recording, so a slice of ``per_example`` taken here would have
    # no gradient and the check would always pass.
    only_first = tf.one_hot(0, problem.batch_size, dtype=per_example.dtype)
    first = tape.gradient(
        per_example,
        z,
        output_gradients=only_first[:, None] * weights[None, :],
        unconnected_gradients=ZERO,
    )
    total = float(tf.reduce_max(tf.abs(first))) + 1e-30
    return float(tf.reduce_max(tf.abs(first[1:]))) / total
