"""Taps on one layer of a functional Keras model, leaving the model untouched.

The batch strategy needs a layer's input and pre-activation output, and
``Output("layer")`` targets need to differentiate with respect to a layer's
output. Both are got here by running the model's own functional graph node by
node, as the model's ``call`` does, and handing the target layer's node to a
hook instead of calling the layer. Nothing on the user's model, layers or
variables is replaced or added, so other threads may run the same model (or
tap it) at the same time.

Earlier versions replaced ``layer.call`` and ``layer.activation`` while
tracing: a second thread then crashed (``'Conv1D' object has no attribute
'call'``) or ran the model with the activation replaced. Sub-models from an
intermediate tensor (``keras.Model(layer.output, model.output)``) are not
used either: Keras clones the graph nodes between them and appends the clones
to the user's downstream layers.

Subclassed models have no graph to run: their ``call`` is Python code that
calls the layer itself, so a layer inside one cannot be tapped without
changing it, and :class:`LayerTap` refuses it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import tensorflow as tf

from jacobkit.keras import compat

#: hook(call, args, kwargs) -> the node's outputs; ``call(*args, **kwargs)``
#: runs the layer as the model would.
Hook = Callable[[Callable[..., Any], tuple, dict], Any]


class TapError(ValueError):
    """The layer cannot be tapped; the message says why (completed by callers)."""


class NotCertain(Exception):
    """A Keras 3 functional graph is not as a shortcut needs it, or not
    certainly so; ``str()`` says why."""


def _keras3_graph(model: Any) -> Any:
    """The Keras 3 ``Functional`` that runs ``model``, or ``None``."""
    try:
        import keras
        from keras.src.models.functional import Functional
    except ImportError:  # pragma: no cover - keras ships with tensorflow
        return None
    if isinstance(model, keras.Sequential):
        return getattr(model, "_functional", None)
    return model if isinstance(model, Functional) else None


def _tf_keras_graph(model: Any) -> Any:
    """The ``tf_keras`` graph network ``model`` runs, or ``None``."""
    tf_keras = compat.tf_keras()
    if tf_keras is None:
        return None
    if isinstance(model, tf_keras.Model) and getattr(model, "_is_graph_network", False):
        return model
    return None


def _nodes(graph: Any) -> list[Any]:
    return [
        node
        for depth in sorted(graph._nodes_by_depth, reverse=True)
        for node in graph._nodes_by_depth[depth]
        if not node.is_input
    ]


def _operation(node: Any) -> Any:
    return getattr(node, "operation", None) or getattr(node, "layer", None)


def _path(
    model: Any, layer: Any, node: Any = None
) -> list[tuple[Any, Any, bool]] | None:
    """``[(graph, op, is_keras3), ...]`` from ``model`` down to the graph that
    calls ``layer`` (that holds ``node``, one of its calls, where given);
    ``op`` is what to intercept at that level (a nested model on the way, then
    the layer). ``None`` when ``layer`` is not in a graph."""
    graph = _keras3_graph(model)
    keras3 = graph is not None
    if graph is None:
        graph = _tf_keras_graph(model)
    if graph is None:
        return None
    nodes = _nodes(graph)
    operations = [_operation(n) for n in nodes]
    count = sum(op is layer for op in operations)
    here = count if node is None else any(n is node for n in nodes)
    if here:
        if count > 1:
            raise TapError(
                f"layer {layer.name!r} runs {count} times per forward pass (a "
                "shared layer)"
            )
        return [(graph, layer, keras3)]
    seen: list[Any] = []
    for op in operations:
        if any(op is s for s in seen) or op is model:
            continue
        seen.append(op)
        inner = _path(op, layer, node)
        if inner is not None:
            if sum(o is op for o in operations) > 1:
                raise TapError(
                    f"layer {layer.name!r} is inside {op.name!r}, which runs "
                    f"{sum(o is op for o in operations)} times per forward pass"
                )
            return [(graph, op, keras3), *inner]
    return None


class LayerTap:
    """Runs ``model`` with ``layer``'s node handed to a hook.

    Args:
        model: a functional or Sequential Keras 3 / ``tf_keras`` model; the
            layer may sit in a functional model nested inside it.
        layer: the layer to tap; it must run once per forward pass.
        lookup: a tied embedding (a layer that runs more than once, exactly
            one of its calls on integer ids) is tapped at that lookup call.
            For its output only: its variables are used by every call.

    Raises:
        TapError: ``layer`` runs more than once per forward pass, or ``model``
            (or the model around ``layer``) is subclassed or a plain function.
    """

    def __init__(self, model: Any, layer: Any, *, lookup: bool = False) -> None:
        calls = len(getattr(layer, "_inbound_nodes", ()) or ())
        node = None
        if calls > 1 and lookup:
            node = lookup_node(layer)
        if calls > 1 and node is None:
            # NOTE (why counted over every graph): a tied embedding (keras_hub's
            # CausalLM: the lookup inside the backbone, the logits in the
            # task's own graph) runs once per graph level, and was tapped at
            # the outer call, the logits, alone
            raise TapError(
                f"layer {layer.name!r} runs {calls} times per forward pass (a "
                "shared or tied layer), so its output is not one tensor"
            )
        path = _path(model, layer, node)
        if path is None:
            raise TapError(
                f"layer {layer.name!r} is called from the Python code of a "
                f"subclassed model or a function ({type(model).__name__}), not "
                "from a functional graph, so its input and output cannot be "
                "tapped without changing the layer"
            )
        self.model = model
        self.layer = layer
        self._path = path

    def __call__(self, inputs: Any, training: bool, hook: Hook) -> Any:
        """The model's outputs for ``inputs``, the tapped node computed by
        ``hook(call, args, kwargs)`` (``call`` is the layer as the model
        would call it)."""
        return self._run(0, inputs, training, hook)

    def _run(self, level: int, inputs: Any, training: bool, hook: Hook) -> Any:
        graph, target, keras3 = self._path[level]
        if level + 1 == len(self._path):
            replace = hook
        else:

            def replace(call, args, kwargs):
                return self._run(level + 1, args[0], training, hook)

        run = _run_keras3 if keras3 else _run_tf_keras
        return run(graph, inputs, training, target, replace)


def lookup_node(layer: Any) -> Any:
    """A tied embedding's lookup: the one call of ``layer`` on integer ids,
    or ``None`` (no such call, or several)."""
    found = [
        node
        for node in getattr(layer, "_inbound_nodes", ()) or ()
        if node.input_tensors and tf.as_dtype(node.input_tensors[0].dtype).is_integer
    ]
    return found[0] if len(found) == 1 else None


def _run_keras3(graph, inputs, training, target, replace):
    """Keras 3 ``Functional.call``, with ``target``'s node given to ``replace``."""
    from keras.src.models.functional import operation_fn, unpack_singleton

    flat = graph._standardize_inputs(inputs)

    def operation(op):
        call = operation_fn(op, training=training)
        if op is target:
            return lambda *args, **kwargs: replace(call, args, kwargs)
        return call

    return unpack_singleton(graph._run_through_graph(flat, operation_fn=operation))


