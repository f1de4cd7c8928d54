"""What jacobkit reads from a model's layer tree, read-only.

- :func:`target_keys`: stable result keys, the layer's path inside the model
  (``"head/kernel"``; ``"backbone/conv1/kernel"`` in a nested sub-model),
  never the model's own name.
- :func:`layers_named`: the layers a ``layer=`` name or path names (a bare
  name, any path suffix, the full key prefix the results print);
  :func:`short_path`, the shortest of those that names one layer alone.
- :func:`close_names`: "did you mean" suggestions for a layer-name typo.
- :func:`contains_layer`: whether a layer is part of a model at all.
- :func:`layers_through`: the layers of a kind the caller chooses (a
  predicate, such as the layer registry's "loops over time") that a target's
  values flow through.
- :func:`input_mismatch`: the model's expected input shapes against the ones
  received, in words.

Nothing here calls a model or changes a layer.
"""

from __future__ import annotations

import difflib
import math
import re
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import tensorflow as tf

from jacobkit.keras import compat


#: class names (anywhere in a layer's MRO) of Keras layers that run a
#: ``tf.while_loop`` over time steps
def children(layer: Any) -> list[Any]:
    """The layers ``layer`` holds directly (sub-models, wrapped layers, cells)."""
    return compat.flatten_layers(layer, recursive=False)


def walk(model: Any) -> Iterator[tuple[Any, tuple[str, ...]]]:
    """``(layer, path)`` for ``model`` (path ``()``) and every layer inside it,
    depth first; ``path`` is the names from below ``model`` down to the layer.
    A layer reached twice (shared) is yielded once, at its first path."""
    seen: set[int] = set()

    def visit(layer: Any, path: tuple[str, ...]):
        if id(layer) in seen:
            return
        seen.add(id(layer))
        yield layer, path
        for child in children(layer):
            yield from visit(child, (*path, child.name))

    yield from visit(model, ())


def own_trainable_weights(layer: Any) -> list[Any]:
    """The trainable weights ``layer`` holds itself, not through the layers
    inside it (an attention layer holds none: its projections do). A frozen
    layer inside still holds its weights: keras_hub's ``enable_lora``
    freezes the blocks around the LoRA projections, whose factors are then
    trainable weights of the model but of no frozen block."""
    inner = {
        id(compat.unwrap(w))
        for child in children(layer)
        for w in getattr(child, "weights", ())
    }
    return [
        w
        for w in getattr(layer, "trainable_weights", ())
        if id(compat.unwrap(w)) not in inner
    ]


def _short_name(variable: Any) -> str:
    """``"kernel"`` for Keras 3's ``"kernel"`` and tf_keras' ``"dense/kernel:0"``."""
    name = variable.name.rsplit("/", 1)[-1]
    return name[:-2] if name.endswith(":0") else name


def target_keys(
    model: Any, variables: Sequence[Any], unwrap: Callable[[Any], Any]
) -> list[str | None]:
    """The result key of each variable: ``"<layer path>/<variable name>"``.

    The layer path is the names of the layers from below ``model`` down to the
    layer that holds the variable itself (its deepest owner: an LSTM's kernel
    is ``"lstm/lstm_cell/kernel"``, a nested sub-model's layer
    ``"backbone/conv1/kernel"``). The model's own name is never part of it, so
    a ``Sequential`` and a functional model give the same keys. ``None`` for a
    variable that is not in the model's layer tree. ``unwrap`` maps a variable
    to the ``tf.Variable`` that identifies it.
    """
    wanted = {id(unwrap(v)) for v in variables}
    owner: dict[int, tuple[str, ...]] = {}
    for layer, path in walk(model):
        for weight in compat.weights(layer):
            key = id(unwrap(weight))
            if key in wanted and len(path) >= len(owner.get(key, ())):
                owner[key] = (*path, _short_name(weight))
    return [
        "/".join(owner[id(unwrap(v))]) if id(unwrap(v)) in owner else None
        for v in variables
    ]


def contains_layer(model: Any, layer: Any) -> bool:
    """Whether ``layer`` is ``model`` or one of the layers inside it."""
    return any(candidate is layer for candidate, _ in walk(model))


def named_layers(model: Any) -> list[tuple[Any, str]]:
    """``(layer, path)`` of every layer inside ``model``, itself excluded; the
    path is the one result keys start with (``"block_0/query"``, see
    :func:`target_keys`). A plain ``tf.Module``'s sub-modules by name."""
    if compat.is_keras_layer(model):
        return [(layer, "/".join(path)) for layer, path in walk(model) if path]
    return [(module, module.name) for module in compat.flatten_layers(model)]


def _ends_with(path: str, suffix: str) -> bool:
    """Whether ``suffix`` is ``path`` or its last whole names."""
    return path == suffix or path.endswith("/" + suffix)


