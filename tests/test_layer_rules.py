"""The batch strategy's closed forms for the layers of transformers and
mobile nets (:mod:`jacobkit.layers`), at every row mode and for
``reduce="norm"``, against the float64 reference.

The blocks: a transformer block (Embedding -> self-attention -> residual
LayerNormalization -> feed-forward, with two EinsumDense projections in the
functional graph), the same with Keras's causal ``MultiHeadAttention`` (its
four projections one target) and a mobile block (expand 1x1 -> BatchNormalization ->
ReLU -> DepthwiseConv2D -> BatchNormalization -> ReLU -> project 1x1 ->
SeparableConv2D), with
random weights and randomized moving statistics, inference mode.

Tolerance: :func:`jacobkit.testing.assert_close`'s derived one (twice the
float32 loop's own error from float64, floored). Measured: the closed forms
are within 2.7e-6 of the float32 loop, and norms within 1.4e-6.
"""

from __future__ import annotations

import keras
import numpy as np
import pytest
import tensorflow as tf

import jacobkit as jk
from jacobkit import testing

ROW_MODES = ["features", "per_example", "full"]


def _transformer():
    keras.utils.set_random_seed(0)
    ids = keras.Input((6,), dtype="int32")
    h = keras.layers.Embedding(20, 8, name="embedding")(ids)
    query = keras.layers.EinsumDense(
        "abc,cde->abde", (None, 2, 4), bias_axes="de", name="query"
    )(h)
    scores = keras.ops.softmax(keras.ops.einsum("abhd,achd->ahbc", query, query))
    attended = keras.ops.einsum("ahbc,achd->abhd", scores, query)
    out = keras.layers.EinsumDense(
        "abcd,cde->abe", (None, 8), bias_axes="e", name="attention_output"
    )(attended)
    h = keras.layers.LayerNormalization(name="norm")(h + out)
    f = keras.layers.Dense(16, activation="relu", name="ffn")(h)
    h = keras.layers.GlobalAveragePooling1D()(h + keras.layers.Dense(8)(f))
    model = keras.Model(ids, keras.layers.Dense(3, name="head")(h))
    x = np.random.default_rng(0).integers(0, 20, size=(3, 6)).astype("int32")
    return model, x


def _attention():
    """Embedding -> causal MultiHeadAttention -> residual LayerNormalization
    -> feed-forward: the attention layer's four projections are one target."""
    keras.utils.set_random_seed(0)
    ids = keras.Input((6,), dtype="int32")
    h = keras.layers.Embedding(20, 8, name="embedding")(ids)
    attended = keras.layers.MultiHeadAttention(2, 4, name="mha")(
        h, h, use_causal_mask=True
    )
    h = keras.layers.LayerNormalization(name="norm")(h + attended)
    f = keras.layers.Dense(16, activation="relu", name="ffn")(h)
    h = keras.layers.GlobalAveragePooling1D()(h + keras.layers.Dense(8)(f))
    model = keras.Model(ids, keras.layers.Dense(3, name="head")(h))
    x = np.random.default_rng(0).integers(0, 20, size=(3, 6)).astype("int32")
    return model, x


def _mobile():
    keras.utils.set_random_seed(0)
    inp = keras.Input((6, 6, 3))
    h = keras.layers.Conv2D(8, 1, name="expand")(inp)
    h = keras.layers.ReLU()(keras.layers.BatchNormalization(name="bn1")(h))
    h = keras.layers.DepthwiseConv2D(3, padding="same", name="depthwise")(h)
    h = keras.layers.ReLU()(keras.layers.BatchNormalization(name="bn2")(h))
    h = keras.layers.Conv2D(4, 1, name="project")(h)
    h = keras.layers.SeparableConv2D(
        5, 3, strides=2, padding="same", activation="relu", name="separable"
    )(h)
    h = keras.layers.GlobalAveragePooling2D()(h)
    model = keras.Model(inp, keras.layers.Dense(3, name="head")(h))
    rng = np.random.default_rng(1)
    for name in ("bn1", "bn2"):
        bn = model.get_layer(name)
        bn.moving_mean.assign(rng.normal(size=bn.moving_mean.shape))
        bn.moving_variance.assign(rng.uniform(0.5, 2.0, size=bn.moving_variance.shape))
    x = np.random.default_rng(0).normal(size=(3, 6, 6, 3)).astype("float32")
    return model, x


