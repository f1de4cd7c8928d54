"""jacobian() over many batches: datasets, iterables, sums and per-example rows."""

from __future__ import annotations

import warnings

import keras
import numpy as np
import pytest
import tensorflow as tf

import jacobkit as jk
from jacobkit import testing
from jacobkit.testing import examples


def _reference(name: str, x: np.ndarray, outputs: str, **sizes) -> list[np.ndarray]:
    """float64 Jacobians of all of ``x`` as one batch, the obvious way."""
    ex64 = examples.build(name, "float64", **sizes)
    model = ex64.model
    layer = model.get_layer(ex64.layer)
    return testing.reference_jacobian(
        model,
        x.astype("float64"),
        [layer.kernel, layer.bias],
        outputs=outputs,
        call_kwargs={"training": False},
    )


@pytest.fixture(scope="module")
def mlp():
    """The mlp example with 128 examples (64 batches of 2)."""
    return examples.build("mlp", batch=128)


@pytest.fixture(scope="module")
def mlp_reference(mlp):
    return _reference("mlp", mlp.inputs, "features", batch=128)


def test_64_batches_sum_as_tightly_as_one_batch(mlp, mlp_reference):
    # The float32 rows of each batch are summed in float64 and cast at the
    # end, so 64 batches are as close to the float64 reference as one batch of
    # all 128 examples is. Measured (TF 2.21 CPU, max relative difference of
    # the kernel): one batch 2.3e-7, 64 batches 9.7e-8 (a float32 running sum
    # of the same 64 results: 2.3e-7). Asserted: 64 batches within 2x of one
    # batch's error, and within the float32 tolerance 1e-5.
    one = jk.jacobian(mlp.model, mlp.inputs, mlp.layer, strategy="chunked")
    dataset = tf.data.Dataset.from_tensor_slices(mlp.inputs).batch(2)
    many = jk.jacobian(mlp.model, dataset, mlp.layer, strategy="chunked")
    assert many.rows_shape == (10,)
    assert many.kernel.dtype == tf.float32
    error_one = testing.assert_close(one, mlp_reference)
    error_many = testing.assert_close(many, mlp_reference)
    assert error_many <= 2 * error_one, (error_many, error_one)


def test_auto_sums_a_dataset_of_x_y_pairs_with_one_plan(mlp, mlp_reference):
    # (x, y) elements: x is used. One auto session serves every batch.
    labels = np.zeros((128, 1), "float32")
    dataset = tf.data.Dataset.from_tensor_slices((mlp.inputs, labels)).batch(32)
    result = jk.jacobian(mlp.model, dataset, mlp.layer, cache=False)
    assert result.plan.calls == 4
    testing.assert_close(result, mlp_reference)


def _counting_model(ex):
    """A Keras model around ``ex.model`` that counts its Python calls (each
    trace of a computation calls it; planning probes trace many times)."""
    calls = []

    class Counting(keras.Model):
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def call(self, x, training=False):
            calls.append(1)
            return self.inner(x, training=training)

    model = Counting(ex.model)
    model(ex.inputs[:1])
    return model, calls


@pytest.mark.parametrize("outputs", ["per_example", "features"])
def test_last_smaller_batch_neither_replans_nor_retraces_twice(outputs):
    ex = examples.build("generator", batch=26)
    model, calls = _counting_model(ex)
    layer = ex.model.get_layer(ex.layer)
    seen = []  # model calls so far, when each batch is handed over

    def batches():
        for start in range(0, 26, 4):  # six batches of 4, a last one of 2
            seen.append(len(calls))
            yield ex.inputs[start : start + 4]

    # a configured strategy: auto's race would trace its other candidates on
    # the next few batches (once each), which is not what is counted here
    strategy = jk.strategies.Chunked(chunk_size=8)
    result = jk.jacobian(model, batches(), layer, outputs=outputs, strategy=strategy)
    seen.append(len(calls))
    per_batch = np.diff(seen)  # calls while computing each batch
    assert per_batch[0] > 0  # inspected and traced on the first batch
    assert list(per_batch[1:-1]) == [0] * 5, per_batch
    if outputs == "per_example":
        # padded to the first batch's size (training=False): nothing new
        assert per_batch[-1] == 0, per_batch
    else:
        # "features" rows sum over the batch: padding would change them, so
        # the new shape is traced once (the shape inspection and the
        # computation: one model call each), as the first batch was
        assert 0 < per_batch[-1] <= per_batch[0], per_batch
    testing.assert_close(result, _reference("generator", ex.inputs, outputs, batch=26))


