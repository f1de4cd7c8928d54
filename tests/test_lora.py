"""LoRA on keras_hub models (``backbone.enable_lora(rank)``: the attention's
query and value projections get LoRA factors, everything else is frozen):
per-example loss gradients of the trainable variables (the factors and the
projections' biases), their norms and the clipped sum against float64, and
``jk.coverage`` on the causal LMs. The layer rules themselves are in the
conformance suite (``tests/layer_cases.py``: the kinds' ``lora`` rules).

The float64 reference does not go through Keras's LoRA (its factors are
float32 whatever the layer's dtype): it is a float64 copy of the model
without LoRA, each projection's kernel set to the merged ``W + s A B``, one
tape per example for the kernel's and bias's gradients, and the chain rule
of ``K = W + s A B``: ``dA = s dK Bᵀ``, ``dB = s Aᵀ dK`` (contracted over
the kernel's leading axes).

Tolerance: 1e-5 of the largest value; measured (GPT-2, float32, oneDNN on)
at most 2.1e-7 for the rows and norms, 2.6e-7 for the clipped sum, 1.7e-7
for the Gram matrix and the projection.
"""

from __future__ import annotations

import numpy as np
import pytest

import jacobkit as jk
from jacobkit import testing
from jacobkit.keras import compat
from tests import hub_models, layer_cases
from tests.test_layer_conformance import _reference as conformance_reference
from tests.test_reductions import _projected_reference

keras = pytest.importorskip("keras")
keras_hub = pytest.importorskip("keras_hub")
tf = pytest.importorskip("tensorflow")

RTOL = 1e-5
BATCH, LENGTH, VOCABULARY, RANK, ALPHA = 3, 5, 50, 2, 4


def _tokens() -> dict:
    rng = np.random.default_rng(0)
    x = {
        "token_ids": rng.integers(1, VOCABULARY, (BATCH, LENGTH)).astype("int32"),
        "padding_mask": np.ones((BATCH, LENGTH), "int32"),
    }
    x["padding_mask"][1, 3:] = 0
    return x


def _loss(y_true, y_pred):
    """Each example's mean squared error over its sequence output."""
    return keras.ops.mean(keras.ops.square(y_pred - y_true), axis=(1, 2))


def _gpt2(dtype: str = "float32"):
    return keras_hub.models.GPT2Backbone(
        vocabulary_size=VOCABULARY,
        num_layers=1,
        num_heads=2,
        hidden_dim=8,
        intermediate_dim=16,
        max_sequence_length=LENGTH,
        dtype=dtype,
    )


@pytest.fixture(scope="module")
def case():
    keras.utils.set_random_seed(0)
    model = _gpt2()
    rng = np.random.default_rng(2)
    model.enable_lora(RANK)
    for layer in _lora_layers(model):
        layer.lora_alpha = ALPHA  # s = 2: the scale is not 1
        for w in (layer.lora_kernel_a, layer.lora_kernel_b, layer.bias):
            w.assign(rng.normal(scale=0.3, size=w.shape).astype("float32"))
    x = _tokens()
    y = rng.normal(size=(BATCH, LENGTH, 8)).astype("float32")
    return model, (x, y), jk.Loss(_loss), _reference(model, x, y)


def _lora_layers(model) -> list:
    return [layer for layer in model._flatten_layers() if compat.lora_enabled(layer)]


def _reference(model, x, y) -> list[np.ndarray]:
    """Per-example float64 gradients of ``model.trainable_variables``, in
    their order (see the module docstring)."""
    copy = _gpt2("float64")
    copy(x)
    scale = ALPHA / RANK
    merged = {}
    for layer in _lora_layers(model):
        a = np.asarray(layer.lora_kernel_a, np.float64)
        b = np.asarray(layer.lora_kernel_b, np.float64)
        frozen = np.asarray(compat.lora_frozen(layer, "kernel"), np.float64)
        merged[layer.path] = (frozen + scale * a @ b, a, b)
    by_path = {w.path: w for w in model.weights}
    for w64 in copy.weights:
        owner = w64.path.rsplit("/", 1)[0]
        if owner in merged and w64.path.endswith("/kernel"):
            w64.assign(merged[owner][0])
        else:
            w64.assign(np.asarray(by_path[w64.path], np.float64))
    layers64 = {layer.path: layer for layer in copy._flatten_layers()}
    found: dict[str, list[np.ndarray]] = {v.path: [] for v in model.trainable_variables}
    for i in range(BATCH):
        xi = {k: v[i : i + 1] for k, v in x.items()}
        with tf.GradientTape() as tape:
            loss = _loss(y[i : i + 1].astype(np.float64), copy(xi))
        owners = list(merged)
        watched = [v for o in owners for v in (layers64[o].kernel, layers64[o].bias)]
        grads = tape.gradient(loss, watched)
        for j, owner in enumerate(owners):
            dk, dc = np.asarray(grads[2 * j]), np.asarray(grads[2 * j + 1])
            _, a, b = merged[owner]
            found[f"{owner}/lora_kernel_a"].append(scale * dk @ b.T)
            found[f"{owner}/lora_kernel_b"].append(
                scale * np.tensordot(a, dk, axes=(range(a.ndim - 1),) * 2)
            )
            found[f"{owner}/bias"].append(dc)
    return [np.stack(found[v.path]) for v in model.trainable_variables]


