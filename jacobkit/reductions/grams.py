"""``jk.gram``: the exact inner products between the per-example gradients
of two sets of examples (data attribution's TracIn and Grad-Cos, the
empirical NTK), without holding more than two chunks' gradients.

Both sets are read in chunks of examples. For each chunk each target's rows
are in one of three forms (:mod:`jacobkit.problem.reduction.products`), chosen per
target by predicted cost (:func:`jacobkit.layers.norms.ghost_pairs`, mixed
ghost clipping's rule): a Dense or convolution kernel whose rows' inner
products are cheaper from the layer's input and output cotangents is kept
as those factors (the ghost form); an embedding's per-example lookup as its
ids and cotangents, paired by the ids both sides hold
(:mod:`jacobkit.layers.lookups`);
every other target's rows are its gradients, formed by the ``batch``
strategy's closed forms or, where no closed form serves a target, by the
strategy ``auto`` picks. A rule predicts; the calls of one problem then time
that arrangement against every target's rows formed, and against the
per-example gradients materialized as ``jacobian()`` gives them and
multiplied, and keep the fastest (:mod:`jacobkit.reductions.arrangement`):
a Gram is never slower for long than materializing.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import tensorflow as tf

from jacobkit import planner, runtime
from jacobkit.batches import collect, distribute, passes, source
from jacobkit.memory import budget as budgets
from jacobkit.problem import Call, PerModel
from jacobkit.problem.loss import Loss
from jacobkit.reductions import arrangement, blocks
from jacobkit.reductions import features as feats
from jacobkit.reductions.arrangement import RULE, Arranged

#: what a chunk pair may hold without a memory budget, at least (fixed, not a
#: share of free memory: the chunking, and so the float32 sums, must not
#: depend on the machine's load); more where :data:`DEFAULT_CHUNK_EXAMPLES`
#: need it, up to :data:`MAX_DEFAULT_CHUNK_BYTES`
DEFAULT_CHUNK_BYTES = 256 * 2**20
#: without a memory budget, the budget is raised (up to
#: :data:`MAX_DEFAULT_CHUNK_BYTES`) for chunks of this many examples: every
#: pair of chunks computes one chunk's features again, so small chunks cost
#: a set's features many times over.
#: NOTE (measured, one core). The reductions benchmark's ``bert_small`` (4
#: layers of 256, 13 MiB of formed per-example rows), one batch of 32 with
#: itself: under 256 MiB, 7 chunks of at most 5 examples, 28 feature calls,
#: 1.77 s, 1.6x materializing the per-example gradients (which holds
#: 1.3 GiB); one chunk, 0.38 s (0.35x).
DEFAULT_CHUNK_EXAMPLES = 32
#: the most a default budget is raised to
MAX_DEFAULT_CHUNK_BYTES = 2 * 2**30
#: at most this many examples per chunk. NOTE (why not 32, as before): the
#: digits MLP of notebook 07 (2,410 parameters), 100 test x 1,000 training
#: examples: 32 per chunk made 132 feature calls, 0.6 s per checkpoint; one
#: chunk per set, 2 calls.
MAX_CHUNK_EXAMPLES = 1024


@dataclass(frozen=True)
class GramResult:
    """The Gram matrix of two sets' per-row gradients.

    Attributes:
        matrix: ``(rows_a, rows_b)`` float64: ``matrix[i, j] = <g_i, h_j>``,
            the inner product of row ``i`` of set ``a`` and row ``j`` of set
            ``b`` over every target together (rows in order: example-major,
            as ``jacobian()`` flattens ``rows_shape``). Rows summed over
            the batch (``outputs="features"``) are summed over the whole set.
        rows_shape_a, rows_shape_b: each set's rows, as ``jacobian()``'s.
        forms: each target's form: ``"ghost"`` (from the layer's input and
            output cotangents) or ``"materialized"``, as :attr:`arrangement`
            arranged them.
        strategy: what computed the rows (``"batch"``, or the strategy
            ``auto`` picked where no closed form serves every target).
        chunk_examples: examples per chunk.
        wall_time_s: the whole call.
        norms_a, norms_b: each set's rows' gradient norms over every
            target, float64, in the rows' order (``gram(norms=True)``; else,
            and for rows summed over each set, ``None``).
    """

    matrix: np.ndarray
    rows_shape_a: tuple[int, ...]
    rows_shape_b: tuple[int, ...]
    forms: dict[str, str]
    strategy: str
    chunk_examples: int
    wall_time_s: float
    norms_a: np.ndarray | None = None
    norms_b: np.ndarray | None = None
    #: the arrangement this call ran, the one kept, what the calls timed
    #: (:mod:`jacobkit.reductions.arrangement`)
    arrangement: Arranged = Arranged(RULE, None)

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        return self.matrix if dtype is None else self.matrix.astype(dtype)


def gram(
    model: Any,
    a: Any,
    b: Any = None,
    layer: Any = None,
    *,
    outputs: str | Callable[[Any], tf.Tensor] | Loss = "per_example",
    features: Sequence[int] | None = None,
    training: bool = False,
    output: int | str | None = None,
    strategy: str | Any = "auto",
    memory_budget: int | float | str | None = None,
    chunk_examples: int | None = None,
    progress: bool = True,
    distribute: tf.distribute.Strategy | None = None,
    norms: bool = False,
) -> GramResult:
    """The exact inner products between every row's gradient in ``a`` and
    every row's gradient in ``b`` (``b=None``: ``a`` with itself), summed
    over the targets: shape ``(rows_a, rows_b)``.

    Args:
        model: a Keras model (or any model ``jacobian()`` takes).
        a: an array (a tuple ``(x, y)`` or ``(x, y, w)`` for loss rows), or
            a dataset of such batches, read in chunks.
        b: the same, or ``None`` (``a`` with itself).
        layer: the targets, as ``jacobian()`` takes them; default every
            trainable variable of the model.
        outputs: ``"per_example"`` (default; rows ``(B, F)``: with every
            output feature, the empirical NTK), ``jk.Loss(loss_fn)`` (one
            row per example: TracIn, Grad-Cos), ``"full"``, or
            ``"features"`` (rows summed over each whole set).
        features: as in ``jacobian()``.
        training: as in ``jacobian()``.
        output: as in ``jacobian()``.
        strategy: computes the rows where ``batch``'s closed forms do not
            serve every target (default ``"auto"``).
        memory_budget: bytes (or ``"2GiB"``, a fraction of free memory) for
            two chunks' rows and their products; sets the chunk size.
        chunk_examples: examples per chunk (default: sized by the budget,
            or by :data:`DEFAULT_CHUNK_BYTES` raised for
            :data:`DEFAULT_CHUNK_EXAMPLES` per chunk up to
            :data:`MAX_DEFAULT_CHUNK_BYTES`, at most
            :data:`MAX_CHUNK_EXAMPLES`).
        progress: show a progress bar over the chunks of ``a``.
        distribute: a ``tf.distribute.MirroredStrategy`` (the GPUs, or
            logical CPU devices, of one host): each chunk's examples are
            split across its replicas, each computing its piece's rows with
            the same computation; the products are taken on the host. Several
            workers are refused.
        norms: also each row's gradient norm (:attr:`GramResult.norms_a`,
            ``norms_b``), from the same features: Grad-Cos's cosines
            without a second pass over either set.

    Returns:
        A :class:`GramResult`; ``np.asarray(result)`` is the matrix.

    Example:
        >>> import keras, numpy as np, jacobkit as jk
        >>> model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3)])
        >>> x = np.random.default_rng(0).normal(size=(5, 4)).astype("float32")
        >>> jk.gram(model, x).matrix.shape  # 5 examples x 3 outputs
        (15, 15)
    """
    start = time.perf_counter()
    if distribute is not None:
        _check_distribute(distribute)
    if layer is None:
        layer = _every_trainable(model)
    call = Call(
        model,
        layer,
        outputs=outputs,
        features=features,
        training=training,
        output=output,
        strategy=None,
    )
    allowed = _check_options(memory_budget, norms)
    chosen = _chosen(strategy, memory_budget)
    reading = collect.reading(call)
    sets = _sets(a, b, reading)
    size = _check_chunk(chunk_examples)
    with runtime.tensorflow_warnings():
        probe = sets[0].first(size or PROBE_EXAMPLES)
        if size is None:
            size = _sized(call, probe, allowed, chosen)
        run, matrix, arranged = _blocks(
            call,
            chosen,
            sets,
            size,
            probe,
            allowed,
            b is None,
            norms,
            progress,
            distribute,
        )
    norms_a, norms_b = run.set_norms()
    first, problem = run.first, run.problem
    assert first is not None and problem is not None, "the set has a chunk"
    return GramResult(
        matrix=matrix,
        rows_shape_a=sets[0].rows_shape(problem, call.summed),
        rows_shape_b=sets[1].rows_shape(problem, call.summed),
        forms=first.forms(problem.target_names),
        strategy=first.strategy,
        chunk_examples=size,
        wall_time_s=time.perf_counter() - start,
        norms_a=norms_a,
        norms_b=norms_b,
        arrangement=arranged,
    )


def _sets(a: Any, b: Any, reading: source.Reading) -> list[blocks.ExampleSet]:
    """The two sets of examples, ``a`` and ``b`` (``b=None``: ``a``)."""
    # a dataset is read once per chunk of the other set: each pass checked
    first_set = passes.checked(a, "gram(a=...)")
    first = blocks.ExampleSet(first_set, reading)
    if b is None and first.arrays is not None:
        # arrays with themselves: converted and checked once, not twice
        return [first, first]
    other_set = first_set if b is None else passes.checked(b, "gram(b=...)")
    return [first, blocks.ExampleSet(other_set, reading)]


def _blocks(
    call: Call,
    chosen: Any,
    sets: list[blocks.ExampleSet],
    size: int,
    probe: Any,
    allowed: int | None,
    symmetric: bool,
    norms: bool,
    progress: bool,
    distribute: tf.distribute.Strategy | None,
) -> tuple[blocks.Blocks, np.ndarray, arrangement.Arranged]:
    """The matrix, block by block, in the arrangement this problem's trial
    runs next, the call timed for it (:mod:`jacobkit.reductions.arrangement`;
    replicas run the rule's, untimed)."""
    trial = None
    if distribute is None:
        key = (call.key, chosen, _shapes(probe), size, symmetric, allowed, norms)
        trial = arrangement.trial(call.model, key)
    way = RULE if trial is None else trial.next()
    run = blocks.Blocks(
        call,
        chosen,
        sets,
        size,
        symmetric=symmetric,
        progress=progress,
        distribute=distribute,
        with_norms=norms,
        way=way,
    )
    began = time.perf_counter()
    matrix = run.matrix()
    took = time.perf_counter() - began
    if trial is None:
        return run, matrix, Arranged(way, way)
    limit = DEFAULT_CHUNK_BYTES if allowed is None else allowed
    first, problem = run.first, run.problem
    assert first is not None and problem is not None, "a chunk ran"
    trial.record(way, took, lambda: arrangement.applying(first, problem.targets, limit))
    return run, matrix, trial.arranged(way)


def _check_distribute(strategy: Any) -> None:
    distribute.check(strategy, out=None)
    if distribute.is_multi_worker(strategy):
        raise ValueError(
            "gram(distribute=MultiWorkerMirroredStrategy): several workers are "
            "not supported; use MirroredStrategy on one host (its GPUs or "
            "logical CPU devices), or call gram on each worker's share of a."
        )


def _every_trainable(model: Any) -> list[Any]:
    found = list(getattr(model, "trainable_variables", None) or [])
    if not found:
        raise ValueError(
            "gram(layer=None): the model has no trainable variables (yet): "
            "build it first (call it on a batch), or pass layer=."
        )
    return found


def _check_options(memory_budget: Any, norms: Any) -> int | None:
    """``memory_budget=`` in bytes (``None``: none), checked with ``norms=``."""
    if not isinstance(norms, bool):
        raise TypeError(f"gram(norms={norms!r}): expected True or False.")
    try:
        return None if memory_budget is None else budgets.parse_budget(memory_budget)
    except (TypeError, ValueError) as err:
        raise type(err)(f"gram(memory_budget={memory_budget!r}): {err}") from err


def _chosen(strategy: Any, memory_budget: Any) -> Any:
    """What computes the features (``auto`` under the budget: the closed
    forms where they serve every target)."""
    return planner.solver(strategy, memory_budget, None, True)


def _check_chunk(chunk_examples: Any) -> int | None:
    if chunk_examples is None:
        return None
    if isinstance(chunk_examples, bool) or not isinstance(chunk_examples, int):
        raise TypeError(
            f"gram(chunk_examples={chunk_examples!r}): expected a positive int."
        )
    if chunk_examples < 1:
        raise ValueError(f"gram(chunk_examples={chunk_examples}): must be >= 1.")
    return chunk_examples


_CHUNK_EXAMPLES = PerModel(
    "jk.gram: examples per chunk per call, solver, input shapes and budget"
)

#: examples whose features' shapes size the chunks (traced once per model,
#: problem, input shapes and budget): a default chunk's, whose trace the
#: first chunk then runs
PROBE_EXAMPLES = DEFAULT_CHUNK_EXAMPLES


def _sized(call: Call, probe: Any, allowed: int | None, chosen: Any) -> int:
    """:func:`_chunk_size` from the shapes of the features of ``probe`` (a
    first chunk of :data:`PROBE_EXAMPLES`, :func:`~jacobkit.reductions.
    features.shapes_of_chunk`), kept in the model's state: a repeated call
    (TracIn's checkpoints, many test sets) probes nothing, and builds no
    problem for it (0.16 ms of a 3 ms call on notebook 07's digits)."""
    kept = _CHUNK_EXAMPLES.of(call.model)
    key = (call.key, chosen, _shapes(probe), allowed)
    if key not in kept:
        first = feats.shapes_of_chunk(call, probe, chosen)
        kept[key] = _chunk_size(first, source.batch_size(probe), allowed)
    size: int = kept[key]
    return size


def _shapes(chunk: Any) -> tuple[tuple[int, ...], ...]:
    return tuple(tuple(np.shape(t)) for t in tf.nest.flatten(chunk))


def _chunk_size(first: feats.ChunkFeatures, examples: int, allowed: int | None) -> int:
    """Examples per chunk: as many as keep two chunks' rows and their
    pairwise products within half of the budget (measured per example on the
    first chunk), at most :data:`MAX_CHUNK_EXAMPLES`. Without a budget:
    :data:`DEFAULT_CHUNK_BYTES`, or what :data:`DEFAULT_CHUNK_EXAMPLES` per
    chunk need, up to :data:`MAX_DEFAULT_CHUNK_BYTES` (it depends on the
    model and the inputs' shapes, not on the machine)."""
    per_example = max(first.nbytes / max(examples, 1), 1.0)
    rows = max(first.num_rows // max(examples, 1), 1)
    pairs = _pair_bytes(first) / max(examples * examples, 1)
    # 2 n per_example + n^2 (pairs + rows^2 * 8) <= allowed / 2
    quadratic = pairs + rows * rows * 8
    linear = 2 * per_example
    if allowed is None:
        most = DEFAULT_CHUNK_EXAMPLES
        wanted = 2 * (linear * most + quadratic * most * most)
        allowed = int(min(max(wanted, DEFAULT_CHUNK_BYTES), MAX_DEFAULT_CHUNK_BYTES))
    n = (-linear + math.sqrt(linear * linear + 2 * quadratic * allowed)) / (
        2 * quadratic
    )
    if n < 1:
        raise ValueError(
            f"gram(memory_budget={budgets.format_bytes(allowed)}): one example's "
            f"rows take {budgets.format_bytes(int(per_example))}, more than the "
            "budget allows for two chunks and their products; raise the budget "
            "or pass fewer targets (layer=)."
        )
    # + 1e-9: a default budget sized for exactly n examples gives n, not n - 1
    return int(min(n + 1e-9, MAX_CHUNK_EXAMPLES))


def _pair_bytes(chunk: feats.ChunkFeatures) -> float:
    """The ghost forms' largest intermediate for the chunk with itself: a
    kernel's ``(B, K, P, B, K, P)`` products of positions; a lookup's rows'
    tables over the distinct ids of both sides (at most ``2 B P``, the
    vocabulary unknown here), ``(2 B K, 2 B P D)``, which its matching
    pairs, where they run, do not exceed
    (:func:`jacobkit.layers.lookups.pair_products`)."""
    found = 0.0
    for f in chunk.features:
        if isinstance(f, feats.Ghost):
            b, k, p = f.cotangents.shape[:3]
            found = max(found, 4.0 * b * b * k * k * p * p)
        elif isinstance(f, feats.Lookup):
            b, k, p, d = f.cotangents.shape
            found = max(found, 4.0 * (2 * b * k) * (2 * b * p) * d)
    return found
