"""The compile cache: trace once per input signature, never share wrongly.

Parametrized over ``jacobkit.strategies.REGISTRY``, so a newly registered
strategy is checked with no change here. Every test builds its own model: the
cache is per model, and a model another test already compiled would hide a
first trace.
"""

from __future__ import annotations

import gc
import weakref

import keras
import numpy as np
import pytest
import tensorflow as tf

import jacobkit as jk
from jacobkit import testing
from jacobkit.problem import PerModel, Problem
from jacobkit.problem.reduction import Norms
from jacobkit.strategies import REGISTRY

COMPILED = [name for name, cls in REGISTRY.items() if cls.compiled]


def test_every_strategy_but_the_loop_is_compiled():
    assert set(REGISTRY) - set(COMPILED) == {"loop"}


def _model(seed: int = 0):
    """Two Dense layers "a" and "b" of the same shapes (6 -> 6), then a head
    of 8 features: a cache that mixed up the two would still return
    Jacobians of the right shape. (8 > 6: the structured strategy applies,
    through the linear head.)"""
    model = keras.Sequential(
        [
            keras.Input((6,)),
            keras.layers.Dense(6, activation="tanh", name="a"),
            keras.layers.Dense(6, activation="tanh", name="b"),
            keras.layers.Dense(8, name="head"),
        ]
    )
    rng = np.random.default_rng(seed)
    model.set_weights(
        [rng.normal(scale=0.5, size=w.shape).astype("float32") for w in model.weights]
    )
    x = rng.normal(size=(5, 6)).astype("float32")
    return model, x


def _expected(model, x, name, outputs="features"):
    layer = model.get_layer(name)
    return testing.reference_jacobian(
        model, x, [layer.kernel, layer.bias], outputs=outputs
    )


def _compiled(model, x, name, strategy, outputs="features"):
    """The cached compiled computation a call with these arguments uses."""
    return strategy.compiled_for(Problem(model, x, name, outputs=outputs))


@pytest.mark.parametrize("name", COMPILED)
def test_same_shapes_do_not_retrace(name):
    model, x = _model()
    first = jk.jacobian(model, x, "a", strategy=name)
    compiled = _compiled(model, x, "a", REGISTRY[name]())
    traces = compiled.tracing_count
    assert first.stats.traced
    assert traces >= 1

    # new values, same shapes, a new (equal) strategy instance
    x2 = 2 * x
    second = jk.jacobian(model, x2, "a", strategy=REGISTRY[name]())
    assert not second.stats.traced
    assert compiled.tracing_count == traces
    assert second.stats.trace_time_s == first.stats.trace_time_s
    # ... and not a stale result: the kernel Jacobian depends on the inputs
    testing.assert_close(second, _expected(model, x2, "a"))
    assert testing.max_relative_difference(second.kernel, first.kernel) > 0.01


def test_while_with_tensorflows_default_shares_the_explicit_tens_trace():
    """``While()`` (``parallel_iterations=None``: TensorFlow's default of
    10) and ``While(10)`` build the same loop: the second call does not
    trace again, and its answer is the float64 reference's."""
    model, x = _model()
    first = jk.jacobian(model, x, "a", strategy=jk.strategies.While(10))
    second = jk.jacobian(model, 2 * x, "a", strategy=jk.strategies.While())
    assert first.stats.traced and not second.stats.traced
    testing.assert_close(second, _expected(model, 2 * x, "a"))
    # another number of rows in flight is another loop
    third = jk.jacobian(model, x, "a", strategy=jk.strategies.While(2))
    assert third.stats.traced


@pytest.mark.parametrize("name", COMPILED)
def test_new_batch_size_retraces_once(name):
    model, x = _model()
    jk.jacobian(model, x, "a", strategy=name)
    compiled = _compiled(model, x, "a", REGISTRY[name]())
    traces = compiled.tracing_count

    small = x[:2]
    first = jk.jacobian(model, small, "a", strategy=name)
    assert first.stats.traced
    assert compiled.tracing_count == traces + 1
    again = jk.jacobian(model, small, "a", strategy=name)
    assert not again.stats.traced
    back = jk.jacobian(model, x, "a", strategy=name)
    assert not back.stats.traced
    assert compiled.tracing_count == traces + 1
    testing.assert_close(again, _expected(model, small, "a"))
    testing.assert_close(back, _expected(model, x, "a"))


@pytest.mark.parametrize("name", list(REGISTRY))
def test_new_batch_size_with_rows_per_example(name):
    """The number of rows follows the batch size here. The compiled
    computation of the first size was once reused for the second (chunked and
    forward then failed; "full" rows go through the same path)."""
    outputs = "per_example"
    model, x = _model()
    jk.jacobian(model, x, "a", strategy=name, outputs=outputs)
    small = x[:2]
    result = jk.jacobian(model, small, "a", strategy=name, outputs=outputs)
    assert result.rows_shape[0] == 2
    testing.assert_close(result, _expected(model, small, "a", outputs))


@pytest.mark.parametrize("name", COMPILED)
def test_two_layers_do_not_share_a_compiled_computation(name):
    model, x = _model()
    on_a = jk.jacobian(model, x, "a", strategy=name)
    on_b = jk.jacobian(model, x, "b", strategy=name)
    assert on_b.stats.traced  # its own computation, traced for itself
    assert list(on_a) != list(on_b)
    assert on_a.kernel.shape == on_b.kernel.shape
    assert testing.max_relative_difference(on_a.kernel, on_b.kernel) > 0.1
    testing.assert_close(on_a, _expected(model, x, "a"))
    testing.assert_close(on_b, _expected(model, x, "b"))
    # and "a" again still gets its own
    again = jk.jacobian(model, x, "a", strategy=name)
    assert not again.stats.traced
    testing.assert_close(again, _expected(model, x, "a"))
    assert _compiled(model, x, "a", REGISTRY[name]()) is not _compiled(
        model, x, "b", REGISTRY[name]()
    )


