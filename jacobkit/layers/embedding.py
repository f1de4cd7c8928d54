"""``Embedding``: ``z[b, p] = W[ids[b, p]]``, a scatter of cotangents by id;
and keras_hub's ``ReversibleEmbedding``, whose reverse calls (the logits of a
language model's head, tied to the table) are ``z = x @ W^T``."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import tensorflow as tf

from jacobkit.layers import norms as layer_norms
from jacobkit.layers import tables
from jacobkit.layers.base import MaterializedNorms, Tapped, Weights


class EmbeddingRule(MaterializedNorms):
    """Closed forms of an ``Embedding`` layer (Keras 3 or ``tf_keras``).

    A row's gradient is non-zero only on the rows of the table whose ids occur
    in its example: ``dr/dW[v] = sum_{p: ids[b, p] = v} G[b, p]``. It is
    returned dense, ``(R, vocabulary, dim)``; the sparse alternative (the ids
    and the ``P`` cotangent rows per example, what ``tf.IndexedSlices`` holds)
    is ``P / vocabulary`` of the size, and is what a user summing them into
    an optimizer step would want; jacobkit's results are dense.
    """

    kind = "embedding"
    kernel_attrs = ("embeddings",)
    bias_attrs = ()

    def unsupported(self) -> str | None:
        why = super().unsupported()
        if why is not None:
            return why
        if getattr(self.layer, "sparse", False):
            return "it returns sparse tensors"
        return None

    def pre_activation(
        self, x: tf.Tensor, kernel: tf.Variable, bias: tf.Variable | None
    ) -> tf.Tensor:
        return tf.gather(kernel, tf.cast(x, tf.int32))

    def activation(self, z: tf.Tensor) -> tf.Tensor:
        return z

    def output_is_z(self) -> bool:
        return True

    def gradients(
        self,
        x: tf.Tensor,
        dz: tf.Tensor,
        kernel_shape: tuple[int, ...],
        *,
        summed: bool,
    ) -> tuple[tf.Tensor, tf.Tensor]:
        """``dz`` (``(B, K, ..., D)``) scattered into the table by the ids
        ``x`` (``(B, ...)``): ``(R, vocabulary, D)``, one segment sum."""
        vocabulary = kernel_shape[0]
        ids = _ids(x, dz.shape[0])  # (B, P)
        if summed:
            # (B * P, K, D): the cotangent rows of every position
            table = tf.math.unsorted_segment_sum(
                _by_position(dz, ids.shape[1]), tf.reshape(ids, (-1,)), vocabulary
            )  # (V, K, D)
            kernel = tf.transpose(table, (1, 0, 2))
        else:
            kernel = per_example_tables(ids, dz, vocabulary)
        count = kernel.shape[0]
        return kernel, tf.zeros((count, 0), dz.dtype)

    def norms(
        self,
        x: tf.Tensor,
        dz: tf.Tensor,
        *,
        summed: bool,
        map_chunks: Callable[..., list[tf.Tensor]],
        form: str | None = None,
    ) -> tuple[tf.Tensor, tf.Tensor]:
        """Per-example rows' norms without the ``(R, vocabulary, D)`` table:
        a row's gradient has one table row per distinct id of its example,
        the sum of that id's cotangent rows, so its squared norm is
        ``sum_v |sum_{p: ids[b, p] = v} G[b, k, p]|²``: the cotangents
        summed by id within each example (each position's segment is its id's
        first position there), ``B P K D`` adds and a ``(B, P, P)``
        comparison of ids, in place of writing ``B K V D`` numbers.

        NOTE (why). A tiny BERT's token table (vocabulary 1,000, 64 wide) at
        32 examples of 32 tokens: the dense per-example table is 8 MiB per
        call, and its norms took most of a clipped-sum call."""
        if summed or not x.dtype.is_integer or form is not None:
            return super().norms(x, dz, summed=summed, map_chunks=map_chunks, form=form)
        batch, rows, dim = dz.shape[0], dz.shape[1], dz.shape[-1]
        ids = _ids(x, batch)  # (B, P)
        positions = ids.shape[1]
        # ExpandDims and a constant of offsets: no strided slices, no range
        same = tf.cast(
            tf.equal(tf.expand_dims(ids, 2), tf.expand_dims(ids, 1)), tf.int32
        )
        first = tf.argmax(same, axis=-1, output_type=tf.int32)  # (B, P)
        segments = first + _offsets(batch, positions, first.dtype)
        data = _by_position(dz, positions)
        by_id = tf.math.unsorted_segment_sum(
            data, tf.reshape(segments, (-1,)), batch * positions
        )  # (B * P, K, D)
        squares = tf.reduce_sum(
            tf.square(tf.reshape(by_id, (batch, positions, rows, dim))), axis=(1, 3)
        )  # (B, K)
        return tf.reshape(tf.sqrt(squares), (-1,)), tf.zeros((batch * rows,), dz.dtype)

    def lookup_ids(self, x: tf.Tensor) -> tf.Tensor | None:
        if not x.dtype.is_integer:  # a reverse call's hidden states
            return None
        return _ids(x, x.shape[0])

    def forms_rows(self, x: tf.Tensor, dz: tf.Tensor, *, summed: bool) -> bool:
        """Only where :meth:`norms` forms the dense table (rows summed over
        the batch, or a reverse call): a per-example lookup's norms are
        sparse, and a clipped sum then scatters the scaled cotangents once,
        as a plain step does.

        NOTE (measured). The tiny BERT of ``benchmarks/reductions.py`` (32
        examples of 32 tokens, a 1,000 x 64 table, one core): forming the
        ``(32, 1000, 64)`` per-example tables, their norms and their
        weighted sum took 2.6 of the clipped sum's 20.8 ms."""
        return summed or not x.dtype.is_integer


