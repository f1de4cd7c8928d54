"""Every registered layer rule, called every way a model calls a layer, in
every row mode and as norms, against float64 (``tests/layer_cases.py``).

A rule is tested by being registered: the cases are the registry's kinds with
a rule (``jacobkit.layers.REGISTRY``), and those with a rule for LoRA-enabled
layers (``LayerKind.lora``, named ``"Dense (LoRA)"``), each with its example;
one without an example fails :func:`test_every_registered_rule_has_an_example`.
"""

from __future__ import annotations

import numpy as np
import pytest

import jacobkit as jk
from jacobkit import layers, testing
from jacobkit.keras import compat
from jacobkit.problem import Problem
from tests import layer_cases

RULES = sorted(
    {layer_cases.case_name(k) for k in layers.REGISTRY.kinds if k.rule is not None}
    | {
        layer_cases.case_name(k) + layer_cases.LORA
        for k in layers.REGISTRY.kinds
        if k.lora is not None
    }
)
MODES = ("features", "per_example", "full")


def test_every_registered_rule_has_an_example():
    missing = [name for name in RULES if name not in layer_cases.CASES]
    assert missing == [], f"add an example to tests/layer_cases.py for {missing}"


#: the float64 references computed in this process, by ``(name, way,
#: outputs)``: the rows' and the norms' cases of a row mode share one
#: (:func:`_reference`)
_EXPECTED: dict[tuple[str, str, str], tuple[np.ndarray, ...]] = {}


def _reference(name: str, way: str, outputs: str) -> tuple:
    """``(model, layer, x, expected)``: a model of its own for the case, and
    the batch strategy's Jacobians' and norms' float64 references: the loop
    on the same model built in float64 with the same weights (a build is
    deterministic: :func:`tests.layer_cases.built`). The references are
    computed once per process and read-only (measured under load on Conv1D
    and LayerScale: the norms' cases took 30% less CPU time)."""
    model, layer, x = layer_cases.built(name, way, "float32")
    key = (name, way, outputs)
    if key not in _EXPECTED:
        model64, _, x64 = layer_cases.built(name, way, "float64")
        targets = Problem(model, x, layer).targets
        weights = [compat.unwrap(w) for w in model.weights]
        positions = [
            next(i for i, w in enumerate(weights) if w is compat.unwrap(t))
            for t in targets
        ]
        variables = [model64.weights[i] for i in positions]
        expected = testing.reference_jacobian(model64, x64, variables, outputs=outputs)
        arrays = tuple(np.array(e, np.float64) for e in expected)
        for array in arrays:
            array.setflags(write=False)
        _EXPECTED[key] = arrays
    return model, layer, x, _EXPECTED[key]


@pytest.mark.parametrize("outputs", MODES)
@pytest.mark.parametrize("way", list(layer_cases.WAYS))
@pytest.mark.parametrize("name", RULES)
def test_rule_agrees_with_float64(name, way, outputs):
    model, layer, x, expected = _reference(name, way, outputs)
    result = jk.jacobian(model, x, layer, strategy="batch", outputs=outputs)
    # float32 against float64: measured at most 4e-7 relative over the cases;
    # assert_close derives its tolerance from the loop's own error
    testing.assert_close(result, list(expected))


@pytest.mark.parametrize("outputs", ["features", "per_example"])
@pytest.mark.parametrize("way", list(layer_cases.WAYS))
@pytest.mark.parametrize("name", RULES)
def test_rule_norms_agree_with_float64(name, way, outputs):
    model, layer, x, expected = _reference(name, way, outputs)
    result = jk.jacobian(
        model, x, layer, strategy="batch", outputs=outputs, reduce="norm"
    )
    expected_norms = []
    for got, full in zip(result.jacobians.values(), expected, strict=True):
        rows = int(np.prod(got.shape))
        expected_norms.append(
            np.sqrt((np.asarray(full).reshape(rows, -1) ** 2).sum(-1))
        )
    # float32 norms of float64 rows: measured within 3e-7 relative to the
    # largest norm of the result (a target whose Jacobian is zero, an
    # attention key's bias, is judged on that scale too); 1e-5 leaves 30x
    scale = max(float(n.max()) for n in expected_norms) + 1e-30
    for got, norms in zip(result.jacobians.values(), expected_norms, strict=True):
        assert np.abs(np.ravel(got) - norms).max() <= 1e-5 * scale


@pytest.mark.parametrize("name", RULES)
def test_factored_rules_map_their_patches(name):
    """``unfold_times(x, M)`` (a Kronecker projection's left factor on the
    patches; a convolution convolves with ``M`` instead of unfolding) equals
    the patches times ``M`` in float64, for every rule whose gradients are
    factored. Measured: at most 9e-8 of the largest entry (1e-5 leaves
    100x)."""
    model, layer, x = layer_cases.built(name, "functional", "float32")
    rule = layers.rule_for(layer)
    assert rule is not None
    if not rule.factored() or layer_cases.CASES[name].ids:
        pytest.skip(f"{name}: not a factored rule on floating input")
    _assert_maps_patches(rule, x)


def _assert_maps_patches(rule, x) -> None:
    """``rule.unfold_times(x, M)`` equals ``rule.unfold(x) @ M`` in float64
    (1e-5 of the largest entry)."""
    patches = np.asarray(rule.unfold(x), np.float64)
    matrix = np.random.default_rng(1).normal(size=(patches.shape[-1], 5))
    want = patches @ matrix
    got = np.asarray(rule.unfold_times(x, matrix.astype(np.float32)))
    assert got.shape == want.shape, type(rule).__name__
    assert np.abs(got - want).max() <= 1e-5 * np.abs(want).max()


@pytest.mark.parametrize("name", RULES)
def test_factored_parts_map_their_patches(name):
    """As :func:`test_factored_rules_map_their_patches`, for each factored
    part of every rule (a separable convolution's pointwise half, attention's
    projections, ViT's patch convolution), on the input the part itself sees:
    each part's tapped input from the rule's own ``tapped_call`` at the
    layer's node. A part mapped through the wrong window failed here
    (``ConvRule.unfold_times`` on the 1x1 pointwise half reshaped to the
    layer's 3x3). Measured: at most 1.2e-7 of the largest entry."""
    from jacobkit.keras import graph

    model, layer, x = layer_cases.built(name, "functional", "float32")
    rule = layers.rule_for(layer)
    assert rule is not None
    parts = rule.parts()
    if not any(part.factored() for part in parts):
        pytest.skip(f"{name}: no factored part")
    weights = [(part.weight("kernel"), part.weight("bias")) for part in parts]
    taps: list = []

    def hook(call, args, kwargs):
        output, found = rule.tapped_call(args, kwargs, weights, lambda z: z)
        taps.extend(found)
        return output

    graph.LayerTap(model, layer)(x, False, hook)
    assert len(taps) == len(parts), (name, len(taps), len(parts))
    checked = 0
    for part, tap in zip(parts, taps, strict=True):
        if not part.factored() or not tap.inputs.dtype.is_floating:
            continue
        _assert_maps_patches(part, tap.inputs)
        checked += 1
    if not checked:
        pytest.skip(f"{name}: no factored part on floating input")
