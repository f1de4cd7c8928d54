"""Rows summed over the batch of a wide Dense layer (the MLP at the FLOP
limit): ``batch`` contracts each chunk of rows as it goes and writes it into
the result, so its peak stays near the result's size; ``auto`` starts on it.

The MLP is the benchmark one, smaller (B=64, 128→256→256→144, a 19 MiB result,
chunks of 29 rows, the last one 28)."""

from __future__ import annotations

import numpy as np
import pytest
import tensorflow as tf

import jacobkit as jk
from jacobkit import memory, testing
from jacobkit.testing import example_models

SIZES = {"batch": 64, "inputs": 128, "hidden": 256, "features": 144}


@pytest.fixture(scope="module")
def mlp():
    return example_models.mlp(**SIZES)


@pytest.fixture(scope="module")
def reference():
    ex = example_models.mlp("float64", **SIZES)
    layer = ex.model.get_layer("hidden1")
    return testing.reference_jacobian(ex.model, ex.inputs, [layer.kernel, layer.bias])


@pytest.mark.parametrize("strategy", ["batch", "auto"])
def test_summed_rows_agree_with_float64(mlp, reference, strategy):
    result = jk.jacobian(mlp.model, mlp.inputs, "hidden1", strategy=strategy)
    assert result.strategy == "batch"  # auto starts on the closed form
    testing.assert_close(result, reference)


def test_peak_is_the_result_plus_one_chunk():
    """On a wider MLP (B=256, 512→512→512→144: a 144 MiB result, chunks of
    16 rows), one call's peak above allocating a result-sized tensor alone
    (``tf.zeros``, measured the same way: 1.77x the result, TensorFlow's own
    copies included) is measured at 0.37-0.44x the result: one chunk's
    kernel rows (0.11x), their cotangents and the tape. The chunks stacked by
    ``tf.map_fn`` before measured 0.90x (a second copy of the result)."""
    if not memory.enable_cpu_memory_stats():
        pytest.skip("CPU memory statistics need TF_CPU_ALLOCATOR_USE_BFC=true")
    sizes = {"batch": 256, "inputs": 512, "hidden": 512, "features": 144}
    ex = example_models.mlp(**sizes)
    result_bytes = 144 * 513 * 512 * 4
    jk.jacobian(ex.model, ex.inputs, "hidden1", strategy="batch")  # traced
    with memory.PeakMemory("CPU:0") as peak:
        result = jk.jacobian(ex.model, ex.inputs, "hidden1", strategy="batch")
    del result
    with memory.PeakMemory("CPU:0") as alone:
        zeros = tf.zeros((144, 513, 512))
    del zeros
    over = (peak.extra_bytes - alone.extra_bytes) / result_bytes
    assert over <= 0.6, over


@pytest.mark.parametrize("chunk", [1, 29, 143])
def test_chunks_written_in_place_keep_every_row(mlp, reference, chunk):
    """``chunked(k)`` shares the in-place writes: a last, smaller chunk and a
    chunk of one row land where they belong."""
    result = jk.jacobian(
        mlp.model, mlp.inputs, "hidden1", strategy=jk.strategies.Chunked(chunk)
    )
    testing.assert_close(result, reference)
    # rows are not repeated or shifted
    kernel = np.asarray(result.kernel)
    assert not np.allclose(kernel[-1], kernel[-2])


#: one row's kernel and bias gradients of the MLP's hidden1, bytes
_ROW_BYTES = (SIZES["inputs"] + 1) * SIZES["hidden"] * 4


@pytest.mark.parametrize(("rows", "size"), [(12, 12), (10, 9), (1, 1)])
def test_chunks_capped_by_their_result_keep_every_row(
    monkeypatch, reference, rows, size
):
    """``batch``'s summed rows in chunks of at most ``CHUNK_RESULT_BYTES``
    (a divisor of the 144 rows where one is within half of the cap) agree
    with float64 as the uncapped chunks do (measured: largest difference
    3.1e-7 of the reference's largest entry at every cap, uncapped too,
    under both CPU kinds; ``assert_close``'s derived tolerance holds it)."""
    from jacobkit.strategies.batch.forms import rows as rows_form

    monkeypatch.setattr(rows_form, "CHUNK_RESULT_BYTES", rows * _ROW_BYTES)
    sizes: list[int] = []
    each_chunk = rows_form.Cotangents.each_chunk

    def recorded(self, contract):
        sizes.append(self.size)
        return each_chunk(self, contract)

    monkeypatch.setattr(rows_form.Cotangents, "each_chunk", recorded)
    ex = example_models.mlp(**SIZES)  # its own model: a fresh trace
    result = jk.jacobian(ex.model, ex.inputs, "hidden1", strategy="batch")
    assert sizes == [size]
    testing.assert_close(result, reference)
    kernel = np.asarray(result.kernel)
    assert not np.allclose(kernel[-1], kernel[-2])


def test_chunk_sizes_at_most():
    """The largest divisor of the rows within half of the cap, else equal
    chunks; never more than the chunk already was."""
    from jacobkit.strategies.batch.contract import Cotangents

    def size(rows: int, now: int, most: int) -> int:
        return Cotangents(lambda start, count: [], rows, now).at_most(most).size

    assert size(144, 16, 13) == 12
    assert size(144, 16, 20) == 16
    assert size(144, 16, 0) == 1
    assert size(13, 13, 4) == 4  # 13 is prime: chunks of 4, 4, 4 and 1
    assert size(14, 14, 5) == 5  # no divisor in 3..5: chunks of 5, 5 and 4
