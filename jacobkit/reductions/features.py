"""Each chunk of examples' per-row gradients in the form the Gram needs
(:mod:`jacobkit.reductions.pairs`): a layer's factors (its unfolded input
and output cotangents, or an embedding's ids and cotangents) where pairs of
rows are cheaper from them, else the gradients flattened; and the inner
products of two chunks' rows, one compiled call."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import tensorflow as tf

from jacobkit import engine, runtime, strategies
from jacobkit.batches import distribute, source
from jacobkit.problem import Call, Slot, model_state
from jacobkit.problem.reduce import Factors
from jacobkit.reductions import pairs
from jacobkit.reductions.pairs import Feature, Flat, Ghost, Lookup
from jacobkit.strategies import reductions


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
            n: "materialized" if isinstance(f, Flat) else "ghost"
            for n, f in zip(names, self.features, strict=True)
        }


def of_chunk(call: Call, x: Any, chosen: Any) -> tuple[ChunkFeatures, Any]:
    """The chunk ``x``'s features, and its problem: by ``batch``'s closed
    forms where it serves every target, else from the per-example Jacobians
    of ``chosen`` (a strategy, or ``auto``)."""
    problem = call.problem(x)
    closed = strategies.REGISTRY["batch"]()
    if not _served(closed, problem):
        return _of_jacobians(problem, chosen), problem
    tensors, _ = closed.run(problem.with_reduce(Factors()))
    return ChunkFeatures(_parsed(tensors), problem.num_rows, closed.name), problem


def shapes_of_chunk(call: Call, x: Any) -> ChunkFeatures:
    """The chunk ``x``'s features as :func:`of_chunk` gives them, for their
    forms and sizes only (what sizes a Gram's chunks): traced, not run,
    and nothing held. Where ``batch``'s closed forms serve every target,
    its factors' computation traced on ``x`` (a first chunk of the same
    shape then runs that trace); else each target's formed rows
    ``(R, size)`` as specs.

    NOTE (measured, one core). The chunks were sized by running the
    features of a probe of 8 examples: its own trace, at a shape no chunk
    has, 1.0 s of a first Gram call on the reductions benchmark's BERT
    tiny (batch 32), and its rows held meanwhile."""
    problem = call.problem(x)
    closed = strategies.REGISTRY["batch"]()
    rows = problem.num_rows
    if not _served(closed, problem):
        flat = tuple(
            Flat(tf.TensorSpec((rows, int(np.prod(t.shape))), t.dtype))
            for t in problem.targets
        )
        return ChunkFeatures(flat, rows, "auto")
    factors: Any = closed.compiled_for(problem.with_reduce(Factors())).fn
    traced = factors.get_concrete_function(problem.inputs).outputs
    return ChunkFeatures(_parsed(list(traced)), rows, closed.name)


def with_products(
    call: Call,
    x: Any,
    chosen: Any,
    count: int | None = None,
    strategy: tf.distribute.Strategy | None = None,
) -> tuple[ChunkFeatures, tf.Tensor, Any]:
    """:func:`of_chunk`, and a block of the inner products of the chunk's
    rows: with themselves ``(R, R)`` (``count=None``: a diagonal block of a
    Gram matrix), or its first ``count`` examples' rows with the rest's
    ``(R_a, R_b)`` (two sets' examples together). One compiled call where
    ``batch``'s closed forms serve every target, else the two steps (and
    on the replicas of ``strategy``, :func:`of_chunk_on_replicas`).

    NOTE (measured, one core). As two calls the products' call took each
    target's tensors as its arguments, which TensorFlow inspects one by one
    on every call (41 targets on the reductions benchmark's BERT). One call:
    a batch of 32 with itself, BERT 21.2 -> 16.6 ms, the conv net 12.0 ->
    10.0 ms; notebook 07's TracIn (100 test x 1,000 training digits, 3
    checkpoints) 7.8 -> 6.2 ms, its first call 0.18 s more (the products
    are traced with each problem's factors, not once per process)."""
    total = source.batch_size(x)
    if strategy is not None:
        found, problem = of_chunk_on_replicas(call, x, chosen, strategy)
        return found, _products(found, count, total), problem
    problem = call.problem(x)
    closed = strategies.REGISTRY["batch"]()
    if not _served(closed, problem):
        found = _of_jacobians(problem, chosen)
        return found, _products(found, count, total), problem
    compiled = _with_products(closed, problem, split=count is not None)
    if count is None:
        products, *tensors = compiled(problem.inputs)
    else:
        per_example = problem.num_rows // total
        products, *tensors = compiled(problem.inputs, tf.constant(count), per_example)
    found = ChunkFeatures(_parsed(tensors), problem.num_rows, closed.name)
    return found, products, problem


def _products(found: ChunkFeatures, count: int | None, total: int) -> tf.Tensor:
    """:func:`with_products`' block from features already computed."""
    if count is None:
        return inner_products(found, found)
    return inner_products_within(found, count, total)


def _of_jacobians(problem: Any, chosen: Any) -> ChunkFeatures:
    """Every target's rows flattened, from the per-example Jacobians that
    ``chosen`` computes."""
    result = engine.run(problem, chosen)
    rows = problem.num_rows
    flat = tuple(
        Flat(tf.reshape(tf.convert_to_tensor(j), (rows, -1)))
        for j in result.jacobians.values()
    )
    return ChunkFeatures(flat, rows, result.strategy)


def _with_products(closed: Any, problem: Any, split: bool = False) -> Any:
    """``closed``'s factors (``reduce=Factors()``) and their products in one
    compiled call, kept per model and problem: ``inputs -> [products (R,
    R), *the factors]``, or where ``split``, ``(inputs, count, per_example)
    -> [the first count examples' rows against the rest's, *the factors]``
    (:func:`jacobkit.reductions.pairs.split_pairs`)."""
    kept = model_state(problem.model, Slot.COMPILED)
    key = (problem.key, "factors and their products", split)
    if key not in kept:
        factors = closed.compiled_for(problem.with_reduce(Factors())).fn

        def parts_of(inputs: Any) -> tuple[list[tf.Tensor], tuple[str, ...], Any]:
            tensors = list(factors(inputs))
            parsed = _parsed(tensors)
            return tensors, pairs.kinds(parsed), [pairs.tensors_of(f) for f in parsed]

        def both(inputs: Any) -> list[tf.Tensor]:
            tensors, kinds, parts = parts_of(inputs)
            return [pairs.sum_of_pairs(kinds, parts, parts), *tensors]

        def apart(inputs: Any, count: Any, per_example: int) -> list[tf.Tensor]:
            tensors, kinds, parts = parts_of(inputs)
            cut = pairs.split_pairs(kinds, parts, count, tf.constant(per_example))
            return [cut, *tensors]

        kept[key] = problem.function(apart if split else both)
    return kept[key]


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
            t[: distribute.piece_rows(len(t), size, n, summed=call.summed)]
            for t in map(np.asarray, found or [])
        ]
        for n, found in zip(map(source.batch_size, pieces), computed, strict=True)
    ]
    joined = [
        _joined([tf.constant(part[k]) for part in trimmed], call.summed)
        for k in range(len(trimmed[0]))
    ]
    rows = distribute.piece_rows(problem.num_rows, size, count, summed=call.summed)
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
    3 and 4), a lookup's two (integer ids of rank 2, then rank 4), every
    other target's one (rank 2)."""
    found: list[Feature] = []
    k = 0
    while k < len(tensors):
        if tensors[k].shape.rank == 3:
            found.append(Ghost(tensors[k], tensors[k + 1]))
            k += 2
        elif tensors[k].dtype.is_integer:
            found.append(Lookup(tensors[k], tensors[k + 1]))
            k += 2
        else:
            found.append(Flat(tensors[k]))
            k += 1
    return tuple(found)


