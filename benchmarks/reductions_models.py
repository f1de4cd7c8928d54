"""The models of the reductions benchmark (``benchmarks/reductions.py``) and
of its PyTorch anchor (``benchmarks/peers/reductions_torch.py``), built with
fixed random weights so both sides differentiate the same function.

- ``convnet``: 32×32×3 images → Conv2D 3→32 (3×3, relu, ``conv1``) → Conv2D
  32→64 (3×3, stride 2, relu, ``conv2``) → global average pooling → Dense
  64→10 (``head``), logits; batch 32, integer labels.
- ``mlp``: a wide MLP, 512 → 1024 (relu) → 1024 (tanh) → 10 logits (1.6 M
  parameters, every per-example gradient 6.3 MiB), batch 32: where the
  per-example gradients are large against the layers' inputs and cotangents;
- ``bert``: a keras_hub BERT text classifier (2 layers, hidden 64, 4 heads,
  vocabulary 1000, 32 tokens), random init, integer labels over 4 classes.
- ``convnet_medium`` and ``bert_small``: the same kinds at sizes where a
  call's fixed costs no longer dominate (the clipped sum's goal, fastDP's
  claim, is stated for such models): four convolutions 3→64→64→128→128
  (the third of stride 2) on 32×32 images; BERT with 4 layers, hidden 256,
  4 heads, intermediate 1024, BERT's vocabulary of 30,522, 32 tokens.
- ``gpt2``: a keras_hub ``GPT2CausalLM`` (the causal LM of
  ``privacy_fit.py`` and ``token_attribution.py``: 2 layers, hidden 64, 4
  heads, intermediate 128, vocabulary 1000, the token table tied to the LM
  head), random init, dropout 0, 32 tokens; the inputs are the first 32 of
  33 random tokens, the labels the last 32 (each position's next token), and
  each example's loss is its mean next-token cross-entropy
  (:func:`next_token_loss`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

try:
    from benchmarks import model_configs
except ImportError:  # imported by name from this folder (peers' exports)
    import model_configs  # type: ignore[no-redef]

BATCH = 32
CLASSES = 10


@dataclass(frozen=True)
class Case:
    """A model, one batch ``(x, y)`` and the loss every reduction uses."""

    name: str
    model: Any
    x: Any
    y: np.ndarray


def convnet(batch: int = BATCH, seed: int = 0) -> Case:
    return _convnet("convnet", [(32, 1), (64, 2)], batch, seed)


def _convnet(name: str, layers: list[tuple[int, int]], batch: int, seed: int) -> Case:
    """32×32×3 images → 3×3 relu convolutions of ``(filters, stride)``
    (``conv1``, ``conv2``, ...) → global average pooling → Dense logits
    (``head``)."""
    import keras

    keras.utils.set_random_seed(seed)
    inputs = keras.Input((32, 32, 3))
    h = inputs
    for i, (filters, stride) in enumerate(layers):
        h = keras.layers.Conv2D(
            filters, 3, strides=stride, activation="relu", name=f"conv{i + 1}"
        )(h)
    h = keras.layers.GlobalAveragePooling2D()(h)
    outputs = keras.layers.Dense(CLASSES, name="head")(h)
    model = keras.Model(inputs, outputs, name=name)
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((batch, 32, 32, 3)).astype("float32")
    y = rng.integers(0, CLASSES, batch).astype("int64")
    return Case(name, model, x, y)


def mlp(batch: int = BATCH, seed: int = 0) -> Case:
    import keras

    keras.utils.set_random_seed(seed)
    model = keras.Sequential(
        [
            keras.Input((512,)),
            keras.layers.Dense(1024, activation="relu", name="hidden1"),
            keras.layers.Dense(1024, activation="tanh", name="hidden2"),
            keras.layers.Dense(CLASSES, name="head"),
        ],
        name="mlp",
    )
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((batch, 512)).astype("float32")
    y = rng.integers(0, CLASSES, batch).astype("int64")
    return Case("mlp", model, x, y)


def bert(batch: int = BATCH, seed: int = 0) -> Case:
    return _bert("bert", 1000, (2, 64, 128), batch, seed)


def _bert(
    name: str, vocabulary: int, sizes: tuple[int, int, int], batch: int, seed: int
) -> Case:
    """A keras_hub BERT text classifier (4 heads, 32 tokens) over 4 classes,
    ``sizes``: its layers, hidden width and feed-forward width."""
    import keras
    import keras_hub

    keras.utils.set_random_seed(seed)
    layers, hidden, intermediate = sizes
    backbone = keras_hub.models.BertBackbone(
        vocabulary_size=vocabulary,
        num_layers=layers,
        num_heads=4,
        hidden_dim=hidden,
        intermediate_dim=intermediate,
        max_sequence_length=32,
    )
    model = keras_hub.models.BertTextClassifier(
        backbone, num_classes=4, preprocessor=None
    )
    rng = np.random.default_rng(seed)
    x = {
        "token_ids": rng.integers(1, vocabulary, (batch, 32)).astype("int32"),
        "segment_ids": np.zeros((batch, 32), "int32"),
        "padding_mask": np.ones((batch, 32), "int32"),
    }
    y = rng.integers(0, 4, batch).astype("int64")
    return Case(name, model, x, y)


def loss(case: str = "") -> Any:
    """Each example's loss ``(y, logits) -> (B,)``: the cross-entropy of its
    label, from logits; on ``gpt2`` its mean next-token cross-entropy
    (:func:`next_token_loss`)."""
    import keras

    if case == "gpt2":
        return next_token_loss
    return keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction=None)


def next_token_loss(y_true: Any, y_pred: Any) -> Any:
    """Each sequence's mean next-token cross-entropy: labels ``(B, T)``,
    logits ``(B, T, V)`` -> ``(B,)``."""
    import keras

    tokens = keras.losses.sparse_categorical_crossentropy(
        y_true, y_pred, from_logits=True
    )
    return keras.ops.mean(tokens, axis=-1)


#: the causal LM's sizes (those of ``privacy_fit.py``'s and
#: ``token_attribution.py``'s, with 32 positions)
GPT2 = model_configs.gpt2(32)


def gpt2(batch: int = BATCH, seed: int = 0) -> Case:
    """keras_hub's ``GPT2CausalLM`` of :data:`GPT2`'s sizes, dropout 0, no
    preprocessor; ``x``: ``token_ids`` and ``padding_mask`` ``(B, 32)``
    (nothing padded), ``y``: each position's next token ``(B, 32)``."""
    import keras
    import keras_hub

    keras.utils.set_random_seed(seed)
    backbone = keras_hub.models.GPT2Backbone(**GPT2, dropout=0.0)
    model = keras_hub.models.GPT2CausalLM(backbone, preprocessor=None)
    length = GPT2["max_sequence_length"]
    rng = np.random.default_rng(seed)
    tokens = rng.integers(1, GPT2["vocabulary_size"], (batch, length + 1))
    x = {
        "token_ids": tokens[:, :-1].astype("int32"),
        "padding_mask": np.ones((batch, length), "int32"),
    }
    return Case("gpt2", model, x, tokens[:, 1:].astype("int64"))


def convnet_medium(batch: int = BATCH, seed: int = 0) -> Case:
    return _convnet(
        "convnet_medium", [(64, 1), (64, 1), (128, 2), (128, 1)], batch, seed
    )


def bert_small(batch: int = BATCH, seed: int = 0) -> Case:
    return _bert("bert_small", 30522, (4, 256, 1024), batch, seed)


CASES = {
    "convnet": convnet,
    "mlp": mlp,
    "bert": bert,
    "convnet_medium": convnet_medium,
    "bert_small": bert_small,
    "gpt2": gpt2,
}
#: the runs of the larger cases: the clipped sum's goal against a plain step;
#: on ``bert_small``, whose token table alone is 7.8 M numbers per example,
#: also the Gram matrix and the projection against materializing (GBs, and
#: seconds per call)
ONLY = {
    "convnet_medium": ("plain step", "clipped sum"),
    "bert_small": (
        "plain step",
        "clipped sum",
        "gram",
        "budgeted gram",
        "materialized gram",
        "projection",
        "materialized projection",
    ),
}
#: steady calls per round where the default's would take minutes
REPEATS = {"bert_small": 2}
