"""How far the closed forms reach: ``jk.coverage`` says which trainable
layers of a model they serve, and why not where they do not.

The per-layer closed forms (the ``batch`` strategy, ``reduce="norm"``, and
``auto``'s per-example rows) are what make per-example rows cost about what
summed rows cost. :func:`coverage` asks, for every layer that holds
trainable weights of its own, whether ``batch`` runs on it (its rule, its
calls found, its checks passed) exactly as a call would ask, or whether a
layer around it covers it (an attention layer its projections, ViT's
patching layer its position embedding); where neither, the refusal in words.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import tensorflow as tf

from jacobkit import layers, runtime, strategies
from jacobkit.keras import layer_tree
from jacobkit.problem import Call


@dataclass(frozen=True)
class LayerCoverage:
    """One layer's weights, and what serves them.

    Attributes:
        path: the layer's path in the model (``"transformer_layer_0/query"``).
        class_name: its class.
        parameters: the trainable parameters it holds itself.
        served_by: the path of the layer whose closed form serves them (the
            layer itself, or one around it), or ``None``: a generic strategy.
        reason: why no closed form serves them (empty where one does).
    """

    path: str
    class_name: str
    parameters: int
    served_by: str | None
    reason: str = ""


@dataclass(frozen=True)
class Coverage:
    """What the closed forms serve of a model's trainable layers
    (:func:`coverage`)."""

    layers: tuple[LayerCoverage, ...]

    @property
    def parameters(self) -> int:
        return sum(entry.parameters for entry in self.layers)

    @property
    def share(self) -> float:
        """The share of the trainable parameters a closed form serves (by
        variables' sizes)."""
        served = sum(e.parameters for e in self.layers if e.served_by is not None)
        return served / self.parameters if self.parameters else 1.0

    @property
    def generic(self) -> tuple[LayerCoverage, ...]:
        """The layers a generic strategy serves."""
        return tuple(e for e in self.layers if e.served_by is None)

    def summary(self) -> str:
        """One line of totals, then one per layer a closed form does not serve."""
        served = sum(e.served_by is not None for e in self.layers)
        lines = [
            f"closed forms serve {self.share:.1%} of {self.parameters:,} trainable "
            f"parameters ({served} of {len(self.layers)} layers)"
        ]
        lines += [
            f"  generic: {e.path} ({e.class_name}, {e.parameters:,}): {e.reason}"
            for e in self.generic
        ]
        return "\n".join(lines)

    __str__ = summary


def coverage(
    model: Any,
    inputs: Any,
    *,
    outputs: str | Callable[[Any], tf.Tensor] = "per_example",
    output: int | str | None = None,
    training: bool = False,
    progress: bool = True,
) -> Coverage:
    """For every layer of ``model`` that holds trainable weights itself,
    whether a per-layer closed form (the ``batch`` strategy) serves it on
    these inputs and rows, and why not where not.

    Each layer is tried as ``jacobian(model, inputs, layer, strategy="batch",
    outputs=...)`` checks it (nothing of the Jacobian is computed); where it
    is refused, the layers around it whose rule has it as a part are tried.
    A layer whose weights do not reach the rows is left out.

    Args:
        model: as for :func:`jacobkit.jacobian`.
        inputs: as for :func:`jacobkit.jacobian` (one batch of arrays).
        outputs: as for :func:`jacobkit.jacobian`.
        output: as for :func:`jacobkit.jacobian`.
        training: as for :func:`jacobkit.jacobian`.
        progress: a progress bar over the layers (each takes a traced pass).

    Returns:
        A :class:`Coverage`; ``print`` it for a summary.

    Example:
        >>> import keras, numpy as np, jacobkit as jk
        >>> model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3)])
        >>> jk.coverage(model, np.ones((2, 4), "float32")).share
        1.0
    """
    from tqdm import tqdm

    found: list[LayerCoverage] = []
    tried: dict[int, str | None] = {}
    owners = list(_owners(model))
    bar = tqdm(
        owners,
        desc="coverage",
        unit="layer",
        disable=not progress or None,
        delay=1.0,
        file=sys.stderr,
    )
    with runtime.tensorflow_warnings():
        for layer, path, around in bar:
            weights = layer_tree.own_trainable_weights(layer)
            size = int(sum(np.prod(w.shape) for w in weights))
            why = _refusal(model, inputs, layer, outputs, output, training, tried)
            if why == _UNCONNECTED:
                continue
            served = path if why is None else None
            for outer, outer_path in around:
                if served is not None:
                    break
                rule = layers.rule_for(outer)
                parts = () if rule is None else rule.parts()
                if any(part.layer is layer for part in parts) and (
                    _refusal(model, inputs, outer, outputs, output, training, tried)
                    is None
                ):
                    served = outer_path
            found.append(
                LayerCoverage(
                    path,
                    type(layer).__name__,
                    size,
                    served,
                    "" if served is not None else str(why),
                )
            )
    return Coverage(tuple(found))


_UNCONNECTED = "unconnected"


def _owners(model: Any) -> Iterator[tuple[Any, str, list[tuple[Any, str]]]]:
    """``(layer, path, [(layer around it, its path), ...])`` for every layer
    holding trainable weights itself, the innermost around it first."""
    chain: list[tuple[Any, tuple[str, ...]]] = []
    for layer, path in layer_tree.walk(model):
        chain = [(a, p) for a, p in chain if path[: len(p)] == p and p != path]
        if path and layer_tree.own_trainable_weights(layer):
            around = [(a, "/".join(p)) for a, p in reversed(chain) if p]
            yield layer, "/".join(path), around
        chain.append((layer, path))


def _refusal(
    model: Any,
    inputs: Any,
    layer: Any,
    outputs: Any,
    output: Any,
    training: bool,
    tried: dict[int, str | None],
) -> str | None:
    """Why ``batch`` refuses ``layer`` (``None``: it runs), cached per layer."""
    if id(layer) not in tried:
        try:
            problem = Call(
                model, layer, outputs=outputs, output=output, training=training
            ).problem(inputs)
        except ValueError as err:
            if "do not influence" in str(err):
                tried[id(layer)] = _UNCONNECTED
                return _UNCONNECTED
            raise
        try:
            strategies.Batch().check(problem)
            tried[id(layer)] = None
        except ValueError as err:
            text = str(err).replace("jacobian(strategy='batch'): ", "")
            tried[id(layer)] = text.split(". Use strategy=")[0]
    return tried[id(layer)]


__all__ = ["Coverage", "LayerCoverage", "coverage"]
