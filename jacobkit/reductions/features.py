"""Each chunk of examples' per-row gradients in the form the Gram needs, as
the engine computes them for ``reduce=`` :class:`~jacobkit.problem.reduction.
Factors` (typed :data:`~jacobkit.problem.reduction.Feature` per target: a
layer's factors where the strategy ``auto`` plans has closed forms, else the
rows formed); and the inner products of two chunks' rows
(:mod:`jacobkit.problem.reduction.products`), one compiled call."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import tensorflow as tf

from jacobkit import runtime
from jacobkit.batches import distribute, source
from jacobkit.problem import Call, PerModel, Problem
from jacobkit.problem.reduction import Factors, Feature, Flat, Ghost, Lookup
from jacobkit.problem.reduction import products as pairs
from jacobkit.reductions import lookup_forms

__all__ = ["ChunkFeatures", "Feature", "Flat", "Ghost", "Lookup"]


@dataclass(frozen=True)
class ChunkFeatures:
    """One chunk's rows, per target.

    Attributes:
        features: each target's :class:`Ghost`, :class:`Lookup` or
            :class:`Flat`, in order.
        num_rows: the chunk's rows (``B * K``, or ``K`` summed over it).
        strategy: what computed them (``"batch"``'s closed forms, or the
            strategy ``auto`` planned where they do not serve every target).
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


def problem_of(call: Call, x: Any, formed: bool = False) -> Problem:
    """The chunk ``x``'s problem, reduced to the Gram's factors (``formed``:
    every target's rows formed, :class:`Factors`' ``formed``)."""
    # inspected as a reduced call's (eagerly where that can tell): the traced
    # inspecting pass was 1,044 of BERT tiny's 3,197 first-call graph ops
    return call.problem(x, reduced=True).with_reduction(Factors(formed=formed))


def of_chunk(
    call: Call, x: Any, chosen: Any, formed: bool = False
) -> tuple[ChunkFeatures, Problem]:
    """The chunk ``x``'s features, and its problem, as ``chosen`` (a
    strategy, or ``auto``) solves the Gram's factors."""
    problem = problem_of(call, x, formed)
    solution = chosen.solve(problem)
    found = ChunkFeatures(
        tuple(solution.output.values), problem.num_rows, solution.strategy.name
    )
    return found, problem


def shapes_of_chunk(call: Call, x: Any, chosen: Any) -> ChunkFeatures:
    """The chunk ``x``'s features as :func:`of_chunk` gives them, for their
    forms and sizes only (what sizes a Gram's chunks): traced, not run,
    and nothing held. Where the planned strategy computes the factors
    itself (closed forms), its computation traced on ``x`` (a first chunk
    of the same shape then runs that trace); else each target's formed rows
    ``(R, size)`` as specs.

    NOTE (measured, one core). The chunks were sized by running the
    features of a probe of 8 examples: its own trace, at a shape no chunk
    has, 1.0 s of a first Gram call on the reductions benchmark's BERT
    tiny (batch 32), and its rows held meanwhile."""
    problem = problem_of(call, x)
    ran = chosen.planned(problem)
    rows = problem.num_rows
    if not (ran.computes(problem) and ran.compiled):
        flat = tuple(
            Flat(tf.TensorSpec((rows, int(np.prod(t.shape))), t.dtype))
            for t in problem.targets
        )
        return ChunkFeatures(flat, rows, ran.name)
    factors: Any = ran.compiled_for(problem).fn
    traced = factors.get_concrete_function(problem.inputs).structured_outputs
    return ChunkFeatures(tuple(traced.values), rows, ran.name)


def with_products(
    call: Call,
    x: Any,
    chosen: Any,
    count: int | None = None,
    strategy: tf.distribute.Strategy | None = None,
    formed: bool = False,
) -> tuple[ChunkFeatures, tf.Tensor, Problem]:
    """:func:`of_chunk`, and a block of the inner products of the chunk's
    rows: with themselves ``(R, R)`` (``count=None``: a diagonal block of a
    Gram matrix), or its first ``count`` examples' rows with the rest's
    ``(R_a, R_b)`` (two sets' examples together). One compiled call with
    the features' own (on the replicas of ``strategy``: the features on
    each, :func:`of_chunk_on_replicas`, the products on the host).

    NOTE (measured, one core). As two calls the products' call took each
    target's tensors as its arguments, which TensorFlow inspects one by one
    on every call (41 targets on the reductions benchmark's BERT). One call:
    a batch of 32 with itself, BERT 21.2 -> 16.6 ms, the conv net 12.0 ->
    10.0 ms; notebook 07's TracIn (100 test x 1,000 training digits, 3
    checkpoints) 7.8 -> 6.2 ms, its first call 0.18 s more (the products
    are traced with each problem's factors, not once per process)."""
    total = source.batch_size(x)
    if strategy is not None:
        found, problem = of_chunk_on_replicas(call, x, chosen, strategy, formed)
        return found, _products(found, count, total), problem
    problem = problem_of(call, x, formed)
    ran = chosen.planned(problem)
    if not ran.compiled:  # an eager strategy: its features, then the products
        found, problem = of_chunk(call, x, ran, formed)
        return found, _products(found, count, total), problem
    forms = _forms(ran, problem, count)
    compiled = _with_products(ran, problem, count is not None, forms)
    if count is None:
        products, output = compiled(problem.inputs)
    else:
        per_example = problem.num_rows // total
        products, output = compiled(problem.inputs, tf.constant(count), per_example)
    found = ChunkFeatures(tuple(output.values), problem.num_rows, ran.name)
    return found, products, problem


