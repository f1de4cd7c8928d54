"""Every bad input gets its exact message, raised before anything large runs.

Messages are asserted in full (``match=^...$``) so that a reworded message is
a deliberate change: each one names the call and the argument, shows what came
in and says the fix.
"""

from __future__ import annotations

import re

import keras
import numpy as np
import pytest
import tensorflow as tf
import tf_keras

import jacobkit as jk
from jacobkit import testing
from jacobkit.memory import PeakMemory
from jacobkit.testing import examples
from tests.cases import two_blocks

MiB = 1024**2


def exactly(message: str) -> str:
    """A ``pytest.raises(match=...)`` pattern for exactly ``message``."""
    return "^" + re.escape(message) + "$"


def mlp():
    """A fresh 4-feature MLP on (3, 5) inputs: layers "hidden" and "head"."""
    model = keras.Sequential(
        [
            keras.Input((5,), name="x"),
            keras.layers.Dense(6, activation="tanh", name="hidden"),
            keras.layers.Dense(4, name="head"),
        ],
        name="small",
    )
    x = np.random.default_rng(0).normal(size=(3, 5)).astype("float32")
    return model, x


class _IntegerOutput(tf.Module):
    """Reads a float variable, returns int32: no Jacobian exists."""

    def __init__(self):
        super().__init__(name="integer_output")
        self.w = tf.Variable(tf.ones((5, 4)), name="w")

    def __call__(self, x):
        return tf.cast(tf.round(x @ self.w), tf.int32)


# -- a large problem: the Jacobian would be 8 MiB -------------------------------
# Dense(128 -> 128) with 128 output features: d(features) / d(kernel) has
# 128 * 128 * 128 float32 = 8 MiB. Errors must come before any of it exists.
_WIDE = 128


@pytest.fixture(scope="module")
def wide():
    model = keras.Sequential(
        [
            keras.Input((_WIDE,)),
            keras.layers.Dense(_WIDE, name="wide"),
            keras.layers.Dense(_WIDE, name="side"),
        ],
        name="wide_model",
    )
    # a branch that is built but does not reach the output
    stray = keras.layers.Dense(_WIDE, name="stray")
    stray.build((None, _WIDE))
    x = np.ones((2, _WIDE), "float32")
    return model, x, stray


def test_peak_memory_sees_the_large_jacobian(wide):
    """The control for the checks below: a successful call on the same problem
    allocates at least the 8 MiB result, and PeakMemory sees it."""
    model, x, _ = wide
    with PeakMemory("CPU:0") as memory:
        result = jk.jacobian(model, x, "wide", strategy="jacobian", device="CPU:0")
    assert result.kernel.shape == (_WIDE, _WIDE, _WIDE)
    assert memory.extra_bytes >= 8 * MiB


@pytest.mark.parametrize(
    "kwargs",
    [
        {"layer": "nope"},
        {"layer": "wide", "features": [0, _WIDE]},
        {"layer": "stray"},  # replaced by the stray layer object: unconnected
        {"layer": "wide", "strategy": "fastest"},
        {"layer": "wide", "outputs": "rows"},
    ],
    ids=["unknown-layer", "features-range", "unconnected", "strategy", "outputs"],
)
def test_errors_come_before_large_allocations(wide, kwargs):
    model, x, stray = wide
    kwargs = {"strategy": "jacobian", **kwargs}
    if kwargs["layer"] == "stray":
        kwargs["layer"] = stray
    with PeakMemory("CPU:0") as memory, pytest.raises(ValueError, match="jacobian"):
        jk.jacobian(model, x, device="CPU:0", **kwargs)
    assert memory.extra_bytes < 1 * MiB


# -- layer= -------------------------------------------------------------------
@pytest.mark.parametrize(
    "name, hint",
    [
        ("hiden", "Did you mean 'hidden'?"),
        ("Head", "Did you mean 'head'?"),
        ("HIDDEN_1", "Did you mean 'hidden'?"),
        # only layers with trainable variables: not the input layer 'x'
        (
            "output",
            "The model's layers with trainable variables are: 'hidden', 'head'.",
        ),
        ("y", "The model's layers with trainable variables are: 'hidden', 'head'."),
    ],
)
def test_unknown_layer_name_suggests_the_closest(name, hint):
    model, x = mlp()
    with pytest.raises(
        ValueError,
        match=exactly(
            f"jacobian(layer={name!r}): the model has no layer named {name!r}. {hint}"
        ),
    ):
        jk.jacobian(model, x, name, strategy="chunked")


def test_unknown_layer_name_in_a_large_model():
    """No list of 40 names: the closest ones, or the first ten."""
    layers = [keras.layers.Dense(2, name=f"block{i}") for i in range(24)]
    model = keras.Sequential(
        [keras.Input((2,), name="x"), *layers, keras.layers.Dense(2, name="head")]
    )
    x = np.ones((1, 2), "float32")
    with pytest.raises(
        ValueError,
        match=exactly(
            "jacobian(layer='haed'): the model has no layer named 'haed'. "
            "Did you mean 'head'?"
        ),
    ):
        jk.jacobian(model, x, "haed", strategy="chunked")
    first = ", ".join(repr(f"block{i}") for i in range(10))
    with pytest.raises(
        ValueError,
        match=exactly(
            "jacobian(layer='logits'): the model has no layer named 'logits'. "
            f"The model's layers with trainable variables are: {first} and 15 more."
        ),
    ):
        jk.jacobian(model, x, "logits", strategy="chunked")


