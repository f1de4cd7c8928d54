"""The layer registry (:mod:`jacobkit.layers.registry`): what it refuses,
how a layer finds its kind, and that the stock kinds' facts are true of
the Keras layers they name (traced, not assumed).

The facts are checked where a wrong one would make a result wrong or a
refusal false: the convolutions a layer's gradient runs (the scratch probe,
the depthwise check), pfor's rule for each convolution kind, and what acts
elementwise or is the identity at inference (the structure finder).
"""

from __future__ import annotations

import keras
import numpy as np
import pytest
import tensorflow as tf

import jacobkit as jk
from jacobkit import layers, testing
from jacobkit.layers import convolutions, stock
from jacobkit.layers.dense import DenseRule
from jacobkit.layers.registry import LayerKind, LayerRegistry
from tests.user_layers import Scale, ScaleRule


class _MyDense(keras.layers.Dense):
    """A user's subclass of a registered class."""


class _MyDenseRule(DenseRule):
    kind = "my_dense"


def _name(kind: LayerKind) -> str:
    return kind.name


def test_every_stock_kind_names_a_keras_class():
    """Stock names resolve in ``keras.layers``; a library's path resolves
    once that library is imported (keras_hub, keras.applications)."""
    import keras_hub  # noqa: F401 - the paths' modules imported

    keras.applications.convnext  # noqa: B018 - imported with keras
    # the stock kinds (a user's, registered by another test in this
    # process, names its class itself)
    for kind in stock.KINDS:
        assert isinstance(kind.layer, str)
        where = kind.layer if ":" in kind.layer else f"keras.layers.{kind.layer}"
        assert kind.classes([keras]), f"{where} does not exist"


def test_a_layer_gets_the_kind_of_its_nearest_registered_class():
    assert layers.kind_of(keras.layers.Dense(2)).name == "Dense"
    assert layers.kind_of(keras.layers.Flatten()) is None
    # an LSTM is an RNN: it loops over time steps
    assert layers.kind_of(keras.layers.LSTM(2)).name == "RNN"
    assert layers.runs_a_loop(keras.layers.LSTM(2))
    # a subclass gets its base's rule, but no stock facts (it may change call)
    mine = _MyDense(2)
    assert isinstance(layers.rule_for(mine), DenseRule)
    assert layers.stock_kind(mine) is None
    assert layers.stock_kind(keras.layers.Dense(2)).linear == "matmul"


def test_a_registered_subclass_wins_over_its_base_in_any_order():
    registry = LayerRegistry([LayerKind("Dense", DenseRule)])
    assert registry.of(_MyDense(2)).rule is DenseRule  # looked up, then cached
    registry.add(LayerKind(_MyDense, _MyDenseRule))
    assert registry.of(_MyDense(2)).rule is _MyDenseRule
    assert registry.of(keras.layers.Dense(2)).rule is DenseRule
    assert registry.stock(_MyDense(2)).name == "_MyDense"


def test_registration_refuses_duplicates_and_unknown_facts():
    registry = LayerRegistry([LayerKind("Dense", DenseRule)])
    with pytest.raises(
        ValueError, match=r"Dense is registered already \(registered: Dense\)"
    ):
        registry.add(LayerKind("Dense"))
    with pytest.raises(ValueError, match="Dense is registered already"):
        registry.add(LayerKind(keras.layers.Dense, DenseRule))
    with pytest.raises(ValueError, match="choose from 'conv2d', 'conv3d', 'depthwise'"):
        registry.add(LayerKind("Conv2D", convolutions=("conv4d",)))
    with pytest.raises(ValueError, match="choose from 'matmul', 'convolution'"):
        registry.add(LayerKind("Conv2D", linear="affine"))  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="LayerRule subclass"):
        registry.add(LayerKind("Conv2D", rule=object))  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="LoRA rule of Conv2D must be a LayerRule"):
        registry.add(LayerKind("Conv2D", lora=object))  # type: ignore[arg-type]
    assert [k.name for k in registry.kinds] == ["Dense"]


def test_batch_refusal_lists_every_layer_with_a_rule():
    described = layers.with_rules()
    assert described.startswith("Dense, Conv1D, Conv2D")
    for kind in layers.REGISTRY.kinds:
        assert (kind.name in described) == (kind.rule is not None), kind.name
    assert "with LoRA enabled: Dense, EinsumDense and Embedding)" in described
    model = keras.Sequential([keras.Input((4, 2)), keras.layers.LSTM(3)])
    x = np.zeros((2, 4, 2), "float32")
    with pytest.raises(ValueError) as refused:
        jk.jacobian(model, x, model.layers[0], strategy="batch")
    assert f"supports {described} layers" in str(refused.value)


