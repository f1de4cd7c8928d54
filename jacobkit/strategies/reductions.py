"""``reduce=`` by a strategy without its own (the ``batch`` strategy computes
both from its closed forms).

``reduce=jk.ClippedSum(C)``: each row's norm (over every
target) by the strategy itself, then one backward pass of the rows weighted
by ``min(1, C / norm)``. That pass gives ``sum_r s_r g_r`` at once: the
gradient of ``sum_r s_r row_r`` is the scaled rows' gradients summed, and no
row's gradient is formed. (``batch`` needs no second pass: it scales each
row's cotangents at its layers and contracts once; see
:mod:`jacobkit.strategies.batch`.)
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import tensorflow as tf

from jacobkit.layers.base import squared_rows
from jacobkit.problem import Problem, Slot, model_state, sketch
from jacobkit.problem.reduce import ClippedSum, Project
from jacobkit.problem.solution import Stats

ZERO = tf.UnconnectedGradients.ZERO

Run = Callable[[Problem], tuple[list[tf.Tensor], Stats]]


def clipped_sum(
    run: Run, problem: Problem, *, norms: bool
) -> tuple[list[tf.Tensor], tf.Tensor, Stats]:
    """The clipped sum per target, every row's norm ``(R,)`` and the cost:
    ``run`` computes each row's per-target norms where ``norms`` (its
    strategy supports ``reduce="norm"``), else each row's Jacobians (a
    strategy that holds them all anyway)."""
    reduce = problem.reduce
    assert isinstance(reduce, ClippedSum), "a clipped sum is asked for"
    check_variables(problem, "jk.ClippedSum(...)", "clips")
    first, stats = run(problem.with_reduce("norm" if norms else None))
    total = tf.sqrt(tf.add_n([_squared_norms(f, norms) for f in first]))
    start = time.perf_counter()
    sums = _weighted(problem)(problem.inputs, reduce.scales(total))
    wall = stats.wall_time_s + time.perf_counter() - start
    return list(sums), total, replace(stats, wall_time_s=wall)


def _squared_norms(found: tf.Tensor, norms: bool) -> tf.Tensor:
    """Each row's squared norm ``(R,)`` from its norms or its Jacobians."""
    if norms:
        return tf.square(tf.reshape(tf.cast(found, tf.float32), (-1,)))
    return squared_rows(found)


def _weighted(problem: Problem) -> Any:
    """``(inputs, scales (R,)) -> the gradient of sum_r scales_r row_r`` per
    target, compiled once per model and problem."""
    compiled = model_state(problem.model, Slot.COMPILED)
    key = (problem.key, "weighted rows")
    if key not in compiled:
        detached = problem.detached()
        targets = list(problem.targets)

        def weighted(inputs: Any, scales: tf.Tensor) -> list[tf.Tensor]:
            with tf.GradientTape(watch_accessed_variables=False) as tape:
                tape.watch(targets)
                rows = detached.rows(inputs)
            found: list[tf.Tensor] = tape.gradient(
                rows,
                targets,
                output_gradients=tf.reshape(
                    tf.cast(scales, rows.dtype), tf.shape(rows)
                ),
                unconnected_gradients=ZERO,
            )
            return [tf.convert_to_tensor(g) for g in found]

        compiled[key] = problem.function(weighted)
    return compiled[key]


def projected(run: Run, problem: Problem) -> tuple[list[tf.Tensor], Stats]:
    """Each target's part of every row's projection ``(R, dim)`` from the
    rows' Jacobians that ``run`` computes (one chunk of rows where the
    strategy chunks; a dataset's batches one by one)."""
    check_variables(problem, "jk.Project(...)", "maps")
    jacobians, stats = run(problem.with_reduce(None))
    start = time.perf_counter()
    found = [m.of_flat(j) for m, j in zip(sketch.maps(problem), jacobians, strict=True)]
    wall = stats.wall_time_s + time.perf_counter() - start
    return found, replace(stats, wall_time_s=wall)


def check_variables(problem: Problem, reduce: str, verb: str) -> None:
    """Refuse ``Inputs()``/``Output()`` targets: a reduction over every
    target together is of the variables' gradients."""
    if problem.tensor_targets is not None:
        raise ValueError(
            f"jacobian(reduce={reduce}): {verb} the gradients of variables, got "
            f"the tensor target(s) {', '.join(problem.target_names)}."
        )


def computation(strategy: Any, problem: Problem) -> Callable[[Any], list[tf.Tensor]]:
    """``inputs -> what strategy.solve(problem) gives`` as one computation, as
    ``tf.distribute`` replicas run it: the per-target values in
    :meth:`~jacobkit.strategies.base.Strategy.run`'s layout, then every row's
    norm last with ``reduce=jk.ClippedSum``. A strategy that clips or projects
    itself gives its own computation; for the others the two steps of
    :func:`clipped_sum` or :func:`projected` are composed into one
    ``tf.function`` (compiled once per model, problem and strategy)."""
    reduce = problem.reduce
    clipping = isinstance(reduce, ClippedSum) and not strategy.clips
    projecting = isinstance(reduce, Project) and not strategy.projects
    if not (clipping or projecting):
        fn: Callable[[Any], list[tf.Tensor]] = strategy.compiled_for(problem).fn
        return fn
    compiled = model_state(problem.model, Slot.COMPILED)
    key = (problem.key, strategy.key, "one computation")
    if key not in compiled:
        check_variables(problem, repr(reduce), "clips" if clipping else "maps")
        if clipping:
            assert isinstance(reduce, ClippedSum)
            norms = strategy.supports_norm
            first = strategy.compiled_for(
                problem.with_reduce("norm" if norms else None)
            ).fn
            weighted = _weighted(problem)

            def one(inputs: Any) -> list[tf.Tensor]:
                found = first(inputs)
                total = tf.sqrt(tf.add_n([_squared_norms(f, norms) for f in found]))
                return [*weighted(inputs, reduce.scales(total)), total]

        else:
            jacobians = strategy.compiled_for(problem.with_reduce(None)).fn
            maps = sketch.maps(problem)

            def one(inputs: Any) -> list[tf.Tensor]:
                found = jacobians(inputs)
                return [m.of_flat(j) for m, j in zip(maps, found, strict=True)]

        compiled[key] = problem.function(one)
    found: Callable[[Any], list[tf.Tensor]] = compiled[key]
    return found