BLOCKS = {"transformer": _transformer, "attention": _attention, "mobile": _mobile}
TARGETS = [
    ("transformer", "embedding"),
    ("transformer", "query"),
    ("transformer", "attention_output"),
    ("transformer", "norm"),
    ("attention", "mha"),
    ("mobile", "bn1"),
    ("mobile", "depthwise"),
    ("mobile", "bn2"),
    ("mobile", "separable"),
]


@pytest.fixture(scope="module")
def blocks():
    return {name: build() for name, build in BLOCKS.items()}


@pytest.fixture(scope="module")
def references():
    """The float64 references computed in this module, by block, layer and
    row mode: the closed form's, the norms' and every strategy's cases of a
    row mode share one (the module's models are shared already, and read
    only)."""
    return {}


def _reference(model, x, layer, outputs, references=None, block=None):
    """The float64 reference; once per ``(block, layer, outputs)`` given the
    module's ``references``."""
    key = (block, layer, outputs)
    if references is not None and key in references:
        return references[key]
    variables = [v for v in model.get_layer(layer).trainable_weights]
    found = testing.float64_reference(model, x, variables, outputs=outputs)
    if references is not None:
        references[key] = found
    return found


def _assert_matches(res, ref):
    """``testing.assert_close``, except for Jacobians that are zero in exact
    arithmetic: an attention layer's key bias adds the same score to every
    key of a query, which the softmax cancels (float64 reference: about
    1e-17 of the other Jacobians; float32: about 1e-8, measured). Those are
    held to 1e-6 of the largest Jacobian, absolutely."""
    got = [np.asarray(j) for j in res.jacobians.values()]
    want = [np.asarray(j) for j in ref.jacobians]
    scale = max(np.abs(w).max() for w in want)
    zero = [i for i, w in enumerate(want) if np.abs(w).max() <= 1e-12 * scale]
    for i in zero:
        assert np.abs(got[i]).max() <= 1e-6 * scale, (i, np.abs(got[i]).max())
    if not zero:
        return testing.assert_close(res, ref)
    keep = [i for i in range(len(want)) if i not in zero]
    testing.assert_close([got[i] for i in keep], [want[i] for i in keep])


@pytest.mark.parametrize("outputs", ROW_MODES)
@pytest.mark.parametrize(("block", "layer"), TARGETS)
def test_closed_form_agrees_with_float64(blocks, references, block, layer, outputs):
    model, x = blocks[block]
    res = jk.jacobian(model, x, layer, strategy="batch", outputs=outputs)
    _assert_matches(res, _reference(model, x, layer, outputs, references, block))


@pytest.mark.parametrize("outputs", ["features", "per_example"])
@pytest.mark.parametrize(("block", "layer"), TARGETS)
def test_norms_agree_with_float64(blocks, references, block, layer, outputs):
    model, x = blocks[block]
    res = jk.jacobian(model, x, layer, strategy="batch", outputs=outputs, reduce="norm")
    ref = _reference(model, x, layer, outputs, references, block)
    scale = max(np.abs(np.asarray(full)).max() for full in ref.jacobians)
    for got, full in zip(res.jacobians.values(), ref.jacobians):
        rows = np.asarray(full).reshape(*res.rows_shape, -1)
        expected = np.sqrt((rows**2).sum(-1))
        if np.abs(rows).max() <= 1e-12 * scale:  # zero exactly (see above)
            assert np.abs(np.asarray(got)).max() <= 1e-6 * scale
            continue
        # float32 norms of float64 rows: measured within 1.4e-6
        assert testing.max_relative_difference(got, expected) < 1e-4


@pytest.mark.parametrize(("block", "layer"), TARGETS)
def test_auto_runs_per_example_rows_in_closed_form(blocks, block, layer):
    model, x = blocks[block]
    res = jk.jacobian(model, x, layer, outputs="per_example", cache=False)
    assert res.strategy == "batch", res.plan


