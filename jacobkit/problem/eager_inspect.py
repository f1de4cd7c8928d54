"""The inspecting pass run eagerly on two and three examples, where that can
be read for sure: what :func:`jacobkit.problem.inspect.trace` learns from a
traced forward and backward pass (the outputs' and rows' shapes, which
targets the rows reach, the tensors' bytes for the memory priors, the
convolution gradients' kinds), learned from the ops TensorFlow runs eagerly
(a :class:`jacobkit.keras.calls.Record`), each tensor's bytes extrapolated
to the batch from the two passes.

NOTE (why). Tracing a pass costs ~0.3 ms per graph op whatever the batch:
BERT tiny's traced pass (1,044 graph ops) was about a third of a first
reduced call's excess over a plain training step's first call. Two eager
passes on two and three examples run the same ops once each, with no graph
built.

NOTE (exactness). A tensor's bytes on ``B`` examples are taken as affine in
the examples: ``s(B) = s(2) + (B - 2) (s(3) - s(2))``, exact for the
activations and cotangents (``B`` times one example's), for weights and
their gradients (the same at any batch) and for tensors that fold the
batch into another axis (attention's ``(B * heads, T, T)``). Two and three,
not one and two: with one example some broadcasts are not broadcasts, and
TensorFlow's gradients then skip their sums, so the passes' ops would not
match. Shapes (the outputs', the rows') must be, axis by axis, the same in
both passes or two and three times one size (then that size times ``B``).

Where the record cannot say for sure, :func:`inspection` returns ``None``
and the traced pass runs, as before: ``training=True`` (the pass's random
ops are named in the traced graph: ``Inspection.unpinned``), tensor targets
(their own calls), outputs not a single tensor, a model whose layers are
not all Keras's or keras_hub's own loop-free ones (a ``tf.while_loop`` runs
as a Python loop eagerly: the record would not show the loop the traced
computation runs, ``Inspection.has_loops``), a model whose inputs fix their
batch size, a pass part of which ran as a ``tf.function`` (its ops unseen),
passes whose ops do not match, any error (the traced pass raises it in
jacobkit's words), and a trace already under way (no eager execution).
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from typing import Any

import tensorflow as tf

from jacobkit.keras import calls, compat, layer_tree
from jacobkit.layers import convolutions
from jacobkit.problem import liveness, operands
from jacobkit.problem.inspect import Inspection, Traceable
from jacobkit.problem.liveness import Node

#: the examples of the two passes whose bytes are extrapolated to the batch;
#: a batch of at most the larger runs once, as it is
EXAMPLES = (2, 3)
#: the modules whose layers' code is known to run no loop: Keras's own layers
#: and keras_hub's modelling layers, less those below
_OWN = ("keras.src.layers.", "keras_hub.src.layers.modeling.")
#: ... less these: recurrent layers and wrappers (a loop, or ``vectorized_map``
#: as a traced function), preprocessing, Lambda (a user's function), and
#: keras_hub's box layers (``ops.while_loop``)
_NOT_OWN = (
    "keras.src.layers.rnn.",
    "keras.src.layers.preprocessing.",
    "keras.src.layers.core.lambda_layer",
    "keras_hub.src.layers.modeling.non_max_supression",
    "keras_hub.src.layers.modeling.anchor_generator",
    "keras_hub.src.layers.modeling.box_matcher",
)
#: a model whose ``call`` is one of these modules' runs its graph's layers
_OWN_MODELS = ("keras.src.models.functional", "keras.src.models.sequential")
#: ops that read their inputs' shapes alone: eagerly, a gradient asks them
#: for shapes a traced one knows statically (a constant), so their reads
#: keep nothing alive (counted, the forward tensors they read stayed alive
#: to the end of the backward pass: BERT tiny's walked peak 1.9x the traced)
_SHAPE_OPS = frozenset({"Shape", "ShapeN", "Size", "Rank"})
#: the key of a target variable's handle among an op's inputs
_TARGET = ("target",)
#: the key of any other tensor no recorded op made (an input, a constant)
_OUTSIDE = ("outside",)


@dataclass(frozen=True)
class _Pass:
    """What one eager pass shows: the outputs' and rows' shapes, the rows'
    dtype, which targets the rows reach, and its ops (the first
    ``forward_ops`` of them the forward pass), and the pass itself where it
    is kept for the checks."""

    outputs: tuple[int, ...]
    rows: tuple[int, ...]
    dtype: tf.DType
    connected: tuple[bool, ...]
    nodes: tuple[Node, ...]
    forward_ops: int
    transposed: tuple[operands.Transposed, ...] = ()
    kept: KeptPass | None = None
    gradients: tuple[convolutions.Gradient, ...] = ()


@dataclass(frozen=True)
class KeptPass:
    """The eager pass on a problem's first ``min(B, 2)`` examples, kept for
    the ``batch`` strategy's checks, which read that same forward pass
    (:mod:`jacobkit.strategies.batch.checks`): run once, not twice.

    Attributes:
        inputs: the examples it ran on (the problem's inputs' first ones).
        record: its forward ops (:class:`jacobkit.keras.calls.Record`).
        tape: the persistent tape that recorded the forward pass, the
            targets watched.
        per_example: the per-example rows ``(n, K)``
            (:meth:`jacobkit.problem.rows.Rows.per_example`), on that tape.
    """

    inputs: Any
    record: calls.Record
    tape: tf.GradientTape
    per_example: tf.Tensor


class Kept:
    """One :class:`KeptPass` at most, shared by a problem and its shallow
    copies (taken once: what is taken, or cleared, is freed for all)."""

    def __init__(self) -> None:
        self._kept: KeptPass | None = None

    def put(self, kept: KeptPass) -> None:
        self._kept = kept

    def inspection(self, problem: Traceable) -> Inspection | None:
        """:func:`inspection` of ``problem``, its pass kept here."""
        return inspection(problem, self)

    def take(self) -> KeptPass | None:
        """The kept pass, which this slot then no longer holds."""
        kept, self._kept = self._kept, None
        return kept


def inspection(problem: Traceable, keep: Kept | None = None) -> Inspection | None:
    """The :class:`Inspection` of ``problem`` from eager passes on two and
    three of its examples (its whole batch where it holds at most three),
    or ``None`` where those cannot tell it for sure (the module's NOTE):
    the traced pass then runs. ``keep``: where the inspection holds, the
    pass on ``min(B, 2)`` examples is kept there (:class:`KeptPass`; with
    three examples, none: the checks read two)."""
    batch = batch_of(problem)
    if batch is None:
        return None
    sizes = (batch,) if batch <= max(EXAMPLES) else EXAMPLES
    passes = []
    kept = None
    for n in sizes:
        shared = keep is not None and n == min(batch, EXAMPLES[0])
        found = _run(problem, n, batch, shared)
        if found is None:
            return None
        passes.append(found)
        kept = found.kept or kept
    inspected = _combined(problem, passes, sizes, batch)
    if inspected is not None and kept is not None and keep is not None:
        keep.put(kept)
    return inspected


def batch_of(problem: Traceable) -> int | None:
    """The examples of ``problem``'s inputs, where an eager pass may tell
    its inspection (``None``: it may not)."""
    if (
        not tf.executing_eagerly()
        or problem.training
        or getattr(problem, "tensor_targets", None) is not None
        or not _loop_free(problem.model)
    ):
        return None
    leading = {
        int(t.shape[0]) if t.shape.rank else None
        for t in tf.nest.flatten(problem.inputs)
    }
    if len(leading) != 1 or None in leading:
        return None
    return leading.pop()


def _loop_free(model: Any) -> bool:
    """Whether every layer of ``model`` is Keras's or keras_hub's own and runs
    no loop, and its models run their graphs (functional, sequential) with
    no batch size fixed."""
    if not compat.is_model(model):
        return False
    for layer in [model, *compat.flatten_layers(model)]:
        if compat.is_model(layer):
            call = getattr(type(layer).call, "__module__", "") or ""
            if not call.startswith(_OWN_MODELS):
                return False
            if not _any_batch(layer):
                return False
            continue
        module = type(layer).__module__ or ""
        call = getattr(type(layer).call, "__module__", "") or ""
        for where in (module, call):
            if not where.startswith(_OWN) or where.startswith(_NOT_OWN):
                return False
    return True


def _any_batch(model: Any) -> bool:
    """Whether ``model``'s graph inputs leave the batch size open."""
    try:
        specs = list(model.inputs or ())
    except (AttributeError, ValueError):  # a model without a graph of its own
        return False
    for spec in specs:
        shape = getattr(spec, "shape", None)
        if shape is None or not len(shape) or shape[0] is not None:
            return False
    return bool(specs)


def _run(problem: Traceable, n: int, batch: int, keep: bool) -> _Pass | None:
    """One eager forward and backward pass on the first ``n`` examples
    (``keep``: the pass kept for the checks too, :class:`KeptPass`)."""
    inputs = problem.inputs
    if n < batch:
        inputs = tf.nest.map_structure(lambda t: t[:n], inputs)
    record = calls.Record()
    targets = list(problem.targets)
    tape = tf.GradientTape(persistent=keep, watch_accessed_variables=False)
    per_example = None
    try:
        with tape:
            tape.watch(targets)
            with record:
                outputs = problem.call_model(inputs)
                if not isinstance(outputs, tf.Tensor):
                    return None
                problem.rows_spec.check(outputs)
                rows = problem.rows_spec.of(outputs, problem.labels(inputs))
                forward_ops = len(record.ops)
            if keep and problem.rows_spec.decomposes_per_example:
                # the checks' rows, on the tape, their ops not recorded:
                # what the inspection reads is the pass alone
                per_example = _per_example(problem, outputs, inputs)
        if not rows.dtype.is_floating:
            return None
        with record:
            grads = tape.gradient(rows, targets, output_gradients=tf.ones_like(rows))
    except Exception:  # the traced pass raises it, in jacobkit's words
        return None
    if record.graphs:
        return None
    handles = {id(compat.as_tf_variable(t).handle) for t in targets}
    kept = None
    if per_example is not None:
        kept = KeptPass(inputs, record.head(forward_ops), tape, per_example)
    return _Pass(
        outputs=tuple(int(d) for d in outputs.shape),
        rows=tuple(int(d) for d in rows.shape),
        dtype=rows.dtype,
        connected=tuple(g is not None for g in grads),
        nodes=_nodes(record.ops, handles),
        forward_ops=forward_ops,
        transposed=operands.of_eager(record.ops[:forward_ops], handles),
        kept=kept,
        gradients=convolutions.of_eager_ops(record.ops[forward_ops:]),
    )


def _per_example(problem: Traceable, outputs: tf.Tensor, inputs: Any) -> Any:
    """The per-example rows the checks read, ``None`` where they cannot be
    formed (the checks then run their own pass, and say why)."""
    spec = problem.rows_spec
    try:
        return spec.per_example(spec.select(outputs), problem.labels(inputs))
    except Exception:  # the checks' own pass raises it
        return None


def _nodes(ops: Sequence[calls.EagerOp], handles: set[int]) -> tuple[Node, ...]:
    """The recorded ops as :class:`Node` records: each tensor keyed by the
    op and output that made it (an identity's by its input's source)."""
    keys: dict[int, Hashable] = {}
    nodes = []
    for i, op in enumerate(ops):
        reads = tuple(
            keys.get(id(t), _TARGET if id(t) in handles else _OUTSIDE)
            for t in (() if op.type in _SHAPE_OPS else op.inputs)
        )
        made = []
        for j, t in enumerate(op.outputs):
            key: Hashable = (i, j)
            if op.type == "Identity" and reads:
                key = reads[0]
            keys[id(t)] = key
            made.append((key, liveness.tensor_bytes(t)))
        nodes.append(Node(op.type, reads, tuple(made)))
    return tuple(nodes)


def _combined(
    problem: Traceable, passes: list[_Pass], sizes: tuple[int, ...], batch: int
) -> Inspection | None:
    """The inspection on ``batch`` examples of one exact pass, or of two on
    ``sizes`` examples extrapolated (``None``: they do not match)."""
    last = passes[-1]
    if len(passes) == 1:
        nodes, outputs, rows = last.nodes, last.outputs, last.rows
        transposed = last.transposed
    else:
        first = passes[0]
        if (
            first.forward_ops != last.forward_ops
            or first.connected != last.connected
            or first.dtype != last.dtype
        ):
            return None
        found = _extrapolated(first.nodes, last.nodes, sizes, batch)
        outputs_shape = _shape(first.outputs, last.outputs, sizes, batch)
        rows_shape = _shape(first.rows, last.rows, sizes, batch)
        grown = operands.extrapolated(
            first.transposed, last.transposed, (sizes[0], sizes[1]), batch
        )
        if (
            found is None
            or outputs_shape is None
            or rows_shape is None
            or grown is None
        ):
            return None
        transposed = grown
        nodes, outputs, rows = found, outputs_shape, rows_shape
    if not outputs:
        return None
    forward = nodes[: last.forward_ops]
    return Inspection(
        outputs_shape=tf.TensorShape(outputs),
        rows=tf.TensorSpec(rows, last.dtype),
        connected=last.connected,
        has_loops=False,
        activation_bytes=liveness.backward_bytes(forward, (_TARGET,)),
        convolutions=convolutions.of_gradient_ops(
            node.type for node in nodes[last.forward_ops :]
        ),
        forward_bytes=liveness.float_bytes(forward),
        sequential_memory=liveness.walk_nodes(nodes, last.forward_ops),
        unpinned=(),
        layer_outputs=layer_tree.output_bytes(problem.model, outputs[0]),
        transposed=transposed,
        # patches grow with the examples (the last pass's: sizes[-1])
        convolution_gradients=tuple(
            g.scaled(batch / sizes[-1]) for g in last.gradients
        ),
    )


def _extrapolated(
    first: Sequence[Node], second: Sequence[Node], sizes: tuple[int, ...], batch: int
) -> tuple[Node, ...] | None:
    """``second``'s nodes with each tensor's bytes extrapolated from the
    two passes to ``batch`` examples (``None``: their ops do not match, or a
    tensor shrinks with more examples)."""
    if len(first) != len(second):
        return None
    a, b = sizes
    nodes = []
    for one, two in zip(first, second, strict=True):
        if (
            one.type != two.type
            or one.reads != two.reads
            or len(one.made) != len(two.made)
        ):
            return None
        made = []
        for (key, small), (_, large) in zip(one.made, two.made, strict=True):
            step, rest = divmod(large - small, b - a)
            if step < 0 or rest:
                return None
            made.append((key, small + (batch - a) * step))
        nodes.append(Node(two.type, two.reads, tuple(made)))
    return tuple(nodes)


def _shape(
    first: tuple[int, ...], second: tuple[int, ...], sizes: tuple[int, ...], batch: int
) -> tuple[int, ...] | None:
    """A shape on ``batch`` examples from its two passes': each axis the same
    in both, or ``a k`` and ``b k`` on ``sizes = (a, b)`` examples (then
    ``batch k``); ``None`` otherwise."""
    if len(first) != len(second):
        return None
    a, b = sizes
    found = []
    for one, two in zip(first, second, strict=True):
        if one == two:
            found.append(one)
        elif one % a == 0 and two == one // a * b:
            found.append(one // a * batch)
        else:
            return None
    return tuple(found)
