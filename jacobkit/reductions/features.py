"""Each chunk of examples' per-row gradients in the form the Gram needs:
a layer's factors (its unfolded input and output cotangents) where pairs of
rows are cheaper from them, else the gradients flattened; and the inner
products of two chunks' rows from these forms.

NOTE (the ghost form). A factored kernel's row gradient is
``G_r = Σ_p U_p Δ_{r,p}ᵀ`` (``U`` the unfolded input of the row's example,
``P x I``; ``Δ`` its cotangents, ``P x O``), so
``<G_r, G_s> = Σ_{p,q} (U_p · U'_q) (Δ_{r,p} · Δ'_{s,q})``: two Gram
matrices over positions, multiplied elementwise and summed, never forming
``G`` (Opacus's ghost norm, between two examples instead of one with itself).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import tensorflow as tf

from jacobkit import engine, runtime, strategies
from jacobkit.batches import distribute, source
from jacobkit.layers import contract
from jacobkit.problem import Call, Slot, model_state
from jacobkit.problem.reduce import Factors
from jacobkit.strategies import reductions


@dataclass(frozen=True)
class Ghost:
    """A factored kernel's rows: ``patches`` ``(B, P, I)`` and
    ``cotangents`` ``(B, K, P, O)``, ``B * K`` rows."""

    patches: tf.Tensor
    cotangents: tf.Tensor

    @property
    def nbytes(self) -> int:
        return _nbytes(self.patches) + _nbytes(self.cotangents)


@dataclass(frozen=True)
class Flat:
    """Rows' gradients ``(R, size)``."""

    rows: tf.Tensor

    @property
    def nbytes(self) -> int:
        return _nbytes(self.rows)


Feature = Ghost | Flat


@dataclass(frozen=True)
class ChunkFeatures:
    """One chunk's rows, per target.

    Attributes:
        features: each target's :class:`Ghost` or :class:`Flat`, in order.
        num_rows: the chunk's rows (``B * K``, or ``K`` summed over it).
        strategy: what computed them (``"batch"``'s closed forms, or the
            strategy ``auto`` picked for the per-example Jacobians).
    """

    features: tuple[Feature, ...]
    num_rows: int
    strategy: str

    @property
    def nbytes(self) -> int:
        return sum(f.nbytes for f in self.features)

    def forms(self, names: tuple[str, ...]) -> dict[str, str]:
        """Each target's form: ``"ghost"`` or ``"materialized"``."""
        return {
            n: "ghost" if isinstance(f, Ghost) else "materialized"
            for n, f in zip(names, self.features, strict=True)
        }


def _nbytes(tensor: tf.Tensor) -> int:
    return int(tensor.shape.num_elements() or 0) * tensor.dtype.size


def of_chunk(call: Call, x: Any, chosen: Any) -> tuple[ChunkFeatures, Any]:
    """The chunk ``x``'s features, and its problem: by ``batch``'s closed
    forms where it serves every target, else from the per-example Jacobians
    of ``chosen`` (a strategy, or ``auto``)."""
    problem = call.problem(x)
    closed = strategies.REGISTRY["batch"]()
    if not _served(closed, problem):
        result = engine.run(problem, chosen)
        rows = problem.num_rows
        flat = tuple(
            Flat(tf.reshape(tf.convert_to_tensor(j), (rows, -1)))
            for j in result.jacobians.values()
        )
        return ChunkFeatures(flat, rows, result.strategy), problem
    tensors, _ = closed.run(problem.with_reduce(Factors()))
    return ChunkFeatures(_parsed(tensors), problem.num_rows, closed.name), problem


