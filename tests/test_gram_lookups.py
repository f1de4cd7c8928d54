"""``jk.gram``'s lookup rows, paired from the ids both sides hold
(:mod:`jacobkit.layers.lookups`), never the per-example tables: a Keras
``Embedding`` (``mask_zero=True``, ids repeated within and across
examples) and keras_hub's BERT (its token table, and its position table,
a lookup of the positions, under sequences shorter than the table), against
float64 computed the obvious way: every row's gradient by a float64 tape
per row, flattened, ``G @ Hᵀ`` in NumPy; the two ways of
:func:`~jacobkit.layers.lookups.pair_products` forced, against float64
tables formed with ``np.add.at``.

Tolerance: 1e-5 of the matrix's largest entry (``tests/test_gram.py``'s).
Measured (float32, oneDNN on): at most 1.3e-7 on BERT, 1.1e-7 on the
``Embedding`` model, 1.2e-7 on the pair products alone.
"""

from __future__ import annotations

import numpy as np
import pytest
import tensorflow as tf

import jacobkit as jk
from jacobkit import planner
from jacobkit.layers import lookups
from jacobkit.problem import Call
from jacobkit.problem.reduction import Lookup
from jacobkit.reductions import features as feats
from tests import hub_models
from tests.test_gram import _rows

keras = pytest.importorskip("keras")

RTOL = 1e-5


def _close(got, want) -> None:
    np.testing.assert_allclose(got, want, rtol=0, atol=RTOL * np.abs(want).max())


def _tables(ids: np.ndarray, cotangents: np.ndarray, vocabulary: int) -> np.ndarray:
    """float64 per-example tables, ``(B K, vocabulary D)``."""
    batch, rows, positions, dim = cotangents.shape
    tables = np.zeros((batch, rows, vocabulary, dim))
    for b in range(batch):
        for p in range(positions):
            np.add.at(tables[b], (slice(None), ids[b, p]), cotangents[b, :, p])
    return tables.reshape(batch * rows, -1)


def _side(rng, batch, rows, positions, dim, high):
    ids = rng.integers(0, high, (batch, positions)).astype("int32")
    cotangents = rng.normal(size=(batch, rows, positions, dim)).astype("float32")
    return ids, cotangents


_SPEC = (
    tf.TensorSpec((None, None), tf.int32),
    tf.TensorSpec((None, None, None, 4), tf.float32),
)


@pytest.mark.parametrize("form", [None, "tables", "pairs"])
@pytest.mark.parametrize("ids", ["repeated", "sparse", "positions"])
def test_pair_products_of_two_sides_against_formed_tables(form, ids):
    """Two sides of other sizes (5 examples of 2 rows and 7 positions, 3 of
    3 rows and 4), traced at unknown shapes: ids from 6 of 40 (repeated
    within and across examples), from 40 (few shared), or the positions."""
    rng = np.random.default_rng(0)
    high = {"repeated": 6, "sparse": 40, "positions": 1}[ids]
    ids_a, g_a = _side(rng, 5, 2, 7, 4, high)
    ids_b, g_b = _side(rng, 3, 3, 4, 4, high)
    if ids == "positions":
        ids_a = np.broadcast_to(np.arange(7, dtype="int32"), (5, 7))
        ids_b = np.broadcast_to(np.arange(4, dtype="int32"), (3, 4))
    products = tf.function(
        lambda *t: lookups.pair_products(*t, form=form),
        input_signature=[*_SPEC, *_SPEC],
        autograph=False,
    )
    got = products(ids_a, g_a, ids_b, g_b).numpy()
    f64 = [np.asarray(t, np.float64) for t in (g_a, g_b)]
    want = _tables(ids_a, f64[0], 40) @ _tables(ids_b, f64[1], 40).T
    assert got.shape == (10, 9)
    _close(got, want)


@pytest.mark.parametrize("form", [None, "tables", "pairs"])
def test_pair_products_of_a_set_with_itself(form):
    """``ids_b is ids_a``: one side's work, a symmetric matrix."""
    rng = np.random.default_rng(1)
    ids, g = _side(rng, 6, 2, 9, 4, 5)

    def products(ids, g):
        return lookups.pair_products(ids, g, ids, g, form=form)

    got = tf.function(products, autograph=False)(ids, g).numpy()
    tables = _tables(ids, np.asarray(g, np.float64), 5)
    _close(got, tables @ tables.T)


def test_the_pairs_are_chosen_where_few_ids_are_shared():
    """BERT tiny's batch with itself (32 x 32 tokens of 1,000 ids, about
    2,000 matching pairs of ~1,000 entries, ~640 distinct ids): the pairs;
    its positions (32 ids each example holds: 32,768 pairs): the tables;
    the pairs not where they would hold more than the tables."""
    chosen = lambda *n: bool(lookups.pairs_chosen(*(tf.constant(k) for k in n)))  # noqa: E731
    assert chosen(2000, 640, 32, 32, 1, 1)
    assert not chosen(32 * 32 * 32, 32, 32, 32, 1, 1)
    # cheaper by the weight, but more numbers gathered than the tables hold
    assert not chosen(100, 10, 2, 2, 1, 1)


