"""Issue 48's crashes and raw errors: each either works now (checked against
an independent float64 reference) or ends in jacobkit's own words."""

from __future__ import annotations

import importlib
import subprocess
import sys

import keras
import numpy as np
import pytest
import tensorflow as tf

import jacobkit as jk
from jacobkit import testing
from tests.user_layers import Scale, ScaleRule

RNG = np.random.default_rng(48)


def embedding_model() -> keras.Model:
    tokens = keras.Input((5,), dtype="int32")
    h = keras.layers.Embedding(11, 4, name="emb")(tokens)
    h = keras.layers.GlobalAveragePooling1D()(h)
    return keras.Model(tokens, keras.layers.Dense(3, name="head")(h))


@pytest.mark.parametrize("every_variable", [False, True], ids=["layer", "all"])
def test_verify_on_an_embedding_reads_its_indexed_slices(every_variable):
    """The table's gradient is IndexedSlices; verify compared it as an array
    (TypeError). A float64 reference passes, a wrong one is refused."""
    model = embedding_model()
    tokens = RNG.integers(0, 11, size=(2, 5)).astype("int32")
    layer = model.trainable_variables if every_variable else "emb"
    reference = testing.float64_reference(model, tokens, layer, baseline=False)
    assert jk.verify(list(reference), model, tokens, layer) < 1e-5
    wrong = [array.copy() for array in reference]
    wrong[0] = wrong[0] * 1.5
    with pytest.raises(jk.VerificationError, match="^verify: the Jacobian for "):
        jk.verify(wrong, model, tokens, layer)


@keras.saving.register_keras_serializable(package="test_edge_crashes")
class Centre(keras.layers.Layer):
    """Subtracts the batch mean: every example's output mixes the batch's."""

    def call(self, x):
        return x - tf.reduce_mean(x, axis=0, keepdims=True)


def mixing_model() -> keras.Model:
    x = keras.Input((3,))
    h = Centre()(keras.layers.Dense(4, name="m1")(x))
    return keras.Model(x, keras.layers.Dense(2, name="m2")(h))


def test_a_mixing_model_with_variables_is_refused_in_words_and_auto_falls_back():
    """With a list of variables there is no target layer; the refusal named
    ``problem.layer.name`` (AttributeError), so auto and jk.gram crashed."""
    model = mixing_model()
    x = RNG.normal(size=(4, 3)).astype("float32")
    y = np.zeros(4, "float32")
    loss = jk.Loss(lambda _, out: tf.reduce_sum(out**2, axis=-1))
    variables = model.trainable_variables
    with pytest.raises(ValueError, match="mixes examples across the batch") as info:
        jk.jacobian(model, (x, y), variables, outputs=loss, strategy="batch")
    assert "at the targets (m1/kernel, m1/bias, m2/kernel, ...)" in str(info.value)
    reference = testing.float64_reference(
        model, (x, y), variables, outputs=loss, baseline=False
    )
    norms = jk.jacobian(model, (x, y), variables, outputs=loss, reduce="norm")
    largest = max(abs(rows).max() for rows in reference)
    for norm, rows in zip(norms.jacobians.values(), reference):
        expected = np.linalg.norm(rows.reshape(4, -1), axis=1)
        np.testing.assert_allclose(norm, expected, rtol=1e-5, atol=1e-6 * largest)
    gram = jk.gram(model, (x, y), layer=variables, outputs=loss, chunk_examples=4)
    flat = np.concatenate([r.reshape(4, -1) for r in reference], axis=1)
    expected = flat @ flat.T
    np.testing.assert_allclose(
        gram.matrix, expected, rtol=1e-5, atol=1e-6 * abs(expected).max()
    )


def test_separable_conv2d_under_keras_default_name_keeps_its_closed_form():
    """``tf.nn.separable_conv2d`` opens a scope named ``separable_conv2d``
    inside the layer's; the layer's call was taken for that inner scope."""
    x = keras.Input((6, 6, 2))
    h = keras.layers.SeparableConv2D(3, 3)(x)
    h = keras.layers.SeparableConv2D(3, 3)(h)
    model = keras.Model(x, keras.layers.Dense(2)(keras.layers.Flatten()(h)))
    assert model.layers[1].name.startswith("separable_conv2d")
    inputs = RNG.normal(size=(2, 6, 6, 2)).astype("float32")
    variables = model.trainable_variables
    result = jk.jacobian(model, inputs, variables, strategy="batch")
    testing.assert_close(result, testing.float64_reference(model, inputs, variables))


