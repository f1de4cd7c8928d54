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
    handles = variable_handles(graph, variables)
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


def variable_handles(graph: Any, variables: Iterable[Any]) -> set[int]:
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


class Unavailable(ValueError):
    """An eager pass's record cannot say for sure which ops are a layer's
    calls (``str()`` says why): the traced pass finds them instead."""


@dataclass(frozen=True)
class EagerOp:
    """One op run eagerly: its type, the Keras 3 name scopes open around it
    (each layer call opens its own, ``caller`` the layer), and the tensors it
    took and made."""

    type: str
    scopes: tuple[Any, ...]
    inputs: tuple[Any, ...]
    outputs: tuple[Any, ...]
    #: TensorFlow's flat sequence of its attributes' names and values
    attrs: tuple[Any, ...] = ()


def _keras_scopes() -> Any:
    """Keras 3's stack of open name scopes in this thread (``None``: no Keras
    3)."""
    try:
        from keras.src.backend.common import global_state
    except ImportError:  # pragma: no cover - Keras 3 is a dependency
        return None
    return global_state.get_global_attribute("name_scope_stack")


#: op types that run a traced function eagerly, its ops unseen
_FUNCTION_CALLS = frozenset({"PartitionedCall", "StatefulPartitionedCall"})


class Record:
    """The ops run eagerly in this thread while it is open, each with the
    Keras name scopes open around it (a TensorFlow op callback: thread-local,
    set on nothing of the model's).

    NOTE (why). Where a layer is called from Python, its calls are found in a
    traced pass by their name scopes and their reads of the layer's weights
    (see the module docstring). Eagerly, each call of a Keras 3 layer opens a
    name scope object of its own whose ``caller`` is the layer: recorded with
    each op, it tells the layer's calls apart exactly (back-to-back calls
    too) without tracing the pass (BERT tiny's checks before a first
    reduction traced ~1,400 graph ops)."""

    def __init__(self) -> None:
        self.ops: list[EagerOp] = []
        self.graphs = 0

    def _seen(
        self,
        op_type: Any,
        inputs: Any,
        attrs: Any,
        outputs: Any,
        op_name: Any = None,
        graph: Any = None,
    ) -> None:
        kind = op_type.decode() if isinstance(op_type, bytes) else str(op_type)
        if graph is not None or kind in _FUNCTION_CALLS:
            self.graphs += 1  # ops inside a function are not seen one by one
            return
        stack = _keras_scopes()
        self.ops.append(
            EagerOp(
                kind,
                tuple(stack or ()),
                tuple(inputs),
                tuple(outputs),
                tuple(attrs or ()),
            )
        )

    def head(self, count: int) -> Record:
        """A record of this one's first ``count`` ops (closed: nothing is
        added to it)."""
        found = Record()
        found.ops = self.ops[:count]
        found.graphs = self.graphs
        return found

    def maker(self, tensor: Any) -> tuple[str, tuple[Any, ...]]:
        """The type and inputs of the recorded op that made ``tensor``
        (``("", ())``: none did)."""
        for op in reversed(self.ops):
            if any(t is tensor for t in op.outputs):
                return op.type, op.inputs
        return "", ()

    def __enter__(self) -> Record:
        from tensorflow.python.framework import op_callbacks

        op_callbacks.add_op_callback(self._seen)
        return self

    def __exit__(self, *exc: Any) -> None:
        from tensorflow.python.framework import op_callbacks

        op_callbacks.remove_op_callback(self._seen)


def eager_layer_calls(
    record: Record, layer: Any, variables: Iterable[Any], sources: Iterable[Any]
) -> tuple[LayerCall, ...]:
    """Every call of ``layer`` in an eager pass's ``record``, as
    :func:`layer_calls` finds them in a traced one: the ops under the name
    scope that a call of ``layer`` opened, for each call in which one of
    ``variables`` is read. ``sources``: the pass's inputs (tensors no op
    made; other such tensors are constants).

    Raises:
        Unavailable: the record cannot tell the calls for sure (part of the
            pass ran as a graph, whose ops are not recorded; no weight read,
            or a read outside a Keras 3 call of the layer; a call reads a
            floating tensor no recorded op made, which may be its own
            constant or an input): the traced pass says.
    """
    ops = record.ops
    if record.graphs:
        raise Unavailable("part of the pass ran as a graph")
    handles = {id(compat.as_tf_variable(v).handle) for v in variables if v is not None}
    made = {id(t) for op in ops for t in op.outputs}
    made |= {id(t) for t in tf.nest.flatten(sources)}
    entries: list[Any] = []
    for op in ops:
        if not any(id(t) in handles for t in op.inputs):
            continue
        mine = [e for e in op.scopes if getattr(e, "caller", None) is layer]
        if not mine:
            raise Unavailable(f"a read of layer {layer.name!r}'s weights outside it")
        if not any(mine[-1] is e for e in entries):
            entries.append(mine[-1])
    if not entries:
        raise Unavailable(f"no op of the eager pass reads layer {layer.name!r}")
    found = []
    for entry in entries:
        members = [i for i, op in enumerate(ops) if any(entry is e for e in op.scopes)]
        found.append(_eager_call(layer.name, ops, members, made))
    return tuple(found)


def _eager_call(
    name: str, ops: Sequence[EagerOp], members: list[int], made: set[int]
) -> LayerCall:
    """The call made of ``ops`` at ``members`` (as :func:`_call`)."""
    inside = [ops[i] for i in members]
    chosen = set(members)
    outside = [op for i, op in enumerate(ops) if i not in chosen]
    produced = {id(t) for op in inside for t in op.outputs}
    taken_outside = {id(t) for op in outside for t in op.inputs}
    used = {id(t) for op in inside for t in op.inputs}
    inputs: list[Any] = []
    taken: list[Any] = []
    unused: list[Any] = []
    for op in inside:
        for tensor in op.inputs:
            if (
                id(tensor) in produced
                or tensor.dtype == tf.resource
                or any(tensor is t for t in inputs)
            ):
                continue
            if id(tensor) in made:
                inputs.append(tensor)
            elif tensor.dtype.is_floating and tensor.shape.rank:
                # no op made it: a constant of the call's, or a tensor from
                # outside the pass; the traced pass tells them apart
                raise Unavailable(f"a call of layer {name!r} reads a tensor no op made")
    for op in inside:
        for index, tensor in enumerate(op.outputs):
            if id(tensor) in taken_outside:
                taken.append(tensor)
            elif id(tensor) not in used and not (op.type == "IdentityN" and index > 0):
                unused.append(tensor)
    return LayerCall(f"{name} (eager)", tuple(inputs), tuple(taken or unused))