def test_training_mode_batch_norm_is_refused(blocks):
    # the batch statistics mix the examples: no closed form per example
    model, x = blocks["mobile"]
    with pytest.raises(ValueError, match="batch"):
        jk.jacobian(model, x, "bn1", strategy="batch", training=True)


def test_attention_projections_called_from_python_get_the_closed_form():
    # MultiHeadAttention calls its projections from Python: no node of the
    # graph, so batch finds each call in the traced pass (it refused before)
    inp = keras.Input((5, 8))
    h = keras.layers.MultiHeadAttention(2, 4, name="mha")(inp, inp)
    model = keras.Model(inp, keras.layers.Dense(3)(keras.layers.Flatten()(h)))
    x = np.random.default_rng(0).normal(size=(2, 5, 8)).astype("float32")
    ref = _reference_nested(model, x)
    res = jk.jacobian(model, x, "mha/query", strategy="batch", outputs="per_example")
    # float32 against float64: measured 3e-7 relative; the default holds it
    testing.assert_close(res, ref)
    res = jk.jacobian(model, x, "mha/query", outputs="per_example")
    assert res.strategy == "batch", res.plan
    testing.assert_close(res, ref)


class SwishNet(keras.Model):
    """Layers called from Python (found in the traced pass), with Keras's
    ``swish``: ``tf.nn.silu``'s ``tf.custom_gradient`` passes the
    pre-activation through an ``IdentityN`` output that nothing takes."""

    def __init__(self):
        super().__init__()
        self.conv = keras.layers.Conv2D(4, 3, activation="swish")
        self.pool = keras.layers.GlobalAveragePooling2D()
        self.head = keras.layers.Dense(3, activation="swish")

    def call(self, x):
        return self.head(self.pool(self.conv(x)))


@pytest.mark.parametrize("target", ["conv", "head"])
def test_swish_activated_layers_in_the_traced_pass(target):
    # the last tensor of the output's shape that nothing took was the
    # pre-activation, taken for the output: the check refused batch on
    # EfficientNet's squeeze-excite convolutions (every variable at once);
    # "head" is the pass's own result, whose output nothing takes
    keras.utils.set_random_seed(0)
    model = SwishNet()
    x = np.random.default_rng(0).normal(size=(3, 6, 6, 2)).astype("float32")
    model(x)
    layer = getattr(model, target)
    ref = testing.float64_reference(
        model, x, layer.trainable_weights, outputs="per_example"
    )
    res = jk.jacobian(
        model, x, layer.trainable_weights, strategy="batch", outputs="per_example"
    )
    # float32 against float64: measured 1.5e-7 (conv) and 1.8e-7 (head)
    # relative; the default holds it
    testing.assert_close(res, ref)


def _reference_nested(model, x):
    query = model.get_layer("mha")._query_dense
    return testing.float64_reference(
        model, x, query.trainable_weights, outputs="per_example"
    )


#: (strategy, block) pairs refused by design, with the words that say why
REFUSED = {
    ("chunked", "mobile"): "pfor",  # a depthwise convolution on the way
    ("structured", "transformer"): "shortcut",
    ("structured", "mobile"): "shortcut",
}


@pytest.mark.parametrize("outputs", ["features", "per_example"])
@pytest.mark.parametrize(
    ("block", "layer"),
    [("transformer", "embedding"), ("transformer", "norm"), ("mobile", "bn1")],
)
@pytest.mark.parametrize("strategy", list(jk.strategies.REGISTRY))
def test_every_strategy_on_the_blocks(
    blocks, references, strategy, block, layer, outputs
):
    model, x = blocks[block]
    why = REFUSED.get((strategy, block))
    if why is not None:
        with pytest.raises(ValueError, match=why):
            jk.jacobian(model, x, layer, strategy=strategy, outputs=outputs)
        return
    res = jk.jacobian(model, x, layer, strategy=strategy, outputs=outputs)
    testing.assert_close(res, _reference(model, x, layer, outputs, references, block))