def _run_tf_keras(graph, inputs, training, target, replace):
    """``tf_keras`` ``Functional._run_internal_graph``, with ``target``'s node
    given to ``replace`` and ``training`` passed to every layer that takes it."""
    usage = graph._tensor_usage_count
    tensors: dict[str, list[Any]] = {}
    flat = graph._flatten_to_reference_inputs(inputs)
    for reference, value in zip(graph.inputs, flat):
        value = graph._conform_to_reference_input(value, ref_input=reference)
        tensors[str(id(reference))] = [value] * usage[str(id(reference))]
    for node in _nodes(graph):
        if any(i not in tensors for i in node.flat_input_ids):
            continue
        args, kwargs = node.map_arguments(tensors)
        layer = node.layer
        if getattr(layer, "_expects_training_arg", False):
            kwargs = {**kwargs, "training": training}
        if layer is target:
            outputs = replace(layer, args, kwargs)
        else:
            outputs = layer(*args, **kwargs)
        for output_id, value in zip(node.flat_output_ids, tf.nest.flatten(outputs)):
            tensors[output_id] = [value] * usage[output_id]
    results = [tensors[str(id(x))].pop() for x in graph.outputs]
    return tf.nest.pack_sequence_as(graph._nested_outputs, results)


# -- reading a Keras 3 functional graph (the structured shortcuts) --------------
def producer(tensor: Any) -> tuple[Any, Any]:
    """``(layer, node)`` that made a symbolic tensor of the graph."""
    history = getattr(tensor, "_keras_history", None)
    if history is None:
        raise NotCertain("a tensor of the graph has no producing layer")
    layer, node_index, _ = history
    return layer, layer._inbound_nodes[node_index]


def single_input(layer: Any, node: Any) -> Any:
    """The one symbolic input of a plain ``layer(x)`` call."""
    inputs = node.input_tensors
    # Keras records training=/mask= keywords of symbolic calls; the model
    # sets those itself when it runs.
    extra = set(node.arguments.kwargs) - {"training", "mask"}
    if len(inputs) != 1 or extra or len(node.arguments.args) != 1:
        raise NotCertain(f"layer {layer.name!r} is not called as layer(x)")
    return inputs[0]


def used_once(layer: Any) -> None:
    if len(layer._inbound_nodes) != 1:
        raise NotCertain(
            f"layer {layer.name!r} is called {len(layer._inbound_nodes)} times"
        )


def input_model(keras: Any, model: Any, tensor: Any) -> Callable[[Any], tf.Tensor]:
    """``inputs -> tensor`` as a sub-model of ``model``'s functional graph
    (nothing of ``model`` or its layers changes)."""
    try:
        inputs = model.input
    except AttributeError:  # a Sequential model never called: one input
        inputs = model.inputs[0] if len(model.inputs) == 1 else model.inputs
    try:
        sub = keras.Model(inputs, tensor)
    except (ValueError, TypeError, KeyError) as err:
        raise NotCertain(f"no sub-model up to {tensor.name}: {err}") from err
    return sub


def takes_training(layer: Any) -> bool:
    return bool(getattr(layer, "_call_has_training_arg", False))
