"""``jk.gram`` with a tied token table (looked up at the input, called in
reverse for a causal LM's logits), whose per-example rows are formed: the
reverse call's tables by one batched matmul over the positions
(:func:`jacobkit.layers.tables.reverse_tables`), the lookups' cotangents
then scattered into them at their ids
(:meth:`ReversibleEmbeddingRule.shared_gradients
<jacobkit.layers.embedding.ReversibleEmbeddingRule.shared_gradients>`);
against float64 computed the obvious way: NumPy's einsum and ``np.add.at``
for the pieces, per-example float64 gradients (a float64 tape per example,
:func:`jacobkit.testing.float64_reference`) and ``J Jᵀ`` for the matrix, on
keras_hub's GPT-2 and on a small causal model of a ``ReversibleEmbedding``
and a Dense layer, with one loss row and with several rows (logits) per
example.

``shared_gradients`` is checked for every registered layer rule that
overrides it: one that does without a case here fails
:func:`test_every_shared_gradients_has_a_case`.

Tolerances (float32, oneDNN on; measured): the pieces 1e-6 of the largest
value (largest error measured 1.3e-7); the matrices 1e-5 of the largest
value (as ``tests/test_reductions_models.py``; largest measured 1.1e-7).
"""

from __future__ import annotations

import numpy as np
import pytest
import tensorflow as tf

import jacobkit as jk
from jacobkit import layers, testing
from jacobkit.layers import embedding, tables
from jacobkit.layers.base import LayerRule
from tests import hub_models

keras = pytest.importorskip("keras")
keras_hub = pytest.importorskip("keras_hub")

#: the pieces' tolerance, of the largest value
PIECE_RTOL = 1e-6
#: the Gram matrices', of the largest value
RTOL = 1e-5
BATCH, LENGTH, VOCABULARY, DIM = 3, 6, 40, 8


def _close(got, want, rtol) -> None:
    want = np.asarray(want, np.float64)
    scale = float(np.abs(want).max())
    assert scale > 0, "a reference of zeros checks nothing"
    np.testing.assert_allclose(np.asarray(got), want, rtol=0, atol=rtol * scale)


def _reverse_reference(inputs, g) -> np.ndarray:
    """``Σ_p g[b, k, p] ⊗ inputs[b, p]``: ``(B K, V, D)`` in float64."""
    found = np.einsum(
        "bpd,bkpv->bkvd", np.float64(inputs), np.float64(g), optimize=False
    )
    return found.reshape(-1, *found.shape[2:])


def _lookup_reference(ids, dz, vocabulary) -> np.ndarray:
    """Each row's table of a lookup, ``dz`` ``(B, K, P, D)`` added at the
    ids ``(B, P)`` of its example, one position at a time: ``(B K, V, D)``."""
    batch, rows, positions, dim = dz.shape
    tables = np.zeros((batch, rows, vocabulary, dim))
    for b in range(batch):
        for p in range(positions):
            tables[b, :, ids[b, p]] += np.float64(dz[b, :, p])
    return tables.reshape(batch * rows, vocabulary, dim)


def _random(seed, rows):
    rng = np.random.default_rng(seed)
    inputs = rng.normal(size=(BATCH, LENGTH, DIM)).astype("float32")
    g = rng.normal(size=(BATCH, rows, LENGTH, VOCABULARY)).astype("float32")
    ids = rng.integers(0, VOCABULARY, (BATCH, LENGTH)).astype("int32")
    ids[0, 3] = ids[0, 1]  # an id twice in one example: its rows add up
    ids[1, :] = ids[1, 0]  # one id everywhere
    dz = rng.normal(size=(BATCH, rows, LENGTH, DIM)).astype("float32")
    return inputs, g, ids, dz


@pytest.mark.parametrize("rows", [1, 3])
def test_reverse_tables(rows):
    inputs, g, _, _ = _random(0, rows)
    found = tables.reverse_tables(tf.constant(inputs), tf.constant(g))
    assert found.shape == (BATCH * rows, VOCABULARY, DIM)
    _close(found, _reverse_reference(inputs, g), PIECE_RTOL)


def _tied_rule():
    table = keras_hub.layers.ReversibleEmbedding(VOCABULARY, DIM)
    table.build((None, LENGTH))
    rule = layers.rule_for(table)
    assert isinstance(rule, embedding.ReversibleEmbeddingRule)
    return rule


