"""Every strategy under ``mixed_float16`` and ``mixed_bfloat16``, and on models
whose layers are float16 or bfloat16, against the float64 reference.

Each strategy either stays within 2x of the ``loop``'s own error (the
accuracy users get from a tape loop at that precision) and within the
measured :data:`jacobkit.testing.TOLERANCE` of the policy, or refuses with
jacobkit's message (see :mod:`jacobkit.precision`).

The models are copies of the float32 examples made by
:func:`jacobkit.testing.cast_copy`, built while the global policy is set
(the fixture restores ``float32`` afterwards, so other tests are unaffected);
the reference is the float64 loop on :func:`jacobkit.testing.float64_copy`
of the model under test (same weights: under mixed precision the variables
are float32).
"""

from __future__ import annotations

import functools

import keras
import pytest
import tensorflow as tf

import jacobkit as jk
from jacobkit import testing
from jacobkit.problem import Problem
from tests.cases import (
    STRATEGIES,
    STRUCTURED_REFUSES,
    call_kwargs,
    example,
    structured_refuses,
)

POLICIES = ["mixed_float16", "mixed_bfloat16"]
#: each registered strategy once, with its default options
REGISTERED = [c for c in STRATEGIES if c.id in jk.strategies.REGISTRY]
LAYER_DTYPES = ["float16", "bfloat16"]
#: a Conv1D stack, a Conv2D model and a Dense MLP
PROBLEMS = ["generator", "cnn2d", "mlp"]
OUTPUTS = ["features", "per_example"]
#: one rounding of the compute dtype (unit roundoff): where the loop happens
#: to be exact, a strategy may still be this far from the reference
UNIT_ROUNDOFF = {"float16": 2.0**-11, "bfloat16": 2.0**-8}


def _compute_dtype(precision: str) -> str:
    return precision.removeprefix("mixed_")


@pytest.fixture
def policy(request):
    """Set the global policy for one test; restore the previous one after."""
    previous = keras.mixed_precision.global_policy()
    keras.mixed_precision.set_global_policy(request.param)
    try:
        yield request.param
    finally:
        keras.mixed_precision.set_global_policy(previous)


@functools.cache
def _model(problem: str, precision: str):
    """The example's model in ``precision`` (a policy or a dtype)."""
    return testing.cast_copy(example(problem).model, precision)


@functools.cache
def _reference(problem: str, precision: str, outputs: str) -> testing.Reference:
    model = _model(problem, precision)
    layer = model.get_layer(example(problem).layer)
    return testing.float64_reference(
        model,
        example(problem).inputs,
        [layer.kernel, layer.bias],
        outputs=outputs,
        call_kwargs=call_kwargs(model),
    )


@functools.cache
def _loop_errors(problem: str, precision: str, outputs: str) -> tuple[float, ...]:
    """The ``loop`` strategy's error per target: the accuracy to keep."""
    result = jk.jacobian(
        _model(problem, precision),
        example(problem).inputs,
        example(problem).layer,
        strategy="loop",
        outputs=outputs,
    )
    reference = _reference(problem, precision, outputs)
    return tuple(
        testing.max_relative_difference(a, e)
        for a, e in zip(result.jacobians.values(), reference, strict=True)
    )


def _refusal(name: str, precision: str) -> str | None:
    """The start of the message where a strategy must refuse, else None."""
    if _compute_dtype(precision) != "float16":
        return None
    if name in ("jacobian", "chunked"):
        return "computes in float16"
    if name == "batch" and precision == "float16":
        return "stores its variables in float16"
    return None


def _check(case, problem: str, precision: str, outputs: str) -> None:
    ex = example(problem)
    model = _model(problem, precision)
    reference = _reference(problem, precision, outputs)
    strategy = case.make(Problem(model, ex.inputs, ex.layer, outputs=outputs).num_rows)
    call = dict(strategy=strategy, outputs=outputs)
    refusal = _refusal(strategy.name, precision)
    if strategy.name == "structured" and structured_refuses(problem, outputs):
        refusal = STRUCTURED_REFUSES  # no shortcut in these models
    if refusal:
        with pytest.raises(ValueError, match=f"strategy='{strategy.name}'.*{refusal}"):
            jk.jacobian(model, ex.inputs, ex.layer, **call)
        return
    result = jk.jacobian(model, ex.inputs, ex.layer, **call)
    variables = model.get_layer(ex.layer).weights
    assert [j.dtype for j in result.jacobians.values()] == [
        tf.as_dtype(v.dtype) for v in variables
    ]
    if not (strategy.name == "loop" and _compute_dtype(precision) == "bfloat16"):
        # the measured bound of this precision (the eager loop under bfloat16
        # is the exception, see testing.TOLERANCE)
        testing.assert_close(result, list(reference), precision=precision)
    floor = UNIT_ROUNDOFF[_compute_dtype(precision)]
    loop = _loop_errors(problem, precision, outputs)
    for name, jac, ref, loop_error in zip(
        result.jacobians, result.jacobians.values(), reference, loop, strict=True
    ):
        error = testing.max_relative_difference(jac, ref)
        assert error <= max(2 * loop_error, floor), (name, error, loop_error)


@pytest.mark.parametrize("outputs", OUTPUTS)
@pytest.mark.parametrize("problem", PROBLEMS)
@pytest.mark.parametrize("policy", POLICIES, indirect=True)
@pytest.mark.parametrize("case", STRATEGIES, ids=lambda c: c.id)
def test_mixed_policy_agrees_with_float64(case, policy, problem, outputs):
    _check(case, problem, policy, outputs)


@pytest.mark.parametrize("problem", PROBLEMS)
@pytest.mark.parametrize("dtype", LAYER_DTYPES)
@pytest.mark.parametrize("case", REGISTERED, ids=lambda c: c.id)
def test_low_precision_layers_agree_with_float64(case, dtype, problem):
    _check(case, problem, dtype, "features")


@pytest.mark.parametrize("policy", POLICIES, indirect=True)
def test_auto_picks_an_accurate_strategy(policy):
    """Under mixed_float16, auto never settles on a strategy that refuses
    (it drops a candidate whose check raises, with the reason)."""
    ex = example("cnn2d")
    model = _model("cnn2d", policy)
    reference = _reference("cnn2d", policy, "features")
    for _ in range(4):  # auto tries its candidates over the first calls
        result = jk.jacobian(model, ex.inputs, ex.layer, cache=False)
        testing.assert_close(result, list(reference), precision=policy)
        if policy == "mixed_float16":
            assert result.strategy not in ("jacobian", "chunked")
    for rejection in result.plan.rejected:
        if policy == "mixed_float16" and rejection.label.startswith("chunked"):
            assert "computes in float16" in rejection.reason, rejection


@pytest.mark.parametrize("problem", ["cnn2d", "tf_keras"])
def test_variables_of_a_float16_layer_are_refused_too(problem):
    """A list of variables is judged by the layer that owns them."""
    ex = example(problem)
    model = _model(problem, "mixed_float16")
    layer = model.get_layer(ex.layer)
    with pytest.raises(ValueError, match="the target computes in float16"):
        jk.jacobian(model, ex.inputs, [layer.kernel, layer.bias], strategy="chunked")


def test_the_policy_is_restored():
    """The fixture above leaves the global policy as it found it."""
    assert keras.mixed_precision.global_policy().name == "float32"
