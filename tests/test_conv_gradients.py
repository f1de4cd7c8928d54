"""A convolution's input gradient as the forward convolution of the flipped
kernel (:mod:`jacobkit.strategies.gradients.convolution`), jacobkit's rule under
TensorFlow's own CPU kernels (oneDNN off). Here it is forced on, on either
kind of kernels: the numbers must not depend on it."""

from __future__ import annotations

import keras
import numpy as np
import pytest
import tensorflow as tf

import jacobkit as jk
from jacobkit import runtime
from jacobkit.strategies import gradients
from jacobkit.strategies.gradients import convolution, dilated, rules
from jacobkit.testing import examples
from tests import gradient_rules
from tests.gradient_rules import assert_agrees_with_float64, assert_in_place_only_inside


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
    """A stride of 2: TensorFlow's own gradient, untouched."""
    x = tf.random.normal((2, 9, 9, 3))
    w = tf.random.normal((3, 3, 3, 4))
    with gradients.convolution_rules():
        _gradients(x, w, tf.ones((2, 5, 5, 4)), 2, "SAME")
    assert not forced


@pytest.mark.parametrize("strides", [1, 2])
def test_no_input_gradient_where_the_tape_needs_none(forced, strides):
    """A convolution whose input the tape needs no gradient of (neither
    watched nor a recorded op's output: a model's first layer on its
    inputs): the rule traces no input gradient (neither its own nor
    TensorFlow's ``Conv2DBackpropInput``), at stride 1 and 2, and the
    kernel's gradient is the float64 reference's, tap by tap
    (:func:`_dilated_reference` undilated). Measured (both kinds): at most
    9.0e-16 relative to the largest entry; the tolerance, 1e-13, is 110x
    that."""
    rng = np.random.default_rng(strides)
    x = tf.constant(rng.normal(size=(2, 9, 10, 3)))
    w = tf.constant(rng.normal(size=(3, 3, 3, 4)))
    out = tf.nn.conv2d(x, w, strides, "SAME").shape
    cotangent = tf.constant(rng.normal(size=out))

    @tf.function
    def kernel_gradient():
        with tf.GradientTape() as tape:
            tape.watch(w)
            total = tf.reduce_sum(tf.nn.conv2d(x, w, strides, "SAME") * cotangent)
        return tape.gradient(total, w)

    with gradients.convolution_rules():
        traced = kernel_gradient.get_concrete_function()
    built = {op.type for op in traced.graph.get_operations()}
    assert not forced and not built & {"Conv2DBackpropInput", "ReverseV2"}
    _, want = _dilated_reference(
        x.numpy(), w.numpy(), cotangent.numpy(), strides, (1, 1), "SAME"
    )
    got = traced().numpy()
    assert np.max(np.abs(got - want)) <= 1e-13 * np.max(np.abs(want))


def _refused(error):
    """Whether ``error`` is TensorFlow's own CPU kernels (oneDNN off)
    refusing a dilated convolution's gradient."""
    return "dilation rates larger than 1" in str(error)


def test_dilated_convolution_keeps_tensorflows_gradient(forced):
    """A dilation of 2 where TensorFlow's own gradient runs (oneDNN's
    kernels): TensorFlow's, untouched. Under TensorFlow's own CPU kernels
    it refuses (``Conv2DBackpropInput``), and the rule takes it
    (:func:`test_dilated_gradient_agrees_with_float64`)."""
    x = tf.random.normal((2, 9, 9, 3))
    w = tf.random.normal((3, 3, 3, 4))

    def dilated():
        with tf.GradientTape() as tape:
            tape.watch(x)
            y = tf.nn.conv2d(x, w, 1, "SAME", dilations=2)
        return tape.gradient(y, x)

    try:
        dilated()
    except tf.errors.InvalidArgumentError as error:
        if not _refused(error):
            raise
        pytest.skip(f"TensorFlow's own gradient refuses a dilation here: {error}")
    with gradients.convolution_rules():
        dilated()
    assert not forced


