"""What the ``batch`` strategy checks before it runs, and its refusals: a
target layer with a closed form (what the layer registry holds,
:func:`jacobkit.layers.with_rules`), rows that decompose per example, a layer
that can be tapped, and, on one eager forward pass, that the layer computes
its closed form, that the rule's gradients and norms are those of autodiff
through its own ``pre_activation``, and that examples do not mix."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import tensorflow as tf

from jacobkit import layers
from jacobkit.keras import calls as layer_calls
from jacobkit.keras.graph import TapError
from jacobkit.problem import PerModel, Problem, structural_inspect
from jacobkit.problem.eager_inspect import KeptPass
from jacobkit.strategies import precision
from jacobkit.strategies.batch import rule_check
from jacobkit.strategies.batch.forward import (
    Forward,
    node_tap,
    projections,
    tapped_forward,
)

#: machine epsilon of the half-precision compute dtypes of mixed precision
_EPSILON = {tf.float16: 2.0**-10, tf.bfloat16: 2.0**-7}
#: examples the checks before the first run look at: two show whether
#: examples mix, and an eager Keras call holds every layer's output (a
#: frozen MobileNetV2 at 96 px: 260 MiB for 16 images, against batch's 29
#: MiB steady peak)
CHECK_EXAMPLES = 2


def tensor_refusal(problem: Problem) -> str | None:
    """Why ``batch`` cannot differentiate ``problem``'s targets, known from
    what they are alone: tensors (``Inputs()``, ``Output()``), not a layer's
    variables (``None``: variables)."""
    if problem.tensor_targets is None:
        return None
    return (
        "differentiates a Dense or Conv layer's kernel and bias, got the "
        f"tensor target(s) {', '.join(problem.target_names)}. Use "
        "strategy='chunked' or 'jacobian' (per-example rows of "
        "Inputs()/Output() targets cost K rows there, not B x K)"
    )


def check(problem: Problem, name: str) -> None:
    """Refuse what strategy ``name`` (``"batch"``) cannot run (``ValueError``)."""
    tensors = tensor_refusal(problem)
    if tensors is not None:
        raise ValueError(f"jacobian(strategy='batch'): {tensors}.")
    rule = problem.layer_rule
    if problem.layer is None and problem.forms is None:
        raise ValueError(
            f"jacobian(strategy='batch'): supports {layers.with_rules()} layers, "
            "got a list of variables not every one of which is a weight of such "
            "a layer (all of its kernels and biases). Use strategy='chunked' or "
            "'jacobian' for these targets."
        )
    if problem.layer is not None and rule is None:
        what = f"layer {problem.layer.name!r} ({type(problem.layer).__name__})"
        raise ValueError(
            f"jacobian(strategy='batch'): supports {layers.with_rules()} layers, "
            f"got {what}. Use strategy='chunked' or 'jacobian' for this target."
        )
    if not problem.rows_spec.decomposes_per_example:
        raise ValueError(
            "jacobian(strategy='batch'): needs rows that each belong to one "
            "example or sum over examples (outputs='features', "
            "'per_example' or 'full'); a callable outputs= may mix "
            "examples. Use strategy='chunked'."
        )
    if problem.layer is not None and problem.projections is None:
        raise ValueError(
            "jacobian(strategy='batch'): the targets must be exactly the "
            "layer's own kernel and bias (an attention layer's: those of its "
            "four projections)."
        )
    precision.refuse_float16_variables(problem, name)
    why = None if rule is None else rule.unsupported()
    if why is not None:
        raise ValueError(
            f"jacobian(strategy='batch'): layer {problem.layer.name!r} is not "
            f"supported: {why}. Use strategy='chunked' or 'jacobian'."
        )
    refusal = _numeric_refusal(problem)
    if refusal is not None:
        raise ValueError(refusal)


_REFUSALS = PerModel("batch: the checks on one forward pass, per problem and examples")


def _numeric_refusal(problem: Problem) -> str | None:
    """The refusal of the checks on one forward pass (``None``: they pass),
    kept per model, targets, rows, training and the checked examples' shapes.

    NOTE (measured, loaded machine). Where the layer is called from Python
    the pass was traced: 2.5-3.0 s of a first clipped sum's 8.3-9.5 s on
    the reductions benchmark's BERT tiny; eagerly (its calls found in the
    eager pass's record) 0.7-2.3 s, in fresh processes alternating. Kept
    here, it runs once per problem: a first ``jk.gram`` asks for it by its
    sizing probe's problem and its chunk's, each by the check of whether
    ``batch`` serves the targets and again before compiling. The verdict does not depend
    on the batch size beyond the :data:`CHECK_EXAMPLES` it reads, nor on
    ``reduce=``."""
    # taken (freed) whether or not it serves
    first = _kept_pass(problem)
    kept = _REFUSALS.of(problem.model)
    batch = problem.batch_size
    key = (
        problem.key.differentiated,
        problem.key.layer,
        tuple(
            (tuple(t.shape[1:]), t.dtype.name) for t in tf.nest.flatten(problem.inputs)
        ),
        None if batch is None else min(batch, CHECK_EXAMPLES),
    )
    if key not in kept:
        if structural_inspect.trusted(problem):
            kept[key] = (None, STRUCTURE)
        else:
            kept[key] = (_checked_refusal(problem, first), NUMERIC)
    refusal: str | None = kept[key][0]
    return refusal


#: how the checks went (:func:`how_checked`): trusted from the model's
#: structure (:func:`jacobkit.problem.structural_inspect.trusted`: the test
#: suite proves what they would), or run on one forward pass
STRUCTURE, NUMERIC = "structure", "numeric"


def how_checked(model: Any) -> tuple[str, ...]:
    """How each of ``model``'s problems so far was checked
    (:data:`STRUCTURE` or :data:`NUMERIC`), in the order checked: what the
    tests read to see which way a first call went."""
    return tuple(how for _, how in _REFUSALS.of(model).values())


def _checked_refusal(problem: Problem, kept: KeptPass | None) -> str | None:
    try:
        checked = _checked_pass(problem, kept)
    except TapError as err:
        return (
            f"jacobian(strategy='batch'): {err}; the batch strategy needs "
            "the layer's input and output at each of its calls. Use "
            "strategy='chunked' or 'jacobian'."
        )
    try:
        _check_closed_form(problem, checked)
    except ValueError as err:
        return str(err)
    wrong = rule_check.refusal(
        problem, checked.rule, checked.autodiff, checked.precision
    )
    if wrong is not None:
        return wrong
    leak = _cross_example_leak(checked)
    if leak > 1e-6:
        return (
            "jacobian(strategy='batch'): the model mixes examples across the "
            f"batch: example 0's outputs depend on other examples' values at "
            f"{_where(problem)} (relative size {leak:.1e}), as "
            "BatchNormalization with training=True does. The batch strategy "
            "assumes independent examples; use strategy='chunked' or "
            "'jacobian'."
        )
    return None


def _where(problem: Problem) -> str:
    """The target layer, or the variables given in its place, in words."""
    if problem.layer is not None:
        return f"layer {problem.layer.name!r}"
    names = list(problem.target_names)
    shown = ", ".join(names[:3]) + (", ..." if len(names) > 3 else "")
    return f"the targets ({shown})"


@dataclass(frozen=True)
class Checked:
    """What the checks read of one forward pass.

    Attributes:
        own: the layer's output at each call, as the layer computes it.
        output: the same as the layer's rule computes it from the call's input.
        firsts: the cotangent at each tap's ``z`` of example 0's rows (with
            random weights): zero at every other example where examples do not
            mix.
        rule: at each tap, what its part's rule gives for random cotangents
            at ``z`` (:func:`.rule_check.against_autodiff`).
        autodiff: the same by autodiff of the rule's ``pre_activation``.
        precision: at each tap, the epsilon of ``z``'s dtype.
    """

    own: list[tf.Tensor]
    output: list[tf.Tensor]
    firsts: list[tf.Tensor]
    rule: list[tf.Tensor]
    autodiff: list[tf.Tensor]
    precision: list[tf.Tensor]


def _checked(problem: Problem, forward: Forward) -> Checked:
    per_example = forward.rows
    batch = int(per_example.shape[0])
    weights = tf.random.stateless_normal(
        per_example.shape[1:], seed=(0, 1), dtype=per_example.dtype
    )
    # Select example 0 with the cotangent, not by slicing: the tape has
    # stopped recording, so a slice of ``per_example`` taken here would have
    # no gradient and the check would always pass.
    only_first = tf.one_hot(0, batch, dtype=per_example.dtype)
    firsts = forward.cotangents(only_first[:, None] * weights[None, :])
    assert forward.own is not None, "a pass for the checks records the layer's own"
    rule: list[tf.Tensor] = []
    autodiff: list[tf.Tensor] = []
    precision: list[tf.Tensor] = []
    parts = projections(problem)
    for tap, part in zip(forward.taps, forward.parts):
        if tap.z.shape.is_fully_defined() and rule_check.checked(parts[part].rule):
            by_rule, by_autodiff = rule_check.against_autodiff(
                problem, parts[part], tap, CHECK_EXAMPLES
            )
            rule.append(by_rule)
            autodiff.append(by_autodiff)
            precision.append(tf.constant(rule_check.epsilon(tap.z.dtype)))
    return Checked(
        list(forward.own),
        list(forward.output),
        list(firsts),
        rule,
        autodiff,
        precision,
    )


def _checked_pass(problem: Problem, kept: KeptPass | None = None) -> Checked:
    """One forward pass that serves both checks (each took 0.13 s of a 2 s
    first call on the MLP 512-1024-1024-144), on the first
    :data:`CHECK_EXAMPLES` examples where the model runs on fewer than its
    batch (else on all of them), eager: the layer tapped at its node where
    it is one of a functional graph, elsewhere its calls found in the eager
    pass's record (:func:`jacobkit.keras.calls.eager_layer_calls`), or in a
    traced pass where the record cannot tell them for sure. ``kept``: the
    eager inspecting pass on the same examples, whose record serves where
    the layer's calls are read from one (:func:`_kept_pass`)."""
    traced = not node_tap(problem)

    def values(inputs: Any, kept: KeptPass | None = None) -> tuple[list[Any], ...]:
        forward = tapped_forward(problem, inputs, check=True, kept=kept)
        found = _checked(problem, forward)
        return (
            found.own,
            found.output,
            found.firsts,
            found.rule,
            found.autodiff,
            found.precision,
        )

    def run(inputs: Any) -> Checked:
        if traced and kept is not None:
            try:  # the calls found in the eager inspecting pass's record
                return Checked(*(list(v) for v in values(kept.inputs, kept)))
            except layer_calls.Unavailable:
                pass
        if traced:
            try:  # the layer's calls found in an eager pass's record
                return Checked(*(list(v) for v in values(inputs)))
            except layer_calls.Unavailable:
                pass
        # (a tf.function returns nests of tensors: the record is made outside)
        compute = problem.function(values) if traced else values
        return Checked(*(list(v) for v in compute(inputs)))

    batch = problem.batch_size
    if batch is not None and batch > CHECK_EXAMPLES:
        first = tf.nest.map_structure(lambda t: t[:CHECK_EXAMPLES], problem.inputs)
        try:
            return run(first)
        except (ValueError, TypeError, tf.errors.OpError) as err:
            if isinstance(err, TapError):
                raise
            # a model bound to its batch size: checked on all of it
    return run(problem.inputs)


