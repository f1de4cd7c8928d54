"""What a Keras model's structure says, for sure, without running it: whether
every operation of its functional graph computes each example from that
example alone in inference mode (:func:`per_example_graph`), the layers
upstream of its output (:func:`upstream_layers`) and a bound on the bytes
of its layers' outputs for a batch (:func:`layer_output_bound`).

NOTE (why an allowlist). Examples mix where an operation reduces, sorts or
attends over the batch axis: ``BatchNormalization`` with ``training=True``,
a ``Softmax(axis=0)``, a ``keras.ops.mean(x, axis=0)`` node, a user's
function in ``Activation`` or ``Lambda``. None of that shows in the
layers' types alone, so only exact classes listed here count (a subclass
may change ``call``), with their axes read where they have one, their
activations Keras's own, and no node whose call fixes ``training=True``.
Anything else: ``False``, and the numeric check runs as before.

Nothing here calls a model or changes a layer.
"""

from __future__ import annotations

import math
from typing import Any

from jacobkit.keras import compat, nodes

#: Keras layers that compute each example alone in inference mode, whatever
#: their configuration (their axes are checked apart: :data:`_AXES`)
_KERAS = frozenset(
    {
        "InputLayer",
        "Dense",
        "EinsumDense",
        "Conv1D",
        "Conv2D",
        "Conv3D",
        "DepthwiseConv1D",
        "DepthwiseConv2D",
        "SeparableConv1D",
        "SeparableConv2D",
        "Conv1DTranspose",
        "Conv2DTranspose",
        "Conv3DTranspose",
        "Embedding",
        "ReversibleEmbedding",
        "Activation",
        "ReLU",
        "LeakyReLU",
        "ELU",
        "PReLU",
        "Softmax",
        "Identity",
        "Dropout",
        "SpatialDropout1D",
        "SpatialDropout2D",
        "SpatialDropout3D",
        "GaussianNoise",
        "GaussianDropout",
        "AlphaDropout",
        "Flatten",
        "Reshape",
        "Permute",
        "ZeroPadding1D",
        "ZeroPadding2D",
        "ZeroPadding3D",
        "Cropping1D",
        "Cropping2D",
        "Cropping3D",
        "UpSampling1D",
        "UpSampling2D",
        "UpSampling3D",
        "MaxPooling1D",
        "MaxPooling2D",
        "MaxPooling3D",
        "AveragePooling1D",
        "AveragePooling2D",
        "AveragePooling3D",
        "GlobalAveragePooling1D",
        "GlobalAveragePooling2D",
        "GlobalAveragePooling3D",
        "GlobalMaxPooling1D",
        "GlobalMaxPooling2D",
        "GlobalMaxPooling3D",
        "Add",
        "Subtract",
        "Multiply",
        "Average",
        "Maximum",
        "Minimum",
        "Concatenate",
        "LayerNormalization",
        "BatchNormalization",
        "MultiHeadAttention",
    }
)
#: keras_hub's modelling layers that compute each example alone (read:
#: their ``call`` adds, normalizes and attends within an example, and calls
#: each of their layers once)
_HUB = frozenset(
    {"TransformerEncoder", "PositionEmbedding", "TokenAndPositionEmbedding"}
)
#: the modules of the classes above
_KERAS_MODULE = "keras.src.layers."
_HUB_MODULE = "keras_hub.src.layers.modeling."
#: keras_hub's own elementwise activations (``gelu_approximate``: Keras's
#: ``gelu(x, approximate=True)``), by module and name
_HUB_ACTIVATIONS = frozenset({("keras_hub.src.utils.keras_utils", "gelu_approximate")})
#: the attributes holding the axes a layer reduces or joins over
_AXES = {
    "Softmax": "axis",
    "LayerNormalization": "axis",
    "Concatenate": "axis",
}
#: layers whose output's sizes beyond the batch are their input's, or come
#: from their configuration: an unknown size there is the inputs' sequence
#: length (:func:`layer_output_bound`)
_SAME_LENGTH = frozenset(
    {
        "InputLayer",
        "Dense",
        "EinsumDense",
        "Embedding",
        "ReversibleEmbedding",
        "Activation",
        "ReLU",
        "Softmax",
        "Dropout",
        "Add",
        "Multiply",
        "LayerNormalization",
        "MultiHeadAttention",
        "TransformerEncoder",
        "PositionEmbedding",
        "TokenAndPositionEmbedding",
        "GetItem",
    }
)