@pytest.mark.parametrize("target", ["query", "Output"])
def test_a_name_of_several_layers_is_refused_with_their_paths(target):
    model, x = two_blocks()
    layer = jk.Output("query") if target == "Output" else "query"
    with pytest.raises(
        ValueError,
        match=exactly(
            "jacobian(layer='query'): 2 layers of the model match 'query': "
            "'block_0/query', 'block_1/query'. Pass one of these paths to choose one."
        ),
    ):
        jk.jacobian(model, x, layer, strategy="chunked")


@pytest.mark.parametrize(
    "name, hint",
    [
        # the bare name is ambiguous: both paths, never 'query' alone
        ("qeury", "Did you mean 'block_0/query' or 'block_1/query'?"),
        (
            "block_1/qeury",
            "Did you mean 'block_1/query' or 'block_0/query' or 'block_1'?",
        ),
        # nothing close: every layer that has variables, never the input 'x'
        (
            "logits",
            "The model's layers with trainable variables are: 'block_0', "
            "'block_0/query', 'block_1', 'block_1/query', 'head'.",
        ),
        (
            "xx",
            "The model's layers with trainable variables are: 'block_0', "
            "'block_0/query', 'block_1', 'block_1/query', 'head'.",
        ),
    ],
)
def test_unknown_layer_path_suggests_layers_with_variables(name, hint):
    model, x = two_blocks()
    with pytest.raises(
        ValueError,
        match=exactly(
            f"jacobian(layer={name!r}): the model has no layer named {name!r}. {hint}"
        ),
    ):
        jk.jacobian(model, x, name, strategy="chunked")


def test_ambiguous_name_is_refused_before_large_allocations():
    layers = [
        keras.Sequential([keras.layers.Dense(_WIDE, name="query")], name=f"block_{i}")
        for i in range(2)
    ]
    model = keras.Sequential([keras.Input((_WIDE,)), *layers], name="wide_blocks")
    x = np.ones((2, _WIDE), "float32")
    with PeakMemory("CPU:0") as memory, pytest.raises(ValueError, match="match"):
        jk.jacobian(model, x, "query", strategy="jacobian", device="CPU:0")
    assert memory.extra_bytes < 1 * MiB


def test_unknown_layer_name_on_a_model_without_layers():
    ex = examples.build("tf_module")
    with pytest.raises(
        ValueError,
        match=exactly(
            "jacobian(layer='w'): the model has no layer named 'w'. The model "
            "has no named layers; pass a list of variables instead."
        ),
    ):
        jk.jacobian(ex.model, ex.inputs, "w", strategy="chunked")


def test_unknown_layer_name_on_tf_keras():
    ex = examples.build("tf_keras")
    with pytest.raises(ValueError, match=re.escape("no layer named 'hidden'")):
        jk.jacobian(ex.model, ex.inputs, "hidden", strategy="chunked")


def _dropout_model(flavour):
    layers = flavour.layers
    model = flavour.Sequential(
        [
            layers.Dense(3, name="first"),
            layers.Dropout(0.5, name="drop"),
            layers.Dense(2, name="last"),
        ]
    )
    x = np.ones((2, 4), "float32")
    model(x)  # builds it
    return model, x


@pytest.mark.parametrize("flavour", [keras, tf_keras], ids=["keras3", "tf_keras"])
@pytest.mark.parametrize("by", ["name", "object"])
def test_layer_without_variables(flavour, by):
    model, x = _dropout_model(flavour)
    layer = "drop" if by == "name" else model.get_layer("drop")
    with pytest.raises(
        ValueError,
        match=exactly(
            "jacobian(layer='drop'): layer 'drop' (Dropout) has no trainable "
            "variables, so it has no Jacobian. Choose a layer with a kernel or "
            "bias (Dense, Conv1D, Conv2D, ...), or pass a list of variables."
        ),
    ):
        jk.jacobian(model, x, layer, strategy="chunked")


@pytest.mark.parametrize("layer", [3, None, [], 2.5], ids=repr)
def test_layer_of_the_wrong_type(layer):
    model, x = mlp()
    with pytest.raises(
        TypeError,
        match=exactly(
            "jacobian(layer=...): expected a layer, a layer name or a non-empty "
            f"list of variables, got {type(layer).__name__}: {layer!r}."
        ),
    ):
        jk.jacobian(model, x, layer, strategy="chunked")


def test_list_with_something_that_is_not_a_variable():
    model, x = mlp()
    kernel = model.get_layer("head").kernel
    with pytest.raises(
        TypeError,
        match=exactly(
            "jacobian(layer=...): expected a tf.Variable or keras.Variable in the "
            "list of targets, got str: 'head'. Pass a layer, a layer name, or a "
            "list of the model's variables."
        ),
    ):
        jk.jacobian(model, x, [kernel, "head"], strategy="chunked")


# -- targets that do not reach the outputs -------------------------------------
_UNCONNECTED = (
    "jacobian(layer=...): target(s) {} do not influence the model's outputs, so "
    "their Jacobian is zero (a tape would return None). Pick a layer on the "
    "path to the outputs, or pass unconnected='zero' to get zeros."
)