def _kept_pass(problem: Problem) -> KeptPass | None:
    """The eager inspecting pass kept for these checks
    (:class:`~jacobkit.problem.eager_inspect.KeptPass`), where it ran on the
    examples they read: the first ``min(B, CHECK_EXAMPLES)`` of inputs of
    these shapes and dtypes (``None``: the checks run their own pass)."""
    kept = None if problem.kept_pass is None else problem.kept_pass.take()
    batch = problem.batch_size
    if kept is None or batch is None:
        return None
    ran = tf.nest.flatten(kept.inputs)
    mine = tf.nest.flatten(problem.inputs)
    if len(ran) != len(mine) or any(
        int(a.shape[0]) != min(batch, CHECK_EXAMPLES)
        or a.shape[1:] != b.shape[1:]
        or a.dtype != b.dtype
        for a, b in zip(ran, mine)
    ):
        return None
    return kept


def _check_closed_form(problem: Problem, checked: Checked) -> None:
    """Refuse a layer whose output is not what its rule computes beside it
    (``activation(linear(x))``, or an attention layer's projections and
    attention), at every call."""
    for own, output in zip(checked.own, checked.output):
        # float32 rounding of the same operations differs by < 1e-6 relative;
        # a float16/bfloat16 layer (mixed precision) rounds its own output to
        # a few of its epsilons, against ``z`` computed in float32
        allowed = 1e-4 if own.dtype.size >= 4 else 16 * _EPSILON[own.dtype]
        own = tf.cast(own, output.dtype)
        scale = float(tf.reduce_max(tf.abs(own))) + 1e-30
        if float(tf.reduce_max(tf.abs(output - own))) > allowed * scale:
            layer = problem.layer
            named = (
                "a target layer"  # several layers' calls in the traced pass
                if layer is None
                else f"layer {layer.name!r} ({type(layer).__name__})"
            )
            raise ValueError(
                f"jacobian(strategy='batch'): {named} computes more than "
                "activation(x @ kernel + bias) (or a convolution, or attention "
                "over its projections): its output differs from that closed "
                "form. Use strategy='chunked' or 'jacobian'."
            )


def _cross_example_leak(checked: Checked) -> float:
    """How much example 0's rows depend on other examples at the layer's parts'
    outputs (0 when examples are independent; exactly 0 up to rounding)."""
    firsts = [f for f in checked.firsts if f.shape[0] is not None and f.shape[0] > 1]
    if not firsts:
        return 0.0
    total = max(float(tf.reduce_max(tf.abs(f))) for f in firsts) + 1e-30
    return max(float(tf.reduce_max(tf.abs(f[1:]))) for f in firsts) / total