def _dilated_reference(x, w, cotangent, strides, dilations, padding):
    """float64 numpy: the input and kernel gradients of ``sum(conv2d(x, w) *
    cotangent)`` (``NHWC``), tap by tap, the obvious way."""
    (kh, kw), (dh, dw) = w.shape[:2], dilations
    reach = [(kh - 1) * dh + 1, (kw - 1) * dw + 1]
    out, pads = [], []
    for size, span in zip(x.shape[1:3], reach):
        if padding == "SAME":
            count = -(-size // strides)
            total = max((count - 1) * strides + span - size, 0)
            pads.append((total // 2, total - total // 2))
        else:
            count = (size - span) // strides + 1
            pads.append((0, 0))
        out.append(count)
    padded = np.pad(x, [(0, 0), pads[0], pads[1], (0, 0)])
    grad_padded = np.zeros_like(padded)
    grad_w = np.zeros_like(w)
    for a in range(kh):
        for e in range(kw):
            rows = slice(a * dh, a * dh + (out[0] - 1) * strides + 1, strides)
            cols = slice(e * dw, e * dw + (out[1] - 1) * strides + 1, strides)
            grad_w[a, e] = np.einsum("bijc,bijo->co", padded[:, rows, cols], cotangent)
            grad_padded[:, rows, cols] += np.einsum("bijo,co->bijc", cotangent, w[a, e])
    height, width = x.shape[1:3]
    grad_x = grad_padded[
        :, pads[0][0] : pads[0][0] + height, pads[1][0] : pads[1][0] + width
    ]
    return grad_x, grad_w


@pytest.mark.parametrize("padding", ["SAME", "VALID"])
@pytest.mark.parametrize("strides", [1, 2])
@pytest.mark.parametrize("dilations", [(2, 2), (2, 3), (1, 3)])
def test_dilated_gradient_agrees_with_float64(monkeypatch, padding, strides, dilations):
    """The rule's gradients of a dilated ``Conv2D`` (TensorFlow's undilated
    kernels on the kernel spread out: :func:`dilated.dilated_gradient`),
    taken as under TensorFlow's own CPU kernels on either kind, float64,
    against the obvious taps. Measured: at most 8.1e-16 relative to the
    largest entry over these 12 cases, either kind (the same products
    summed in another order); the tolerance, 1e-13, as above."""
    taken = []
    monkeypatch.setattr(rules, "replaces", lambda: True)
    monkeypatch.setattr(
        dilated, "refuses_dilation", lambda op: taken.append(op) or True
    )
    rng = np.random.default_rng(sum(dilations) + strides)
    x = rng.normal(size=(2, 11, 10, 3))
    w = rng.normal(size=(3, 2, 3, 4))
    out = tf.nn.conv2d(x, w, strides, padding, dilations=dilations).shape
    cotangent = rng.normal(size=out)
    expected = _dilated_reference(x, w, cotangent, strides, dilations, padding)
    with gradients.convolution_rules():
        with tf.GradientTape() as tape:
            inputs = [tf.constant(x), tf.constant(w)]
            tape.watch(inputs)
            y = tf.nn.conv2d(*inputs, strides, padding, dilations=dilations)
            total = tf.reduce_sum(y * cotangent)
        found = tape.gradient(total, inputs)
    assert len(taken) == 1
    for got, want in zip(found, expected):
        scale = np.abs(want).max()
        assert np.abs(got.numpy() - want).max() <= 1e-13 * scale


class _Dilated(keras.layers.Layer):
    """A user's layer: ``tf.nn.conv2d`` dilated by 2 (Keras' ``Conv2D``
    passes a dilation through ``SpaceToBatchND`` instead)."""

    def build(self, shape):
        self.kernel = self.add_weight(shape=(3, 3, shape[-1], 4), name="kernel")

    def call(self, x):
        return tf.nn.conv2d(x, self.kernel, 1, "SAME", dilations=2)


@pytest.mark.parametrize("strategy", ["while", "loop", "forward"])
def test_users_dilated_convolution_on_this_kind(strategy):
    """A user's dilated ``tf.nn.conv2d`` on this kind (the rule where
    TensorFlow's own CPU kernels refuse it, TensorFlow's gradient
    elsewhere), against Keras' ``Conv2D(dilation_rate=2)`` with the same
    kernel (space-to-batch, TensorFlow's own gradients) under ``loop``.
    Measured (float32): at most 5.0e-7 relative to the largest entry with
    oneDNN off, 3.4e-7 on; the tolerance, 5e-6, is 10x that."""

    def model(first):
        inputs = keras.Input((9, 9, 3))
        x = keras.layers.Conv2D(2, 3, name="c2")(first(inputs))
        outputs = keras.layers.Dense(2)(keras.layers.Flatten()(x))
        return keras.Model(inputs, outputs)

    keras.utils.set_random_seed(0)
    users = model(_Dilated(name="c"))
    twin = model(
        keras.layers.Conv2D(
            4, 3, dilation_rate=2, padding="same", use_bias=False, name="c"
        )
    )
    twin.set_weights(users.get_weights())
    x = tf.constant(np.random.default_rng(0).normal(size=(3, 9, 9, 3)), tf.float32)
    found = jk.jacobian(users, x, "c", strategy=strategy)["c/kernel"]
    expected = jk.jacobian(twin, x, "c", strategy="loop")["c/kernel"]
    scale = float(tf.reduce_max(tf.abs(expected)))
    assert float(tf.reduce_max(tf.abs(found - expected))) <= 5e-6 * scale


def test_rule_in_place_only_inside_the_block(forced):
    assert_in_place_only_inside("Conv2D", gradients.convolution_rules)


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
        *gradient_rules.strategies(2),
    ],
    ids=lambda s: s.label,
)
def test_generator_under_the_rule_agrees_with_float64(forced, strategy):
    """The Conv1D generator's first layer through the rule (traced in every
    strategy's computation; 8 features on 6 channels, so that the linear
    head's shortcut applies), against the float64 reference; the tolerance
    is derived from the obvious loop's own error
    (:func:`jacobkit.testing.assert_close`); the rule takes conv2's and
    conv3's input gradients."""
    ex = examples.build("generator", features=8)
    assert_agrees_with_float64(ex.model, ex.inputs, ex.layer, strategy, forced)


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


@pytest.mark.parametrize("padding", ["SAME", "VALID"])
def test_patches_in_pass_give_tensorflows_gradients(forced, monkeypatch, padding):
    """An eager pass of its own (``structured``'s first call's check):
    under :func:`~jacobkit.strategies.gradients.patches_in_pass` the kernel
    gradient from the input's patches, formed in the pass, and the input
    gradient by the flipped kernel, against TensorFlow's own kernels
    (float64, two stacked convolutions). Measured: at most 2.9e-16
    relative to the largest entry over 5 seeds; the tolerance, 1e-13, as
    above. The second convolution's kernel is no target: its gradient is
    not taken, so its patches are never formed."""
    formed = []
    own = convolution.shared_patches

    def counted(op):
        found = own(op)
        formed.append(tuple(op.inputs[1].shape))
        return found

    monkeypatch.setattr(convolution, "shared_patches", counted)
    rng = np.random.default_rng(5)
    x = tf.constant(rng.normal(size=(2, 1, 9, 3)))
    w1 = tf.constant(rng.normal(size=(1, 5, 3, 4)))
    w2 = tf.constant(rng.normal(size=(1, 3, 4, 2)))
    out = 9 if padding == "SAME" else 3
    cotangent = tf.constant(rng.normal(size=(2, 1, out, 2)))

    def gradients_of(sources):
        with tf.GradientTape() as tape:
            tape.watch(sources)
            h = tf.tanh(tf.nn.conv2d(x, w1, 1, padding))
            y = tf.nn.conv2d(h, w2, 1, padding)
        return tape.gradient(y, sources, output_gradients=cotangent)

    expected = gradients_of([x, w1])
    assert not forced and not formed
    with gradients.patches_in_pass():
        found = gradients_of([x, w1])
    assert formed == [(1, 5, 3, 4)]  # the target's, not the later layer's
    assert len(forced) == 2  # both input gradients by the flipped kernel
    for got, want in zip(found, expected, strict=True):
        scale = float(tf.reduce_max(tf.abs(want)))
        assert float(tf.reduce_max(tf.abs(got - want))) <= 1e-13 * scale
    # outside the block, TensorFlow's kernels again
    gradients_of([x, w1])
    assert formed == [(1, 5, 3, 4)] and len(forced) == 2
