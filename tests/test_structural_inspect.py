"""A reduced call's inspection read from the model's structure
(:mod:`jacobkit.problem.structural_inspect`) against the eager passes'
(:mod:`jacobkit.problem.eager_inspect`, the reference): the same shapes,
rows, connections and convolution kinds exactly, byte counts bounded above
within the stated factor; ``None`` wherever the structure cannot tell.
And ``batch``'s numeric checks trusted (:func:`structural_inspect.trusted`)
only where the test suite proves them: a user's rule, a subclassed model,
``training=True``, a layer called twice keep the numeric check."""

from __future__ import annotations

import keras
import numpy as np
import pytest
import tensorflow as tf

import jacobkit as jk
from jacobkit import layers, runtime
from jacobkit.layers.dense import DenseRule
from jacobkit.planner import reduced
from jacobkit.problem import Problem, eager_inspect, structural_inspect
from jacobkit.strategies import gradients
from jacobkit.strategies.batch import checks
from tests.cases import clipped_sums, per_example_gradients
from tests.inspect_models import convnet, mlp

RNG = np.random.default_rng(5)
LOSS = keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction=None)
#: the structural figures over the eager passes' (activations and forward
#: bytes): at least 1 (an upper bound), at most the factor
FACTOR = structural_inspect.ACTIVATION_FACTOR


def mobilenet() -> keras.Model:
    return keras.applications.MobileNetV2(
        input_shape=(32, 32, 3), alpha=0.35, weights=None, classes=5
    )


def hub_bert() -> keras.Model:
    keras_hub = pytest.importorskip("keras_hub")
    backbone = keras_hub.models.BertBackbone(
        vocabulary_size=50,
        num_layers=2,
        num_heads=2,
        hidden_dim=16,
        intermediate_dim=32,
        max_sequence_length=8,
    )
    return keras_hub.models.BertTextClassifier(
        backbone, num_classes=5, preprocessor=None
    )


def _inputs(model: keras.Model, batch: int) -> tuple:
    y = RNG.integers(0, 5, batch).astype("int64")
    if isinstance(model, Subclassed):
        return RNG.normal(size=(batch, 7)).astype("float32"), y
    if isinstance(model.inputs[0], dict) or len(model.inputs) > 1:
        ids = RNG.integers(0, 50, (batch, 8)).astype("int32")
        x = {
            "token_ids": ids,
            "segment_ids": np.zeros_like(ids),
            "padding_mask": np.ones_like(ids),
        }
        return x, y
    shape = (batch, *model.inputs[0].shape[1:])
    return RNG.normal(size=shape).astype("float32"), y


def _problem(model: keras.Model, batch: int, **kwargs) -> Problem:
    kwargs.setdefault("reduce", jk.ClippedSum(1.0))
    return Problem(
        model,
        _inputs(model, batch),
        model.trainable_variables,
        outputs=jk.Loss(LOSS),
        **kwargs,
    )


@pytest.mark.parametrize("build", [convnet, mlp, mobilenet, hub_bert])
def test_the_structural_inspection_is_the_eager_one(build):
    problem = _problem(build(), 8)
    found = structural_inspect.inspection(problem)
    eager = eager_inspect.inspection(problem)
    assert found is not None and eager is not None
    assert not found.measured and eager.measured
    assert found.outputs_shape == eager.outputs_shape
    assert found.rows == eager.rows
    assert found.connected == eager.connected
    assert found.has_loops == eager.has_loops is False
    assert found.convolutions == eager.convolutions
    assert found.layer_outputs == eager.layer_outputs
    assert found.unpinned == eager.unpinned == ()
    # oneDNN on: the MatMul rule copies nothing, whatever the operands;
    # off: the products' operands read from the layers, the passes' own
    want = () if runtime.cpu_kind().onednn else eager.transposed
    assert found.transposed == want
    for mine, theirs in (
        (found.activation_bytes, eager.activation_bytes),
        (found.forward_bytes, eager.forward_bytes),
    ):
        assert theirs <= mine <= FACTOR * theirs
    # the problem took it, and the checks were trusted
    assert not problem.inspection_measured
    assert structural_inspect.verdict(problem) == structural_inspect.Trust(True)


class Subclassed(keras.Model):
    def __init__(self) -> None:
        super().__init__()
        self.hidden = keras.layers.Dense(8, activation="relu")
        self.head = keras.layers.Dense(5)

    def call(self, x):
        return self.head(self.hidden(x))


def _built_subclassed() -> keras.Model:
    model = Subclassed()
    model(np.zeros((1, 7), "float32"))
    return model


