"""A table lookup's rows in ``jk.gram``'s Gram form: the inner products of
two sets' per-example table gradients from their ids and cotangents, never
the ``(vocabulary, D)`` tables.

Row ``(b, k)``'s gradient of the table is ``S_bk[v] = Σ_{p: ids[b, p] = v}
G[b, k, p]`` (``G`` its cotangents at the looked-up rows), so
``<S_bk, S'_cl> = Σ_v <S_bk[v], S'_cl[v]>``: only ids met on both sides
count. Two ways, chosen from the ids themselves: before the trace where
the ids are at hand (:func:`form_of`, only the chosen way traced), else on
every call inside the compiled function (:func:`pair_products`):

- **tables over the distinct ids**: both sides' ids numbered ``0 .. U-1``
  (``U`` the ids the two sides hold, at most ``min(vocabulary, B P + C
  Q)``), each row's ``(U, D)`` table formed by one segment sum, the pairs
  one matrix product: a formed table's work over ``U`` ids instead of the
  vocabulary (for positions, ``U = T``: the cotangents themselves);
- **matching pairs**: each example's cotangents summed by id (its distinct
  ids), then every pair of the two sides' entries with the same id (found
  by sorting one side's ids), gathered and multiplied: ``N (K + L + K L)
  D`` for ``N`` matching pairs, which a vocabulary much larger than a
  batch's ids keeps near ``B P + C Q`` (at most ``B C min(P, Q)``).

NOTE (why not the ids-equality mask). ``Σ_{p, q} [ids[b, p] = ids'[c, q]]
<G[b, p], G'[c, q]>`` as one ``(B P, D) x (D, C Q)`` product, masked and
summed over ``(p, q)`` blocks, costs ``B C P Q D``: BERT tiny's 32 x 32
tokens against a 1,000 x 64 table, as much as the formed tables' pairs.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import tensorflow as tf

#: the matching pairs' gathered, multiplied and summed numbers cost this
#: many times one multiply-add of the distinct-id tables' matrix product
#: (their written numbers the same as one), as :func:`pairs_chosen` weighs
#: them. NOTE (measured, one core of two shared under a load average of
#: 6-10, oneDNN off, TF 2.21): 32 examples of 32 ids with themselves, 64
#: wide, ids drawn from 30, 100, 300, 1,000 and 3,000: the pairs took 8.0,
#: 4.9-7.2, 3.6, 3.0-3.2 and 2.8-3.4 ms, the tables 0.9-2.8, 2.8-3.4,
#: 4.0-5.9, 8.0-11.4 and 12.2-15.9 ms (two runs): the pairs faster from
#: 300 on, where the weight puts them below the tables for any value from
#: 4.3 to 25 (the tables' ``(B K + C L + B K C L) U`` over the pairs' ``N (K
#: + L + K L)``: 108,800 / 25,059 at 100 ids, 312,256 / 12,360 at 300).
#: BERT tiny's positions (each example all 32): tables 1.5 ms, pairs 13.5;
#: its token ids (1,000): pairs 0.9 ms, the formed ``(32, 1000, 64)``
#: tables and their product 9.5 ms.
PAIR_WEIGHT = 10.0


def formed_cheaper(positions: int, vocabulary: int) -> bool:
    """Whether a lookup's rows are formed (every per-example table, ``(B K,
    vocabulary D)``) rather than paired from ids and cotangents: where the
    table has no more rows than an example has positions, the distinct ids
    a batch holds are likely the whole table (a segment id's two rows, a
    character vocabulary under long sequences), and the pairs' bookkeeping
    (the ids' numbering and sort) buys nothing."""
    return vocabulary <= positions


def pair_products(
    ids_a: tf.Tensor,
    cotangents_a: tf.Tensor,
    ids_b: tf.Tensor,
    cotangents_b: tf.Tensor,
    *,
    form: str | None = None,
) -> tf.Tensor:
    """The inner products of two sets' lookup rows, ``(B K, C L)`` float32,
    from their ids ``(B, P)`` and ``(C, Q)`` and cotangents ``(B, K, P, D)``
    and ``(C, L, Q, D)``; ``ids_b is ids_a`` (a set with itself): one side's
    work.

    By the distinct-id tables or the matching pairs (the module's two ways),
    whichever is predicted cheaper from the ids: the tables' ``(B K + C L)
    U D`` written numbers and ``B K C L U D`` multiply-adds against
    :data:`PAIR_WEIGHT` ``N (K + L + K L) D``, the pairs only where their
    gathered ``N (K + L) D`` numbers are no more than the tables', both
    traced under a ``tf.cond``; ``form``: ``"tables"`` or ``"pairs"``, that
    way alone (decided before the trace, :func:`form_of`, or forced by
    tests and benchmarks)."""
    same = ids_b is ids_a and cotangents_b is cotangents_a
    a = _Side(ids_a, cotangents_a)
    b = a if same else _Side(ids_b, cotangents_b)
    # one numbering of the ids of both sides: 0 .. U-1
    both = a.ids if same else tf.concat([a.ids, b.ids], axis=0)
    distinct, numbered = tf.unique(both)
    count = tf.size(distinct)
    a_ids = numbered[: tf.size(a.ids)]
    b_ids = a_ids if same else numbered[tf.size(a.ids) :]
    a_entries = a.by_id(a_ids, count)
    b_entries = a_entries if same else b.by_id(b_ids, count)
    matches = _matches(a_entries, b_entries)

    def tables() -> tf.Tensor:
        ta = a.tables(a_entries, count)
        tb = ta if same else b.tables(b_entries, count)
        # one batch of a matrix product: the shared axis (U D) is long against
        # the rows (see products._flat_pair's note on oneDNN)
        return tf.matmul(ta[None], tb[None], transpose_b=True)[0]

    def pairs() -> tf.Tensor:
        return _paired(a_entries, b_entries, matches, a.batch, b.batch)

    if form == "tables":
        return tables()
    if form == "pairs":
        return pairs()
    chosen = pairs_chosen(
        tf.reduce_sum(matches[1] - matches[0]),
        count,
        a.batch * a.rows,
        b.batch * b.rows,
        a.rows,
        b.rows,
    )
    return tf.cond(chosen, pairs, tables)


def pairs_chosen(
    matches: tf.Tensor,
    distinct: tf.Tensor,
    rows_a: tf.Tensor,
    rows_b: tf.Tensor,
    per_example_a: tf.Tensor,
    per_example_b: tf.Tensor,
) -> tf.Tensor:
    """Whether :func:`pair_products` takes the matching pairs (``N =
    matches`` of them) rather than the tables over ``U = distinct`` ids:
    :data:`PAIR_WEIGHT` ``N (K + L + K L)`` against ``(B K + C L + B K C
    L) U`` (both times ``D``), and the pairs' gathered ``N (K + L)`` no more
    than the tables' ``(B K + C L) U`` (``rows_a = B K``, ``rows_b = C L``,
    ``per_example_a = K``, ``per_example_b = L``). A scalar bool tensor."""
    numbers = (matches, distinct, rows_a, rows_b, per_example_a, per_example_b)
    return _pairs_cheaper(*(tf.cast(n, tf.float32) for n in numbers))


def _pairs_cheaper(found: Any, ids: Any, r_a: Any, r_b: Any, k: Any, ell: Any) -> Any:
    """:func:`pairs_chosen`'s rule on float tensors or Python floats (one
    rule for the compiled choice and :func:`form_of`'s)."""
    table_cost = (r_a + r_b + r_a * r_b) * ids
    pair_cost = PAIR_WEIGHT * found * (k + ell + k * ell)
    held = found * (k + ell) <= (r_a + r_b) * ids
    return (pair_cost < table_cost) & held


def form_of(
    ids_a: np.ndarray, ids_b: np.ndarray | None, rows_a: int, rows_b: int
) -> str:
    """The way :func:`pair_products` takes for these ids, ``"pairs"`` or
    ``"tables"``, decided in NumPy before anything is traced (the compiled
    function then traces that way alone): ids ``(B, P)`` and ``(C, Q)``
    (``ids_b=None``: a set with itself), ``rows_a = K`` and ``rows_b = L``
    rows per example. The same rule as :func:`pairs_chosen`, on the same
    counts: the distinct ids of both sides, and the matching pairs of the
    two sides' entries (an example's distinct ids).

    NOTE (measured, one core of a loaded machine). BERT tiny's 32 x 32
    token ids of 1,000: 0.15 ms with themselves, 0.34 ms as two halves, on
    every call; the ``tf.cond`` traced 161 graph ops more on the first
    (both ways, 125 + 36). ``np.unique`` alone took 0.21 ms on those ids:
    sorts and run lengths instead."""
    a = _entries(ids_a)
    ids, held_a = _runs(a)
    if ids_b is None:
        found, distinct = float(np.dot(held_a, held_a)), ids.size
        examples_b = len(ids_a)
    else:
        b = _entries(ids_b)
        held_b = np.searchsorted(b, ids, "right") - np.searchsorted(b, ids, "left")
        found = float(np.dot(held_a, held_b))
        # the ids of both sides: a's, and b's less those a holds too
        distinct = ids.size + _runs(b)[0].size - int(np.count_nonzero(held_b))
        examples_b = len(ids_b)
    chosen = _pairs_cheaper(
        found,
        float(distinct),
        float(len(ids_a) * rows_a),
        float(examples_b * rows_b),
        float(rows_a),
        float(rows_b),
    )
    return "pairs" if chosen else "tables"


def _entries(ids: np.ndarray) -> np.ndarray:
    """Every example's distinct ids (its entries), all of them sorted."""
    rows = np.sort(np.asarray(ids).reshape(len(ids), -1), axis=1)
    first = np.ones(rows.shape, bool)
    first[:, 1:] = rows[:, 1:] != rows[:, :-1]
    return np.sort(rows[first])


def _runs(ordered: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """A sorted array's distinct values and how often each occurs."""
    starts = np.flatnonzero(np.r_[True, ordered[1:] != ordered[:-1]])
    return ordered[starts], np.diff(np.r_[starts, ordered.size])


def squared_norms(ids: tf.Tensor, cotangents: tf.Tensor) -> tf.Tensor:
    """Each row's squared lookup-gradient norm, ``(B K,)`` float32, from
    its ids ``(B, P)`` and cotangents ``(B, K, P, D)``: ``||S_bk||² =
    Σ_v ||S_bk[v]||²`` over the example's distinct ids, each example's
    cotangents summed by id (the pairs' entries), never the ``(B, P, P)``
    comparison of its positions' ids nor the table."""
    side = _Side(ids, cotangents)
    distinct, numbered = tf.unique(side.ids)
    examples, _, summed = side.by_id(numbered, tf.size(distinct))
    squares = tf.reduce_sum(tf.square(summed), axis=-1)  # (n, K)
    per_row = tf.math.unsorted_segment_sum(squares, examples, side.batch)
    return tf.reshape(per_row, (-1,))


class _Side:
    """One set's lookup rows: its ids flattened ``(B P,)``, its cotangents
    by position ``(B P, K, D)`` float32, each position's example."""

    def __init__(self, ids: tf.Tensor, cotangents: tf.Tensor) -> None:
        # (B, K, P, D), static where known: a dynamic axis is a strided
        # slice of the shape, four graph ops in every trace
        shape = [cotangents.shape[i] or tf.shape(cotangents)[i] for i in range(4)]
        self.batch, self.rows, self.dim = shape[0], shape[1], shape[3]
        self.ids = tf.reshape(tf.cast(ids, tf.int32), (-1,))
        by_position = tf.transpose(tf.cast(cotangents, tf.float32), (0, 2, 1, 3))
        self.vectors = tf.reshape(by_position, (-1, self.rows, self.dim))
        if isinstance(shape[0], int) and isinstance(shape[2], int):
            examples = np.repeat(np.arange(shape[0], dtype=np.int32), shape[2])
            self.examples = tf.constant(examples)
        else:
            self.examples = tf.repeat(tf.range(self.batch), shape[2])

    def by_id(self, numbered: tf.Tensor, count: tf.Tensor) -> _Entries:
        """Each example's cotangents summed by id: one entry per distinct id
        of each example (its example, its id's number, ``(K, D)``)."""
        wide = tf.cast(count, tf.int64)
        keys = tf.cast(self.examples, tf.int64) * wide + tf.cast(numbered, tf.int64)
        entries, slot = tf.unique(keys)
        summed = tf.math.unsorted_segment_sum(self.vectors, slot, tf.size(entries))
        return (
            tf.cast(entries // wide, tf.int32),
            tf.cast(entries % wide, tf.int32),
            summed,
        )

    def tables(self, entries: _Entries, count: tf.Tensor) -> tf.Tensor:
        """Every row's table over the distinct ids, ``(B K, U D)``."""
        examples, ids, summed = entries
        table = tf.math.unsorted_segment_sum(
            summed, examples * count + ids, self.batch * count
        )  # (B U, K, D)
        table = tf.reshape(table, (self.batch, count, self.rows, self.dim))
        table = tf.transpose(table, (0, 2, 1, 3))
        return tf.reshape(table, (self.batch * self.rows, count * self.dim))


#: one side's entries: each's example ``(n,)``, id number ``(n,)`` and
#: cotangents summed ``(n, K, D)``
_Entries = tuple[tf.Tensor, tf.Tensor, tf.Tensor]


def _matches(a: _Entries, b: _Entries) -> _Matches:
    """Where each of ``a``'s entries' id is among ``b``'s entries sorted by
    id (:data:`_Matches`)."""
    order = tf.argsort(b[1], stable=True)
    ordered = tf.gather(b[1], order)
    low = tf.searchsorted(ordered, a[1], side="left")
    high = tf.searchsorted(ordered, a[1], side="right")
    return low, high, order


#: ``b``'s entries with ``a``'s entry ``i``'s id: ``order[low[i]:high[i]]``
_Matches = tuple[tf.Tensor, tf.Tensor, tf.Tensor]


def _paired(
    a: _Entries,
    b: _Entries,
    matches: _Matches,
    batch_a: tf.Tensor,
    batch_b: tf.Tensor,
) -> tf.Tensor:
    """The matching pairs' products summed per pair of examples, ``(B K, C
    L)``."""
    low, high, order = matches
    # a's entry i against b's sorted entries low[i] .. high[i] - 1, spelled
    # out: tf.ragged.range's RaggedTensor and its checks traced 0.05 s more
    # (BERT tiny's shapes, median of three fresh processes, loaded)
    counts = high - low
    left = tf.repeat(tf.range(tf.size(counts)), counts)
    starts = tf.cumsum(counts, exclusive=True)
    within = tf.range(tf.reduce_sum(counts)) - tf.gather(starts, left)
    right = tf.gather(order, tf.gather(low, left) + within)
    # (N, K, 1, D) x (N, 1, L, D), summed over D: (N, K, L)
    products = tf.reduce_sum(
        tf.gather(a[2], left)[:, :, None] * tf.gather(b[2], right)[:, None], axis=-1
    )
    cells = tf.gather(a[0], left) * batch_b + tf.gather(b[0], right)
    grid = tf.math.unsorted_segment_sum(products, cells, batch_a * batch_b)
    rows_a, rows_b = tf.shape(a[2])[1], tf.shape(b[2])[1]
    grid = tf.reshape(grid, (batch_a, batch_b, rows_a, rows_b))
    grid = tf.transpose(grid, (0, 2, 1, 3))
    return tf.reshape(grid, (batch_a * rows_a, batch_b * rows_b))
