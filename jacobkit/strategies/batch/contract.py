"""The ``batch`` strategy's contractions: each linear part's kernel and bias
Jacobians (or their norms) from its cotangents at ``z`` and its tapped
input, by its rule's closed form (see the NOTE in
:func:`jacobkit.layers.contract.kernel_and_bias_gradients`), summed over the
part's calls where the layer runs several times, placed in the order of the
targets."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar, cast

import tensorflow as tf

from jacobkit.layers import norms as layer_norms
from jacobkit.layers.base import squared_rows
from jacobkit.problem import Problem, sketch
from jacobkit.problem.reduce import ClippedSum
from jacobkit.problem.targets import Projection
from jacobkit.strategies.base import map_chunks
from jacobkit.strategies.batch.forward import projections

_F = TypeVar("_F", bound=Callable[..., Any])


def _no_autograph(fn: _F) -> _F:
    """``fn`` left as written by AutoGraph (kept for tf_keras models): the
    helpers below have no data-dependent control flow, and AutoGraph
    miscalled a helper from inside a comprehension over ``zip``."""
    return cast(_F, tf.autograph.experimental.do_not_convert(fn))


@_no_autograph
def _placed(
    problem: Problem, parts: list[tuple[Any, Any]], *, norms: bool = False
) -> list[tf.Tensor]:
    """Each part's ``(kernel, bias)`` results (or norms) at its targets'
    positions, each in its target's dtype (bias rows reshaped to the
    variable's shape: a rule gives ``(R, units)``, ``EinsumDense``'s bias is
    ``(heads, dim)``)."""
    targets = problem.targets
    out: list[Any] = [None] * len(targets)
    for projection, (kernel, bias) in zip(projections(problem), parts):
        out[projection.kernel] = tf.cast(kernel, targets[projection.kernel].dtype)
        if projection.bias is not None:
            target = targets[projection.bias]
            if not norms:
                bias = tf.reshape(bias, (-1, *target.shape))
            out[projection.bias] = tf.cast(bias, target.dtype)
    return out


@_no_autograph
def _each_part(
    problem: Problem,
    taps: Taps,
    dzs: list[Any],
    contract: Callable[[Projection, Any, Any, tuple[int, ...]], tuple[Any, Any]],
    *,
    norms: bool = False,
) -> list[tf.Tensor]:
    """``contract(part, x, dz, kernel_shape)`` of each tap, summed over the
    taps of each part (its calls), placed in the order of the targets
    (:func:`_placed`)."""
    targets = problem.targets
    xs, parts = taps
    done: list[Any] = []
    for i, p in enumerate(projections(problem)):
        shape = tuple(targets[p.kernel].shape)
        each = [contract(p, x, dz, shape) for x, dz, j in zip(xs, dzs, parts) if j == i]
        kernel = tf.add_n([k for k, _ in each]) if len(each) > 1 else each[0][0]
        bias = each[0][1]
        if bias is not None and len(each) > 1:
            bias = tf.add_n([b for _, b in each])
        done.append((kernel, bias))
    return _placed(problem, done, norms=norms)


#: each tap's input (cast to its ``z``'s dtype) and the index of its part
Taps = tuple[list[Any], list[int]]


def summed_rows(problem: Problem, taps: Taps, dzs: list[Any]) -> list[tf.Tensor]:
    """One chunk of rows summed over the batch from its row-major cotangents
    (each ``(count, B, *z.shape[1:])``), in the order of the targets."""
    return _each_part(
        problem,
        taps,
        dzs,
        lambda p, x, dz, shape: p.rule.summed_gradients(x, dz, shape),
    )


def gradients(
    problem: Problem, taps: Taps, dzs: list[Any], *, summed: bool
) -> list[tf.Tensor]:
    """The kernel/bias Jacobians from the ``dzs`` in closed form (see the NOTE
    in :func:`jacobkit.layers.contract.kernel_and_bias_gradients`): one einsum
    per part, no per-row ``vectorized_map`` and no while-loop fallback."""
    # under mixed precision the layer input is float16 and ``dz`` float32
    # (``z`` is computed in the kernel's dtype): contract in float32, as the
    # loop's gradient accumulates (``xs`` are cast to ``z``'s dtype)
    return _each_part(
        problem,
        taps,
        dzs,
        lambda p, x, dz, shape: p.rule.gradients(x, dz, shape, summed=summed),
    )


def norms(
    problem: Problem, taps: Taps, dzs: list[Any], *, summed: bool
) -> list[tf.Tensor]:
    """Per-row norms of the kernel/bias Jacobians (Gram form or chunks of
    rows, :func:`jacobkit.layers.norms.kernel_and_bias_norms`). A layer
    called several times: the norms of the summed gradients, formed per
    chunk of rows (the norm of a sum is not a sum of norms)."""
    _, parts = taps
    if len(parts) > len(set(parts)):
        by_row = gradients(problem, taps, dzs, summed=summed)
        return [tf.norm(tf.reshape(g, (tf.shape(g)[0], -1)), axis=-1) for g in by_row]
    return _each_part(
        problem,
        taps,
        dzs,
        lambda p, x, dz, _: p.rule.norms(x, dz, summed=summed, map_chunks=map_chunks),
        norms=True,
    )


@_no_autograph
def clipped_sum(
    problem: Problem, taps: Taps, dzs: list[Any], *, summed: bool
) -> list[tf.Tensor]:
    """``reduce=jk.ClippedSum``: each target's sum of the rows' gradients
    scaled to norm at most ``clip_norm`` (over all targets together), then
    every row's norm ``(R,)``.

    A row's gradient is linear in its cotangent, so no second backward pass
    is needed (the book-keeping of ghost clipping). Per part:

    - where its norms form every row's gradient anyway (a convolution over
      few positions, a normalization: :meth:`LayerRule.forms_rows`, and a
      layer called several times), those gradients are kept, and the sum is
      them weighted by the scales: ``(R,) x (R, size)``;
    - elsewhere (the Gram form: a Dense layer on vectors), the norms come
      from the cotangents (as :func:`norms`) and the sum is one more
      contraction of the cotangents, each row's scaled by
      ``min(1, clip_norm / norm)``.

    NOTE (measured). The conv net of ``benchmarks/reductions.py`` (batch 32,
    one core): 18.7 ms with a second contraction for every layer, against
    a 7.5 ms plain step; conv2's rows (196 positions, 288 x 64) are formed
    for their norms, and contracting them again cost as much as forming
    them.
    """
    reduce = problem.reduce
    assert isinstance(reduce, ClippedSum), "a clipped sum is asked for"
    targets = problem.targets
    xs, parts = taps
    shared = len(parts) > len(set(parts))
    formed: dict[int, tuple[Any, Any]] = {}
    # each target's squared row norms (R,), in float32: a formed row's
    # squares summed at once (no square root to undo), a rule's norms squared
    squares: list[Any] = []
    for i, p in enumerate(projections(problem)):
        calls = [(x, dz) for x, dz, j in zip(xs, dzs, parts) if j == i]
        if shared or all(p.rule.forms_rows(x, dz, summed=summed) for x, dz in calls):
            shape = tuple(targets[p.kernel].shape)
            each = [p.rule.gradients(x, dz, shape, summed=summed) for x, dz in calls]
            kernel = _summed([k for k, _ in each])
            bias = None if p.bias is None else _summed([b for _, b in each])
            formed[i] = (kernel, bias)
            squares.extend(squared_rows(g) for g in (kernel, bias) if g is not None)
        else:
            ((x, dz),) = calls
            kernel, bias = p.rule.norms(x, dz, summed=summed, map_chunks=map_chunks)
            squares.append(tf.square(tf.cast(kernel, tf.float32)))
            if p.bias is not None:
                squares.append(tf.square(tf.cast(bias, tf.float32)))
    total = tf.sqrt(tf.add_n(squares))
    scales = reduce.scales(total)
    batch, rows = int(dzs[0].shape[0]), int(dzs[0].shape[1])
    by_row = tf.reshape(scales, (1, rows) if summed else (batch, rows))

    def weighted(rows: Any) -> Any:  # (R, ...) -> (1, ...)
        return tf.tensordot(tf.cast(scales, rows.dtype), rows, 1)[None]

    # each part's sum with a leading axis of 1, as _placed lays rows out
    sums: list[tuple[Any, Any]] = []
    for i, p in enumerate(projections(problem)):
        if i in formed:  # the rows' gradients, weighted
            kernel, bias = formed[i]
            sums.append((weighted(kernel), None if bias is None else weighted(bias)))
            continue
        # the cotangents, each row's scaled, contracted once
        ((x, dz),) = [(x, d) for x, d, j in zip(xs, dzs, parts) if j == i]
        scale = tf.reshape(by_row, (*by_row.shape, *[1] * (dz.shape.rank - 2)))
        kernel, bias = p.rule.gradients(
            x,
            dz * tf.cast(scale, dz.dtype),
            tuple(targets[p.kernel].shape),
            summed=True,
        )
        sums.append(
            (
                tf.reduce_sum(kernel, axis=0, keepdims=True),
                tf.reduce_sum(bias, axis=0, keepdims=True),
            )
        )
    return [s[0] for s in _placed(problem, sums)] + [total]


def _factors(rule: Any, x: Any, dz: Any, *, summed: bool) -> tuple[Any, Any]:
    """A factored part's unfolded input ``(B, P, I)`` and cotangents ``(B,
    K, P, O)`` from its tap ``x`` and ``dz`` (``(B, K, *z.shape[1:])``); rows
    summed over the batch see one example of ``B * P`` positions."""
    return _by_position(rule.unfold(x), dz, summed=summed)


def _by_position(patches: Any, dz: Any, *, summed: bool) -> tuple[Any, Any]:
    """``patches`` (``(B, P, I)``, or a lookup's ids ``(B, P)``) with the
    cotangents ``(B, K, P, O)``; summed rows: one example of ``B * P``
    positions."""
    batch, positions = patches.shape[0], patches.shape[1]
    cotangents = tf.reshape(dz, (batch, dz.shape[1], positions, dz.shape[-1]))
    if summed:
        patches = tf.reshape(patches, (1, batch * positions, *patches.shape[2:]))
        cotangents = tf.transpose(cotangents, (1, 0, 2, 3))
        cotangents = tf.reshape(cotangents, (1, dz.shape[1], batch * positions, -1))
    return patches, cotangents


def _summed(found: list[Any]) -> Any:
    return tf.add_n(found) if len(found) > 1 else found[0]


@_no_autograph
def projected(
    problem: Problem, taps: Taps, dzs: list[Any], *, summed: bool
) -> list[tf.Tensor]:
    """``reduce=jk.Project``: each target's part of every row's projection,
    ``(R, dim)`` (:mod:`jacobkit.problem.sketch`). A Kronecker map of a
    factored part is applied to the factors, summed over its calls; other
    parts' gradients are formed by their rule, then mapped."""
    maps = sketch.maps(problem)
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
                ids, cotangents = _by_position(ids, dz, summed=summed)
                kernels.append(kernel_map.of_lookup(ids, cotangents))
                biases.append(None)  # an embedding has no bias
            elif kernel_map.left is not None and p.rule.factored():
                left = p.rule.unfold_times(x, kernel_map.held("left"))  # (B, P, s)
                left, cotangents = _by_position(left, dz, summed=summed)
                kernels.append(kernel_map.of_mapped(left, cotangents))
                bias = tf.reduce_sum(cotangents, axis=2)
                biases.append(tf.reshape(bias, (-1, bias.shape[-1])))
            else:
                kernel, bias = p.rule.gradients(x, dz, shape, summed=summed)
                kernels.append(kernel_map.of_flat(kernel))
                biases.append(bias)
        out[p.kernel] = _summed(kernels)
        if p.bias is not None:
            out[p.bias] = maps[p.bias].of_flat(_summed(biases))
    return out


def _lookup(rule: Any, calls: list[Any], shape: tuple[int, ...]) -> Any:
    """An embedding's one lookup call as ``jk.gram``'s ghost form, its ids
    ``(B, P)`` and cotangents ``(B, K, P, O)``, where
    :func:`jacobkit.layers.norms.ghost_lookup_pairs` says pairs are cheaper
    from them than from the formed tables; else ``None``."""
    if len(calls) != 1:
        return None
    ((x, dz),) = calls
    ids = rule.lookup_ids(x)
    if ids is None or not layer_norms.ghost_lookup_pairs(
        int(ids.shape[1]), int(shape[0]), int(shape[-1]), int(dz.shape[1])
    ):
        return None
    return _by_position(ids, dz, summed=False)


@_no_autograph
def factors(
    problem: Problem, taps: Taps, dzs: list[Any], *, summed: bool
) -> list[tf.Tensor]:
    """``jk.gram``'s view of every row's gradient, in the order of the
    targets: a factored kernel where :func:`jacobkit.layers.norms.ghost_pairs`
    says pairs are cheaper from its factors, as two tensors (its unfolded
    input ``(B, P, I)`` and cotangents ``(B, K, P, O)``, a layer's calls
    side by side along ``P``); an embedding's per-example lookup likewise,
    its ids ``(B, P)`` (integers) in place of the one-hot patches
    (:func:`_lookup`); every other target as one ``(R, size)`` tensor of its
    rows' gradients (summed over the layer's calls)."""
    targets = problem.targets
    xs, parts = taps
    out: list[Any] = [None] * len(targets)
    for i, p in enumerate(projections(problem)):
        shape = tuple(targets[p.kernel].shape)
        calls = [pair[:2] for pair in zip(xs, dzs, parts) if pair[2] == i]
        lookup = None if summed else _lookup(p.rule, calls, shape)
        if lookup is not None:  # an embedding has no bias
            out[p.kernel] = lookup
            continue
        pairs = (
            [_factors(p.rule, x, dz, summed=summed) for x, dz in calls]
            if p.rule.factored()
            else []
        )
        ghost = bool(pairs) and layer_norms.ghost_pairs(
            sum(int(u.shape[1]) for u, _ in pairs),
            int(pairs[0][0].shape[-1]),
            int(pairs[0][1].shape[-1]),
            int(pairs[0][1].shape[1]),
        )
        if ghost:
            patches = tf.concat([u for u, _ in pairs], axis=1)
            cotangents = tf.concat([g for _, g in pairs], axis=2)
            out[p.kernel] = (patches, cotangents)
            bias = tf.reduce_sum(cotangents, axis=2)
            bias = tf.reshape(bias, (-1, bias.shape[-1]))
        else:
            found = [p.rule.gradients(x, dz, shape, summed=summed) for x, dz in calls]
            kernel = _summed([k for k, _ in found])
            out[p.kernel] = (tf.reshape(kernel, (tf.shape(kernel)[0], -1)),)
            bias = _summed([b for _, b in found])
        if p.bias is not None:
            out[p.bias] = (tf.reshape(bias, (tf.shape(bias)[0], -1)),)
    return [t for entry in out for t in entry]
