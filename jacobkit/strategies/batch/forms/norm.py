"""``batch``'s norms: each row's kernel and bias gradient norms from the
Gram form or chunks of rows, without the rows held together."""

from __future__ import annotations

from typing import Any

import tensorflow as tf

from jacobkit.layers.base import row_norms
from jacobkit.problem import Problem
from jacobkit.problem.reduction import Norms
from jacobkit.strategies.batch.contract import (
    Cotangents,
    Taps,
    added,
    no_autograph,
    placed,
)
from jacobkit.strategies.batch.forward import projections
from jacobkit.strategies.chunks import map_chunks

KIND = Norms


@no_autograph
def contract(
    problem: Problem, taps: Taps, cotangents: Cotangents, *, summed: bool
) -> list[tf.Tensor]:
    """Per-row norms of the kernel/bias Jacobians (Gram form or chunks of
    rows, :func:`jacobkit.layers.norms.kernel_and_bias_norms`). A layer
    called several times: the norms of the summed gradients, by its rule's
    :meth:`~jacobkit.layers.LayerRule.shared_norms` where it has them (a
    tied embedding's lookup and logits), else formed (the norm of a sum is
    not a sum of norms); every other part as if alone."""
    xs, parts = taps
    dzs = cotangents.every_row()
    targets = problem.targets
    done: list[tuple[Any, Any]] = []
    for i, p in enumerate(projections(problem)):
        calls = [(x, dz) for x, dz, j in zip(xs, dzs, parts) if j == i]
        if len(calls) == 1:
            ((x, dz),) = calls
            done.append(p.rule.norms(x, dz, summed=summed, map_chunks=map_chunks))
            continue
        shared = p.rule.shared_norms(calls, summed=summed)
        if shared is not None:
            done.append(shared)
            continue
        shape = tuple(targets[p.kernel].shape)
        each = [p.rule.gradients(x, dz, shape, summed=summed) for x, dz in calls]
        kernel = row_norms(added([k for k, _ in each]))
        bias = None if p.bias is None else row_norms(added([b for _, b in each]))
        done.append((kernel, bias))
    return placed(problem, done, norms=True)
