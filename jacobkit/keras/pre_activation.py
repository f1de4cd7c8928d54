"""A call's own pre-activation ``z`` in a pass (traced, or an eager pass's
:class:`~jacobkit.keras.calls.Record`), read from the ops that made its
output: the ``batch`` strategy takes each call's cotangent at ``z`` there,
through the model's own backward pass, instead of computing the layer again
beside the model."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import tensorflow as tf

from jacobkit.keras import calls, compat
from jacobkit.keras.calls import Record


def pre_activation(
    layer: Any,
    output: tf.Tensor,
    one_op: dict[str, str],
    record: Record | None = None,
) -> Any:
    """The pre-activation ``z`` that a call's ``output = activation(z)`` was
    computed from in the traced pass: where the layer's activation is a stock
    one made of one op (``one_op``: its name -> the op's type), that op's
    input if it made ``output`` (through identities); for any other
    activation, the tensor its ops all start from
    (:func:`_activation_input`); else ``None``.

    NOTE (why). The ``batch`` strategy needs each call's cotangent at ``z``.
    Without the model's own ``z``, it computes the layer again beside the
    model from the call's input and carries the cotangent at the output back
    through that copy: a second forward pass of every tapped layer (on a
    small conv net, 2.5 of a clipped sum's 11 ms). The first call's checks
    compare this ``z`` with the rule's. ``record``: the eager pass's
    :class:`Record` (``None``: a traced pass)."""
    name = None
    for keras in compat.keras_modules():
        name = name or compat.stock_activation(keras, compat.activation(layer))
    wanted = one_op.get(name or "")
    made_by = _graph_maker if record is None else record.maker
    op_type, op_inputs = made_by(output)
    while op_type == "Identity" and op_inputs:
        op_type, op_inputs = made_by(op_inputs[0])
    if wanted is None:
        variables = getattr(layer, "weights", ())
        handles = (
            calls.variable_handles(output.graph, variables)
            if record is None
            else {id(compat.as_tf_variable(v).handle) for v in variables}
        )
        return _activation_input(output, made_by, handles)
    if op_type != wanted or len(op_inputs) != 1:
        return None
    z = op_inputs[0]
    if z.dtype != output.dtype or z.shape != output.shape:
        return None
    return z


#: the most ops :func:`_activation_input` walks back through (tanh-approximate
#: GELU is 8)
ACTIVATION_OPS = 32


def _activation_input(
    output: tf.Tensor, made_by: Any, handles: set[int]
) -> tf.Tensor | None:
    """The pre-activation ``z`` of an activation made of several ops (GELU,
    a keras_hub ``gelu_approximate``, any function of ``z`` alone): walking
    back from ``output`` through ops whose tensors all have its shape and
    dtype (constants aside), every path ends at one tensor made by an op
    that reads one of the layer's weights (``handles``: their handles'
    ``id()``; the bias's add); ``None`` where a
    path ends anywhere else (a tensor of another shape, an input, a second
    such tensor) or the walk is longer than :data:`ACTIVATION_OPS` ops.

    NOTE (measured, the reductions benchmark's ``bert_small``, one core,
    oneDNN on, loaded). Without it each GELU call was computed again beside
    the model (its matmul, its GELU and the GELU's backward): 16 ms of the
    Gram call's 184 ms of ops (the plain step's: 126); paired in one
    process, the Gram's CPU time over the plain step's went from 1.33-1.40
    to 1.23-1.27 (``benchmarks/results/cpu/bert_small_gram_profile.md``).
    The first call's checks compare this ``z`` with the rule's, call by
    call."""
    shape, dtype = output.shape, output.dtype
    found: tf.Tensor | None = None
    pending, seen, walked = [output], {id(output)}, 0
    while pending:
        tensor = pending.pop()
        op_type, op_inputs = made_by(tensor)
        if tensor is not output and _reads(op_inputs, made_by, handles):
            if found is not None and found is not tensor:
                return None
            found = tensor
            continue
        walked += 1
        if walked > ACTIVATION_OPS or not op_inputs:
            return None  # too long, or an input of the pass (no op made it)
        for source in op_inputs:
            kind = made_by(source)[0]
            if kind == "Const" or (kind == "" and source.shape.num_elements() == 1):
                continue  # a constant (eagerly: a scalar no op made)
            if source.dtype != dtype or source.shape != shape:
                return None
            if id(source) not in seen:
                seen.add(id(source))
                pending.append(source)
    return found


def _reads(op_inputs: Sequence[Any], made_by: Any, handles: set[int]) -> bool:
    """Whether an op takes the value of a variable whose handle's ``id()`` is
    in ``handles`` (through casts and identities)."""
    for source in op_inputs:
        kind, inner = made_by(source)
        while kind in ("Identity", "Cast") and inner:
            kind, inner = made_by(inner[0])
        if kind == "ReadVariableOp" and inner and id(inner[0]) in handles:
            return True
    return False


def _graph_maker(tensor: tf.Tensor) -> tuple[str, tuple[Any, ...]]:
    """The type and inputs of the op that made ``tensor`` in a graph."""
    return tensor.op.type, tuple(tensor.op.inputs)