def _masked(mask_zero: bool = True):
    """Ids -> Embedding(mask_zero) -> a masked average -> Dense: the padding
    (id 0) masked out of the average."""
    keras.utils.set_random_seed(3)
    ids = keras.Input((None,), dtype="int32")
    h = keras.layers.Embedding(40, 6, mask_zero=mask_zero, name="embed")(ids)
    h = keras.layers.Dense(5, activation="tanh", name="ffn")(h)
    h = keras.layers.GlobalAveragePooling1D()(h)
    return keras.Model(ids, keras.layers.Dense(3, name="head")(h))


def _padded_ids(count: int, length: int, seed: int):
    """Ids from 1..7 (repeated within and across examples), each example's
    tail padded with 0 from a random point; labels of 3 classes."""
    rng = np.random.default_rng(seed)
    x = rng.integers(1, 8, (count, length)).astype("int32")
    for row, keep in zip(x, rng.integers(2, length + 1, count), strict=True):
        row[keep:] = 0
    return x, rng.integers(0, 3, count)


LOSS = jk.Loss(
    keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction=None)
)


@pytest.mark.parametrize("mask_zero", [True, False])
def test_an_embeddings_gram_from_its_ids(mask_zero):
    """A set with itself in chunks of 3, two sets of other lengths, and the
    per-example rows (3 per example): the table paired from its ids."""
    model = _masked(mask_zero)
    a, b = _padded_ids(7, 9, seed=0), _padded_ids(4, 5, seed=1)
    rows_a, rows_b = _rows(model, a, LOSS), _rows(model, b, LOSS)
    itself = jk.gram(model, a, outputs=LOSS, chunk_examples=3)
    assert itself.forms["embed/embeddings"] == "ghost"
    _close(itself.matrix, rows_a @ rows_a.T)
    _close(jk.gram(model, a, b, outputs=LOSS).matrix, rows_a @ rows_b.T)
    per_example = _rows(model, a[0], "per_example")
    _close(jk.gram(model, a[0]).matrix, per_example @ per_example.T)


def _bert():
    """keras_hub's BERT classifier, its tables: 50 tokens, 12 positions, 2
    segments; sequences of 8 and 5 tokens, some padded."""
    keras_hub = pytest.importorskip("keras_hub")
    keras.utils.set_random_seed(0)
    backbone = hub_models.bert(50, length=12)
    model = keras_hub.models.BertTextClassifier(
        backbone, num_classes=3, preprocessor=None
    )
    return model, _tokens(5, 8, seed=0), _tokens(3, 5, seed=1)