def _two_branch_model():
    """Output = used(x); "unused" is called on x but its output is dropped."""
    x_in = keras.Input((5,))
    used = keras.layers.Dense(3, name="used")
    unused = keras.layers.Dense(3, name="unused")
    y = used(x_in)
    unused(x_in)  # built, on a branch that goes nowhere
    model = keras.Model(x_in, y, name="two_branch")
    x = np.random.default_rng(1).normal(size=(2, 5)).astype("float32")
    return model, x, used, unused


class _IdleLayer(keras.Model):
    """Holds a built layer "idle" that its call never uses."""

    def __init__(self):
        super().__init__(name="idle_layer")
        self.used = keras.layers.Dense(3, name="used")
        self.idle = keras.layers.Dense(3, name="idle")
        self.idle.build((None, 5))

    def call(self, x):
        return self.used(x)


@pytest.mark.parametrize("strategy", ["loop", "chunked"])
def test_unconnected_layer_raises(strategy):
    model = _IdleLayer()
    x = np.ones((2, 5), "float32")
    with pytest.raises(
        ValueError, match=exactly(_UNCONNECTED.format("idle/kernel, idle/bias"))
    ):
        jk.jacobian(model, x, "idle", strategy=strategy)


def _not_part(name: str, model: str, fix: str) -> str:
    return (
        f"jacobian(layer=...): layer {name!r} (Dense) is not part of the model "
        f"{model!r}: it belongs to another model, or was never called in this "
        f"one, so it cannot influence the outputs. {fix}"
    )


def test_layer_of_another_model():
    model, x = mlp()
    twin, _ = mlp()  # same layer names, other variables
    other = keras.Sequential([keras.Input((5,)), keras.layers.Dense(4, name="other")])
    with pytest.raises(
        ValueError,
        match=exactly(
            _not_part(
                "head",
                "small",
                "Pass its name ('head') or model.get_layer('head') to use this "
                "model's own layer of that name.",
            )
        ),
    ):
        jk.jacobian(model, x, twin.get_layer("head"), strategy="chunked")
    with pytest.raises(
        ValueError,
        match=exactly(
            _not_part(
                "other", "small", "Pass one of this model's layers (by name or object)."
            )
        ),
    ):
        jk.jacobian(model, x, other.layers[-1], strategy="chunked")


def test_layer_built_beside_the_model():
    """A functional model keeps only the layers between its inputs and outputs."""
    model, x, _, unused = _two_branch_model()
    with pytest.raises(
        ValueError,
        match=exactly(
            _not_part(
                "unused",
                "two_branch",
                "Pass one of this model's layers (by name or object).",
            )
        ),
    ):
        jk.jacobian(model, x, unused, strategy="chunked")


def test_unused_tf_variable_raises():
    model, x = mlp()
    stray = tf.Variable(tf.ones((3,)), name="stray")
    with pytest.raises(
        ValueError,
        match=exactly(
            "jacobian(layer=[...]): stray is not a variable of the model 'small': "
            "it belongs to another model, or to none, so it cannot influence the "
            "outputs. Pass this model's variables (model.get_layer(name).kernel, "
            "...)."
        ),
    ):
        jk.jacobian(model, x, [stray], strategy="chunked")
    # a variable of the model that does not reach the outputs is unconnected
    idle = _IdleLayer()
    x5 = np.ones((2, 5), "float32")
    with pytest.raises(ValueError, match=exactly(_UNCONNECTED.format("idle/kernel"))):
        jk.jacobian(idle, x5, [idle.idle.kernel], strategy="chunked")


@pytest.mark.parametrize("strategy", ["loop", "jacobian", "chunked", "forward"])
def test_unconnected_zero_returns_zeros_for_it_only(strategy):
    model, x, used, unused = _two_branch_model()
    result = jk.jacobian(
        model,
        x,
        [used.kernel, unused.kernel],
        strategy=strategy,
        unconnected="zero",
    )
    used_jac, unused_jac = result[0].numpy(), result[1].numpy()
    assert unused_jac.shape == (3, 5, 3)
    assert not unused_jac.any()
    # the connected one is still right: d(sum_b Y[b, f]) / dW[i, k] = sum_b x[b, i]
    expected = np.einsum("bi,kf->fik", x, np.eye(3))
    np.testing.assert_allclose(used_jac, expected, rtol=1e-6)


@pytest.mark.parametrize("unconnected", ["ignore", None, True])
def test_unconnected_must_be_error_or_zero(unconnected):
    model, x = mlp()
    with pytest.raises(
        ValueError,
        match=exactly(
            f"jacobian(unconnected={unconnected!r}): expected 'error' (raise "
            "when a target does not influence the outputs) or 'zero' (return "
            "zeros for it)."
        ),
    ):
        jk.jacobian(model, x, "head", strategy="chunked", unconnected=unconnected)