def per_example_tables(ids: tf.Tensor, dz: tf.Tensor, vocabulary: int) -> tf.Tensor:
    """Each per-example row's gradient of the table, formed: the ids ``(B,
    P)`` and the cotangents ``dz`` (``(B, K, ..., D)``) -> ``(B * K,
    vocabulary, D)``, row-major, one segment sum (each example's cotangent
    rows scattered into its own copy of the table)."""
    batch, rows, dim = dz.shape[0], dz.shape[1], dz.shape[-1]
    own = ids + _offsets(batch, vocabulary, ids.dtype)  # example b's rows
    table = tf.math.unsorted_segment_sum(
        _by_position(dz, ids.shape[1]), tf.reshape(own, (-1,)), batch * vocabulary
    )  # (B * V, K, D)
    table = tf.reshape(table, (batch, vocabulary, rows, dim))
    return tf.reshape(
        tf.transpose(table, (0, 2, 1, 3)), (batch * rows, vocabulary, dim)
    )


def _ids(x: tf.Tensor, batch: int) -> tf.Tensor:
    """A lookup's input as int32 ids, one row of positions per example:
    ``(B, P)``."""
    return tf.reshape(tf.cast(x, tf.int32), (batch, -1))


def _by_position(dz: tf.Tensor, positions: int) -> tf.Tensor:
    """``dz`` ``(B, K, ..., D)`` as the cotangent rows of every position,
    ``(B * P, K, D)``."""
    batch, rows, dim = dz.shape[0], dz.shape[1], dz.shape[-1]
    by_example = tf.reshape(dz, (batch, rows, positions, dim))
    return tf.reshape(
        tf.transpose(by_example, (0, 2, 1, 3)), (batch * positions, rows, dim)
    )