def per_example_graph(model: Any) -> bool:
    """Whether every operation of ``model`` (a functional or sequential
    Keras model, nested ones walked) computes each example from that
    example alone in inference mode (the module's NOTE), and no node of
    its graphs fixes ``training=True``."""
    if not compat.is_model(model):
        return False
    found = list(nodes.operations(model))
    if not found:
        return False  # no graph to read (a subclassed model)
    for op in found:
        if compat.is_model(op):
            continue
        if not _per_example(op):
            return False
        inner = compat.flatten_layers(op) if compat.is_layer(op) else []
        if not all(_per_example(layer) for layer in inner):
            return False
    return True


def _per_example(op: Any) -> bool:
    """Whether ``op`` (a layer or a graph's operation) is of a listed class
    (exactly), with its axes away from the batch axis and Keras's own
    activations."""
    if op is None:
        return False
    cls = type(op)
    module = cls.__module__ or ""
    name = cls.__name__
    if name == "GetItem" and module == "keras.src.ops.numpy":
        return _keeps_batch(op)
    if module.startswith(_KERAS_MODULE):
        listed = name in _KERAS
    elif module.startswith(_HUB_MODULE):
        listed = name in _HUB
    else:
        listed = False
    if not listed or compat.is_model(op):
        return False
    if name in _AXES and not _away_from_batch(op, getattr(op, _AXES[name], 0)):
        return False
    if name == "EinsumDense" and not _einsum_per_example(op):
        return False
    if name == "MultiHeadAttention":
        axes = getattr(op, "_attention_axes", None)
        if axes is not None and 0 in tuple(axes):
            return False
    function = getattr(op, "activation", None)
    return function is None or not callable(function) or _own_activation(function)


def _own_activation(function: Any) -> bool:
    """Whether ``function`` is Keras's own activation, or one of keras_hub's
    (:data:`_HUB_ACTIVATIONS`): each acts on each element alone."""
    keras = compat.keras3()
    if keras is not None and compat.stock_activation(keras, function) is not None:
        return True
    where = (getattr(function, "__module__", None), getattr(function, "__name__", None))
    return where in _HUB_ACTIVATIONS


def _away_from_batch(layer: Any, axes: Any) -> bool:
    """Whether ``axes`` (an int or several) never name axis 0 of the
    layer's input (a negative axis read against the rank it was built
    for; unknown rank: only ``-1`` of an input of at least two axes)."""
    found = axes if isinstance(axes, list | tuple) else (axes,)
    shape = compat.built_input_shape(layer)
    for axis in found:
        if not isinstance(axis, int):
            return False
        if axis >= 0:
            if axis == 0:
                return False
            continue
        if shape is None or axis + len(shape) <= 0:
            return False
    return True


def _einsum_per_example(layer: Any) -> bool:
    """Whether an ``EinsumDense``'s equation keeps the input's first axis as
    the output's first and out of the kernel's: ``"abc,cd->abd"``."""
    equation = str(getattr(layer, "equation", ""))
    try:
        operands, output = equation.replace(" ", "").split("->")
        inputs, kernel = operands.split(",")
    except ValueError:
        return False
    return (
        bool(inputs)
        and inputs[0].isalpha()
        and output[:1] == inputs[0]
        and inputs[0] not in kernel
    )


def _keeps_batch(op: Any) -> bool:
    """Whether a ``GetItem`` node (``x[:, 0, :]``) keeps the whole batch axis
    as it is: its key a tuple starting with ``slice(None)``."""
    for node in getattr(op, "_inbound_nodes", None) or ():
        args: Any = getattr(getattr(node, "arguments", None), "args", ())
        if len(args) < 2:
            return False
        key = args[1]
        first = key[0] if isinstance(key, tuple) and key else None
        if not (isinstance(first, slice) and first == slice(None)):
            return False
    return True


def lengths_kept(model: Any) -> bool:
    """Whether every unknown size beyond the batch in ``model``'s graphs is
    the inputs' sequence length: each node with one is of a layer that
    keeps or sets its sizes (:data:`_SAME_LENGTH`), a ``GetItem`` excepted
    (its slice may shorten it)."""
    for op in nodes.operations(model):
        if op is None or compat.is_model(op):
            continue
        for node in getattr(op, "_inbound_nodes", None) or ():
            for out in getattr(node, "output_tensors", None) or ():
                if None not in tuple(out.shape)[1:]:
                    continue
                name = type(op).__name__
                if name not in _SAME_LENGTH or name == "GetItem":
                    return False
    return True