@pytest.mark.parametrize("layer", ["expand", "depthwise", "bn"])
def test_tf_keras_layers_get_their_own_rules(layer):
    # tf_keras's DepthwiseConv2D is a subclass of its Conv2D: it must get the
    # depthwise rule, not the convolution's
    import tf_keras

    model = tf_keras.Sequential(
        [
            tf_keras.Input((6, 6, 3)),
            tf_keras.layers.Conv2D(4, 1, name="expand"),
            tf_keras.layers.DepthwiseConv2D(3, name="depthwise"),
            tf_keras.layers.BatchNormalization(name="bn"),
            tf_keras.layers.GlobalAveragePooling2D(),
            tf_keras.layers.Dense(3),
        ]
    )
    x = np.random.default_rng(0).normal(size=(3, 6, 6, 3)).astype("float32")
    res = jk.jacobian(model, x, layer, strategy="batch", outputs="per_example")
    testing.assert_close(res, _reference(model, x, layer, "per_example"))


@pytest.mark.parametrize("layer", ["inner", "norm"])
def test_tf_keras_layers_called_from_python_get_their_closed_forms(layer):
    """A tf_keras subclassed model's layers, called from its Python ``call``:
    found in the traced pass as Keras 3's are (its LayerNormalization keeps
    its axis as a positive index, read from the shape it was built for)."""
    tf_keras = pytest.importorskip("tf_keras")

    class Model(tf_keras.Model):
        def __init__(self):
            super().__init__()
            self.inner = tf_keras.layers.Dense(5, activation="tanh", name="inner")
            self.norm = tf_keras.layers.LayerNormalization(name="norm")
            self.head = tf_keras.layers.Dense(3, name="head")

        def call(self, x):
            return self.head(self.norm(self.inner(x)))

    model = Model()
    x = np.random.default_rng(0).normal(size=(4, 3, 6)).astype("float32")
    model(x)
    result = jk.jacobian(model, x, layer, strategy="batch", outputs="per_example")
    loop = jk.jacobian(model, x, layer, strategy="loop", outputs="per_example")
    # the same float32 arithmetic two ways: measured 1e-7 relative
    testing.assert_close(result, list(loop.jacobians.values()), tolerance=1e-5)
    assert jk.jacobian(model, x, layer, outputs="per_example").strategy == "batch"


@pytest.mark.parametrize(
    "shape, sizes, strides, rates, padding",
    [
        ((3, 32, 32, 3), (3, 3), (1, 1), (1, 1), "VALID"),
        ((2, 30, 30, 4), (3, 3), (2, 2), (1, 1), "VALID"),
        ((2, 15, 17, 3), (3, 2), (2, 3), (1, 1), "SAME"),
        ((2, 16, 16, 2), (3, 3), (1, 1), (2, 2), "SAME"),
        ((2, 16, 16, 2), (5, 5), (2, 2), (1, 1), "SAME"),
        ((2, 9, 9, 2), (1, 1), (1, 1), (1, 1), "VALID"),
        ((2, 1, 20, 3), (1, 4), (1, 3), (1, 2), "VALID"),  # a Conv1D's
        ((2, 7, 7, 2), (7, 7), (1, 1), (1, 1), "VALID"),  # one position
    ],
)
@pytest.mark.parametrize("identity", [False, True], ids=["gather", "identity"])
def test_patches_equal_extract_patches(
    shape, sizes, strides, rates, padding, identity, monkeypatch
):
    """Both unfolds give exactly ``tf.image.extract_patches``' numbers, in
    its order: the gather (a copy) and the convolution with the identity
    kernel (products by 1 and 0), whichever this machine would choose."""
    from jacobkit.layers import conv
    from jacobkit.layers.conv import patches

    monkeypatch.setattr(
        conv,
        "_by_identity_kernel",
        lambda x, size, rates: identity and all(rate == 1 for rate in rates),
    )
    x = tf.constant(np.random.default_rng(0).normal(size=shape).astype("float32"))
    want = tf.image.extract_patches(
        x, [1, *sizes, 1], [1, *strides, 1], [1, *rates, 1], padding
    )
    want = tf.reshape(want, (shape[0], -1, want.shape[-1]))
    got = patches(x, padding, list(sizes), list(strides), list(rates))
    np.testing.assert_array_equal(got.numpy(), want.numpy())