def test_per_example_rows_in_dataset_order_from_a_generator():
    # unknown cardinality; batches of 5, 5, 5 and 3 examples
    ex = examples.build("generator", batch=18)
    result = jk.jacobian(
        ex.model,
        (ex.inputs[i : i + 5] for i in range(0, 18, 5)),
        ex.layer,
        outputs="per_example",
        strategy="chunked",
    )
    assert result.rows_shape == (18, 5)
    assert tuple(result.kernel.shape) == (18, 5, 5, 4, 6)
    testing.assert_close(
        result, _reference("generator", ex.inputs, "per_example", batch=18)
    )


def test_batches_view_and_steps_on_an_infinite_dataset(mlp):
    # jk.data.batches: known length; steps= takes the first batches of a
    # repeating dataset
    x = mlp.inputs[:12]
    viewed = jk.jacobian(
        mlp.model, jk.data.batches(x, 5), mlp.layer, strategy="chunked"
    )
    repeated = tf.data.Dataset.from_tensor_slices(x).batch(6).repeat()
    taken = jk.jacobian(mlp.model, repeated, mlp.layer, strategy="chunked", steps=4)
    reference = _reference("mlp", x, "features", batch=12)
    testing.assert_close(viewed, reference)
    # 4 batches of 6 = x twice
    testing.assert_close(taken, [2 * r for r in reference])


# -- errors before any work ------------------------------------------------------
def _no_calls(ex, inputs, match, error=ValueError, **kwargs):
    model, calls = _counting_model(ex)
    before = len(calls)
    with pytest.raises(error, match=match):
        jk.jacobian(model, inputs, ex.model.get_layer(ex.layer), **kwargs)
    return len(calls) - before


def test_dataset_errors_before_any_work(mlp):
    x = mlp.inputs
    empty = tf.data.Dataset.from_tensor_slices(x).batch(4).take(0)
    assert _no_calls(mlp, empty, r"has no batches") == 0
    infinite = tf.data.Dataset.from_tensor_slices(x).batch(4).repeat()
    assert _no_calls(mlp, infinite, r"infinite .*Pass steps=N") == 0
    integers = tf.data.Dataset.from_tensor_slices(x.astype("int32")).batch(4)
    assert _no_calls(mlp, integers, r"hold int32.*need float", TypeError) == 0
    assert _no_calls(mlp, iter([]), r"has no batches") == 0
    assert _no_calls(mlp, iter([x[:4]]), r"steps=0\): must be >= 1", steps=0) == 0


def test_batches_that_disagree_in_shape_are_refused_before_they_run(mlp):
    # batch 1 has 11 input features instead of 12: refused before it is run
    ex = examples.build("generator", batch=8)
    bad = [ex.inputs[:4], ex.inputs[4:, :6]]
    with pytest.raises(ValueError, match=r"batch 1 has shape \(4, 6, 4\).*\(4, 8, 4\)"):
        jk.jacobian(ex.model, iter(bad), ex.layer, strategy="chunked")
    with pytest.raises(TypeError, match=r"batch 1 holds int64"):
        jk.jacobian(
            ex.model,
            iter([ex.inputs[:4], np.ones((4, 8, 4), "int64")]),
            ex.layer,
            strategy="chunked",
        )


def test_non_finite_inputs_warn_once_naming_the_batch_and_count(mlp):
    x = mlp.inputs[:12].copy()
    x[5, 3] = np.nan  # batch 1 (of 4): one NaN
    x[6, :2] = np.inf  # two Inf
    x[9, 0] = np.nan  # batch 2: reported only by the first warning
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = jk.jacobian(
            mlp.model, jk.data.batches(x, 4), mlp.layer, strategy="chunked"
        )
    mine = [w for w in caught if "NaN/Inf" in str(w.message)]
    assert len(mine) == 1
    assert "batch 1 holds 3 NaN/Inf" in str(mine[0].message)
    assert np.isnan(result.kernel.numpy()).any()


def test_progress_bar_is_quiet_when_output_is_not_a_terminal(mlp, capsys, monkeypatch):
    # not under pytest's own switch: tqdm itself stays quiet off a terminal
    monkeypatch.delenv("PYTEST_CURRENT_TEST", raising=False)
    jk.jacobian(
        mlp.model,
        jk.data.batches(mlp.inputs[:8], 4),
        mlp.layer,
        strategy="chunked",
        progress=True,
    )
    assert capsys.readouterr().err == ""


def test_non_finite_inputs_of_one_batch_warn_with_the_count(mlp):
    x = mlp.inputs[:4].copy()
    x[1, :3] = np.nan
    with pytest.warns(RuntimeWarning, match=r"the inputs hold 3 NaN/Inf value"):
        result = jk.jacobian(mlp.model, x, mlp.layer, strategy="chunked")
    # every "features" row holds NaN (where the NaN inputs reach the kernel)
    assert np.isnan(result.kernel.numpy()).any(axis=(1, 2)).all()
