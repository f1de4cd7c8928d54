"""Checking a result: ``jk.verify``, ``testing.float64_reference`` and
``testing.assert_close`` take every target ``jk.jacobian`` takes, and do not
report a correct result wrong where one target's exact Jacobian is zero.

The models the other tests do not use come from keras_hub at tiny random
configurations (nothing is downloaded): a GPT-2 backbone, whose attention key
bias has a zero Jacobian (the softmax over the keys cancels it), and a ViT
inside a functional model, whose layers are named by nested paths.
"""

from __future__ import annotations

import functools

import numpy as np
import pytest

import jacobkit as jk
from jacobkit import testing
from jacobkit.keras import layer_tree
from tests import hub_models
from tests.cases import OUTPUTS, TARGETS, example, tensor_reference, two_blocks

keras = pytest.importorskip("keras")
keras_hub = pytest.importorskip("keras_hub")

#: the key projection of GPT-2's first attention layer: its bias shifts every
#: logit of a query by the same amount, which the softmax cancels
KEY = "transformer_layer_0/self_attention/key"
#: a Dense layer of the ViT, by the path the issue named
VIT_DENSE = "vit_encoder/transformer_block_2/mlp/dense_1"


@functools.cache
def _gpt2():
    keras.utils.set_random_seed(0)
    backbone = hub_models.gpt2(layers=2, hidden=8, intermediate=16)
    tokens = np.random.default_rng(0).integers(0, 50, (2, 6)).astype("int32")
    return backbone, {"token_ids": tokens, "padding_mask": np.ones_like(tokens)}


@functools.cache
def _vit():
    """A tiny keras_hub ViT inside a functional model with a Dense head."""
    keras.utils.set_random_seed(0)
    vit = hub_models.vit(layers=3, name="vit")
    x_in = keras.Input((16, 16, 3))
    head = keras.layers.Dense(3, name="head")(vit(x_in)[:, 0])
    model = keras.Model(x_in, head)
    x = np.random.default_rng(0).normal(size=(2, 16, 16, 3)).astype("float32")
    return model, x


@functools.cache
def _gpt2_key():
    """The float64 reference of the key projection, and the loop's result."""
    model, x = _gpt2()
    variables = [v for v in model.weights if v.path.startswith(f"{KEY}/")]
    reference = testing.float64_reference(model, x, variables)
    result = jk.jacobian(model, x, KEY, strategy="loop")
    assert list(result) == [v.path for v in variables]
    return reference, result


# -- a target whose exact Jacobian is zero ---------------------------------------
def test_a_target_whose_exact_jacobian_is_zero_passes_assert_close():
    reference, result = _gpt2_key()
    kernel, bias = reference
    # the premise: in float64 the bias's Jacobian is round-off, 1.7e-18
    # against the kernel's 3.4e-2
    assert np.max(np.abs(bias)) < 1e-15 * np.max(np.abs(kernel))
    # float32 gives 1.5e-9 there: 4.4e-8 of the result's largest value, but
    # 9.0e8 relative to the bias's own float64 round-off (the failure before);
    # measured 1.9e-7 (the kernel)
    assert testing.assert_close(result, reference) < 1e-6
    # an exact zero (what a closed form may give) passes too
    zeroed = [np.array(result.kernel), np.zeros_like(result.bias)]
    assert testing.assert_close(zeroed, reference) < 1e-6


def test_a_target_whose_exact_jacobian_is_zero_passes_verify():
    """It failed with "key/bias is wrong ... 1.09e+00 relative" (the bias's
    own scale); against the result's scale, measured 2.9e-7."""
    model, x = _gpt2()
    _, result = _gpt2_key()
    assert jk.verify(result, model, x, KEY) < 1e-5
    zeroed = [np.array(result.kernel), np.zeros_like(result.bias)]
    assert jk.verify(zeroed, model, x, KEY) < 1e-5


@pytest.mark.parametrize("which", [0, 1], ids=["kernel", "bias"])
def test_a_wrong_result_is_still_caught(which):
    """One entry off by the result's largest value, in the kernel or in the
    zero bias. ``verify`` sees an error of one entry whenever it exceeds its
    tolerance 1e-4 times ``max |v^T J|`` <= 16 x 8 rows x the largest value
    (NOTE in jacobkit/verification.py): 1.3% of it; ``assert_close`` one
    above 1e-5 of it."""
    model, x = _gpt2()
    reference, result = _gpt2_key()
    largest = float(np.max(np.abs(result.kernel)))
    wrong = [np.array(a) for a in result.jacobians.values()]
    wrong[which].flat[5] += largest
    name = ("kernel", "bias")[which]
    with pytest.raises(jk.VerificationError, match=f"key/{name} is wrong"):
        jk.verify(wrong, model, x, KEY)
    with pytest.raises(AssertionError, match=f"Jacobian {which} differs"):
        testing.assert_close(wrong, reference)


