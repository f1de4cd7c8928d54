"""The public call and its result: targets, options and the result API."""

from __future__ import annotations

import logging
import os
import pathlib
import re
import subprocess
import sys

import keras
import numpy as np
import pytest
import tensorflow as tf
import tf_keras

import jacobkit as jk
from jacobkit import testing
from jacobkit.problem import Problem
from jacobkit.testing import examples
from tests.cases import example, reference, two_blocks


# -- the result ----------------------------------------------------------------
@pytest.fixture(scope="module")
def mlp_result():
    ex = example("mlp")
    return jk.jacobian(
        ex.model, ex.inputs, ex.layer, strategy=jk.strategies.Chunked(chunk_size=5)
    )


def test_result_is_correct(mlp_result):
    testing.assert_close(mlp_result, reference("mlp", "features"))


def test_result_shapes_and_what_ran(mlp_result):
    # mlp: 12 inputs -> hidden1 (16) -> ... -> 10 features
    assert mlp_result.rows_shape == (10,)
    assert tuple(mlp_result.kernel.shape) == (10, 12, 16)
    assert tuple(mlp_result.bias.shape) == (10, 16)
    assert mlp_result.strategy == "chunked"
    assert mlp_result.chunk_size == 5
    assert mlp_result.strategy_config == jk.strategies.Chunked(chunk_size=5)
    assert mlp_result.stats.num_rows == 10


def test_result_indexing(mlp_result):
    kernel, bias = mlp_result.kernel, mlp_result.bias
    assert list(mlp_result) == ["hidden1/kernel", "hidden1/bias"]
    assert len(mlp_result) == 2
    for key in ("kernel", "hidden1/kernel", 0, -2):
        assert mlp_result[key] is kernel
    for key in ("bias", "hidden1/bias", 1, -1):
        assert mlp_result[key] is bias
    assert "kernel" in mlp_result and 1 in mlp_result
    assert "weights" not in mlp_result and 2 not in mlp_result


def test_result_key_error_lists_the_targets(mlp_result):
    with pytest.raises(
        KeyError,
        match=re.escape(
            "JacobianResult['weights']: no such target. Targets: "
            "'hidden1/kernel', 'hidden1/bias'; roles: 'kernel', 'bias'"
        ),
    ):
        mlp_result["weights"]
    with pytest.raises(
        KeyError,
        match=re.escape(
            "JacobianResult[2]: index out of range for 2 target(s): "
            "'hidden1/kernel', 'hidden1/bias'"
        ),
    ):
        mlp_result[2]


def test_result_without_roles_has_no_kernel():
    ex = example("tf_module")  # targets given as [w, b]: no layer, no roles
    result = jk.jacobian(ex.model, ex.inputs, ex.layer, strategy="chunked")
    assert list(result) == ["w", "b"]
    with pytest.raises(KeyError, match=re.escape("Targets: 'w', 'b'")):
        _ = result.kernel
    testing.assert_close(result, reference("tf_module", "features"))


def test_result_numpy(mlp_result):
    arrays = mlp_result.numpy()
    assert list(arrays) == list(mlp_result)
    for name, array in arrays.items():
        assert isinstance(array, np.ndarray)
        np.testing.assert_array_equal(array, mlp_result[name].numpy())


def test_result_stats(mlp_result):
    stats = mlp_result.stats
    assert isinstance(stats, jk.Stats)
    assert isinstance(stats.wall_time_s, float) and stats.wall_time_s >= 0
    assert isinstance(stats.trace_time_s, float) and stats.trace_time_s >= 0
    assert isinstance(stats.traced, bool)
    assert stats.peak_bytes is None or stats.peak_bytes > 0


def test_result_is_frozen(mlp_result):
    with pytest.raises(AttributeError):
        mlp_result.strategy = "loop"


def test_chunk_size_is_none_for_unchunked_strategies():
    ex = example("mlp")
    result = jk.jacobian(ex.model, ex.inputs, ex.layer, strategy="jacobian")
    assert result.strategy == "jacobian" and result.chunk_size is None


def test_result_keeps_the_configured_strategy():
    ex = example("mlp")
    configured = jk.strategies.While(parallel_iterations=3)
    result = jk.jacobian(ex.model, ex.inputs, ex.layer, strategy=configured)
    assert result.strategy == "while" and result.strategy_config == configured
    assert result.strategy_config.parallel_iterations == 3
    assert configured.label == "while(parallel=3)"
    assert configured.smaller() == jk.strategies.While(1)
    assert jk.strategies.Chunked(1).smaller() is None


