"""The float64 reference, checked once against a closed form.

A linear Dense layer ``Y = x W + b`` with ``x`` of shape ``(B, [T,] I)`` and
``W`` of shape ``(I, K)`` has ``dY[..., f] / dW[i, k] = x[..., i]`` when
``k == f`` and 0 otherwise, and ``dY[..., f] / db[k] = 1`` when ``k == f``.
Summing that over the axes each ``outputs=`` mode sums over gives every row's
Jacobian in closed form (see :func:`closed_form`). The reference must match it
to float64 rounding, and the strategies to their float32 tolerance.
"""

from __future__ import annotations

import keras
import numpy as np
import pytest
import tensorflow as tf

import jacobkit as jk
from jacobkit import testing

BATCH, MIDDLE, INPUTS, FEATURES = 3, 4, 5, 6


def _square_over_batch(y):
    """A callable ``outputs=``: rows ``sum_b Y[b, ...] ** 2``."""
    return tf.reduce_sum(y * y, axis=0)


MODES = {
    "features": "features",
    "per_example": "per_example",
    "full": "full",
    "callable": _square_over_batch,
}


def closed_form(x, w, b, mode: str) -> tuple[np.ndarray, np.ndarray]:
    """d rows / dW and d rows / db for ``Y = x @ w + b``, by hand.

    Shapes: ``rows_shape + (I, K)`` and ``rows_shape + (K,)``.
    """
    eye = np.eye(w.shape[1])  # eye[f, k] = (k == f)
    if mode == "features":  # row f = sum over every axis but the last
        x_sum = x.reshape(-1, x.shape[-1]).sum(axis=0)
        count = x.size // x.shape[-1]  # B, or B * T
        return np.einsum("i,fk->fik", x_sum, eye), count * eye
    if mode == "per_example":  # row (b, f) = sum over the middle axes
        x_sum = x.reshape(x.shape[0], -1, x.shape[-1]).sum(axis=1)
        count = x[0].size // x.shape[-1]  # 1, or T
        dw = np.einsum("bi,fk->bfik", x_sum, eye)
        db = count * np.broadcast_to(eye, (x.shape[0], *eye.shape))
        return dw, db
    if mode == "full":  # one row per element of Y
        dw = np.einsum("...i,fk->...fik", x, eye)
        db = np.broadcast_to(eye, (*x.shape[:-1], *eye.shape))
        return dw, db
    if mode == "callable":  # row (..., f) = sum_b Y[b, ..., f] ** 2
        y = x @ w + b
        dw = np.einsum("b...f,b...i,fk->...fik", 2 * y, x, eye)
        db = np.einsum("b...f,fk->...fk", 2 * y, eye)
        return dw, db
    raise ValueError(mode)


def _dense(dtype: str, middle: bool):
    """A linear Dense layer with seeded weights, and inputs."""
    rng = np.random.default_rng(7)
    w = rng.normal(size=(INPUTS, FEATURES))
    b = rng.normal(size=(FEATURES,))
    x = rng.normal(size=(BATCH, MIDDLE, INPUTS) if middle else (BATCH, INPUTS))
    layer = keras.layers.Dense(FEATURES, name="dense", dtype=dtype)
    model = keras.Sequential([keras.Input(x.shape[1:], dtype=dtype), layer])
    layer.set_weights([w.astype(dtype), b.astype(dtype)])
    return model, layer, x.astype(dtype), w, b


def _close_to_float64(actual, expected) -> float:
    assert actual.shape == expected.shape
    return testing.max_relative_difference(actual, expected)


@pytest.mark.parametrize("middle", [False, True], ids=["BxI", "BxTxI"])
@pytest.mark.parametrize("mode", list(MODES))
def test_reference_matches_the_closed_form(mode, middle):
    model, layer, x, w, b = _dense("float64", middle)
    dw, db = testing.reference_jacobian(
        model, x, [layer.kernel, layer.bias], outputs=MODES[mode]
    )
    expected_dw, expected_db = closed_form(x, w, b, mode)
    assert _close_to_float64(dw, expected_dw) < 1e-14
    assert _close_to_float64(db, expected_db) < 1e-14


def test_reference_rows_are_not_a_split_batch_axis():
    """``outputs="features"`` sums over the batch (what the users' loop over
    ``tf.unstack(Y, axis=-1)`` gives), unlike ``tape.jacobian`` then
    ``tf.unstack(..., axis=0)``, which splits the batch axis."""
    model, layer, x, w, b = _dense("float64", middle=False)
    (dw,) = testing.reference_jacobian(model, x, [layer.kernel])
    with tf.GradientTape() as tape:
        y = model(x)
    split = tape.jacobian(y, layer.kernel.value)[0]  # example 0: (K, I, K)
    assert dw.shape == split.shape == (FEATURES, INPUTS, FEATURES)
    assert _close_to_float64(split, dw) > 0.1


def test_reference_feature_subset():
    model, layer, x, w, b = _dense("float64", middle=True)
    features = [4, 0]
    dw, db = testing.reference_jacobian(
        model, x, [layer.kernel, layer.bias], features=features
    )
    expected_dw, expected_db = closed_form(x, w, b, "features")
    assert _close_to_float64(dw, expected_dw[features]) < 1e-14
    assert _close_to_float64(db, expected_db[features]) < 1e-14


def test_reference_accepts_keras_and_tf_variables():
    model, layer, x, w, b = _dense("float64", middle=False)
    from_keras = testing.reference_jacobian(model, x, [layer.kernel])
    from_tf = testing.reference_jacobian(model, x, [layer.kernel.value])
    np.testing.assert_array_equal(from_keras[0], from_tf[0])


# the batch strategy refuses callable outputs (see the conformance tests)
_STRATEGY_MODES = [("jacobian", mode) for mode in MODES] + [
    ("batch", mode) for mode in MODES if mode != "callable"
]


@pytest.mark.parametrize("middle", [False, True], ids=["BxI", "BxTxI"])
@pytest.mark.parametrize(
    "strategy, mode", _STRATEGY_MODES, ids=[f"{s}-{m}" for s, m in _STRATEGY_MODES]
)
def test_strategy_matches_the_closed_form(strategy, mode, middle):
    model, _, x, w, b = _dense("float32", middle)
    result = jk.jacobian(model, x, "dense", strategy=strategy, outputs=MODES[mode])
    # closed form in float64 from the float32 weights and inputs
    expected_dw, expected_db = closed_form(
        x.astype("float64"), w.astype("float32"), b.astype("float32"), mode
    )
    tolerance = testing.TOLERANCE[tf.float32]
    assert _close_to_float64(result.kernel.numpy(), expected_dw) < tolerance
    assert _close_to_float64(result.bias.numpy(), expected_db) < tolerance
