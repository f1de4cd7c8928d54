"""The matrix products a Keras model's forward pass makes, read from its
layers: for each ``MatMul`` op whose gradient takes an operand transposed,
the product's rows and that operand's bytes, as
:func:`jacobkit.problem.operands.of_eager` records them from an eager pass.

NOTE (what Keras runs, TensorFlow backend, read from its source and checked
against the eager passes in ``tests/test_structural_inspect.py``).
``Dense`` computes ``ops.matmul(x, kernel)``: a 2-D input is one ``MatMul``
of ``B`` rows; a deeper one goes through ``tf.tensordot``, which reshapes it
to ``(B * T..., in)`` for one ``MatMul`` (no transposes either way).
``EinsumDense`` with an input of three axes or more computes ``Einsum`` or
``BatchMatMul`` ops (Keras's hand-written einsums make a rank-2 ``MatMul``
only for operands of at most two axes), so no ``MatMul``; an attention
layer's scores are of rank 4. keras_hub's ``TransformerEncoder`` runs its
feed-forward ``Dense`` pair (intermediate, then output) after its
attention. For ``c = a @ kernel`` the gradient takes the kernel transposed
where ``a`` depends on a target, and ``a`` where the kernel is one (in
that order). A tensor depends on a target where a node's input does or its
layer holds one; a ``PositionEmbedding`` reads its input's static shape
alone. Anything else with a ``Dense`` or ``EinsumDense`` in it, LoRA, a
quantized or non-float32 layer: ``None`` (the eager pass counts it).

An unknown size beyond the batch is the inputs' sequence length where
:func:`jacobkit.keras.per_example.lengths_kept` says so.

Nothing here calls a model or changes a layer.
"""

from __future__ import annotations

import math
from typing import Any

from jacobkit.keras import compat, nodes

#: layers that run no rank-2 ``MatMul`` of their own and hold none that does
_COMPOSITES = frozenset({"MultiHeadAttention", "TokenAndPositionEmbedding"})


def transposed(
    model: Any, targets: set[int], batch: int, length: int | None
) -> list[tuple[int, int]] | None:
    """``(rows, bytes)`` of each operand the gradient of a ``MatMul`` of
    ``model``'s forward pass on ``batch`` examples takes transposed, in the
    order the pass runs them (the module's NOTE); ``targets``: the ids of
    the target variables (unwrapped); ``length``: the inputs' size where the
    model leaves one open. ``None`` where the layers do not tell it."""
    found: list[tuple[int, int]] = []
    ok = _walk(model, targets, batch, length, set(), found)
    return found if ok else None


def _walk(
    model: Any,
    targets: set[int],
    batch: int,
    length: int | None,
    marked: set[int],
    found: list[tuple[int, int]],
) -> bool:
    """Walk ``model``'s nodes in the order Keras runs them (deepest first),
    ``marked`` the ids of the symbolic tensors that depend on a target."""
    graph = getattr(model, "_functional", None) or model
    by_depth = getattr(graph, "_nodes_by_depth", None)
    if not by_depth:
        return False
    for depth in sorted(by_depth, reverse=True):
        for node in by_depth[depth]:
            op = node.operation
            inputs = list(node.input_tensors or ())
            depends = any(id(t) in marked for t in inputs)
            name = type(op).__name__
            if compat.is_model(op):
                inner = list(getattr(op, "inputs", None) or ())
                if depends:
                    marked.update(id(t) for t in inner)
                if not _walk(op, targets, batch, length, marked, found):
                    return False
                outputs = list(getattr(op, "outputs", None) or ())
                depends = any(id(t) in marked for t in outputs)
            else:
                if not _layer(op, inputs, depends, targets, batch, length, found):
                    return False
                if name == "PositionEmbedding":
                    depends = False  # its input's static shape alone
                depends = depends or _holds(op, targets)
            if depends:
                marked.update(id(t) for t in node.output_tensors or ())
    return True


def _layer(
    layer: Any,
    inputs: list[Any],
    depends: bool,
    targets: set[int],
    batch: int,
    length: int | None,
    found: list[tuple[int, int]],
) -> bool:
    """Append the operands of ``layer``'s own products on ``inputs`` (a
    node's); ``False`` where the layer's products are not read here."""
    name = type(layer).__name__
    inner = [layer, *compat.flatten_layers(layer)]
    dense = [x for x in inner if type(x).__name__ in ("Dense", "EinsumDense")]
    if not dense:
        return True
    if any(not _plain(x) for x in dense) or len(inputs) < 1:
        return False
    shape = _shape(inputs[0], batch, length)
    if shape is None:
        return False
    if name == "Dense":
        _dense(layer, shape, depends, targets, found)
        return True
    if name == "EinsumDense" or name in _COMPOSITES:
        # an EinsumDense of an input of 3 axes or more: no rank-2 MatMul
        return all(_rank_of(x) >= 3 for x in dense) and all(
            type(x).__name__ == "EinsumDense" for x in dense
        )
    if name == "TransformerEncoder":
        first = getattr(layer, "_feedforward_intermediate_dense", None)
        second = getattr(layer, "_feedforward_output_dense", None)
        pair = [first, second]
        rest = [x for x in dense if all(x is not y for y in pair)]
        if first is None or second is None or any(_rank_of(x) < 3 for x in rest):
            return False
        if any(type(x).__name__ != "EinsumDense" for x in rest):
            return False
        others = [x for x in inner[1:] if all(x is not y for y in pair)]
        depends = depends or any(_holds(x, targets) for x in others)
        _dense(first, shape, depends, targets, found)
        depends = depends or _holds(first, targets)
        width = (*shape[:-1], int(first.units))
        _dense(second, width, depends, targets, found)
        return True
    return False


def _dense(
    layer: Any,
    shape: tuple[int, ...],
    depends: bool,
    targets: set[int],
    found: list[tuple[int, int]],
) -> None:
    """A ``Dense`` on an input of ``shape``: one ``MatMul`` of
    ``(rows, in) @ (in, units)`` (float32, 4 bytes an element)."""
    rows = math.prod(shape[:-1])
    width = shape[-1]
    if depends:
        found.append((rows, 4 * width * int(layer.units)))
    if id(compat.unwrap(layer.kernel)) in targets:
        found.append((rows, 4 * rows * width))


def _plain(layer: Any) -> bool:
    """A float32 layer, LoRA off, not quantized."""
    return (
        not compat.lora_enabled(layer)
        and compat.quantization_mode(layer) is None
        and compat.dtype_policy_name(layer) == "float32"
    )


def _rank_of(layer: Any) -> int:
    """The rank of the input ``layer`` was built for (0: unknown)."""
    shape = compat.built_input_shape(layer)
    return 0 if shape is None else len(shape)


def _holds(layer: Any, targets: set[int]) -> bool:
    """Whether ``layer`` (or a layer in it) holds a target."""
    weights = getattr(layer, "weights", None) or ()
    return any(id(compat.unwrap(w)) in targets for w in weights)


def _shape(tensor: Any, batch: int, length: int | None) -> tuple[int, ...] | None:
    """A symbolic float32 tensor's shape on ``batch`` examples (an open size
    beyond the batch: ``length``)."""
    if str(getattr(tensor, "dtype", "")) != "float32":
        return None
    dims = nodes.sized(tensor.shape, batch, length)
    return dims if dims is not None and len(dims) >= 2 else None
