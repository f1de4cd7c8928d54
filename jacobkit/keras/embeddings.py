"""Where a language model's token embeddings are: the token embedding layer
(a keras_hub backbone's ``token_embedding``, or the model's one
``Embedding``). Its output is differentiated; a tied one's (called again for
the logits) at its lookup call (``jacobkit.keras.graph.LayerTap``)."""

from __future__ import annotations

from typing import Any

import numpy as np


def embedding_layer(model: Any, name: str | None = None) -> Any:
    """The token embedding layer: ``name``'s, a keras_hub backbone's
    ``token_embedding``, or the model's one ``Embedding``."""
    import keras

    if name is not None:
        found = _find(model, name)
        if found is None:
            raise ValueError(
                f"token_attribution(embedding={name!r}): the model has no layer "
                "of that name."
            )
        return found
    backbone = getattr(model, "backbone", model)
    found = getattr(backbone, "token_embedding", None)
    if found is not None:
        return found
    embeddings = [
        layer
        for layer in getattr(model, "_flatten_layers", lambda: [])()
        if isinstance(layer, keras.layers.Embedding)
    ]
    if len(embeddings) == 1:
        return embeddings[0]
    raise ValueError(
        "token_attribution(embedding=None): "
        + (
            "the model has no Embedding layer"
            if not embeddings
            else f"the model has {len(embeddings)} Embedding layers ("
            + ", ".join(e.name for e in embeddings)
            + ")"
        )
        + "; name the token embedding: embedding='...'."
    )


def pad_token_id(model: Any) -> int:
    """The padding token's id: the tokenizer's ``pad_token_id`` where the
    model has a preprocessor with one, else 0 (Gemma's, and BERT's and
    Llama's unknown or padding token)."""
    preprocessor = getattr(model, "preprocessor", None)
    tokenizer = getattr(preprocessor, "tokenizer", None)
    found = getattr(tokenizer, "pad_token_id", None)
    return int(found) if isinstance(found, (int, np.integer)) else 0


def _find(model: Any, name: str) -> Any:
    for layer in getattr(model, "_flatten_layers", lambda: [])():
        if layer.name == name:
            return layer
    return None