def _in_order(names: list[str], path: list[str]) -> bool:
    """Whether ``path`` ends with ``names[-1]`` and holds ``names[:-1]``
    before it, in order (others may come between)."""
    if not names or not path or names[-1] != path[-1]:
        return False
    rest = iter(path[:-1])
    return all(any(name == step for step in rest) for name in names[:-1])


def layers_named(layers: Sequence[tuple[Any, str]], name: str) -> list[tuple[Any, str]]:
    """The ``(layer, path)`` of ``layers`` (:func:`named_layers`) that ``name``
    names, in order:

    - the one layer whose full path is ``name`` (a top-level layer's name is
      its full path);
    - else every layer whose path ends with ``name`` in whole names: a bare
      name (``"query"``) or a path suffix (``"block_0/query"``);
    - else every layer whose path holds the names of ``name`` in order and
      ends with its last one (``"transformer_layer_0/query"`` names
      ``"transformer_layer_0/self_attention/query"``).

    More than one is ambiguous: the caller refuses it.
    """
    exact = [(layer, path) for layer, path in layers if path == name]
    if exact:
        return exact[:1]
    suffix = [(layer, path) for layer, path in layers if _ends_with(path, name)]
    if suffix:
        return suffix
    names = name.split("/")
    return [
        (layer, path) for layer, path in layers if _in_order(names, path.split("/"))
    ]


def short_path(path: str, paths: Sequence[str]) -> str:
    """The shortest suffix of ``path`` (whole names) that names it alone among
    ``paths`` (:func:`named_layers`): its bare name where no other layer ends
    with it, else ``"block_0/query"``, at most the full path."""
    names = path.split("/")
    for k in range(1, len(names)):
        suffix = "/".join(names[-k:])
        if sum(_ends_with(other, suffix) for other in paths) == 1:
            return suffix
    return path


def close_paths(
    name: str, paths: Sequence[str], among: Sequence[str], n: int = 3
) -> list[str]:
    """Up to ``n`` of ``paths`` closest to ``name``, each shown as its
    :func:`short_path` among ``among`` (every layer's path): ``name`` is
    compared with as many trailing names of each path as it has itself
    (``"qeury"`` with ``"query"``, ``"block_0/qeury"`` with
    ``"block_0/query"``)."""
    depth = len(name.split("/"))
    tails: dict[str, list[str]] = {}
    for path in paths:
        tails.setdefault("/".join(path.split("/")[-depth:]), []).append(path)
    found: list[str] = []
    for tail in close_names(name, list(tails), n=n):
        found.extend(short_path(path, among) for path in tails[tail])
    return found[:n]


def close_names(name: str, names: Sequence[str], n: int = 3) -> list[str]:
    """Up to ``n`` of ``names`` closest to ``name`` (``difflib``, ignoring
    case: ``"Head"`` and ``"HEAD1"`` both suggest ``"head"``)."""
    lowered: dict[str, str] = {}
    for candidate in names:
        lowered.setdefault(candidate.lower(), candidate)
    close = difflib.get_close_matches(name.lower(), list(lowered), n=n, cutoff=0.6)
    return [lowered[c] for c in close]


def layers_through(
    model: Any, target: Any, chosen: Callable[[Any], bool], *, after_only: bool = False
) -> list[Any]:
    """The outermost ``chosen`` layers that values of ``target`` flow
    through: the one that is or holds ``target``, else those after it in the
    model's layer order (none where it comes after them all); every one when
    ``target`` is ``None`` (variables, tensor targets) or not in the model.
    ``after_only``: those after it, not the one that is or holds it.

    ``chosen`` says which layers count (the depthwise check passes the layer
    registry's ``jacobkit.layers.pfor_cannot_vectorize``)."""
    found: list[tuple[int, Any, tuple[str, ...]]] = []
    target_at = None
    for position, (layer, path) in enumerate(walk(model)):
        if layer is target:
            target_at = (position, path)
        if chosen(layer) and not any(path[: len(p)] == p for _, _, p in found):
            found.append((position, layer, path))
    if target_at is not None:
        position, path = target_at
        holding = [layer for _, layer, p in found if path[: len(p)] == p]
        if holding and not after_only:
            return holding
        return [layer for at, layer, _ in found if at > position]
    return [layer for _, layer, _ in found]


def describe(layers: Sequence[Any]) -> str:
    """``"layer 'lstm' (LSTM)"`` or ``"layers 'a' (LSTM), 'b' (GRU)"``."""
    named = ", ".join(f"{layer.name!r} ({type(layer).__name__})" for layer in layers)
    return f"layer{'s' if len(layers) > 1 else ''} {named}"


