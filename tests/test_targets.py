"""``jk.Inputs()`` and ``jk.Output(layer)`` targets: every registered strategy
× every tensor-target problem × every ``outputs`` mode against the float64
reference, result names and shapes, and the errors."""

from __future__ import annotations

import numpy as np
import pytest
import tensorflow as tf

import jacobkit as jk
from jacobkit import planner, testing
from tests.cases import OUTPUTS, TARGETS, example, tensor_reference


@pytest.mark.parametrize("outputs", list(OUTPUTS))
@pytest.mark.parametrize(
    "index", range(len(TARGETS)), ids=[f"{c.problem}-{c.id}" for c in TARGETS]
)
@pytest.mark.parametrize("strategy", list(jk.strategies.REGISTRY))
def test_agrees_with_float64_reference(strategy, index, outputs):
    case = TARGETS[index]
    ex = example(case.problem)
    call = dict(strategy=strategy, outputs=OUTPUTS[outputs])
    refusals = {"batch": "differentiates a Dense or Conv", "structured": "not Inputs"}
    if strategy in refusals:
        with pytest.raises(ValueError, match=refusals[strategy]):
            jk.jacobian(ex.model, ex.inputs, case.target, **call)
        return
    result = jk.jacobian(ex.model, ex.inputs, case.target, **call)
    expected = tensor_reference(index, outputs)
    assert len(result) == 1
    assert tuple(result[0].shape) == expected.shape
    # measured over this product: at most 3.4e-7 relative (forward, residual
    # Output(conv_a), callable rows), median 1.2e-7; default float32 1e-5
    testing.assert_close(result, [expected])


def test_per_example_blocks_have_shape_b_f_then_the_input():
    ex = example("generator")
    batch, sequence, channels = ex.inputs.shape
    res = jk.jacobian(ex.model, ex.inputs, jk.Inputs(), outputs="per_example")
    assert list(res) == ["inputs"]
    assert res.rows_shape == (batch, 5)
    assert tuple(res["inputs"].shape) == (batch, 5, sequence, channels)
    act = jk.jacobian(
        ex.model, ex.inputs, jk.Output("conv3"), outputs="per_example", strategy="loop"
    )
    assert list(act) == ["conv3/output"]
    assert tuple(act[0].shape) == (batch, 5, sequence, 6)


def test_names_of_every_input_of_a_multi_input_model():
    ex = example("multi_input")
    res = jk.jacobian(ex.model, ex.inputs, jk.Inputs(), strategy="chunked")
    assert list(res) == ["inputs/a", "inputs/b"]
    by_name = jk.jacobian(ex.model, ex.inputs, jk.Inputs("b"), strategy="chunked")
    by_index = jk.jacobian(ex.model, ex.inputs, jk.Inputs(1), strategy="chunked")
    assert list(by_name) == list(by_index) == ["inputs/b"]
    np.testing.assert_array_equal(res["inputs/b"], by_name[0])
    np.testing.assert_array_equal(by_index[0], by_name[0])


def test_a_variable_input_and_a_tensor_input_give_the_same_jacobian():
    """USERS.md case 4: a function called with a tf.Tensor or a tf.Variable."""

    def f(x):
        return tf.tanh(x[:, :3] * x[:, 1:])

    x = np.random.default_rng(0).normal(size=(3, 4))
    expected = testing.reference_tensor_jacobian(f, x, outputs="per_example")
    for value in (tf.constant(x, tf.float32), tf.Variable(x, dtype=tf.float32)):
        res = jk.jacobian(f, value, jk.Inputs(), outputs="per_example")
        testing.assert_close(res, [expected])


def test_the_model_gains_no_graph_nodes():
    """A sub-model from an intermediate tensor would append cloned nodes to
    the user's downstream layers; the tap leaves them as they are."""
    ex = example("generator")
    before = {layer.name: len(layer._inbound_nodes) for layer in ex.model.layers}
    jk.jacobian(ex.model, ex.inputs, jk.Output("conv1"), strategy="chunked")
    jk.jacobian(ex.model, ex.inputs, "conv2", strategy="batch")
    after = {layer.name: len(layer._inbound_nodes) for layer in ex.model.layers}
    assert after == before


def test_unknown_input_name():
    ex = example("multi_input")
    with pytest.raises(ValueError) as err:
        jk.jacobian(ex.model, ex.inputs, jk.Inputs("c"))
    assert str(err.value) == (
        "jacobian(layer=Inputs('c')): the model has no input 'c'; its inputs "
        "are ['a', 'b']. Pass one of those names, a position, or Inputs() for "
        "all of them."
    )


def test_output_of_a_shared_layer_is_refused():
    ex = example("shared_layer")
    with pytest.raises(ValueError, match=r"Output\('shared'\)\): layer 'shared' runs"):
        jk.jacobian(ex.model, ex.inputs, jk.Output("shared"))


def test_output_in_a_subclassed_model_is_refused():
    ex = example("subclassed")
    with pytest.raises(ValueError, match="not from a functional graph"):
        jk.jacobian(ex.model, ex.inputs, jk.Output("inner"))


def test_integer_input_is_refused():
    def f(x):
        return tf.cast(x, tf.float32) * 2.0

    with pytest.raises(TypeError, match=r"Inputs\(None\)\): input\(s\) \['0'\]"):
        jk.jacobian(f, np.ones((2, 3), "int32"), jk.Inputs())


