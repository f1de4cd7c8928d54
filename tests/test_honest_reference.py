"""The float64 reference is float64 everywhere, and ``assert_close``'s
tolerance follows the float32 error the model itself has.

Measured (TF 2.21 CPU, Keras 3.15), the plain float32 tape loop's error to
the float64 copy: 2e-7 to 9e-7 on the examples, the nested Conv/BN model
and the frozen ResNet50 head; 1.1e-4 on the 32-layer nested tanh MLP below
(its gain of 2 makes it sensitive, as deep models are), where every strategy
is 4.0e-5 to 6.0e-5 from the reference: a fixed 1e-5 fails them all.
"""

from __future__ import annotations

import functools
import re

import keras
import numpy as np
import pytest
import tensorflow as tf

import jacobkit as jk
from jacobkit import testing
from jacobkit.testing import examples
from tests.cases import PROBLEMS, call_kwargs, example

#: the float64 copy's outputs against the model's own float32 outputs: float32
#: rounding of the forward pass, measured at most 3.2e-7 (cnn2d) on the
#: examples and 5.8e-6 on the 34 sensitive layers of ``deep_tanh``
FORWARD_ROUNDING = {"deep_tanh": 2e-5}
DEFAULT_FORWARD_ROUNDING = 2e-6

#: examples Keras cannot rebuild from their config
NOT_CLONEABLE = {"subclassed": "TwoLayer", "tf_module": "_Affine"}
CLONEABLE = [name for name in PROBLEMS if name not in NOT_CLONEABLE]


def _nested_conv(depth: int = 4):
    """A Conv2D stem, then a nested Sequential of Conv2D + BatchNormalization
    blocks inside a nested functional model, then a Dense head."""
    layers = keras.layers
    keras.utils.set_random_seed(0)
    blocks = [keras.Input((8, 8, 6))]
    for i in range(depth):
        blocks += [
            layers.Conv2D(6, 3, padding="same", activation="relu", name=f"c{i}"),
            layers.BatchNormalization(name=f"bn{i}"),
        ]
    inner = keras.Sequential(blocks, name="blocks")
    x = keras.Input((8, 8, 6))
    wrapper = keras.Model(x, inner(x), name="backbone")
    x = keras.Input((8, 8, 3))
    h = layers.Conv2D(6, 3, padding="same", activation="relu", name="stem")(x)
    h = layers.GlobalAveragePooling2D()(wrapper(h))
    model = keras.Model(x, layers.Dense(4, name="head")(h), name="nested_conv")
    examples.randomize_weights(model, seed=0)
    inputs = np.random.default_rng(1).normal(size=(3, 8, 8, 3)).astype("float32")
    return model, inputs


def _deep_tanh(depth: int = 32, gain: float = 2.0):
    """A Dense stem, a nested Sequential of ``depth`` tanh layers with weights
    of scale ``gain / sqrt(width)``, and a Dense head."""
    layers = keras.layers
    width = 32
    body = keras.Sequential(
        [keras.Input((width,))]
        + [layers.Dense(width, activation="tanh", name=f"d{i}") for i in range(depth)],
        name="body",
    )
    x = keras.Input((16,))
    h = layers.Dense(width, activation="tanh", name="stem")(x)
    model = keras.Model(x, layers.Dense(6, name="head")(body(h)), name="deep_tanh")
    rng = np.random.default_rng(0)
    scales = [gain / np.sqrt(w.shape[0]) if w.ndim > 1 else 0.3 for w in model.weights]
    model.set_weights(
        [rng.normal(scale=s, size=w.shape) for s, w in zip(scales, model.weights)]
    )
    inputs = rng.normal(size=(8, 16)).astype("float32")
    return model, inputs


NESTED = {"nested_conv": _nested_conv, "deep_tanh": _deep_tanh}


@functools.cache
def _nested(name: str):
    return NESTED[name]()


def _all_layers(model) -> list:
    """Every layer, recursing into nested models (Keras 3 and tf_keras)."""
    found = []
    for layer in model.layers:
        found.append(layer)
        if hasattr(layer, "layers"):
            found += _all_layers(layer)
    return found