def inner_products(a: ChunkFeatures, b: ChunkFeatures) -> tf.Tensor:
    """``(R_a, R_b)``: the inner products of every row of ``a`` with every
    row of ``b``, summed over the targets, in float32: one compiled call
    (:func:`_compiled`) over the targets' tensors."""
    matched = []
    for fa, fb in zip(a.features, b.features, strict=True):
        if type(fa) is not type(fb):
            # the form follows the positions: rows summed over chunks of
            # different sizes (or sequences of other lengths) may get
            # different forms
            fa, fb = pairs.flat(fa, fb), pairs.flat(fb, fa)
        matched.append((fa, fb))
    found: tf.Tensor = _compiled(pairs.sum_of_pairs)(
        pairs.kinds([fa for fa, _ in matched]),
        [pairs.tensors_of(fa) for fa, _ in matched],
        [pairs.tensors_of(fb) for _, fb in matched],
    )
    return found


def inner_products_within(chunk: ChunkFeatures, count: int, total: int) -> tf.Tensor:
    """:func:`inner_products` of a chunk's first ``count`` examples' rows
    with the rest's (a chunk of ``total`` examples, per-example rows: each
    example's ``K`` in order), split inside the compiled call (split
    eagerly, its dozen slices cost more than the call they saved)."""
    found: tf.Tensor = _compiled(pairs.split_pairs)(
        pairs.kinds(chunk.features),
        [pairs.tensors_of(f) for f in chunk.features],
        tf.constant(count),
        tf.constant(chunk.num_rows // total),
    )
    return found


def row_norms(chunk: ChunkFeatures) -> np.ndarray:
    """Each of the chunk's rows' gradient norm over the targets, ``(R,)``
    float64, from its features (:func:`jacobkit.reductions.pairs.squared_norms`,
    one compiled call)."""
    squared = _compiled(pairs.squared_norms)(
        pairs.kinds(chunk.features), [pairs.tensors_of(f) for f in chunk.features]
    )
    return np.sqrt(np.maximum(squared.numpy().astype(np.float64), 0.0))


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
