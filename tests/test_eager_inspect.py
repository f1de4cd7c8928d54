"""A reduced call's inspecting pass run eagerly on two and three examples
(:mod:`jacobkit.problem.eager_inspect`) against the traced pass it replaces
(:func:`jacobkit.problem.inspect.trace`, the reference): the same shapes,
connections and convolution kinds exactly, the same byte counts within a
measured tolerance, and the traced pass wherever the eager record is unsure."""

from __future__ import annotations

import keras
import numpy as np
import pytest
import tensorflow as tf

import jacobkit as jk
from jacobkit.problem import Problem, eager_inspect, inspect
from tests.inspect_models import convnet, mlp

RNG = np.random.default_rng(11)
#: eager / traced byte counts (forward bytes, what a row's backward pass
#: keeps, the sequential walk's figures). Measured on the models below and
#: the reductions benchmark's: every count equal but the walk's first row,
#: equal on the conv nets and the attention model, +1.8% on BERT tiny and
#: +7% / +12% on the MLP at batch 3 / 8 (one of its (B, 16) tensors read
#: later by the eager gradient), so 15% here
BYTES_TOLERANCE = 0.15
LOSS = keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction=None)


def tokens() -> keras.Model:
    """Embedding -> attention -> pooled head: broadcasts and batched matmuls
    whose batch axis is folded with the heads'."""
    inputs = keras.Input((6,), dtype="int32")
    h = keras.layers.Embedding(20, 8, name="embed")(inputs)
    h = keras.layers.MultiHeadAttention(2, 4, name="attention")(h, h)
    h = keras.layers.GlobalAveragePooling1D()(h)
    return keras.Model(inputs, keras.layers.Dense(5, name="head")(h))


def _inputs(model: keras.Model, batch: int) -> tuple[np.ndarray, np.ndarray]:
    shape = (batch, *model.inputs[0].shape[1:])
    if model.inputs[0].dtype.startswith("int"):
        x = RNG.integers(0, 20, shape).astype("int32")
    else:
        x = RNG.normal(size=shape).astype("float32")
    return x, RNG.integers(0, 5, batch).astype("int64")


def _problem(model: keras.Model, batch: int, **kwargs) -> Problem:
    x, y = _inputs(model, batch)
    kwargs.setdefault("reduce", jk.ClippedSum(1.0))
    return Problem(
        model, (x, y), model.trainable_variables, outputs=jk.Loss(LOSS), **kwargs
    )


def _close(eager: int, traced: int) -> bool:
    return abs(eager - traced) <= BYTES_TOLERANCE * max(traced, 1)


@pytest.mark.parametrize("build", [convnet, mlp, tokens])
@pytest.mark.parametrize("batch", [3, 8])
def test_the_eager_inspection_is_the_traced_one(build, batch):
    """Batch 3: one exact pass; batch 8: two passes extrapolated."""
    problem = _problem(build(), batch)
    eager = eager_inspect.inspection(problem)
    traced = inspect.trace(problem)
    assert eager is not None
    assert eager.outputs_shape == traced.outputs_shape
    assert eager.rows == traced.rows
    assert eager.connected == traced.connected
    assert eager.has_loops == traced.has_loops
    assert eager.convolutions == traced.convolutions
    assert eager.unpinned == traced.unpinned
    assert eager.layer_outputs == traced.layer_outputs
    assert eager.transposed == traced.transposed
    assert _close(eager.forward_bytes, traced.forward_bytes)
    assert _close(eager.activation_bytes, traced.activation_bytes)
    assert eager.sequential_memory is not None
    assert traced.sequential_memory is not None
    assert _close(eager.sequential_memory.first_row, traced.sequential_memory.first_row)
    assert _close(eager.sequential_memory.per_row, traced.sequential_memory.per_row)


def test_features_rows_do_not_scale_with_the_batch():
    """``outputs='features'`` rows are summed over the batch: ``(K,)`` on
    any batch, as the traced pass says."""
    model = mlp()
    x = RNG.normal(size=(9, 7)).astype("float32")
    problem = Problem(model, x, "hidden", reduce="norm")
    eager = eager_inspect.inspection(problem)
    assert eager is not None
    assert eager.rows == inspect.trace(problem).rows
    assert tuple(eager.outputs_shape) == (9, 5)


def test_an_unconnected_target_is_found_unconnected():
    """A layer of the model the rows do not reach (its output is the
    model's second, not picked by ``output=``): its weights unconnected in
    both."""
    inputs = keras.Input((4,))
    used = keras.layers.Dense(3, name="used")(inputs)
    unused = keras.layers.Dense(3, name="unused")(inputs)
    model = keras.Model(inputs, [used, unused])
    x = RNG.normal(size=(6, 4)).astype("float32")
    problem = Problem(
        model,
        x,
        [*model.get_layer("used").weights, *model.get_layer("unused").weights],
        reduce="norm",
        unconnected="zero",
        output=0,
    )
    eager = eager_inspect.inspection(problem)
    assert eager is not None
    assert eager.connected == (True, True, False, False)
    assert eager.connected == inspect.trace(problem).connected


