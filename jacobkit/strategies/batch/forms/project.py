"""``batch``'s projection: a Kronecker map applied to a layer's factors,
other parts' gradients formed, then mapped."""

from __future__ import annotations

from typing import Any

import tensorflow as tf

from jacobkit.problem import Problem, sketch
from jacobkit.problem.reduction import Project
from jacobkit.strategies.batch.contract import (
    Cotangents,
    Taps,
    added,
    by_position,
    no_autograph,
)
from jacobkit.strategies.batch.forward import projections

KIND = Project


@no_autograph
def contract(
    problem: Problem, taps: Taps, cotangents: Cotangents, *, summed: bool
) -> list[tf.Tensor]:
    """``reduce=jk.Project``: each target's part of every row's projection,
    ``(R, dim)`` (:mod:`jacobkit.problem.sketch`). A Kronecker map of a
    factored part is applied to the factors, summed over its calls (a
    lookup's ids gather the left factor's rows; a tied table's reverse call
    maps its factors swapped: ``TargetMap.of_reversed``); other parts'
    gradients are formed by their rule, then mapped."""
    project = problem.reduction
    assert isinstance(project, Project), "a projection is asked for"
    maps = sketch.maps(problem, project)
    dzs = cotangents.every_row()
    targets = problem.targets
    xs, parts = taps
    out: list[Any] = [None] * len(targets)
    for i, p in enumerate(projections(problem)):
        kernel_map, shape = maps[p.kernel], tuple(targets[p.kernel].shape)
        kernels: list[Any] = []
        biases: list[Any] = []
        for x, dz in (pair[:2] for pair in zip(xs, dzs, parts) if pair[2] == i):
            ids = p.rule.lookup_ids(x) if kernel_map.kronecker else None
            if ids is not None:  # the one-hot patches' left factor, gathered
                ids, cotangents = by_position(ids, dz, summed=summed)
                kernels.append(kernel_map.of_lookup(ids, cotangents))
                biases.append(None)  # an embedding has no bias
            elif kernel_map.kronecker and p.rule.reverse_inputs(x) is not None:
                # the factors swapped: the cotangents times the left factor
                inputs, cotangents = by_position(
                    p.rule.reverse_inputs(x), dz, summed=summed
                )
                kernels.append(kernel_map.of_reversed(inputs, cotangents))
                biases.append(None)  # a tied table has no bias
            elif kernel_map.left is not None and p.rule.factored():
                left = p.rule.unfold_times(x, kernel_map.held("left"))  # (B, P, s)
                left, cotangents = by_position(left, dz, summed=summed)
                kernels.append(kernel_map.of_mapped(left, cotangents))
                bias = tf.reduce_sum(cotangents, axis=2)
                biases.append(tf.reshape(bias, (-1, bias.shape[-1])))
            else:
                kernel, bias = p.rule.gradients(x, dz, shape, summed=summed)
                kernels.append(kernel_map.of_flat(kernel))
                biases.append(bias)
        out[p.kernel] = added(kernels)
        if p.bias is not None:
            out[p.bias] = maps[p.bias].of_flat(added(biases))
    return out
