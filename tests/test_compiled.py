"""``jk.function``: the compiled entry point (issue 49).

Each case compares a call traced inside a ``tf.function`` (a Keras
``train_step`` under ``model.fit``, a replica of ``strategy.run``) with the
eager ``jk.jacobian`` on the same inputs (itself checked against float64
by the conformance suites), and the clipped sum of a loss with a float64
tape loop, one tape per example. Tolerances were measured on this file's
models (TF 2.21, oneDNN on) and are written where they are used.
"""

from __future__ import annotations

import os

import keras
import numpy as np
import pytest
import tensorflow as tf

import jacobkit as jk
from jacobkit.problem.reduction import KINDS
from tests.cases import REDUCTIONS, PerRow, clipped_sums, per_example_gradients

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
#: the public kinds ``reduce=`` takes, from the registry
PUBLIC = [
    case for kind, case in zip(KINDS.values(), REDUCTIONS, strict=True) if kind.public
]


def _mlp(dropout: float = 0.0, seed: int = 3) -> keras.Model:
    keras.utils.set_random_seed(seed)
    return keras.Sequential(
        [
            keras.Input((5,)),
            keras.layers.Dense(6, activation="tanh", name="hidden"),
            keras.layers.Dropout(dropout, name="drop"),
            keras.layers.Dense(3, name="head"),
        ]
    )


def _data(n: int = 6, seed: int = 0) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, 5)).astype("float32")
    y = rng.integers(0, 3, size=n)
    w = rng.uniform(0.5, 1.5, size=n).astype("float32")
    return x, y, w


def per_example_loss(y, logits):
    return keras.losses.sparse_categorical_crossentropy(y, logits, from_logits=True)


def _max_diff(got: dict, want: dict) -> float:
    assert got.keys() == want.keys()
    return max(
        float(np.max(np.abs(np.asarray(got[k]) - np.asarray(want[k])))) for k in got
    )


@pytest.mark.parametrize("outputs", ["features", "per_example"])
@pytest.mark.parametrize("case", PUBLIC, ids=lambda c: c.id)
def test_every_kind_in_a_tf_function_equals_the_eager_call(case, outputs):
    """Every public kind of the registry, two row modes, on an MLP: the
    traced call against ``jk.jacobian`` (measured: equal, 0 apart: the same
    planned strategy's computation; 2e-6 allowed for a change of plan).
    A refusal is the same, when ``jk.function`` plans."""
    model = _mlp()
    x, _, _ = _data()
    rows = jk.jacobian(model, x, "hidden", outputs=outputs, cache=False)
    reduce = case.argument(
        PerRow(
            tuple(np.asarray(v) for v in rows.jacobians.values()),
            rows.rows_shape,
            tuple(rows.jacobians),
        )
    )
    kwargs = dict(outputs=outputs, reduce=reduce, cache=False)
    try:
        want = jk.jacobian(model, x, "hidden", **kwargs)
    except ValueError as refused:  # refused alike, when planned
        with pytest.raises(ValueError) as also:
            jk.function(model, "hidden", example=x, **kwargs)
        assert str(also.value) == str(refused)
        return
    got = tf.function(jk.function(model, "hidden", example=x, **kwargs))(x)
    assert _max_diff(got.values, want.jacobians) <= 2e-6
    assert got.values["hidden/kernel"].shape == want.jacobians["hidden/kernel"].shape
    if want.norms is None:
        assert got.norms is None
    else:
        np.testing.assert_allclose(got.norms, want.norms, rtol=1e-5, atol=1e-7)


def _clipped_sum_float64(model, x, y, w, clip):
    """``Σ_i min(1, C/|g_i|) g_i`` over the examples, a float64 tape per
    example on ``model``'s hidden and head layers written out on float64
    copies of their weights."""
    hidden, head = model.get_layer("hidden"), model.get_layer("head")
    kernel, bias, head_k, head_b = (
        tf.cast(v, tf.float64)
        for v in (hidden.kernel, hidden.bias, head.kernel, head.bias)
    )
    targets = [tf.Variable(kernel), tf.Variable(bias)]

    def forward(x):
        return tf.tanh(x @ targets[0] + targets[1]) @ head_k + head_b

    rows = per_example_gradients(forward, targets, (x, y, w), per_example_loss)
    return clipped_sums(rows, clip)