class Looping(keras.Model):
    """A subclassed model: its own code may run a ``tf.while_loop``, which
    runs as a Python loop eagerly."""

    def __init__(self) -> None:
        super().__init__()
        self.head = keras.layers.Dense(5)

    def call(self, x):
        return self.head(
            tf.while_loop(lambda h: tf.reduce_sum(h) > 1e9, lambda h: h, [x])[0]
        )


def _lstm() -> keras.Model:
    return keras.Sequential(
        [keras.Input((4, 3)), keras.layers.LSTM(6), keras.layers.Dense(5)]
    )


def _fixed_batch() -> keras.Model:
    inputs = keras.Input((7,), batch_size=8)
    return keras.Model(inputs, keras.layers.Dense(5)(inputs))


def _lambda() -> keras.Model:
    inputs = keras.Input((7,))
    h = keras.layers.Lambda(lambda t: t * 2.0)(inputs)
    return keras.Model(inputs, keras.layers.Dense(5)(h))


@pytest.mark.parametrize(
    "build, shape",
    [(Looping, (8, 7)), (_lstm, (8, 4, 3)), (_fixed_batch, (8, 7)), (_lambda, (8, 7))],
)
def test_the_traced_pass_where_the_record_is_unsure(build, shape):
    """A loop the eager record cannot show (a subclassed model's own code,
    a recurrent layer), a batch size fixed by the model, a user's function
    in a Lambda: no eager inspection; the problem is the traced pass's."""
    model = build()
    x = RNG.normal(size=shape).astype("float32")
    model(x)
    y = RNG.integers(0, 5, shape[0]).astype("int64")
    problem = Problem(
        model,
        (x, y),
        model.trainable_variables,
        outputs=jk.Loss(LOSS),
        reduce=jk.ClippedSum(1.0),
    )
    assert eager_inspect.inspection(problem) is None
    assert problem.has_loops == inspect.trace(problem).has_loops


def test_training_and_rows_calls_keep_the_traced_pass():
    """``training=True`` (the random ops' names come from the traced graph)
    and unreduced rows are inspected by the traced pass."""
    model = mlp()
    assert eager_inspect.inspection(_problem(model, 8, training=True)) is None
    rows = _problem(model, 8, reduce=None)
    assert rows.activation_bytes == inspect.trace(rows).activation_bytes


def test_the_eager_passes_change_nothing_of_the_model():
    """Weights, a dropout layer's seed state and the variables' count are
    those before the passes."""
    model = mlp()
    before = [v.numpy().copy() for v in model.variables]
    count = len(model.variables)
    problem = _problem(model, 8)
    assert eager_inspect.inspection(problem) is not None
    assert len(model.variables) == count
    for was, now in zip(before, model.variables, strict=True):
        np.testing.assert_array_equal(was, now.numpy())


def test_a_reduced_call_on_the_eager_inspection_is_exact():
    """The clipped sum of the conv net, planned on the eager inspection,
    against the float64 reference (per-example gradients, clipped, summed)."""
    model = convnet()
    x, y = _inputs(model, 8)
    found = jk.jacobian(
        model,
        (x, y),
        model.trainable_variables,
        outputs=jk.Loss(LOSS),
        reduce=jk.ClippedSum(0.5),
    )
    per_example = []
    for i in range(8):  # each example's gradient by its own tape
        with tf.GradientTape() as tape:
            loss = LOSS(y[i : i + 1], model(x[i : i + 1]))[0]
        grads = tape.gradient(loss, model.trainable_variables)
        per_example.append(
            np.concatenate([np.asarray(g, np.float64).ravel() for g in grads])
        )
    flat = np.stack(per_example)
    scale = np.minimum(1.0, 0.5 / np.linalg.norm(flat, axis=1))
    expected = scale @ flat
    got = np.concatenate([np.asarray(v, np.float64).ravel() for v in found.values()])
    # float32 gradients of a 3-layer net: measured within 3e-7 of the rows'
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-6)


def test_targets_no_forward_op_reads_keep_the_largest_tensor_alone():
    """Targets the forward pass never reads reach no row: what a row's
    backward pass keeps is the forward pass's working set, its largest
    tensor (the hidden layer's ``(8, 16)`` float32 outputs), in the eager
    and the traced count alike, not every floating tensor."""
    model = keras.Sequential(
        [
            keras.Input((7,)),
            keras.layers.Dense(16, activation="tanh"),
            keras.layers.Dense(5),
        ]
    )
    elsewhere = keras.layers.Dense(3)
    elsewhere.build((None, 4))
    x = RNG.normal(size=(8, 7)).astype("float32")
    problem = Problem(
        model,
        x,
        [elsewhere.kernel],
        outputs="per_example",
        unconnected="zero",
        reduce="norm",
    )
    eager = eager_inspect.inspection(problem)
    assert eager is not None
    largest = 8 * 16 * 4
    assert eager.activation_bytes == largest
    assert inspect.trace(problem).activation_bytes == largest
