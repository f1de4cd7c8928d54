"""The sizes of the benchmarks' keras_hub models, one place for every script
that builds them (and for the exports its PyTorch peers rebuild), so that
two benchmarks said to run the same model do.

Imports nothing: a script imports it by name from this folder (``import
model_configs``, as ``runs``), a module imported as ``benchmarks.<name>`` as
``benchmarks.model_configs``.
"""

from __future__ import annotations

from typing import Any

#: keras_hub's ``GPT2Backbone`` of the token-attribution benchmark and its
#: PyTorch export (``peers/export_gpt2.py``), 128 positions; the reductions'
#: and DP fit's causal LM is the same at 32 positions (:func:`gpt2`)
GPT2: dict[str, Any] = dict(
    vocabulary_size=1000,
    num_layers=2,
    num_heads=4,
    hidden_dim=64,
    intermediate_dim=128,
    max_sequence_length=128,
)

#: the tiny text backbones (BERT, GPT-2) of the coverage and IG-rules
#: benchmarks, their positions left to each
TINY_TEXT: dict[str, Any] = dict(
    vocabulary_size=50,
    num_layers=2,
    num_heads=2,
    hidden_dim=16,
    intermediate_dim=32,
)


def gpt2(length: int = 128) -> dict[str, Any]:
    """:data:`GPT2`'s sizes at ``length`` positions."""
    return {**GPT2, "max_sequence_length": length}


def tiny_text(length: int) -> dict[str, Any]:
    """:data:`TINY_TEXT`'s sizes at ``length`` positions."""
    return {**TINY_TEXT, "max_sequence_length": length}
