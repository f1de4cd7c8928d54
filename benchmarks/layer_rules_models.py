"""The models of the layer-rules table's second part: layers inside models
users load, called from Python (keras_hub blocks, a subclassed model) or
deep in a frozen keras.applications backbone. Each case builds its model
with random weights, at batch 16; ``benchmarks/layer_rules.py`` measures one
case per fresh process (first call and process growth included).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

BATCH = 16


def _tokens(vocabulary: int = 100, length: int = 16, segment: bool = False) -> dict:
    rng = np.random.default_rng(0)
    x = {
        "token_ids": rng.integers(1, vocabulary, (BATCH, length)).astype("int32"),
        "padding_mask": np.ones((BATCH, length), "int32"),
    }
    if segment:
        x["segment_ids"] = np.zeros((BATCH, length), "int32")
    return x


def _text(name: str) -> Callable[[], tuple[Any, Any, dict]]:
    def build() -> tuple[Any, Any, dict]:
        import keras_hub

        sizes = dict(num_layers=2, hidden_dim=64, intermediate_dim=128)
        if name == "gpt2":
            model = keras_hub.models.GPT2Backbone(
                vocabulary_size=100, num_heads=4, max_sequence_length=32, **sizes
            )
            return model, _tokens(), {}
        if name == "bert":
            model = keras_hub.models.BertBackbone(
                vocabulary_size=100, num_heads=4, max_sequence_length=32, **sizes
            )
            return model, _tokens(segment=True), {"output": "sequence_output"}
        model = keras_hub.models.GemmaBackbone(
            vocabulary_size=100,
            num_query_heads=4,
            num_key_value_heads=1,
            head_dim=16,
            **sizes,
        )
        return model, _tokens(), {}

    return build


def _vit() -> tuple[Any, Any, dict]:
    import keras_hub

    model = keras_hub.models.ViTBackbone(
        image_shape=(32, 32, 3),
        patch_size=8,
        num_layers=2,
        num_heads=4,
        hidden_dim=64,
        mlp_dim=128,
    )
    x = np.random.default_rng(0).normal(size=(BATCH, 32, 32, 3)).astype("float32")
    return model, x, {}


def _frozen(name: str) -> Callable[[], tuple[Any, Any, dict]]:
    def build() -> tuple[Any, Any, dict]:
        import keras

        backbone = getattr(keras.applications, name)(
            weights=None, include_top=False, input_shape=(32, 32, 3)
        )
        backbone.trainable = False
        inputs = keras.Input((32, 32, 3))
        pooled = keras.layers.GlobalAveragePooling2D()(backbone(inputs))
        model = keras.Model(inputs, keras.layers.Dense(10, name="head")(pooled))
        x = np.random.default_rng(0).normal(size=(BATCH, 32, 32, 3)).astype("float32")
        return model, x, {}

    return build


def _subclassed() -> tuple[Any, Any, dict]:
    from jacobkit.testing import examples

    ex = examples.build("subclassed", batch=BATCH)
    return ex.model, ex.inputs, {}


#: case name -> (builder, target layer)
CASES: dict[str, tuple[Callable[[], tuple[Any, Any, dict]], str]] = {
    "subclassed / inner": (_subclassed, "inner"),
    "GPT-2 / ffn dense": (
        _text("gpt2"),
        "transformer_layer_1/feedforward_intermediate_dense",
    ),
    "GPT-2 / attention query": (
        _text("gpt2"),
        "transformer_layer_1/self_attention/query",
    ),
    "BERT / attention value": (_text("bert"), "transformer_layer_0/value"),
    "Gemma / query": (_text("gemma"), "decoder_block_1/query"),
    "Gemma / ffw gating": (_text("gemma"), "decoder_block_1/ffw_gating"),
    "Gemma / RMS norm": (_text("gemma"), "decoder_block_1/pre_ffw_norm"),
    "ViT / mlp dense": (_vit, "transformer_block_1/mlp/dense_1"),
    "ConvNeXtTiny (frozen) / depthwise": (
        _frozen("ConvNeXtTiny"),
        "convnext_tiny_stage_3_block_2_depthwise_conv",
    ),
    "ConvNeXtTiny (frozen) / layer scale": (
        _frozen("ConvNeXtTiny"),
        "convnext_tiny_stage_3_block_2_layer_scale",
    ),
    "DenseNet121 (frozen) / conv": (_frozen("DenseNet121"), "conv5_block16_2_conv"),
}
