"""The tiny keras_hub backbones (random init, no downloads) that several
test files build: one builder per family, sized by its arguments. Seeds are
the caller's (``keras.utils.set_random_seed`` before the call)."""

from __future__ import annotations

from typing import Any


def gpt2(vocabulary: int = 50, **sizes: int) -> Any:
    """A ``GPT2Backbone`` (sizes as :func:`_stack`)."""
    return _stack("GPT2Backbone", vocabulary, **sizes)


def bert(vocabulary: int = 50, **sizes: int) -> Any:
    """A ``BertBackbone`` (sizes as :func:`_stack`)."""
    return _stack("BertBackbone", vocabulary, **sizes)


def _stack(
    name: str,
    vocabulary: int,
    *,
    layers: int = 1,
    hidden: int = 16,
    intermediate: int = 32,
    length: int = 12,
    heads: int = 2,
) -> Any:
    """keras_hub's backbone ``name`` of ``layers`` transformer layers."""
    import keras_hub

    return getattr(keras_hub.models, name)(
        vocabulary_size=vocabulary,
        num_layers=layers,
        num_heads=heads,
        hidden_dim=hidden,
        intermediate_dim=intermediate,
        max_sequence_length=length,
    )


def gemma(
    vocabulary: int = 50,
    *,
    layers: int = 1,
    hidden: int = 16,
    intermediate: int = 32,
    head_dim: int = 8,
) -> Any:
    """A ``GemmaBackbone`` with grouped attention (2 query heads, 1 key and
    value head)."""
    return _grouped(
        "GemmaBackbone", vocabulary, layers, hidden, intermediate, head_dim=head_dim
    )


def llama(
    vocabulary: int = 50, *, layers: int = 1, hidden: int = 16, intermediate: int = 32
) -> Any:
    """A ``LlamaBackbone`` with grouped attention (2 query heads, 1 key and
    value head): its own RMS norms, rotary positions, untied reverse
    embeddings."""
    return _grouped("LlamaBackbone", vocabulary, layers, hidden, intermediate)


def _grouped(
    name: str,
    vocabulary: int,
    layers: int,
    hidden: int,
    intermediate: int,
    **extra: Any,
) -> Any:
    """keras_hub's backbone ``name`` with grouped attention: 2 query heads,
    1 key and value head (``extra``: its other arguments)."""
    import keras_hub

    return getattr(keras_hub.models, name)(
        vocabulary_size=vocabulary,
        num_layers=layers,
        num_query_heads=2,
        num_key_value_heads=1,
        hidden_dim=hidden,
        intermediate_dim=intermediate,
        **extra,
    )


def vit(*, layers: int = 2, hidden: int = 8, mlp: int = 16, **kwargs: Any) -> Any:
    """A ``ViTBackbone`` on 16 x 16 RGB images in patches of 4, 2 heads
    (``kwargs``: its other arguments, as ``name``)."""
    import keras_hub

    return keras_hub.models.ViTBackbone(
        image_shape=(16, 16, 3),
        patch_size=4,
        num_layers=layers,
        num_heads=2,
        hidden_dim=hidden,
        mlp_dim=mlp,
        **kwargs,
    )
