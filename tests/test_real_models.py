"""Every registered strategy on models nobody here wrote: a frozen
keras.applications MobileNetV2 backbone with a Dense head, and a keras_hub
BERT classifier, against the float64 reference.

Both are small random-init configurations of the benchmark's builders
(:mod:`jacobkit.testing.example_backbones`: ``weights=None``, no preset), so
nothing is downloaded: MobileNetV2 at ``alpha=0.35`` on 32 px images, BERT
with 2 transformer layers, hidden size 32 and a 1,000-token vocabulary.
Batches of 2, 3 output rows (the heads' classes).

Targets: the head (``Dense``), the backbone's first convolution (``Conv1``,
3x3x3x16: small enough for ``forward``) and a transformer projection named by
the path the results print (``transformer_layer_0/query``, an
``EinsumDense``).

Where a strategy refuses a target by design (``batch`` on an ``EinsumDense``,
``structured`` where no exact shortcut applies) the test asserts the refusal.

Tolerance: :func:`jacobkit.testing.assert_close`'s derived one (twice the
float32 loop's own error against float64, floored). Measured on these
models, against float64: the loop's own error is 8.9e-7 (head), 8.7e-7
(Conv1), 2.4e-7 (query); every strategy that runs is within 1.8x of it
(forward on query: 4.1e-7), inside the factor of 2.
"""

from __future__ import annotations

import numpy as np
import pytest

import jacobkit as jk
from jacobkit import testing
from jacobkit.testing import examples

keras = pytest.importorskip("keras")
keras_hub = pytest.importorskip("keras_hub")

STRATEGY_NAMES = list(jk.strategies.REGISTRY)


def _mobilenet():
    # the benchmark's frozen MobileNetV2 at a third of its width
    ex = examples.build("frozen_mobilenet", batch=2, size=32, alpha=0.35)
    return ex.model, ex.inputs


def _bert():
    ex = examples.build("bert_classifier", batch=2, sequence=8, hidden=32)
    return ex.model, ex.inputs


_BUILDERS = {"mobilenet_v2": _mobilenet, "bert": _bert}
_MODELS: dict = {}


def _model(name: str):
    """Build each model once per test session (a few seconds each)."""
    if name not in _MODELS:
        _MODELS[name] = _BUILDERS[name]()
    return _MODELS[name]


# (model, layer, how to find the target's variables the plain Keras way)
TARGETS = {
    "head": ("mobilenet_v2", "head"),
    "backbone_conv": ("mobilenet_v2", "Conv1"),
    "transformer_query": ("bert", "transformer_layer_0/query"),
}

# Known failures, being fixed elsewhere; strict=False so a fix does not fail
# here. pfor (batch, chunked) cannot differentiate through the backbone's
# DepthwiseConv2D with respect to an earlier layer's kernel:
# "DepthwiseConv2dNativeBackpropInput expected to be not loop invariant".
XFAIL: dict[tuple[str, str], str] = {}

#: forward mode on these targets runs a pass per chunk of their parameters:
#: 100 s and 50 s of the default run on a loaded 2-core machine (the head's
#: forward case stays in it)
SLOW_FORWARD = ("backbone_conv", "transformer_query")

# Documented refusals: the strategy must refuse, in words, not run.
REFUSES: dict[tuple[str, str], str] = {
    # pfor has no rule for the depthwise convolutions on the way
    ("chunked", "backbone_conv"): r"pfor\) has no rule for the gradient of layers",
    ("structured", "backbone_conv"): "no exact shortcut applies",
    ("structured", "transformer_query"): "no exact shortcut applies",
}


def _variables(model, target: str) -> list:
    """The target's variables, found without jacobkit's name lookup."""
    if target == "head":
        layer = model.get_layer("head")
        return [layer.kernel, layer.bias]
    if target == "backbone_conv":
        return [model.layers[1].get_layer("Conv1").kernel]
    prefix = "transformer_layer_0/self_attention_layer/query/"
    found = [v for v in model.weights if v.path.startswith(prefix)]
    assert [v.path.rsplit("/", 1)[1] for v in found] == ["kernel", "bias"]
    return found


_REFERENCES: dict = {}


def _reference(target: str):
    if target not in _REFERENCES:
        name, _ = TARGETS[target]
        model, x = _model(name)
        _REFERENCES[target] = testing.float64_reference(
            model, x, _variables(model, target), call_kwargs={"training": False}
        )
    return _REFERENCES[target]


@pytest.mark.parametrize("target", list(TARGETS))
@pytest.mark.parametrize("strategy", STRATEGY_NAMES)
def test_real_model_agrees_with_float64(strategy, target, request):
    if strategy == "forward" and target in SLOW_FORWARD:
        request.applymarker(pytest.mark.slow)
        if not request.config.getoption("--slow"):
            pytest.skip("slow: run with pytest --slow")
    if (strategy, target) in XFAIL:
        request.applymarker(
            pytest.mark.xfail(reason=XFAIL[strategy, target], strict=False)
        )
    name, layer = TARGETS[target]
    model, x = _model(name)
    if (strategy, target) in REFUSES:
        with pytest.raises(ValueError, match=REFUSES[strategy, target]):
            jk.jacobian(model, x, layer, strategy=strategy)
        return
    result = jk.jacobian(model, x, layer, strategy=strategy)
    assert result.strategy == strategy
    assert result.rows_shape == (3,)
    testing.assert_close(result, _reference(target))