def _bn_training() -> keras.Model:
    inputs = keras.Input((7,))
    h = keras.layers.Dense(8, name="hidden")(inputs)
    h = keras.layers.BatchNormalization()(h, training=True)
    return keras.Model(inputs, keras.layers.Dense(5, name="head")(h))


def _shared() -> keras.Model:
    inputs = keras.Input((5,))
    dense = keras.layers.Dense(5, name="twice")
    return keras.Model(inputs, dense(dense(inputs)))


def _batch_mean() -> keras.Model:
    inputs = keras.Input((7,))
    h = keras.layers.Dense(8, name="hidden")(inputs)
    h = keras.layers.Softmax(axis=0)(h)  # over the batch: examples mix
    return keras.Model(inputs, keras.layers.Dense(5, name="head")(h))


def _user_activation() -> keras.Model:
    inputs = keras.Input((7,))
    h = keras.layers.Dense(8, name="hidden")(inputs)
    h = keras.layers.Activation(lambda t: t - keras.ops.mean(t, axis=0))(h)
    return keras.Model(inputs, keras.layers.Dense(5, name="head")(h))


@pytest.mark.parametrize(
    "build", [_built_subclassed, _bn_training, _shared, _batch_mean, _user_activation]
)
def test_the_structure_does_not_tell(build):
    problem = _problem(build(), 4)
    assert structural_inspect.inspection(problem) is None
    found = structural_inspect.verdict(problem)
    assert not found.trusted and found.reason
    assert problem.inspection_measured


def _clipped_sum(model, inputs, **kwargs):
    """A clipped sum over every trainable variable of ``model``."""
    return jk.jacobian(
        model,
        inputs,
        model.trainable_variables,
        outputs=jk.Loss(LOSS),
        reduce=jk.ClippedSum(1.0),
        **kwargs,
    )


def test_a_first_call_judges_the_checks_once(monkeypatch):
    """The structural inspection and ``batch``'s checks read one verdict,
    kept per model: a fresh model's first clipped sum judges it once (each
    judged it before, twice in all)."""
    judged = []
    judge = structural_inspect._judged

    def counted(problem):
        judged.append(problem)
        return judge(problem)

    monkeypatch.setattr(structural_inspect, "_judged", counted)
    model = mlp()
    x, y = _inputs(model, 4)
    for _ in range(2):
        _clipped_sum(model, (x, y), strategy="batch", cache=False)
    assert len(judged) == 1
    assert checks.how_checked(model) == (checks.STRUCTURE,)


def test_training_is_not_read():
    model = mlp()
    assert structural_inspect.inspection(_problem(model, 4, training=True)) is None


def _per_example_reference(model, x, y, clip: float) -> list[np.ndarray]:
    """The clipped sum the obvious way: each example's loss gradient on its
    own, on a float64 copy, float64 norms and sums."""
    copy = jk.testing.float64_copy(model)
    rows = per_example_gradients(
        lambda one: copy(one, training=False), copy.trainable_variables, (x, y), LOSS
    )
    return clipped_sums(rows, clip)[0]


@pytest.mark.parametrize("build", [convnet, mlp, hub_bert])
def test_the_fast_path_is_taken_and_exact(build):
    model = build()
    x, y = _inputs(model, 6)
    result = jk.jacobian(
        model,
        (x, y),
        model.trainable_variables,
        outputs=jk.Loss(LOSS),
        reduce=jk.ClippedSum(0.5),
    )
    assert result.strategy == "batch", result.plan
    assert checks.how_checked(model) == (checks.STRUCTURE,)
    reference = _per_example_reference(model, x, y, 0.5)
    # one scale for all targets: an attention key's bias has a gradient of
    # zero up to rounding (softmax ignores a shift), so its own is noise
    scale = max(np.abs(want).max() for want in reference)
    for got, want in zip(result.values(), reference):
        # float32 sums of 6 examples' gradients against a float64 copy's:
        # measured 8.6e-8 (conv net), 1.4e-7 (MLP), 1.4e-7 (BERT) of the
        # largest entry with oneDNN on, 1.0e-7, 2.6e-7, 9.4e-8 off
        np.testing.assert_allclose(np.asarray(got), want, atol=1e-5 * scale)