def _tokens(count: int, length: int, seed: int):
    rng = np.random.default_rng(seed)
    x = {
        "token_ids": rng.integers(1, 12, (count, length)).astype("int32"),
        "padding_mask": np.ones((count, length), "int32"),
        "segment_ids": np.zeros((count, length), "int32"),
    }
    x["padding_mask"][1, length // 2 :] = 0
    x["token_ids"][1, length // 2 :] = 0
    return x, rng.integers(0, 3, count)


def test_bert_tinys_gram_pairs_its_token_and_position_tables():
    model, a, b = _bert()
    rows_a, rows_b = _rows(model, a, LOSS), _rows(model, b, LOSS)
    itself = jk.gram(model, a, outputs=LOSS, chunk_examples=2)
    forms = {k.split("/")[-2]: v for k, v in itself.forms.items() if "embed" in k}
    assert forms["token_embedding"] == "ghost", forms
    assert forms["position_embedding"] == "ghost", forms
    assert forms["segment_embedding"] == "materialized", forms
    _close(itself.matrix, rows_a @ rows_a.T)
    _close(jk.gram(model, a, b, outputs=LOSS).matrix, rows_a @ rows_b.T)


def _counted_choice(ids_a, ids_b, rows_a, rows_b) -> bool:
    """:func:`~jacobkit.layers.lookups.pairs_chosen` on counts taken by
    brute force: the distinct ids of both sides, and every pair of the two
    sides' entries (an example's distinct ids) with the same id."""
    entries_a = [set(row) for row in ids_a.tolist()]
    entries_b = [set(row) for row in ids_b.tolist()]
    found = sum(len(a & b) for a in entries_a for b in entries_b)
    distinct = len(set(ids_a.ravel().tolist()) | set(ids_b.ravel().tolist()))
    numbers = (found, distinct, len(ids_a) * rows_a, len(ids_b) * rows_b)
    return bool(lookups.pairs_chosen(*numbers, rows_a, rows_b))


@pytest.mark.parametrize("high", [3, 40, 1000, 30_000])
@pytest.mark.parametrize("rows", [(1, 1), (2, 3)])
def test_the_way_decided_before_the_trace_is_the_compiled_ones(high, rows):
    """:func:`~jacobkit.layers.lookups.form_of` (NumPy, before the trace)
    against the compiled rule on brute-force counts, for a set with itself
    and two sets: both ways are reached over these ids (few distinct: the
    tables; many: the pairs)."""
    rng = np.random.default_rng(high)
    ids_a = rng.integers(0, high, (6, 9))
    ids_b = rng.integers(0, high, (4, 5))
    k, ell = rows
    itself = lookups.form_of(ids_a, None, k, k)
    assert (itself == "pairs") == _counted_choice(ids_a, ids_a, k, k)
    apart = lookups.form_of(ids_a, ids_b, k, ell)
    assert (apart == "pairs") == _counted_choice(ids_a, ids_b, k, ell)
    assert itself == ("tables" if high <= 40 else "pairs")


@pytest.mark.parametrize("ids", ["repeated", "sparse", "positions"])
def test_lookup_norms_from_per_id_sums(ids):
    """``gram(norms=True)``'s lookup norms (:func:`~jacobkit.layers.lookups.
    squared_norms`) against float64 tables' rows squared (measured: at most
    6e-8 of the largest)."""
    rng = np.random.default_rng(2)
    high = {"repeated": 4, "sparse": 40, "positions": 1}[ids]
    x, g = _side(rng, 5, 3, 7, 4, high)
    if ids == "positions":
        x = np.broadcast_to(np.arange(7, dtype="int32"), (5, 7))
    got = tf.function(lookups.squared_norms, autograph=False)(x, g).numpy()
    want = (_tables(x, np.asarray(g, np.float64), 40) ** 2).sum(axis=1)
    _close(got, want)


def _recorded(monkeypatch) -> list:
    """The ways the compiled products were traced with, one per traced
    lookup pair (``None``: chosen inside the compiled call)."""
    ways: list = []
    traced = lookups.pair_products

    def recording(*args, form=None):
        ways.append(form)
        return traced(*args, form=form)

    monkeypatch.setattr(lookups, "pair_products", recording)
    return ways


def _wide(vocabulary: int, computed: bool = False):
    """Ids -> Embedding(vocabulary, 6) -> Dense -> mean -> Dense(3); where
    ``computed``, the ids the table looks up are computed by the model."""
    keras.utils.set_random_seed(5)
    ids = keras.Input((None,), dtype="int32")
    looked = keras.layers.Maximum()([ids, ids]) if computed else ids
    h = keras.layers.Embedding(vocabulary, 6, name="embed")(looked)
    h = keras.layers.Dense(5, activation="tanh", name="ffn")(h)
    h = keras.layers.GlobalAveragePooling1D()(h)
    return keras.Model(ids, keras.layers.Dense(3, name="head")(h))


def test_one_way_traced_per_call_and_a_later_call_of_the_other_way(monkeypatch):
    """Ids from the model's input: the first call traces the way its ids
    choose alone (no ``tf.cond``); a later call of the same problem whose
    ids choose the other way gets that way traced beside the first, and one
    whose ids choose a traced way traces nothing; every block exact
    (``training=True``: the same path) against the float64 rows. The
    features' compiled call is called directly: ``jk.gram``'s own trial of
    the formed arrangement would run some of these calls formed."""
    ways = _recorded(monkeypatch)
    model = _wide(500)
    call = Call(model, model.trainable_variables, outputs=LOSS, training=True)
    chosen = planner.solver("auto", None, None, True)
    rng = np.random.default_rng(4)
    sparse = (rng.integers(0, 500, (6, 10)).astype("int32"), rng.integers(0, 3, 6))
    dense = (rng.integers(0, 3, (6, 10)).astype("int32"), rng.integers(0, 3, 6))
    for batch, way in ((sparse, "pairs"), (dense, "tables"), (sparse, None)):
        before = len(ways)
        found, block, _ = feats.with_products(call, batch, chosen)
        assert isinstance(found.features[0], Lookup)
        assert ways[before:] == ([] if way is None else [way])  # None: no trace
        rows = _rows(model, batch, LOSS)
        _close(block.numpy(), rows @ rows.T)
    # the first four examples against the last two: split inside the call
    _, block, _ = feats.with_products(call, sparse, chosen, count=4)
    assert ways[-1] == "pairs"
    rows = _rows(model, sparse, LOSS)
    _close(block.numpy(), rows[:4] @ rows[4:].T)


def test_ids_the_model_computes_are_paired_by_the_compiled_choice(monkeypatch):
    """Ids made inside the model are not known before the call: the way is
    chosen in the compiled call (both ways traced under one ``tf.cond``),
    exact."""
    ways = _recorded(monkeypatch)
    model = _wide(500, computed=True)
    rng = np.random.default_rng(6)
    batch = (rng.integers(0, 500, (5, 8)).astype("int32"), rng.integers(0, 3, 5))
    got = jk.gram(model, batch, outputs=LOSS)
    assert got.forms["embed/embeddings"] == "ghost"
    assert ways == [None]
    rows = _rows(model, batch, LOSS)
    _close(got.matrix, rows @ rows.T)