def _as_float64(inputs):
    return tf.nest.map_structure(lambda a: np.asarray(a, "float64"), inputs)


def _model_and_inputs(name: str):
    if name in NESTED:
        return _nested(name)
    ex = example(name)
    return ex.model, ex.inputs


@pytest.mark.parametrize("name", [*NESTED, *CLONEABLE])
def test_float64_copy_is_float64_throughout(name):
    model, inputs = _model_and_inputs(name)
    before = [np.array(w) for w in model.get_weights()]
    copy = testing.float64_copy(model)
    assert copy.weights and {tf.as_dtype(v.dtype) for v in copy.weights} == {tf.float64}
    for layer in _all_layers(copy):
        if type(layer).__name__ == "InputLayer":
            assert layer.output.dtype == "float64", layer.name
        elif not hasattr(layer, "layers"):  # models hold no computation
            assert layer.compute_dtype == "float64", layer.name
    kwargs = call_kwargs(model)
    original = model(inputs, **kwargs)
    inputs64 = _as_float64(inputs)
    copied = copy(inputs64, **kwargs)
    assert copied.dtype == tf.float64
    rounding = FORWARD_ROUNDING.get(name, DEFAULT_FORWARD_ROUNDING)
    assert testing.max_relative_difference(copied, original) <= rounding
    # float64 all the way: a change below float32's resolution reaches the
    # outputs (a float32 layer anywhere on the path would round it away)
    nudged = tf.nest.map_structure(lambda a: a * (1 + 1e-9), inputs64)
    assert np.max(np.abs(copy(nudged, **kwargs) - copied)) > 0
    # the model itself is untouched
    assert {tf.as_dtype(v.dtype) for v in model.weights} == {tf.float32}
    for a, b in zip(before, model.get_weights(), strict=True):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("name", PROBLEMS)
def test_float64_examples_are_float64_throughout(name):
    """The tests' own references come from the float64 builds."""
    model = example(name, "float64").model
    variables = getattr(model, "weights", None) or model.trainable_variables
    assert {tf.as_dtype(v.dtype) for v in variables} == {tf.float64}


@pytest.mark.parametrize("name", list(NOT_CLONEABLE))
def test_float64_copy_refuses_what_it_cannot_rebuild(name):
    ex = example(name)
    refusal = r"cast_copy\(model, 'float64'\): cannot rebuild"
    with pytest.raises(TypeError, match=refusal):
        testing.float64_copy(ex.model)
    # issue 48: the reference was the float32 loop on the model itself, which
    # assert_close then held the model to (a difference of 0.0, a check
    # against nothing); now it is refused, in words
    refusal = r"float64_reference\(model=.*\): no float64 copy of the model"
    with pytest.raises(TypeError, match=refusal) as err:
        testing.float64_reference(
            ex.model,
            ex.inputs,
            _variables(ex),
            call_kwargs=call_kwargs(ex.model),
        )
    assert "testing.reference_jacobian(copy" in str(err.value)


class _Rebuildable(keras.Model):
    """A subclassed model whose layers take the default dtype policy, made
    with a constructor argument (in its config)."""

    def __init__(self, width: int = 4, **kwargs):
        super().__init__(**kwargs)
        self.hidden = keras.layers.Dense(width, activation="tanh")
        self.head = keras.layers.Dense(2)

    def call(self, x):
        return self.head(self.hidden(x) * x[:, :1])


class _NoArguments(keras.Model):
    """A subclassed model whose constructor takes no argument at all."""

    def __init__(self):
        super().__init__()
        self.hidden = keras.layers.Dense(3, activation="tanh")
        self.head = keras.layers.Dense(2)

    def call(self, x):
        return self.head(self.hidden(x) * x[:, :1])


