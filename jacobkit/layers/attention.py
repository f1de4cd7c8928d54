"""``MultiHeadAttention``: its four projections (query, key, value, output),
each an ``EinsumDense`` with a closed form of its own
(:class:`~jacobkit.layers.einsum.EinsumDenseRule`); a ``MultiHeadAttention``
target means those four kernels and biases.

NOTE (how the projections are reached). The layer calls its projections from
Python, so they are not nodes of the model's graph and cannot be tapped
there. The rule taps the attention layer's own node instead and computes its
output beside it, as its ``call`` does: the three input projections with the
layer's own weights, the attention itself by the layer's
``_compute_attention_mask`` and ``_compute_attention`` (read-only methods of
the user's layer; nothing is set on it), then the output projection. The
``batch`` strategy checks that output against the layer's own before it
runs, so a Keras version whose ``call`` does more (a gate, a sliding window,
masks this rule does not pass on) is refused, not answered wrongly.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import tensorflow as tf

from jacobkit.layers.base import LayerRule, Tapped, Weights
from jacobkit.layers.einsum import EinsumDenseRule

#: the projections, in the order of :meth:`MultiHeadAttentionRule.parts`
_PROJECTIONS = ("_query_dense", "_key_dense", "_value_dense", "_output_dense")


class MultiHeadAttentionRule(LayerRule):
    """Closed forms of a ``MultiHeadAttention`` layer's four projections
    (Keras 3 or ``tf_keras``)."""

    kind = "multi_head_attention"
    covers = "its four projections"

    def parts(self) -> tuple[LayerRule, ...]:
        return tuple(
            EinsumDenseRule(getattr(self.layer, name)) for name in _PROJECTIONS
        )

    def weight(self, role: str) -> Any:
        """An attention layer has no kernel of its own (see :meth:`parts`)."""
        return None

    def unsupported(self) -> str | None:
        layer = self.layer
        if not all(getattr(layer, name, None) is not None for name in _PROJECTIONS):
            return "it is not built, or its projections are not where Keras keeps them"
        if getattr(layer, "_use_gate", False):
            return "it has a gate (use_gate=True)"
        if getattr(layer, "_sliding_window", None) is not None:
            return "it has a sliding window"
        for part in self.parts():
            why = part.unsupported()
            if why is not None:
                return f"its projection {part.layer.name!r}: {why}"
        return None

    def tapped_call(
        self,
        args: tuple,
        kwargs: dict,
        weights: Weights,
        watch: Callable[[tf.Tensor], tf.Tensor],
    ) -> tuple[Any, list[Tapped]]:
        layer = self.layer
        call = inspect.signature(layer.call).bind(*args, **kwargs).arguments
        if call.get("return_attention_scores"):
            raise ValueError("return_attention_scores=True is not supported")
        query, value = call["query"], call["value"]
        key = call.get("key")
        key = value if key is None else key
        mask = layer._compute_attention_mask(
            query,
            value,
            query_mask=_mask(call, "query_mask", query),
            value_mask=_mask(call, "value_mask", value),
            key_mask=_mask(call, "key_mask", key),
            attention_mask=call.get("attention_mask"),
            use_causal_mask=bool(call.get("use_causal_mask", False)),
        )
        parts = self.parts()
        taps = [
            part.tapped(x, kernel, bias, watch)
            for part, x, (kernel, bias) in zip(parts, (query, key, value), weights)
        ]
        attended, _ = layer._compute_attention(
            *(tap.z for tap in taps), mask, bool(call.get("training") or False)
        )
        taps.append(parts[3].tapped(attended, *weights[3], watch))
        return taps[3].z, taps


def _mask(call: dict, name: str, tensor: tf.Tensor) -> Any:
    """The mask Keras would pass as ``name``: the argument, else the
    tensor's own Keras mask."""
    given = call.get(name)
    return given if given is not None else getattr(tensor, "_keras_mask", None)