# -- features= ----------------------------------------------------------------
@pytest.mark.parametrize(
    "features, bad", [([0, 4], [4]), ([-5, 1, 9], [-5, 9])], ids=["high", "both"]
)
def test_features_out_of_range(features, bad):
    model, x = mlp()
    with pytest.raises(
        ValueError,
        match=exactly(
            f"jacobian(features={features!r}): index(es) {bad} are out of range "
            "for an output with 4 features (shape (3, 4)). Valid indices are 0..3."
        ),
    ):
        jk.jacobian(model, x, "head", strategy="chunked", features=features)


@pytest.mark.parametrize("features", [[1.5], "ab", [0, None]], ids=repr)
def test_features_not_integers(features):
    model, x = mlp()
    with pytest.raises(
        TypeError,
        match=exactly(
            f"jacobian(features={features!r}): expected a list of integer "
            "indices into the output's last axis, such as features=[0, 5, 7]."
        ),
    ):
        jk.jacobian(model, x, "head", strategy="chunked", features=features)


def test_features_empty():
    model, x = mlp()
    with pytest.raises(
        ValueError,
        match=exactly(
            "jacobian(features=[]): choose at least one feature, such as "
            "features=[0, 5, 7], or pass features=None for all of them."
        ),
    ):
        jk.jacobian(model, x, "head", strategy="chunked", features=[])


def test_negative_features_count_from_the_end():
    model, x = mlp()
    last = jk.jacobian(model, x, "head", strategy="chunked", features=[-1])
    fourth = jk.jacobian(model, x, "head", strategy="chunked", features=[3])
    # gather's gradient drops negative indices: this once was all zeros
    assert np.abs(fourth.kernel.numpy()).max() > 0.1
    np.testing.assert_array_equal(last.kernel.numpy(), fourth.kernel.numpy())
    np.testing.assert_array_equal(last.bias.numpy(), fourth.bias.numpy())


# -- the model's output ---------------------------------------------------------
_NOT_FLOATING = (
    "jacobian(model=...): the rows have dtype int32; Jacobians need a floating "
    "output (float16/32/64). Cast the output to float, or pick a floating "
    "output with outputs=callable."
)


@pytest.mark.parametrize("strategy", ["loop", "jacobian", "forward"])
def test_integer_output(strategy):
    module = _IntegerOutput()
    x = np.ones((2, 5), "float32")
    with pytest.raises(TypeError, match=exactly(_NOT_FLOATING)):
        jk.jacobian(module, x, [module.w], strategy=strategy)


def test_integer_output_of_a_keras_model():
    x_in = keras.Input((5,))
    h = keras.layers.Dense(4, name="dense")(x_in)
    y = keras.layers.Lambda(lambda t: keras.ops.cast(t, "int32"))(h)
    model = keras.Model(x_in, y)
    with pytest.raises(TypeError, match=exactly(_NOT_FLOATING)):
        jk.jacobian(model, np.ones((2, 5), "float32"), "dense", strategy="chunked")


def test_per_example_needs_a_batch_and_a_feature_axis():
    w = tf.Variable(tf.ones((5, 2)), name="w")

    def model(x):
        return tf.reduce_sum(x @ w, axis=1)  # shape (B,)

    with pytest.raises(
        ValueError,
        match=exactly(
            "jacobian(outputs='per_example'): needs an output of shape (batch, "
            "..., features), got shape (3,). Use outputs='full' for one row per "
            "output element."
        ),
    ):
        jk.jacobian(
            model,
            np.ones((3, 5), "float32"),
            [w],
            strategy="chunked",
            outputs="per_example",
        )


# -- outputs= -------------------------------------------------------------------
@pytest.mark.parametrize(
    "outputs, hint",
    [
        (1.5, ""),
        ("Features", " Did you mean 'features'?"),
        ("per-example", " Did you mean 'per_example'?"),
        # a name or an index: what output= (singular) takes
        (
            "logits",
            " To pick one output of a multi-output model by name or index, pass "
            "output='logits' (singular); outputs= says what a row is.",
        ),
        (
            1,
            " To pick one output of a multi-output model by name or index, pass "
            "output=1 (singular); outputs= says what a row is.",
        ),
    ],
    ids=repr,
)
def test_outputs_of_the_wrong_kind(outputs, hint):
    model, x = mlp()
    with pytest.raises(
        ValueError,
        match=exactly(
            f"jacobian(outputs={outputs!r}): expected one of 'features', "
            "'per_example', 'full' or a callable g(Y) -> tf.Tensor whose every "
            f"element is a row.{hint}"
        ),
    ):
        jk.jacobian(model, x, "head", strategy="chunked", outputs=outputs)


# -- strategy= and chunk_size= ------------------------------------------------------
def test_unknown_strategy_lists_the_choices():
    model, x = mlp()
    choices = ", ".join(repr(n) for n in [*jk.strategies.REGISTRY, "auto"])
    assert "'chunked'" in choices and "'auto'" in choices
    with pytest.raises(
        ValueError,
        match=exactly(
            f"jacobian(strategy='pfor'): unknown strategy. Choose one of "
            f"{choices}, or pass a configured instance such as "
            "jacobkit.strategies.Chunked(chunk_size=16)."
        ),
    ):
        jk.jacobian(model, x, "head", strategy="pfor")


def test_strategy_class_instead_of_instance():
    model, x = mlp()
    with pytest.raises(
        TypeError,
        match=exactly(
            "jacobian(strategy=Chunked): got the class, not a configured "
            "instance. Pass strategy=Chunked() (with options if it takes any) or "
            "the name 'chunked'."
        ),
    ):
        jk.jacobian(model, x, "head", strategy=jk.strategies.Chunked)


