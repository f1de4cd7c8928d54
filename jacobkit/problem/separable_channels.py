"""The separable-channels structure (row colouring): the target layer's
output channel ``f`` reaches only output feature ``f``, through elementwise
layers, so one backward pass gives every row's Jacobian.

NOTE (why the shortcut is exact). The target is a stock ``Dense`` or
channels-last ``Conv`` layer ``L`` whose output ``a = act(x @ K + b)``
reaches ``Y`` only through elementwise layers (``Y[..., f] =
phi(a[..., f])``). Output feature ``f`` then depends on ``K`` and ``b`` only
through channel ``f``: ``dY[..., f] / dK[..., g] = 0`` for ``g != f``. The
rows' Jacobians have disjoint support (column ``f`` of the last axis), so the
gradient of the *sum* of all rows, one backward pass, holds every row's
Jacobian in its own column; row ``f``'s Jacobian is that column, zeros
elsewhere. For ``"per_example"`` rows the sum is taken per example: the
gradient of ``sum Y[b]`` with respect to the target, which only needs
``L``'s input ``x[b]`` (``x`` does not depend on ``K`` or ``b``: ``L`` runs
once), one vectorized pass over examples through ``L`` and the elementwise
layers only.

What is linear, elementwise or the identity at inference is asked of the
layer registry (:mod:`jacobkit.layers`), for exactly a stock class (a
subclass may change ``call``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import tensorflow as tf

from jacobkit import layers
from jacobkit.keras import compat
from jacobkit.keras import graph as keras_graph
from jacobkit.keras.compat import as_tf_variable
from jacobkit.problem import functional
from jacobkit.problem.functional import Graph, NotApplicable
from jacobkit.problem.problem import Problem


@dataclass(frozen=True)
class SeparableChannels:
    """The target layer's output channel ``f`` reaches only output feature
    ``f``, through elementwise layers.

    Attributes:
        layer: the target layer ``L``.
        channels: the output channel of each row's last index (the
            ``features=`` indices made non-negative, or ``range(F)``).
        layer_input: ``inputs -> x``, ``L``'s input (a sub-model built from
            the functional graph).
        tail: ``x -> Y``: ``L`` and the elementwise layers after it, called
            as the model calls them.
        description: the path, in words.
    """

    layer: Any
    channels: tuple[int, ...]
    layer_input: Callable[[Any], tf.Tensor]
    tail: Callable[[tf.Tensor], tf.Tensor]
    description: str

    def describe(self) -> str:
        return f"separable channels: {self.description}; one backward pass"


def find(problem: Problem, graph: Graph) -> SeparableChannels:
    """The separable channels of ``problem``'s target layer.

    Raises:
        NotApplicable: they are not, or not certainly.
    """
    layer = _target(problem, graph.keras)
    chain, node = _elementwise_chain(problem, graph)
    keras_graph.used_once(layer)
    layer_input = keras_graph.single_input(layer, node)
    prefix: Any = keras_graph.input_model(graph.keras, problem.model, layer_input)
    # The layer's input must not read the targets (weights shared with a
    # layer before it would make the contraction wrong).
    before = {id(as_tf_variable(v)) for v in prefix.weights}
    if any(id(t) in before for t in problem.targets):
        raise NotApplicable(
            f"separable channels: {layer.name!r}'s variables are also read before it"
        )
    path = [each.name for each in chain]
    called = [layer, *reversed(chain)]

    def tail(x: tf.Tensor) -> tf.Tensor:
        for each in called:
            x = each(x, training=False) if keras_graph.takes_training(each) else each(x)
        return x

    description = " -> ".join([layer.name, *reversed(path), "output"])
    return SeparableChannels(
        layer, functional.channels(problem), prefix, tail, description
    )


def _target(problem: Problem, keras: Any) -> Any:
    """The target layer, where its output channels can be separable."""
    layer = problem.layer
    if problem.rows_spec.mode not in ("features", "per_example"):
        raise NotApplicable(
            f"separable channels: outputs={problem.rows_spec.mode!r} rows are "
            "not colourable by output channel"
        )
    if layer is None:
        raise NotApplicable("separable channels: the targets are not a layer")
    linear = functional.linear_kind(layer)
    if linear is None:
        raise NotApplicable(
            f"separable channels: target {layer.name!r} is not a stock Dense "
            "or Conv layer"
        )
    if linear != "matmul" and compat.data_format(layer) != "channels_last":
        raise NotApplicable(f"separable channels: {layer.name!r} is channels_first")
    if functional.lora_or_quantized(layer):
        raise NotApplicable(f"separable channels: {layer.name!r} is LoRA/quantized")
    if not layers.elementwise_activation(keras, layer.activation):
        raise NotApplicable(
            f"separable channels: {layer.name!r}'s activation "
            f"{compat.activation_name(layer.activation) or layer.activation!r} is not "
            "elementwise"
        )
    if not problem.roles.cover(len(problem.targets)):
        raise NotApplicable("separable channels: a target is not the layer's own")
    width = problem.output_width
    for target in problem.targets:
        if target.shape[-1] != width:
            raise NotApplicable(
                f"separable channels: {layer.name!r} has {target.shape[-1]} "
                f"output channels, the model {width} features"
            )
    return layer


def _elementwise_chain(problem: Problem, graph: Graph) -> tuple[list[Any], Any]:
    """The layers from the output back to the target layer, each elementwise
    (given its activation) or the identity at inference, and the target's
    node."""
    layer = problem.layer
    chain = []
    current, node = keras_graph.producer(graph.output)
    while current is not layer:
        kind = layers.stock_kind(current)
        passes = kind is not None and (
            kind.elementwise or (kind.inference_identity and not problem.training)
        )
        if not passes:
            raise NotApplicable(
                f"separable channels: layer {current.name!r} "
                f"({type(current).__name__}) between {layer.name!r} and the "
                "output is not elementwise"
            )
        activation = compat.activation(current)
        if activation is not None and not layers.elementwise_activation(
            graph.keras, activation
        ):
            raise NotApplicable(
                f"separable channels: activation layer {current.name!r} is not "
                "elementwise"
            )
        keras_graph.used_once(current)
        chain.append(current)
        current, node = keras_graph.producer(keras_graph.single_input(current, node))
    return chain, node