# -- input shapes --------------------------------------------------------------
def _expected_inputs(model: Any) -> list[tuple[str, tuple]] | None:
    """``[(name, shape)]`` of the model's declared inputs (batch axis
    ``None``), or ``None`` where the model declares none (subclassed models,
    plain functions)."""
    try:
        declared = compat.declared_inputs(model)
    except (AttributeError, ValueError):
        return None
    if not declared:
        return None
    expected = []
    for tensor in declared:
        shape = getattr(tensor, "shape", None)
        if shape is None:
            return None
        dims = tuple(None if d is None else int(d) for d in tuple(shape))
        if not dims:
            return None
        expected.append((str(getattr(tensor, "name", "")), (None, *dims[1:])))
    return expected


def _fits(expected: tuple, received: tuple) -> bool:
    return len(expected) == len(received) and all(
        e is None or e == r for e, r in zip(expected, received)
    )


def _shape(dims: tuple) -> str:
    return (
        "("
        + ", ".join("None" if d is None else str(d) for d in dims)
        + (",)" if len(dims) == 1 else ")")
    )


def _batch_first(dims: tuple) -> str:
    return "(batch" + "".join(f", {d}" for d in dims[1:]) + ")"


def input_mismatch(model: Any, inputs: Any, flat: Sequence[Any]) -> str | None:
    """What is wrong with the shapes of ``inputs`` (``flat``: its tensors, in
    ``tf.nest`` order) for the model's declared inputs, in words; ``None``
    where the shapes fit or the model declares none."""
    expected = _expected_inputs(model)
    if expected is None:
        return None
    received: list[tuple[int | None, ...]] = [
        tuple(int(d) if d is not None else None for d in t.shape) for t in flat
    ]
    if len(expected) != len(received):
        listed = ", ".join(f"{name!r} {_shape(dims)}" for name, dims in expected)
        got = ", ".join(_shape(r) for r in received)
        return (
            f"the model takes {len(expected)} input(s) ({listed}), got "
            f"{len(received)} of shape(s) {got}. Pass one array per input, "
            "in a tuple, list or dict keyed by input name."
        )
    if isinstance(inputs, dict):
        by_name = dict(expected)
        if set(by_name) == set(inputs):
            expected = [(name, by_name[name]) for name in sorted(inputs)]
    for (name, want), shape in zip(expected, received):
        if _fits(want, shape):
            continue
        which = f"input {name!r} of " if len(expected) > 1 else ""
        start = (
            f"{which}the model expects shape {_shape(want)} (batch first), got "
            f"shape {_shape(shape)}"
        )
        if len(shape) == len(want) - 1 and _fits(want[1:], shape):
            return (
                f"{start}: the batch axis is missing. Add it: x[None] (or "
                "np.expand_dims(x, 0)) for a single example."
            )
        return f"{start}. Pass an array of shape {_batch_first(want)}."
    return None


_ANSI = re.compile(r"\x1b\[[0-9;]*m")
_NOISE = (
    "Exception encountered when calling",
    "Arguments received by",
    "Call arguments received by",
    "in user code:",
)


def error_summary(err: BaseException) -> str:
    """The informative line of a (Keras, ``tf.function``) error: the last
    exception's own message, without traceback frames or argument lists."""
    text = _ANSI.sub("", str(err))
    lines = [line.strip() for line in text.splitlines()]
    # tf.function's "in user code:" block ends with "    SomeError: message"
    for i in range(len(lines) - 1, -1, -1):
        match = re.match(r"^\w+(Error|Exception): (.*)$", lines[i])
        if match:
            lines = [match.group(2), *lines[i + 1 :]]
            break
    for line in lines:
        if line and not line.startswith(_NOISE) and not line.startswith(("•", "File ")):
            return line if line.endswith((".", "!", "?")) else line + "."
    return type(err).__name__ + "."


def output_bytes(model: Any, batch: int) -> int | None:
    """Bytes of the outputs of the layers of ``model``'s functional graph
    (nested models' layers included, the models themselves not) for a call
    on ``batch`` examples: what an eager Keras call holds at its peak, since
    a functional model keeps each node's output until the call returns. A
    layer with no node of its own (called from another layer's Python, as
    keras_hub's transformer blocks call theirs) holds its output only while
    that layer runs, and is not counted. ``None`` where a node's shape is
    not known beyond its batch (a model built for any sequence length); 0
    where no layer has a node (a subclassed model)."""
    total = 0
    for layer, path in walk(model):
        if not path or compat.is_model(layer):
            continue  # the model itself, a nested model: its layers count
        try:
            outputs = layer.output
        except (AttributeError, ValueError):
            continue
        for out in tf.nest.flatten(outputs):
            dims = tuple(out.shape)[1:]
            if any(d is None for d in dims):
                return None
            size = tf.as_dtype(out.dtype).size
            total += batch * size * math.prod(int(d) for d in dims)
    return total