def of_chunk_on_replicas(
    call: Call, x: Any, chosen: Any, strategy: tf.distribute.Strategy
) -> tuple[ChunkFeatures, Any]:
    """The chunk ``x``'s features as :func:`of_chunk` gives them, its
    examples split into one contiguous piece per replica of ``strategy``
    (``distribute=``; one host): each replica computes its piece's with the
    same compiled computation (:class:`jacobkit.batches.distribute.Replicas`),
    and the pieces are joined in order (concatenated along the examples, or
    for rows summed over the batch, their positions concatenated and their
    gradients added). Returns them with the first piece's problem."""
    replicas = strategy.num_replicas_in_sync
    count = source.batch_size(x)
    edges = np.linspace(0, count, min(replicas, count) + 1).astype(int)
    pieces = [
        tf.nest.map_structure(lambda a, i=i: np.asarray(a)[edges[i] : edges[i + 1]], x)
        for i in range(len(edges) - 1)
    ]
    problem = call.problem(pieces[0])
    closed = strategies.REGISTRY["batch"]()
    served = _served(closed, problem)
    ran, name = closed, closed.name
    if served:
        problem = problem.with_reduce(Factors())
    else:
        ran = engine.planned(chosen, problem)
        name = ran.name
    size = source.batch_size(pieces[0])
    computed = distribute.Replicas(
        strategy,
        reductions.computation(ran, problem),
        summed=call.summed,
        batch_size=size,
    ).run(pieces)
    # per-example pieces were padded to the first's size: their rows trimmed
    trimmed = [
        [
            t if call.summed else t[: t.shape[0] // size * source.batch_size(piece)]
            for t in map(np.asarray, found or [])
        ]
        for piece, found in zip(pieces, computed, strict=True)
    ]
    joined = [
        _joined([tf.constant(part[k]) for part in trimmed], call.summed)
        for k in range(len(trimmed[0]))
    ]
    rows = problem.num_rows if call.summed else problem.num_rows // size * count
    if served:
        return ChunkFeatures(_parsed(joined), rows, name), problem
    flat = tuple(Flat(tf.reshape(j, (rows, -1))) for j in joined)
    return ChunkFeatures(flat, rows, name), problem


def _joined(parts: list[tf.Tensor], summed: bool) -> tf.Tensor:
    """One tensor of a chunk from its pieces': concatenated along the
    examples; rows summed over the batch have one leading row, the factors
    of their positions concatenated (ranks 3 and 4: along the positions) and
    their gradients added."""
    if not summed:
        return tf.concat(parts, axis=0)
    rank = parts[0].shape.rank
    if rank == 3:  # patches (1, B * P, I)
        return tf.concat(parts, axis=1)
    if rank == 4:  # cotangents (1, K, B * P, O)
        return tf.concat(parts, axis=2)
    return tf.add_n(parts)


def _served(closed: Any, problem: Any) -> bool:
    """Whether ``batch``'s closed forms serve every target of ``problem``:
    checked once per model and problem (the check traces a pass; measured on
    a tiny BERT classifier, 0.9 s of every 1.1 s call when it was not kept)."""
    kept = model_state(problem.model, Slot.COMPILED)
    key = (problem.key, "batch serves the targets")
    if key not in kept:
        try:
            closed.check(problem)
            kept[key] = True
        except ValueError:
            kept[key] = False
    served: bool = kept[key]
    return served


def _parsed(tensors: list[tf.Tensor]) -> tuple[Feature, ...]:
    """``contract.factors``' flat list: a ghost target's two tensors (ranks
    3 and 4), every other target's one (rank 2)."""
    found: list[Feature] = []
    k = 0
    while k < len(tensors):
        if tensors[k].shape.rank == 3:
            found.append(Ghost(tensors[k], tensors[k + 1]))
            k += 2
        else:
            found.append(Flat(tensors[k]))
            k += 1
    return tuple(found)


def inner_products(a: ChunkFeatures, b: ChunkFeatures) -> tf.Tensor:
    """``(R_a, R_b)``: the inner products of every row of ``a`` with every
    row of ``b``, summed over the targets, in float32: one compiled call
    (:func:`_compiled`) over the targets' tensors."""
    pairs = []
    for fa, fb in zip(a.features, b.features, strict=True):
        if isinstance(fa, Ghost) != isinstance(fb, Ghost):
            # the form follows the positions: rows summed over chunks of
            # different sizes may get different forms
            fa, fb = _flat(fa), _flat(fb)
        pairs.append((fa, fb))
    found: tf.Tensor = _compiled(_sum_of_pairs)(
        _kinds([fa for fa, _ in pairs]),
        [_tensors(fa) for fa, _ in pairs],
        [_tensors(fb) for _, fb in pairs],
    )
    return found


def inner_products_within(chunk: ChunkFeatures, count: int, total: int) -> tf.Tensor:
    """:func:`inner_products` of a chunk's first ``count`` examples' rows
    with the rest's (a chunk of ``total`` examples, per-example rows: each
    example's ``K`` in order), split inside the compiled call (split
    eagerly, its dozen slices cost more than the call they saved)."""
    found: tf.Tensor = _compiled(_split_pairs)(
        _kinds(chunk.features),
        [_tensors(f) for f in chunk.features],
        tf.constant(count),
        tf.constant(chunk.num_rows // total),
    )
    return found


def _kinds(features: Sequence[Feature]) -> tuple[str, ...]:
    """Each target's form, as the compiled products take it."""
    return tuple("ghost" if isinstance(f, Ghost) else "flat" for f in features)


def _tensors(feature: Feature) -> tuple[tf.Tensor, ...]:
    if isinstance(feature, Ghost):
        return (feature.patches, feature.cotangents)
    return (feature.rows,)


#: each target's tensors: a ghost form's two, a flat one's one
_Parts = list[tuple[tf.Tensor, ...]]


def _compiled(fn: Callable[..., tf.Tensor]) -> Any:
    """``fn`` compiled once per process and kept in :data:`jacobkit.runtime.
    PROCESS` (no model owns it: every Gram call's products share its
    traces). Eager, the products' 20 small ops took 1.6 ms of each 5.5 ms
    Gram call of notebook 07's MLP (100 x 1,000 examples). Shapes are read
    at run time (``reduce_retracing``: chunks of other sizes reuse the
    trace)."""
    return runtime.measured_once(
        ("compiled", __name__, fn.__name__),
        lambda: tf.function(fn, reduce_retracing=True, autograph=False),
    )


def _split_pairs(
    kinds: tuple[str, ...], parts: _Parts, count: tf.Tensor, per_example: tf.Tensor
) -> tf.Tensor:
    """:func:`_sum_of_pairs` of the first ``count`` examples of each
    target's tensors with the rest (a flat target's rows: ``count *
    per_example``)."""
    a: _Parts = []
    b: _Parts = []
    for kind, tensors in zip(kinds, parts, strict=True):
        cut = count if kind == "ghost" else count * per_example
        a.append(tuple(t[:cut] for t in tensors))
        b.append(tuple(t[cut:] for t in tensors))
    return _sum_of_pairs(kinds, a, b)


def _sum_of_pairs(kinds: tuple[str, ...], a: _Parts, b: _Parts) -> tf.Tensor:
    """The sum over the targets of each pair's inner products."""
    total = None
    for kind, ta, tb in zip(kinds, a, b, strict=True):
        if kind == "flat":
            part = tf.matmul(
                tf.cast(ta[0], tf.float32), tf.cast(tb[0], tf.float32), transpose_b=True
            )
        else:
            part = _ghost_pair(Ghost(*ta), Ghost(*tb))
        total = part if total is None else total + part
    assert total is not None, "at least one target"
    return total


def _ghost_pair(fa: Ghost, fb: Ghost) -> tf.Tensor:
    if fa.patches.shape[1] == 1 and fb.patches.shape[1] == 1:
        return _rank_one_pair(fa, fb)
    patches = tf.einsum("bpi,cqi->bcpq", fa.patches, fb.patches)
    cotangents = tf.einsum("bkpo,clqo->bkclpq", fa.cotangents, fb.cotangents)
    both = tf.einsum("bcpq,bkclpq->bkcl", patches, cotangents)
    shape = tf.shape(both)
    return tf.cast(tf.reshape(both, (shape[0] * shape[1], -1)), tf.float32)


def _rank_one_pair(fa: Ghost, fb: Ghost) -> tf.Tensor:
    """One position per example (a Dense layer on unbatched features): each
    row's gradient is ``a δᵀ``, so ``<a δᵀ, a' δ'ᵀ> = (a·a')(δ·δ')``, two
    matrix products. NOTE (why): the general einsums took 2 ms each for 100
    x 1,000 examples of notebook 07's MLP, most of a TracIn call."""
    inputs = tf.matmul(fa.patches[:, 0], fb.patches[:, 0], transpose_b=True)  # (B, C)
    a_shape, b_shape = tf.shape(fa.cotangents), tf.shape(fb.cotangents)
    units = a_shape[-1]
    outputs = tf.matmul(
        tf.reshape(fa.cotangents, (-1, units)),
        tf.reshape(fb.cotangents, (-1, units)),
        transpose_b=True,
    )
    outputs = tf.reshape(outputs, (a_shape[0], a_shape[1], b_shape[0], b_shape[1]))
    both = outputs * tf.cast(inputs, outputs.dtype)[:, None, :, None]
    return tf.cast(
        tf.reshape(both, (a_shape[0] * a_shape[1], b_shape[0] * b_shape[1])),
        tf.float32,
    )


def _flat(feature: Feature) -> Flat:
    """A ghost form's rows' gradients, formed: ``(B * K, I * O)``."""
    if isinstance(feature, Flat):
        return feature
    patches, cotangents = feature.patches, feature.cotangents
    formed = contract.per_example_matmul(patches, cotangents)  # (B, K, I, O)
    shape = formed.shape
    return Flat(tf.reshape(formed, (shape[0] * shape[1], -1)))
