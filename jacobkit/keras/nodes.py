"""What a Keras model's graph nodes say, read without running it: the
operations of its graphs (:func:`operations`), a node's keyword arguments
(:func:`kwargs`), whether a layer is called once (:func:`called_once`) and a
symbolic shape on a given batch (:func:`sized`). Shared by
:mod:`.per_example` and :mod:`.matmuls`, and by
:mod:`jacobkit.problem.structural_inspect`, which reads no node itself.

Nothing here calls a model or changes a layer.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from jacobkit.keras import compat


def kwargs(node: Any) -> dict[str, Any]:
    """The keyword arguments a graph node called its operation with."""
    found = getattr(getattr(node, "arguments", None), "kwargs", None)
    return found or {}


def operations(model: Any) -> Iterator[Any]:
    """Every operation of ``model``'s graph and of the models in it, their
    nodes checked: ``training=True`` fixed in a call yields ``None``."""
    # a sequential model's graph is the functional model it builds
    graph = getattr(model, "_functional", None) or model
    for op in getattr(graph, "operations", None) or ():
        for node in getattr(op, "_inbound_nodes", None) or ():
            if kwargs(node).get("training") is True:
                yield None
        yield op
        if compat.is_model(op):
            yield from operations(op)


def called_once(layer: Any) -> bool:
    """Whether ``layer`` has at most one node in a graph (none: called from
    the Python of a listed layer, which calls each of its layers once), and
    that node does not call it in reverse (a ``ReversibleEmbedding`` as a
    language model's head: its weights tied to the inputs' embedding)."""
    found = list(getattr(layer, "_inbound_nodes", None) or ())
    return len(found) <= 1 and not any(kwargs(n).get("reverse") for n in found)


def sized(shape: Any, batch: int, length: int | None) -> tuple[int, ...] | None:
    """``shape`` (its first axis the batch) on ``batch`` examples, an unknown
    size beyond the batch taken as ``length`` (``None``: one is unknown and
    no ``length`` given)."""
    dims: list[int] = [batch]
    for d in tuple(shape)[1:]:
        size = length if d is None else d
        if size is None:
            return None
        dims.append(int(size))
    return tuple(dims)