@pytest.mark.parametrize("cls", [jk.strategies.Chunked, jk.strategies.Forward])
@pytest.mark.parametrize("chunk_size", [0, -3])
def test_chunk_size_below_one(cls, chunk_size):
    with pytest.raises(
        ValueError,
        match=exactly(
            f"strategies.{cls.name}(chunk_size={chunk_size}): chunk_size must be "
            ">= 1 (the number of rows computed together). Use 1 for the least "
            "memory."
        ),
    ):
        cls(chunk_size=chunk_size)


@pytest.mark.parametrize("cls", [jk.strategies.Chunked, jk.strategies.Forward])
@pytest.mark.parametrize("chunk_size", [2.0, "8", True, None], ids=repr)
def test_chunk_size_not_an_int(cls, chunk_size):
    with pytest.raises(
        TypeError,
        match=exactly(
            f"strategies.{cls.name}(chunk_size={chunk_size!r}): expected a "
            f"positive int, got {type(chunk_size).__name__}."
        ),
    ):
        cls(chunk_size=chunk_size)


@pytest.mark.parametrize("cls", [jk.strategies.Chunked, jk.strategies.Forward])
def test_chunk_size_numpy_integer_is_accepted(cls):
    strategy = cls(chunk_size=np.int64(4))
    assert strategy.chunk_size == 4 and type(strategy.chunk_size) is int


# -- the batch strategy on a model that mixes examples ------------------------------
@pytest.mark.parametrize("outputs", ["features", "per_example", "full"])
def test_batch_refuses_batch_norm_in_training(outputs):
    # A fresh model: training=True updates the BatchNormalization statistics.
    ex = examples.build("residual")
    start = (
        "jacobian(strategy='batch'): the model mixes examples across the batch: "
        "example 0's outputs depend on other examples' values at layer 'conv_a' "
        "(relative size "
    )
    end = (
        "), as BatchNormalization with training=True does. The batch strategy "
        "assumes independent examples; use strategy='chunked' or 'jacobian'."
    )
    with pytest.raises(
        ValueError,
        match="^" + re.escape(start) + r"\d\.\de[-+]\d\d" + re.escape(end) + "$",
    ):
        jk.jacobian(
            ex.model,
            ex.inputs,
            ex.layer,
            strategy="batch",
            training=True,
            outputs=outputs,
        )


def test_batch_accepts_batch_norm_in_inference():
    ex = examples.build("residual")
    result = jk.jacobian(
        ex.model, ex.inputs, ex.layer, strategy="batch", outputs="per_example"
    )
    assert result.strategy == "batch"


# -- training=, inputs=, model= ------------------------------------------------------
@pytest.mark.parametrize("training", ["yes", None, 1], ids=repr)
def test_training_must_be_a_bool(training):
    model, x = mlp()
    with pytest.raises(
        TypeError,
        match=exactly(
            f"jacobian(training={training!r}): expected True (training "
            "behaviour: dropout, batch statistics) or False (inference), got "
            f"{type(training).__name__}."
        ),
    ):
        jk.jacobian(model, x, "head", strategy="chunked", training=training)


@pytest.mark.parametrize(
    "inputs", ["x.npy", None, {"a": object()}], ids=["str", "None", "dict-object"]
)
def test_inputs_of_the_wrong_type(inputs):
    model, _ = mlp()
    leaf = inputs["a"] if isinstance(inputs, dict) else inputs
    with pytest.raises(
        TypeError,
        match=exactly(
            "jacobian(inputs=...): expected NumPy arrays or tf.Tensors (in a "
            "tuple, list or dict for a multi-input model), got "
            f"{type(leaf).__name__}."
        ),
    ):
        jk.jacobian(model, inputs, "head", strategy="chunked")


def test_model_that_is_not_callable():
    _, x = mlp()
    with pytest.raises(
        TypeError,
        match=exactly(
            "jacobian(model=...): expected a Keras model or a callable "
            "f(inputs) -> tf.Tensor, got str."
        ),
    ):
        jk.jacobian("model.keras", x, "head", strategy="chunked")


def test_model_with_a_dict_output_needs_a_callable_outputs():
    x_in = keras.Input((5,))
    dense = keras.layers.Dense(4, name="dense")
    model = keras.Model(x_in, {"score": dense(x_in)})
    x = np.ones((2, 5), "float32")
    with pytest.raises(
        TypeError,
        match=exactly(
            "jacobian(model=...): the model returned dict, not a single tensor. "
            "Pick one with output= (output=0 .. 0 or output='score'), or pass "
            "outputs=callable that maps them to rows."
        ),
    ):
        jk.jacobian(model, x, "dense", strategy="chunked")
    # ... and the fix it names works
    result = jk.jacobian(
        model, x, "dense", strategy="chunked", outputs=lambda y: y["score"]
    )
    assert result.kernel.shape == (2, 4, 5, 4)


