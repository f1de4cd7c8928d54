"""What the structure finder (:mod:`.structure`) reads of a problem, for
both of its structures: the model's one output in its Keras 3 functional
graph, the output channels the rows select, and the stock layer facts it
relies on (asked of the layer registry, :mod:`jacobkit.layers`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from jacobkit import layers
from jacobkit.keras import compat
from jacobkit.keras import graph as keras_graph
from jacobkit.problem.problem import Problem

#: the structure is absent, or not certain; ``str()`` says why (the graph
#: walk's own refusal: :class:`jacobkit.keras.graph.NotCertain`)
NotApplicable = keras_graph.NotCertain


@dataclass(frozen=True)
class Graph:
    """The model's one output tensor and the Keras module it comes from."""

    keras: Any
    output: Any


def graph(problem: Problem) -> Graph:
    """The model's one output in its Keras 3 functional graph.

    Raises:
        NotApplicable: rows of a callable ``outputs=``, not a Keras 3
            functional (or ``Sequential``) model, or not one output.
    """
    if callable(problem.rows_spec.mode):
        raise NotApplicable("a callable outputs= may mix features")
    try:
        import keras
    except ImportError as err:  # pragma: no cover - keras ships with tensorflow
        raise NotApplicable("Keras 3 is not installed") from err
    model = problem.model
    if not isinstance(model, keras.Model):
        raise NotApplicable(
            f"{type(model).__name__} is not a Keras 3 model (structure is read "
            "from Keras 3 functional graphs only)"
        )
    try:
        outputs = model.outputs
    except AttributeError as err:
        raise NotApplicable(
            f"{type(model).__name__} has no functional graph (a subclassed model)"
        ) from err
    if not outputs or len(outputs) != 1:
        raise NotApplicable("the model does not have exactly one output")
    return Graph(keras, outputs[0])


def channels(problem: Problem) -> tuple[int, ...]:
    """The output channel of each row's last index: the ``features=``
    indices made non-negative, or ``range(F)``."""
    width = int(problem.output_width or 0)
    chosen = problem.rows_spec.features
    if chosen is None:
        return tuple(range(width))
    return tuple(f % width for f in chosen)


def linear_kind(layer: Any) -> str | None:
    """How ``layer``'s output before its activation is linear in its input
    (:data:`jacobkit.layers.registry.Linear`: ``"matmul"``, ``"convolution"``)
    where it is exactly a stock class that is, else ``None``."""
    kind = layers.stock_kind(layer)
    return None if kind is None else kind.linear


def lora_or_quantized(layer: Any) -> bool:
    return compat.lora_enabled(layer) or bool(compat.quantization_mode(layer))


def refuse_own_variables(problem: Problem, layer: Any, structure: str) -> None:
    """Raise :data:`NotApplicable` where ``problem``'s targets include
    ``layer``'s own variables: a structure that rewrites ``layer``'s pass
    (``structure`` names it in the message) keeps no gradient of them."""
    own = {id(compat.as_tf_variable(v)) for v in layer.weights}
    if any(id(t) in own for t in problem.targets):
        raise NotApplicable(
            f"{structure}: the targets include {layer.name!r}'s own variables"
        )