def test_clipped_sum_of_a_loss_against_float64_as_batch_sizes_change():
    """DP-SGD's case: ``jk.Loss`` rows of ``(x, y, w)``, ``ClippedSum``,
    batches of changing size, traced with known sizes and with an unknown
    one (padded to the example's, weight 0). Against a float64 tape loop
    (measured: 9.3e-8 absolute at sums of order 0.1 to 1, float32 against
    float64); one trace per signature."""
    model = _mlp()
    x, y, w = _data(8)
    clip = 0.5
    fn = jk.function(
        model,
        "hidden",
        example=(x, y, w),
        outputs=jk.Loss(per_example_loss),
        reduce=jk.ClippedSum(clip),
        cache=False,
    )
    assert set(fn.variables) == {"hidden/kernel", "hidden/bias"}
    known = tf.function(fn)
    unknown = tf.function(
        fn,
        input_signature=[
            (
                tf.TensorSpec((None, 5)),
                tf.TensorSpec((None,), tf.int64),
                tf.TensorSpec((None,)),
            )
        ],
    )
    # called eagerly: each size its own static signature, planned in the trace
    eager = jk.function(
        model,
        "hidden",
        example=(x, y, w),
        outputs=jk.Loss(per_example_loss),
        reduce=jk.ClippedSum(clip),
        cache=False,
    )
    for size in (8, 5, 8, 5, 3):
        part = (x[:size], y[:size], w[:size])
        want, want_norms = _clipped_sum_float64(model, *part, clip)
        for traced in (known, unknown, eager):
            got = traced(part)
            for name, expected in zip(
                ("hidden/kernel", "hidden/bias"), want, strict=True
            ):
                np.testing.assert_allclose(
                    got.values[name], expected, rtol=1e-5, atol=1e-7
                )
            np.testing.assert_allclose(got.norms, want_norms, rtol=1e-5)
    assert known.experimental_get_tracing_count() == 3  # sizes 8, 5, 3
    assert unknown.experimental_get_tracing_count() == 1
    assert fn.tracing_count == 4  # its own: sizes 8, 5, 3 and the unknown one
    assert eager.tracing_count == 3
    with pytest.raises(tf.errors.InvalidArgumentError, match="as large as the largest"):
        unknown(_data(9))


class DPModel(keras.Model):
    """A custom ``train_step``: the clipped sum of the per-example losses'
    gradients, by a ``jk.function`` planned before ``fit``, then SGD."""

    fn: jk.Function

    def train_step(self, data):
        x, y, w = data
        out = self.fn((x, y, w))
        names = list(self.fn.variables)
        self.optimizer.apply(
            [out.values[n] for n in names], [self.fn.variables[n] for n in names]
        )
        return {"largest_norm": tf.reduce_max(out.norms)}


def _functional(cls: type = keras.Model) -> keras.Model:
    keras.utils.set_random_seed(4)
    inputs = keras.Input((5,))
    hidden = keras.layers.Dense(6, activation="tanh", name="hidden")(inputs)
    return cls(inputs, keras.layers.Dense(3, name="head")(hidden))


def test_a_train_step_under_fit_without_run_eagerly():
    """``model.fit`` traces its step with an unknown batch size (its last
    batch is short): 10 examples in batches of 4, 4 and 2, one epoch; the
    weights after it equal three eager steps of ``jk.jacobian`` and the
    same SGD on a copy (measured: equal)."""
    x, y, w = _data(10)
    model = _functional(DPModel)
    reference = _functional()
    reference.set_weights(model.get_weights())
    loss, clipped = jk.Loss(per_example_loss), jk.ClippedSum(0.5)
    example = (x[:4], y[:4], w[:4])
    model.fn = jk.function(
        model, "hidden", example=example, outputs=loss, reduce=clipped, cache=False
    )
    model.compile(optimizer=keras.optimizers.SGD(0.1))
    model.fit(x, y, sample_weight=w, batch_size=4, epochs=1, shuffle=False, verbose=0)
    assert not model.run_eagerly
    for i in range(0, 10, 4):
        part = tuple(a[i : i + 4] for a in (x, y, w))
        got = jk.jacobian(
            reference, part, "hidden", outputs=loss, reduce=clipped, cache=False
        )
        for v, g in zip(reference.weights[:2], got.jacobians.values(), strict=True):
            v.assign_sub(0.1 * g)
    for mine, theirs in zip(model.weights, reference.weights, strict=True):
        np.testing.assert_allclose(mine.numpy(), theirs.numpy(), rtol=1e-5, atol=1e-7)


