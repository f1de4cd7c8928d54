"""``jk.ClippedSum(clip_norm, pad_batches=True)``: batches padded with
examples of sample weight 0 to a few sizes give the clipped sum and the
norms of the unpadded batch, by every registered strategy, and batches of
different sizes within one padded size trace once.

Reference: every example's loss gradient in float64, one tape per example
on a float64 copy (``tests.cases``), then each norm, scale and sum in
NumPy, for the batch as given. Tolerance:
as ``tests/test_reductions.py`` (1e-5 of the largest value, the suite's
float32 bound; padding adds exact zeros, so the errors are those of the
unpadded sums, at most 1.9e-7 there).
"""

from __future__ import annotations

import keras
import numpy as np
import pytest
import tensorflow as tf

import jacobkit as jk
from jacobkit import testing
from jacobkit.problem import padding
from tests.cases import STRATEGIES, clipped_sums, per_example_gradients
from tests.test_reductions import _mlp, _tokens

RTOL = 1e-5
LOSS = jk.Loss(
    keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction=None)
)


def _reference(model, inputs, clip: float | None = None):
    """The clipped sums in the variables' shapes, the norms and the clip
    (``None``: the norms' median, so that some rows are clipped)."""
    copy = testing.float64_copy(model)
    rows = per_example_gradients(copy, copy.trainable_variables, inputs, LOSS.fn)
    clip = float(np.median(rows.norms)) if clip is None else clip
    sums, norms = clipped_sums(rows, clip)
    return sums, norms, clip


def _padded(model, inputs, clip: float, **kwargs):
    """``reduce=jk.ClippedSum(clip, pad_batches=True)`` of loss rows over
    every trainable variable."""
    return jk.jacobian(
        model,
        inputs,
        model.trainable_variables,
        outputs=kwargs.pop("outputs", LOSS),
        reduce=jk.ClippedSum(clip, pad_batches=True),
        **kwargs,
    )


def _close(result, sums, norms) -> None:
    scale = max(float(np.abs(s).max()) for s in sums)
    for got, want in zip(result.jacobians.values(), sums, strict=True):
        np.testing.assert_allclose(np.asarray(got), want, rtol=0, atol=RTOL * scale)
    assert result.rows_shape == norms.shape
    np.testing.assert_allclose(
        np.asarray(result.norms), norms, rtol=0, atol=RTOL * norms.max()
    )


@pytest.mark.parametrize("size", [1, 5, 9, 33, 63, 64, 65, 100, 1000])
def test_a_bucket_holds_the_batch_and_at_most_a_quarter_more(size):
    found = padding.bucket(size)
    assert size <= found <= size + size // 4
    assert padding.bucket(found) == found


def test_poisson_sizes_around_64_fall_in_a_few_buckets():
    """An expected batch of 64 drawn at q = 64 / 1437 (the DP-SGD guide's
    digits run) gives sizes within about four standard deviations of 64."""
    sizes = range(32, 97)
    assert len({padding.bucket(n) for n in sizes}) <= 7 < len(sizes)


@pytest.mark.parametrize("case", STRATEGIES, ids=lambda c: c.id)
def test_a_padded_batch_gives_the_unpadded_clipped_sum(case):
    model, inputs = _mlp(11)  # padded to 12
    assert padding.bucket(11) == 12
    sums, norms, clip = _reference(model, inputs)
    strategy = case.make(len(inputs[1]))
    if strategy.name == "structured":  # serves linear heads, not losses
        with pytest.raises(ValueError):
            _padded(model, inputs, clip, strategy=strategy)
        return
    _close(_padded(model, inputs, clip, strategy=strategy), sums, norms)


def test_given_sample_weights_are_kept_and_the_padding_weighs_zero():
    model, inputs = _tokens(13)  # padded to 14
    sums, norms, clip = _reference(model, inputs)
    _close(_padded(model, inputs, clip), sums, norms)


def test_sizes_within_one_bucket_trace_once():
    model, inputs = _mlp(40)
    _, _, clip = _reference(model, inputs)
    traced = []
    for size in (33, 36, 40, 38):  # each padded to 40
        part = tuple(a[:size] for a in inputs)
        sums, norms, _ = _reference(model, part, clip)
        result = _padded(model, part, clip, strategy="batch")
        _close(result, sums, norms)
        traced.append(result.stats.traced)
    assert traced == [True, False, False, False]


def test_a_dataset_of_uneven_batches_is_padded_batch_by_batch():
    model, inputs = _tokens(23)
    sums, norms, clip = _reference(model, inputs)
    data = tf.data.Dataset.from_tensor_slices(inputs).batch(10)  # 10 + 10 + 3
    _close(_padded(model, data, clip, strategy="batch"), sums, norms)


def _mean_over_the_batch(y_true, y_pred):
    """Per-example losses divided by the batch size: one number per example,
    but each depends on how many examples share the batch."""
    losses = LOSS.fn(y_true, y_pred)
    return losses / tf.cast(tf.shape(losses)[0], losses.dtype)


def test_a_loss_that_depends_on_the_batch_size_is_refused():
    """Issue 48: a mean over the batch inside the loss made padding scale
    every gradient by ``n / padded`` (on main, 9 examples padded to 10, no
    row clipped: the sums 0.100 off float64, silently). Refused, on arrays
    and on a dataset's padded batch; the same loss unpadded agrees with
    float64 (RTOL 1e-5; measured at most 2e-7)."""
    model, (x, y) = _mlp(9)  # padded to 10
    mean = jk.Loss(_mean_over_the_batch)
    message = r"jk.Loss\(_mean_over_the_batch\) depends on the batch size"
    with pytest.raises(ValueError, match=message) as err:
        _padded(model, (x, y), 1e3, outputs=mean)
    assert "scale every gradient by 9/10" in str(err.value)
    data = tf.data.Dataset.from_tensor_slices((x, y)).batch(9)
    with pytest.raises(ValueError, match=message):
        _padded(model, data, 1e3, outputs=mean)
    ref = testing.float64_reference(
        model, (x, y), model.trainable_variables, outputs=mean
    )
    result = jk.jacobian(
        model,
        (x, y),
        model.trainable_variables,
        outputs=mean,
        reduce=jk.ClippedSum(1e3),
    )
    want = [np.asarray(r, np.float64).sum(axis=0) for r in ref]  # none clipped
    scale = max(float(np.abs(w).max()) for w in want)
    for got, w in zip(result.jacobians.values(), want, strict=True):
        np.testing.assert_allclose(np.asarray(got), w, rtol=0, atol=RTOL * scale)


@pytest.mark.parametrize("outputs", ["per_example", "features"])
def test_padding_needs_loss_rows(outputs):
    model, (x, _) = _mlp(9)
    with pytest.raises(ValueError, match="only loss rows have"):
        _padded(model, x, 1.0, outputs=outputs)


def test_pad_batches_must_be_a_bool():
    with pytest.raises(ValueError, match="expected True or False"):
        jk.ClippedSum(1.0, pad_batches="yes")  # type: ignore[arg-type]


def test_an_empty_batch_is_refused_as_without_padding():
    model, (x, y) = _mlp(9)
    with pytest.raises(ValueError, match="the batch holds 0 examples"):
        _padded(model, (x[:0], y[:0]), 1.0)
