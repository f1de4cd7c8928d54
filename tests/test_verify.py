"""``jk.verify``: passes every strategy's correct result, catches wrong ones."""

from __future__ import annotations

import keras
import numpy as np
import pytest

import jacobkit as jk
from jacobkit import testing
from tests.cases import example


@pytest.fixture(scope="module")
def tagger():
    """The dense_head example (every registered strategy applies to it) and
    a correct result, from the loop."""
    ex = example("dense_head")
    result = jk.jacobian(ex.model, ex.inputs, ex.layer, strategy="loop")
    return ex, result


@pytest.mark.parametrize("name", list(jk.strategies.REGISTRY))
@pytest.mark.parametrize("outputs", ["features", "per_example"])
def test_passes_every_strategys_correct_result(name, outputs):
    ex = example("dense_head")
    result = jk.jacobian(ex.model, ex.inputs, ex.layer, strategy=name, outputs=outputs)
    worst = jk.verify(result, ex.model, ex.inputs, ex.layer, outputs=outputs)
    # measured over every strategy x problem x outputs mode: at most 5e-6
    # in float32 (see jacobkit/verification.py TOLERANCES)
    assert 0 <= worst < 1e-4


def test_passes_a_float64_result_with_the_float64_tolerance():
    ex = example("generator", "float64")
    result = jk.jacobian(
        ex.model, ex.inputs, ex.layer, strategy="chunked", outputs="per_example"
    )
    assert jk.verify(result, ex.model, ex.inputs, ex.layer, outputs="per_example") < (
        1e-10
    )


def _corrupted(result, change) -> list[np.ndarray]:
    arrays = [np.array(j) for j in result.jacobians.values()]
    change(arrays)
    return arrays


def test_catches_a_corrupted_row(tagger):
    ex, result = tagger

    def swap_rows(arrays):  # rows 1 and 3 of the kernel Jacobian exchanged
        arrays[0][[1, 3]] = arrays[0][[3, 1]]

    with pytest.raises(jk.VerificationError, match="Jacobian for .*kernel is wrong"):
        jk.verify(_corrupted(result, swap_rows), ex.model, ex.inputs, ex.layer)

    def zero_row(arrays):
        arrays[1][2] = 0.0

    with pytest.raises(jk.VerificationError, match="bias is wrong"):
        jk.verify(_corrupted(result, zero_row), ex.model, ex.inputs, ex.layer)


@pytest.mark.parametrize("seed", range(3))
def test_catches_one_wrong_element(tagger, seed):
    """One kernel entry off by 5% of the largest, in a column where it must
    be zero. Per the NOTE in jacobkit/verification.py it is caught whatever the
    cotangents (``|v_r| >= 1``): ``tolerance * max|v^T J|`` is at most
    ``1e-4 * 16 * 5 rows * the largest entry``, 0.8% of it."""
    ex, result = tagger
    largest = float(np.max(np.abs(result.kernel)))

    def one_element(arrays):
        arrays[0][2, 1, 4] += 0.05 * largest  # row 2, column 4

    with pytest.raises(AssertionError, match="kernel is wrong"):
        jk.verify(
            _corrupted(result, one_element), ex.model, ex.inputs, ex.layer, seed=seed
        )


def test_catches_a_result_for_other_features():
    """Same shapes, other rows: features [0, 1, 2] checked as [1, 0, 2]."""
    ex = example("generator")
    result = jk.jacobian(
        ex.model, ex.inputs, ex.layer, strategy="chunked", features=[0, 1, 2]
    )
    assert jk.verify(result, ex.model, ex.inputs, ex.layer, features=[0, 1, 2]) < 1e-4
    with pytest.raises(jk.VerificationError):
        jk.verify(result, ex.model, ex.inputs, ex.layer, features=[1, 0, 2])


def test_wrong_shapes_and_arguments_are_clear_errors(tagger):
    ex, result = tagger
    with pytest.raises(ValueError, match=r"rows_shape \(3, 5\)\). Pass the outputs="):
        jk.verify(result, ex.model, ex.inputs, ex.layer, outputs="per_example")
    with pytest.raises(ValueError, match="has 1 Jacobian.* but layer= gives 2"):
        jk.verify([result.kernel], ex.model, ex.inputs, ex.layer)
    with pytest.raises(ValueError, match=r"verify\(probes=0\): need at least one"):
        jk.verify(result, ex.model, ex.inputs, ex.layer, probes=0)


@pytest.mark.parametrize("reduce", ["norm", "clipped_sum", "project", "gram"])
def test_a_reduced_result_is_refused_with_what_to_check_instead(reduce):
    """Before: a hint to pass other ``outputs=`` (norms, a clipped sum, a
    projection) or a raw ``TypeError`` (a Gram)."""
    ex = example("dense_head")
    args = (ex.model, ex.inputs, ex.layer)
    outputs: object = "per_example"
    if reduce == "gram":
        result = jk.gram(ex.model, ex.inputs, layer=ex.layer)
    elif reduce == "clipped_sum":  # clipped per example: loss rows
        labels = np.zeros(ex.model(ex.inputs).shape, "float32")
        outputs = jk.Loss(keras.losses.MeanSquaredError(reduction=None))
        args = (ex.model, (ex.inputs, labels), ex.layer)
        result = jk.jacobian(*args, outputs=outputs, reduce=jk.ClippedSum(1.0))
    else:
        spelled = {"norm": "norm"}.get(reduce, jk.Project(4))
        result = jk.jacobian(*args, outputs="per_example", reduce=spelled)
    with pytest.raises(ValueError, match=r"checks rows of Jacobians .* without reduce"):
        jk.verify(result, *args, outputs=outputs)


def test_testing_exports_it():
    assert testing.verify is jk.verify
    assert testing.VerificationError is jk.VerificationError
    assert issubclass(jk.VerificationError, AssertionError)
