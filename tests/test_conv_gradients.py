"""A convolution's input gradient as the forward convolution of the flipped
kernel (:mod:`jacobkit.strategies.gradients.convolution`), jacobkit's rule under
TensorFlow's own CPU kernels (oneDNN off). Here it is forced on, on either
kind of kernels: the numbers must not depend on it."""

from __future__ import annotations

import numpy as np
import pytest
import tensorflow as tf
from tensorflow.python.framework import ops

import jacobkit as jk
from jacobkit import runtime, testing
from jacobkit.strategies import gradients
from jacobkit.strategies.gradients import convolution, rules
from jacobkit.testing import examples


@pytest.fixture
def forced(monkeypatch):
    """The rule on (as with oneDNN off), and a count of the input gradients
    it took."""
    taken = []
    own = convolution.input_gradient

    def counted(*args):
        taken.append(args)
        return own(*args)

    monkeypatch.setattr(rules, "replaces", lambda: True)
    monkeypatch.setattr(convolution, "input_gradient", counted)
    return taken


def _gradients(x, w, cotangent, strides, padding):
    with tf.GradientTape() as tape:
        tape.watch([x, w])
        y = tf.nn.conv2d(x, w, strides, padding)
        total = tf.reduce_sum(y * cotangent)
    return tape.gradient(total, [x, w])


@pytest.mark.parametrize("padding", ["SAME", "VALID"])
@pytest.mark.parametrize("window", [(1, 1), (1, 4), (1, 5), (3, 3), (2, 5), (3, 2)])
def test_input_gradient_is_tensorflows_own(forced, padding, window):
    """float64, against TensorFlow's ``Conv2DBackpropInput`` and
    ``Conv2DBackpropFilter``. Measured: at most 7.1e-15 relative to the
    largest entry (the same products summed in another order); the
    tolerance, 1e-13, is 14x that."""
    rng = np.random.default_rng(sum(window))
    x = tf.constant(rng.normal(size=(2, 9, 10, 3)))
    w = tf.constant(rng.normal(size=(*window, 3, 4)))
    out = tf.nn.conv2d(x, w, 1, padding).shape
    cotangent = tf.constant(rng.normal(size=out))
    expected = _gradients(x, w, cotangent, 1, padding)
    assert not forced
    with gradients.convolution_rules():
        found = _gradients(x, w, cotangent, 1, padding)
    assert len(forced) == 1  # the input's gradient was the rule's
    for got, want in zip(found, expected):
        scale = float(tf.reduce_max(tf.abs(want)))
        assert float(tf.reduce_max(tf.abs(got - want))) <= 1e-13 * scale


def test_strided_convolution_keeps_tensorflows_gradient(forced):
    """A stride of 2 or a dilation: TensorFlow's own gradient, untouched."""
    x = tf.random.normal((2, 9, 9, 3))
    w = tf.random.normal((3, 3, 3, 4))
    with gradients.convolution_rules():
        _gradients(x, w, tf.ones((2, 5, 5, 4)), 2, "SAME")
        with tf.GradientTape() as tape:
            tape.watch(x)
            y = tf.nn.conv2d(x, w, 1, "SAME", dilations=2)
        tape.gradient(y, x)
    assert not forced


def test_rule_in_place_only_inside_the_block(forced, monkeypatch):
    registry = ops._gradient_registry._registry
    own = registry["Conv2D"]
    with gradients.convolution_rules():
        assert registry["Conv2D"] is not own
        with gradients.convolution_rules():  # nested: one replacement
            assert registry["Conv2D"] is not own
        assert registry["Conv2D"] is not own
    assert registry["Conv2D"] is own
    assert not runtime.PROCESS.gradient_rules


def test_not_replaced_under_onednn(monkeypatch):
    here = runtime.cpu_kind()
    for onednn in (True, False):
        kind = runtime.CpuKind(here.model, here.flags, onednn)
        monkeypatch.setattr(runtime, "cpu_kind", lambda kind=kind: kind)
        if tf.config.list_logical_devices("GPU"):
            assert not rules.replaces()
        else:
            assert rules.replaces() is not onednn


