"""The ``batch`` strategy's check of a layer rule's own arithmetic: its
``gradients()`` and ``norms()`` (per example and summed over the batch)
against autodiff of the ``z`` it computes (``pre_activation``), for random
cotangents, once per problem with the other checks (:mod:`.checks`). A rule
registered by a user with a wrong gradient is so refused in words, never
used (``docs/layers.md``: "a mismatch is a refusal in words")."""

from __future__ import annotations

from typing import Any

import tensorflow as tf

from jacobkit.layers import lora, stock
from jacobkit.layers.base import Tapped, squared_rows
from jacobkit.problem import Problem
from jacobkit.problem.targets import Projection
from jacobkit.strategies.batch.forward import projections
from jacobkit.strategies.chunks import map_chunks

#: rows per example in the rule's check: two, so that a rule mixing up the
#: example and row axes is caught
_CHECK_ROWS = 2
#: the rules jacobkit ships: each checked against float64 by the layer
#: conformance suite (``tests/test_layer_conformance.py``), so not again on
#: every first call. NOTE (measured, one core): checking them took 0.32 s of
#: the reductions benchmark's conv net's first clipped sum (0.42 s before the
#: check, 0.74 s with it), and doubled BERT tiny's (2.2 -> 4.4 s)
_STOCK_RULES = frozenset(kind.rule for kind in stock.KINDS) | frozenset(
    part for kind in stock.KINDS if kind.lora for part in lora.part_rules(kind.lora)
)


def checked(rule: Any) -> bool:
    """Whether a tap's rule is checked here: a user's (registered with
    ``jk.layers.register``, or a subclass of a stock rule), not one that
    jacobkit ships."""
    return type(rule) not in _STOCK_RULES


def against_autodiff(
    problem: Problem, part: Projection, tap: Tapped, examples: int
) -> tuple[tf.Tensor, tf.Tensor]:
    """A registered rule checked against autodiff of its own
    ``pre_activation`` (the ``z`` its tap computes, :func:`_linear`) at one
    tap, for random cotangents ``dz`` at ``z``
    (``(B, K, *z.shape[1:])``, ``K`` = :data:`_CHECK_ROWS`): its per-row
    gradients, its rows summed over the batch and the squared norms of both
    (``norms()``), flat and concatenated, against the same from one
    backward pass through that ``z`` with one copy of the weights
    per row (``B K`` copies: the first ``examples`` examples).

    NOTE (measured, 2-core CPU shared). On the MLP 512-1024-1024-144's
    middle Dense: 0.05 s on a warm process, against the rest of the checks'
    0.04 s; in a cold process the first call's checks take 0.5 s against
    0.1-0.3 s before (TensorFlow's first dispatch of each op), of a first
    call of 10-20 s. The verdict is kept with the other checks' (in
    :mod:`.checks`).

    The check is of the rule alone, not of the model: ``pre_activation`` is
    checked against the layer by :mod:`.checks`."""
    dtype = tap.z.dtype
    targets = problem.targets
    kernel = _in(targets[part.kernel], dtype)
    bias = None if part.bias is None else _in(targets[part.bias], dtype)
    x = tap.inputs[:examples]
    if x.dtype.is_floating:
        x = tf.cast(x, dtype)
    examples = int(x.shape[0])  # fewer where the batch is smaller
    shape = (examples, _CHECK_ROWS, *tap.z.shape[1:])
    dz = tf.random.stateless_normal(shape, seed=(0, 2), dtype=dtype)
    rows = examples * _CHECK_ROWS
    with tf.GradientTape(watch_accessed_variables=False) as tape:
        kernels = [tf.identity(kernel) for _ in range(rows)]
        biases = [None if bias is None else tf.identity(bias) for _ in range(rows)]
        tape.watch([kernels, [b for b in biases if b is not None]])
        product = tf.constant(0.0, tap.z.dtype)
        for row in range(rows):
            b, k = divmod(row, _CHECK_ROWS)  # rows are example-major
            z = _linear(part.rule, x, kernels[row], biases[row])
            only = tf.one_hot(b, examples, dtype=z.dtype)
            weights = tf.reshape(only, (-1,) + (1,) * (z.shape.rank - 1))
            product += tf.reduce_sum(z * weights * dz[:, k])
    found = tape.gradient(
        product,
        [kernels, [b for b in biases if b is not None]],
        unconnected_gradients=tf.UnconnectedGradients.ZERO,
    )
    kernel_rows = tf.stack([tf.convert_to_tensor(g) for g in found[0]])
    if bias is None:
        bias_rows = tf.zeros((rows, 0), kernel_rows.dtype)
    else:
        bias_rows = tf.stack([tf.convert_to_tensor(g) for g in found[1]])
    # a part without a bias: what a rule gives for it is never read
    has_bias = float(bias is not None)
    by_rule = []
    for summed in (False, True):
        k_rows, b_rows = part.rule.gradients(x, dz, tuple(kernel.shape), summed=summed)
        k_norms, b_norms = part.rule.norms(x, dz, summed=summed, map_chunks=map_chunks)
        by_rule += [
            _flat(k_rows),
            _flat(b_rows) if bias is not None else tf.zeros((0,), k_rows.dtype),
            tf.square(k_norms) + has_bias * tf.square(tf.cast(b_norms, k_norms.dtype)),
        ]
    by_autodiff = []
    for k_rows, b_rows in (
        (kernel_rows, bias_rows),
        (_summed(kernel_rows, examples), _summed(bias_rows, examples)),
    ):
        by_autodiff += [
            _flat(k_rows),
            _flat(b_rows),
            squared_rows(k_rows) + squared_rows(b_rows),
        ]
    return (
        tf.concat([tf.cast(t, tf.float32) for t in by_rule], 0),
        tf.concat([tf.cast(t, tf.float32) for t in by_autodiff], 0),
    )