def test_device_that_is_not_a_device_name():
    ex = examples.build("mlp")
    message = (
        "jacobian(device='banana'): not a device name; use 'CPU:0' or 'GPU:0' "
        "(or None for TensorFlow's placement)."
    )
    with pytest.raises(ValueError, match=re.escape(message)):
        jk.jacobian(ex.model, ex.inputs, ex.layer, device="banana")


@pytest.mark.skipif(
    bool(tf.config.list_physical_devices("GPU")), reason="a GPU is visible"
)
def test_device_that_is_not_there():
    ex = examples.build("mlp")
    message = (
        "jacobian(device='GPU:0'): TensorFlow sees no GPU:0 here; visible "
        "devices: CPU:0. Pass one of those, or None."
    )
    with pytest.raises(ValueError, match=re.escape(message)):
        jk.jacobian(ex.model, ex.inputs, ex.layer, device="GPU:0")


def test_memory_budget_with_a_fixed_strategy():
    ex = examples.build("mlp")
    message = (
        "jacobian(memory_budget='1GiB', strategy='jacobian'): a memory budget is "
        "planned for by strategy='auto' only."
    )
    with pytest.raises(ValueError, match=re.escape(message)):
        jk.jacobian(
            ex.model, ex.inputs, ex.layer, strategy="jacobian", memory_budget="1GiB"
        )


@pytest.mark.parametrize("parallel", [0, -1, 2.0, "4", True], ids=repr)
def test_while_parallel_iterations_must_be_a_positive_int(parallel):
    with pytest.raises(
        ValueError,
        match=exactly(
            f"strategies.while(parallel_iterations={parallel!r}): expected a "
            "positive int (rows in flight at once), or None for TensorFlow's "
            "default."
        ),
    ):
        jk.strategies.While(parallel)


# -- inputs of the wrong shape --------------------------------------------------
@pytest.mark.parametrize("flavour", ["keras3", "tf_keras"])
def test_inputs_without_the_batch_axis(flavour):
    ex = examples.build("mlp" if flavour == "keras3" else "tf_keras")
    x = ex.inputs[0]
    width = x.shape[-1]
    with pytest.raises(
        ValueError,
        match=exactly(
            f"jacobian(inputs=...): the model expects shape (None, {width}) (batch "
            f"first), got shape ({width},): the batch axis is missing. Add it: "
            "x[None] (or np.expand_dims(x, 0)) for a single example."
        ),
    ) as raised:
        jk.jacobian(ex.model, x, ex.layer, strategy="chunked")
    # no traced TensorFlow error chained to it: a traceback ends in this message
    assert raised.value.__cause__ is None and raised.value.__suppress_context__


@pytest.mark.parametrize("example", ["cnn2d", "generator", "tf_keras"])
def test_inputs_of_the_wrong_shape(example):
    ex = examples.build(example)
    x = ex.inputs[..., :-1]  # one channel short
    want = (None, *ex.inputs.shape[1:])
    got = x.shape
    with pytest.raises(
        ValueError,
        match=exactly(
            f"jacobian(inputs=...): the model expects shape {want} (batch first), "
            f"got shape {got}. Pass an array of shape "
            f"(batch, {', '.join(map(str, want[1:]))})."
        ),
    ):
        jk.jacobian(ex.model, x, ex.layer, strategy="chunked")


def test_inputs_of_a_multi_input_model():
    ex = examples.build("multi_input")
    xa, xb = ex.inputs
    with pytest.raises(
        ValueError,
        match=exactly(
            "jacobian(inputs=...): the model takes 2 input(s) ('a' (None, 6), 'b' "
            "(None, 4, 3)), got 1 of shape(s) (3, 6). Pass one array per input, "
            "in a tuple, list or dict keyed by input name."
        ),
    ):
        jk.jacobian(ex.model, xa, ex.layer, strategy="chunked")
    with pytest.raises(
        ValueError,
        match=exactly(
            "jacobian(inputs=...): input 'b' of the model expects shape (None, 4, "
            "3) (batch first), got shape (3, 4). Pass an array of shape (batch, "
            "4, 3)."
        ),
    ):
        jk.jacobian(ex.model, {"a": xa, "b": xb[..., 0]}, ex.layer, strategy="chunked")


@pytest.mark.parametrize("example", ["subclassed", "tf_module"])
def test_a_model_that_fails_on_the_inputs(example):
    """Models that declare no input shapes: the model's own complaint, in one
    line of jacobkit's message (no tf.function trace)."""
    ex = examples.build(example)
    x = ex.inputs[:, :-1]
    with pytest.raises(ValueError) as raised:
        jk.jacobian(ex.model, x, ex.layer, strategy="chunked")
    message = str(raised.value)
    assert message.startswith(
        f"jacobian(model=...): calling the model on inputs of shape {x.shape} failed: "
    ), message
    assert message.endswith(
        "Check that the inputs are what the model takes (batch axis first)."
    )
    assert "\n" not in message and "in user code" not in message


def test_a_model_named_after_a_private_class():
    """Keras names a model after its class (``_Net`` -> ``"__net"``), a name
    TensorFlow refuses for a traced graph: the message says how to rename."""

    class _Net(keras.Model):
        def __init__(self):
            super().__init__()
            self.dense = keras.layers.Dense(2)

        def call(self, x):
            return self.dense(x)

    model = _Net()
    x = np.ones((3, 4), "float32")
    model(x)  # eager Keras calls take the name
    with pytest.raises(ValueError, match=r"cannot trace a model named '__net'"):
        jk.jacobian(model, x, model.dense, strategy="chunked")
    # the failed trace leaves no Keras name scope open: a model built later
    # in the process gets its own paths (not "__net/...")
    later = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2, name="d")])
    assert not any(v.path.startswith("__net") for v in later.weights)