#: a tied table's Gram-form norms cost this many times their multiply-adds
#: against the formed tables' (:meth:`ReversibleEmbeddingRule.shared_norms`).
#: NOTE (measured, ``benchmarks/tied_head.py``, the table's norms alone on a
#: GPT2CausalLM of vocabulary 2,000 and width 64, 16 examples, 2 loaded
#: cores, ``benchmarks/results/cpu/tied_head.md``): the Gram form took
#: 0.51x the formed tables' time at 8 tokens, 0.75x at 32, 0.91x at 128 and
#: 1.12x at 256 (two earlier runs: 0.54x, 0.65x, 0.93x at 64, 0.93-1.01x
#: at 128, 1.05x at 256), where ``norms.GRAM_WEIGHT`` (2, measured on a
#: convolution's einsums) put the crossover at 31 tokens: the Gram form's
#: work is one batched matmul of the logits' cotangents, the formed tables'
#: also writes and reads ``B K V D`` numbers. 0.5 puts it at about ``2 D``,
#: 124 tokens there.
TIED_GRAM_WEIGHT = 0.5


class ReversibleEmbeddingRule(EmbeddingRule):
    """keras_hub's ``ReversibleEmbedding``, called forward (ids: a lookup, as
    ``Embedding``) or in reverse (``x @ W^T``, the logits; ``tanh(z / c) * c``
    with a ``logit_soft_cap`` ``c``). A language model calls it both ways; the
    ``batch`` strategy then has a tap per call and sums their gradients. A
    reverse call's row has ``dr/dW[v] = sum_p G[b, p, v] x[b, p]``. The two
    kinds of call are told apart by their input: ids lack the feature axis
    (``x`` has one axis fewer than a row's ``z``).

    The norms of a row's gradient summed over both kinds of call are taken
    in the Gram form (:meth:`shared_norms`) wherever the per-example
    ``(vocabulary, D)`` tables would cost more or not fit in one chunk."""

    kind = "reversible_embedding"

    def unsupported(self) -> str | None:
        why = super().unsupported()
        if why is not None:
            return why
        if not getattr(self.layer, "tie_weights", True):
            return "its reverse weights are not tied to the table"
        return None

    def tapped_call(
        self,
        args: tuple,
        kwargs: dict,
        weights: Weights,
        watch: Callable[[tf.Tensor], tf.Tensor],
    ) -> tuple[Any, list[Tapped]]:
        x = args[0]
        ((kernel, _),) = weights
        if x.dtype.is_integer:
            tapped = Tapped(x, watch(tf.gather(kernel, x)))
            return tapped.z, [tapped]
        dtype = getattr(self.layer, "reverse_dtype", None) or kernel.dtype
        inputs = tf.cast(x, dtype)
        tapped = Tapped(
            inputs,
            watch(tf.matmul(inputs, tf.cast(kernel, dtype), transpose_b=True)),
        )
        cap = getattr(self.layer, "logit_soft_cap", None)
        output = tapped.z if cap is None else tf.tanh(tapped.z / cap) * cap
        return output, [tapped]

    def output_is_z(self) -> bool:
        return getattr(self.layer, "logit_soft_cap", None) is None

    def gradients(
        self,
        x: tf.Tensor,
        dz: tf.Tensor,
        kernel_shape: tuple[int, ...],
        *,
        summed: bool,
    ) -> tuple[tf.Tensor, tf.Tensor]:
        if x.shape.rank != dz.shape.rank - 1:  # ids: a forward call
            return super().gradients(x, dz, kernel_shape, summed=summed)
        vocabulary, dim = kernel_shape
        batch, rows = dz.shape[0], dz.shape[1]
        inputs = tf.reshape(tf.cast(x, dz.dtype), (batch, -1, dim))
        g = tf.reshape(dz, (batch, rows, -1, vocabulary))
        if summed:
            kernel = _summed_table(inputs, g)
        else:
            kernel = tables.reverse_tables(inputs, g)
        return kernel, tf.zeros((kernel.shape[0], 0), dz.dtype)

    def shared_gradients(
        self,
        calls: list[tuple[tf.Tensor, tf.Tensor]],
        kernel_shape: tuple[int, ...],
        *,
        summed: bool,
    ) -> tuple[tf.Tensor, tf.Tensor] | None:
        """Per-example rows' tables summed over the reverse calls and the
        lookups: the reverse calls' tables formed
        (:func:`jacobkit.layers.tables.reverse_tables`), then each lookup's
        cotangents added into them at its ids
        (:func:`jacobkit.layers.tables.lookups_added`), not a table of
        zeros of their own scattered into and added. Rows summed over the
        batch, or a table only looked up or only called in reverse:
        ``None``."""
        if summed:
            return None
        lookups = [(x, dz) for x, dz in calls if x.shape.rank != dz.shape.rank - 1]
        reverse = [(x, dz) for x, dz in calls if x.shape.rank == dz.shape.rank - 1]
        if not lookups or not reverse:
            return None
        vocabulary, dim = kernel_shape
        formed = [
            tables.reverse_tables(
                tf.reshape(tf.cast(x, dz.dtype), (dz.shape[0], -1, dim)),
                tf.reshape(dz, (dz.shape[0], dz.shape[1], -1, vocabulary)),
            )
            for x, dz in reverse
        ]
        kernel = formed[0] if len(formed) == 1 else tf.add_n(formed)
        for x, dz in lookups:
            kernel = tables.lookups_added(kernel, _ids(x, dz.shape[0]), dz)
        return kernel, tf.zeros((kernel.shape[0], 0), kernel.dtype)

    def reverse_inputs(self, x: tf.Tensor) -> tf.Tensor | None:
        if x.dtype.is_integer:  # ids: a forward call
            return None
        return tf.reshape(x, (x.shape[0], -1, self.weight("kernel").shape[-1]))

    def shared_norms(
        self,
        calls: list[tuple[tf.Tensor, tf.Tensor]],
        *,
        summed: bool,
        form: str | None = None,
    ) -> tuple[tf.Tensor, tf.Tensor] | None:
        """Per-example rows' norms of the table's gradient summed over its
        lookups and reverse calls, in the Gram form: each call's gradient is
        ``Σ_p a[p] c[p]ᵀ``, ``(vocabulary, D)``, with ``a`` the one-hot row
        of a lookup's id and ``c`` its cotangent ``(D,)``, or ``a`` a
        reverse call's cotangent at the logits ``(vocabulary,)`` and ``c``
        its input; so ``|Σ_i G_i|² = Σ_{i, j} Σ_{p, q} <a_i[p], a_j[q]>
        <c_i[p], c_j[q]>`` (:func:`_pair`): per example and row, ``P² V``
        multiply-adds for a reverse call against itself, a gather for a
        lookup against a reverse call, ``P² D`` elsewhere, and ``(B, K, P,
        P)`` held, never the ``(B, K, vocabulary, D)`` tables.

        Where those tables are fewer multiply-adds, weighted by
        :data:`TIED_GRAM_WEIGHT` (``w P² (D + K V)`` against ``K P D V``,
        ``P`` the reverse calls' positions: sequences longer than about
        ``D / w``), and fit in one chunk
        (:data:`~jacobkit.layers.norms.CHUNK_ELEMENTS`), ``None``: they are
        formed. Rows summed over the batch: ``None``."""
        if summed or form == "chunks":
            return None
        vocabulary, dim = (int(n) for n in self.weight("kernel").shape)
        batch, rows = int(calls[0][1].shape[0]), int(calls[0][1].shape[1])
        sides = [_side(x, dz, vocabulary, dim) for x, dz in calls]
        # the reverse calls' pairs dominate (P² V against a lookup's P² D)
        positions = sum(int(s[1].shape[-2]) for s in sides if s[0].dtype != tf.int32)
        gram = TIED_GRAM_WEIGHT * positions * positions * (dim + rows * vocabulary)
        cheaper = gram < rows * positions * dim * vocabulary
        formed = batch * rows * vocabulary * dim
        if form is None and not (cheaper or formed > layer_norms.CHUNK_ELEMENTS):
            return None
        squares = tf.add_n(
            [
                _pair(sides[i], sides[j]) * (1.0 if i == j else 2.0)
                for i in range(len(sides))
                for j in range(i, len(sides))
            ]
        )  # (B, K)
        kernel = tf.sqrt(tf.maximum(tf.reshape(squares, (-1,)), 0.0))
        return kernel, tf.zeros((batch * rows,), kernel.dtype)


