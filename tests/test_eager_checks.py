"""``batch``'s checks before its first run, where the target layers are called
from Python (no graph node): their calls are found in an eager pass's record
(:func:`jacobkit.keras.calls.eager_layer_calls`), as they are in a traced pass
(:func:`jacobkit.keras.calls.layer_calls`), and the checks pass eagerly."""

from __future__ import annotations

import keras
import numpy as np
import pytest
import tensorflow as tf

import jacobkit as jk
from jacobkit import testing
from jacobkit.keras import calls
from jacobkit.problem import structural_inspect
from jacobkit.strategies.batch import checks

RNG = np.random.default_rng(7)


class Twice(keras.Model):
    """A subclassed model calling one Dense twice back to back, then a head:
    the two calls' ops are consecutive under one name (eagerly, no ``_1``)."""

    kind: type = keras.layers.Dense

    def __init__(self) -> None:
        super().__init__()
        self.shared = self.kind(4, activation="tanh", name="shared")
        self.head = keras.layers.Dense(2, name="head")

    def call(self, x):
        return self.head(self.shared(self.shared(x)))


def twice() -> tuple[keras.Model, np.ndarray]:
    model = Twice()
    x = RNG.normal(size=(5, 4)).astype("float32")
    model(x)
    return model, tf.constant(x)


def test_eager_record_finds_the_calls_the_traced_pass_finds():
    """Back-to-back calls of one layer are two calls in both, with the same
    input and output values."""
    model, x = twice()
    layer = model.shared
    record = calls.Record()
    with record:
        model(x)
    eager = calls.eager_layer_calls(record, layer, layer.weights, x)

    found = []

    @tf.function
    def traced(inputs):
        out = model(inputs)
        graph = tf.compat.v1.get_default_graph()
        found.extend(calls.layer_calls(graph, layer, layer.weights))
        return [out] + [t for c in found for t in (*c.inputs, _made(c))]

    values = traced(x)[1:]
    assert len(eager) == len(found) == 2
    flat = [t for c in eager for t in (*c.inputs, _made(c))]
    assert len(flat) == len(values)
    for mine, theirs in zip(flat, values):
        # the same ops on the same values, eagerly and in a graph (where
        # grappler may fuse them): measured 6e-8 alone, 1.2e-7 (two float32
        # ulps at the arrays' magnitude of about 0.7) after other test files
        # in the same process; an element near cancellation fails rtol alone
        np.testing.assert_allclose(mine, theirs, rtol=1e-6, atol=5e-7)


def _made(call: calls.LayerCall) -> tf.Tensor:
    """The floating tensor a call gave out last (what ``batch`` reads)."""
    return [t for t in call.outputs if t.dtype.is_floating][-1]


def test_the_checks_of_a_layer_called_from_python_pass_eagerly(monkeypatch):
    """No ``tf.function`` is built for the checks; the result is the float64
    reference's."""
    model, x = twice()
    built = []
    original = jk.problem.Problem.function

    def counted(self, fn):
        built.append(fn)
        return original(self, fn)

    monkeypatch.setattr(jk.problem.Problem, "function", counted)
    problem_checks = []
    checked = checks._checked_pass

    def spy(problem, *kept):
        before = len(built)
        found = checked(problem, *kept)
        problem_checks.append(len(built) - before)
        return found

    monkeypatch.setattr(checks, "_checked_pass", spy)
    result = jk.jacobian(
        model, x, model.trainable_variables, outputs="per_example", strategy="batch"
    )
    assert problem_checks and not any(problem_checks)
    reference = testing.float64_reference(
        model, x, model.trainable_variables, outputs="per_example"
    )
    for got, want in zip(result.jacobians.values(), reference):
        # float32 against float64: measured 1.6e-7
        assert testing.max_relative_difference(got, want) < 1e-5


class _Shifted(keras.layers.Dense):
    """A Dense shifted by one inside its own call: off its closed form."""

    def call(self, inputs):
        return super().call(inputs) + 1.0


class ShiftedTwice(Twice):
    kind = _Shifted


def test_the_eager_checks_refuse_a_layer_off_its_closed_form():
    model = ShiftedTwice()
    x = tf.constant(RNG.normal(size=(5, 4)).astype("float32"))
    model(x)
    with pytest.raises(ValueError, match="a target layer.* computes more than"):
        jk.jacobian(
            model, x, model.trainable_variables, outputs="per_example", strategy="batch"
        )


# -- the eager inspecting pass serves the checks --------------------------------