def test_dropout_is_one_draw_as_the_eager_call():
    """``training=True`` with Dropout: the traced call equals the eager call
    from the same seed state (exactly), and moves the seed state as one
    call does."""
    model = _mlp(dropout=0.5)
    x, y, w = _data()
    seed = next(v for v in model.non_trainable_variables if "seed" in v.path)
    before = seed.numpy()
    kwargs = dict(
        outputs=jk.Loss(per_example_loss),
        reduce=jk.ClippedSum(0.5),
        training=True,
        cache=False,
    )
    fn = jk.function(model, "hidden", example=(x, y, w), **kwargs)
    assert np.array_equal(seed.numpy(), before)  # planning moves nothing
    got = tf.function(fn)((x, y, w))
    moved = seed.numpy()
    assert not np.array_equal(moved, before)
    seed.assign(before)
    want = jk.jacobian(model, (x, y, w), "hidden", **kwargs)
    np.testing.assert_array_equal(seed.numpy(), moved)
    assert _max_diff(got.values, want.jacobians) == 0.0
    np.testing.assert_array_equal(got.norms, want.norms)


def test_batch_normalization_moves_once_per_call():
    """``training=True`` with BatchNormalization: the moving statistics after
    one traced call equal one ``model(x, training=True)`` on a copy
    (measured: equal), and the result equals the eager call from the same
    state (measured: equal)."""
    keras.utils.set_random_seed(5)
    model = keras.Sequential(
        [
            keras.Input((5,)),
            keras.layers.Dense(6, name="hidden"),
            keras.layers.BatchNormalization(name="bn"),
            keras.layers.Dense(3, name="head"),
        ]
    )
    x, _, _ = _data()
    start = model.get_weights()
    copy = keras.models.clone_model(model)
    copy.set_weights(start)
    kwargs = dict(outputs="per_example", training=True, reduce="norm", cache=False)
    fn = jk.function(model, "hidden", example=x, **kwargs)
    got = tf.function(fn)(x)
    copy(x, training=True)
    moved = [v.numpy() for v in model.non_trainable_variables]
    assert not np.allclose(moved[0], start[4])  # the moving mean moved
    for mine, theirs in zip(moved, copy.non_trainable_variables, strict=True):
        np.testing.assert_allclose(mine, theirs.numpy(), rtol=1e-6, atol=1e-8)
    model.set_weights(start)  # the eager call from the same state
    want = jk.jacobian(model, x, "hidden", **kwargs)
    assert _max_diff(got.values, want.jacobians) <= 1e-6
    for mine, theirs in zip(moved, model.non_trainable_variables, strict=True):
        np.testing.assert_array_equal(mine, theirs.numpy())


def test_a_conv_net_clipped_sum_equals_the_eager_call():
    """A small conv net, a loss's clipped sum (measured: equal)."""
    keras.utils.set_random_seed(6)
    model = keras.Sequential(
        [
            keras.Input((6, 6, 2)),
            keras.layers.Conv2D(3, 3, activation="relu", name="conv"),
            keras.layers.Flatten(),
            keras.layers.Dense(3, name="head"),
        ]
    )
    rng = np.random.default_rng(1)
    x = rng.normal(size=(4, 6, 6, 2)).astype("float32")
    y = rng.integers(0, 3, size=4)
    kwargs = dict(
        outputs=jk.Loss(per_example_loss), reduce=jk.ClippedSum(0.1), cache=False
    )
    fn = jk.function(model, "conv", example=(x, y), **kwargs)
    got = tf.function(fn)((x, y))
    want = jk.jacobian(model, (x, y), "conv", **kwargs)
    assert _max_diff(got.values, want.jacobians) <= 1e-6
    np.testing.assert_allclose(got.norms, want.norms, rtol=1e-5)