def _by_hand(weights: list[np.ndarray], x: np.ndarray) -> list[np.ndarray]:
    """Per-example rows of ``head(tanh(x W1 + b1) * x[:, :1])``, written out
    in float64 with its own variables: one tape per row."""
    variables = [tf.Variable(w.astype("float64")) for w in weights]
    kernel, bias, head, head_bias = variables
    x64 = tf.constant(x, tf.float64)
    rows = []
    for b in range(len(x)):
        for f in range(2):
            with tf.GradientTape() as tape:
                hidden = tf.tanh(x64 @ kernel + bias) * x64[:, :1]
                y = (hidden @ head + head_bias)[b, f]
            rows.append([g.numpy() for g in tape.gradient(y, variables)])
    return [
        np.stack([r[i] for r in rows]).reshape(len(x), 2, *weights[i].shape)
        for i in range(len(weights))
    ]


@pytest.mark.parametrize("cls", [_Rebuildable, _NoArguments])
def test_a_subclassed_model_is_rebuilt_in_float64(cls):
    """Issue 48: a subclassed model got a float32 loop on itself under the
    float64 reference's name. Now it is made anew in float64 (its
    constructor's arguments under a float64 default policy, built on the
    inputs, the weights copied) and held to a float64 computation by hand:
    measured 0 to 1e-16 (float64 on both sides); the model's own float32
    loop is 2e-8 to 6e-8 from it."""
    keras.utils.set_random_seed(3)
    model = cls()
    x = np.random.default_rng(3).normal(size=(3, 5)).astype("float32")
    model(x)
    variables = model.trainable_variables
    reference = testing.float64_reference(model, x, variables, outputs="per_example")
    assert reference.description.startswith("float64 loop on a float64 copy")
    assert all(r.dtype == np.float64 for r in reference)
    expected = _by_hand([np.asarray(v) for v in variables], x)
    for found, want in zip(reference, expected, strict=True):
        np.testing.assert_allclose(found, want, rtol=1e-12, atol=1e-14)
    assert max(reference.baseline_errors) > 0  # float32 against float64
    # the model itself is untouched, and a layer target is found in the copy
    assert {v.dtype for v in model.weights} == {"float32"}
    by_layer = testing.float64_reference(model, x, model.hidden, outputs="per_example")
    np.testing.assert_allclose(by_layer[0], expected[0], rtol=1e-12, atol=1e-14)


def _variables(ex):
    if isinstance(ex.layer, list):
        return ex.layer
    layer = _find(ex.model, ex.layer)
    return [layer.kernel, layer.bias]


def _find(model, name):
    return next(layer for layer in _all_layers(model) if layer.name == name)


#: forward mode is left out here: 20-30 s per model for its vectorized JVPs
#: through 34 layers (it is checked on every example by the conformance tests)
#: structured is left out too: neither model has a shortcut (it refuses, as
#: the conformance suite checks on every problem without one)
REVERSE = [
    name for name in jk.strategies.REGISTRY if name not in ("forward", "structured")
]


@pytest.mark.parametrize("name", list(NESTED))
@pytest.mark.parametrize("strategy", REVERSE)
def test_derived_tolerance_on_nested_and_deep_models(name, strategy):
    model, inputs = _nested(name)
    stem = model.get_layer("stem")
    reference = _reference(name)
    assert reference.description.startswith("float64 loop on a float64 copy")
    result = jk.jacobian(model, inputs, "stem", strategy=strategy)
    worst = testing.assert_close(result, reference)
    tolerance = [
        max(testing.TOLERANCE[tf.float32], testing.BASELINE_FACTOR * e)
        for e in reference.baseline_errors
    ]
    assert worst <= max(tolerance)
    if name == "deep_tanh":
        # float32 itself is far from float64 here: a fixed 1e-5 would fail a
        # correct result (measured 4.0e-5 to 6.0e-5 for every strategy)
        assert min(reference.baseline_errors) > testing.TOLERANCE[tf.float32]
        with pytest.raises(AssertionError, match="tolerance 1.0e-05"):
            testing.assert_close(result, list(reference))
    # a result off by 5x its tolerance still fails
    wrong = [j * (1 + 5 * t) for j, t in zip(result.jacobians.values(), tolerance)]
    with pytest.raises(AssertionError, match="differs from the reference"):
        testing.assert_close(wrong, reference)
    assert stem.kernel.dtype == "float32"


