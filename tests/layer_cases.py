"""One example per registered layer rule, and the three ways a model calls a
layer: as a node of a functional graph, from a subclassed model's ``call``,
and from inside a block (a layer that calls it from Python, as keras_hub's
transformer blocks do).

``tests/test_layer_conformance.py`` takes the product of the registry's rules
(every kind with a rule, ``jacobkit.layers.REGISTRY``), the ways of calling
and the row modes: a rule is checked by being registered, and the suite fails
for a rule without an example here.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import keras
import keras_hub
import numpy as np

#: per kind name: a fresh layer (float32 or float64) and how it is called
Make = Callable[[str], Any]


@dataclass(frozen=True)
class LayerCase:
    """An example of one layer kind.

    Attributes:
        make: ``dtype -> a new layer`` (unbuilt).
        shape: one example's input shape.
        ids: the input is token ids below this (else floating).
        call: how the layer is called on the input (``layer(x)`` by default).
    """

    make: Make
    shape: tuple[int, ...]
    ids: int | None = None
    call: Callable[[Any, Any], Any] = lambda layer, x: layer(x)


def _built(layer: Any, shape: tuple[int | None, ...]) -> Any:
    layer.build(shape)
    return layer


def _conv_inputs() -> tuple[int, ...]:
    return (6, 6, 4)


CASES: dict[str, LayerCase] = {
    "Dense": LayerCase(
        lambda d: keras.layers.Dense(5, activation="tanh", dtype=d), (3, 4)
    ),
    "Conv1D": LayerCase(
        lambda d: keras.layers.Conv1D(5, 3, activation="relu", dtype=d), (7, 4)
    ),
    "Conv2D": LayerCase(
        lambda d: keras.layers.Conv2D(4, 3, groups=2, padding="same", dtype=d),
        _conv_inputs(),
    ),
    "DepthwiseConv2D": LayerCase(
        lambda d: keras.layers.DepthwiseConv2D(3, depth_multiplier=2, dtype=d),
        _conv_inputs(),
    ),
    "SeparableConv2D": LayerCase(
        lambda d: keras.layers.SeparableConv2D(5, 3, padding="same", dtype=d),
        _conv_inputs(),
    ),
    "EinsumDense": LayerCase(
        # the kernel's output axis first: not Dense-like (Gemma's form)
        lambda d: keras.layers.EinsumDense("btd,ndh->btnh", (3, 2, 3), dtype=d),
        (3, 4),
    ),
    "MultiHeadAttention": LayerCase(
        lambda d: keras.layers.MultiHeadAttention(2, 3, dtype=d),
        (3, 4),
        call=lambda layer, x: layer(x, x),
    ),
    "Embedding": LayerCase(lambda d: keras.layers.Embedding(9, 4, dtype=d), (5,), 9),
    "LayerNormalization": LayerCase(
        lambda d: keras.layers.LayerNormalization(dtype=d), (3, 4)
    ),
    "BatchNormalization": LayerCase(
        lambda d: keras.layers.BatchNormalization(dtype=d), (3, 4)
    ),
    "RMSNormalization": LayerCase(
        lambda d: keras.layers.RMSNormalization(dtype=d), (3, 4)
    ),
    "PositionEmbedding": LayerCase(
        lambda d: keras_hub.layers.PositionEmbedding(sequence_length=6, dtype=d),
        (4, 3),
    ),
    # Keras's class, which keras_hub's models build (keras_hub's of that
    # name, registered too, is a subclass of it), with Gemma 2's soft cap
    "ReversibleEmbedding": LayerCase(
        lambda d: keras.layers.ReversibleEmbedding(9, 4, logit_soft_cap=3.0, dtype=d),
        (5,),
        9,
        # forward, then in reverse: the logits of the same table
        call=lambda layer, x: layer(layer(x), reverse=True),
    ),
    "LayerScale": LayerCase(
        lambda d: keras.src.applications.convnext.LayerScale(0.5, 4, dtype=d),
        (3, 4),
    ),
    "ViTPatchingAndEmbedding": LayerCase(
        # built eagerly, as ViTBackbone does: its position ids are made then
        lambda d: _built(
            keras_hub.src.models.vit.vit_layers.ViTPatchingAndEmbedding(
                image_size=(4, 4),
                patch_size=(2, 2),
                hidden_dim=4,
                num_channels=2,
                dtype=d,
            ),
            (None, 4, 4, 2),
        ),
        (4, 4, 2),
    ),
}


def lora(layer: Any, shape: tuple[int | None, ...], rank: int = 2) -> Any:
    """``layer`` built for ``shape``, then LoRA enabled (its kernel frozen,
    the factors and the bias trainable), as ``backbone.enable_lora`` does."""
    layer.build(shape)
    layer.enable_lora(rank, lora_alpha=3)
    return layer


#: a kind's LoRA rule (``LayerKind.lora``): the layer with LoRA enabled
LORA = " (LoRA)"
CASES["Dense" + LORA] = LayerCase(
    lambda d: lora(keras.layers.Dense(5, activation="tanh", dtype=d), (None, 3, 4)),
    (3, 4),
)
CASES["EinsumDense" + LORA] = LayerCase(
    # GPT-2's query and value: the bias on two output axes
    lambda d: lora(
        keras.layers.EinsumDense("abc,cde->abde", (3, 2, 3), bias_axes="de", dtype=d),
        (None, 3, 4),
    ),
    (3, 4),
)
CASES["Embedding" + LORA] = LayerCase(
    lambda d: lora(keras.layers.Embedding(9, 4, dtype=d), (None, 5)), (5,), 9
)


def _frozen_bias(layer: Any) -> Any:
    layer.bias.trainable = False
    return layer


#: LoRA layers beside those (``tests/test_lora.py``): no bias; Gemma's
#: equation, the kernel's output axis first
LORA_EXTRA = {
    "Dense (LoRA, no bias)": LayerCase(
        lambda d: lora(keras.layers.Dense(5, use_bias=False, dtype=d), (None, 3, 4)),
        (3, 4),
    ),
    "Dense (LoRA, frozen bias)": LayerCase(
        lambda d: _frozen_bias(lora(keras.layers.Dense(5, dtype=d), (None, 3, 4))),
        (3, 4),
    ),
    "EinsumDense (LoRA, a bias of shape (d, 1))": LayerCase(
        # bias_axes="d" of "abde": broadcast over e, summed over it
        lambda d: lora(
            keras.layers.EinsumDense(
                "abc,cde->abde", (3, 2, 3), bias_axes="d", dtype=d
            ),
            (None, 3, 4),
        ),
        (3, 4),
    ),
    "EinsumDense (LoRA, Gemma's equation)": LayerCase(
        lambda d: lora(
            keras.layers.EinsumDense("btd,ndh->btnh", (3, 2, 3), dtype=d), (None, 3, 4)
        ),
        (3, 4),
    ),
}
CASES.update(LORA_EXTRA)
#: kinds named alike in two libraries: the key above is the class's module
ALIASES = {
    "keras_hub.src.models.gemma.rms_normalization": "GemmaRMSNormalization",
}
CASES["GemmaRMSNormalization"] = LayerCase(
    lambda d: keras_hub.src.models.gemma.rms_normalization.RMSNormalization(dtype=d),
    (3, 4),
)


def _hub_rms(module: str, name: str) -> LayerCase:
    """One of keras_hub's copies of ``LlamaLayerNorm``."""
    cls = getattr(importlib.import_module(f"keras_hub.src.models.{module}"), name)
    return LayerCase(lambda d: cls(dtype=d), (3, 4))


