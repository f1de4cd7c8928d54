"""A layer's calls in a traced pass, found without touching the layer.

The ``batch`` strategy needs, for each call of the target layer, the tensor
the call took in and the tensor it gave out. In a functional model the
graph's node says (:mod:`jacobkit.keras.graph`); a subclassed model, a
keras_hub block or any Python code calls its layers directly, and nothing
records the call. What does record it is the traced graph itself: inside a
``tf.function``, every op a layer's ``call`` makes is named under the layer's
name scope (Keras 3 and ``tf_keras`` alike open ``tf.name_scope(layer.name)``
around ``call``; a second call of the same layer, or a scope already taken,
gets ``name_1``, ``name_2``), and the layer's weights are read by ops that
take their variables' handles. So a call is found as:

1. the ops that take a target variable's handle (its reads);
2. the name scope of each read, cut at the component that names the layer;
3. the ops under that scope: the call. Its input is what those ops take from
   outside the scope (resources aside), its output what ops outside take from
   it.

Nothing is set on the model, its layers or its variables, so other threads
may run the same model at the same time. Misreading a call (a layer that
reads its weights from another layer's scope, say) cannot pass unseen: the
``batch`` strategy recomputes each found call's output from its input with
the layer's rule and compares before it runs.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import tensorflow as tf

from jacobkit.keras import compat


class NoCall(ValueError):
    """The layer's calls cannot be found in the traced graph; ``str()`` says
    why."""


@dataclass(frozen=True)
class LayerCall:
    """One call of a layer in a traced graph.

    Attributes:
        scope: the call's name scope (``"model/block_1/dense"``).
        inputs: the tensors the call took from outside its scope, resources
            aside, in the order its ops first read them.
        outputs: the tensors it made that ops outside its scope take, in
            the order they were made; where none is taken yet (the pass's
            result), those that nothing takes, less the arguments that
            ``tf.custom_gradient`` passes through (:func:`_passed_through`).
    """

    scope: str
    inputs: tuple[tf.Tensor, ...]
    outputs: tuple[tf.Tensor, ...]


def layer_calls(
    graph: Any, layer: Any, variables: Iterable[Any]
) -> tuple[LayerCall, ...]:
    """Every call of ``layer`` in ``graph`` (a ``FuncGraph`` being traced, the
    layer's forward ops made already), found by the reads of ``variables``
    (the layer's own weights), in the order the calls ran.

    Raises:
        NoCall: ``graph`` is not a traced function's graph, no op reads the
            variables, or a read is not under a scope named after the layer.
    """
    if not hasattr(graph, "captures"):
        raise NoCall("the forward pass is not traced (no function graph)")
    handles = _handles(graph, variables)
    reads = [
        op for op in graph.get_operations() if any(id(t) in handles for t in op.inputs)
    ]
    if not reads:
        raise NoCall(
            f"no op of the traced pass reads the weights of layer {layer.name!r}"
        )
    scopes: list[str] = []
    for op in reads:
        scope = _call_scope(op.name, layer.name)
        if scope is None:
            raise NoCall(
                f"layer {layer.name!r}'s weights are read outside a name scope "
                f"of its own (by op {op.name!r})"
            )
        if scope not in scopes:
            scopes.append(scope)
    operations = graph.get_operations()
    return tuple(_call(scope, operations) for scope in scopes)


def _handles(graph: Any, variables: Iterable[Any]) -> set[int]:
    """``id()`` of the handles through which ``graph`` reads ``variables``
    (the placeholders their eager handles are captured as)."""
    wanted = {id(compat.as_tf_variable(v).handle) for v in variables if v is not None}
    return {id(inside) for outside, inside in graph.captures if id(outside) in wanted}


def _call_scope(op_name: str, layer_name: str) -> str | None:
    """The name scope of the layer's call around the op ``op_name``: the
    path up to its last component that is ``layer_name`` or
    ``layer_name_<n>``, or the first of a run of such components: an op may
    open a scope of the layer's name inside the layer's own (Keras's default
    name ``separable_conv2d`` is also ``tf.nn.separable_conv2d``'s scope, as
    in ``model/separable_conv2d_1/separable_conv2d/depthwise``)."""
    parts = op_name.split("/")[:-1]
    named = re.compile(rf"{re.escape(layer_name)}(_\d+)?")
    for i in range(len(parts) - 1, -1, -1):
        if named.fullmatch(parts[i]):
            while i > 0 and named.fullmatch(parts[i - 1]):
                i -= 1
            return "/".join(parts[: i + 1])
    return None


def _call(scope: str, operations: Sequence[Any]) -> LayerCall:
    """The call whose ops are under ``scope``."""
    prefix = scope + "/"
    inside = [op for op in operations if op.name.startswith(prefix)]
    members = {id(op) for op in inside}
    inputs: list[tf.Tensor] = []
    taken: list[tf.Tensor] = []
    unused: list[tf.Tensor] = []
    for op in inside:
        for tensor in op.inputs:
            if (
                id(tensor.op) not in members
                and tensor.dtype != tf.resource
                and not any(tensor is t for t in inputs)
            ):
                inputs.append(tensor)
        for index, tensor in enumerate(op.outputs):
            consumers = tensor.consumers()
            if any(id(c) not in members for c in consumers):
                taken.append(tensor)
            elif not consumers and not _passed_through(op, index):
                unused.append(tensor)  # the traced pass's own result, or waste
    return LayerCall(scope, tuple(inputs), tuple(taken or unused))


def _passed_through(op: Any, index: int) -> bool:
    """Whether output ``index`` of ``op`` is an argument that
    ``tf.custom_gradient`` passes through its ``IdentityN`` (results first,
    then the arguments and variables, which nothing takes). Keras's ``silu``
    (``activation="swish"``) is one: its ``IdentityN:1`` is the layer's
    pre-activation, and was taken for the layer's output, as the last tensor
    of its shape that nothing took."""
    return bool(op.type == "IdentityN" and index > 0)


def pre_activation(layer: Any, output: tf.Tensor, one_op: dict[str, str]) -> Any:
    """The pre-activation ``z`` that a call's ``output = activation(z)`` was
    computed from in the traced pass, where the layer's activation is a stock
    one made of one op (``one_op``: its name -> the op's type) and that op
    made ``output`` (through identities); else ``None``.

    NOTE (why). The ``batch`` strategy needs each call's cotangent at ``z``.
    Without the model's own ``z``, it computes the layer again beside the
    model from the call's input and carries the cotangent at the output back
    through that copy: a second forward pass of every tapped layer (on a
    small conv net, 2.5 of a clipped sum's 11 ms). The first call's checks
    compare this ``z`` with the rule's."""
    name = None
    for keras in compat.keras_modules():
        name = name or compat.stock_activation(keras, compat.activation(layer))
    wanted = one_op.get(name or "")
    op = output.op
    while op.type == "Identity" and op.inputs:
        op = op.inputs[0].op
    if wanted is None or op.type != wanted or len(op.inputs) != 1:
        return None
    z = op.inputs[0]
    if z.dtype != output.dtype or z.shape != output.shape:
        return None
    return z
