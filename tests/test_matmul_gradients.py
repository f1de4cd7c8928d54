"""A ``MatMul``'s gradient through transposed operands
(:mod:`jacobkit.strategies.gradients.matmul`), jacobkit's rule under TensorFlow's
own CPU kernels (oneDNN off). Here it is forced on, on either kind of
kernels and down to one row: the numbers must not depend on it."""

from __future__ import annotations

import numpy as np
import pytest
import tensorflow as tf

from jacobkit.strategies import gradients
from jacobkit.strategies.gradients import matmul, rules
from jacobkit.testing import example_models
from tests import gradient_rules
from tests.gradient_rules import assert_agrees_with_float64, assert_in_place_only_inside


@pytest.fixture
def forced(monkeypatch):
    """The rule on (as with oneDNN off) from one row up, and for each
    gradient asked of it, whether it took it (not TensorFlow's own)."""
    taken = []
    own = matmul._matmul_gradient

    def counted(tensorflows, op, grad):
        fell_back = []

        def fallback(*args):
            fell_back.append(True)
            return tensorflows(*args)

        found = own(fallback, op, grad)
        taken.append(not fell_back)
        return found

    monkeypatch.setattr(rules, "replaces", lambda: True)
    monkeypatch.setattr(matmul, "MATMUL_ROWS", 1)
    monkeypatch.setattr(matmul, "_matmul_gradient", counted)
    return taken


def _gradients(a, b, cotangent, **flags):
    with tf.GradientTape() as tape:
        tape.watch([a, b])
        total = tf.reduce_sum(tf.matmul(a, b, **flags) * cotangent)
    return tape.gradient(total, [a, b])


def _graph_ops(fn, *args):
    graph = tf.function(fn).get_concrete_function(*args).graph
    return [op for op in graph.get_operations() if op.type == "MatMul"]


@pytest.mark.parametrize("rows", [1, 7, 300])
def test_matmul_gradient_is_tensorflows_own(forced, rows):
    """float64, against TensorFlow's own gradient (``transpose_a`` and
    ``transpose_b`` on the kernel). Measured relative to the largest entry
    (oneDNN off): 0 at 7 and 300 rows (the same products in the same
    order), 6.0e-16 at one row (a matrix-vector kernel's order); the
    tolerance, 1e-14, is 17x that."""
    rng = np.random.default_rng(rows)
    a = tf.constant(rng.normal(size=(rows, 40)))
    b = tf.constant(rng.normal(size=(40, 50)))
    cotangent = tf.constant(rng.normal(size=(rows, 50)))
    expected = _gradients(a, b, cotangent)
    assert not forced
    with gradients.matmul_rules():
        found = _gradients(a, b, cotangent)
    assert forced == [True]
    for got, want in zip(found, expected):
        scale = float(tf.reduce_max(tf.abs(want)))
        assert float(tf.reduce_max(tf.abs(got - want))) <= 1e-14 * scale


def test_products_take_no_transpose_flags(forced):
    """Under the rule the traced gradient's two ``MatMul``s run on
    transposed copies, with neither ``transpose_a`` nor ``transpose_b``."""
    a, b, c = tf.ones((8, 3)), tf.ones((3, 5)), tf.ones((8, 5))
    with gradients.matmul_rules():
        found = _graph_ops(lambda a, b, c: _gradients(a, b, c), a, b, c)
    flags = [(op.get_attr("transpose_a"), op.get_attr("transpose_b")) for op in found]
    assert flags == [(False, False)] * 3  # the forward product and two gradients
    own = _graph_ops(lambda a, b, c: _gradients(a, b, c), a, b, c)
    flags = {(op.get_attr("transpose_a"), op.get_attr("transpose_b")) for op in own}
    assert flags == {(False, False), (False, True), (True, False)}