def materialized(call: Call, x: Any, chosen: Any) -> tuple[ChunkFeatures, Problem]:
    """The chunk ``x``'s per-row gradients of every target as ``jacobian()``
    computes them (the unreduced problem, by the strategy ``chosen`` plans
    for it: ``auto``'s, or its disk cache's, pick), each flattened to
    :class:`Flat` ``(R, size)``: the Gram's materializing arrangement."""
    problem = call.problem(x)
    solution = chosen.planned(problem).solve(problem)
    rows = problem.num_rows
    flat = tuple(Flat(tf.reshape(v, (rows, -1))) for v in solution.output.values)
    return ChunkFeatures(flat, rows, solution.strategy.name), problem


def materialized_with_products(
    call: Call, x: Any, chosen: Any, count: int | None = None
) -> tuple[ChunkFeatures, np.ndarray, Problem]:
    """:func:`with_products` of the rows :func:`materialized` forms, as a
    user multiplying ``jacobian()``'s rows computes them: joined into one
    ``J`` ``(R, P)`` in NumPy, ``J Jᵀ`` (or the first ``count`` examples'
    rows against the rest's), float32.

    NOTE (measured, one core, AMD EPYC, loaded). The conv net's 32 rows of
    20,042 as TensorFlow's compiled products: best 1.1-1.3 ms oneDNN on,
    1.0-1.8 ms off (their medians 4-7 ms on a busy machine); NumPy's
    ``J @ J.T``: 0.45-0.48 ms either way."""
    found, problem = materialized(call, x, chosen)
    # each a Flat: its one tensor, the rows; in float32, as the compiled
    # products take every form (float16 rows multiplied in float16 would not)
    rows = [
        np.asarray(tf.cast(pairs.tensors_of(f)[0], tf.float32)) for f in found.features
    ]
    joined = np.concatenate(rows, axis=1)
    if count is None:
        return found, joined @ joined.T, problem
    cut = count * (problem.num_rows // source.batch_size(x))
    return found, joined[:cut] @ joined[cut:].T, problem


def _products(found: ChunkFeatures, count: int | None, total: int) -> tf.Tensor:
    """:func:`with_products`' block from features already computed."""
    if count is None:
        return inner_products(found, found)
    return inner_products_within(found, count, total)


_WITH_PRODUCTS = PerModel(
    "jk.gram: a strategy's factors and their products, one compiled call, "
    "per problem, strategy, split and the lookups' ways; where the lookups' "
    "ids come from, per problem and strategy"
)


def _forms(ran: Any, problem: Problem, count: int | None) -> pairs.Forms:
    """The lookup targets' ways for this call's inputs
    (:mod:`jacobkit.reductions.lookup_forms`), where their ids are known
    before the call: the sources read once per problem and strategy from
    the factors' trace (the trace the compiled call then runs nested)."""
    kept = _WITH_PRODUCTS.of(problem.model)
    # per input shapes too: the problem's key holds none (one compiled
    # function retraces per shape), and a trace's ids have its shapes
    shapes = tuple((tuple(t.shape), t.dtype) for t in tf.nest.flatten(problem.inputs))
    key = ("sources", problem.key, ran.key, shapes)
    if key not in kept:
        traced = ran.compiled_for(problem).fn.get_concrete_function(problem.inputs)
        kept[key] = (traced, lookup_forms.sources(traced, problem.inputs))
    traced, found = kept[key]
    return lookup_forms.of_inputs(found, traced, problem.inputs, count)


def _with_products(
    ran: Any, problem: Problem, split: bool = False, forms: pairs.Forms = None
) -> Any:
    """``ran``'s factors and their products in one compiled call, kept per
    model, problem, strategy and the lookups' ways (``forms``, traced alone:
    :data:`~jacobkit.problem.reduction.products.Forms`): ``inputs ->
    (products (R, R), the factors' Output)``, or where ``split``, ``(inputs,
    count, per_example) -> (the first count examples' rows against the
    rest's, the factors' Output)``
    (:func:`jacobkit.problem.reduction.products.split_pairs`)."""
    kept = _WITH_PRODUCTS.of(problem.model)
    key = (problem.key, ran.key, split, forms)
    if key not in kept:
        factors = ran.compiled_for(problem).fn

        def parts_of(inputs: Any) -> tuple[Any, tuple[str, ...], Any]:
            output = factors(inputs)
            found = tuple(output.values)
            return output, pairs.kinds(found), [pairs.tensors_of(f) for f in found]

        def both(inputs: Any) -> tuple[tf.Tensor, Any]:
            output, kinds, parts = parts_of(inputs)
            return pairs.sum_of_pairs(kinds, parts, parts, forms), output

        def apart(inputs: Any, count: Any, per_example: int) -> tuple[tf.Tensor, Any]:
            output, kinds, parts = parts_of(inputs)
            cut = pairs.split_pairs(
                kinds, parts, count, tf.constant(per_example), forms
            )
            return cut, output

        kept[key] = problem.function(apart if split else both)
    return kept[key]


def of_chunk_on_replicas(
    call: Call,
    x: Any,
    chosen: Any,
    strategy: tf.distribute.Strategy,
    formed: bool = False,
) -> tuple[ChunkFeatures, Problem]:
    """The chunk ``x``'s features as :func:`of_chunk` gives them, its
    examples split into one contiguous piece per replica of ``strategy``
    (``distribute=``; one host): each replica computes its piece's with the
    same compiled computation (:class:`jacobkit.batches.distribute.Replicas`),
    and the pieces are joined in order (:meth:`Factors.joined
    <jacobkit.problem.reduction.Factors.joined>`). Returns them with the
    first piece's problem."""
    replicas = strategy.num_replicas_in_sync
    count = source.batch_size(x)
    # the first piece the largest (array_split's): every piece is padded to
    # its size, for which the one computation is built
    sizes = [len(p) for p in np.array_split(np.arange(count), min(replicas, count))]
    edges = np.concatenate([[0], np.cumsum(sizes)]).astype(int)
    pieces = [
        tf.nest.map_structure(lambda a, i=i: np.asarray(a)[edges[i] : edges[i + 1]], x)
        for i in range(len(edges) - 1)
    ]
    problem = problem_of(call, pieces[0], formed)
    ran = chosen.planned(problem)
    size = source.batch_size(pieces[0])
    replicated = distribute.Replicas(
        strategy,
        ran.flat_computation(problem),
        summed=call.summed,
        batch_size=size,
    )
    computed = replicated.run(pieces)
    # the features' structure (which form each target takes)
    factors = ran.compiled_for(problem).fn
    structure = (
        factors.get_concrete_function(problem.inputs).structured_outputs
        if ran.compiled
        else factors(problem.inputs)
    ).values
    # per-example pieces were padded to the first's size: their rows trimmed
    trimmed = [
        tf.nest.pack_sequence_as(
            structure,
            [
                tf.constant(
                    t[: distribute.piece_rows(len(t), size, n, summed=call.summed)]
                )
                for t in map(np.asarray, found or [])
            ],
        )
        for n, found in zip(map(source.batch_size, pieces), computed, strict=True)
    ]
    kind = problem.reduction
    joined = tuple(
        kind.joined([piece[k] for piece in trimmed], summed=call.summed)
        for k in range(len(structure))
    )
    rows = distribute.piece_rows(problem.num_rows, size, count, summed=call.summed)
    return ChunkFeatures(joined, rows, ran.name), problem


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
    features_a = [fa for fa, _ in matched]
    features_b = None if a is b else [fb for _, fb in matched]
    found: tf.Tensor = _compiled(pairs.sum_of_pairs)(
        pairs.kinds(features_a),
        [pairs.tensors_of(fa) for fa, _ in matched],
        [pairs.tensors_of(fb) for _, fb in matched],
        lookup_forms.of_features(features_a, features_b),
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
        lookup_forms.within(chunk.features, count),
    )
    return found


def row_norms(chunk: ChunkFeatures) -> np.ndarray:
    """Each of the chunk's rows' gradient norm over the targets, ``(R,)``
    float64, from its features (:func:`jacobkit.problem.reduction.products.
    squared_norms`, one compiled call)."""
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