def test_per_example_blocks_refused_when_examples_mix():
    import keras

    x = keras.Input((4,))
    h = keras.layers.BatchNormalization(name="bn")(keras.layers.Dense(3)(x))
    model = keras.Model(x, keras.layers.Dense(2)(h))
    inputs = np.random.default_rng(0).normal(size=(5, 4)).astype("float32")
    with pytest.raises(ValueError, match="mixes examples across the batch"):
        jk.jacobian(model, inputs, jk.Inputs(), outputs="per_example", training=True)
    # the full Jacobian over the batch is the way out, and is right
    res = jk.jacobian(model, inputs, jk.Inputs(), outputs=lambda y: y, training=True)
    expected = testing.reference_tensor_jacobian(
        lambda v: model(v, training=True),
        inputs.astype("float64"),
        outputs=lambda y: y,
    )
    testing.assert_close(res, [expected], tolerance=1e-4)


@pytest.mark.parametrize("target", ["output", "inputs"])
@pytest.mark.parametrize("strategy", ["auto", "while"])
def test_a_repeated_call_traces_the_model_no_more(target, strategy):
    # A layer that counts how often Python runs its call: once per trace (a
    # compiled call runs the graph, not the Python). After the first calls
    # (auto may trace a second strategy on its second), the same call must not
    # trace the model again: before, Output() traced it once per call to find
    # the layer's output shape (0.65 s a call on MobileNetV2).
    import keras

    class Counting(keras.layers.Layer):
        runs = 0

        def call(self, x):
            Counting.runs += 1
            return x

    inp = keras.Input((6,))
    h = keras.layers.Dense(8, activation="tanh", name="hidden")(Counting()(inp))
    model = keras.Model(inp, keras.layers.Dense(3, name="head")(h))
    x = np.random.default_rng(0).normal(size=(4, 6)).astype("float32")
    layer = jk.Output("hidden") if target == "output" else jk.Inputs()

    def call():
        return jk.jacobian(
            model, x, layer, strategy=strategy, outputs="per_example", cache=False
        )

    # few rows start auto on the eager loop, which runs the model's Python
    # on every call by design (Policy.eager_rows): off here. auto traces each
    # candidate it tries, and tries one once its time spent outweighs the
    # candidate's tracing (Policy.rent), which depends on the machine's
    # speed: 4 calls did not always settle it (a trace on the 6th). rent=0
    # tries them on the next calls, and the count starts once nothing is
    # left to try.
    def settled(result) -> bool:
        return result.plan is None or result.plan.settled  # (a fixed strategy)

    with planner.use_policy(eager_rows=0, rent=0.0):
        for _ in range(12):
            if settled(call()):
                break
        assert settled(call())
        before = Counting.runs
        for _ in range(3):
            res = call()
    assert Counting.runs == before
    # and the result is still right: the eager loop of tape.gradient, which
    # traces nothing (float32 against float32: within 1e-5, measured 2e-7)
    loop = jk.jacobian(model, x, layer, strategy="loop", outputs="per_example")
    np.testing.assert_allclose(
        np.asarray(res[0]), np.asarray(loop[0]), rtol=1e-5, atol=1e-6
    )


@pytest.fixture
def mixed_float16():
    import keras

    keras.mixed_precision.set_global_policy("mixed_float16")
    yield
    keras.mixed_precision.set_global_policy("float32")


@pytest.mark.parametrize("strategy", ["auto", "loop", "while", "chunked"])
@pytest.mark.parametrize("target", ["output", "inputs"])
def test_mixed_precision_tensor_targets_come_back_in_float32(
    mixed_float16, strategy, target
):
    # a float16 activation's Jacobian came back float16 while every other
    # target of a mixed-precision model comes back float32
    import warnings

    import keras

    # tanh, not relu: a pre-activation within float16's rounding of 0 takes
    # the other side of relu's kink in the float32 twin, and that entry's
    # gradient is then wholly different (about 1 random init in 20 put one
    # there: 0.23 of the largest entry). Seeded, so every run checks the same
    # weights.
    seeded = {"kernel_initializer": keras.initializers.GlorotUniform(seed=0)}
    inp = keras.Input((8, 8, 3))
    h = keras.layers.Conv2D(4, 3, activation="tanh", name="c1", **seeded)(inp)
    h = keras.layers.GlobalAveragePooling2D()(h)
    head = keras.layers.Dense(3, name="head", dtype="float32", **seeded)
    model = keras.Model(inp, head(h))
    x = np.random.default_rng(0).normal(size=(2, 8, 8, 3)).astype("float32")
    layer = jk.Output("c1") if target == "output" else jk.Inputs()
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        res = jk.jacobian(model, x, layer, strategy=strategy, outputs="per_example")
    assert res[0].dtype == tf.float32
    twin = testing.cast_copy(model, "float32")
    ref = jk.jacobian(twin, x, layer, strategy="loop", outputs="per_example")
    # float16 activations: measured 4.4e-4 (Output) and 6.2e-4 (Inputs; 1.0e-3
    # without oneDNN) against the float32 twin's loop, every strategy alike
    assert testing.max_relative_difference(res[0], ref[0]) < 1e-2
