"""``batch``'s norms: each row's kernel and bias gradient norms from the
Gram form or chunks of rows, without the rows held together."""

from __future__ import annotations

import tensorflow as tf

from jacobkit.problem import Problem
from jacobkit.problem.reduction import Norms
from jacobkit.strategies.batch.contract import (
    Cotangents,
    Taps,
    each_part,
    gradients,
)
from jacobkit.strategies.chunks import map_chunks

KIND = Norms


def contract(
    problem: Problem, taps: Taps, cotangents: Cotangents, *, summed: bool
) -> list[tf.Tensor]:
    """Per-row norms of the kernel/bias Jacobians (Gram form or chunks of
    rows, :func:`jacobkit.layers.norms.kernel_and_bias_norms`). A layer
    called several times: the norms of the summed gradients, formed per
    chunk of rows (the norm of a sum is not a sum of norms)."""
    _, parts = taps
    dzs = cotangents.every_row()
    if len(parts) > len(set(parts)):
        by_row = gradients(problem, taps, dzs, summed=summed)
        return [tf.norm(tf.reshape(g, (tf.shape(g)[0], -1)), axis=-1) for g in by_row]
    return each_part(
        problem,
        taps,
        dzs,
        lambda p, x, dz, _: p.rule.norms(x, dz, summed=summed, map_chunks=map_chunks),
        norms=True,
    )