# -- strategies that cannot run through a layer --------------------------------------
def _recurrent_model(flavour, kind: str = "LSTM"):
    layers = flavour.layers
    x_in = flavour.Input((6, 3))
    h = layers.Dense(3, name="pre")(x_in)
    h = getattr(layers, kind)(4, name="rnn")(h)
    y = layers.Dense(2, name="head")(h)
    model = flavour.Model(x_in, y)
    x = np.random.default_rng(2).normal(size=(2, 6, 3)).astype("float32")
    return model, x


@pytest.mark.parametrize(
    "flavour, kind, target",
    [
        (keras, "LSTM", "rnn"),
        (keras, "LSTM", "pre"),  # its tangent flows into the loop
        (keras, "GRU", "rnn"),
        (tf_keras, "SimpleRNN", "rnn"),
    ],
    ids=["keras3-lstm", "keras3-before-lstm", "keras3-gru", "tf_keras-simplernn"],
)
def test_forward_mode_refuses_a_recurrent_loop(flavour, kind, target):
    model, x = _recurrent_model(flavour, kind)
    with (
        PeakMemory("CPU:0") as memory,
        pytest.raises(
            ValueError,
            match=exactly(
                f"jacobian(strategy='forward'): forward mode cannot run through layer "
                f"'rnn' ({kind}): TensorFlow's forward mode does not support its "
                "tf.while_loop over time steps. Use strategy='chunked', 'while' or "
                "'loop' for this target (or 'auto', which does not pick forward mode "
                "here)."
            ),
        ) as raised,
    ):
        jk.jacobian(model, x, target, strategy="forward")
    assert memory.extra_bytes < 1 * MiB
    assert raised.value.__cause__ is None and raised.value.__suppress_context__


# -- output= ------------------------------------------------------------------------
def _two_outputs():
    x_in = keras.Input((5,))
    h = keras.layers.Dense(4, activation="tanh", name="dense")(x_in)
    logits = keras.layers.Dense(3, name="logits")(h)
    aux = keras.layers.Dense(2, name="aux")(h)
    model = keras.Model(x_in, [logits, aux], name="two_outputs")
    return model, np.ones((2, 5), "float32")


@pytest.mark.parametrize(
    "output, message",
    [
        (
            "logit",
            "jacobian(output='logit'): the model has 2 outputs: 0 'logits' (shape "
            "(2, 3)), 1 'aux' (shape (2, 2)). Pass output= one of these indices "
            "or names. Did you mean 'logits'?",
        ),
        (
            2,
            "jacobian(output=2): the model has 2 outputs: 0 'logits' (shape (2, "
            "3)), 1 'aux' (shape (2, 2)). Pass output= one of these indices or "
            "names.",
        ),
    ],
    ids=["name", "index"],
)
def test_output_that_the_model_does_not_have(output, message):
    model, x = _two_outputs()
    with pytest.raises(ValueError, match=exactly(message)):
        jk.jacobian(model, x, "dense", strategy="chunked", output=output)


def test_output_of_a_single_output_model():
    model, x = mlp()
    with pytest.raises(
        ValueError,
        match=exactly(
            "jacobian(output=1): the model has a single output (shape (3, 4)). "
            "Drop output=, or pass output=0."
        ),
    ):
        jk.jacobian(model, x, "head", strategy="chunked", output=1)


@pytest.mark.parametrize("two", [False, True], ids=["one output", "two outputs"])
def test_output_given_what_outputs_takes_points_to_outputs(two):
    """output="per_example" (singular): what a row is, swapped for which output."""
    model, x = _two_outputs() if two else mlp()
    layer = "dense" if two else "head"
    with pytest.raises(
        ValueError,
        match=re.escape(
            ". outputs='per_example' (plural) says what a row is; output= picks "
            "one output of a multi-output model."
        ),
    ):
        jk.jacobian(model, x, layer, strategy="chunked", output="per_example")


@pytest.mark.parametrize("output", [1.0, ["logits"]], ids=repr)
def test_output_of_the_wrong_type(output):
    model, x = _two_outputs()
    with pytest.raises(
        TypeError,
        match=exactly(
            f"jacobian(output={output!r}): expected the index (0, 1, ...) or the "
            f"name of one of the model's outputs, got {type(output).__name__}."
        ),
    ):
        jk.jacobian(model, x, "dense", strategy="chunked", output=output)


def test_a_multi_output_model_without_output():
    model, x = _two_outputs()
    with pytest.raises(
        TypeError,
        match=exactly(
            "jacobian(model=...): the model returned list, not a single tensor. "
            "Pick one with output= (output=0 .. 1 or output='logits' / 'aux'), or "
            "pass outputs=callable that maps them to rows."
        ),
    ):
        jk.jacobian(model, x, "dense", strategy="chunked")