def test_a_user_rule_keeps_the_numeric_check():
    class MyDense(keras.layers.Dense):
        pass

    layers.register(MyDense, DenseRule)  # a user's rule (for a subclass)
    inputs = keras.Input((7,))
    h = MyDense(8, name="mine")(inputs)
    model = keras.Model(inputs, keras.layers.Dense(5, name="head")(h))
    x, y = _inputs(model, 4)
    result = jk.jacobian(
        model, (x, y), "mine", outputs=jk.Loss(LOSS), reduce=jk.ClippedSum(1.0)
    )
    assert result.strategy == "batch", result.plan
    assert checks.how_checked(model) == (checks.NUMERIC,)


def test_a_tight_budget_measures_the_inspection(monkeypatch):
    """Where the structure's upper bound does not fit an explicit budget
    with room, the planner measures the inspection by the passes."""
    measured = []
    original = reduced.measure_inspection

    def counting(problem):
        measured.append(problem)
        original(problem)

    monkeypatch.setattr(reduced, "measure_inspection", counting)
    # oneDNN off: the convolution rules' scratch alone (32 MiB at this
    # batch) exceeds a budget of the conv net's bound, so the MLP there
    model = convnet() if runtime.cpu_kind().onednn else mlp()
    x, y = _inputs(model, 8)
    problem = _problem(model, 8)
    assert not problem.inspection_measured
    bound = problem.activation_bytes

    _clipped_sum(model, (x, y), memory_budget=int(bound * 1.2))
    assert measured and measured[0].inspection_measured
    measured.clear()
    _clipped_sum(model, (x, y), memory_budget="8GiB")
    assert not measured


def test_gram_takes_the_fast_path():
    model = convnet()
    x, y = _inputs(model, 6)
    found = jk.gram(model, (x, y), outputs=jk.Loss(LOSS))
    assert set(checks.how_checked(model)) == {checks.STRUCTURE}
    flat = []
    for i in range(len(y)):
        with tf.GradientTape() as tape:
            loss = LOSS(y[i : i + 1], model(x[i : i + 1], training=False))
        grads = tape.gradient(loss, model.trainable_variables)
        flat.append(np.concatenate([np.asarray(g, np.float64).ravel() for g in grads]))
    want = np.stack(flat) @ np.stack(flat).T
    # float32 products of 6 examples' gradients against float64: measured
    # 9e-8 of the largest entry
    np.testing.assert_allclose(
        np.asarray(found.matrix), want, atol=1e-5 * np.abs(want).max()
    )


@pytest.fixture
def onednn_off(monkeypatch):
    """TensorFlow's own kernels as :func:`jacobkit.runtime.cpu_kind` reports
    them (what the ``MatMul`` rule and the structural inspection read), on
    any machine: the eager passes record the same ``MatMul`` ops either way
    (oneDNN changes kernels, not the ops an eager pass dispatches)."""
    here = runtime.cpu_kind()
    off = runtime.CpuKind(here.model, here.flags, False)
    monkeypatch.setattr(runtime, "cpu_kind", lambda *args: off)
    if tf.config.list_logical_devices("GPU"):
        pytest.skip("on a GPU the MatMul rule replaces nothing")


def _head_of(model: keras.Model) -> list:
    """The last Dense's weights (the classifier's head): the products
    before it depend on no target."""
    dense = [x for x in model._flatten_layers() if type(x).__name__ == "Dense"]
    return list(dense[-1].trainable_weights)


def _first_of(model: keras.Model) -> list:
    """The weights of the layer holding the model's first variable (the
    first convolution, the MLP's hidden Dense, BERT's token embeddings):
    every later product's input depends on a target, no later kernel is
    one."""
    first = model.trainable_variables[0]
    for layer in model._flatten_layers(include_self=False):
        mine = [] if isinstance(layer, keras.Model) else layer.trainable_weights
        if any(w is first for w in mine):
            return list(mine)
    raise AssertionError("no layer holds it")


@pytest.mark.parametrize("which", ["all", "head", "first"])
@pytest.mark.parametrize("build", [convnet, mlp, hub_bert, mobilenet])
@pytest.mark.parametrize("batch", [8, 100])
def test_the_transposed_operands_are_the_eager_passes(onednn_off, build, which, batch):
    """With oneDNN off, each Dense's product's operands read from the layers:
    field by field (rows, bytes, order) the eager passes' records, at a
    batch under and over the rule's least rows, whichever weights are
    targets; the hoisted copies' bytes the planner counts alike."""
    model = build()
    targets = {
        "all": model.trainable_variables,
        "head": _head_of(model),
        "first": _first_of(model),
    }[which]
    problem = Problem(
        model,
        _inputs(model, batch),
        targets,
        outputs=jk.Loss(LOSS),
        reduce=jk.ClippedSum(1.0),
    )
    found = structural_inspect.inspection(problem)
    eager = eager_inspect.inspection(problem)
    assert found is not None and eager is not None
    assert found.transposed == eager.transposed
    if which == "all" and batch == 100:
        assert gradients.hoisted_bytes(found.transposed) > 0
    assert gradients.hoisted_bytes(found.transposed) == gradients.hoisted_bytes(
        eager.transposed
    )
    assert not problem.inspection_measured