@pytest.mark.parametrize("lookups", [1, 2])
@pytest.mark.parametrize("rows", [1, 3])
def test_shared_gradients_of_a_tied_table(rows, lookups):
    """The reverse call's tables and every lookup's scattered rows, summed:
    against float64, and against each call's own gradients added (the form
    it replaces)."""
    rule = _tied_rule()
    inputs, g, ids, dz = _random(1, rows)
    calls = [(tf.constant(inputs), tf.constant(g))]
    want = _reverse_reference(inputs, g)
    for k in range(lookups):
        more_ids, more_dz = (ids, dz) if k == 0 else _random(2 + k, rows)[2:]
        calls.insert(0, (tf.constant(more_ids), tf.constant(more_dz)))
        want = want + _lookup_reference(more_ids, more_dz, VOCABULARY)
    shape = (VOCABULARY, DIM)
    kernel, bias = rule.shared_gradients(calls, shape, summed=False)
    assert kernel.shape == (BATCH * rows, VOCABULARY, DIM)
    assert bias.shape == (BATCH * rows, 0)
    _close(kernel, want, PIECE_RTOL)
    each = [rule.gradients(x, d, shape, summed=False)[0] for x, d in calls]
    _close(kernel, tf.add_n(each), PIECE_RTOL)


def test_shared_gradients_only_for_both_calls_per_example():
    """Rows summed over the batch, or a table called one way only: no
    shared form (each call's gradients are formed and added)."""
    rule = _tied_rule()
    inputs, g, ids, dz = _random(1, 1)
    reverse = (tf.constant(inputs), tf.constant(g))
    lookup = (tf.constant(ids), tf.constant(dz))
    shape = (VOCABULARY, DIM)
    assert rule.shared_gradients([lookup, reverse], shape, summed=True) is None
    assert rule.shared_gradients([lookup, lookup], shape, summed=False) is None
    assert rule.shared_gradients([reverse], shape, summed=False) is None


#: the rules whose ``shared_gradients`` the tests above check
COVERED = {embedding.ReversibleEmbeddingRule}


def test_every_shared_gradients_has_a_case():
    """Every registered rule that overrides :meth:`LayerRule.shared_gradients`
    is one the tests above check."""
    rules = {r for k in layers.REGISTRY.kinds for r in (k.rule, k.lora) if r}
    found = {
        rule
        for rule in rules
        if rule.shared_gradients is not LayerRule.shared_gradients
    }
    assert found, "the tied table's rule overrides it"
    assert found <= COVERED, found - COVERED


def _next_token_loss(y_true, y_pred):
    """Each sequence's mean next-token cross-entropy."""
    tokens = keras.losses.sparse_categorical_crossentropy(
        y_true, y_pred, from_logits=True
    )
    return keras.ops.mean(tokens, axis=-1)


def _ids():
    rng = np.random.default_rng(4)
    ids = rng.integers(1, VOCABULARY, (BATCH, LENGTH + 1)).astype("int32")
    ids[0, 3] = ids[0, 1]  # an id twice in one example
    return ids[:, :-1], ids[:, 1:]


def _gpt2():
    keras.utils.set_random_seed(4)
    backbone = hub_models.gpt2(VOCABULARY, length=LENGTH)
    model = keras_hub.models.GPT2CausalLM(backbone, preprocessor=None)
    ids, y = _ids()
    x = {"token_ids": ids, "padding_mask": np.ones_like(ids)}
    return model, x, y


def _tied_causal():
    """ids -> a ReversibleEmbedding -> Dense(tanh) -> the same table in
    reverse: each position's logits ``(B, P, V)``."""
    keras.utils.set_random_seed(4)
    table = keras_hub.layers.ReversibleEmbedding(VOCABULARY, DIM, name="table")
    ids = keras.Input((LENGTH,), dtype="int32")
    hidden = keras.layers.Dense(DIM, activation="tanh", name="mix")(table(ids))
    model = keras.Model(ids, table(hidden, reverse=True))
    x, y = _ids()
    return model, x, y


MODELS = {"gpt2": _gpt2, "tied_causal": _tied_causal}
#: loss rows (one per example), or two of the logits (summed over the
#: positions: ``"per_example"``'s rows)
ROWS = {"loss": None, "logits": (1, 7)}


@pytest.fixture(scope="module", params=list(MODELS))
def model_case(request):
    return MODELS[request.param]()


@pytest.mark.parametrize("rows", list(ROWS))
def test_gram_with_a_tied_table(model_case, rows):
    model, x, y = model_case
    variables = model.trainable_variables
    features = ROWS[rows]
    if features is None:
        inputs, outputs = (x, y), jk.Loss(_next_token_loss)
    else:
        inputs, outputs = x, "per_example"
    ref = testing.float64_reference(
        model, inputs, variables, outputs=outputs, features=features, baseline=False
    )
    result = jk.gram(
        model, inputs, outputs=outputs, features=features, strategy="batch"
    )
    count = int(np.prod(result.rows_shape_a))
    assert count == BATCH * (1 if features is None else len(features))
    flat = np.concatenate([np.reshape(np.float64(r), (count, -1)) for r in ref], 1)
    assert result.strategy == "batch"
    table = next(n for n in result.forms if "embedding" in n or "table" in n)
    assert result.forms[table] == "materialized", result.forms
    _close(result.matrix, flat @ flat.T, RTOL)