def test_eager_calls_inside_a_tf_function_name_jk_function():
    """``jk.jacobian``, ``jk.gram`` and ``jk.verify`` traced: jacobkit's
    message names ``jk.function``; ``jk.function`` itself is built eagerly."""
    model = _mlp()
    x, _, _ = _data()
    result = jk.jacobian(model, x, "hidden", cache=False)
    calls = {
        "jacobian": lambda a: jk.jacobian(model, a, "hidden").kernel,
        "gram": lambda a: jk.gram(model, a, layer="hidden").matrix,
        "verify": lambda a: jk.verify(result, model, a, "hidden") or a,
    }
    for name, call in calls.items():
        with pytest.raises(TypeError, match=r"use jk\.function") as refused:
            tf.function(call)(x)
        assert "SymbolicTensor" not in str(refused.value), name
    with pytest.raises(TypeError, match="build it outside the traced function"):
        tf.function(lambda a: jk.function(model, "hidden", example=a)(a).values)(x)


def test_padded_batches_and_per_example_rows_of_unknown_size():
    """``ClippedSum(pad_batches=True)``: each size padded to its bucket with
    weight 0, the padding's norms cut; per-example rows and their norms
    traced with an unknown batch size, padded and cut. Against the eager
    call (measured: equal)."""
    model = _mlp()
    x, y, _ = _data(8)
    kwargs = dict(
        outputs=jk.Loss(per_example_loss),
        reduce=jk.ClippedSum(0.5, pad_batches=True),
        cache=False,
    )
    fn = jk.function(model, "hidden", example=(x, y), **kwargs)
    for size in (7, 5):
        got = fn((x[:size], y[:size]))
        want = jk.jacobian(model, (x[:size], y[:size]), "hidden", **kwargs)
        assert _max_diff(got.values, want.jacobians) <= 1e-6
        assert got.norms.shape == (size,)
        np.testing.assert_allclose(got.norms, want.norms, rtol=1e-6)
    for reduce in (None, "norm"):
        kwargs = dict(outputs="full", reduce=reduce, cache=False)
        fn = jk.function(model, "hidden", example=x, **kwargs)
        traced = tf.function(fn, input_signature=[tf.TensorSpec((None, 5))])
        got = traced(x[:3])
        want = jk.jacobian(model, x[:3], "hidden", **kwargs)
        assert (
            got.values["hidden/kernel"].shape == want.jacobians["hidden/kernel"].shape
        )
        assert _max_diff(got.values, want.jacobians) <= 1e-6


class Subclassed(keras.Model):
    """A subclassed model: its layers are attributes, its graph is ``call``."""

    def __init__(self) -> None:
        super().__init__(name="subclassed")
        self.hidden = keras.layers.Dense(6, activation="relu", name="hidden")
        self.head = keras.layers.Dense(3, name="head")

    def call(self, x, training=False):
        return self.head(self.hidden(x) + 0.1 * x[:, :1])


def test_a_subclassed_model_in_a_tf_function():
    """A subclassed model's per-example rows projected (``jk.Project``),
    traced, against the eager call (measured: equal)."""
    keras.utils.set_random_seed(7)
    model = Subclassed()
    x, _, _ = _data()
    model(x)
    kwargs = dict(outputs="per_example", reduce=jk.Project(4), cache=False)
    fn = jk.function(model, "hidden", example=x, **kwargs)
    got = tf.function(fn)(x[:5])
    want = jk.jacobian(model, x[:5], "hidden", **kwargs)
    assert got.values["hidden/kernel"].shape == (5, 3, 4)
    assert _max_diff(got.values, want.jacobians) <= 1e-6


