"""Every registered strategy × every test problem × every ``outputs`` mode,
against the float64 reference."""

from __future__ import annotations

import numpy as np
import pytest

import jacobkit as jk
from jacobkit import testing
from jacobkit.problem import Problem
from tests.cases import (
    BATCH_REFUSES,
    OUTPUTS,
    PROBLEMS,
    STRATEGIES,
    STRUCTURED_APPLIES,
    STRUCTURED_REFUSES,
    example,
    reference,
    skip_same_chunks,
)


@pytest.mark.parametrize("outputs", list(OUTPUTS))
@pytest.mark.parametrize("problem", PROBLEMS)
@pytest.mark.parametrize("case", STRATEGIES, ids=lambda c: c.id)
def test_agrees_with_float64_reference(case, problem, outputs, request):
    ex = example(problem)
    problem_ = Problem(ex.model, ex.inputs, ex.layer, outputs=OUTPUTS[outputs])
    skip_same_chunks(request, case, problem_.num_rows, problem_.num_rows)
    strategy = case.make(problem_.num_rows)
    refuse = strategy.name == "batch" and (
        problem in BATCH_REFUSES or outputs == "callable"
    )
    if strategy.name == "structured" and (problem, outputs) not in STRUCTURED_APPLIES:
        with pytest.raises(ValueError, match=STRUCTURED_REFUSES):
            jk.jacobian(
                ex.model,
                ex.inputs,
                ex.layer,
                strategy=strategy,
                outputs=OUTPUTS[outputs],
            )
        return
    if refuse:
        match = _batch_refusal(problem, outputs)
        with pytest.raises(ValueError, match=match):
            jk.jacobian(
                ex.model,
                ex.inputs,
                ex.layer,
                strategy=strategy,
                outputs=OUTPUTS[outputs],
            )
        return
    result = jk.jacobian(
        ex.model, ex.inputs, ex.layer, strategy=strategy, outputs=OUTPUTS[outputs]
    )
    assert result.strategy == strategy.name
    assert result.rows_shape == problem_.rows_shape
    assert (
        result.rows_shape
        == reference(problem, outputs)[0].shape[: len(result.rows_shape)]
    )
    testing.assert_close(result, reference(problem, outputs))


def _batch_refusal(problem: str, outputs: str) -> str:
    """The batch strategy checks the layer type, then the rows, then sharing."""
    if problem == "tf_module" or outputs != "callable":
        return BATCH_REFUSES[problem]
    return "a callable outputs= may mix"


@pytest.mark.parametrize("case", STRATEGIES, ids=lambda c: c.id)
def test_feature_subset(case, request):
    ex = example("generator")
    features = (4, 0, 2)
    skip_same_chunks(request, case, len(features), len(features))
    strategy = case.make(len(features))
    if strategy.name == "structured":  # 3 features, 6 channels before the head
        with pytest.raises(ValueError, match="6 inputs for 3 features, no fewer"):
            jk.jacobian(
                ex.model, ex.inputs, ex.layer, strategy=strategy, features=[4, 0, 2]
            )
        return
    result = jk.jacobian(
        ex.model, ex.inputs, ex.layer, strategy=strategy, features=list(features)
    )
    assert result.rows_shape == (3,)
    testing.assert_close(result, reference("generator", "features", features))


def test_chunk_sizes_beyond_the_rows_are_the_rows():
    """``chunked`` runs chunks of ``min(chunk_size, R)`` rows: a larger size
    gives the same numbers, bit for bit, as ``chunk_size=R``. The suite
    relies on it to run such twins with ``--slow`` only
    (:func:`tests.cases.same_chunks_as`)."""
    ex = example("mlp")
    rows = Problem(ex.model, ex.inputs, ex.layer, outputs="features").num_rows
    assert rows == 10
    found = [
        jk.jacobian(ex.model, ex.inputs, ex.layer, strategy=jk.strategies.Chunked(size))
        for size in (rows, 16, rows + 1000)
    ]
    for other in found[1:]:
        for want, got in zip(
            found[0].jacobians.values(), other.jacobians.values(), strict=True
        ):
            np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
