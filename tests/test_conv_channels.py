"""One-channel rows at a convolution's output (:mod:`jacobkit.problem.
conv_channels`): a linear head's rows, one channel each of the convolution
before it, taken to that convolution's input by one small convolution each.
Exact where it applies (against the float64 reference), and not used where
it does not (the rows then run as before, and are still exact)."""

from __future__ import annotations

import functools
import re

import keras
import numpy as np
import pytest
import tensorflow as tf

import jacobkit as jk
from jacobkit import testing
from jacobkit.problem import structure
from jacobkit.problem.call import Call
from jacobkit.strategies import conv_channels
from jacobkit.testing import examples
from jacobkit.testing.example import randomize_weights

# float64 models against the float64 reference: measured at most 9.9e-16
# relative to the largest entry (the same products summed in another order);
# the tolerance, 1e-13, is ~100x that.
TOLERANCE = 1e-13

S = jk.strategies
INNER = [S.While(), S.While(1), S.Chunked(3), S.Jacobian()]


@pytest.fixture
def taken(monkeypatch):
    """How many times the step's computation was built."""
    count = []
    own = conv_channels.rows_fn

    def counted(*args):
        count.append(args)
        return own(*args)

    monkeypatch.setattr(conv_channels, "rows_fn", counted)
    return count


@functools.cache
def _generator():
    return examples.generator(
        "float64", batch=3, sequence=9, channels=4, filters=6, filters3=5, features=12
    )


def _conv2d_model(
    padding="same",
    activation="relu",
    window=(3, 3),
    strides=1,
    dilation=1,
    filters=5,
    features=11,
    dtype="float64",
):
    """Conv2D(relu, target "conv1") -> Conv2D("conv3", the given settings)
    -> Dense(features) on (2, 7, 6, 3)."""
    x = keras.Input((7, 6, 3), dtype=dtype)
    h = keras.layers.Conv2D(
        4, 3, padding="same", activation="relu", name="conv1", dtype=dtype
    )(x)
    h = keras.layers.Conv2D(
        filters,
        window,
        strides=strides,
        dilation_rate=dilation,
        padding=padding,
        activation=activation,
        name="conv3",
        dtype=dtype,
    )(h)
    y = keras.layers.Dense(features, name="head", dtype=dtype)(h)
    model = keras.Model(x, y)
    randomize_weights(model, 3)
    inputs = np.random.default_rng(4).normal(size=(2, 7, 6, 3)).astype(dtype)
    return model, inputs


def _conv1d_model(padding, window, activation="tanh"):
    """Conv1D("conv1") -> Conv1D("conv3") -> Dense(9) on (2, 8, 3)."""
    x = keras.Input((8, 3), dtype="float64")
    h = keras.layers.Conv1D(4, 3, padding="same", name="conv1", dtype="float64")(x)
    h = keras.layers.Conv1D(
        5,
        window,
        padding=padding,
        activation=activation,
        name="conv3",
        dtype="float64",
    )(h)
    y = keras.layers.Dense(9, name="head", dtype="float64")(h)
    model = keras.Model(x, y)
    randomize_weights(model, 5)
    return model, np.random.default_rng(6).normal(size=(2, 8, 3))


def _check(model, inputs, strategy, layer="conv1", **kwargs):
    target = model.get_layer(layer)
    reference = testing.reference_jacobian(
        model, inputs, [target.kernel, target.bias], **kwargs
    )
    result = jk.jacobian(model, inputs, layer, strategy=strategy, **kwargs)
    return testing.assert_close(result, reference, tolerance=TOLERANCE)


@pytest.mark.parametrize("inner", INNER, ids=lambda s: s.label)
def test_the_generator_through_the_step(taken, inner):
    ex = _generator()
    _check(ex.model, ex.inputs, S.Structured(inner))
    assert len(taken) == 1


def test_a_features_subset(taken):
    ex = _generator()
    _check(ex.model, ex.inputs, S.Structured("while"), features=[11, 0, 4, 4, 7, 2, 9])
    assert len(taken) == 1


@pytest.mark.parametrize("padding", ["same", "valid"])
@pytest.mark.parametrize("activation", ["relu", "linear"])
@pytest.mark.parametrize("window", [(3, 3), (2, 3), (1, 4)])
def test_conv2d_same_and_valid(taken, padding, activation, window):
    model, inputs = _conv2d_model(padding, activation, window)
    for inner in (S.While(), S.Chunked(2)):
        _check(model, inputs, S.Structured(inner))
    assert len(taken) == 2