@pytest.mark.parametrize("name", COMPILED)
def test_training_flag_is_part_of_the_cache_key(name):
    model, x = _model()
    inference = _compiled(model, x, "a", REGISTRY[name]())
    training = REGISTRY[name]().compiled_for(Problem(model, x, "a", training=True))
    assert inference is not training


class _CountingModule(tf.Module):
    """``x @ w``, counting how often its Python body runs (once per trace)."""

    def __init__(self) -> None:
        super().__init__()
        self.w = tf.Variable(np.ones((3, 2), "float32"))
        self.traces = 0

    def __call__(self, x):
        self.traces += 1
        return tf.matmul(x, self.w)


def test_problem_inspection_traces_once_per_signature():
    """Building the Problem traces the model to learn shapes and connectivity;
    a loop of calls on the same model and input shapes must not pay it again
    (it was 0.2 s per call on a small Conv1D stack)."""
    module = _CountingModule()
    x = np.ones((4, 3), "float32")
    first = Problem(module, x, [module.w])
    assert module.traces == 1 and first.rows_shape == (2,)
    again = Problem(module, x + 1.0, [module.w])
    assert module.traces == 1 and again.rows_shape == (2,)
    Problem(module, x, [module.w], outputs="per_example")  # other rows
    assert module.traces == 2
    wider = Problem(module, np.ones((7, 3), "float32"), [module.w], outputs="full")
    assert module.traces == 3 and wider.rows_shape == (7, 2)


def test_a_problem_has_one_key_built_once():
    """``problem.key``: equal for the same arguments and input shapes, and
    kept by a copy on other inputs; another ``reduce=`` or other rows make
    another key (what compiled computations are kept under)."""
    module = _CountingModule()
    x = np.ones((4, 3), "float32")
    first = Problem(module, x, [module.w])
    assert Problem(module, x + 1.0, [module.w]).key == first.key
    assert first.with_inputs(x + 2.0).key == first.key
    assert first.detached().key == first.key
    norms = first.with_reduction(Norms())
    assert norms.key.reduce == Norms() and norms.key != first.key
    assert norms.key.differentiated == first.key.differentiated
    other = Problem(module, x, [module.w], outputs="per_example")
    assert other.key != first.key and other.key.rows_shape == (4, 2)
    assert len({first.key, norms.key, other.key}) == 3


def test_per_model_state_lives_as_long_as_the_model():
    """A ``PerModel`` slot: one dict per model, gone with the model; an
    object that cannot be weakly referenced gets a fresh dict each time
    (nothing kept, so a reused ``id`` is never served another's entry)."""

    class Kept:
        pass

    slot = PerModel("a test's values")
    module, other = _CountingModule(), _CountingModule()
    value = Kept()
    slot.of(module)["key"] = value
    assert slot.of(module)["key"] is value and "key" not in slot.of(other)
    unreferenceable = object()
    slot.of(unreferenceable)["key"] = value
    assert slot.of(unreferenceable) == {}
    alive = weakref.ref(value)
    del module, value
    gc.collect()
    assert alive() is None


class _SignFlip(tf.Module):
    """A plain callable ``f(x)`` with a Python ``if`` on a tensor: it runs
    only when AutoGraph converts it."""

    def __init__(self) -> None:
        super().__init__()
        self.w = tf.Variable(np.linspace(-1.0, 1.0, 12).reshape(4, 3), dtype="float32")

    def __call__(self, x):
        y = tf.tanh(x @ self.w)
        if tf.reduce_sum(x) > 0:
            y = 2.0 * y
        return y


@pytest.mark.parametrize("name", [*COMPILED, "auto"])
def test_a_plain_callable_keeps_autograph(name):
    """jacobkit traces Keras 3 models without AutoGraph (it never converts
    their code; its conversion of jacobkit's own functions cost ~1 s of the
    first call). A plain callable keeps it: its Python ``if`` on a tensor
    runs, and the Jacobians match the eager loop (both branches taken)."""
    model = _SignFlip()
    for sign in (1.0, -1.0):
        x = sign * np.abs(np.random.default_rng(0).normal(size=(2, 4)))
        x = x.astype("float32")
        try:
            result = jk.jacobian(model, x, [model.w], strategy=name)
        except ValueError as err:  # refused with its own message, not broken
            assert "jacobian(strategy=" in str(err), err
            continue
        expected = testing.reference_jacobian(model, x, [model.w])
        # float32 eager loop as reference (same model; the float64 path would
        # need a float64 copy of a tf.Module): measured agreement ~1e-7
        testing.assert_close(list(result.jacobians.values()), expected)


def test_a_tf_keras_subclassed_layer_keeps_autograph():
    """tf_keras converts a subclassed layer's ``call`` only while AutoGraph
    is on: a Python ``if`` on a tensor there still runs."""
    tf_keras = pytest.importorskip("tf_keras")

    class Doubling(tf_keras.layers.Layer):
        def call(self, x):
            if tf.reduce_sum(x) > 0:
                return 2.0 * x
            return x

    inputs = tf_keras.Input((4,))
    hidden = tf_keras.layers.Dense(3, activation="tanh", name="dense")(inputs)
    model = tf_keras.Model(inputs, Doubling()(hidden))
    x = np.abs(np.random.default_rng(1).normal(size=(2, 4))).astype("float32")
    for name in ("chunked", "while"):
        result = jk.jacobian(model, x, "dense", strategy=name)
        expected = testing.reference_jacobian(
            model, x, model.get_layer("dense").trainable_variables
        )
        testing.assert_close(list(result.jacobians.values()), expected)