def _lora() -> keras.Model:
    model = mlp()
    model.layers[0].enable_lora(2)
    return model


def _einsum_2d() -> keras.Model:
    inputs = keras.Input((7,))
    h = keras.layers.EinsumDense("ab,bc->ac", output_shape=8, name="mixer")(inputs)
    return keras.Model(inputs, keras.layers.Dense(5, name="head")(h))


@pytest.mark.parametrize("build", [_lora, _einsum_2d])
def test_products_the_layers_do_not_tell(onednn_off, build):
    """LoRA's own product of its factors, an EinsumDense Keras computes by a
    rank-2 MatMul, before the head (the target, its checks trusted): not
    read from the layers, the eager passes count them."""
    model = build()
    x, y = _inputs(model, 4)
    problem = Problem(
        model, (x, y), _head_of(model), outputs=jk.Loss(LOSS), reduce=jk.ClippedSum(1.0)
    )
    assert structural_inspect.trusted(problem)
    assert structural_inspect.inspection(problem) is None
    assert problem.inspection_measured
    eager = eager_inspect.inspection(problem)
    assert eager is not None and eager.transposed


def causal_lm() -> keras.Model:
    """Logits ``(B, None, V)``: every unknown size the tokens' length."""
    tokens = keras.Input((None,), dtype="int32")
    h = keras.layers.Embedding(50, 16, name="embed")(tokens)
    attended = keras.layers.MultiHeadAttention(2, 8, name="attn")(
        h, h, use_causal_mask=True
    )
    h = keras.layers.LayerNormalization()(keras.layers.Add()([h, attended]))
    h = keras.layers.Dense(32, activation="gelu", name="ff")(h)
    return keras.Model(tokens, keras.layers.Dense(50, name="logits")(h))


def _sliced() -> keras.Model:
    """An unknown size a slice shortens: not the tokens' length."""
    tokens = keras.Input((None,), dtype="int32")
    h = keras.layers.Embedding(50, 16, name="embed")(tokens)
    return keras.Model(tokens, keras.layers.Dense(50, name="logits")(h[:, 1:]))


@pytest.mark.parametrize("onednn", [True, False])
@pytest.mark.parametrize("batch", [3, 40])
def test_an_open_length_is_the_inputs(monkeypatch, onednn, batch):
    """A causal LM's logits ``(B, None, V)``: the unknown size read as the
    tokens' length, the inspection field by field the eager passes' (the
    products' operands with oneDNN off too)."""
    here = runtime.cpu_kind()
    kind = runtime.CpuKind(here.model, here.flags, onednn)
    monkeypatch.setattr(runtime, "cpu_kind", lambda *args: kind)
    model = causal_lm()
    tokens = RNG.integers(0, 50, (batch, 6)).astype("int32")
    labels = RNG.integers(0, 50, (batch, 6)).astype("int64")
    problem = Problem(
        model,
        (tokens, labels),
        model.trainable_variables,
        outputs=jk.Loss(LOSS),
        reduce=jk.ClippedSum(1.0),
    )
    found = structural_inspect.inspection(problem)
    eager = eager_inspect.inspection(problem)
    assert found is not None and eager is not None
    assert found.outputs_shape == eager.outputs_shape == (batch, 6, 50)
    assert found.rows == eager.rows
    assert found.connected == eager.connected
    assert found.layer_outputs == eager.layer_outputs
    gpu = bool(tf.config.list_logical_devices("GPU"))
    want = () if onednn or gpu else eager.transposed
    assert found.transposed == want
    for mine, theirs in (
        (found.activation_bytes, eager.activation_bytes),
        (found.forward_bytes, eager.forward_bytes),
    ):
        assert theirs <= mine <= FACTOR * theirs


def test_a_sliced_length_is_not_read():
    model = _sliced()
    tokens = RNG.integers(0, 50, (4, 6)).astype("int32")
    labels = RNG.integers(0, 50, (4, 5)).astype("int64")
    problem = Problem(
        model,
        (tokens, labels),
        model.trainable_variables,
        outputs=jk.Loss(LOSS),
        reduce=jk.ClippedSum(1.0),
    )
    assert structural_inspect.inspection(problem) is None
    assert problem.inspection_measured