def _close(got, want) -> None:
    scale = max(float(np.abs(w).max()) for w in want)
    for g, w in zip(got, want, strict=True):
        np.testing.assert_allclose(np.asarray(g), w, rtol=0, atol=RTOL * scale)


def test_the_trainable_variables_are_the_factors_and_biases(case):
    model, *_ = case
    names = sorted(v.path.rsplit("/", 1)[1] for v in model.trainable_variables)
    assert (
        names
        == ["bias", "bias", "lora_kernel_a", "lora_kernel_a"] + ["lora_kernel_b"] * 2
    )


def test_rows_and_norms(case):
    model, data, loss, grads = case
    variables = model.trainable_variables
    rows = jk.jacobian(model, data, variables, outputs=loss, strategy="batch")
    _close(list(rows.jacobians.values()), grads)
    norms = jk.jacobian(
        model, data, variables, outputs=loss, strategy="batch", reduce="norm"
    )
    want = [np.linalg.norm(g.reshape(BATCH, -1), axis=1) for g in grads]
    _close(list(norms.jacobians.values()), want)


def test_clipped_sum_runs_batch(case):
    model, data, loss, grads = case
    flat = np.concatenate([g.reshape(BATCH, -1) for g in grads], axis=1)
    norms = np.linalg.norm(flat, axis=1)
    clip = float(np.median(norms))
    result = jk.jacobian(
        model,
        data,
        model.trainable_variables,
        outputs=loss,
        reduce=jk.ClippedSum(clip),
    )
    assert result.strategy == "batch", result.plan
    scales = np.minimum(1.0, clip / norms)
    _close(list(result.jacobians.values()), [np.tensordot(scales, g, 1) for g in grads])
    _close([result.norms], [norms])


def test_gram_and_projection(case):
    """``jk.gram`` and ``reduce=jk.Project``: the up part with GPT-2's bias
    on two axes is formed per row (not factored), the down part by its
    einsum; both against the float64 rows."""
    model, data, loss, grads = case
    flat = np.concatenate([g.reshape(BATCH, -1) for g in grads], axis=1)
    found = jk.gram(model, data, outputs=loss, strategy="batch", progress=False)
    _close([found.matrix], [flat @ flat.T])
    variables = model.trainable_variables
    project = jk.Project(16, seed=1)
    result = jk.jacobian(
        model, data, variables, outputs=loss, reduce=project, strategy="batch"
    )
    want = _projected_reference(project, list(result.jacobians), variables, grads)
    _close([result.projection], [want])


@pytest.mark.parametrize("name", sorted(layer_cases.LORA_EXTRA))
def test_other_lora_layers_against_float64(name):
    """A LoRA ``Dense`` without a bias, one with its bias frozen (no target,
    still added), an ``EinsumDense`` whose bias spans one output axis before
    the last (shape ``(d, 1)``) and one with Gemma's equation
    (``btd,ndh->btnh``: the down part by its transposed einsum), beside the
    conformance suite's three (whose harness this is; its float64 model's
    factors are float32, as Keras makes them: ``assert_close`` derives the
    tolerance from the loop's own error). Measured, on every way of calling
    and row mode: rows within 2.4e-7 of the largest value, norms 2.0e-7
    (the conformance suite's three: 2.1e-7 and 1.4e-7); the norms' bound
    is 1e-5."""
    model, layer, x, expected = conformance_reference(name, "functional", "per_example")
    result = jk.jacobian(model, x, layer, strategy="batch", outputs="per_example")
    # the layer's targets are what it trains (a frozen bias is none)
    assert sorted(result.jacobians) == sorted(w.path for w in layer.trainable_weights)
    testing.assert_close(result, list(expected))
    norms = jk.jacobian(
        model, x, layer, strategy="batch", outputs="per_example", reduce="norm"
    )
    for got, full in zip(norms.jacobians.values(), expected, strict=True):
        want = np.linalg.norm(np.asarray(full).reshape(np.size(got), -1), axis=1)
        assert np.abs(np.ravel(got) - want).max() <= RTOL * want.max()


