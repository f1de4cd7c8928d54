"""The ``batch`` strategy's forward pass: each linear part of the target
layer, its input and its pre-activation output ``z``, and how a cotangent at
the rows reaches ``z``. The user's layer is never changed. Two kinds of tap:

- **A node** of a functional graph (:class:`~jacobkit.keras.graph.LayerTap`):
  the model's graph runs with the layer's node computed beside the layer by
  its rule (:meth:`jacobkit.layers.LayerRule.tapped_call`), so each part's
  ``z`` is in the pass itself and a cotangent at the rows reaches it by one
  backward pass.
- **Calls in the traced pass** (:mod:`jacobkit.keras.calls`), wherever the
  layer is called from Python (a subclassed model, a keras_hub block, a
  function): the model runs as it is, inside the ``tf.function`` the strategy
  builds; each call of the layer is found in the traced graph with its input
  ``x`` and output ``y``. A cotangent at the rows reaches ``y`` by one backward
  pass; the rule computes the layer beside it from ``x`` (every part's ``z``
  and the output), and the cotangent at ``y`` is carried back to each ``z``
  through that computation (the activation's, or the attention's, vector-
  Jacobian product; nothing where ``y`` is ``z``). A layer called several
  times has a tap per call; its gradient is their sum.

NOTE (why summing over calls is exact). A row's gradient with respect to a
weight used by several calls is the sum over the calls of each call's input
contracted with the total derivative of the row with respect to that call's
``z`` (the chain rule; backpropagation computes exactly this total derivative
at an intermediate tensor, later calls' dependence on earlier ones
included).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import tensorflow as tf

from jacobkit.keras import calls as layer_calls
from jacobkit.keras.graph import TapError
from jacobkit.keras.pre_activation import pre_activation
from jacobkit.layers import LayerRule
from jacobkit.layers.base import Tapped
from jacobkit.layers.stock import ONE_OP_ACTIVATIONS
from jacobkit.problem import Problem
from jacobkit.problem.eager_inspect import KeptPass
from jacobkit.problem.forms import LayerForm
from jacobkit.problem.targets import Projection
from jacobkit.strategies import gradients
from jacobkit.strategies.base import ZERO


@dataclass(frozen=True)
class Forward:
    """A forward pass with the target layer's parts tapped.

    Attributes:
        taps: each tapped part's input and pre-activation output ``z``, one
            per part and call.
        parts: for each tap, the index of its part
            (:meth:`~jacobkit.layers.LayerRule.parts`).
        rows: the per-example rows ``P``, ``(B, K)``.
        output: the layer's output as its rule computes it (one per call;
            ``None`` for a call tapped at its own output).
        own: the layer's output as the layer itself computes it (``None``
            unless asked for, or where the tap reads the layer's own).
        tape: the persistent tape that recorded the pass.
        ends: the tensors a cotangent at the rows is taken at (each tap's
            ``z``, or each call's output).
        through: ``cotangent at ends -> cotangent at each tap's z``.
    """

    taps: list[Tapped]
    parts: list[int]
    rows: tf.Tensor
    output: list[Any]
    own: list[Any] | None
    tape: tf.GradientTape
    ends: list[tf.Tensor]
    through: Callable[[list[tf.Tensor]], list[tf.Tensor]]

    def cotangents(self, seeds: tf.Tensor) -> list[tf.Tensor]:
        """The cotangent at each tap's ``z`` of ``sum(seeds * rows)``
        (``seeds`` of the rows' shape), one backward pass."""
        # towards the ends alone: no gradient at the watched targets' reads
        # (:mod:`jacobkit.strategies.gradients.unneeded`)
        with gradients.towards(self.ends):
            at_ends = self.tape.gradient(
                self.rows,
                self.ends,
                output_gradients=seeds,
                unconnected_gradients=ZERO,
            )
        return self.through(at_ends)


def tapped_forward(
    problem: Problem,
    inputs: Any,
    *,
    check: bool = False,
    kept: KeptPass | None = None,
) -> Forward:
    """Forward pass tapping the target layer's parts (see the module
    docstring): at its node where it has one in a functional graph, else at
    its calls in the traced pass (which must be being traced: a
    ``tf.function``). With ``check``, the layer's own output is recorded too.
    ``kept``: an eager pass already run on ``inputs``, its calls read from
    its record (not run again; taps at calls only).

    Raises:
        TapError: the layer's calls cannot be found or read (traced taps).
    """
    if kept is None and node_tap(problem):
        return _node_forward(problem, inputs, check)
    return _traced_forward(problem, inputs, check, kept)


def node_tap(problem: Problem) -> bool:
    """Whether the problem's one target layer is a node of a functional graph
    (tapped there); several layers, or one called from Python, are tapped at
    their calls in the traced pass."""
    if problem.layer is None:
        return False
    try:
        problem.layer_tap  # noqa: B018 - built here, where it can be
    except TapError:
        return False
    return True


def _node_forward(problem: Problem, inputs: Any, check: bool) -> Forward:
    found: list[tuple[list[Tapped], Any, Any]] = []
    layer_rule = rule(problem)
    weights = _weights(problem)

    def watch(z: tf.Tensor) -> tf.Tensor:
        tape.watch(z)
        return z

    def on_layer(call: Any, args: Any, kwargs: Any) -> Any:
        output, taps = layer_rule.tapped_call(args, kwargs, weights, watch)
        found.append((taps, output, call(*args, **kwargs) if check else None))
        return output

    tape = tf.GradientTape(persistent=True, watch_accessed_variables=False)
    with tape:
        per_example = problem.per_example_rows(inputs, hook=on_layer)
    taps, output, own = found[0]
    return Forward(
        taps=taps,
        parts=list(range(len(taps))),
        rows=per_example,
        output=[output],
        own=[own] if check else None,
        tape=tape,
        ends=[tap.z for tap in taps],
        through=lambda at_z: at_z,
    )


@dataclass(frozen=True)
class _Unit:
    """What is looked up in the traced pass: the calls of ``layer``, each
    computed beside by ``rule`` with the weights of parts ``parts``."""

    layer: Any
    rule: LayerRule
    parts: tuple[int, ...]


def _units(problem: Problem) -> list[_Unit]:
    """What is looked up, for every layer serving the targets: a rule whose
    parts are sub-layers of their own (an attention layer's projections) part
    by part, each call of each sub-layer computed by the part's rule; any
    other layer by layer. Parts are numbered across the layers, in the order
    of :func:`projections`."""
    found: list[_Unit] = []
    offset = 0
    for form in forms(problem):
        layer_rule = form.rule
        parts = layer_rule.parts()
        if len(parts) > 1 and all(p.layer is not layer_rule.layer for p in parts):
            found += [_Unit(p.layer, p, (offset + i,)) for i, p in enumerate(parts)]
        else:
            numbers = tuple(offset + i for i in range(len(parts)))
            found.append(_Unit(layer_rule.layer, layer_rule, numbers))
        offset += len(parts)
    return found


def _traced_forward(
    problem: Problem, inputs: Any, check: bool, kept: KeptPass | None = None
) -> Forward:
    weights = _weights(problem)
    record = layer_calls.Record() if tf.executing_eagerly() else None
    tape = tf.GradientTape(persistent=True, watch_accessed_variables=False)
    if kept is not None:
        record, tape, per_example = kept.record, kept.tape, kept.per_example
    else:
        with tape:
            tape.watch(list(problem.targets))
            if record is None:
                per_example = problem.per_example_rows(inputs)
            else:
                with record:
                    per_example = problem.per_example_rows(inputs)
    graph = tf.compat.v1.get_default_graph()
    beside = tf.GradientTape(persistent=True, watch_accessed_variables=False)
    taps: list[Tapped] = []
    parts: list[int] = []
    outputs: list[Any] = []
    own: list[Any] = []
    spans: list[tuple[int, int]] = []  # each call's taps: [start, stop)
    z_own: list[tf.Tensor] = []  # (checks) the model's z beside the rule's
    z_rule: list[tf.Tensor] = []
    batch = int(per_example.shape[0])
    for unit in _units(problem):
        mine = [weights[i] for i in unit.parts]
        read = [w for pair in mine for w in pair]
        try:
            found = (
                layer_calls.layer_calls(graph, unit.layer, read)
                if record is None
                else layer_calls.eager_layer_calls(record, unit.layer, read, inputs)
            )
        except layer_calls.NoCall as err:
            raise TapError(str(err)) from err
        for call in found:
            x = _call_input(unit, call, batch)
            own_z = None if check else _own_z_alone(unit, call)
            if own_z is not None:
                # the call's own z (its output, or its activation's input): no
                # detour through the rule's, which is not traced at all
                spans.append((len(taps), len(taps) + 1))
                taps.append(Tapped(x, own_z))
                parts.extend(unit.parts)
                outputs.append(None)
                own.append(own_z)
                continue

            def watch(z: tf.Tensor) -> tf.Tensor:
                beside.watch(z)
                return z

            with beside:
                output, call_taps = unit.rule.tapped_call((x,), {}, mine, watch)
            y = _call_output(unit.layer, call, output)
            z = _own_z(unit, y, len(call_taps), record)
            if check:
                if z is not None and z is not y:
                    # the first call's checks compare the model's z with the
                    # rule's
                    z_own.append(z)
                    z_rule.append(call_taps[0].z)
            elif z is not None:
                # the call's own z (its output, or its activation's input):
                # no detour through the rule's
                call_taps, output, y = [Tapped(x, z)], None, z
            spans.append((len(taps), len(taps) + len(call_taps)))
            taps.extend(call_taps)
            parts.extend(unit.parts)
            outputs.append(output)
            own.append(y)

    def through(at_outputs: list[tf.Tensor]) -> list[tf.Tensor]:
        at_z: list[tf.Tensor] = []
        for (start, stop), output, cotangent in zip(spans, outputs, at_outputs):
            if output is None:  # the call's output is its z
                at_z.append(cotangent)
                continue
            at_z.extend(
                beside.gradient(
                    output,
                    [tap.z for tap in taps[start:stop]],
                    output_gradients=tf.cast(cotangent, output.dtype),
                    unconnected_gradients=ZERO,
                )
            )
        return at_z

    return Forward(
        taps=taps,
        parts=parts,
        rows=per_example,
        output=[*outputs, *z_rule],
        own=[*own, *z_own],
        tape=tape,
        ends=own,
        through=through,
    )


def _own_z(
    unit: _Unit, y: tf.Tensor, taps: int, record: layer_calls.Record | None = None
) -> tf.Tensor | None:
    """A call's own pre-activation ``z`` in the traced pass, where it has one
    part: its output where that is ``z``, else its one-op activation's input
    (:func:`jacobkit.keras.pre_activation.pre_activation`); ``None`` elsewhere, and
    for a float16/bfloat16 output (the rule's ``z`` is float32)."""
    if taps != 1 or y.dtype.size < 4:
        return None
    if unit.rule.output_is_z():
        return y
    return pre_activation(unit.layer, y, ONE_OP_ACTIVATIONS, record)


def _own_z_alone(unit: _Unit, call: layer_calls.LayerCall) -> tf.Tensor | None:
    """A call's own ``z`` (:func:`_own_z`) found without computing the rule
    beside it, where the call of a one-part layer gives out one floating
    tensor: the one :func:`_call_output` picks wherever the rule's output has
    its shape, which the first call's checks make sure of (they compare that
    output with the rule's, call by call). ``None`` where that does not
    hold: the rule is computed beside, as before.

    NOTE (measured). Computing the rule and discarding it traced 185 graph
    ops of BERT tiny's first clipped sum (4,800 in all); 143 of them are
    skipped so (the rest: calls whose activation is not one op, GELU)."""
    if len(unit.parts) != 1:
        return None
    made = [t for t in call.outputs if t.shape.rank is not None and t.dtype.is_floating]
    if len(made) != 1 or not made[0].shape.rank:
        return None
    return _own_z(unit, made[0], 1)


def _call_input(unit: _Unit, call: layer_calls.LayerCall, batch: int) -> tf.Tensor:
    """The one tensor ``call`` took in, with an example axis (for a layer
    that reads only its input's shape and took no tensor in: zeros of its
    output's shape)."""
    layer = unit.layer
    candidates = [t for t in call.inputs if t.shape.rank is not None and t.shape.rank]
    if not candidates and unit.rule.shape_only_input:
        made = [t for t in call.outputs if t.dtype.is_floating and t.shape.rank]
        if made:
            return tf.zeros_like(made[-1])
    if len(candidates) != 1:
        shapes = ", ".join(str(tuple(t.shape)) for t in candidates) or "none"
        raise TapError(
            f"layer {layer.name!r} is called on {len(candidates)} tensors "
            f"({shapes}) at {call.scope!r}, not one input"
        )
    x = candidates[0]
    if x.shape[0] is not None and int(x.shape[0]) != batch:
        raise TapError(
            f"layer {layer.name!r} is called at {call.scope!r} on a tensor of "
            f"shape {tuple(x.shape)} whose first axis is not the examples' (the "
            "tensor is shared by every example of the batch): its per-example "
            "gradients are not separable there"
        )
    return x


def _call_output(layer: Any, call: layer_calls.LayerCall, output: Any) -> tf.Tensor:
    """The tensor ``call`` gave out: the last it made of the shape its rule
    computes."""
    shape = tuple(output.shape)
    found = [
        t
        for t in call.outputs
        if t.shape.rank is not None and tuple(t.shape) == shape and t.dtype.is_floating
    ]
    if not found:
        raise TapError(
            f"layer {layer.name!r}'s call at {call.scope!r} gives out no tensor of "
            f"the shape its closed form computes, {shape}"
        )
    return found[-1]


def rule(problem: Problem) -> LayerRule:
    """The target layer's rule (``batch`` runs only where it has one)."""
    found = problem.layer_rule
    assert found is not None, "checked before batch runs"
    return found


def forms(problem: Problem) -> tuple[LayerForm, ...]:
    """The layers serving the targets (checked before batch runs)."""
    found = problem.forms
    assert found is not None, "checked before batch runs"
    return found


def projections(problem: Problem) -> tuple[Projection, ...]:
    """Every linear part of the layers serving the targets, in order."""
    return tuple(p for form in forms(problem) for p in form.projections)


def _weights(problem: Problem) -> list[tuple[tf.Variable, tf.Variable | None]]:
    """``(kernel, bias)`` of each linear part, in the order of the parts."""
    targets = problem.targets
    return [
        (targets[p.kernel], None if p.bias is None else targets[p.bias])
        for p in projections(problem)
    ]
