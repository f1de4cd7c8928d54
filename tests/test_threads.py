"""jacobkit never changes the user's model, even for a moment: two threads
computing Jacobians of one model while a third runs the model all get correct
answers, and the layer objects keep their own ``call`` and ``activation``.

(Before, the batch strategy replaced ``layer.call`` and ``layer.activation``
while tracing: a second thread crashed with ``'Conv1D' object has no attribute
'call'`` and the model ran with the activation replaced by the identity.)
"""

from __future__ import annotations

import threading

import numpy as np
import pytest

import jacobkit as jk
from jacobkit import testing
from jacobkit.testing import examples
from tests.cases import TARGETS, reference, tensor_reference

ROUNDS = 3


def _attributes(layer) -> tuple:
    return (dict(vars(layer)).get("call"), layer.activation, type(layer).call)


#: (strategy, problem, target): every registered strategy on its problem's
#: layer (structured on the one whose head it colours: it has no shortcut on
#: the generator), and an Output target
CASES = [
    (name, "dense_head" if name == "structured" else "generator", "layer")
    for name in jk.strategies.REGISTRY
] + [("chunked", "generator", "output(conv2)")]


@pytest.mark.parametrize(("strategy", "problem", "target"), CASES)
def test_two_jacobian_threads_and_a_model_thread(strategy, problem, target):
    ex = examples.build(problem)
    if target == "layer":
        expected = reference(problem, "per_example")
        target = ex.layer
    else:  # the tap of an Output target runs the graph beside the model too
        case = TARGETS[[c.id for c in TARGETS].index(target)]
        expected = [tensor_reference(TARGETS.index(case), "per_example")]
        target = case.target
    model, layer = ex.model, ex.model.get_layer(ex.layer)
    before = _attributes(layer)
    expected_outputs = model(ex.inputs, training=False).numpy()
    start = threading.Barrier(3)
    errors: list[BaseException] = []
    results: list[jk.JacobianResult] = []
    outputs: list[np.ndarray] = []
    seen: list[tuple] = []

    def jacobians():
        try:
            start.wait()
            for _ in range(ROUNDS):
                results.append(
                    jk.jacobian(
                        model,
                        ex.inputs,
                        target,
                        strategy=strategy,
                        outputs="per_example",
                    )
                )
        except BaseException as err:  # noqa: BLE001 - reported below
            errors.append(err)

    def predictions():
        try:
            start.wait()
            for _ in range(20 * ROUNDS):
                seen.append(_attributes(layer))
                outputs.append(model(ex.inputs, training=False).numpy())
        except BaseException as err:  # noqa: BLE001 - reported below
            errors.append(err)

    threads = [threading.Thread(target=f) for f in (jacobians, jacobians, predictions)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors, errors
    assert len(results) == 2 * ROUNDS
    for result in results:
        testing.assert_close(result, expected)
    # the model thread saw the model's own outputs (same ops: bit-identical)
    for output in outputs:
        np.testing.assert_array_equal(output, expected_outputs)
    assert all(attributes == before for attributes in seen)
    assert _attributes(layer) == before
    assert "call" not in vars(layer)