#: one call of a tied table as ``Σ_p a[p] c[p]ᵀ``: a lookup's ids ``(B, P)``
#: and cotangents ``(B, K, P, D)``, or a reverse call's cotangents ``(B, K,
#: P, V)`` and inputs ``(B, P, D)``
_Side = tuple[tf.Tensor, tf.Tensor]


def _summed_table(inputs: tf.Tensor, g: tf.Tensor) -> tf.Tensor:
    """``einsum("bpd,bkpv->kvd")``: the reverse call's table gradient summed
    over the examples, ``(K, V, D)`` from inputs ``(B, P, D)`` and cotangents
    ``(B, K, P, V)``, as one product of the transposed inputs ``(D, B P)``
    by each row's cotangents ``(B P, V)``, then ``(K, D, V)`` transposed.

    NOTE (measured, one core, loaded): GPT-2's tied table (B=32, P=32,
    V=1,000, D=64, K=1) took 9.8 ms as the einsum with oneDNN off (13.7 of
    the clipped sum's 78 ms op time), 0.97 ms so; oneDNN on 2.2 -> 1.1 ms.
    TensorFlow's own kernels contract the einsum through a transposed
    product at a fraction of their rate; the inputs' transpose is small."""
    batch, rows, _, vocabulary = g.shape
    dim = inputs.shape[-1]
    across = tf.transpose(tf.reshape(inputs, (-1, dim)))  # (D, B P)
    per_row = tf.reshape(tf.transpose(g, (1, 0, 2, 3)), (rows, -1, vocabulary))
    return tf.transpose(tf.matmul(across, per_row), (0, 2, 1))


