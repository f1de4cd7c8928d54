"""Frozen backbones users bring: keras.applications ResNet50 (the users'
second case), MobileNetV2 and EfficientNetB0, and a keras_hub BERT
classifier, each with a small head, built with random weights
(``weights=None``, no preset) so that nothing is downloaded.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from jacobkit.testing.example import Example, keras_module, rng_inputs

__all__ = [
    "bert_classifier",
    "frozen_efficientnet",
    "frozen_mobilenet",
    "frozen_resnet",
]


def frozen_resnet(
    dtype: str = "float32",
    seed: int = 0,
    *,
    batch: int = 2,
    size: int = 32,
    classes: int = 3,
) -> Example:
    """The users' second case: a frozen ResNet50 backbone (``weights=None``,
    no download) with a pooling + Dropout + Dense(classes, softmax) head.
    Target: ``"head"``."""
    keras = keras_module()
    layers = keras.layers

    def head(h: Any) -> Any:
        h = layers.GlobalAveragePooling2D(dtype=dtype)(h)
        h = layers.Dropout(0.2, name="dropout", dtype=dtype)(h)
        return layers.Dense(classes, activation="softmax", name="head", dtype=dtype)(h)

    return _frozen(
        "frozen_resnet",
        lambda shape: keras.applications.ResNet50(
            weights=None, include_top=False, input_shape=shape
        ),
        "ResNet50",
        dtype,
        seed,
        {"batch": batch, "size": size, "classes": classes},
        head=head,
    )


def frozen_mobilenet(
    dtype: str = "float32",
    seed: int = 0,
    *,
    batch: int = 2,
    size: int = 32,
    classes: int = 3,
    alpha: float = 1.0,
) -> Example:
    """A frozen MobileNetV2 backbone (``weights=None``, average pooling; full
    width unless ``alpha``) under a linear ``Dense(classes)`` head. Target:
    ``"head"``."""
    keras = keras_module()
    return _frozen(
        "frozen_mobilenet",
        lambda shape: keras.applications.MobileNetV2(
            input_shape=shape,
            alpha=alpha,
            include_top=False,
            weights=None,
            pooling="avg",
        ),
        "MobileNetV2",
        dtype,
        seed,
        {"batch": batch, "size": size, "classes": classes},
    )


def frozen_efficientnet(
    dtype: str = "float32",
    seed: int = 0,
    *,
    batch: int = 2,
    size: int = 32,
    classes: int = 3,
) -> Example:
    """A frozen EfficientNetB0 backbone (``weights=None``, average pooling)
    under a linear ``Dense(classes)`` head. Target: ``"head"``."""
    keras = keras_module()
    return _frozen(
        "frozen_efficientnet",
        lambda shape: keras.applications.EfficientNetB0(
            input_shape=shape, include_top=False, weights=None, pooling="avg"
        ),
        "EfficientNetB0",
        dtype,
        seed,
        {"batch": batch, "size": size, "classes": classes},
    )


def _frozen(
    name: str,
    backbone_of: Callable[[tuple[int, int, int]], Any],
    title: str,
    dtype: str,
    seed: int,
    sizes: dict[str, int],
    *,
    head: Callable[[Any], Any] | None = None,
) -> Example:
    """``backbone_of(input_shape)``, frozen and called with
    ``training=False``, under ``head`` (default: a linear ``Dense(classes)``
    named ``"head"``, the target)."""
    keras = keras_module()
    keras.utils.set_random_seed(seed)  # before building: same weights every time
    shape = (sizes["size"], sizes["size"], 3)
    backbone = backbone_of(shape)
    backbone.trainable = False
    x = keras.Input(shape, dtype=dtype)
    if head is None:
        head = keras.layers.Dense(sizes["classes"], name="head", dtype=dtype)
    y = head(backbone(x, training=False))
    model = keras.Model(x, y, name=name)
    (inputs,) = rng_inputs(seed, dtype, (sizes["batch"], *shape))
    return Example(name, model, inputs, "head", f"frozen {title} + Dense head", sizes)


def bert_classifier(
    dtype: str = "float32",
    seed: int = 0,
    *,
    batch: int = 2,
    sequence: int = 16,
    classes: int = 3,
    layers: int = 2,
    hidden: int = 64,
) -> Example:
    """A keras_hub ``BertTextClassifier`` (random weights, no preprocessor)
    over a small ``BertBackbone``: ``layers`` transformer layers of width
    ``hidden`` (``max(2, hidden // 32)`` heads, a feed-forward of ``4 * hidden``), a
    1,000-token vocabulary. Target: its ``"logits"`` head. Needs keras-hub
    (the ``dev`` extra)."""
    try:
        import keras_hub
    except ImportError as err:  # pragma: no cover - in the dev extra
        raise ImportError(
            "the bert_classifier example needs keras-hub: pip install keras-hub"
        ) from err
    keras = keras_module()
    keras.utils.set_random_seed(seed)
    vocabulary = 1000
    backbone = keras_hub.models.BertBackbone(
        vocabulary_size=vocabulary,
        num_layers=layers,
        num_heads=max(2, hidden // 32),
        hidden_dim=hidden,
        intermediate_dim=4 * hidden,
        max_sequence_length=sequence,
        dtype=dtype,
    )
    model = keras_hub.models.BertTextClassifier(
        backbone=backbone, num_classes=classes, preprocessor=None, dtype=dtype
    )
    rng = np.random.default_rng(seed + 1000)
    inputs: dict[str, Any] = {
        "token_ids": rng.integers(0, vocabulary, size=(batch, sequence)).astype(
            "int32"
        ),
        "segment_ids": np.zeros((batch, sequence), "int32"),
        "padding_mask": np.ones((batch, sequence), "int32"),
    }
    return Example(
        "bert_classifier",
        model,
        inputs,
        "logits",
        "keras_hub BERT classifier",
        {"batch": batch, "sequence": sequence, "classes": classes},
    )