def _stack(mixing: bool = False) -> keras.Model:
    """Keras's own layers (so a reduced call's inspection runs eagerly);
    ``mixing``: a unit normalization over the batch axis between them,
    which makes every example's output depend on the others'."""
    inputs = keras.Input((4,))
    h = keras.layers.Dense(6, activation="tanh", name="hidden")(inputs)
    if mixing:
        h = keras.layers.UnitNormalization(axis=0)(h)
    return keras.Model(inputs, keras.layers.Dense(3, name="head")(h))


def _passes(monkeypatch) -> tuple[list[int], list[bool]]:
    """The examples of each model call of a problem, and whether each eager
    check read the inspecting pass's record (kept) or ran its own."""
    from jacobkit.strategies.batch import forward

    examples: list[int] = []
    kept: list[bool] = []
    call_model = jk.problem.Problem.call_model
    traced_forward = forward._traced_forward

    def counted(self, inputs, hook=None):
        if tf.executing_eagerly():
            examples.append(int(tf.nest.flatten(inputs)[0].shape[0]))
        return call_model(self, inputs, hook)

    def spied(problem, inputs, check, kept_pass=None):
        if check:
            kept.append(kept_pass is not None)
        return traced_forward(problem, inputs, check, kept_pass)

    monkeypatch.setattr(jk.problem.Problem, "call_model", counted)
    monkeypatch.setattr(forward, "_traced_forward", spied)
    return examples, kept


def test_a_reduced_first_call_runs_the_two_example_pass_once(monkeypatch):
    """The checks read the inspecting pass on two examples: eagerly, the
    model runs on two and three examples once each (the checks' own pass on
    two examples is gone), and the rows' gradient norms are the float64
    reference's. (Where the model's structure tells the inspection and
    vouches for the checks, as it does here, no eager pass runs at all:
    :func:`test_the_structure_runs_no_eager_pass`; made unable here.)"""
    model = _stack()
    x = RNG.normal(size=(8, 4)).astype("float32")
    monkeypatch.setattr(structural_inspect, "inspection", lambda problem: None)
    monkeypatch.setattr(structural_inspect, "trusted", lambda problem: False)
    examples, kept = _passes(monkeypatch)
    variables = model.trainable_variables
    found = jk.jacobian(
        model, x, variables, outputs="per_example", reduce="norm", strategy="batch"
    )
    assert kept == [True]
    assert sorted(examples) == [2, 3]
    reference = testing.float64_reference(model, x, variables, outputs="per_example")
    for got, want in zip(found.values(), reference, strict=True):
        # each target's gradient norm per row; float32 against float64:
        # measured 1.2e-7
        expected = np.linalg.norm(np.reshape(want, (8, 3, -1)), axis=2)
        assert testing.max_relative_difference(got, expected) < 1e-5


def test_the_structure_runs_no_eager_pass(monkeypatch):
    """A stock model in inference mode: the inspection read from its
    structure, the checks trusted (:mod:`jacobkit.problem.
    structural_inspect`): the model never runs eagerly, and the norms are
    the float64 reference's."""
    model = _stack()
    x = RNG.normal(size=(8, 4)).astype("float32")
    examples, kept = _passes(monkeypatch)
    variables = model.trainable_variables
    found = jk.jacobian(
        model, x, variables, outputs="per_example", reduce="norm", strategy="batch"
    )
    assert examples == [] and kept == []
    reference = testing.float64_reference(model, x, variables, outputs="per_example")
    for got, want in zip(found.values(), reference, strict=True):
        # float32 against float64, as above: measured 1.2e-7
        expected = np.linalg.norm(np.reshape(want, (8, 3, -1)), axis=2)
        assert testing.max_relative_difference(got, expected) < 1e-5


def test_the_kept_pass_refuses_a_model_mixing_examples(monkeypatch):
    """A unit normalization over the batch mixes examples: refused in the
    same words on the inspecting pass's record as on the checks' own."""
    model = _stack(mixing=True)
    x = tf.constant(RNG.normal(size=(8, 4)).astype("float32"))
    examples, kept = _passes(monkeypatch)
    with pytest.raises(ValueError, match="mixes examples across the batch"):
        jk.jacobian(
            model,
            x,
            model.trainable_variables,
            outputs="per_example",
            reduce="norm",
            strategy="batch",
        )
    assert kept == [True]


def test_an_unreduced_call_runs_the_checks_own_pass(monkeypatch):
    """No eager inspection without ``reduce=``: nothing kept, the checks
    run their own pass on two examples (where the structure does not vouch
    for them: made unable here, as a user's rule would)."""
    model = _stack()
    x = tf.constant(RNG.normal(size=(8, 4)).astype("float32"))
    monkeypatch.setattr(structural_inspect, "trusted", lambda problem: False)
    examples, kept = _passes(monkeypatch)
    jk.jacobian(
        model, x, model.trainable_variables, outputs="per_example", strategy="batch"
    )
    assert kept == [False]
    assert examples == [2]
