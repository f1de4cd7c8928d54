"""The ``batch`` strategy's forward pass: the model's graph run with the
target layer's node computed beside the layer by its rule
(:meth:`jacobkit.layers.LayerRule.tapped_call`), each linear part's input
and pre-activation output ``z`` recorded on a tape. The user's layer is
never changed."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import tensorflow as tf

from jacobkit.layers import LayerRule
from jacobkit.layers.base import Tapped
from jacobkit.problem import Problem
from jacobkit.problem.targets import Projection


@dataclass(frozen=True)
class Forward:
    """A forward pass with the target layer computed beside it.

    Attributes:
        taps: each linear part's input and pre-activation output ``z``
            (:meth:`jacobkit.layers.LayerRule.tapped_call`), watched by
            ``tape``.
        rows: the per-example rows ``P``, ``(B, K)``.
        tape: the persistent tape that recorded the pass.
        output: the layer's output as computed beside it.
        own: the layer's output as the layer itself computes it (``None``
            unless asked for).
    """

    taps: list[Tapped]
    rows: tf.Tensor
    tape: tf.GradientTape
    output: Any
    own: Any


def tapped_forward(problem: Problem, inputs: Any, *, check: bool = False) -> Forward:
    """Forward pass recording the target layer's parts' inputs and outputs.

    The model's graph is run with the layer's node computed beside the layer
    (:meth:`jacobkit.layers.LayerRule.tapped_call`, :attr:`Problem.layer_tap`);
    the user's layer is never changed. With ``check``, the node's output as
    the layer itself computes it is recorded too.
    """
    found: list[tuple[list[Tapped], Any, Any]] = []
    layer_rule = rule(problem)
    targets = problem.targets
    weights = [
        (targets[p.kernel], None if p.bias is None else targets[p.bias])
        for p in projections(problem)
    ]

    def watch(z: tf.Tensor) -> tf.Tensor:
        tape.watch(z)
        return z

    def on_layer(call: Any, args: Any, kwargs: Any) -> Any:
        output, taps = layer_rule.tapped_call(args, kwargs, weights, watch)
        found.append((taps, output, call(*args, **kwargs) if check else None))
        return output

    tape = tf.GradientTape(persistent=True, watch_accessed_variables=False)
    with tape:
        per_example = problem.per_example_rows(inputs, hook=on_layer)
    taps, output, own = found[0]
    return Forward(taps, per_example, tape, output, own)


def rule(problem: Problem) -> LayerRule:
    """The target layer's rule (``batch`` runs only where it has one)."""
    found = problem.layer_rule
    assert found is not None, "checked before batch runs"
    return found


def projections(problem: Problem) -> tuple[Projection, ...]:
    """The target layer's linear parts (checked before batch runs)."""
    found = problem.projections
    assert found is not None, "checked before batch runs"
    return found