def _in(variable: Any, dtype: tf.DType) -> tf.Tensor:
    """A weight's value as a tensor of ``z``'s dtype (a bfloat16 model's
    rules compute in it; ``z`` is linear in the weights, so their gradients
    do not depend on the weights' rounding)."""
    return tf.cast(tf.convert_to_tensor(variable), dtype)


def _linear(rule: Any, x: tf.Tensor, kernel: Any, bias: Any) -> tf.Tensor:
    """The part's ``z`` from ``x`` as its tap computes it
    (:meth:`~jacobkit.layers.LayerRule.tapped_call`: ``pre_activation``, or
    a ``ReversibleEmbedding``'s reverse call)."""
    _, taps = rule.tapped_call((x,), {}, [(kernel, bias)], lambda z: z)
    (tap,) = taps
    z: tf.Tensor = tap.z
    return z


def _flat(rows: tf.Tensor) -> tf.Tensor:
    return tf.reshape(rows, (-1,))


def _summed(rows: tf.Tensor, examples: int) -> tf.Tensor:
    """Example-major rows ``(B K, ...)`` summed over the examples: ``(K, ...)``."""
    by_example = tf.reshape(rows, (examples, _CHECK_ROWS, *rows.shape[1:]))
    return tf.reduce_sum(by_example, 0)


def epsilon(dtype: tf.DType) -> float:
    """The machine epsilon of a floating dtype (float32's for others)."""
    if dtype == tf.float64:
        return 2.0**-52
    return {tf.float16: 2.0**-10, tf.bfloat16: 2.0**-7}.get(dtype, 2.0**-23)


def refusal(
    problem: Problem,
    by_rule: list[tf.Tensor],
    by_autodiff: list[tf.Tensor],
    precision: list[tf.Tensor],
) -> str | None:
    """The refusal of a rule whose ``gradients()`` or ``norms()`` differ from
    autodiff of its ``pre_activation`` (``None``: they agree). float32
    rounding of the same sums: measured 1e-7 of the largest value on the
    registered example (a doubled gradient is off by 1 of it)."""
    for rule, autodiff, eps in zip(by_rule, by_autodiff, precision):
        if rule.shape != autodiff.shape:
            off = float("inf")
        else:
            scale = float(tf.reduce_max(tf.abs(autodiff))) + 1e-30
            off = float(tf.reduce_max(tf.abs(rule - autodiff))) / scale
        # float32: 1e-4, as the closed form's check; a bfloat16 model's rule
        # and autodiff, both right, differ by 2e-3 (16 epsilons: 0.125)
        if off > max(1e-4, 16 * float(eps)):
            layer = problem.layer
            named = "a target layer" if layer is None else f"layer {layer.name!r}"
            rules = sorted({type(p.rule).__name__ for p in projections(problem)})
            return (
                f"jacobian(strategy='batch'): the closed form of {named} "
                f"({', '.join(rules)}) is wrong: its gradients() or norms() "
                "differ from autodiff of its own pre_activation() (largest "
                f"difference {off:.1e} of the largest value). Fix the rule "
                "registered with jacobkit.layers.register, or use "
                "strategy='chunked' or 'jacobian'."
            )
    return None