@pytest.mark.parametrize(
    "strategy",
    [
        jk.strategies.Structured(jk.strategies.While()),
        jk.strategies.Structured(jk.strategies.Batch()),
        jk.strategies.While(),
        jk.strategies.Chunked(2),
        jk.strategies.Batch(),
        jk.strategies.Jacobian(),
        jk.strategies.Loop(),  # eager: the rule in place during each call
        jk.strategies.Forward(),  # forward mode: the rule differentiated
    ],
    ids=lambda s: s.label,
)
def test_generator_under_the_rule_agrees_with_float64(forced, strategy):
    """The Conv1D generator's first layer through the rule (traced in every
    strategy's computation; 8 features on 6 channels, so that the linear
    head's shortcut applies), against the float64 reference; the tolerance
    is derived from the obvious loop's own error
    (:func:`jacobkit.testing.assert_close`)."""
    ex = examples.build("generator", features=8)
    result = jk.jacobian(ex.model, ex.inputs, ex.layer, strategy=strategy)
    if strategy.name != "forward":
        assert forced  # conv2's and conv3's input gradients were the rule's
    # forward mode: TensorFlow's forwardprop traces each op's JVP (through
    # its registered gradient) once per op, attributes and shapes for the
    # whole process, so whether the rule was in place depends on what ran
    # before in the process (a CI worker had traced the generator's Conv2D
    # JVP without it); the values agree either way
    expected = testing.float64_reference(ex.model, ex.inputs, ex.layer)
    testing.assert_close(result, expected)


def _rows_in_a_loop(x, w, cotangents):
    """Each cotangent's input and kernel gradients of ``conv2d(x, w)``, the
    rows in a ``tf.while_loop`` (``tf.map_fn``) inside a ``tf.function``."""

    @tf.function
    def rows():
        with tf.GradientTape(persistent=True) as tape:
            tape.watch([x, w])
            y = tf.nn.conv2d(x, w, 1, "SAME")
        return tf.map_fn(
            lambda c: tape.gradient(y, [x, w], output_gradients=c),
            cotangents,
            fn_output_signature=[x.dtype, w.dtype],
        )

    return rows()


def test_loop_invariant_patches_give_the_kernel_gradient(forced, monkeypatch):
    """Rows in a loop: the kernel gradient from the input's patches, formed
    once outside the loop, against TensorFlow's own ``Conv2DBackpropFilter``
    (float64). Measured: at most 2.8e-16 relative to the largest entry over
    5 seeds (the same products summed in another order); the tolerance,
    1e-13, as above."""
    formed = []
    own = convolution.shared_patches

    def counted(op):
        found = own(op)
        formed.append(found)
        return found

    monkeypatch.setattr(convolution, "shared_patches", counted)
    rng = np.random.default_rng(3)
    x = tf.constant(rng.normal(size=(2, 1, 9, 3)))
    w = tf.constant(rng.normal(size=(1, 5, 3, 4)))
    cotangents = tf.constant(rng.normal(size=(4, 2, 1, 9, 4)))
    expected = _rows_in_a_loop(x, w, cotangents)
    assert not formed
    with gradients.convolution_rules():
        found = _rows_in_a_loop(x, w, cotangents)
    assert len(formed) == 1 and formed[0] is not None  # once, before the loop
    for got, want in zip(found, expected):
        scale = float(tf.reduce_max(tf.abs(want)))
        assert float(tf.reduce_max(tf.abs(got - want))) <= 1e-13 * scale


def test_patches_not_formed_outside_a_loop_or_when_large(forced, monkeypatch):
    """One gradient in the forward pass's own graph: TensorFlow's
    ``Conv2DBackpropFilter`` (no patches to share); patches over
    :data:`~jacobkit.strategies.gradients.SHARED_PATCHES_BYTES`: the same."""
    formed = []
    own = convolution.shared_patches
    monkeypatch.setattr(convolution, "shared_patches", lambda op: formed.append(op))
    x = tf.random.normal((2, 1, 9, 3))
    w = tf.random.normal((1, 5, 3, 4))
    with gradients.convolution_rules():
        tf.function(lambda: _gradients(x, w, tf.ones((2, 1, 9, 4)), 1, "SAME"))()
    assert not formed
    monkeypatch.setattr(convolution, "shared_patches", own)
    monkeypatch.setattr(convolution, "SHARED_PATCHES_BYTES", 100)
    taken = []
    filters = convolution._gen_nn_ops.conv2d_backprop_filter
    monkeypatch.setattr(
        convolution._gen_nn_ops,
        "conv2d_backprop_filter",
        lambda *a, **k: taken.append(1) or filters(*a, **k),
    )
    with gradients.convolution_rules():
        _rows_in_a_loop(x, w, tf.ones((3, 2, 1, 9, 4)))
    assert taken  # too large to hold: TensorFlow's kernel in each row