# -- targets -------------------------------------------------------------------
def _unwrap(variable):
    """The tf.Variable behind a keras.Variable (a tf.Variable is itself)."""
    return variable.value if isinstance(variable, keras.Variable) else variable


def _targets(ex: examples.Example, form: str):
    layer = ex.model.get_layer(ex.layer)
    if form == "name":
        return ex.layer
    if form == "object":
        return layer
    if form == "variables":  # keras.Variable for Keras 3, tf.Variable for tf_keras
        return [layer.kernel, layer.bias]
    # the tf.Variable behind each keras.Variable
    unwrapped = [_unwrap(v) for v in (layer.kernel, layer.bias)]
    assert all(isinstance(v, tf.Variable) for v in unwrapped)
    return unwrapped


@pytest.mark.parametrize("form", ["name", "object", "variables", "tf_variables"])
@pytest.mark.parametrize("problem", ["mlp", "tf_keras"], ids=["keras3", "tf_keras"])
def test_target_forms(problem, form):
    ex = example(problem)
    result = jk.jacobian(ex.model, ex.inputs, _targets(ex, form), strategy="chunked")
    testing.assert_close(result, reference(problem, "features"))
    layer = ex.model.get_layer(ex.layer)
    targets = Problem(ex.model, ex.inputs, _targets(ex, form)).targets
    assert targets[0] is _unwrap(layer.kernel)
    assert targets[1] is _unwrap(layer.bias)
    if form in ("name", "object"):
        assert result.kernel is result[0] and result.bias is result[1]


def test_keras3_variables_are_not_tf_variables():
    """Why jacobkit unwraps them (the reason the forms above exist)."""
    kernel = example("mlp").model.get_layer("hidden1").kernel
    assert isinstance(kernel, keras.Variable)
    assert not isinstance(kernel, tf.Variable)


def check_frozen_backbone_only_the_head_is_a_target() -> None:
    ex = examples.frozen_resnet(batch=2)
    head = ex.model.get_layer("head")
    problem = Problem(ex.model, ex.inputs, "head")
    # 320 variables in the model; the Keras 3 backbone's tf.Variables still
    # say trainable=True, so anything but an explicit target list would
    # watch them all.
    assert len(ex.model.weights) > 300
    assert len(problem.targets) == 2
    assert problem.targets[0] is head.kernel.value
    assert problem.targets[1] is head.bias.value
    result = jk.jacobian(ex.model, ex.inputs, "head", strategy="loop")
    assert list(result) == ["head/kernel", "head/bias"]
    expected = testing.reference_jacobian(
        ex.model, ex.inputs, [head.kernel, head.bias], call_kwargs={"training": False}
    )
    testing.assert_close(result, expected)


