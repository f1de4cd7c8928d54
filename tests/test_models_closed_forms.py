"""Per-example rows and norms by the closed forms inside models nobody here
wrote, where their layers are called from Python (keras_hub's transformer
blocks) or deep in a frozen keras.applications backbone, against float64;
and ``auto`` runs the closed form for them.

The keras_hub models (GPT-2, BERT, Gemma, Llama, ViT) are tiny random-init
configurations (2 blocks, hidden size 8, a 50-token vocabulary; nothing
downloaded), batch 2. The frozen backbones (ConvNeXtTiny, DenseNet121 at 32 px
with a Dense head) are slow to build and their float64 reference slower
(Keras's grouped convolution in float64): marked slow.

Tolerance: :func:`jacobkit.testing.assert_close`'s float32 floor, 1e-5
relative to the largest value of the result. Measured: the closed forms are
within 5e-7 of float64 on every case here.
"""

from __future__ import annotations

import numpy as np
import pytest

import jacobkit as jk
from jacobkit import testing
from jacobkit.problem import Problem
from tests import hub_models

keras = pytest.importorskip("keras")
keras_hub = pytest.importorskip("keras_hub")

_RNG = np.random.default_rng(0)


def _tokens(segment: bool = False) -> dict:
    x = {
        "token_ids": _RNG.integers(1, 50, (2, 6)).astype("int32"),
        "padding_mask": np.ones((2, 6), "int32"),
    }
    if segment:
        x["segment_ids"] = np.zeros((2, 6), "int32")
    return x


_TEXT = dict(layers=2, hidden=8, intermediate=16)


def _gpt2():
    model = hub_models.gpt2(**_TEXT)
    return model, _tokens()


def _bert():
    backbone = hub_models.bert(**_TEXT)
    # its sequence output alone (the float64 reference takes one output)
    model = keras.Model(backbone.inputs, backbone.output["sequence_output"])
    return model, _tokens(segment=True)


def _gemma():
    model = hub_models.gemma(head_dim=4, **_TEXT)
    return model, _tokens()


def _llama():
    model = hub_models.llama(layers=2, hidden=8, intermediate=16)
    return model, _tokens()


def _vit():
    model = hub_models.vit()
    return model, _RNG.normal(size=(2, 16, 16, 3)).astype("float32")


def _frozen(name: str):
    def build():
        backbone = getattr(keras.applications, name)(
            weights=None, include_top=False, input_shape=(32, 32, 3)
        )
        backbone.trainable = False
        inputs = keras.Input((32, 32, 3))
        pooled = keras.layers.GlobalAveragePooling2D()(backbone(inputs))
        model = keras.Model(inputs, keras.layers.Dense(3, name="head")(pooled))
        return model, _RNG.normal(size=(2, 32, 32, 3)).astype("float32")

    return build


_BUILDERS = {
    "gpt2": _gpt2,
    "bert": _bert,
    "gemma": _gemma,
    "llama": _llama,
    "vit": _vit,
    "convnext": _frozen("ConvNeXtTiny"),
    "densenet": _frozen("DenseNet121"),
}
_SLOW = pytest.mark.slow
CASES = [
    pytest.param("gpt2", "transformer_layer_1/feedforward_intermediate_dense"),
    pytest.param("gpt2", "transformer_layer_1/self_attention/query"),
    pytest.param("gpt2", "token_embedding"),
    pytest.param("bert", "transformer_layer_0/value"),
    pytest.param("bert", "position_embedding"),
    pytest.param("gemma", "decoder_block_1/query"),
    pytest.param("gemma", "decoder_block_0/pre_attention_norm"),
    pytest.param("llama", "transformer_layer_1/feedforward_layernorm"),
    pytest.param("llama", "transformer_layer_0/feedforward_gate_dense"),
    pytest.param("vit", "transformer_block_1/mlp/dense_1"),
    pytest.param("vit", "vit_patching_and_embedding"),
    pytest.param(
        "convnext", "convnext_tiny_stage_3_block_2_depthwise_conv", marks=_SLOW
    ),
    pytest.param("densenet", "conv5_block16_2_conv", marks=_SLOW),
]
_MODELS: dict = {}


def _model(name: str):
    if name not in _MODELS:
        _MODELS[name] = _BUILDERS[name]()
    return _MODELS[name]


@pytest.mark.parametrize(("name", "layer"), CASES)
def test_per_example_rows_and_norms_by_the_closed_form(name, layer):
    model, x = _model(name)
    targets = list(Problem(model, x, layer).targets)
    # (the float32 loop's own error is not measured: the floor holds)
    reference = testing.float64_reference(
        model,
        x,
        targets,
        outputs="per_example",
        call_kwargs={"training": False},
        baseline=False,
    )
    rows = jk.jacobian(model, x, layer, strategy="batch", outputs="per_example")
    testing.assert_close(rows, reference)
    norms = jk.jacobian(
        model,
        x,
        layer,
        strategy="batch",
        outputs="per_example",
        reduce="norm",
    )
    expected = [
        np.sqrt((np.asarray(r).reshape(int(np.prod(rows.rows_shape)), -1) ** 2).sum(-1))
        for r in reference.jacobians
    ]
    # float32 norms of float64 rows: measured within 3e-7 of the largest norm
    scale = max(float(e.max()) for e in expected) + 1e-30
    for got, want in zip(norms.jacobians.values(), expected, strict=True):
        assert np.abs(np.ravel(got) - want).max() <= 1e-5 * scale
    auto = jk.jacobian(model, x, layer, outputs="per_example")
    assert auto.strategy in ("batch", "structured"), auto.plan
    if auto.strategy == "structured":
        assert auto.strategy_config.resolved_inner().name == "batch", auto.plan


@pytest.mark.parametrize(("name", "layer"), [c for c in CASES if not c.marks])
def test_features_rows_in_several_chunks(name, layer, monkeypatch):
    """Rows summed over the batch, computed a few at a time
    (``CHUNK_BYTES`` shrunk so every row is its own chunk): inside the chunk
    loop, pfor's cotangents lost their static row count, and the einsum
    rule's reshape of an attention projection failed on it."""
    from jacobkit.strategies import batch

    model, x = _model(name)
    monkeypatch.setattr(batch, "CHUNK_BYTES", 1)
    monkeypatch.setattr(batch, "ROWS_AT_ONCE", 1)
    targets = list(Problem(model, x, layer).targets)
    reference = testing.float64_reference(
        model, x, targets, call_kwargs={"training": False}, baseline=False
    )
    rows = jk.jacobian(model, x, layer, strategy="batch", cache=False)
    testing.assert_close(rows, reference)