@pytest.mark.parametrize("name", ["gpt2", "gemma"])
def test_coverage_of_a_lora_causal_lm(name):
    """Every trainable parameter of a LoRA causal LM (its factors and
    biases) is served by a closed form, and counted."""
    keras.utils.set_random_seed(0)
    if name == "gpt2":
        backbone = hub_models.gpt2(length=LENGTH, hidden=8, intermediate=16)
        model = keras_hub.models.GPT2CausalLM(backbone, preprocessor=None)
    else:
        backbone = hub_models.gemma(hidden=8, intermediate=16, head_dim=4)
        model = keras_hub.models.GemmaCausalLM(backbone, preprocessor=None)
    backbone.enable_lora(RANK)
    x = _tokens()
    found = jk.coverage(model, x, progress=False)
    assert found.share == 1.0, found.summary()
    counted = sum(int(np.prod(v.shape)) for v in model.trainable_variables)
    assert found.parameters == counted, found.summary()
    assert all("lora" in v.path or "bias" in v.path for v in model.trainable_variables)


def test_clipped_sum_under_dropout():
    """``training=True`` on a LoRA ``GPT2CausalLM`` (keras_hub's default
    dropout, 0.1): ``auto`` runs ``batch``, and the clipped sum and norms
    are those of one draw of the masks. The reference is
    ``tests/test_one_draw.py``'s: a float32 tape per example inside a
    ``StatelessScope`` at the model's seed state, taken before the call (the
    same masks; float32 against float32, the float64 references above check
    the arithmetic). Measured: at most 2e-7 of the largest value."""
    from tests.test_one_draw import _tape_rows

    keras.utils.set_random_seed(0)
    backbone = hub_models.gpt2(VOCABULARY, length=LENGTH, hidden=8, intermediate=16)
    model = keras_hub.models.GPT2CausalLM(backbone, preprocessor=None)
    backbone.enable_lora(RANK)
    rng = np.random.default_rng(3)
    for variable in model.trainable_variables:  # B starts at zero
        variable.assign(rng.normal(scale=0.3, size=variable.shape).astype("float32"))
    x = _tokens()
    y = np.roll(x["token_ids"], -1, axis=1)

    def next_token(y_true, y_pred):
        tokens = keras.losses.sparse_categorical_crossentropy(
            y_true, y_pred, from_logits=True
        )
        return keras.ops.mean(tokens, axis=-1)

    loss = jk.Loss(next_token)
    rows, norms = _tape_rows(model, x, y, loss)
    clip = float(np.median(norms))
    result = jk.jacobian(
        model,
        (x, y),
        model.trainable_variables,
        outputs=loss,
        reduce=jk.ClippedSum(clip),
        training=True,
    )
    assert result.strategy == "batch", result.plan
    scales = np.minimum(1.0, clip / norms)
    _close(list(result.jacobians.values()), [np.tensordot(scales, r, 1) for r in rows])
    _close([result.norms], [norms])


@pytest.mark.parametrize("name", ["Dense (LoRA)", "Embedding (LoRA)"])
def test_gram_and_kronecker_projection_of_factored_parts(name, monkeypatch):
    """The parts whose factors ``jk.gram`` and ``jk.Project`` use without
    forming the rows (a LoRA ``Dense``'s two matmuls; an embedding's lookup
    of ``A`` and its ``B``), every map a Kronecker product
    (``sketch.DENSE_ELEMENTS`` 0), against the float64 rows of the
    conformance harness. Measured: at most 2.2e-7 of the largest value."""
    from jacobkit.problem import sketch

    monkeypatch.setattr(sketch, "DENSE_ELEMENTS", 0)
    model, layer, x, expected = conformance_reference(name, "functional", "per_example")
    rows = [np.asarray(e).reshape(-1, *np.shape(e)[2:]) for e in expected]
    flat = np.concatenate([r.reshape(len(r), -1) for r in rows], axis=1)
    found = jk.gram(
        model, x, layer=layer, outputs="per_example", strategy="batch", progress=False
    )
    _close([np.asarray(found.matrix).reshape(flat.shape[0], -1)], [flat @ flat.T])
    project = jk.Project(9, seed=1)
    result = jk.jacobian(
        model, x, layer, outputs="per_example", reduce=project, strategy="batch"
    )
    variables = list(layer.trainable_weights)
    by_name = dict(zip(result.jacobians, rows, strict=True))
    names = list(result.jacobians)
    order = [next(v for v in variables if v.path == n) for n in names]
    want = _projected_reference(project, names, order, [by_name[n] for n in names])
    _close([np.asarray(result.projection).reshape(len(want), -1)], [want])
