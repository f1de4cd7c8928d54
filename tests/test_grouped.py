"""A plan per group of targets (issue 49): where one layer has no closed
form, the others keep theirs.

Models with one uncovered layer between covered ones: an Embedding -> LSTM
-> Dense classifier, and a conv net with a user's layer with weights and no
rule. Every reduction kind (``tests.cases.REDUCTIONS``, so a new kind is
checked here too) on ``auto`` against the rows' float64 gradients (a tape
per row on a float64 copy), and ``auto`` picks the grouped plan: ``batch``
on the covered targets, a generic strategy on the uncovered layer's, which
its label names. With ``training=True`` and Dropout, every group's pass
draws the same mask: against a float32 tape in a ``keras.StatelessScope``
with the model's seed state before the call (the masks the call draws).

Tolerances (float32, measured on an Intel Xeon with AMX, oneDNN on), the
largest ``max|found - expected| / max|expected|`` over the arrays of a kind
(LSTM / conv net): rows 1.2e-7 / 9.7e-8, norm 1.4e-7 / 6.0e-8, clipped sum
(sums and norms) 7.5e-8 / 8.4e-8, projection 1.2e-7 / 1.4e-7, Gram 1.3e-7 /
1.0e-7; bound by the conformance suite's (1e-6 to 3e-6, as
``tests/test_reduction_conformance.py``'s ``TOLERANCE``). ``training=True``
against the float32 tape: rows 6.9e-8, clipped sum 1.8e-7; bound 1e-5.
"""

from __future__ import annotations

import functools
from typing import Any

import keras
import numpy as np
import pytest
import tensorflow as tf

import jacobkit as jk
from jacobkit import testing
from jacobkit.problem import Problem
from jacobkit.strategies import Grouped
from tests.cases import REDUCTIONS, PerRow, ReductionCase

LOSS = jk.Loss(
    keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction=None)
)
TOLERANCE = {
    "rows": 2e-6,
    "norm": 1e-6,
    "clipped_sum": 1e-6,
    "project": 2e-6,
    "gram": 3e-6,
}
TRAINING_RTOL = 1e-5


@keras.saving.register_keras_serializable("jacobkit_tests")
class Gain(keras.layers.Layer):
    """A user's layer with weights and no rule: a per-channel gain with a
    nonlinear part (``x * w + 0.1 * sin(x) * w``)."""

    def build(self, input_shape: Any) -> None:
        self.w = self.add_weight(
            shape=(input_shape[-1],), initializer="random_uniform", name="w"
        )

    def call(self, x: Any) -> Any:
        return x * self.w + 0.1 * keras.ops.sin(x) * self.w


def _lstm(batch: int = 6, unroll: bool = True) -> tuple[keras.Model, Any, np.ndarray]:
    """Unrolled in the default cases: over its ``tf.while_loop`` pfor took
    13.5 s to trace chunked's pass alone (``lstm_loop``, slow)."""
    keras.utils.set_random_seed(4)
    model = keras.Sequential(
        [
            keras.Input((5,), dtype="int32"),
            keras.layers.Embedding(11, 4, name="embed"),
            keras.layers.LSTM(3, unroll=unroll, name="lstm"),
            keras.layers.Dense(3, name="head"),
        ]
    )
    rng = np.random.default_rng(4)
    return (
        model,
        rng.integers(0, 11, (batch, 5)).astype("int32"),
        rng.integers(0, 3, batch),
    )


def _custom(batch: int = 5, dropout: float = 0.0) -> tuple[keras.Model, Any, Any]:
    keras.utils.set_random_seed(5)
    model = keras.Sequential(
        [
            keras.Input((6, 6, 2)),
            keras.layers.Conv2D(3, 3, activation="tanh", name="conv"),
            Gain(name="gain"),
            keras.layers.Conv2D(4, 2, name="conv2"),
            keras.layers.Flatten(),
            keras.layers.Dropout(dropout, name="drop"),
            keras.layers.Dense(3, name="head"),
        ]
    )
    rng = np.random.default_rng(5)
    x = rng.normal(size=(batch, 6, 6, 2)).astype("float32")
    return model, x, rng.integers(0, 3, batch)


