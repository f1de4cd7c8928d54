"""What a steady call no longer redoes gives what redoing it gave: the
reduced planner's plan kept between calls, the inspection's key, the
nested hiding of TensorFlow's warnings, ``gram(a)``'s one conversion."""

from __future__ import annotations

import logging

import numpy as np
import pytest
import tensorflow as tf

import jacobkit as jk
from jacobkit import runtime
from jacobkit.planner import paired, reduced
from jacobkit.problem import inspect
from tests.test_reduced_timed import verdict  # noqa: F401  (a fixture)
from tests.test_reductions_budget import _call, _lstm


@pytest.mark.parametrize("way", [paired.OTHER, paired.PRIOR])
def test_the_plan_kept_between_calls_is_the_one_made_afresh(way, verdict, monkeypatch):  # noqa: F811
    """Through the timed trial (pending, then a verdict, a switch where the
    other wins) and the steady calls after it, every call's plan equals the
    one :meth:`Reduced._plan` makes from the planner's state then."""
    verdict(way)
    made = []
    kept = reduced.Reduced.plan

    def checked(self):
        found = kept(self)
        made.append((found, self._plan()))
        return found

    monkeypatch.setattr(reduced.Reduced, "plan", checked)
    model, inputs = _lstm()
    plans = [_call(model, inputs, "norm").plan for _ in range(9)]
    assert len(made) == 9
    assert all(found == afresh for found, afresh in made)
    assert [p.calls for p in plans] == list(range(1, 10))
    assert not plans[4].settled and plans[5].settled
    assert bool(plans[-1].switches) == (way == paired.OTHER)


def test_the_inspection_key_tells_the_nestings_apart():
    """Tuples, lists and dicts (sorted by key) of tensors, as ``to_tensors``
    gives them, have distinct keys; the same nesting, equal ones."""
    t = tf.zeros((2, 3))
    nests = [t, (t,), [t], (t, t), [t, t], (t, (t,)), {"a": t}, {"b": t}]
    keys = [inspect._structure(n) for n in nests]
    assert len(set(keys)) == len(nests)
    assert inspect._structure({"b": t, "a": t}) == inspect._structure({"a": t, "b": t})
    assert inspect._structure((t, [t])) == inspect._structure((t + 1, [t]))


def test_nested_hiding_of_warnings_ends_with_the_outermost(caplog):
    """An inner :func:`runtime.tensorflow_warnings` adds nothing: after it
    ends, the outer one still hides; after the outer ends, nothing does."""
    logger = logging.getLogger("tensorflow")
    with caplog.at_level(logging.WARNING, logger="tensorflow"):
        with runtime.tensorflow_warnings():
            with runtime.tensorflow_warnings():
                logger.warning("inner")
            logger.warning("outer")
            logger.error("an error")
        logger.warning("after")
    assert [r.getMessage() for r in caplog.records] == ["an error", "after"]


def test_gram_of_one_set_is_gram_of_it_with_itself():
    """``gram(a)`` converts ``a`` once and reads it as both sets: the
    matrix of ``gram(a, a)``, which converts each (``gram(a)`` takes the
    symmetric path, so not bitwise: measured 9.5e-7 absolute, 4.2e-7
    relative at most; tolerance 2e-6), and symmetric."""
    import keras

    keras.utils.set_random_seed(0)
    model = keras.Sequential(
        [
            keras.Input((5,)),
            keras.layers.Dense(4, activation="tanh"),
            keras.layers.Dense(3),
        ]
    )
    x = np.random.default_rng(0).normal(size=(6, 5)).astype("float32")
    one = jk.gram(model, x)
    two = jk.gram(model, x, x)
    assert one.matrix.shape == (18, 18)
    np.testing.assert_allclose(one.matrix, two.matrix, rtol=2e-6, atol=2e-6)
    np.testing.assert_array_equal(one.matrix, one.matrix.T)
    assert one.rows_shape_a == one.rows_shape_b == two.rows_shape_b