def _conv_layer(name: str) -> tuple[keras.layers.Layer, tf.Tensor]:
    cls = getattr(keras.layers, name)
    rank = int(name[-2])
    layer = cls(3) if name.startswith("Depthwise") else cls(4, 3)
    return layer, tf.random.normal((2, *([6] * rank), 3))


@pytest.mark.parametrize(
    "kind", [k for k in layers.REGISTRY.kinds if k.convolutions], ids=_name
)
def test_a_layers_gradient_runs_the_convolutions_it_is_registered_with(kind):
    layer, x = _conv_layer(kind.name)
    layer(x)

    def gradient(x):
        with tf.GradientTape() as tape:
            tape.watch(x)
            y = layer(x)
        return tape.gradient(y, [x, *layer.trainable_weights])

    graph = tf.function(gradient).get_concrete_function(x).graph
    ran = convolutions.of_gradient_ops(op.type for op in graph.get_operations())
    assert ran == set(kind.convolutions)
    assert layers.pfor_cannot_vectorize(layer) == (not kind.pfor_vectorizes)


#: pfor has no rule for Conv3DBackpropInputV2 either (TF 2.21), but the
#: registry says it has, as the depthwise check always did: a Conv3D target
#: fails on chunked's first call instead of being refused before it. Saying
#: so changes what chunked and auto do: its own change, not this refactor's.
@pytest.mark.parametrize(
    "convolution",
    convolutions.CONVOLUTIONS,
    ids=lambda c: c.kind,
)
def test_pfor_has_a_rule_for_a_convolution_kind_where_registered(convolution):
    axes = convolution.spatial_axes
    x = tf.random.normal((2, *([6] * axes), 2))
    kernel = tf.random.normal((*([3] * axes), 2, 1))

    @tf.function(autograph=False)
    def vectorized(x, kernel):
        # as batch's backward pass: one cotangent per row, vectorized
        with tf.GradientTape(persistent=True) as tape:
            tape.watch([x, kernel])
            y = convolution.forward(x, kernel)
        return tf.vectorized_map(
            lambda ct: tape.gradient(y, [x, kernel], output_gradients=ct),
            tf.ones((2, *y.shape)),
            fallback_to_while_loop=False,
        )

    if convolution.pfor_rule:
        vectorized(x, kernel)
    else:
        with pytest.raises(ValueError, match="|".join(convolution.gradient_ops)):
            vectorized(x, kernel)


def _stock(kind: LayerKind) -> keras.layers.Layer:
    if kind.name == "Activation":
        return keras.layers.Activation("tanh")
    if kind.inference_identity:
        return getattr(keras.layers, kind.name)(0.3)
    return getattr(keras.layers, kind.name)()


@pytest.mark.parametrize(
    "kind",
    [k for k in layers.REGISTRY.kinds if k.elementwise or k.inference_identity],
    ids=_name,
)
def test_elementwise_layers_act_on_each_element_alone(kind):
    layer = _stock(kind)
    x = tf.random.normal((2, 5))
    with tf.GradientTape() as tape:
        tape.watch(x)
        y = layer(x, training=False)
    jacobian = tape.batch_jacobian(y, x).numpy()
    off_diagonal = jacobian * (1 - np.eye(5))
    assert np.all(off_diagonal == 0)
    if kind.inference_identity:
        np.testing.assert_array_equal(y, x)


class _Scale(Scale):
    """The register() example's layer, registered by this file's first test."""