MODELS = {
    "lstm": _lstm,
    "custom": _custom,
    "lstm_loop": functools.partial(_lstm, unroll=False),
}
#: the uncovered layer's targets, which the generic group runs
UNCOVERED = {
    "lstm": ("lstm/lstm_cell/kernel", "lstm/lstm_cell/recurrent_kernel"),
    "custom": ("gain/w",),
    "lstm_loop": ("lstm/lstm_cell/kernel", "lstm/lstm_cell/recurrent_kernel"),
}


@functools.cache
def _subject(name: str) -> tuple[keras.Model, Any, np.ndarray]:
    return MODELS[name]()


@functools.cache
def _per_row(name: str) -> PerRow:
    model, x, y = _subject(name)
    ref = testing.float64_reference(
        model, (x, y), model.trainable_variables, outputs=LOSS, baseline=False
    )
    gradients = tuple(np.asarray(g, np.float64) for g in ref.jacobians)
    return PerRow(gradients, (len(x),), tuple(ref.names))


def _relative_error(found: list[np.ndarray], expected: list[np.ndarray]) -> float:
    assert [np.shape(f) for f in found] == [np.shape(e) for e in expected]
    scale = testing.largest_value(expected)
    return max(
        testing.max_relative_difference(f, e, scale=scale)
        for f, e in zip(found, expected, strict=True)
    )


#: the LSTM's cases that run by default (each LSTM case took 4-11 s on a
#: loaded 2-core machine, the conv net's 1-4 s): the rows and DP-SGD's sum
LSTM_KINDS = ("rows", "clipped_sum")


def _cases() -> list[Any]:
    return [
        pytest.param(
            reduction,
            name,
            id=f"{reduction.id}-{name}",
            marks=[pytest.mark.slow]
            if name == "lstm_loop"
            or (name == "lstm" and reduction.id not in LSTM_KINDS)
            else [],
        )
        for reduction in REDUCTIONS
        for name in MODELS
    ]


@pytest.mark.parametrize(("reduction", "name"), _cases())
def test_auto_runs_a_plan_per_group_and_agrees_with_float64(
    reduction: ReductionCase, name: str
) -> None:
    model, x, y = _subject(name)
    rows = _per_row(name)
    argument = reduction.argument(rows)
    found = reduction.found(
        model, (x, y), model.trainable_variables, argument, outputs=LOSS
    )
    error = _relative_error(found, reduction.expected(rows, argument))
    assert error <= TOLERANCE[reduction.id], error
    if reduction.id == "gram":
        result = jk.gram(model, (x, y), None, model.trainable_variables, outputs=LOSS)
        assert result.strategy == "grouped"
        return
    # the same call again (compiled): which plan ran
    result = jk.jacobian(
        model, (x, y), model.trainable_variables, outputs=LOSS, reduce=argument
    )
    label = result.strategy_config.label
    assert label.startswith("grouped(batch | "), label
    for target in UNCOVERED[name]:
        assert target in label, label
    assert "head/kernel" not in label, label


def _tape(model: keras.Model, x: Any, y: Any) -> list[np.ndarray]:
    """Each example's loss gradient per variable, float32, in a stateless
    scope: the masks of the model's current seed state, nothing moved."""
    variables = model.trainable_variables
    with keras.StatelessScope(), tf.GradientTape(persistent=True) as tape:
        losses = LOSS.fn(y, model(x, training=True))
        rows = tf.unstack(tf.reshape(losses, (-1,)))
    found = [tape.gradient(r, variables) for r in rows]
    return [np.stack([np.asarray(g[k]) for g in found]) for k in range(len(variables))]


