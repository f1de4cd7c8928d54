"""``batch``'s factors for ``jk.gram``: a layer's unfolded input and
cotangents where pairs of rows are cheaper from them, an embedding's ids and
cotangents, else the rows' gradients formed."""

from __future__ import annotations

import math
from typing import Any

import tensorflow as tf

from jacobkit.layers import lookups
from jacobkit.layers import norms as layer_norms
from jacobkit.layers.base import UnfoldedMatmul
from jacobkit.problem import Problem
from jacobkit.problem.reduction import Factors, Flat, Ghost, Lookup, Output
from jacobkit.strategies.batch.contract import (
    Cotangents,
    Taps,
    added,
    by_position,
    no_autograph,
)
from jacobkit.strategies.batch.forward import projections

KIND = Factors


def unfolded(rule: Any, x: Any, dz: Any, *, summed: bool) -> tuple[Any, Any]:
    """A factored part's unfolded input ``(B, P, I)`` and cotangents ``(B,
    K, P, O)`` from its tap ``x`` and ``dz`` (``(B, K, *z.shape[1:])``); rows
    summed over the batch see one example of ``B * P`` positions."""
    return by_position(rule.unfold(x), dz, summed=summed)


def _lookup(rule: Any, calls: list[Any], shape: tuple[int, ...]) -> Any:
    """A table's one lookup call as ``jk.gram``'s ghost form, its ids ``(B,
    P)`` and cotangents ``(B, K, P, O)`` (paired from the ids both sides
    hold: :mod:`jacobkit.layers.lookups`), unless the table has no more rows
    than an example has positions
    (:func:`jacobkit.layers.lookups.formed_cheaper`); else ``None``."""
    if len(calls) != 1:
        return None
    ((x, dz),) = calls
    ids = rule.lookup_ids(x)
    if ids is None or lookups.formed_cheaper(int(ids.shape[1]), int(shape[0])):
        return None
    return by_position(ids, dz, summed=False)


@no_autograph
def contract(
    problem: Problem, taps: Taps, cotangents: Cotangents, *, summed: bool
) -> Output:
    """``jk.gram``'s view of every row's gradient, in the order of the
    targets: a factored kernel where :func:`jacobkit.layers.norms.ghost_pairs`
    says pairs are cheaper from its factors, as two tensors (its unfolded
    input ``(B, P, I)`` and cotangents ``(B, K, P, O)``, a layer's calls
    side by side along ``P``); an embedding's per-example lookup likewise,
    its ids ``(B, P)`` (integers) in place of the one-hot patches
    (:func:`_lookup`); every other target as one ``(R, size)`` tensor of its
    rows' gradients (summed over the layer's calls): each a
    :data:`~jacobkit.problem.reduction.Feature`. ``Factors(formed=True)``:
    every target's rows formed (the arrangement ``jk.gram`` times against
    the cost rule's).

    NOTE (why a tied table's rows are formed). A causal LM's token table,
    looked up and called in reverse for the logits, has no factors of one
    kind; its pairs in a Gram form would cost ``P² V`` per pair of rows
    (the logits' cotangents against each other at every pair of positions)
    against ``V D`` for the pair formed, plus ``P V D`` per row once:
    cheaper only for sequences shorter than about ``sqrt(D)`` tokens. A
    norm, a row against itself, has no such saving
    (``ReversibleEmbeddingRule.shared_norms`` takes it in the Gram form)."""
    targets = problem.targets
    kind = problem.reduction
    formed = isinstance(kind, Factors) and kind.formed
    xs, parts = taps
    dzs = cotangents.every_row()
    out: list[Any] = [None] * len(targets)
    for i, p in enumerate(projections(problem)):
        shape = tuple(targets[p.kernel].shape)
        calls = [pair[:2] for pair in zip(xs, dzs, parts) if pair[2] == i]
        lookup = None if summed or formed else _lookup(p.rule, calls, shape)
        if lookup is not None:  # an embedding has no bias
            out[p.kernel] = Lookup(*lookup)
            continue
        sizes = (
            None
            if formed or not p.rule.factored()
            else _factor_sizes(p.rule, calls, shape, summed=summed)
        )
        pairs = [] if sizes is None else sizes[1]
        ghost = sizes is not None and layer_norms.ghost_pairs(*sizes[0])
        if ghost:
            if not pairs:
                pairs = [unfolded(p.rule, x, dz, summed=summed) for x, dz in calls]
                assert sizes is not None and _sizes_of(pairs) == sizes[0], (
                    "a rule's patches as its static shapes say"
                )
            # one call's factors as they are (a concat of one is an Identity
            # and its axis constant)
            patches = _joined([u for u, _ in pairs], axis=1)
            by_positions = _joined([g for _, g in pairs], axis=2)
            out[p.kernel] = Ghost(patches, by_positions)
            bias = tf.reduce_sum(by_positions, axis=2)
            bias = tf.reshape(bias, (-1, bias.shape[-1]))
        else:
            shared = p.rule.shared_gradients(calls, shape, summed=summed)
            found = (
                [p.rule.gradients(x, dz, shape, summed=summed) for x, dz in calls]
                if shared is None
                else [shared]
            )
            kernel = added([k for k, _ in found])
            out[p.kernel] = Flat(_flat_rows(kernel))
            bias = added([b for _, b in found])
        if p.bias is not None:
            out[p.bias] = Flat(_flat_rows(bias))
    return Output(tuple(out))


