"""keras_hub's BERT text classifier under Hugging Face's names and layouts
(``BertForSequenceClassification``): the inverse of keras_hub's
``convert_bert.py``, for the reductions benchmark's ``bert`` case, so that the
PyTorch peer (``reductions_torch.py``) differentiates the very same function.

Used on jacobkit's side (``export_reductions.py --case bert``); imports
nothing but NumPy.
"""

from __future__ import annotations

import re
from collections.abc import Callable

import numpy as np

#: keras_hub variable path (a regular expression) -> Hugging Face name, and
#: how a Keras-layout array of that variable becomes the PyTorch layout
_RULES: tuple[tuple[str, str, str], ...] = (
    (r"token_embedding/embeddings", "bert.embeddings.word_embeddings.weight", "same"),
    (
        r"position_embedding/embeddings",
        "bert.embeddings.position_embeddings.weight",
        "same",
    ),
    (
        r"segment_embedding/embeddings",
        "bert.embeddings.token_type_embeddings.weight",
        "same",
    ),
    (r"embeddings_layer_norm/gamma", "bert.embeddings.LayerNorm.weight", "same"),
    (r"embeddings_layer_norm/beta", "bert.embeddings.LayerNorm.bias", "same"),
    (
        r"transformer_layer_(\d+)/self_attention_layer/(query|key|value)/kernel",
        r"bert.encoder.layer.\1.attention.self.\2.weight",
        "heads_in",
    ),
    (
        r"transformer_layer_(\d+)/self_attention_layer/(query|key|value)/bias",
        r"bert.encoder.layer.\1.attention.self.\2.bias",
        "flat",
    ),
    (
        r"transformer_layer_(\d+)/self_attention_layer/attention_output/kernel",
        r"bert.encoder.layer.\1.attention.output.dense.weight",
        "heads_out",
    ),
    (
        r"transformer_layer_(\d+)/self_attention_layer/attention_output/bias",
        r"bert.encoder.layer.\1.attention.output.dense.bias",
        "same",
    ),
    (
        r"transformer_layer_(\d+)/self_attention_layer_norm/gamma",
        r"bert.encoder.layer.\1.attention.output.LayerNorm.weight",
        "same",
    ),
    (
        r"transformer_layer_(\d+)/self_attention_layer_norm/beta",
        r"bert.encoder.layer.\1.attention.output.LayerNorm.bias",
        "same",
    ),
    (
        r"transformer_layer_(\d+)/feedforward_layer_norm/gamma",
        r"bert.encoder.layer.\1.output.LayerNorm.weight",
        "same",
    ),
    (
        r"transformer_layer_(\d+)/feedforward_layer_norm/beta",
        r"bert.encoder.layer.\1.output.LayerNorm.bias",
        "same",
    ),
    (
        r"transformer_layer_(\d+)/feedforward_intermediate_dense/kernel",
        r"bert.encoder.layer.\1.intermediate.dense.weight",
        "transpose",
    ),
    (
        r"transformer_layer_(\d+)/feedforward_intermediate_dense/bias",
        r"bert.encoder.layer.\1.intermediate.dense.bias",
        "same",
    ),
    (
        r"transformer_layer_(\d+)/feedforward_output_dense/kernel",
        r"bert.encoder.layer.\1.output.dense.weight",
        "transpose",
    ),
    (
        r"transformer_layer_(\d+)/feedforward_output_dense/bias",
        r"bert.encoder.layer.\1.output.dense.bias",
        "same",
    ),
    (r"pooled_dense/kernel", "bert.pooler.dense.weight", "transpose"),
    (r"pooled_dense/bias", "bert.pooler.dense.bias", "same"),
    (r"logits/kernel", "classifier.weight", "transpose"),
    (r"logits/bias", "classifier.bias", "same"),
)

_LAYOUTS: dict[str, Callable[[np.ndarray], np.ndarray]] = {
    "same": lambda a: a,
    "flat": lambda a: a.reshape(-1),
    "transpose": lambda a: a.T,
    # (in, heads, head_dim) -> (heads * head_dim, in)
    "heads_in": lambda a: a.reshape(a.shape[0], -1).T,
    # (heads, head_dim, out) -> (out, heads * head_dim)
    "heads_out": lambda a: a.reshape(-1, a.shape[-1]).T,
}


def name_and_layout(path: str) -> tuple[str, str]:
    """A keras_hub variable's Hugging Face name and the kind of layout change
    (``"same"``, ``"flat"``, ``"transpose"``, ``"heads_in"``,
    ``"heads_out"``: each a transpose of a 2-D view, or none)."""
    for pattern, name, layout in _RULES:
        if re.fullmatch(pattern, path):
            return re.sub(pattern, name, path), layout
    raise SystemExit(f"bert_layout: no Hugging Face name for {path!r}")


def hf(path: str, array: np.ndarray) -> tuple[str, np.ndarray]:
    """A keras_hub variable's path and a Keras-layout array of its shape ->
    its Hugging Face name and the array in PyTorch's layout."""
    name, layout = name_and_layout(path)
    return name, np.ascontiguousarray(_LAYOUTS[layout](np.asarray(array)))