def upstream_layers(model: Any) -> set[int] | None:
    """The ids of the layers whose outputs reach ``model``'s single output
    (a functional model's, nested models walked through the outputs they
    give; a layer's own layers with it), ``None`` where it cannot be read
    (not a graph, several outputs)."""
    outputs = list(getattr(model, "outputs", None) or ())
    if len(outputs) != 1:
        return None
    found: set[int] = set()
    seen: set[int] = set()
    stack = outputs
    while stack:
        tensor = stack.pop()
        if id(tensor) in seen:
            continue
        seen.add(id(tensor))
        history = getattr(tensor, "_keras_history", None)
        if history is None:
            return None
        op, node_index, tensor_index = history
        nodes = getattr(op, "_inbound_nodes", None) or ()
        if node_index >= len(nodes):
            return None
        found.add(id(op))
        if compat.is_model(op):
            inner = list(getattr(op, "outputs", None) or ())
            if tensor_index >= len(inner):
                return None
            stack.append(inner[tensor_index])
        elif compat.is_layer(op):
            found.update(id(layer) for layer in compat.flatten_layers(op))
        stack.extend(_keras_tensors(nodes[node_index]))
    return found


def _keras_tensors(node: Any) -> list[Any]:
    """The symbolic tensors a node reads."""
    tensors = getattr(node, "input_tensors", None)
    if tensors is None:
        return []
    return [t for t in tensors if hasattr(t, "_keras_history")]


def layer_output_bound(model: Any, batch: int, length: int | None) -> int | None:
    """An upper bound's base for the floating tensors of a forward pass of
    ``model`` on ``batch`` examples: the outputs of its graphs' nodes
    (nested models' included, the models not), the inputs every layer
    without a node was built for (those a listed layer calls from its
    Python: a transformer block's feed-forward width), each attention
    layer's scores (``B heads T_q T_k``, three times: scores, softmax,
    dropout). An
    unknown size beyond the batch is ``length`` (the inputs' sequence
    length) where the layer keeps or sets its sizes (:data:`_SAME_LENGTH`);
    ``None`` where that cannot be read."""
    total = 0
    for op in nodes.operations(model):
        if op is None or compat.is_model(op):
            continue
        for node in getattr(op, "_inbound_nodes", None) or ():
            for out in getattr(node, "output_tensors", None) or ():
                found = _bytes(tuple(out.shape), out.dtype, batch, length)
                if (
                    found is None
                    or type(op).__name__ not in _SAME_LENGTH
                    and (None in tuple(out.shape)[1:])
                ):
                    return None
                total += found
        inner = compat.flatten_layers(op) if compat.is_layer(op) else []
        for layer in [op, *inner]:
            if not (getattr(layer, "_inbound_nodes", None) or ()):
                shape = compat.built_input_shape(layer)
                if shape is not None:
                    found = _bytes(shape, "float32", batch, length)
                    if found is None:
                        return None
                    total += found
            if type(layer).__name__ == "MultiHeadAttention":
                scores = _scores(layer, batch, length)
                if scores is None:
                    return None
                total += scores
    return total


def _bytes(
    shape: tuple[Any, ...], dtype: Any, batch: int, length: int | None
) -> int | None:
    """Bytes of a tensor of ``shape`` (its first axis the batch) with
    ``batch`` examples, an unknown size taken as ``length``."""
    size = _dtype_size(dtype)
    dims = nodes.sized(shape, batch, length) if shape else None
    return None if size is None or dims is None else size * math.prod(dims)


def _scores(layer: Any, batch: int, length: int | None) -> int | None:
    """Bytes of an attention layer's scores, softmax and its dropout
    (float32, ``B heads T_q T_k`` each; one attention axis)."""
    shapes = getattr(layer, "_build_shapes_dict", None) or {}
    query, value = shapes.get("query_shape"), shapes.get("value_shape")
    heads = getattr(layer, "_num_heads", None)
    if query is None or value is None or not isinstance(heads, int):
        return None
    sizes: list[int] = []
    for shape in (query, value):
        inner = tuple(shape)[1:-1]
        if len(inner) != 1:
            return None
        size = length if inner[0] is None else int(inner[0])
        if size is None:
            return None
        sizes.append(size)
    return 3 * 4 * batch * heads * sizes[0] * sizes[1]


def _dtype_size(dtype: Any) -> int | None:
    """Bytes of one element of a Keras dtype name."""
    sizes = {"float16": 2, "bfloat16": 2, "float32": 4, "float64": 8}
    sizes.update({"int32": 4, "int64": 8, "bool": 1, "int8": 1, "uint8": 1})
    return sizes.get(str(dtype))
