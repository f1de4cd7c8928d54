"""``reduce="norm"``: per-row L2 norms of each target's Jacobian, against the
norms of the materialized float64 reference, for every registered strategy:
natively where it lists the kind (``Strategy.native``: one chunk of rows'
Jacobians held at a time), else from the rows it holds anyway (the kind's
generic computation)."""

from __future__ import annotations

import numpy as np
import pytest

import jacobkit as jk
from jacobkit import testing
from jacobkit.layers import norms
from jacobkit.testing import examples
from tests.cases import call_kwargs, reference, target_variables

#: each registered strategy, with its default options
NORM_STRATEGIES = {name: cls() for name, cls in jk.strategies.REGISTRY.items()}
NORM_STRATEGIES.update({"chunked(3)": jk.strategies.Chunked(3), "auto": "auto"})


def _norms(jacobians, rows_shape):
    return [
        np.sqrt(np.sum(np.reshape(j, (*rows_shape, -1)) ** 2, axis=-1))
        for j in jacobians
    ]


@pytest.mark.parametrize("outputs", ["features", "per_example", "full"])
@pytest.mark.parametrize("problem", ["generator", "mlp", "cnn2d", "tf_module"])
@pytest.mark.parametrize("strategy", list(NORM_STRATEGIES))
def test_norms_agree_with_float64_reference(strategy, problem, outputs):
    ex = examples.build(problem)
    if strategy == "batch" and problem == "tf_module":
        with pytest.raises(ValueError, match="supports Dense, Conv1D, Conv2D"):
            jk.jacobian(ex.model, ex.inputs, ex.layer, strategy="batch", reduce="norm")
        return
    try:
        result = jk.jacobian(
            ex.model,
            ex.inputs,
            ex.layer,
            strategy=NORM_STRATEGIES[strategy],
            outputs=outputs,
            reduce="norm",
        )
    except jk.strategies.structured.NoShortcut as refused:
        # structured refuses, in words, a problem no exact shortcut serves
        pytest.skip(str(refused))
    assert result.reduce == "norm"
    expected_jacobians = reference(problem, outputs)
    rows_shape = expected_jacobians[0].shape[: len(result.rows_shape)]
    assert result.rows_shape == rows_shape
    assert all(tuple(v.shape) == rows_shape for v in result.jacobians.values())
    # measured (batch; mlp, cnn2d, generator; every outputs): at most 1.5e-7
    # relative (float32 rounding; one-pass norms, the Dense layer's as
    # ||x|| ||δ||: mlp 1.4e-7, was 1.1e-7); default 1e-5
    testing.assert_close(result, _norms(expected_jacobians, rows_shape))


@pytest.mark.parametrize("sequence", [4, 48])
def test_gram_form_and_chunked_materialization(sequence):
    """Short sequences take the Gram form, long ones chunks of rows (the
    crossover of :func:`jacobkit.layers.norms.use_gram`); both give the norms."""
    sizes = {"batch": 2, "sequence": sequence, "channels": 3, "filters": 4}
    gram = norms.use_gram(sequence, 5 * 3, 4, 5)
    assert gram == (sequence == 4)
    ex = examples.build("generator", **sizes)
    ex64 = examples.build("generator", "float64", **sizes)
    result = jk.jacobian(
        ex.model,
        ex.inputs,
        ex.layer,
        strategy="batch",
        outputs="per_example",
        reduce="norm",
    )
    expected = testing.reference_jacobian(
        ex64.model,
        ex64.inputs,
        target_variables(ex64),
        outputs="per_example",
        call_kwargs=call_kwargs(ex64.model),
    )
    testing.assert_close(result, _norms(expected, result.rows_shape))


@pytest.mark.parametrize("strategy", ["auto", "while"])
def test_norms_of_own_example_blocks_of_an_input_target(strategy):
    ex = examples.build("generator")
    full = jk.jacobian(
        ex.model, ex.inputs, jk.Inputs(), outputs="per_example", strategy="loop"
    )
    result = jk.jacobian(
        ex.model,
        ex.inputs,
        jk.Inputs(),
        outputs="per_example",
        reduce="norm",
        strategy=strategy,
    )
    assert result.strategy == ("chunked" if strategy == "auto" else strategy)
    assert tuple(result["inputs"].shape) == full.rows_shape
    testing.assert_close(result, _norms([full["inputs"].numpy()], full.rows_shape))


def test_unknown_reduce():
    ex = examples.build("mlp")
    with pytest.raises(ValueError, match=r"jacobian\(reduce='max'\): expected None"):
        jk.jacobian(ex.model, ex.inputs, ex.layer, reduce="max")