@pytest.mark.parametrize("reduce", [None, "clipped_sum"])
def test_training_every_group_draws_the_same_dropout_mask(reduce: Any) -> None:
    model, x, y = _custom(dropout=0.5)
    expected = _tape(model, x, y)  # before the call: the masks it draws
    norms = np.sqrt(sum(np.sum(g.reshape(len(x), -1) ** 2, axis=1) for g in expected))
    clip = float(np.median(norms))
    argument = None if reduce is None else jk.ClippedSum(clip)
    result = jk.jacobian(
        model,
        (x, y),
        model.trainable_variables,
        outputs=LOSS,
        reduce=argument,
        strategy=Grouped(),
        training=True,
    )
    if reduce is not None:
        scales = np.minimum(1.0, clip / norms)
        expected = [np.tensordot(scales, g, 1) for g in expected]
        np.testing.assert_allclose(result.norms, norms, rtol=TRAINING_RTOL)
    found = [np.asarray(v) for v in result.jacobians.values()]
    scale = testing.largest_value(expected)
    print(
        "MEASURED training",
        reduce,
        max(
            testing.max_relative_difference(f, e, scale=scale)
            for f, e in zip(found, expected)
        ),
    )
    for f, e in zip(found, expected, strict=True):
        assert testing.max_relative_difference(f, e, scale=scale) <= TRAINING_RTOL


def test_a_restricted_problem_has_its_own_key_and_targets() -> None:
    model, x, _ = _subject("custom")
    problem = Problem(model, x, model.trainable_variables, outputs="per_example")
    part = problem.restricted((0, 1, 4))
    assert part.target_names == ("conv/kernel", "conv/bias", "conv2/bias")
    assert part.key != problem.key
    assert part.key.differentiated.targets == tuple(
        id(problem.targets[i]) for i in (0, 1, 4)
    )
    assert problem.restricted(range(len(problem.targets))) is problem
    grouped = Grouped()
    groups = grouped.groups(problem)
    assert [g.strategy.name for g in groups] == ["batch", "chunked"]
    assert [problem.target_names[i] for i in groups[1].indices] == ["gain/w"]


def test_names_no_target_of_the_problem_in_words() -> None:
    model, x, y = _subject("custom")
    with pytest.raises(ValueError, match="no target named 'lstm/x'"):
        jk.jacobian(
            model,
            x,
            model.trainable_variables,
            outputs="per_example",
            strategy=Grouped(uncovered=("lstm/x",)),
        )


@keras.saving.register_keras_serializable("jacobkit_tests")
class Noisy(keras.layers.Layer):
    """A user's layer with weights that draws noise no seed state pins."""

    def build(self, input_shape: Any) -> None:
        self.w = self.add_weight(shape=(input_shape[-1],), initializer="ones", name="w")

    def call(self, x: Any, training: bool = False) -> Any:
        noise = tf.random.uniform(tf.shape(x)) * 0.01 if training else 0.0
        return x * self.w + noise


def test_unpinned_randomness_keeps_one_pass_on_every_target() -> None:
    """Each group's pass would draw its own noise: auto does not group, and
    a grouped plan named by hand is refused in words."""
    keras.utils.set_random_seed(6)
    model = keras.Sequential(
        [
            keras.Input((4,)),
            keras.layers.Dense(5, name="dense"),
            Noisy(name="noisy"),
            keras.layers.Dense(3, name="head"),
        ]
    )
    x = np.random.default_rng(6).normal(size=(8, 4)).astype("float32")
    call = dict(outputs="per_example", training=True)
    result = jk.jacobian(model, x, model.trainable_variables, reduce="norm", **call)
    assert not result.strategy_config.label.startswith("grouped"), result.strategy
    grouped = Grouped("chunked", ("noisy/w",))
    with pytest.raises(ValueError, match="runs a forward pass per group"):
        jk.jacobian(model, x, model.trainable_variables, strategy=grouped, **call)