@pytest.mark.parametrize(
    "clip",
    [tf.constant(1.5), np.float32(1.5), np.array(1.5), tf.constant(3, tf.int32)],
    ids=["tf-scalar", "np-float32", "np-0d", "tf-int"],
)
def test_clipped_sum_takes_scalar_tensors(clip):
    reduction = jk.ClippedSum(clip)
    assert type(reduction.clip_norm) is float
    assert reduction.clip_norm == float(np.asarray(clip))


@pytest.mark.parametrize(
    "clip",
    [tf.constant([1.0, 2.0]), tf.constant(True), tf.constant(-1.0), "1.0"],
    ids=["vector", "bool", "negative", "string"],
)
def test_clipped_sum_still_refuses_what_is_not_a_positive_number(clip):
    with pytest.raises(ValueError, match=r"^jk\.ClippedSum\(clip_norm="):
        jk.ClippedSum(clip)


def test_testing_is_an_attribute_of_jacobkit_before_it_is_imported():
    code = "import jacobkit as jk; print(jk.testing.__name__)"
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    )
    assert done.stdout.strip() == "jacobkit.testing"
    assert "testing" in dir(importlib.import_module("jacobkit"))


def mlp() -> keras.Model:
    x = keras.Input((3,))
    h = keras.layers.Dense(5, activation="tanh", name="d1")(x)
    return keras.Model(x, keras.layers.Dense(3, name="d2")(h))


X = RNG.normal(size=(4, 3)).astype("float32")
Y = np.array([0, 1, 2, 0])
LOSS = jk.Loss(
    keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction=None)
)


def test_labels_as_a_python_list_are_one_array():
    """``(x, [0, 1, 2, 0])`` was read as four inputs (optree's structure
    error); the labels are one array, as NumPy's would be."""
    model = mlp()
    listed = jk.jacobian(model, (X, Y.tolist()), "d1", outputs=LOSS)
    arrays = jk.jacobian(model, (X, Y), "d1", outputs=LOSS)
    for a, b in zip(listed.jacobians.values(), arrays.jacobians.values()):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("which", ["y", "sample_weight"])
def test_labels_or_weights_of_another_length_are_refused(which):
    inputs = (X, Y[:3]) if which == "y" else (X, Y, np.ones(3, "float32"))
    with pytest.raises(
        ValueError, match=rf"^jacobian\(inputs=\(x, y.*\): {which} holds 3 example"
    ):
        jk.jacobian(mlp(), inputs, "d1", outputs=LOSS)


def test_an_unbatched_dataset_is_refused_in_words():
    data = tf.data.Dataset.from_tensor_slices((X, Y))
    with pytest.raises(ValueError, match=r"unbatched\? Call dataset\.batch"):
        jk.jacobian(mlp(), data, "d1", outputs=LOSS)


def test_a_wrong_feature_size_with_labels_names_x_against_the_model():
    wide = RNG.normal(size=(4, 5)).astype("float32")
    with pytest.raises(ValueError) as info:
        jk.jacobian(mlp(), (wide, Y), "d1", outputs=LOSS)
    assert str(info.value) == (
        "jacobian(inputs=...): x of (x, y) does not fit the model: the model "
        "expects shape (None, 3) (batch first), got shape (4, 5). Pass an array "
        "of shape (batch, 3)."
    )


def test_jacobian_inside_a_traced_function_says_it_is_eager():
    model = mlp()

    @tf.function
    def step(x):
        return jk.jacobian(model, x, "d1").kernel

    with pytest.raises(TypeError, match="jk.jacobian, jk.gram and jk.verify run "):
        step(X)


def test_jacobian_inside_fit_without_run_eagerly_says_what_to_do():
    model = mlp()

    class Probe(keras.Model):
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def call(self, x):
            return self.inner(x)

        def train_step(self, data):
            x, _ = data
            kernel = jk.jacobian(self.inner, x, "d1").kernel
            return {"largest": tf.reduce_max(tf.abs(kernel))}

    probe = Probe(model)
    probe.compile(optimizer="sgd")
    with pytest.raises(TypeError, match=r"run_eagerly=True"):
        probe.fit(X, Y, epochs=1, verbose=0)
    probe.compile(optimizer="sgd", run_eagerly=True)
    probe.fit(X, Y, epochs=1, verbose=0)


def causal_lm() -> keras.Model:
    tokens = keras.Input((None,), dtype="int32")
    h = keras.layers.Embedding(11, 4, name="tok")(tokens)
    return keras.Model(tokens, keras.layers.Dense(11)(h))


def test_token_attribution_on_one_token_is_refused_in_words():
    ids = RNG.integers(0, 11, size=(2, 1)).astype("int32")
    with pytest.raises(ValueError, match="a prompt of one token has no next token"):
        jk.explain.token_attribution(causal_lm(), ids)
    with_targets = jk.explain.token_attribution(causal_lm(), ids, targets=ids)
    assert with_targets.scores.shape == (2, 1, 1)