@functools.cache
def _reference(name: str) -> testing.Reference:
    model, inputs = _nested(name)
    stem = model.get_layer("stem")
    return testing.float64_reference(
        model, inputs, [stem.kernel, stem.bias], call_kwargs={"training": False}
    )


def test_compare_says_what_the_reference_was(tmp_path, capsys):
    """``jacobkit compare --model`` on a nested model: the reference is a
    float64 copy throughout, and the label says so."""
    from jacobkit import cli

    model, inputs = _nested("nested_conv")
    model.save(tmp_path / "nested.keras")
    np.save(tmp_path / "x.npy", inputs)
    args = ["--model", str(tmp_path / "nested.keras"), "--inputs"]
    args += [str(tmp_path / "x.npy"), "--layer", "stem", "--strategies"]
    code = cli.main(["compare", *args, "loop,while", "--repeats", "1"])
    out = capsys.readouterr().out
    assert code == 0, out
    assert (
        "reference: float64 loop on a float64 copy of the model (every variable "
        "float64)" in out
    ), out
    assert "DISAGREE" not in out


# -- a loop that is wholly off lends no tolerance ------------------------------------
def _wholly_off_reference() -> testing.Reference:
    """A non-zero reference whose loop was 100% off: under ``mixed_float16``
    a random-init backbone's features underflow and the loop's Jacobian is
    all zeros, so its own error is 1.0 and 2x that would pass anything."""
    expected = np.arange(1.0, 7.0).reshape(2, 3)
    return testing.Reference((expected,), (1.0,), "float64 loop (test)")


@pytest.mark.parametrize(
    "actual, message",
    [
        (np.zeros((2, 3)), "Jacobian 0 is all zero where the reference is not"),
        (np.full((2, 3), np.nan), "Jacobian 0 holds 6 NaN or infinite entries"),
        (
            np.array([[1.0, 2.0, np.inf], [4.0, 5.0, 6.0]]),
            "Jacobian 0 holds 1 NaN or infinite entries",
        ),
    ],
    ids=["zeros", "nan", "inf"],
)
def test_empty_or_non_finite_result_fails_whatever_the_loop_error(actual, message):
    reference = _wholly_off_reference()
    with pytest.raises(AssertionError, match=message):
        testing.assert_close([actual], reference)
    # nor does a given tolerance let it through
    with pytest.raises(AssertionError, match=message):
        testing.assert_close([actual], list(reference), tolerance=2.0)


def test_derived_tolerance_is_capped():
    reference = _wholly_off_reference()
    expected = reference[0]
    # 60% off everywhere: 2 x the loop's 100% would pass it; the cap does not
    off = expected * (1 + 0.6)
    with pytest.raises(
        AssertionError,
        match=re.escape(
            "max relative difference 6.000e-01 > tolerance 5.0e-01 (2 x the "
            "obvious loop's own error 1.0e+00, capped at MAX_DERIVED_TOLERANCE = "
            "0.5: a loop that far off did not compute this Jacobian either)"
        ),
    ):
        testing.assert_close([off], reference)
    # within the cap, and a small loop error keeps its own tolerance
    assert testing.assert_close([expected * 1.4], reference) == pytest.approx(0.4)
    assert testing.MAX_DERIVED_TOLERANCE == 0.5
    small = testing.Reference((expected,), (1e-3,), "float64 loop (test)")
    testing.assert_close([expected * (1 + 1.5e-3)], small)
    with pytest.raises(AssertionError, match=r"tolerance 2\.0e-03 \(2 x"):
        testing.assert_close([expected * (1 + 3e-3)], small)


def test_an_all_zero_reference_still_takes_an_all_zero_result():
    """Targets that do not reach the rows: zero in both, not a failure."""
    zero = testing.Reference((np.zeros((2, 3)),), (0.0,), "float64 loop (test)")
    assert testing.assert_close([np.zeros((2, 3))], zero) == 0.0