def test_unknown_layer_on_a_frozen_backbone_offers_its_layers():
    """The frozen backbone's layers have variables (not trainable ones) and
    are targets: a near miss is offered them; with nothing close, the
    candidates are listed (never a layer without variables)."""
    model, x = _model("mobilenet_v2")
    with pytest.raises(ValueError, match=r"Did you mean 'Conv_1' or 'Conv1'"):
        jk.jacobian(model, x, "Conv_11", strategy="loop")
    with pytest.raises(ValueError, match=r"layers with .*variables are: .*'Conv1'"):
        jk.jacobian(model, x, "xyzq", strategy="loop")
    with pytest.raises(ValueError) as refused:
        jk.jacobian(model, x, "input_layr", strategy="loop")
    assert "'input_layer'" not in str(refused.value)


def test_forward_on_a_large_kernel_is_refused_with_the_numbers():
    """MobileNetV2's ``Conv_1`` kernel (1x1x112x1280 at alpha=0.35: 143,360
    elements, one forward pass each) against the loop's 3 rows: refused
    before it runs, saying how many passes and how much slower."""
    model, x = _model("mobilenet_v2")
    with pytest.raises(ValueError) as refused:
        jk.jacobian(model, x, "Conv_1", strategy="forward")
    message = str(refused.value)
    assert "forward mode needs 143,360 forward passes" in message, message
    assert "the loop needs 3 backward passes" in message, message
    assert "Forward(max_slowdown=None)" in message, message


# Per-example rows and norms by the default call, on a transformer
# projection, a LayerNorm and a depthwise convolution of these models, all by
# batch's closed form (keras_hub's attention and LayerNorms are called from
# Python inside its TransformerEncoder: found in the traced pass).
PER_EXAMPLE = {
    "transformer_query": (
        "bert",
        "transformer_layer_0/query",
        "transformer_layer_0/self_attention_layer/query/",
    ),
    "layer_norm": (
        "bert",
        "transformer_layer_0/self_attention_layer_norm",
        "transformer_layer_0/self_attention_layer_norm/",
    ),
    "depthwise": (
        "mobilenet_v2",
        "block_1_depthwise",
        "block_1_depthwise/",
    ),
}


def _per_example_reference(target: str):
    key = ("per_example", target)
    if key not in _REFERENCES:
        name, _, prefix = PER_EXAMPLE[target]
        model, x = _model(name)
        found = [v for v in model.weights if v.path.startswith(prefix)]
        assert found, prefix
        _REFERENCES[key] = testing.float64_reference(
            model,
            x,
            found,
            outputs="per_example",
            call_kwargs={"training": False},
        )
    return _REFERENCES[key]


@pytest.mark.parametrize("target", list(PER_EXAMPLE))
def test_per_example_rows_and_norms_agree_with_float64(target):
    name, layer, _ = PER_EXAMPLE[target]
    model, x = _model(name)
    reference = _per_example_reference(target)
    rows = jk.jacobian(model, x, layer, outputs="per_example")
    assert rows.rows_shape == (2, 3)
    assert rows.strategy == "batch", rows.plan
    testing.assert_close(rows, reference)
    norms = jk.jacobian(model, x, layer, outputs="per_example", reduce="norm")
    for got, full in zip(norms.jacobians.values(), reference.jacobians):
        flat = np.asarray(full).reshape(2, 3, -1)
        # float32 norms of float64 rows: measured within 2e-6 here
        expected = np.sqrt((flat**2).sum(-1))
        assert testing.max_relative_difference(got, expected) < 1e-4


def test_memory_prior_on_a_frozen_backbone_is_within_2x_of_the_peak():
    """Issue 20: the prior once put a frozen MobileNetV2 head 4-17x off.
    Now its first call (the eager loop: few rows) holds every layer's output,
    and the prior counts them. Measured here (alpha 0.35, 32 px, 8 images):
    1.06x; asserted within 2x either way, in a fresh session (a
    model of its own) so that nothing was measured before."""
    from jacobkit import memory

    ex = examples.build("frozen_mobilenet", batch=8, size=32, alpha=0.35)
    plan = jk.plan(ex.model, ex.inputs, "head", cache=False)
    assert plan.strategy.name == "loop"
    with memory.PeakMemory("CPU:0") as peak:
        result = jk.jacobian(ex.model, ex.inputs, "head", cache=False)
    assert result.strategy == "loop"
    ratio = plan.predicted_peak_bytes / peak.extra_bytes
    assert 0.5 <= ratio <= 2.0, (plan.predicted_peak_bytes, peak.extra_bytes)