@pytest.mark.parametrize("shift", [-3, 20], ids=["negative", "past-the-end"])
def test_token_attribution_refuses_ids_outside_the_vocabulary(shift):
    ids = RNG.integers(0, 11, size=(2, 4)).astype("int32") + shift
    with pytest.raises(
        ValueError,
        match=r"^token_attribution\(inputs=...\): token ids from .* holds 11",
    ):
        jk.explain.token_attribution(causal_lm(), ids)


def test_trak_refuses_one_hot_labels_and_a_one_output_model():
    one_hot = np.eye(3, dtype="float32")[Y]
    with pytest.raises(ValueError, match=r"^explain\.trak\(train=...\): labels of"):
        jk.explain.trak(mlp(), (X, one_hot), (X, Y), dim=4)
    single = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
    with pytest.raises(ValueError, match=r"^explain\.trak\(model_or_checkpoints"):
        jk.explain.trak(single, (X, np.zeros(4, "int32")), (X, Y), dim=4)


def test_trak_takes_the_overwrite_its_stale_out_refusal_advises(tmp_path):
    model = mlp()
    first = jk.explain.trak(model, (X, Y), (X, Y), dim=4, out=tmp_path)
    with pytest.raises(ValueError, match="Pass overwrite=True"):
        jk.explain.trak(model, (X + 1, Y), (X, Y), dim=4, out=tmp_path)
    fresh = jk.explain.trak(
        model, (X + 1, Y), (X, Y), dim=4, out=tmp_path, overwrite=True
    )
    expected = jk.explain.trak(model, (X + 1, Y), (X, Y), dim=4)
    np.testing.assert_allclose(fresh.scores, expected.scores, rtol=1e-6)
    assert not np.allclose(fresh.scores, first.scores)


@keras.saving.register_keras_serializable(package="test_edge_crashes")
class SharedTable(keras.layers.Layer):
    """Calls an inner Dense on a table shared by every example."""

    def build(self, shape):
        self.table = self.add_weight(shape=(5, shape[-1]), trainable=False)
        self.dense = keras.layers.Dense(shape[-1], name="inner")

    def call(self, x):
        return x + tf.reduce_sum(self.dense(tf.sin(self.table)), axis=0)


def test_a_refusal_does_not_quote_the_checks_own_batch_size():
    """The batch checks run on two examples; the refusal said "the batch of
    2" for a user's batch of 6."""
    x = keras.Input((3,))
    model = keras.Model(x, keras.layers.Dense(2)(SharedTable(name="shared")(x)))
    inner = model.get_layer("shared").dense
    with pytest.raises(ValueError, match="shared by every example") as info:
        jk.jacobian(model, np.ones((6, 3), "float32"), inner, strategy="batch")
    assert "batch of 2" not in str(info.value)


@keras.saving.register_keras_serializable(package="test_edge_crashes")
class _Scale(Scale):
    """The register() example's layer, registered by the test below."""


def test_registering_a_rule_drops_the_plans_made_without_it():
    """auto kept the plan (in memory and on disk) that refused ``batch``
    before the rule was registered."""
    from jacobkit.planner import cache
    from jacobkit.problem.call import Call

    x = keras.Input((3, 4))
    model = keras.Model(x, keras.layers.Dense(2)(keras.ops.tanh(_Scale(name="s")(x))))
    inputs = RNG.normal(size=(3, 3, 4)).astype("float32")
    problem = Call(model, "s", outputs="per_example").problem(inputs)
    before = cache.fingerprint(problem, "CPU:0")
    for reduce in (None, "norm"):
        run = jk.jacobian(model, inputs, "s", outputs="per_example", reduce=reduce)
        assert run.strategy != "batch"
    jk.layers.register(_Scale, ScaleRule)
    problem = Call(model, "s", outputs="per_example").problem(inputs)
    assert cache.fingerprint(problem, "CPU:0") != before
    reference = testing.float64_reference(model, inputs, "s", outputs="per_example")
    rows = jk.jacobian(model, inputs, "s", outputs="per_example")
    assert rows.strategy == "batch", rows.plan
    testing.assert_close(rows, reference)
    norms = jk.jacobian(model, inputs, "s", outputs="per_example", reduce="norm")
    assert norms.strategy == "batch", norms.plan
    expected = np.linalg.norm(
        reference[0].reshape(*reference[0].shape[:2], -1), axis=-1
    )
    (norm,) = norms.jacobians.values()
    np.testing.assert_allclose(norm, expected, rtol=1e-5)
