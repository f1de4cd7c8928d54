"""A convolution's per-example kernel gradients by one filter gradient per
example (``layers.conv.example_filters``), the path large convolutions take,
forced on small ones (``example_filter_macs() == 0``, as under
TensorFlow's own CPU kernels): per-example rows, loss
rows, norms and the clipped sum against float64, over strides and padding,
with one op per example written into the graph (a small batch) and by a
``tf.map_fn`` loop (a batch over ``conv.UNROLLED_EXAMPLES``, forced).

Tolerance: measured at most 4.8e-7 of the largest value (float32 against
float64, oneDNN on); the bound is the suite's 1e-5.
"""

from __future__ import annotations

import keras
import numpy as np
import pytest

import jacobkit as jk
from jacobkit import testing
from jacobkit.layers import conv as conv_rule
from tests.test_reductions import LOSS, _per_example

RTOL = 1e-5
GEOMETRIES = {
    "valid": dict(kernel_size=3),
    "same-strided": dict(kernel_size=3, strides=2, padding="same"),
    "wide-strided": dict(kernel_size=(2, 3), strides=(1, 2)),
}


@pytest.fixture(params=["unrolled", "loop"])
def by_example(monkeypatch, request):
    """Every Conv2D takes the per-example path, one op per example or a
    while loop; counts its calls."""
    if request.param == "loop":
        monkeypatch.setattr(conv_rule, "UNROLLED_EXAMPLES", 0)
    calls = []
    original = conv_rule.example_filters

    def counted(*args, **kwargs):
        calls.append(1)
        return original(*args, **kwargs)

    monkeypatch.setattr(conv_rule, "example_filter_macs", lambda: 0)
    monkeypatch.setattr(conv_rule, "example_filters", counted)
    return calls


def _model(geometry: str) -> tuple[keras.Model, tuple[np.ndarray, np.ndarray]]:
    rng = np.random.default_rng(3)
    keras.utils.set_random_seed(3)
    model = keras.Sequential(
        [
            keras.Input((7, 8, 3)),
            keras.layers.Conv2D(
                4, activation="tanh", name="conv", **GEOMETRIES[geometry]
            ),
            keras.layers.Flatten(),
            keras.layers.Dense(3, name="head"),
        ]
    )
    x = rng.normal(size=(5, 7, 8, 3)).astype("float32")
    return model, (x, rng.integers(0, 3, 5))


def _close(got, want) -> None:
    for g, w in zip(got, want, strict=True):
        w = np.asarray(w)
        scale = np.abs(w).max()
        np.testing.assert_allclose(
            np.reshape(np.asarray(g), w.shape), w, rtol=0, atol=RTOL * scale
        )


@pytest.mark.parametrize("geometry", list(GEOMETRIES))
def test_per_example_rows(by_example, geometry):
    """Every output feature's row (3 per example: one filter gradient's
    output channels per example)."""
    model, (x, _) = _model(geometry)
    layer = model.get_layer("conv")
    result = jk.jacobian(model, x, layer, strategy="batch", outputs="per_example")
    want = testing.float64_reference(model, x, layer, outputs="per_example")
    assert by_example, "the per-example path ran"
    _close(list(result.jacobians.values()), want)


@pytest.mark.parametrize("geometry", list(GEOMETRIES))
def test_norms_and_clipped_sum(by_example, geometry):
    model, inputs = _model(geometry)
    variables = model.trainable_variables
    want, flat = _per_example(model, inputs)
    norms = np.linalg.norm(flat, axis=1)
    clip = float(np.median(norms))
    result = jk.jacobian(
        model,
        inputs,
        variables,
        strategy="batch",
        outputs=LOSS,
        reduce=jk.ClippedSum(clip),
    )
    assert by_example, "the per-example path ran"
    sums = [np.tensordot(np.minimum(1.0, clip / norms), g, 1) for g in want]
    _close(list(result.jacobians.values()), sums)
    np.testing.assert_allclose(result.norms, norms, rtol=0, atol=RTOL * norms.max())
    layer = model.get_layer("conv")
    found = jk.jacobian(
        model, inputs, layer, strategy="batch", outputs=LOSS, reduce="norm"
    )
    kernel = np.linalg.norm(want[0].reshape(len(norms), -1), axis=1)
    got = np.ravel(found.jacobians["conv/kernel"])
    np.testing.assert_allclose(got, kernel, rtol=0, atol=RTOL * kernel.max())
