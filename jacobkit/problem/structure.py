"""Exact shortcuts that a model's structure allows, found from its functional graph.

Two structures are recognised, each only where it is certain (a Keras 3
functional or ``Sequential`` model with one output, every layer on the path
a stock Keras class used once); anywhere else :func:`find` says why not.

NOTE (why each shortcut is exact).

*A linear head.* The model ends in ``Y = h @ W + c``: a stock ``Dense(F)``
with linear activation on ``h`` of shape ``(B, ..., D)``, and the targets sit
before it. Every row of ``Y`` (``"features"``: ``sum_{b,...} Y[..., f]``;
``"per_example"``: ``sum_{...} Y[b, ..., f]``; ``"full"``: ``Y[b, ..., f]``)
is then ``sum_c W[c, f] * s_c + const``, where ``s_c`` is the same kind of
row of ``h``. ``W`` and ``c`` are not targets, so by linearity
``J(row_f) = sum_c W[c, f] * J(s_c)``: the Jacobians of the D rows of ``h``
combined with the head's kernel (``features=`` picks columns of ``W``). D
rows are computed instead of F.

*Separable channels (row colouring).* The target is a stock ``Dense`` or
channels-last ``Conv`` layer ``L`` whose output ``a = act(x @ K + b)`` reaches
``Y`` only through elementwise layers (``Y[..., f] = phi(a[..., f])``).
Output feature ``f`` then depends on ``K`` and ``b`` only through channel
``f``: ``dY[..., f] / dK[..., g] = 0`` for ``g != f``. The rows' Jacobians
have disjoint support (column ``f`` of the last axis), so the gradient of the
*sum* of all rows, one backward pass, holds every row's Jacobian in its own
column; row ``f``'s Jacobian is that column, zeros elsewhere. For
``"per_example"`` rows the sum is taken per example: the gradient of
``sum Y[b]`` with respect to the target, which only needs ``L``'s input
``x[b]`` (``x`` does not depend on ``K`` or ``b``: ``L`` runs once), one
vectorized pass over examples through ``L`` and the elementwise layers only.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import tensorflow as tf

from jacobkit.keras import compat
from jacobkit.keras import graph as keras_graph
from jacobkit.keras.compat import as_tf_variable
from jacobkit.problem.cache import per_model
from jacobkit.problem.problem import Problem

#: Keras activations that act on each element alone (``softmax``, ``glu`` and
#: friends mix the last axis and are not here).
_ELEMENTWISE_ACTIVATIONS = frozenset(
    {
        "linear",
        "relu",
        "relu6",
        "elu",
        "selu",
        "celu",
        "gelu",
        "sigmoid",
        "hard_sigmoid",
        "log_sigmoid",
        "tanh",
        "hard_tanh",
        "softplus",
        "softsign",
        "swish",
        "silu",
        "hard_silu",
        "hard_swish",
        "mish",
        "exponential",
        "leaky_relu",
    }
)
#: layers that act on each element alone (given their activation, if any)
_ELEMENTWISE_LAYERS = frozenset({"Activation", "ReLU", "LeakyReLU", "ELU", "Identity"})
#: layers that are the identity at inference (random, elementwise, in training)
_INFERENCE_IDENTITY = frozenset(
    {"Dropout", "GaussianNoise", "GaussianDropout", "AlphaDropout"}
)
_LINEAR = frozenset({"Dense", "Conv1D", "Conv2D", "Conv3D"})


#: the structure is absent, or not certain; ``str()`` says why (the graph
#: walk's own refusal: :class:`jacobkit.keras.graph.NotCertain`)
NotApplicable = keras_graph.NotCertain


@dataclass(frozen=True)
class LinearHead:
    """The model ends in a linear ``Dense`` head on ``D`` channels.

    Attributes:
        head: the ``Dense`` layer.
        width: ``D``, the size of the head's input's last axis.
        sub_problem: the same rows of the head's input ``h`` (a sub-model
            built from the functional graph), same targets; its Jacobians
            have shape ``rows_shape[:-1] + (D,) + v.shape``. It takes the
            model's inputs and holds none (:meth:`Problem.detached`): run it
            on ``sub_problem.with_inputs(problem.inputs)``.
        columns: the columns of the head's kernel the rows select (the
            ``features=`` indices, made non-negative), or ``None`` for all.
    """

    head: Any
    width: int
    sub_problem: Problem
    columns: tuple[int, ...] | None

    def kernel(self) -> tf.Tensor:
        """The head's kernel restricted to the rows' columns: ``(D, K)``."""
        kernel = tf.convert_to_tensor(self.head.kernel)
        if self.columns is None:
            return kernel
        return tf.gather(kernel, list(self.columns), axis=1)

    def describe(self) -> str:
        return (
            f"linear head {self.head.name!r}: {self.width} rows of its input "
            "combined with its kernel"
        )


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


Structure = LinearHead | SeparableChannels

#: model -> {problem key: Structure, or the reason none applies}
_FOUND: weakref.WeakKeyDictionary[Any, dict[Any, Any]] = weakref.WeakKeyDictionary()


def find(problem: Problem) -> Structure:
    """The exact shortcut ``problem`` allows (cached per model and problem).

    Separable channels are tried first (the target is then the last layer
    with variables, so no linear head lies after it), then a linear head.

    Raises:
        NotApplicable: neither applies, or it is not certain; the message
            gives each reason.
    """
    return _cached(_FOUND, problem, _find)


def _cached(
    store: weakref.WeakKeyDictionary[Any, dict[Any, Any]],
    problem: Problem,
    finder: Callable[[Problem], Structure],
) -> Structure:
    """``finder(problem)`` cached in ``store`` per model and problem, or the
    reason it raised :class:`NotApplicable` (raised again)."""
    cache = per_model(store, problem.model)
    key = problem.key
    if key not in cache:
        try:
            found = finder(problem)
            if isinstance(found, LinearHead):
                # the cache outlives the call: no input values in it (use
                # ``found.sub_problem.with_inputs(problem.inputs)``)
                found = replace(found, sub_problem=found.sub_problem.detached())
            cache[key] = found
        except NotApplicable as err:
            # the reason only: a kept exception keeps its traceback, whose
            # frames keep their callers' locals (auto's whole first result)
            cache[key] = _Reason(str(err))
    found = cache[key]
    if isinstance(found, _Reason):
        raise NotApplicable(found.text)
    structure: Structure = found
    return structure


@dataclass(frozen=True)
class _Reason:
    """Why no shortcut applies to a problem (cached)."""

    text: str


def find_separable(problem: Problem) -> SeparableChannels:
    """Only the separable-channels structure (for a linear head's sub-problem)."""
    graph = _graph(problem)
    return _separable(problem, graph)


def _find(problem: Problem) -> Structure:
    graph = _graph(problem)
    reasons = []
    for finder in (_separable, _linear_head):
        try:
            return finder(problem, graph)
        except NotApplicable as err:
            reasons.append(str(err))
    raise NotApplicable("; ".join(reasons))


@dataclass(frozen=True)
class _Graph:
    """The model's one output tensor and the Keras module it comes from."""

    keras: Any
    output: Any


def _graph(problem: Problem) -> _Graph:
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
    return _Graph(keras, outputs[0])


def _elementwise_activation(keras: Any, activation: Any) -> bool:
    return compat.stock_activation(keras, activation) in _ELEMENTWISE_ACTIVATIONS


def _lora_or_quantized(layer: Any) -> bool:
    return compat.lora_enabled(layer) or bool(compat.quantization_mode(layer))


def _separable(problem: Problem, graph: _Graph) -> SeparableChannels:
    keras = graph.keras
    layer = problem.layer
    if problem.rows_spec.mode not in ("features", "per_example"):
        raise NotApplicable(
            f"separable channels: outputs={problem.rows_spec.mode!r} rows are "
            "not colourable by output channel"
        )
    if layer is None:
        raise NotApplicable("separable channels: the targets are not a layer")
    kind = keras_graph.stock(keras, layer, _LINEAR)
    if kind is None:
        raise NotApplicable(
            f"separable channels: target {layer.name!r} is not a stock Dense "
            "or Conv layer"
        )
    if kind != "Dense" and compat.data_format(layer) != "channels_last":
        raise NotApplicable(f"separable channels: {layer.name!r} is channels_first")
    if _lora_or_quantized(layer):
        raise NotApplicable(f"separable channels: {layer.name!r} is LoRA/quantized")
    if not _elementwise_activation(keras, layer.activation):
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
    chain, path = [], []
    tensor = graph.output
    current, node = keras_graph.producer(tensor)
    training = problem.training
    passing = _ELEMENTWISE_LAYERS | _INFERENCE_IDENTITY
    while current is not layer:
        name = keras_graph.stock(keras, current, passing)
        if name is None or (name in _INFERENCE_IDENTITY and training):
            raise NotApplicable(
                f"separable channels: layer {current.name!r} "
                f"({type(current).__name__}) between {layer.name!r} and the "
                "output is not elementwise"
            )
        if name == "Activation" and not _elementwise_activation(
            keras, current.activation
        ):
            raise NotApplicable(
                f"separable channels: activation layer {current.name!r} is not "
                "elementwise"
            )
        keras_graph.used_once(current)
        chain.append(current)
        path.append(current.name)
        current, node = keras_graph.producer(keras_graph.single_input(current, node))
    keras_graph.used_once(layer)
    layer_input = keras_graph.single_input(layer, node)
    prefix: Any = keras_graph.input_model(keras, problem.model, layer_input)
    # The layer's input must not read the targets (weights shared with a
    # layer before it would make the contraction wrong).
    before = {id(as_tf_variable(v)) for v in prefix.weights}
    if any(id(t) in before for t in problem.targets):
        raise NotApplicable(
            f"separable channels: {layer.name!r}'s variables are also read before it"
        )
    layers = [layer, *reversed(chain)]

    def tail(x: tf.Tensor) -> tf.Tensor:
        for each in layers:
            x = each(x, training=False) if keras_graph.takes_training(each) else each(x)
        return x

    channels = _channels(problem)
    description = " -> ".join([layer.name, *reversed(path), "output"])
    return SeparableChannels(layer, channels, prefix, tail, description)


def _channels(problem: Problem) -> tuple[int, ...]:
    width = int(problem.output_width or 0)
    chosen = problem.rows_spec.features
    if chosen is None:
        return tuple(range(width))
    return tuple(f % width for f in chosen)


#: model -> {problem key: LinearHead of any width, or the reason none applies}
_HEADS: weakref.WeakKeyDictionary[Any, dict[Any, Any]] = weakref.WeakKeyDictionary()


def find_head(problem: Problem) -> LinearHead:
    """The model's linear head whatever its width (cached per model and
    problem): ``batch`` seeds its backward pass at the head's input with the
    head's kernel columns, which skips the head's own backward from one-hot
    rows, also where the head is wider than the rows (where :func:`find`
    refuses it: combining ``D > F`` rows would cost more, not less).

    Raises:
        NotApplicable: the model does not end in a linear head, or not
            certainly.
    """
    found = _cached(_HEADS, problem, _any_head)
    assert isinstance(found, LinearHead)
    return found


def _any_head(problem: Problem) -> LinearHead:
    """The linear head of any width (:func:`find_head`). A detached problem
    (a strategy's build) holds specs: zeros of their shapes serve (the
    head's sub-problem keeps no values)."""
    problem = problem.with_inputs(
        tf.nest.map_structure(
            lambda t: tf.zeros(t.shape, t.dtype) if isinstance(t, tf.TensorSpec) else t,
            problem.inputs,
        )
    )
    return _linear_head(problem, _graph(problem), narrower=False)


def _known_head(problem: Problem) -> LinearHead | None:
    """The linear head :func:`find` or :func:`find_head` already found for
    ``problem`` (the same head and sub-model, whichever asked first), so
    that its sub-problem, a traced pass of the sub-model, is built once."""
    for store in (_FOUND, _HEADS):
        known = per_model(store, problem.model).get(problem.key)
        if isinstance(known, LinearHead):
            return known
    return None


def _linear_head(
    problem: Problem, graph: _Graph, *, narrower: bool = True
) -> LinearHead:
    keras = graph.keras
    head, node = keras_graph.producer(graph.output)
    if keras_graph.stock(keras, head, frozenset({"Dense"})) is None:
        raise NotApplicable(
            f"linear head: the output layer {head.name!r} "
            f"({type(head).__name__}) is not a stock Dense layer"
        )
    if compat.stock_activation(keras, head.activation) != "linear":
        raise NotApplicable(
            f"linear head: {head.name!r} has activation "
            f"{compat.activation_name(head.activation) or head.activation!r}, "
            "not linear"
        )
    if _lora_or_quantized(head):
        raise NotApplicable(f"linear head: {head.name!r} is LoRA/quantized")
    keras_graph.used_once(head)
    head_vars = {id(as_tf_variable(v)) for v in head.weights}
    if any(id(t) in head_vars for t in problem.targets):
        raise NotApplicable(
            f"linear head: the targets include {head.name!r}'s own variables"
        )
    h = keras_graph.single_input(head, node)
    width = int(head.kernel.shape[0])
    rows_width = len(_channels(problem))
    if narrower and width >= rows_width:
        raise NotApplicable(
            f"linear head: {head.name!r} has {width} inputs for {rows_width} "
            "features, no fewer"
        )
    known = _known_head(problem)
    if known is not None:
        return known
    sub_model = keras_graph.input_model(keras, problem.model, h)
    sub_problem = Problem(
        sub_model,
        problem.inputs,
        problem.layer if problem.layer is not None else list(problem.targets),
        outputs=problem.rows_spec.mode,
        training=problem.training,
        unconnected="zero",
    )
    columns = None if problem.rows_spec.features is None else _channels(problem)
    return LinearHead(head, width, sub_problem, columns)
