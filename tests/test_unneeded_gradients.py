"""A backward pass taken towards tensors of the forward pass alone
(:func:`jacobkit.strategies.gradients.towards`, ``batch``'s cotangents at
its taps): no gradient at the watched variables' reads is traced, and the
cotangents are TensorFlow's own. The rules are forced on (as with oneDNN
off), so the same holds on either kind of kernels."""

from __future__ import annotations

import contextlib

import numpy as np
import pytest
import tensorflow as tf

from jacobkit.strategies import gradients
from jacobkit.strategies.gradients import rules


@pytest.fixture
def forced(monkeypatch):
    monkeypatch.setattr(rules, "replaces", lambda: True)


def _variables(seed: int, stride: int) -> list[tf.Variable]:
    rng = np.random.default_rng(seed)
    shapes = [(3, 3, 3, 4), (4,), (3, 3, 4, 5), (5,), (5, 2), (2,)]
    return [tf.Variable(rng.normal(size=s)) for s in shapes]


def _traced(variables, x, *, towards: bool, bias_from_end: bool, stride: int):
    """The cotangents at the three layers' ``z`` of the rows ``sum(z3 ** 2)``
    (the tape watching the variables, as ``batch``'s does), and the op types
    the backward pass built."""
    k1, b1, k2, b2, w, bd = variables
    built: list[str] = []

    @tf.function
    def run(x):
        tape = tf.GradientTape(persistent=True, watch_accessed_variables=False)
        with tape:
            tape.watch(variables)
            z1 = tf.nn.bias_add(tf.nn.conv2d(x, k1, 1, "VALID"), b1)
            a1 = tf.nn.relu(z1)
            if bias_from_end:  # a bias that depends on an end: needed
                a1 = tf.nn.bias_add(a1, tf.reduce_mean(z1, axis=(0, 1, 2)))
            z2 = tf.nn.bias_add(tf.nn.conv2d(a1, k2, stride, "VALID"), b2)
            h = tf.reduce_mean(tf.nn.relu(z2), axis=(1, 2))
            z3 = tf.nn.bias_add(tf.matmul(h, w), bd)
            rows = tf.reduce_sum(z3**2, axis=1)
        graph = tf.compat.v1.get_default_graph()
        before = len(graph.get_operations())
        ends = [z1, z2, z3]
        with contextlib.ExitStack() as stack:
            stack.enter_context(gradients.convolution_rules())
            stack.enter_context(gradients.matmul_rules())
            stack.enter_context(gradients.bias_rules())
            if towards:
                stack.enter_context(gradients.towards(ends))
            found = tape.gradient(rows, ends)
        built.extend(op.type for op in graph.get_operations()[before:])
        return found

    found = run(x)
    return [np.asarray(g) for g in found], built


@pytest.mark.parametrize("stride", [1, 2])
@pytest.mark.parametrize("bias_from_end", [False, True])
def test_towards_the_ends_leaves_the_reads_out(forced, stride, bias_from_end):
    """float64, against the same pass's cotangents without ``towards``
    (TensorFlow's tape, every summed gradient traced): the same ops on the
    way to the ends, so equal (measured: 0 difference; tolerance 1e-12
    relative to the largest entry). No kernel or bias gradient is traced
    but a bias that depends on an end's."""
    variables = _variables(stride, stride)
    x = tf.constant(np.random.default_rng(7).normal(size=(2, 9, 9, 3)))
    expected, everything = _traced(
        variables, x, towards=False, bias_from_end=bias_from_end, stride=stride
    )
    found, built = _traced(
        variables, x, towards=True, bias_from_end=bias_from_end, stride=stride
    )
    for got, want in zip(found, expected, strict=True):
        assert np.abs(got - want).max() <= 1e-12 * np.abs(want).max()
    assert everything.count("Conv2DBackpropFilter") == 2
    assert "Conv2DBackpropFilter" not in built
    assert everything.count("BiasAddGrad") == 3 + bias_from_end
    # the bias computed from z1 keeps its gradient (z1's cotangent needs it)
    assert built.count("BiasAddGrad") == (3 + bias_from_end if bias_from_end else 0)
    assert len(built) < len(everything)


def test_outside_towards_every_gradient_is_traced(forced):
    """Without ``towards``, the variables' gradients are there: a pass
    towards the variables gets TensorFlow's own numbers (float64; measured
    0 difference, tolerance 1e-12 relative)."""
    variables = _variables(3, 1)
    x = tf.constant(np.random.default_rng(3).normal(size=(2, 9, 9, 3)))

    def grads(ruled: bool):
        with tf.GradientTape() as tape:
            z1 = tf.nn.bias_add(tf.nn.conv2d(x, variables[0], 1, "VALID"), variables[1])
            total = tf.reduce_sum(z1**2)
        if not ruled:
            return tape.gradient(total, variables[:2])
        with gradients.convolution_rules(), gradients.bias_rules():
            return tape.gradient(total, variables[:2])

    for got, want in zip(grads(True), grads(False), strict=True):
        assert np.abs(got - want).max() <= 1e-12 * np.abs(want).max()
