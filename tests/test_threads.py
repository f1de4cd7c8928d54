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
from tests import hub_models
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


def test_two_threads_tap_the_same_keras_hub_model_at_once():
    """The layers of a keras_hub block are found in the traced pass (no node
    of a graph to tap): two threads computing per-example rows of a GPT-2's
    feed-forward layer, each on its own inputs, while a third runs the model,
    all get their own correct answers; the model's weights never change."""
    backbone = hub_models.gpt2(layers=2, hidden=8, intermediate=16)
    rng = np.random.default_rng(0)
    batches = [
        {
            "token_ids": rng.integers(1, 50, (2, 6)).astype("int32"),
            "padding_mask": np.ones((2, 6), "int32"),
        }
        for _ in range(2)
    ]
    target = "transformer_layer_1/feedforward_intermediate_dense"
    expected = [
        jk.jacobian(backbone, x, target, strategy="loop", outputs="per_example")
        for x in batches
    ]
    weights = [w.numpy().copy() for w in backbone.weights]
    model_outputs = backbone(batches[0]).numpy()
    start = threading.Barrier(3)
    errors: list[BaseException] = []
    results: dict[int, list[jk.JacobianResult]] = {0: [], 1: []}
    outputs: list[np.ndarray] = []

    def jacobians(which: int) -> None:
        try:
            start.wait()
            for _ in range(ROUNDS):
                results[which].append(
                    jk.jacobian(
                        backbone,
                        batches[which],
                        target,
                        strategy="batch",
                        outputs="per_example",
                    )
                )
        except BaseException as err:  # noqa: BLE001 - reported below
            errors.append(err)

    def predictions() -> None:
        try:
            start.wait()
            for _ in range(5 * ROUNDS):
                outputs.append(backbone(batches[0]).numpy())
        except BaseException as err:  # noqa: BLE001 - reported below
            errors.append(err)

    threads = [
        threading.Thread(target=jacobians, args=(0,)),
        threading.Thread(target=jacobians, args=(1,)),
        threading.Thread(target=predictions),
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors, errors
    for which in (0, 1):
        assert len(results[which]) == ROUNDS
        for result in results[which]:
            # float32 against the loop: measured 1e-7 relative
            testing.assert_close(
                result, list(expected[which].jacobians.values()), tolerance=1e-5
            )
    for output in outputs:
        np.testing.assert_array_equal(output, model_outputs)
    for before, weight in zip(weights, backbone.weights, strict=True):
        np.testing.assert_array_equal(before, weight.numpy())
