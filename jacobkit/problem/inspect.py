"""The one traced pass of a problem: a forward and backward pass, traced and
never run, shows the output's shape, the rows, which targets reach them and
what the computation holds (loops, activations, convolution gradients).

What it finds is kept per model, what is differentiated
(:class:`~jacobkit.problem.key.Differentiated`) and input signature: tracing
a model takes long (0.2 s for a small Conv1D stack), which a loop of
``jacobian()`` calls on the same model would pay every time.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass
from typing import Any, NoReturn, Protocol

import tensorflow as tf

from jacobkit.keras import compat, layer_tree, state
from jacobkit.layers import convolutions
from jacobkit.layers.convolutions import Gradient as ConvolutionGradient
from jacobkit.problem import liveness, loops, operands
from jacobkit.problem import outputs as model_outputs
from jacobkit.problem.cache import PerModel
from jacobkit.problem.key import Differentiated
from jacobkit.problem.liveness import SequentialMemory
from jacobkit.problem.rows import Rows

_INSPECTED = PerModel("the one traced pass per problem and input signature")


@dataclass(frozen=True)
class Inspection:
    """What one traced forward and backward pass of a problem shows (nothing
    runs).

    Attributes:
        outputs_shape: the model output's shape, ``None`` for several outputs.
        rows: the rows' shape and dtype.
        connected: per target, whether it reaches the rows.
        has_loops: whether the computation runs a ``tf.while_loop``.
        activation_bytes: bytes of every floating tensor the forward pass
            makes, its loops' accumulators included
            (:func:`~jacobkit.problem.loops.kept_bytes`): an upper bound on
            what one row's backward pass keeps.
        convolutions: the convolution kinds the backward pass runs
            (``"conv2d"``, ...: :mod:`jacobkit.layers.convolutions`, read from
            its op types; their CPU kernels' scratch space and accuracy depend
            on the CPU).
        sequential_memory: what a row's backward pass holds where rows run one after
            another (:class:`SequentialMemory`), ``None`` where a ``tf.while_loop``
            hides the tensors (a recurrent layer's are in its loop's body).
        forward_bytes: bytes of every floating tensor the forward pass
            makes, upstream of the targets too: what an eager forward pass
            of a Keras model holds at its peak (it keeps them until the
            call returns; measured on a frozen MobileNetV2 at 96 px, 16
            images: 260 MiB held, 319 MiB counted).
        unpinned: the names of the forward pass's stateful random ops
            (:func:`jacobkit.keras.state.unpinned`): draws no Keras seed
            generator's state pins, new on every pass.
        layer_outputs: bytes of the outputs of the model's functional
            layers for this batch (:func:`jacobkit.keras.layer_tree.output_bytes`),
            ``None`` where not known: read with the traced pass, so a steady
            call does not walk the layers again.
        transposed: the operands of the forward pass's matrix products
            that their gradients take transposed
            (:class:`~jacobkit.problem.operands.Transposed`): what the
            ``MatMul`` rule copies where it applies (oneDNN off).
        convolution_gradients: each convolution gradient op of the
            backward pass (:class:`jacobkit.layers.convolutions.Gradient`):
            whether TensorFlow's kernel or jacobkit's rule runs it, per
            strategy; ``None`` where not read (every op then counted as
            TensorFlow's, for every kind in ``convolutions``).
        measured: whether a pass (traced or eager) measured it; ``False``
            where it was read from the model's structure
            (:mod:`.structural_inspect`: its byte counts upper bounds).
    """

    outputs_shape: tf.TensorShape | None
    rows: tf.TensorSpec
    connected: tuple[bool, ...]
    has_loops: bool
    activation_bytes: int
    convolutions: frozenset[str]
    forward_bytes: int = 0
    sequential_memory: SequentialMemory | None = None
    unpinned: tuple[str, ...] = ()
    layer_outputs: int | None = None
    transposed: tuple[operands.Transposed, ...] = ()
    convolution_gradients: tuple[ConvolutionGradient, ...] | None = None
    measured: bool = True


class Traceable(Protocol):
    """What the traced pass reads of a problem."""

    model: Any
    inputs: Any
    targets: tuple[tf.Variable, ...]
    rows_spec: Rows
    training: bool
    output: int | str | None

    def call_model(self, inputs: Any) -> Any: ...

    def function(self, fn: Callable[..., Any]) -> Any: ...

    def raise_call_error(self, err: Exception) -> NoReturn: ...

    def labels(self, inputs: Any) -> tuple[Any, ...]: ...


def inspect(
    problem: Traceable,
    differentiated: Differentiated,
    eager: Callable[[Traceable], Inspection | None] | None = None,
) -> Inspection:
    """The :class:`Inspection` of ``problem``, which differentiates
    ``differentiated`` (traced once per model, ``differentiated`` and input
    signature: the inputs' shapes, dtypes and structure). ``eager``: a way
    to learn it without tracing (:mod:`.eager_inspect`), ``None`` where
    unsure: the traced pass then runs; kept apart from the traced one."""
    signature = tuple(
        (tuple(t.shape), t.dtype.name) for t in tf.nest.flatten(problem.inputs)
    )
    key = (differentiated, signature, _structure(problem.inputs), eager is not None)
    inspected = _INSPECTED.of(problem.model)
    if key not in inspected:
        found = None if eager is None else eager(problem)
        inspected[key] = trace(problem) if found is None else found
    return inspected[key]


def _structure(inputs: Any) -> Hashable:
    """The nesting of ``inputs`` (tuples, lists and dicts of tensors, as
    :func:`~jacobkit.problem.arguments.to_tensors` gives them), hashable:
    what ``repr(tf.nest.map_structure(...))`` told apart, without
    ``tf.nest``'s generic walk (13 us of a steady call)."""
    if isinstance(inputs, tuple):
        return tuple(_structure(v) for v in inputs)
    if isinstance(inputs, list):
        return ("list", tuple(_structure(v) for v in inputs))
    if isinstance(inputs, dict):
        return ("dict", tuple((k, _structure(inputs[k])) for k in sorted(inputs)))
    return 0


def trace(problem: Traceable) -> Inspection:
    """One forward and backward pass of the problem, traced."""
    found: dict[str, Any] = {}
    probe = _probe(problem, found)
    with compat.name_scopes_kept():
        graph = problem.function(probe).get_concrete_function(problem.inputs).graph
    if "call_failed" in found:
        problem.raise_call_error(found["call_failed"])
    if "invalid" in found:
        raise found["invalid"]
    outputs = found["outputs"]
    if "rows" not in found:
        raise TypeError(
            "jacobian(model=...): the model returned "
            f"{type(outputs).__name__}, not a single tensor. Pick one with "
            f"output= ({model_outputs.choices(outputs, problem.model)}), or "
            "pass outputs=callable that maps them to rows."
        )
    rows = found["rows"]
    if not rows.dtype.is_floating:
        raise TypeError(
            f"jacobian(model=...): the rows have dtype {rows.dtype.name}; "
            "Jacobians need a floating output (float16/32/64). Cast the "
            "output to float, or pick a floating output with outputs=callable."
        )
    operations = graph.get_operations()
    forward_ops = found.get("forward_ops", 0)
    has_loops = any(op.type in loops.LOOPS for op in operations)
    # one Node record per op, read by the byte counts and the walk alike
    nodes = liveness.graph_nodes(operations)
    forward = nodes[:forward_ops]
    outputs_shape = outputs.shape if isinstance(outputs, tf.Tensor) else None
    layer_outputs = None
    reads = _target_reads(graph, problem.targets)
    if outputs_shape is not None and outputs_shape[0] is not None:
        # walked here, once per signature, not on every call (0.1 ms a call)
        layer_outputs = layer_tree.output_bytes(problem.model, int(outputs_shape[0]))
    return Inspection(
        outputs_shape=outputs_shape,
        rows=tf.TensorSpec(rows.shape, rows.dtype),
        connected=tuple(found["connected"]),
        has_loops=has_loops,
        # a loop's accumulators are in no op's outputs: counted apart
        activation_bytes=liveness.backward_bytes(forward, reads)
        + loops.kept_bytes(operations[:forward_ops]),
        convolutions=convolutions.of_gradient_ops(
            op.type for op in operations[forward_ops:]
        ),
        forward_bytes=liveness.float_bytes(forward),
        sequential_memory=(
            None if has_loops else liveness.walk_nodes(nodes, forward_ops)
        ),
        # loop bodies are functions of the graph's library
        unpinned=state.unpinned(
            operations[:forward_ops], graph.as_graph_def() if has_loops else None
        ),
        layer_outputs=layer_outputs,
        transposed=operands.of_graph(operations[:forward_ops], reads),
        convolution_gradients=convolutions.of_graph_ops(operations[forward_ops:]),
    )


def _probe(problem: Traceable, found: dict[str, Any]) -> Callable[[Any], tf.Tensor]:
    """The traced function: records in ``found`` the outputs, the rows, the
    number of forward ops and which targets are connected, or the error
    (raised by :func:`trace` outside ``tf.function``)."""
    rows_spec = problem.rows_spec

    def probe(inputs):
        with tf.GradientTape(watch_accessed_variables=False) as tape:
            tape.watch(problem.targets)
            try:
                outputs = problem.call_model(inputs)
            except model_outputs.OutputError as err:
                found["invalid"] = err
                return tf.constant(0.0)
            except (ValueError, TypeError, tf.errors.OpError) as err:
                # raised as jacobkit's own message, outside tf.function
                found["call_failed"] = err
                return tf.constant(0.0)
            found["outputs"] = outputs
            if not isinstance(outputs, tf.Tensor):
                if not callable(rows_spec.mode):
                    return tf.constant(0.0)
                rows = tf.convert_to_tensor(rows_spec.mode(outputs))
            else:
                try:
                    rows_spec.check(outputs)
                except ValueError as err:
                    # Raised outside tf.function, which would otherwise
                    # prepend its "in user code:" traceback.
                    found["invalid"] = err
                    return tf.constant(0.0)
                rows = rows_spec.of(outputs, problem.labels(inputs))
            found["rows"] = rows
            # the forward pass's ops come before the gradient's
            found["forward_ops"] = len(rows.graph.get_operations())
        if not rows.dtype.is_floating:
            return tf.constant(0.0)
        grads = tape.gradient(
            rows, problem.targets, output_gradients=tf.ones_like(rows)
        )
        found["connected"] = [g is not None for g in grads]
        return tf.constant(0.0)

    return probe


def _target_reads(graph: Any, targets: Sequence[Any]) -> set[str]:
    """The keys (:func:`jacobkit.problem.liveness.graph_nodes`) of the
    placeholders through which ``graph`` reads ``targets``: none where they
    are not among its captures (then no op reads them)."""
    handles = {id(getattr(t, "handle", None)) for t in targets}
    return {inner.name for outer, inner in graph.captures if id(outer) in handles}
