"""keras_hub's causal LMs on the closed forms (issue 49): the token table,
looked up at the input and reused in reverse for the logits (the tied LM
head), is served by ``batch``, so ``auto`` runs ``batch`` there; the
table's norms in the Gram form (both calls together, never the per-example
``(vocabulary, D)`` tables) and its Kronecker projection (the reverse call's
factors swapped) agree with float64 per-example loss gradients computed the
obvious way (a float64 tape per example), reduced by NumPy. That ``auto``
runs ``batch`` on them is asserted in ``tests/test_reductions_models.py``.

The Gram form and the Kronecker map are chosen by size (a tiny vocabulary's
tables are formed, and mapped densely); here they are forced by lowering
``layers.norms.CHUNK_ELEMENTS`` and ``problem.sketch.DENSE_ELEMENTS``.
Every other reduction and the rows under ``auto`` are checked against
float64 by ``tests/test_reductions_models.py`` (the same models);
``training=True`` with dropout by ``tests/test_one_draw.py`` (GPT-2, every
strategy, ``batch`` included).

Tolerance: 1e-5 of the largest value (as ``test_reductions_models``); the
largest error measured here was 5.5e-7 of the largest value (Gemma's
projection; norms 1.3e-7, clipped sums 9.9e-8; float32, oneDNN on).
"""

from __future__ import annotations

import numpy as np
import pytest

import jacobkit as jk
from jacobkit import testing
from jacobkit.layers import norms as layer_norms
from jacobkit.problem import sketch
from tests import hub_models
from tests.test_reductions import _projected_reference

keras = pytest.importorskip("keras")
keras_hub = pytest.importorskip("keras_hub")

RTOL = 1e-5
BATCH, LENGTH, VOCABULARY = 3, 6, 40


def _next_token_loss(y_true, y_pred):
    """Each sequence's mean next-token cross-entropy."""
    tokens = keras.losses.sparse_categorical_crossentropy(
        y_true, y_pred, from_logits=True
    )
    return keras.ops.mean(tokens, axis=-1)


def _lm(name: str):
    keras.utils.set_random_seed(3)
    if name == "gpt2":
        backbone = hub_models.gpt2(VOCABULARY, length=LENGTH)
        model = keras_hub.models.GPT2CausalLM(backbone, preprocessor=None)
    else:
        backbone = hub_models.gemma(VOCABULARY)
        model = keras_hub.models.GemmaCausalLM(backbone, preprocessor=None)
    rng = np.random.default_rng(3)
    x = {
        "token_ids": rng.integers(1, VOCABULARY, (BATCH, LENGTH)).astype("int32"),
        "padding_mask": np.ones((BATCH, LENGTH), "int32"),
    }
    x["token_ids"][0, 3] = x["token_ids"][0, 1]  # an id twice in one example
    y = np.roll(x["token_ids"], -1, axis=1)
    return model, (x, y), jk.Loss(_next_token_loss)


@pytest.fixture(
    scope="module",
    # the same rule on both: Gemma (another 10 s) only with the slow tests
    params=["gpt2", pytest.param("gemma", marks=pytest.mark.slow)],
)
def case(request):
    """A causal LM, its batch, its loss, its token table and the float64
    per-example gradients of every trainable variable."""
    model, inputs, loss = _lm(request.param)
    variables = model.trainable_variables
    ref = testing.float64_reference(model, inputs, variables, outputs=loss)
    grads = [np.asarray(r, np.float64) for r in ref]
    table = model.backbone.token_embedding.embeddings
    return model, inputs, loss, table, grads


def _close(got, want) -> None:
    scale = max(float(np.abs(w).max()) for w in want)
    for g, w in zip(got, want, strict=True):
        np.testing.assert_allclose(np.asarray(g), w, rtol=0, atol=RTOL * scale)


def test_table_norms_in_the_gram_form(case, monkeypatch):
    """Every variable's per-example norms, the table's from both calls in
    the Gram form."""
    model, inputs, loss, table, grads = case
    monkeypatch.setattr(layer_norms, "CHUNK_ELEMENTS", 1)
    variables = model.trainable_variables
    result = jk.jacobian(
        model, inputs, variables, outputs=loss, reduce="norm", strategy="batch"
    )
    want = [np.linalg.norm(g.reshape(BATCH, -1), axis=1) for g in grads]
    _close(list(result.jacobians.values()), want)
    assert any(v is table for v in variables)


def test_clipped_sum_with_the_table_in_the_gram_form(case, monkeypatch):
    model, inputs, loss, _, grads = case
    monkeypatch.setattr(layer_norms, "CHUNK_ELEMENTS", 1)
    flat = np.concatenate([g.reshape(BATCH, -1) for g in grads], 1)
    norms = np.linalg.norm(flat, axis=1)
    clip = float(np.median(norms))
    result = jk.jacobian(
        model,
        inputs,
        model.trainable_variables,
        outputs=loss,
        reduce=jk.ClippedSum(clip),
        strategy="batch",
    )
    scales = np.minimum(1.0, clip / norms)
    _close(list(result.jacobians.values()), [np.tensordot(scales, g, 1) for g in grads])
    _close([result.norms], [norms])


def test_table_projected_by_kronecker_factors(case, monkeypatch):
    """The table alone under a Kronecker map: the lookup's ids gather the
    left factor, the reverse call maps the cotangents at the logits by it."""
    model, inputs, loss, table, grads = case
    monkeypatch.setattr(sketch, "DENSE_ELEMENTS", 0)
    variables = model.trainable_variables
    at = next(i for i, v in enumerate(variables) if v is table)
    project = jk.Project(16, seed=5)
    result = jk.jacobian(
        model, inputs, [table], outputs=loss, reduce=project, strategy="batch"
    )
    names = list(result.jacobians)
    want = _projected_reference(project, names, [table], [grads[at]])
    _close([result.projection], [want])
