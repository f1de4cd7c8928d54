"""The inner products of two chunks' rows from the forms the Gram takes
them in, per target (:mod:`.factors`, which any strategy computes: the
``batch`` strategy's closed forms give the factors, any other its rows):

- :class:`Ghost`, a factored kernel's unfolded input and cotangents;
- :class:`Lookup`, an embedding's ids and cotangents;
- :class:`Flat`, the rows' gradients formed.

NOTE (the ghost form). A factored kernel's row gradient is
``G_r = Σ_p U_p Δ_{r,p}ᵀ`` (``U`` the unfolded input of the row's example,
``P x I``; ``Δ`` its cotangents, ``P x O``), so
``<G_r, G_s> = Σ_{p,q} (U_p · U'_q) (Δ_{r,p} · Δ'_{s,q})``: two Gram
matrices over positions, multiplied elementwise and summed, never forming
``G`` (Opacus's ghost norm, between two examples instead of one with itself).
A lookup's ``U_p`` is the one-hot row of its id: ``U_p · U'_q`` is whether
the two ids are equal, and its pairs are taken from the ids the two sides
share (:func:`jacobkit.layers.lookups.pair_products`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import tensorflow as tf

from jacobkit.layers import contract, embedding, lookups
from jacobkit.layers import norms as layer_norms
from jacobkit.layers.base import squared_rows
from jacobkit.problem.reduction.factors import Feature, Flat, Ghost, Lookup


def kinds(features: Sequence[Feature]) -> tuple[str, ...]:
    """Each target's form, as the compiled products take it."""
    return tuple(_KINDS[type(f)] for f in features)


_KINDS = {Ghost: "ghost", Lookup: "lookup", Flat: "flat"}


def tensors_of(feature: Feature) -> tuple[tf.Tensor, ...]:
    """A feature's tensors, in its fields' order."""
    return tuple(feature)


#: each target's tensors: a ghost form's two, a flat one's one
_Parts = list[tuple[tf.Tensor, ...]]


#: each target's way of pairing a lookup's rows (``"pairs"``, ``"tables"``),
#: decided before the trace (:func:`jacobkit.layers.lookups.form_of`); ``None``
#: (or no forms at all): chosen in the compiled function from the ids
Forms = tuple[str | None, ...] | None


def lookup_form(
    ids_a: np.ndarray, ids_b: np.ndarray | None, rows_a: int, rows_b: int
) -> str:
    """The way a lookup's pairs take for these ids, decided before the
    trace (:func:`jacobkit.layers.lookups.form_of`)."""
    return lookups.form_of(ids_a, ids_b, rows_a, rows_b)


def split_pairs(
    kinds: tuple[str, ...],
    parts: _Parts,
    count: tf.Tensor,
    per_example: tf.Tensor,
    forms: Forms = None,
) -> tf.Tensor:
    """:func:`sum_of_pairs` of the first ``count`` examples of each
    target's tensors with the rest (a flat target's rows: ``count *
    per_example``)."""
    a: _Parts = []
    b: _Parts = []
    for kind, tensors in zip(kinds, parts, strict=True):
        cut = count * per_example if kind == "flat" else count
        a.append(tuple(t[:cut] for t in tensors))
        b.append(tuple(t[cut:] for t in tensors))
    return sum_of_pairs(kinds, a, b, forms)


def sum_of_pairs(
    kinds: tuple[str, ...], a: _Parts, b: _Parts, forms: Forms = None
) -> tf.Tensor:
    """The sum over the targets of each pair's inner products (a lookup's
    by ``forms``' way where one is given, :data:`Forms`)."""
    found = []
    ways = forms or (None,) * len(kinds)
    for kind, ta, tb, way in zip(kinds, a, b, ways, strict=True):
        if kind == "flat":
            found.append(_flat_pair(*(tf.cast(t, tf.float32) for t in (ta[0], tb[0]))))
        elif kind == "lookup":
            found.append(lookups.pair_products(*ta, *tb, form=way))
        else:
            found.append(_ghost_pair(Ghost(*ta), Ghost(*tb)))
    assert found, "at least one target"
    # one AddN: a chain of AddV2 was one op per target in every trace
    return found[0] if len(found) == 1 else tf.add_n(found)


def squared_norms(kinds: tuple[str, ...], parts: _Parts) -> tf.Tensor:
    """Each row's squared gradient norm over the targets, ``(R,)`` float32:
    a flat target's rows squared and summed; a ghost target's by its pairs
    of positions within the row's own example
    (:func:`jacobkit.layers.norms.ghost_squared`); a lookup's by its
    example's cotangents summed per id (:func:`jacobkit.layers.lookups.
    squared_norms`)."""
    total = None
    for kind, tensors in zip(kinds, parts, strict=True):
        if kind == "flat":
            part = squared_rows(tensors[0])
        elif kind == "lookup":
            part = lookups.squared_norms(*tensors)
        else:
            cotangents = tf.cast(tensors[1], tf.float32)  # (B, K, P, O)
            patches = tf.cast(tensors[0], tf.float32)
            positions = tf.matmul(patches, patches, transpose_b=True)  # (B, P, P)
            part = tf.reshape(layer_norms.ghost_squared(positions, cotangents), (-1,))
        total = part if total is None else total + part
    assert total is not None, "at least one target"
    return total