@pytest.mark.slow  # 10 s on 2 loaded cores: BERT's passes traced 4 times
def test_a_keras_hub_classifier_of_dict_inputs_in_fit_shapes():
    """A model jacobkit did not write: keras_hub's BERT text classifier
    (random init, one tiny layer), dict inputs of token ids, traced with an
    unknown batch size as ``fit`` traces, padded to the example's: a loss's
    clipped sum over every variable against the eager call (measured:
    9e-13 apart at sums up to 0.012, norms equal)."""
    keras_hub = pytest.importorskip("keras_hub")
    from tests import hub_models

    keras.utils.set_random_seed(0)
    model = keras_hub.models.BertTextClassifier(
        hub_models.bert(30, length=6), num_classes=3, preprocessor=None
    )
    rng = np.random.default_rng(1)
    x = {
        "token_ids": rng.integers(1, 30, (4, 6)).astype("int32"),
        "segment_ids": np.zeros((4, 6), "int32"),
        "padding_mask": np.ones((4, 6), "int32"),
    }
    y = rng.integers(0, 3, 4)
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction=None)
    kwargs = dict(outputs=jk.Loss(loss), reduce=jk.ClippedSum(0.1), cache=False)
    fn = jk.function(model, model.trainable_variables, example=(x, y), **kwargs)
    specs = {k: tf.TensorSpec((None, 6), tf.int32) for k in x}
    traced = tf.function(
        fn, input_signature=[(specs, tf.TensorSpec((None,), tf.int64))]
    )
    part = ({k: v[:3] for k, v in x.items()}, y[:3])
    got = traced(part)
    want = jk.jacobian(model, part, model.trainable_variables, **kwargs)
    assert _max_diff(got.values, want.jacobians) <= 1e-6
    np.testing.assert_allclose(got.norms, want.norms, rtol=1e-5)


#: what padding a batch of unknown size would change, refused in words
_UNKNOWN_REFUSED = {
    "features rows": (dict(), "rows sum over the batch"),
    "a callable's rows": (dict(outputs=lambda y: y[:, :2]), "sum over the batch"),
    "batch statistics": (
        dict(outputs="per_example", training=True, strategy="chunked"),
        "BatchNormalization",
    ),
}


@pytest.mark.parametrize("case", list(_UNKNOWN_REFUSED))
def test_what_padding_would_change_is_refused_in_words(case):
    kwargs, words = _UNKNOWN_REFUSED[case]
    keras.utils.set_random_seed(3)
    model = keras.Sequential(
        [
            keras.Input((5,)),
            keras.layers.Dense(6, name="hidden"),
            keras.layers.BatchNormalization(name="bn"),
            keras.layers.Dense(3, name="head"),
        ]
    )
    x, _, _ = _data()
    fn = jk.function(model, "hidden", example=x, cache=False, **kwargs)
    traced = tf.function(fn, input_signature=[tf.TensorSpec((None, 5))])
    with pytest.raises(ValueError, match=words):
        traced(x)


_REPLICAS = """
import numpy as np, keras, jacobkit as jk

def per_example_loss(y, logits):
    return keras.losses.sparse_categorical_crossentropy(y, logits, from_logits=True)

keras.utils.set_random_seed(3)
with strategy.scope():
    model = keras.Sequential([keras.Input((5,)),
        keras.layers.Dense(6, activation="tanh", name="hidden"),
        keras.layers.Dense(3, name="head")])
rng = np.random.default_rng(0)
x = rng.normal(size=(8, 5)).astype("float32"); y = rng.integers(0, 3, size=8)
w = np.ones(8, "float32")
kwargs = dict(outputs=jk.Loss(per_example_loss), reduce=jk.ClippedSum(0.5), cache=False)
fn = jk.function(model, "hidden", example=(x[:4], y[:4], w[:4]), **kwargs)
dataset = tf.data.Dataset.from_tensor_slices((x, y, w)).batch(8)
batches = strategy.experimental_distribute_dataset(dataset)

@tf.function
def step(batch):
    out = strategy.run(fn, args=(batch,))
    return strategy.reduce("SUM", out.values["hidden/kernel"], axis=None)

got = [step(b) for b in batches][0]
want = sum(jk.jacobian(model, (x[i:i + 4], y[i:i + 4], w[i:i + 4]), "hidden",
    **kwargs).kernel for i in (0, 4))
diff = float(np.max(np.abs(got.numpy() - want.numpy())))
print("max diff", diff)
assert diff < 1e-6, diff
assert fn.tracing_count >= 1
"""


@pytest.mark.slow  # a fresh process with two logical CPUs: 18 s on 2 loaded cores
def test_replicas_of_a_mirrored_strategy(tmp_path):
    """``strategy.run`` on two logical CPUs inside a ``tf.function``: the
    replicas' clipped sums added equal the eager calls on their halves
    (measured: equal)."""
    from tests.test_distribute import _run_on_two_cpus

    ran = _run_on_two_cpus(tmp_path, "compiled_replicas", _REPLICAS)
    assert "max diff" in ran.stdout
