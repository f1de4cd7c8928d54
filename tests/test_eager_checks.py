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

    def spy(problem):
        before = len(built)
        found = checked(problem)
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