def _side(x: tf.Tensor, dz: tf.Tensor, vocabulary: int, dim: int) -> _Side:
    batch, rows = dz.shape[0], dz.shape[1]
    if x.shape.rank != dz.shape.rank - 1:  # ids (as gradients tells them)
        ids = _ids(x, batch)
        return ids, tf.reshape(dz, (batch, rows, ids.shape[1], dim))
    inputs = tf.reshape(tf.cast(x, dz.dtype), (batch, -1, dim))
    return tf.reshape(dz, (batch, rows, inputs.shape[1], vocabulary)), inputs


def _pair(one: _Side, other: _Side) -> tf.Tensor:
    """``Σ_{p, q} <a[p], a'[q]> <c[p], c'[q]>`` of two calls (:data:`_Side`),
    per example and row: ``(B, K)``."""
    lookup, lookup_other = one[0].dtype == tf.int32, other[0].dtype == tf.int32
    if lookup and lookup_other:  # (B, 1, P, Q): equal ids
        tables = tf.equal(one[0][:, None, :, None], other[0][:, None, None, :])
        tables = tf.cast(tables, one[1].dtype)
    elif lookup:  # the reverse call's cotangent at the lookup's id
        gathered = tf.gather(other[0], one[0], axis=3, batch_dims=1)  # (B,K,Q,P)
        tables = tf.transpose(gathered, (0, 1, 3, 2))
    elif lookup_other:
        tables = tf.gather(one[0], other[0], axis=3, batch_dims=1)  # (B, K, P, Q)
    else:
        tables = tf.einsum("bkpv,bkqv->bkpq", one[0], other[0])
    ends = ("bkpd" if lookup else "bpd") + "," + ("bkqd" if lookup_other else "bqd")
    features = tf.einsum(
        f"{ends}->{'bkpq' if lookup or lookup_other else 'bpq'}",
        one[1],
        other[1],
    )
    if not (lookup or lookup_other):
        features = features[:, None]
    return tf.reduce_sum(tables * features, axis=(2, 3))


def _offsets(batch: Any, step: Any, dtype: Any) -> tf.Tensor:
    """``step * b`` for each example ``b``, ``(B, 1)``: one constant where
    the batch and step are known (a range and its strided slice traced six
    graph ops)."""
    if isinstance(batch, int) and isinstance(step, int):
        return tf.constant(np.arange(batch)[:, None] * step, dtype=dtype)
    return step * tf.expand_dims(tf.range(batch), 1)