def test_a_registered_user_layer_runs_its_closed_form():
    """``jacobkit.layers.register``'s documented example: unknown to batch
    before, its closed form after, equal to float64 in a functional model and
    called from a subclassed model's Python."""
    inputs = keras.Input((3, 4))
    scale = _Scale(name="scale")
    model = keras.Model(inputs, keras.layers.Dense(2)(keras.ops.tanh(scale(inputs))))
    x = np.random.default_rng(0).normal(size=(3, 3, 4)).astype("float32")
    with pytest.raises(ValueError, match="strategy='batch'.*supports"):
        jk.jacobian(model, x, "scale", strategy="batch", outputs="per_example")
    kind = layers.register(_Scale, ScaleRule)
    assert layers.kind_of(scale) is kind
    with pytest.raises(ValueError, match="_Scale is registered already"):
        layers.register(_Scale, ScaleRule)
    result = jk.jacobian(model, x, "scale", strategy="batch", outputs="per_example")
    reference = jk.jacobian(model, x, "scale", strategy="loop", outputs="per_example")
    # the same float32 arithmetic two ways: measured 6e-8 relative
    testing.assert_close(result, list(reference.jacobians.values()), tolerance=1e-6)
    auto = jk.jacobian(model, x, "scale", outputs="per_example")
    assert auto.strategy == "batch", auto.plan


class _WrongScale(_Scale):
    """The register() example's layer, registered with a wrong rule."""


class _DoubledScaleRule(ScaleRule):
    """``ScaleRule`` with its gradient doubled (and so its norms): its
    ``pre_activation`` is right, so only the gradients' check can see it."""

    def gradients(self, x, dz, kernel_shape, *, summed):
        kernel, bias = super().gradients(x, dz, kernel_shape, summed=summed)
        return 2 * kernel, bias


def test_a_registered_rule_with_wrong_gradients_is_refused_in_words():
    """Before: ``batch`` gave rows off by 1.0 (relative) and a clipped sum off
    by 0.40, silently. Now it refuses the rule in words, and ``auto`` falls
    back to a generic strategy that agrees with a float64 closed form."""
    inputs = keras.Input((3, 4))
    scale = _WrongScale(name="scale")
    dense = keras.layers.Dense(2)
    model = keras.Model(inputs, dense(keras.ops.tanh(scale(inputs))))
    x = np.random.default_rng(0).normal(size=(3, 3, 4)).astype("float32")
    layers.register(_WrongScale, _DoubledScaleRule)
    with pytest.raises(ValueError, match=r"closed form of layer 'scale'.*is wrong"):
        jk.jacobian(model, x, "scale", strategy="batch", outputs="per_example")
    # the norms (and so a clipped sum's weights) come from the same rule
    with pytest.raises(ValueError, match="is wrong"):
        jk.jacobian(model, x, "scale", strategy="batch", reduce="norm")
    result = jk.jacobian(model, x, "scale", outputs="per_example")
    assert result.strategy != "batch", result.plan
    # y[b, p, j] = sum_c tanh(x[b, p, c] w[c]) W[c, j] + c_j; a per-example
    # row sums over the positions p: sum_p (1 - tanh^2(x w)) x[b, p, c] W[c, j]
    w = scale.w.numpy().astype("float64")
    kernel = dense.kernel.numpy().astype("float64")
    x64 = x.astype("float64")
    inner = (1 - np.tanh(x64 * w) ** 2) * x64  # (B, P, C)
    expected = np.einsum("bpc,cj->bjc", inner, kernel)
    (found,) = result.jacobians.values()
    # a generic strategy in float32 against float64: measured 3e-7 of the
    # largest value (the doubled rule: 1.0)
    np.testing.assert_allclose(
        np.asarray(found), expected, atol=2e-6 * np.abs(expected).max()
    )


@pytest.mark.filterwarnings("ignore:You passed `rms_scaling=True`")
def test_rms_normalizations_are_known_as_such():
    """``layers.divides_by_rms``: the registered RMS kinds (Keras's, keras_hub
    Gemma's and Llama's) and ``LayerNormalization(rms_scaling=True)``; not
    a plain layer normalization, batch normalization or Dense. (Keras
    deprecates ``rms_scaling=True``: it divides by the standard deviation,
    as scale-blind and as degenerate at 0.)"""
    import keras_hub

    from jacobkit.layers import divides_by_rms

    hub = keras_hub.src.models
    rms = [
        keras.layers.RMSNormalization(),
        keras.layers.LayerNormalization(rms_scaling=True),
        hub.gemma.rms_normalization.RMSNormalization(),
        hub.llama.llama_layernorm.LlamaLayerNorm(),
    ]
    others = [
        keras.layers.LayerNormalization(),
        keras.layers.BatchNormalization(),
        keras.layers.Dense(2),
    ]
    assert [divides_by_rms(layer) for layer in rms] == [True] * len(rms)
    assert [divides_by_rms(layer) for layer in others] == [False] * len(others)
