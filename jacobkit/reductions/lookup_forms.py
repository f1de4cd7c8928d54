"""Which way each lookup target's pairs take in ``jk.gram``'s products
(:func:`jacobkit.layers.lookups.pair_products`: the distinct-id tables or
the matching pairs), decided in NumPy from the ids before the products are
traced, so that the compiled function traces the chosen way alone
(:func:`jacobkit.layers.lookups.form_of`, through
:func:`~jacobkit.problem.reduction.products.lookup_form`).

The ids are at hand eagerly where a chunk's features were computed apart
(:func:`of_features`), or, inside the one compiled call of the features and
their products, where a lookup's ids are a model input (reshaped or cast) or
constants (a position table's): read from the features' traced function
once (:func:`sources`), then from each call's inputs (:func:`of_inputs`).
Elsewhere (ids computed by the model) the way stays chosen per call inside
the compiled function (a ``tf.cond``, both ways traced).

NOTE (why not one way for good). The ways' costs depend on the ids (how
many distinct, how many shared between examples), not only on shapes: a
later call whose ids choose the other way gets that way's trace (kept
beside the first), one more trace where the data changes its mind, never a
slower way on every call.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import tensorflow as tf

from jacobkit.problem.reduction import Feature, Lookup
from jacobkit.problem.reduction.products import Forms, lookup_form

#: ops that keep a tensor's elements in order (the ids an input holds)
_KEEPING = frozenset({"Identity", "Cast", "Reshape"})

#: where a lookup target's ids come from: ``("input", index, shape)``, the
#: flattened inputs' ``index``-th reshaped to ``shape``; ``("constant",
#: ids)``; ``None``: computed by the model, or not a lookup target
Source = tuple[Any, ...] | None


def sources(traced: Any, inputs: Any) -> tuple[Source, ...]:
    """Each target's :data:`Source`, from ``traced``, the features' concrete
    function traced on ``inputs`` (its structured outputs' ``values``)."""
    flat = tf.nest.flatten(inputs)
    found: list[Source] = []
    for feature in traced.structured_outputs.values:
        found.append(
            _source(feature.ids, traced.graph, flat)
            if isinstance(feature, Lookup)
            else None
        )
    return tuple(found)


def _source(ids: tf.Tensor, graph: Any, flat: Sequence[Any]) -> Source:
    constant = tf.get_static_value(ids)
    if constant is not None:
        return ("constant", np.asarray(constant))
    shape = ids.shape
    if not shape.is_fully_defined():
        return None
    tensor = ids
    while tensor.op.type in _KEEPING:
        tensor = tensor.op.inputs[0]
    if tensor.op.type != "Placeholder":
        return None
    index = next((i for i, t in enumerate(graph.inputs) if t is tensor), None)
    if index is None or index >= len(flat):
        return None
    value = flat[index]
    if int(np.prod(value.shape)) != shape.num_elements():
        return None
    return ("input", index, tuple(shape.as_list()))


def of_inputs(
    found: tuple[Source, ...], traced: Any, inputs: Any, count: int | None
) -> Forms:
    """Each lookup target's way for this call's ``inputs`` (:data:`Forms`;
    ``None`` where its ids are not known before the call), the whole chunk
    with itself, or its first ``count`` examples against the rest."""
    if not any(s is not None for s in found):
        return None
    flat = tf.nest.flatten(inputs)
    forms: list[str | None] = []
    for source, feature in zip(found, traced.structured_outputs.values, strict=True):
        if source is None:
            forms.append(None)
            continue
        if source[0] == "constant":
            ids = source[1]
        else:
            value = np.asarray(flat[source[1]])
            if value.size != int(np.prod(source[2])):  # not the traced shapes
                forms.append(None)
                continue
            ids = value.reshape(source[2])
        rows = int(feature.cotangents.shape[1])
        forms.append(_split_form(ids, rows, count))
    return tuple(forms)


def of_features(a: Sequence[Feature], b: Sequence[Feature] | None) -> Forms:
    """Each lookup target's way between two chunks' features computed apart
    (their ids at hand; ``b=None``: a chunk with itself)."""
    forms: list[str | None] = []
    for i, fa in enumerate(a):
        fb = None if b is None else b[i]
        if not isinstance(fa, Lookup) or not _eager(fa, fb):
            forms.append(None)
            continue
        rows_a = int(fa.cotangents.shape[1])
        if fb is None or fb is fa:
            forms.append(lookup_form(fa.ids.numpy(), None, rows_a, rows_a))
            continue
        assert isinstance(fb, Lookup), "a lookup is paired with a lookup"
        rows_b = int(fb.cotangents.shape[1])
        forms.append(lookup_form(fa.ids.numpy(), fb.ids.numpy(), rows_a, rows_b))
    return tuple(forms) if any(f is not None for f in forms) else None


def within(features: Sequence[Feature], count: int) -> Forms:
    """:func:`of_features` of a chunk's first ``count`` examples against the
    rest."""
    forms = [
        _split_form(f.ids.numpy(), int(f.cotangents.shape[1]), count)
        if isinstance(f, Lookup) and _eager(f, None)
        else None
        for f in features
    ]
    return tuple(forms) if any(f is not None for f in forms) else None


def _split_form(ids: np.ndarray, rows: int, count: int | None) -> str:
    if count is None:
        return lookup_form(ids, None, rows, rows)
    return lookup_form(ids[:count], ids[count:], rows, rows)


def _eager(a: Lookup, b: Feature | None) -> bool:
    ids = [a.ids] if b is None or not isinstance(b, Lookup) else [a.ids, b.ids]
    return not any(tf.is_symbolic_tensor(t) for t in ids)