def test_transposed_or_few_rows_keep_tensorflows_gradient(forced, monkeypatch):
    """A product with a transpose flag of its own, and a cotangent of fewer
    rows than :data:`MATMUL_ROWS`: TensorFlow's own gradient, untouched."""
    a, b = tf.random.normal((8, 3)), tf.random.normal((5, 3))
    with gradients.matmul_rules():
        _gradients(a, b, tf.ones((8, 5)), transpose_b=True)
        monkeypatch.setattr(matmul, "MATMUL_ROWS", 9)
        _gradients(a, tf.transpose(b), tf.ones((8, 5)))
    assert forced == [False, False]


def test_large_operands_keep_the_transposed_product(forced, monkeypatch):
    """An operand over :data:`MATMUL_COPY_BYTES` is not copied: its half of
    the gradient is TensorFlow's transposed product (float64, the same
    numbers to 1e-14 relative, as above)."""
    rng = np.random.default_rng(3)
    a = tf.constant(rng.normal(size=(70, 40)))  # 22,400 bytes
    b = tf.constant(rng.normal(size=(40, 50)))  # 16,000 bytes
    cotangent = tf.constant(rng.normal(size=(70, 50)))
    expected = _gradients(a, b, cotangent)
    monkeypatch.setattr(matmul, "MATMUL_COPY_BYTES", 20_000)
    with gradients.matmul_rules():
        traced = _graph_ops(lambda a, b, c: _gradients(a, b, c), a, b, cotangent)
        found = _gradients(a, b, cotangent)
    flags = [(op.get_attr("transpose_a"), op.get_attr("transpose_b")) for op in traced]
    # the forward product, b's copy, a kept transposed
    assert flags == [(False, False), (False, False), (True, False)]
    for got, want in zip(found, expected):
        scale = float(tf.reduce_max(tf.abs(want)))
        assert float(tf.reduce_max(tf.abs(got - want))) <= 1e-14 * scale


def test_copies_are_built_outside_a_loop(forced):
    """A gradient built in a ``tf.while_loop``'s body (``while``'s rows) of
    a product whose operand comes from outside the loop: the transposed copy
    is built outside, once per call, not in the body; float64 against
    TensorFlow's own gradient (measured: 0 difference; tolerance 1e-14
    relative, as above)."""
    rng = np.random.default_rng(4)
    x = tf.constant(rng.normal(size=(8, 6)))
    w = tf.constant(rng.normal(size=(6, 5)))

    def rows(x, w):
        with tf.GradientTape(persistent=True) as tape:
            tape.watch(w)
            y = tf.matmul(x, w)

        def body(i, total):
            scale = tf.cast(i + 1, y.dtype)
            found = tape.gradient(y, w, output_gradients=tf.ones_like(y) * scale)
            return i + 1, total + found

        return tf.while_loop(lambda i, _: i < 3, body, (0, tf.zeros_like(w)))[1]

    expected = tf.function(rows, autograph=False)(x, w)
    with gradients.matmul_rules():
        traced = tf.function(rows, autograph=False).get_concrete_function(x, w)
        found = traced(x, w)
    assert forced and all(forced)
    outside = [op.type for op in traced.graph.get_operations()]
    library = traced.graph.as_graph_def().library.function
    inside = [node.op for f in library for node in f.node_def]
    assert any(t.endswith("While") for t in outside) and "MatMul" in inside
    assert "Transpose" in outside and "Transpose" not in inside
    scale = float(tf.reduce_max(tf.abs(expected)))
    assert float(tf.reduce_max(tf.abs(found - expected))) <= 1e-14 * scale


def test_rule_in_place_only_inside_the_block(forced):
    assert_in_place_only_inside("MatMul", gradients.matmul_rules)


@pytest.mark.parametrize(
    "strategy", gradient_rules.strategies(3), ids=lambda s: s.label
)
def test_mlp_under_the_rule_agrees_with_float64(forced, strategy):
    """The MLP's first Dense through the rule (every strategy's computation),
    against the float64 reference; the tolerance is derived from the
    obvious loop's own error (:func:`jacobkit.testing.assert_close`)."""
    ex = example_models.mlp(batch=6, inputs=5, hidden=7, features=4)
    assert_agrees_with_float64(ex.model, ex.inputs, "hidden1", strategy, forced)
