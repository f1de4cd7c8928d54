"""The chunked computation behind :func:`jacobkit.gram`: each set of
examples read in chunks (:class:`ExampleSet`), and the matrix computed block
by block, chunk of ``a`` by chunk of ``b`` (:class:`Blocks`), or, for two
sets of arrays that are one chunk each, from one features call on both."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import tensorflow as tf

from jacobkit.batches import collect, passes, source
from jacobkit.problem import Call, arguments
from jacobkit.reductions import arrangement
from jacobkit.reductions import features as feats


@dataclass
class ExampleSet:
    """One set of examples, read in chunks again and again (a dataset is
    iterated afresh, each pass checked against the first:
    :class:`~jacobkit.batches.passes.Checked`; a one-shot iterator is read
    once and kept)."""

    inputs: Any
    reading: source.Reading
    kept: list[Any] | None = None
    #: a set of arrays as NumPy, checked once (``None`` for batches)
    arrays: Any = None
    #: the same arrays as the tensors they were converted to (``None`` for
    #: batches): a set of one chunk is that chunk, passed on as it is
    tensors: Any = None

    def __post_init__(self) -> None:
        if not arguments.is_batches(self.inputs):
            # labels as a Python list are one array, as jacobian() reads them
            self.tensors = arguments.to_tensors(self.inputs)
            self.arrays = tf.nest.map_structure(np.asarray, self.tensors)
            arguments.check_examples(self.arrays)
            _check_examples(self.arrays, None)
        elif not isinstance(
            self.inputs, (tf.data.Dataset, source.batches, passes.Checked)
        ):
            # a generator: read it once, as NumPy, and keep the batches
            self.kept = list(source.iterate(self.inputs, None, self.reading))
            if not self.kept:
                raise ValueError("gram(a=..., b=...): a set has no examples.")

    def first(self, size: int) -> Any:
        return next(self.chunks(size))

    def chunks(self, size: int) -> Iterator[Any]:
        """Chunks of at most ``size`` examples, in order: a set of arrays of
        at most ``size`` examples is one chunk, its tensors as converted
        and checked once (:meth:`__post_init__`).

        NOTE (measured, one core, AMD EPYC, oneDNN on, loaded machine,
        paired in one process). Sliced from the NumPy arrays, the chunk was
        checked again and converted to tensors a second time by its
        problem, every call: the reductions benchmark's conv net, a batch of
        32 with itself, 0.95x (wall; 0.97x CPU time) the call that did, the
        same matrix bit for bit."""
        if self.tensors is not None and source.batch_size(self.arrays) <= size:
            yield self.tensors
            return
        for k, batch in enumerate(self._batches()):
            _check_examples(batch, k)
            yield from source.batches(batch, size)

    def _batches(self) -> Iterator[Any]:
        if self.kept is not None:
            yield from self.kept
        elif self.arrays is None:
            yield from source.iterate(self.inputs, None, self.reading)
        else:
            yield self.arrays

    def rows_shape(self, problem: Any, summed: bool) -> tuple[int, ...]:
        if summed:
            return tuple(problem.rows_shape)
        examples = sum(source.batch_size(b) for b in self._batches())
        return (examples, *problem.rows_shape[1:])


def _check_examples(arrays: Any, batch: int | None) -> None:
    """Refuse a set whose arrays (``x``, ``y``, ``sample_weight``) hold other
    numbers of examples, or a scalar (an unbatched dataset's label)."""
    shapes = [tuple(np.shape(a)) for a in tf.nest.flatten(arrays)]
    where = "a set" if batch is None else f"batch {batch} of a set"
    if any(not shape for shape in shapes):
        raise ValueError(
            f"gram(a=..., b=...): {where} holds a scalar (shapes {shapes}); each "
            "needs a batch axis, shape (B, ...). Is the tf.data set unbatched? "
            "Call dataset.batch(32) (any size) before passing it."
        )
    if len({shape[0] for shape in shapes}) > 1:
        raise ValueError(
            f"gram(a=..., b=...): {where} holds arrays of shapes {shapes}, whose "
            "first axes differ; x, y and sample_weight need one entry per example."
        )


@dataclass
class Blocks:
    """The blocks of the matrix, chunk of ``a`` by chunk of ``b``."""

    call: Call
    chosen: Any
    sets: list[ExampleSet]
    size: int
    symmetric: bool
    progress: bool
    distribute: tf.distribute.Strategy | None = None
    #: also each row's gradient norm, per set (``gram(norms=True)``)
    with_norms: bool = False
    #: how the rows are arranged (:mod:`jacobkit.reductions.arrangement`):
    #: the factors' cost rule's, every target's rows formed, or materialized
    #: as ``jacobian()`` gives them
    way: str = arrangement.RULE
    blocks: dict[tuple[int, int], np.ndarray] = field(default_factory=dict)
    #: each set's rows' norms, chunk by chunk (with :attr:`with_norms`)
    norms: tuple[list[np.ndarray], list[np.ndarray]] = field(
        default_factory=lambda: ([], [])
    )
    #: the first chunk of ``a``'s features (their forms, what computed them)
    first: feats.ChunkFeatures | None = None
    #: the first features call's problem (the rows' shape, the targets' names)
    problem: Any = None

    def matrix(self) -> np.ndarray:
        from tqdm import tqdm

        together = self._together()
        if together is not None:
            return together
        rows_a: list[int] = []
        bar = tqdm(
            unit="chunk",
            desc="gram",
            delay=1.0,
            disable=collect.progress_disabled(self.progress),
            file=sys.stderr,
        )
        try:
            for i, xa in enumerate(self.sets[0].chunks(self.size)):
                fa, own = self._features_with_itself(xa)
                if self.first is None:
                    self.first = fa
                self._norms(0, fa)
                rows_a.append(fa.num_rows)
                for j, xb in enumerate(self.sets[1].chunks(self.size)):
                    if self.symmetric and j < i:
                        continue
                    if own is not None and i == j:
                        block = own
                    else:
                        fb = self._features(xb)
                        if i == 0 and not self.symmetric:
                            self._norms(1, fb)
                        block = feats.inner_products(fa, fb)
                    self.blocks[i, j] = np.asarray(block, np.float64)
                bar.update(1)
        finally:
            bar.close()
        return self._assembled(rows_a)

    def _together(self) -> np.ndarray | None:
        """Two sets of arrays, each one chunk: their features from one call
        on both, split (per-row values are the same; the memory is that of
        a chunk of each, as streamed; each call costs its fixed part once:
        0.7 of a 3.7 ms Gram call between notebook 07's 100 test and 1,000
        training digits); ``None`` where a set is streamed."""
        a, b = self.sets
        if self.symmetric or self.call.summed or a.arrays is None or b.arrays is None:
            return None
        count, other = source.batch_size(a.arrays), source.batch_size(b.arrays)
        if max(count, other) > self.size:
            return None  # a set of several chunks: streamed
        try:
            tf.nest.assert_same_structure(a.arrays, b.arrays)
        except (ValueError, TypeError):
            return None
        if any(
            np.shape(u)[1:] != np.shape(v)[1:]
            for u, v in zip(tf.nest.flatten(a.arrays), tf.nest.flatten(b.arrays))
        ):
            return None  # other example shapes (sequence lengths): apart
        both = tf.nest.map_structure(
            lambda u, v: np.concatenate([u, v]), a.arrays, b.arrays
        )
        found, block = self._with_block(both, count)
        self.first = found
        if self.with_norms:
            norms = feats.row_norms(found)
            cut = found.num_rows // (count + other) * count
            self.norms[0].append(norms[:cut])
            self.norms[1].append(norms[cut:])
        return np.asarray(block, np.float64)

    def _norms(self, which: int, chunk: feats.ChunkFeatures) -> None:
        if self.with_norms and not self.call.summed:
            self.norms[which].append(feats.row_norms(chunk))

    def set_norms(self) -> tuple[np.ndarray | None, np.ndarray | None]:
        """Each set's rows' gradient norms, in order (``None`` without
        :attr:`with_norms`, or for rows summed over each set)."""
        if not self.with_norms or self.call.summed:
            return None, None
        a = np.concatenate(self.norms[0])
        return a, a if self.symmetric else np.concatenate(self.norms[1])

    def _features_with_itself(self, x: Any) -> tuple[feats.ChunkFeatures, Any]:
        """A chunk of ``a``'s features, and where the sets are one (a
        symmetric matrix), its diagonal block with them."""
        if not self.symmetric:
            return self._features(x), None
        return self._with_block(x)

    def _with_block(
        self, x: Any, count: int | None = None
    ) -> tuple[feats.ChunkFeatures, Any]:
        """A chunk's features and a block of their products
        (:func:`~jacobkit.reductions.features.with_products`)."""
        block: Any  # a tensor, or the materializing arrangement's NumPy J Jᵀ
        if self.way == arrangement.MATERIALIZED:
            found, block, problem = feats.materialized_with_products(
                self.call, x, self.chosen, count
            )
        else:
            found, block, problem = feats.with_products(
                self.call, x, self.chosen, count, self.distribute, self._formed
            )
        if self.problem is None:
            self.problem = problem
        return found, block

    def _features(self, x: Any) -> feats.ChunkFeatures:
        if self.way == arrangement.MATERIALIZED:
            found, problem = feats.materialized(self.call, x, self.chosen)
        elif self.distribute is not None:
            found, problem = feats.of_chunk_on_replicas(
                self.call, x, self.chosen, self.distribute, self._formed
            )
        else:
            found, problem = feats.of_chunk(self.call, x, self.chosen, self._formed)
        if self.problem is None:
            self.problem = problem
        return found

    @property
    def _formed(self) -> bool:
        return self.way == arrangement.FORMED

    def _assembled(self, rows_a: list[int]) -> np.ndarray:
        if self.symmetric:
            for (i, j), block in list(self.blocks.items()):
                self.blocks[j, i] = block.T
        rows_b = rows_a
        if not self.symmetric:
            count = 1 + max(j for _, j in self.blocks)
            rows_b = [self.blocks[0, j].shape[1] for j in range(count)]
        if self.call.summed:  # rows summed over the whole set: sum the blocks
            return sum(self.blocks.values())  # type: ignore[return-value]
        return np.block(
            [
                [self.blocks[i, j] for j in range(len(rows_b))]
                for i in range(len(rows_a))
            ]
        )