# -- per-example and full rows of Inputs() and Output() ---------------------------
@pytest.mark.parametrize("outputs", ["per_example", "full"])
@pytest.mark.parametrize(
    "index", range(len(TARGETS)), ids=[f"{c.problem}-{c.id}" for c in TARGETS]
)
def test_verify_checks_each_examples_own_block(index, outputs):
    """These results keep each example's own block (``rows_shape +
    target.shape[1:]``); verify checked them against ``rows_shape +
    target.shape`` and refused them with a shape error."""
    case = TARGETS[index]
    ex = example(case.problem)
    call = dict(outputs=outputs)
    result = jk.jacobian(ex.model, ex.inputs, case.target, strategy="chunked", **call)
    # measured at most 3.3e-7 over these targets; the float32 tolerance 1e-4
    assert jk.verify(result, ex.model, ex.inputs, case.target, **call) < 1e-4
    blocks = np.array(result[0])
    largest = float(np.max(np.abs(blocks)))
    # one entry off by the largest value: seen above 1e-4 x 16 x K rows of
    # the largest value (K at most 40 here: 6.4%)
    one = blocks.copy()
    one[1, 0].flat[2] += largest
    # two rows of example 1 exchanged (each the other's Jacobian)
    swapped = blocks.copy()
    swapped[1, [0, 1]] = blocks[1, [1, 0]]
    assert np.any(swapped != blocks)
    for wrong in (one, swapped):
        with pytest.raises(jk.VerificationError, match="is wrong"):
            jk.verify([wrong], ex.model, ex.inputs, case.target, **call)


# -- float64_reference: every target jacobian() takes ----------------------------
@pytest.mark.parametrize("outputs", ["features", "per_example", "full"])
@pytest.mark.parametrize(
    "index", range(len(TARGETS)), ids=[f"{c.problem}-{c.id}" for c in TARGETS]
)
def test_float64_reference_of_a_tensor_target(index, outputs):
    """``Inputs()``, ``Inputs("b")`` and ``Output("layer")`` against the float64
    reference written out by hand for each case (``tests/cases.py``: the rest
    of the model as a function of the target tensor)."""
    case = TARGETS[index]
    ex = example(case.problem)
    expected = tensor_reference(index, outputs)
    result = jk.jacobian(ex.model, ex.inputs, case.target, outputs=OUTPUTS[outputs])
    if case.problem == "tf_module":
        # no float64 copy of a tf.Module: refused, not its own float32 loop
        # (which assert_close would hold it to, a check against nothing)
        with pytest.raises(TypeError, match="no float64 copy of the model"):
            testing.float64_reference(
                ex.model, ex.inputs, case.target, outputs=OUTPUTS[outputs]
            )
        testing.assert_close(result, [expected])
        return
    reference = testing.float64_reference(
        ex.model, ex.inputs, case.target, outputs=OUTPUTS[outputs]
    )
    assert reference[0].shape == expected.shape
    # measured: 0 (float64 on both sides, the float32 weights exact in float64)
    assert testing.max_relative_difference(reference[0], expected) < 1e-6
    assert list(result) == list(reference.names)
    testing.assert_close(result, reference)
    jk.verify(result, ex.model, ex.inputs, case.target, outputs=OUTPUTS[outputs])


def _vit_forms(model) -> dict:
    (layer,) = [
        layer
        for layer, path in layer_tree.named_layers(model)
        if path == f"vit/{VIT_DENSE}"
    ]
    return {
        "path": VIT_DENSE,
        "layer": layer,
        "variables": [layer.kernel, layer.bias],
        "name": "head",
    }


@pytest.mark.parametrize("form", ["path", "layer", "variables", "name"])
def test_float64_reference_takes_every_form_of_a_layer(form):
    """A nested path (a ValueError before), a layer object, a list of
    variables and a unique name: the reference of the same variables as
    ``jacobian`` resolves them (the plain list, checked against a closed form
    in ``tests/test_reference.py``)."""
    model, x = _vit()
    target = _vit_forms(model)[form]
    reference = testing.float64_reference(model, x, target, outputs="per_example")
    result = jk.jacobian(model, x, target, outputs="per_example", cache=False)
    owner = model.get_layer("head") if form == "name" else _vit_forms(model)["layer"]
    plain = testing.float64_reference(
        model, x, [owner.kernel, owner.bias], outputs="per_example"
    )
    assert list(reference.names) == list(result)
    for mine, expected in zip(reference, plain, strict=True):
        np.testing.assert_array_equal(mine, expected)
    # measured: the float32 loop 2.9e-7 to 8.3e-7 from float64 (within the
    # default tolerance, twice that)
    testing.assert_close(result, reference)
    jk.verify(result, model, x, target, outputs="per_example")


def test_float64_reference_takes_a_path_among_repeated_names():
    """``query`` names two layers (one per block): refused as jacobian()
    refuses it; ``block_1/query`` names one."""
    model, x = two_blocks()
    with pytest.raises(ValueError, match="2 layers of the model match 'query'"):
        testing.float64_reference(model, x, "query")
    reference = testing.float64_reference(model, x, "block_1/query")
    assert reference.names == ("block_1/query/kernel", "block_1/query/bias")
    testing.assert_close(jk.jacobian(model, x, "block_1/query"), reference)


def test_float64_reference_refuses_what_jacobian_refuses():
    model, x = _gpt2()
    with pytest.raises(TypeError, match=r"float64_reference\(layer=Inputs\(None\)\)"):
        testing.float64_reference(model, x, jk.Inputs())
    with pytest.raises(ValueError, match="float64_reference"):
        testing.float64_reference(model, x, jk.Output("transformer_layer_0/key"))
    vit, images = _vit()
    # a layer keras_hub calls from Python: no graph node to tap
    with pytest.raises(ValueError, match=r"Output\('dense_1'\)"):
        testing.float64_reference(vit, images, jk.Output(VIT_DENSE))
