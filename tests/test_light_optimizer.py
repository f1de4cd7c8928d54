"""jacobkit's compiled computations, called eagerly, run with a lighter graph
optimizer (:class:`jacobkit.keras.compat.LightOptimized`: one round of
TensorFlow's, no memory optimizer on a CPU), the caller's other options and
an explicit choice of either kept, this thread's options put back after the
call; their results unchanged (against a float64 reference computed the
obvious way)."""

from __future__ import annotations

import keras
import numpy as np
import pytest
import tensorflow as tf
from tensorflow.core.protobuf import config_pb2, rewriter_config_pb2
from tensorflow.python.eager import context

import jacobkit as jk
from jacobkit.keras import compat
from jacobkit.problem import Problem
from jacobkit.strategies import REGISTRY

_Rewriter = rewriter_config_pb2.RewriterConfig
COMPILED = [name for name, cls in REGISTRY.items() if cls.compiled]


def _config(options) -> config_pb2.ConfigProto:
    config = config_pb2.ConfigProto()
    config.ParseFromString(options.config_proto_serialized or b"")
    return config


def _seen() -> config_pb2.ConfigProto:
    """This thread's function options as a call made now would run with."""
    return _config(context.context().function_call_options)


def test_an_eager_call_runs_lighter_and_puts_the_options_back():
    before = context.context().function_call_options
    assert _config(before).graph_options.rewrite_options.meta_optimizer_iterations == (
        _Rewriter.DEFAULT_NUM_ITERS
    )
    inside = compat.LightOptimized(_seen)()
    # the caller's options but the rounds (and, on a CPU, the memory optimizer)
    expected = _config(before)
    expected.graph_options.rewrite_options.meta_optimizer_iterations = _Rewriter.ONE
    if not tf.config.list_logical_devices("GPU"):
        expected.graph_options.rewrite_options.memory_optimization = (
            _Rewriter.NO_MEM_OPT
        )
    assert inside == expected
    assert context.context().function_call_options is before


def test_the_callers_choice_of_rounds_and_memory_optimizer_is_kept():
    ctx = context.context()
    before = ctx.function_call_options
    config = _config(before)
    config.graph_options.rewrite_options.meta_optimizer_iterations = _Rewriter.TWO
    config.graph_options.rewrite_options.memory_optimization = _Rewriter.MANUAL
    config.graph_options.rewrite_options.remapping = _Rewriter.OFF
    chosen = context.FunctionCallOptions(config_proto=config)
    ctx.function_call_options = chosen
    try:
        inside = compat.LightOptimized(_seen)()
        assert inside == config
        assert ctx.function_call_options is chosen
    finally:
        ctx.function_call_options = before


def test_options_put_back_when_the_call_raises():
    before = context.context().function_call_options

    def fails():
        raise RuntimeError("inside")

    with pytest.raises(RuntimeError, match="inside"):
        compat.LightOptimized(fails)()
    assert context.context().function_call_options is before


def test_traced_calls_are_the_enclosing_functions():
    seen = []

    @tf.function(autograph=False)
    def outer(x):
        seen.append(compat.LightOptimized(_seen)())
        return x + 1.0

    outer(tf.constant(1.0))
    assert seen[0].graph_options.rewrite_options.meta_optimizer_iterations == (
        _Rewriter.DEFAULT_NUM_ITERS
    )


@pytest.mark.parametrize("name", COMPILED)
def test_compiled_strategies_run_lighter_with_the_same_jacobians(name):
    """Every compiled strategy's computation is called through
    :class:`~jacobkit.keras.compat.LightOptimized`, and its Jacobian is the
    float64 reference's (a tanh Dense layer's, one row per feature ``o``
    summed over the examples ``i``: ``J[o, a, b] = sum_i x[i, a] [o == b]
    tanh'(z[i, o])``, formed by hand).
    Tolerance 5e-5 relative (and 1e-7 absolute): the worst entry over the
    compiled strategies measured 1.2e-5 relative with oneDNN off, 1.6e-6
    with oneDNN on (float32 sums of 3 examples' products).
    """
    keras.utils.set_random_seed(0)
    model = keras.Sequential(
        [keras.Input((6,)), keras.layers.Dense(4, activation="tanh", name="a")]
    )
    x = np.random.default_rng(0).standard_normal((3, 6)).astype("float32")
    found = jk.jacobian(model, x, "a", strategy=name)
    compiled = REGISTRY[name]().compiled_for(Problem(model, x, "a"))
    assert isinstance(compiled.fn, compat.LightOptimized)
    kernel, bias = (v.numpy().astype(np.float64) for v in model.layers[0].weights)
    x64 = x.astype(np.float64)
    slope = 1.0 - np.tanh(x64 @ kernel + bias) ** 2  # (3, 4)
    eye = np.eye(4)
    want_kernel = np.einsum("ia,ob,io->oab", x64, eye, slope)
    want_bias = np.einsum("ob,io->ob", eye, slope)
    got_kernel, got_bias = (np.asarray(v, np.float64) for v in found.values())
    np.testing.assert_allclose(
        got_kernel.reshape(want_kernel.shape), want_kernel, rtol=5e-5, atol=1e-7
    )
    np.testing.assert_allclose(
        got_bias.reshape(want_bias.shape), want_bias, rtol=5e-5, atol=1e-7
    )


@pytest.mark.parametrize("training", [False, True])
def test_every_run_of_a_steady_call_is_under_the_light_options(monkeypatch, training):
    """A steady call runs its trace directly (``problem.cache.Dispatched``),
    under the same light options as the first call that optimized it: a
    run under TensorFlow's defaults would instantiate the trace again, its
    graph optimized in full on the second call. With ``training=True`` the
    computation's assignments still reach the model (its BatchNormalization's
    moving mean moves on every call, as a plain ``model(x, training=True)``'s
    does)."""
    keras.utils.set_random_seed(4)
    model = keras.Sequential(
        [
            keras.Input((6,)),
            keras.layers.Dense(5, activation="tanh", name="hidden"),
            keras.layers.BatchNormalization(name="norm"),
            keras.layers.Dense(3, name="head"),
        ]
    )
    x = np.random.default_rng(4).normal(size=(8, 6)).astype("float32")
    rounds = []
    run = context.Context.call_function

    def recorded(self, *args, **kwargs):
        config = _config(self.function_call_options)
        rounds.append(config.graph_options.rewrite_options.meta_optimizer_iterations)
        return run(self, *args, **kwargs)

    monkeypatch.setattr(context.Context, "call_function", recorded)
    moving = model.get_layer("norm").moving_mean
    means = []
    for _ in range(4):
        jk.jacobian(model, x, "hidden", reduce="norm", training=training)
        means.append(np.array(moving))
    assert rounds and set(rounds) == {_Rewriter.ONE}, rounds
    moved = [not np.array_equal(a, b) for a, b in zip(means, means[1:], strict=False)]
    assert all(moved) if training else not any(moved), means
