"""The layers a problem's gradient passes through that some strategies
cannot run through, in words for their refusals: recurrent layers (a
``tf.while_loop`` over time steps) and depthwise, separable or 3-D convolutions
(pfor has no rule for their gradients). What a layer type is, the layer
registry says (:mod:`jacobkit.layers`)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from jacobkit import layers
from jacobkit.keras import layer_tree

if TYPE_CHECKING:
    from jacobkit.problem.problem import Problem


def recurrent_layers(problem: Problem) -> str | None:
    """``"layer 'lstm' (LSTM)"``: the recurrent layers the targets' values
    flow through, or ``None``."""
    model = problem.model
    found = layer_tree.layers_through(
        model, problem.layer, layers.runs_a_loop
    ) or layer_tree.layers_through(model, None, layers.runs_a_loop)
    return layer_tree.describe(found) if found else None


def depthwise_layers(problem: Problem, *, after_only: bool = False) -> str | None:
    """``"layer 'dw' (DepthwiseConv2D)"``: the depthwise, separable and 3-D
    convolutions the rows' gradient passes through on its way to the targets,
    or ``None``; ``after_only``: those after the target layer (on the way to
    its output)."""
    target = problem.layer
    if target is None and problem.tensor_targets is not None:
        target = problem.tensor_targets.layer
    found = layer_tree.layers_through(
        problem.model, target, layers.pfor_cannot_vectorize, after_only=after_only
    )
    return layer_tree.describe(found) if found else None
