"""Where a language model's token embeddings are: the token embedding layer
(a keras_hub backbone's ``token_embedding``, or the model's one
``Embedding``), and the layer whose output carries their gradient (the
embedding's own, or, where the layer is tied to the logits and runs twice,
the ``Add`` its lookup feeds)."""

from __future__ import annotations

from typing import Any


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


def differentiated_layer(model: Any, layer: Any) -> Any:
    """Where the token embeddings are differentiated: the embedding layer's
    own output, or, where it is tied (called again for the logits, as
    keras_hub's causal LMs call it), the ``Add`` its lookup feeds (the
    token and position embeddings' sum: the same gradient)."""
    import keras

    nodes = list(getattr(layer, "_inbound_nodes", ()) or ())
    if len(nodes) <= 1:
        return layer
    lookup = [n for n in nodes if n.input_tensors and n.input_tensors[0].dtype in _INTS]
    if len(lookup) == 1:
        output = lookup[0].output_tensors[0]
        for other in getattr(model, "_flatten_layers", lambda: [])():
            for node in getattr(other, "_inbound_nodes", ()) or ():
                fed = any(t is output for t in node.input_tensors)
                add = isinstance(other, keras.layers.Add)
                if fed and add and len(other._inbound_nodes) == 1:
                    return other
    raise ValueError(
        f"token_attribution: the embedding {layer.name!r} is called "
        f"{len(nodes)} times (tied to the logits), and its lookup does not "
        "feed an Add layer whose output has the same gradient; name a layer "
        "that takes the token embeddings: embedding='...'."
    )


_INTS = ("int32", "int64", "uint8", "int16")


def _find(model: Any, name: str) -> Any:
    for layer in getattr(model, "_flatten_layers", lambda: [])():
        if layer.name == name:
            return layer
    return None