#: from this many numbers per formed row on, two sets' rows are paired by a
#: batched matmul of one batch (:func:`_flat_pair`)
WIDE_ROWS = 4096


def _flat_pair(a: tf.Tensor, b: tf.Tensor) -> tf.Tensor:
    """``a bᵀ`` of formed rows ``(R, size)`` and ``(S, size)``: ``(R, S)``.

    NOTE (measured, one core, AMD EPYC, TF 2.21). Under oneDNN a 2-D
    ``MatMul`` with ``transpose_b`` is slow where the shared axis is long
    against the rows (a Gram's shape): 32 rows of 16,384 (a BERT tiny FFN
    kernel's) with 32 took 1.54 ms, the same product as a ``BatchMatMulV2``
    of one batch 0.59 ms (65,536: 5.75 against 2.08 ms; 128 x 128 rows of
    16,384: 7.1 against 5.9 ms). Below :data:`WIDE_ROWS` numbers the two
    were within 10%, and with TensorFlow's own kernels within 4% at every
    size. ``jk.gram`` on BERT tiny pairs 43 formed targets so."""
    if a.shape[-1] is not None and a.shape[-1] >= WIDE_ROWS:
        # expand_dims and squeeze, not [None] and [0]: a strided slice is
        # four graph ops (its three constants), 144 of BERT tiny's first Gram
        wide = tf.expand_dims(a, 0)
        other = wide if b is a else tf.expand_dims(b, 0)
        return tf.squeeze(tf.matmul(wide, other, transpose_b=True), 0)
    return tf.matmul(a, b, transpose_b=True)


def _ghost_pair(fa: Ghost, fb: Ghost) -> tf.Tensor:
    if fa.patches.shape[1] == 1 and fb.patches.shape[1] == 1:
        return _rank_one_pair(fa, fb)
    patches = tf.einsum("bpi,cqi->bcpq", fa.patches, fb.patches)
    cotangents = tf.einsum("bkpo,clqo->bkclpq", fa.cotangents, fb.cotangents)
    return _as_rows(tf.einsum("bcpq,bkclpq->bkcl", patches, cotangents))


def _rank_one_pair(fa: Ghost, fb: Ghost) -> tf.Tensor:
    """One position per example (a Dense layer on unbatched features): each
    row's gradient is ``a δᵀ``, so ``<a δᵀ, a' δ'ᵀ> = (a·a')(δ·δ')``, two
    matrix products. NOTE (why): the general einsums took 2 ms each for 100
    x 1,000 examples of notebook 07's MLP, most of a TracIn call."""
    same = fb.patches is fa.patches and fb.cotangents is fa.cotangents
    # squeezes and one einsum: strided slices and dynamic shapes were four
    # graph ops each, 33 slices of BERT tiny's first Gram
    patches = tf.squeeze(fa.patches, 1)
    inputs = tf.matmul(  # (B, C)
        patches, patches if same else tf.squeeze(fb.patches, 1), transpose_b=True
    )
    ga = tf.squeeze(fa.cotangents, 2)  # (B, K, O)
    gb = ga if same else tf.squeeze(fb.cotangents, 2)
    outputs = tf.einsum("bko,clo->bkcl", ga, gb)
    b, c = _dims(inputs)
    weights = tf.reshape(tf.cast(inputs, outputs.dtype), (b, 1, c, 1))
    return _as_rows(outputs * weights)


def _as_rows(both: tf.Tensor) -> tf.Tensor:
    """Pairs ``(B, K, C, L)`` as the rows' matrix ``(B * K, C * L)``, in
    float32."""
    b, k, c, ell = _dims(both)
    rows = tf.reshape(both, (b * k, c * ell))
    return tf.cast(rows, tf.float32)


def _dims(tensor: tf.Tensor) -> list[Any]:
    """``tensor``'s axes, each an int where the trace knows it (a dynamic
    axis is a strided slice of its shape: four graph ops)."""
    static = tensor.shape.as_list()
    if all(d is not None for d in static):
        return static
    shape = tf.shape(tensor)
    return [d if d is not None else shape[i] for i, d in enumerate(static)]


def flat(feature: Feature, like: Feature) -> Flat:
    """A ghost form's rows' gradients, formed: ``(B * K, I * O)`` (a
    lookup's tables, as wide as ``like``'s formed rows)."""
    if isinstance(feature, Flat):
        return feature
    if isinstance(feature, Lookup):
        assert isinstance(like, Flat), "a lookup is paired with formed tables"
        return _tables(feature, int(like.rows.shape[-1]))
    patches, cotangents = feature.patches, feature.cotangents
    formed = contract.per_example_matmul(patches, cotangents)  # (B, K, I, O)
    shape = formed.shape
    return Flat(tf.reshape(formed, (shape[0] * shape[1], -1)))


def _tables(feature: Lookup, width: int) -> Flat:
    """A lookup's rows' tables, formed: ``(B * K, vocabulary * O)``."""
    cotangents = feature.cotangents
    units = cotangents.shape[-1]
    tables = embedding.per_example_tables(feature.ids, cotangents, width // units)
    return Flat(tf.reshape(tables, (-1, width)))