@pytest.mark.parametrize("padding", ["same", "valid", "causal"])
@pytest.mark.parametrize("window", [1, 2, 3, 4])
def test_conv1d_paddings_and_windows(taken, padding, window):
    model, inputs = _conv1d_model(padding, window)
    _check(model, inputs, S.Structured("while"))
    assert len(taken) == 1


@pytest.mark.parametrize("windows", [True, False], ids=["windows", "depthwise"])
def test_both_ways_of_the_cotangents(taken, monkeypatch, windows):
    """The one-channel cotangents as the shifted windows' product (oneDNN
    off's way) and as a depthwise convolution (oneDNN on's), each forced on
    either kind: the float64 reference to :data:`TOLERANCE` (measured: at
    most 5.3e-16 relative either way), rows in a loop and in chunks, on
    2-D windows, a causal Conv1D and the generator (fresh models: each traces
    its own way)."""
    from jacobkit.problem import conv_channels as found

    calls = []
    own = found.windows_product
    monkeypatch.setattr(
        found, "windows_product", lambda *sizes: calls.append(own(*sizes)) or windows
    )
    for window in [(3, 3), (2, 3)]:
        for padding in ["same", "valid"]:
            model, inputs = _conv2d_model(padding, "relu", window)
            for inner in (S.While(), S.Chunked(2)):
                _check(model, inputs, S.Structured(inner))
    model, inputs = _conv1d_model("causal", 4)
    _check(model, inputs, S.Structured("while"))
    ex = examples.generator(
        "float64", batch=3, sequence=9, channels=4, filters=6, filters3=5, features=12
    )
    for inner in (S.While(), S.Chunked(3)):
        _check(ex.model, ex.inputs, S.Structured(inner))
    assert len(taken) == 11 and len(calls) >= 11


def test_the_default_call_uses_it_and_the_plan_says_so(taken):
    ex = _generator()
    result = jk.jacobian(ex.model, ex.inputs, "conv1")
    assert result.strategy == "structured"
    assert "5 one-channel cotangents at 'conv3' taken to its input" in str(
        result.plan
    ), str(result.plan)
    assert taken
    conv1 = ex.model.get_layer("conv1")
    reference = testing.reference_jacobian(
        ex.model, ex.inputs, [conv1.kernel, conv1.bias]
    )
    testing.assert_close(result, reference, tolerance=TOLERANCE)


def _reason(model, inputs, layer="conv1", **kwargs):
    problem = Call(model, layer, **kwargs).problem(tf.constant(inputs))
    head = structure.find(problem)
    sub = head.sub_problem.with_inputs(problem.inputs)
    with pytest.raises(structure.NotApplicable) as refused:
        structure.find_conv_channels(sub)
    return str(refused.value)


@pytest.mark.parametrize(
    "build, layer, kwargs, why",
    [
        (_generator, "conv3", {}, "the targets include 'conv3''s own variables"),
        (_generator, "conv1", {"outputs": "per_example"}, "not 'features'"),
        (lambda: _conv2d_model(strides=2), "conv1", {}, r"strides \(2, 2\), not 1"),
        (lambda: _conv2d_model(dilation=2), "conv1", {}, r"dilation \(2, 2\), not 1"),
        (
            lambda: _conv2d_model(activation="softmax"),
            "conv1",
            {},
            "activation 'softmax' is not elementwise",
        ),
    ],
)
def test_where_it_does_not_apply(taken, build, layer, kwargs, why):
    """Refused with the reason, and the rows run as before, exactly."""
    built = build()
    model, inputs = (built.model, built.inputs) if hasattr(built, "model") else built
    message = _reason(model, inputs, layer, **kwargs)
    assert re.search(why, message), message
    _check(model, inputs, S.Structured("while"), layer, **kwargs)
    assert not taken


@pytest.mark.parametrize("inner", [S.Batch(), S.Forward()], ids=lambda s: s.label)
def test_inner_strategies_it_does_not_reproduce_run_as_before(taken, inner):
    ex = _generator()
    _check(ex.model, ex.inputs, S.Structured(inner))
    assert not taken


def test_never_touches_the_users_model():
    ex = _generator()
    model = ex.model
    before = [np.array(v) for v in model.weights]
    nodes = {layer.name: len(layer._inbound_nodes) for layer in model.layers}
    jk.jacobian(model, ex.inputs, "conv1", strategy=S.Structured("while"))
    assert all(np.array_equal(a, np.array(v)) for a, v in zip(before, model.weights))
    assert nodes == {layer.name: len(layer._inbound_nodes) for layer in model.layers}