def _factor_sizes(
    rule: Any, calls: list[Any], shape: tuple[int, ...], *, summed: bool
) -> tuple[tuple[int, int, int, int], list[Any]]:
    """The sizes :func:`jacobkit.layers.norms.ghost_pairs` weighs for a
    factored part (its calls' positions, the patches' and cotangents' widths,
    the rows per example), and its unfolded pairs where they were made for
    them. A rule whose patches are one matmul's (:class:`UnfoldedMatmul`:
    Dense, Conv1D, Conv2D) has them from the static shapes, its kernel
    ``(..., O)`` seen as ``(I, O)`` and ``z``'s positions its patches': the
    patches are then unfolded only for the Gram form (unfolded and left
    unused, they traced a convolution or gather and its reshapes per
    target, and its rows' gradients unfolded them again)."""
    if isinstance(rule, UnfoldedMatmul):
        positions = [math.prod(int(n) for n in dz.shape[2:-1]) for _, dz in calls]
        batch, rows = int(calls[0][1].shape[0]), int(calls[0][1].shape[1])
        each = sum(positions) * (batch if summed else 1)
        return (each, math.prod(shape[:-1]), int(shape[-1]), rows), []
    pairs = [unfolded(rule, x, dz, summed=summed) for x, dz in calls]
    return _sizes_of(pairs), pairs


def _sizes_of(pairs: list[Any]) -> tuple[int, int, int, int]:
    """:func:`_factor_sizes` read from unfolded pairs."""
    return (
        sum(int(u.shape[1]) for u, _ in pairs),
        int(pairs[0][0].shape[-1]),
        int(pairs[0][1].shape[-1]),
        int(pairs[0][1].shape[1]),
    )


def _joined(found: list[Any], axis: int) -> Any:
    return found[0] if len(found) == 1 else tf.concat(found, axis=axis)


def _flat_rows(rows: Any) -> Any:
    """``(R, ...)`` rows as ``(R, size)``, by a reshape to a static shape
    where the row count is known (``tf.shape(rows)[0]`` built a Shape, a
    strided slice with its three constants and a Pack per target: 195
    constants of BERT tiny's first ``jk.gram``)."""
    if rows.shape[0] is None:
        return tf.reshape(rows, (tf.shape(rows)[0], -1))
    return tf.reshape(rows, (int(rows.shape[0]), -1))