def test_frozen_backbone_only_the_head_is_a_target():
    """Run in a fresh process: building ResNet50 leaves large free chunks in
    TensorFlow's CPU allocator pool, and the allocator hands a later request
    a whole free chunk of up to twice its size, so tests in this process
    that measure peak memory (tests/test_memory.py) would see it."""
    code = (
        "from tests.test_api import check_frozen_backbone_only_the_head_is_a_target"
        " as check; check()"
    )
    done = subprocess.run(
        [sys.executable, "-c", code],
        cwd=pathlib.Path(__file__).parent.parent,
        env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3"},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-4000:]


# -- training= ----------------------------------------------------------------
@pytest.mark.parametrize("strategy", ["loop", "jacobian", "chunked"])
def test_training_is_passed_to_the_model(strategy):
    """BatchNormalization uses batch statistics with training=True: the
    Jacobian changes deterministically, and the conv bias drops out (BN
    subtracts the per-channel batch mean, which absorbs it)."""
    # Fresh models: training=True updates the BatchNormalization statistics.
    ex, ex64 = examples.build("residual"), examples.build("residual", "float64")
    layer64 = ex64.model.get_layer(ex.layer)
    targets64 = [layer64.kernel, layer64.bias]

    inference = jk.jacobian(ex.model, ex.inputs, ex.layer, strategy=strategy)
    testing.assert_close(
        inference,
        testing.reference_jacobian(
            ex64.model, ex64.inputs, targets64, call_kwargs={"training": False}
        ),
    )
    training = jk.jacobian(
        ex.model, ex.inputs, ex.layer, strategy=strategy, training=True
    )
    kernel64, bias64 = testing.reference_jacobian(
        ex64.model, ex64.inputs, targets64, call_kwargs={"training": True}
    )
    assert testing.max_relative_difference(training.kernel, kernel64) < 1e-5
    assert testing.max_relative_difference(training.kernel, inference.kernel) > 0.1
    # bias: exactly zero in exact arithmetic; float32 rounding only
    kernel_scale = np.abs(kernel64).max()
    assert np.abs(bias64).max() < 1e-12 * kernel_scale
    assert np.abs(training.bias.numpy()).max() < 1e-5 * kernel_scale
    assert np.abs(inference.bias.numpy()).max() > 0.1 * kernel_scale


# -- device=, unbuilt models, multi-input dicts -------------------------------
def test_device_cpu():
    ex = example("mlp")
    result = jk.jacobian(
        ex.model, ex.inputs, ex.layer, strategy="chunked", device="CPU:0"
    )
    assert all(t.device.endswith("CPU:0") for t in result.jacobians.values())
    testing.assert_close(result, reference("mlp", "features"))


def _unbuilt(flavour: str):
    if flavour == "subclassed":

        class Net(keras.Model):
            def __init__(self):
                super().__init__()
                self.first = keras.layers.Dense(3, activation="tanh", name="first")
                self.last = keras.layers.Dense(2, name="last")

            def call(self, x):
                return self.last(self.first(x))

        return Net()
    module = keras if flavour == "keras3" else tf_keras
    return module.Sequential(
        [
            module.layers.Dense(3, activation="tanh", name="first"),
            module.layers.Dense(2, name="last"),
        ]
    )


@pytest.mark.parametrize("by", ["name", "object"])
@pytest.mark.parametrize("flavour", ["keras3", "tf_keras", "subclassed"])
def test_unbuilt_model_is_built_on_first_use(flavour, by):
    model = _unbuilt(flavour)
    assert not model.built
    x = np.random.default_rng(0).normal(size=(4, 5)).astype("float32")
    layer = "first" if by == "name" else model.layers[0]
    result = jk.jacobian(model, x, layer, strategy="chunked")
    assert model.built
    first = model.layers[0]
    assert tuple(result.kernel.shape) == (2, 5, 3)
    expected = testing.reference_jacobian(model, x, [first.kernel, first.bias])
    testing.assert_close(result, expected)


def test_multi_input_as_dict_tuple_and_list():
    ex = example("multi_input")
    xa, xb = ex.inputs
    expected = reference("multi_input", "features")
    results = [
        jk.jacobian(ex.model, inputs, ex.layer, strategy="chunked")
        for inputs in ({"a": xa, "b": xb}, (xa, xb), [xa, xb])
    ]
    for result in results:
        testing.assert_close(result, expected)


def test_tensor_inputs():
    ex = example("mlp")
    result = jk.jacobian(ex.model, tf.constant(ex.inputs), ex.layer, strategy="chunked")
    testing.assert_close(result, reference("mlp", "features"))


def test_nested_python_list_inputs_are_one_array():
    ex = example("mlp")
    result = jk.jacobian(ex.model, ex.inputs.tolist(), ex.layer, strategy="chunked")
    testing.assert_close(result, reference("mlp", "features"))


# -- result keys: the layer's path inside the model ------------------------------------
def _dense_stack(flavour, kind: str):
    layers = flavour.layers
    if kind == "sequential":
        return flavour.Sequential(
            [
                flavour.Input((4,)),
                layers.Dense(3, name="d"),
                layers.Dense(2, name="head"),
            ],
            name="seq",
        )
    x_in = flavour.Input((4,))
    y = layers.Dense(2, name="head")(layers.Dense(3, name="d")(x_in))
    return flavour.Model(x_in, y, name="func")


@pytest.mark.parametrize("kind", ["sequential", "functional"])
@pytest.mark.parametrize("flavour", [keras, tf_keras], ids=["keras3", "tf_keras"])
def test_keys_do_not_depend_on_the_model_type(flavour, kind):
    model = _dense_stack(flavour, kind)
    x = np.ones((2, 4), "float32")
    head = model.get_layer("head")
    for target in ("head", head, [head.kernel, head.bias]):
        result = jk.jacobian(model, x, target, strategy="loop")
        assert list(result) == ["head/kernel", "head/bias"]
        assert result["head/kernel"] is result[0]


def test_keys_of_a_nested_model_keep_its_path():
    """A layer inside a sub-model is keyed by the sub-model's name, then its own."""
    inner_in = keras.Input((4,))
    backbone = keras.Model(
        inner_in, keras.layers.Dense(3, name="d")(inner_in), name="backbone"
    )
    x_in = keras.Input((4,))
    model = keras.Model(
        x_in, keras.layers.Dense(2, name="head")(backbone(x_in)), name="top"
    )
    x = np.ones((2, 4), "float32")
    result = jk.jacobian(model, x, "d", strategy="loop")
    assert list(result) == ["backbone/d/kernel", "backbone/d/bias"]


@pytest.mark.parametrize("name", ["block_1/query", "block_1"])
def test_a_path_names_one_of_several_layers_of_the_same_name(name):
    """``"block_1/query"`` (the prefix of its result keys) is block_1's
    ``query``, not block_0's: both blocks hold a Dense named ``query``."""
    model, x = two_blocks()
    result = jk.jacobian(model, x, name, strategy="loop")
    assert list(result) == ["block_1/query/kernel", "block_1/query/bias"]
    model64 = testing.float64_copy(model)
    query64 = model64.get_layer("block_1").get_layer("query")
    expected = testing.reference_jacobian(
        model64, x.astype("float64"), [query64.kernel, query64.bias]
    )
    testing.assert_close(result, expected)
    query = model.get_layer("block_1").get_layer("query")
    assert result[0].shape == (2, *query.kernel.shape)


@pytest.mark.parametrize(
    "name",
    ["stack/block_0/attention/query", "block_0/attention/query", "block_0/query"],
)
def test_any_path_suffix_or_the_names_in_order_name_a_nested_layer(name):
    """The full path, a suffix of it, or its names in order with some left
    out (``"block_0/query"`` for ``"stack/block_0/attention/query"``)."""

    def block(i: int) -> keras.Sequential:
        attention = keras.Sequential(
            [keras.layers.Dense(2, name="query")], name="attention"
        )
        return keras.Sequential([attention], name=f"block_{i}")

    stack = keras.Sequential([block(0), block(1)], name="stack")
    model = keras.Sequential([keras.Input((2,)), stack], name="deep")
    x = np.ones((1, 2), "float32")
    result = jk.jacobian(model, x, name, strategy="loop")
    assert list(result) == [
        "stack/block_0/attention/query/kernel",
        "stack/block_0/attention/query/bias",
    ]


def test_keys_and_targets_of_a_recurrent_layer():
    x_in = keras.Input((5, 3))
    rnn = keras.layers.LSTM(2, name="rnn")
    model = keras.Model(x_in, keras.layers.Dense(2, name="head")(rnn(x_in)))
    x = np.random.default_rng(3).normal(size=(2, 5, 3)).astype("float32")
    result = jk.jacobian(model, x, "rnn", strategy="loop")
    assert list(result) == [
        "rnn/lstm_cell/kernel",
        "rnn/lstm_cell/recurrent_kernel",
        "rnn/lstm_cell/bias",
    ]
    # float32 loop vs float64 loop on a float64 copy: measured 1e-7
    model64 = testing.float64_copy(model)
    expected = testing.reference_jacobian(
        model64, x.astype("float64"), model64.get_layer("rnn").weights
    )
    testing.assert_close(result, expected)


# -- frozen layers: their weights are still targets; moving statistics never --------
@pytest.mark.parametrize("flavour", [keras, tf_keras], ids=["keras3", "tf_keras"])
def test_frozen_batch_norm_and_conv_are_targets(flavour):
    layers = flavour.layers

    def build(dtype):
        x_in = flavour.Input((5, 5, 2), dtype=dtype)
        h = layers.Conv2D(3, 3, name="conv", dtype=dtype)(x_in)
        h = layers.BatchNormalization(name="bn", dtype=dtype)(h)
        h = layers.GlobalAveragePooling2D(dtype=dtype)(h)
        return flavour.Model(x_in, layers.Dense(2, name="head", dtype=dtype)(h))

    model, model64 = build("float32"), build("float64")
    rng = np.random.default_rng(4)
    for layer in model.layers:  # non-trivial statistics and weights
        layer.set_weights([rng.uniform(0.5, 1.5, w.shape) for w in layer.weights])
    model64.set_weights(model.get_weights())
    for layer in (model.get_layer("conv"), model.get_layer("bn")):
        layer.trainable = False
    x = rng.normal(size=(2, 5, 5, 2)).astype("float32")

    result = jk.jacobian(model, x, "bn", strategy="chunked")
    assert list(result) == ["bn/gamma", "bn/beta"]
    bn64 = model64.get_layer("bn")
    # float32 vs float64 reference: measured 3e-7
    testing.assert_close(
        result,
        testing.reference_jacobian(
            model64, x.astype("float64"), [bn64.gamma, bn64.beta]
        ),
    )
    conv = jk.jacobian(model, x, "conv", strategy="chunked")
    assert list(conv) == ["conv/kernel", "conv/bias"]
    # the calls changed nothing: both layers are still frozen
    assert not model.get_layer("bn").trainable
    assert not model.get_layer("conv").trainable


# -- output=: one output of a multi-output model ------------------------------------
def _two_outputs(dtype: str):
    x_in = keras.Input((5,), dtype=dtype)
    h = keras.layers.Dense(4, activation="tanh", name="dense", dtype=dtype)(x_in)
    logits = keras.layers.Dense(3, name="logits", dtype=dtype)(h)
    aux = keras.layers.Dense(2, name="aux", dtype=dtype)(h)
    return keras.Model(x_in, [logits, aux])


@pytest.mark.parametrize("output", ["logits", 0, "aux", -1])
def test_output_picks_one_output(output):
    model, model64 = _two_outputs("float32"), _two_outputs("float64")
    model64.set_weights(model.get_weights())
    x = np.random.default_rng(5).normal(size=(3, 5)).astype("float32")
    index = {"logits": 0, "aux": 1}.get(output, output)
    dense64 = model64.get_layer("dense")

    def picked64(inputs):
        return model64(inputs)[index]

    expected = testing.reference_jacobian(
        picked64, x.astype("float64"), [dense64.kernel, dense64.bias]
    )
    result = jk.jacobian(model, x, "dense", strategy="chunked", output=output)
    width = 3 if index == 0 else 2
    assert result.rows_shape == (width,)  # one row per feature of that output
    # float32 vs float64 reference: measured 1e-7
    testing.assert_close(result, expected)


def test_output_of_a_dict_output_model_and_in_plan():
    x_in = keras.Input((5,))
    h = keras.layers.Dense(4, name="dense")(x_in)
    model = keras.Model(
        x_in,
        {"score": keras.layers.Dense(3, name="score")(h), "aux": h},
    )
    x = np.ones((2, 5), "float32")
    by_name = jk.jacobian(model, x, "dense", strategy="loop", output="score")
    by_callable = jk.jacobian(
        model,
        x,
        "dense",
        strategy="loop",
        outputs=lambda y: tf.reduce_sum(y["score"], axis=0),
    )
    np.testing.assert_array_equal(by_name.kernel.numpy(), by_callable.kernel.numpy())
    plan = jk.plan(model, x, "dense", output="score", memory_budget="1GiB")
    assert plan.result_bytes == 3 * (5 * 4 + 4) * 4


# -- stats: planning and the whole call -----------------------------------------------
def test_stats_report_planning_and_the_whole_call():
    model = _dense_stack(keras, "functional")
    x = np.ones((2, 4), "float32")
    first = jk.jacobian(model, x, "head", memory_budget="1GiB")
    stats = first.stats
    assert stats.planning_time_s > 0
    assert stats.total_time_s >= stats.planning_time_s + stats.wall_time_s
    fixed = jk.jacobian(model, x, "head", strategy="chunked")
    assert fixed.stats.planning_time_s == 0.0
    assert fixed.stats.total_time_s >= fixed.stats.wall_time_s


# -- TensorFlow's warnings about its own internals stay out ---------------------------
class _Chatty(tf.Module):
    """Logs on TensorFlow's logger whenever it runs (or is traced), as
    TensorFlow's internals do (pfor's "Conv2DBackpropFilter uses a
    while_loop. Fix that!", the retracing warning)."""

    def __init__(self):
        super().__init__(name="chatty")
        self.w = tf.Variable(tf.ones((3, 2)), name="w")

    def __call__(self, x):
        tf.get_logger().warning("internal detail")
        tf.get_logger().error("a real problem")
        return x @ self.w


@pytest.mark.parametrize("strategy", ["auto", "chunked", "loop"])
def test_tensorflow_warnings_are_hidden_while_jacobkit_works(caplog, strategy):
    model = _Chatty()
    x = np.ones((2, 3), "float32")
    with caplog.at_level(logging.WARNING, logger="tensorflow"):
        model(x)  # the control: outside jacobkit both records show
        assert [r.levelname for r in caplog.records] == ["WARNING", "ERROR"]
        caplog.clear()
        jk.jacobian(model, x, [model.w], strategy=strategy)
    levels = {r.levelname for r in caplog.records if r.name == "tensorflow"}
    assert levels == {"ERROR"}  # errors still show
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="tensorflow"):
        model(x)  # and nothing stays switched off afterwards
    assert [r.levelname for r in caplog.records] == ["WARNING", "ERROR"]
