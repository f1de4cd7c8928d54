"""Which closed forms serve a problem's targets: one :class:`LayerForm` per
layer whose rule (:mod:`jacobkit.layers`) covers some of them.

A layer target is its own rule's. A list of variables (``model.
trainable_variables``, for per-example loss gradients of a whole model) is
shared out among the model's layers, outermost first: a layer whose rule's
parts hold only targets takes them (an attention layer its four projections,
ViT's patching layer its class token, convolution and position embedding),
the layers inside a layer without a rule are looked at next. Where some
target is left over, no closed form serves the problem.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from jacobkit import layers
from jacobkit.keras import compat, layer_tree
from jacobkit.problem.targets import Projection


@dataclass(frozen=True)
class LayerForm:
    """One layer's closed forms over some of the targets.

    Attributes:
        layer: the layer.
        rule: its rule.
        projections: its rule's parts, with the positions of their kernels and
            biases among the problem's targets.
    """

    layer: Any
    rule: layers.LayerRule
    projections: tuple[Projection, ...]


def share_out(model: Any, targets: Sequence[Any]) -> tuple[LayerForm, ...] | None:
    """The layers of ``model`` whose rules cover ``targets`` between them
    (outermost first, see the module docstring), or ``None`` where some target
    is no part of any (or no Keras model holds them)."""
    found, remaining = _shared(model, targets)
    return tuple(found) if found and not remaining else None


def served(model: Any, targets: Sequence[Any]) -> tuple[tuple[int, ...], ...]:
    """The positions among ``targets`` that each layer's rule covers (shared
    out as :func:`share_out` does, from the layers' types alone: nothing is
    traced), one tuple per layer; a target in none has no closed form."""
    found, _ = _shared(model, targets)
    return tuple(
        tuple(
            sorted(
                i for p in form.projections for i in (p.kernel, p.bias) if i is not None
            )
        )
        for form in found
    )


def _shared(
    model: Any, targets: Sequence[Any]
) -> tuple[list[LayerForm], dict[int, int]]:
    """The layer forms found, and the targets left over (by id: position)."""
    remaining = {id(compat.unwrap(t)): i for i, t in enumerate(targets)}
    found: list[LayerForm] = []
    for layer, path in layer_tree.walk(model):
        if not remaining:
            break
        if not path:
            continue  # the model itself
        rule = layers.rule_for(layer)
        if rule is None or rule.unsupported() is not None:
            continue
        parts = rule.parts()
        weights = [
            w
            for part in parts
            for w in (part.weight("kernel"), part.weight("bias"))
            if w is not None
        ]
        ids = [id(compat.unwrap(w)) for w in weights]
        if not ids or not all(i in remaining for i in ids):
            continue
        projections = []
        for part in parts:
            bias = part.weight("bias")
            projections.append(
                Projection(
                    part,
                    remaining[id(compat.unwrap(part.weight("kernel")))],
                    None if bias is None else remaining[id(compat.unwrap(bias))],
                )
            )
        for i in ids:
            del remaining[i]
        found.append(LayerForm(layer, rule, tuple(projections)))
    return found, remaining
