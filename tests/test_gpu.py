"""The GPU path: every strategy on ``device="GPU:0"`` agrees with the float64
reference, and peak memory is read from the GPU. Skipped without a GPU."""

from __future__ import annotations

import pytest
import tensorflow as tf

import jacobkit as jk
from jacobkit import memory, testing
from tests.cases import STRATEGIES, example, reference

pytestmark = pytest.mark.skipif(
    not tf.config.list_physical_devices("GPU"), reason="TensorFlow sees no GPU"
)


@pytest.mark.gpu
@pytest.mark.parametrize("case", STRATEGIES, ids=lambda c: c.id)
def test_strategy_on_gpu(case):
    ex = example("generator")
    strategy = case.make(5)
    with memory.PeakMemory("GPU:0") as peak:
        result = jk.jacobian(
            ex.model, ex.inputs, ex.layer, strategy=strategy, device="GPU:0"
        )
    assert "GPU" in result.kernel.device
    assert peak.extra_bytes > 0
    testing.assert_close(result, reference("generator", "features"))


@pytest.mark.gpu
def test_auto_on_gpu_stays_within_budget():
    ex = example("generator")
    with memory.PeakMemory("GPU:0") as peak:
        result = jk.jacobian(
            ex.model, ex.inputs, ex.layer, memory_budget="256MiB", device="GPU:0"
        )
    assert peak.extra_bytes <= 256 * 2**20
    testing.assert_close(result, reference("generator", "features"))