for _module, _name in (
    ("llama.llama_layernorm", "LlamaLayerNorm"),
    ("mistral.mistral_layer_norm", "MistralLayerNormalization"),
    ("qwen.qwen_layernorm", "QwenLayerNorm"),
    ("qwen_moe.qwen_moe_layernorm", "QwenMoeLayerNorm"),
    ("qwen3.qwen3_layernorm", "Qwen3LayerNorm"),
    ("phi3.phi3_layernorm", "Phi3LayerNorm"),
):
    CASES[_name] = _hub_rms(_module, _name)


def case_name(kind: Any) -> str:
    """The key of ``kind``'s example."""
    layer = kind.layer
    if isinstance(layer, str) and ":" in layer:
        module = layer.partition(":")[0]
        return ALIASES.get(module, kind.name)
    return kind.name


# -- the ways of calling ------------------------------------------------------------
def _head(dtype: str) -> Any:
    return keras.layers.Dense(3, name="head", dtype=dtype)


def functional(case: LayerCase, layer: Any, dtype: str) -> Any:
    """``head(tanh(layer(x)))``, the layer a node of the graph."""
    x = keras.Input(case.shape, dtype="int32" if case.ids else dtype)
    h = keras.layers.Activation("tanh", dtype=dtype)(case.call(layer, x))
    return keras.Model(x, _head(dtype)(h))


class Subclassed(keras.Model):
    """The same computation in a subclassed model's ``call``."""

    def __init__(self, case: LayerCase, layer: Any, dtype: str) -> None:
        super().__init__(dtype=dtype)
        self.case = case
        self.inner = layer
        self.head = _head(dtype)

    def call(self, x: Any) -> Any:
        return self.head(keras.ops.tanh(self.case.call(self.inner, x)))


class Block(keras.layers.Layer):
    """A layer calling the layer from Python (a keras_hub block's habit)."""

    def __init__(self, case: LayerCase, layer: Any, dtype: str) -> None:
        super().__init__(dtype=dtype)
        self.case = case
        self.inner = layer

    def call(self, x: Any) -> Any:
        return keras.ops.tanh(self.case.call(self.inner, x))


def in_block(case: LayerCase, layer: Any, dtype: str) -> Any:
    """``head(Block(x))``: a functional model whose node is the block."""
    x = keras.Input(case.shape, dtype="int32" if case.ids else dtype)
    return keras.Model(x, _head(dtype)(Block(case, layer, dtype)(x)))


WAYS = {
    "functional": functional,
    "subclassed": lambda case, layer, dtype: Subclassed(case, layer, dtype),
    "block": in_block,
}


def inputs(case: LayerCase, dtype: str, batch: int = 3) -> np.ndarray:
    rng = np.random.default_rng(7)
    if case.ids:
        return rng.integers(0, case.ids, (batch, *case.shape)).astype("int32")
    return rng.normal(size=(batch, *case.shape)).astype(dtype)


def built(name: str, way: str, dtype: str) -> tuple[Any, Any, np.ndarray]:
    """``(model, target layer, inputs)`` for ``name`` called ``way``, with
    weights drawn from one seed (the float32 and float64 builds get the same
    values)."""
    case = CASES[name]
    layer = case.make(dtype)
    model = WAYS[way](case, layer, dtype)
    x = inputs(case, dtype)
    model(x)
    rng = np.random.default_rng(3)
    values = []
    for w in model.weights:
        value = rng.normal(scale=0.5, size=w.shape)
        if "variance" in w.path:  # a batch norm's moving variance is positive
            value = np.abs(value) + 0.5
        values.append(value.astype(w.dtype))
    model.set_weights(values)
    return model, layer, x