# -- layers TensorFlow's vectorization cannot convert -------------------------
def _depthwise_model(custom: bool = False):
    import keras

    class RawDepthwise(keras.layers.Layer):
        """tf.nn.depthwise_conv2d in a layer of no known type."""

        def build(self, shape):
            self.kernel = self.add_weight(shape=(3, 3, shape[-1], 1), name="kernel")

        def call(self, x):
            return tf.nn.depthwise_conv2d(x, self.kernel, [1, 1, 1, 1], "VALID")

    inp = keras.Input((8, 8, 4))
    dw = (
        RawDepthwise(name="dw")
        if custom
        else keras.layers.DepthwiseConv2D(3, name="dw")
    )
    h = keras.layers.Activation("relu")(dw(inp))
    h = keras.layers.Conv2D(6, 1, name="pw")(h)
    h = keras.layers.GlobalAveragePooling2D()(h)
    model = keras.Model(inp, keras.layers.Dense(3, name="head")(h))
    x = np.random.default_rng(0).normal(size=(4, 8, 8, 4)).astype("float32")
    return model, x


@pytest.mark.parametrize("target", ["dw", "inputs"])
def test_chunked_through_a_depthwise_conv_is_refused_in_one_sentence(
    target, caplog, capfd
):
    model, x = _depthwise_model()
    layer = jk.Inputs() if target == "inputs" else target
    with pytest.raises(ValueError) as err:
        jk.jacobian(model, x, layer, strategy="chunked")
    message = str(err.value)
    assert message.startswith("jacobian(strategy='chunked'): ")
    assert "(DepthwiseConv2D)" in message and "'while'" in message
    assert "\n" not in message
    assert not [r for r in caplog.records if r.levelname == "ERROR"]
    assert "ERROR" not in capfd.readouterr().err


def test_auto_leaves_chunked_out_through_a_depthwise_conv_and_agrees():
    model, x = _depthwise_model()
    res = jk.jacobian(model, x, jk.Inputs(), outputs="per_example", cache=False)
    rejected = {r.label: r.reason for r in res.plan.rejected}
    assert "pfor" in rejected["chunked"], rejected
    loop = jk.jacobian(model, x, jk.Inputs(), outputs="per_example", strategy="loop")
    # both float32 on the same model: measured 1.2e-7
    assert testing.max_relative_difference(res[0], loop[0]) < 1e-5


def test_chunked_through_a_conv3d_is_refused_and_auto_leaves_it_out():
    """pfor has no rule for Conv3DBackpropInputV2 (TF 2.21): refused before
    the first call, as a depthwise convolution is; auto plans around it and
    agrees with the float64 reference."""
    keras.utils.set_random_seed(0)
    inp = keras.Input((5, 5, 5, 2))
    h = keras.layers.Conv3D(3, 2, activation="relu", name="c3")(inp)
    h = keras.layers.GlobalAveragePooling3D()(h)
    model = keras.Model(inp, keras.layers.Dense(2, name="head")(h))
    x = np.random.default_rng(0).normal(size=(3, 5, 5, 5, 2)).astype("float32")
    with pytest.raises(ValueError, match=r"pfor\) has no rule .* \(Conv3D\)"):
        jk.jacobian(model, x, "c3", strategy="chunked")
    res = jk.jacobian(model, x, "c3", cache=False)
    assert "pfor" in {r.label: r.reason for r in res.plan.rejected}["chunked"]
    want = testing.float64_reference(model, x, "c3")
    # float32 against float64: measured 2e-7
    assert testing.max_relative_difference(res.kernel, want[0]) < 1e-5


def test_a_pfor_failure_on_an_unknown_layer_is_one_sentence(caplog, capfd):
    # a layer of no known type: found out while tracing, then refused
    model, x = _depthwise_model(custom=True)
    with pytest.raises(ValueError) as err:
        jk.jacobian(model, x, jk.Inputs(), strategy="chunked")
    message = str(err.value)
    assert message.startswith("jacobian(strategy='chunked'): ")
    assert "DepthwiseConv2dNative" in message and "\n" not in message
    assert not [r for r in caplog.records if r.levelname == "ERROR"]
    assert "ERROR" not in capfd.readouterr().err


class _ShiftedDense(keras.layers.Dense):
    """A Dense whose output is shifted after its activation: not the closed
    form ``activation(x @ kernel + bias)`` its rule computes."""

    def call(self, inputs):
        return super().call(inputs) + 1.0


@pytest.mark.parametrize("every_layer", [False, True])
def test_batch_refuses_a_layer_that_computes_more_than_its_closed_form(every_layer):
    """Tapped at its graph node (one target layer), or at its call in the
    traced pass (every variable of the model): the first call's check finds
    the output off the closed form and refuses, naming the layer where it
    is one."""
    model = keras.Sequential(
        [
            keras.Input((4,)),
            _ShiftedDense(3, activation="relu", name="shifted"),
            keras.layers.Dense(2, name="head"),
        ]
    )
    x = np.random.default_rng(0).normal(size=(5, 4)).astype("float32")
    layer = model.trainable_variables if every_layer else "shifted"
    named = "a target layer" if every_layer else "layer 'shifted'"
    with pytest.raises(ValueError, match=f"{named}.* computes more than"):
        jk.jacobian(model, x, layer, outputs="per_example", strategy="batch")
