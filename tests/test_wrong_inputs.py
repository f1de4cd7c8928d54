"""A sweep of wrong inputs, as a new user passes them, across ``jacobian``,
``gram``, the reductions, ``verify``, ``float64_reference`` and every
``explain`` function (issue 48).

Each case ends in one of two ways:

- ``refused``: a ``ValueError`` or ``TypeError`` of jacobkit's whose message
  names the call (``jacobian(...)``, ``explain.trak(...)``, ...), never a raw
  TensorFlow or Python error (``IndexError``, ``InvalidArgumentError``, an
  ``AttributeError`` of jacobkit's own);
- ``works``: a result, checked against an independent computation.

The models are tiny and built once per module.
"""

from __future__ import annotations

import functools
import re
import warnings
from collections.abc import Callable
from typing import Any, NamedTuple

import keras
import numpy as np
import pytest
import tensorflow as tf

import jacobkit as jk
from jacobkit import explain, testing

#: a call named in the message: ``jacobian(``, ``jk.ClippedSum(``,
#: ``explain.trak(``, ``token_attribution(`` ...
CALLS = (
    "jacobian",
    "plan",
    "gram",
    "verify",
    "float64_reference",
    "assert_close",
    "ClippedSum",
    "Project",
    "Loss",
    "Inputs",
    "Output",
    "saliency",
    "gradient_x_input",
    "integrated_gradients",
    "smoothgrad",
    "grad_cam",
    "tracin",
    "grad_cos",
    "self_influence",
    "trak",
    "token_attribution",
    "generate_and_attribute",
    "plot",
    "plot_influence",
    "plot_tokens",
)
NAMES_A_CALL = re.compile(rf"\b({'|'.join(CALLS)})\(")

RNG = np.random.default_rng(4848)
X = RNG.normal(size=(4, 3)).astype("float32")
Y = np.array([0, 1, 2, 0])
IMAGES = RNG.normal(size=(2, 6, 6, 1)).astype("float32")
TOKENS = RNG.integers(0, 11, size=(2, 5)).astype("int32")


@functools.cache
def mlp() -> keras.Model:
    """``(B, 3) -> (B, 3)`` logits: layers ``d1`` (tanh) and ``d2``."""
    x = keras.Input((3,), name="x")
    h = keras.layers.Dense(5, activation="tanh", name="d1")(x)
    model = keras.Model(x, keras.layers.Dense(3, name="d2")(h))
    model(X)
    return model


@functools.cache
def cnn() -> keras.Model:
    """``(B, 6, 6, 1) -> (B, 3)``: ``conv`` then ``flat`` and ``head``."""
    x = keras.Input((6, 6, 1))
    h = keras.layers.Conv2D(2, 3, activation="relu", name="conv")(x)
    h = keras.layers.Flatten(name="flat")(h)
    return keras.Model(x, keras.layers.Dense(3, name="head")(h))


@functools.cache
def classifier() -> keras.Model:
    """Token ids ``(B, T)`` -> ``(B, 3)``: embedding ``emb`` (11 tokens)."""
    ids = keras.Input((None,), dtype="int32")
    h = keras.layers.Embedding(11, 4, name="emb")(ids)
    h = keras.layers.GlobalAveragePooling1D()(h)
    return keras.Model(ids, keras.layers.Dense(3, name="cls")(h))


@functools.cache
def causal_lm() -> keras.Model:
    """Token ids ``(B, T)`` -> ``(B, T, 11)`` logits: embedding ``tok``."""
    ids = keras.Input((None,), dtype="int32")
    h = keras.layers.Embedding(11, 4, name="tok")(ids)
    return keras.Model(ids, keras.layers.Dense(11, name="lm_head")(h))


@functools.cache
def one_output() -> keras.Model:
    return keras.Sequential([keras.Input((3,)), keras.layers.Dense(1, name="z")])


def loss() -> jk.Loss:
    return jk.Loss(
        keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction=None)
    )


def batch_loss() -> jk.Loss:
    """A loss reduced over the batch: one number, not a row per example."""
    return jk.Loss(keras.losses.SparseCategoricalCrossentropy(from_logits=True))


def dataset(*arrays: Any, batch: int | None = 2) -> tf.data.Dataset:
    data = tf.data.Dataset.from_tensor_slices(arrays)
    return data if batch is None else data.batch(batch)


def rows_result() -> jk.JacobianResult:
    return jk.jacobian(mlp(), X, "d1", strategy="loop")


def influence() -> Any:
    return explain.tracin(mlp(), (X, Y), (X[:2], Y[:2]), loss=loss())


def tokens_result() -> Any:
    return explain.token_attribution(causal_lm(), TOKENS)


class Case(NamedTuple):
    run: Callable[[], Any]
    #: ``None``: refused in words; else a check of the result
    check: Callable[[Any], None] | None = None
    #: words the refusal must hold besides the call's name, where a raw
    #: error could name it too (autograph quotes the user's code)
    says: str = ""


def refused(run: Callable[[], Any], says: str = "") -> Case:
    return Case(run, None, says)


def works(run: Callable[[], Any], check: Callable[[Any], None]) -> Case:
    return Case(run, check)


def _same_as(expected: Callable[[], Any]) -> Callable[[Any], None]:
    def check(result: Any) -> None:
        want = expected()
        for a, b in zip(
            result.jacobians.values(), want.jacobians.values(), strict=True
        ):
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6)

    return check


def _against_reference(layer: str, **kwargs: Any) -> Callable[[Any], None]:
    def check(result: Any) -> None:
        inputs = (X, Y) if "outputs" in kwargs else X
        testing.assert_close(
            result, testing.float64_reference(mlp(), inputs, layer, **kwargs)
        )

    return check


def _finite_float(result: Any) -> None:
    assert np.isfinite(result) and result < 1e-4


JACOBIAN: dict[str, Case] = {
    "model-is-a-string": refused(lambda: jk.jacobian("mlp", X, "d1")),
    "model-is-None": refused(lambda: jk.jacobian(None, X, "d1")),
    "layer-unknown-name": refused(lambda: jk.jacobian(mlp(), X, "dense")),
    "layer-is-an-int": refused(lambda: jk.jacobian(mlp(), X, 3)),
    "layer-is-an-empty-list": refused(lambda: jk.jacobian(mlp(), X, [])),
    "layer-without-weights": refused(lambda: jk.jacobian(cnn(), IMAGES, "flat")),
    "layer-of-another-model": refused(
        lambda: jk.jacobian(mlp(), X, cnn().get_layer("head"))
    ),
    "layer-Inputs-unknown-name": refused(
        lambda: jk.jacobian(mlp(), X, jk.Inputs("nope"))
    ),
    "layer-Output-unknown-layer": refused(
        lambda: jk.jacobian(mlp(), X, jk.Output("nope"))
    ),
    "outputs-unknown-mode": refused(lambda: jk.jacobian(mlp(), X, "d1", outputs="x")),
    "outputs-is-an-int": refused(lambda: jk.jacobian(mlp(), X, "d1", outputs=3)),
    "features-out-of-range": refused(lambda: jk.jacobian(mlp(), X, "d1", features=[7])),
    "features-is-a-string": refused(lambda: jk.jacobian(mlp(), X, "d1", features="ab")),
    "features-empty": refused(lambda: jk.jacobian(mlp(), X, "d1", features=[])),
    "training-is-a-string": refused(
        lambda: jk.jacobian(mlp(), X, "d1", training="yes")
    ),
    "unconnected-unknown": refused(
        lambda: jk.jacobian(mlp(), X, "d1", unconnected="maybe")
    ),
    "output-is-a-float": refused(lambda: jk.jacobian(mlp(), X, "d1", output=1.5)),
    "output-out-of-range": refused(lambda: jk.jacobian(mlp(), X, "d1", output=3)),
    "reduce-unknown": refused(lambda: jk.jacobian(mlp(), X, "d1", reduce="sum")),
    "reduce-a-class-not-an-instance": refused(
        lambda: jk.jacobian(mlp(), X, "d1", reduce=jk.ClippedSum)
    ),
    "strategy-unknown": refused(
        lambda: jk.jacobian(mlp(), X, "d1", strategy="fastest")
    ),
    "strategy-is-an-int": refused(lambda: jk.jacobian(mlp(), X, "d1", strategy=2)),
    "memory_budget-words": refused(
        lambda: jk.jacobian(mlp(), X, "d1", memory_budget="lots")
    ),
    "memory_budget-negative": refused(
        lambda: jk.jacobian(mlp(), X, "d1", memory_budget=-5)
    ),
    "steps-zero": refused(lambda: jk.jacobian(mlp(), X, "d1", steps=0)),
    "inputs-a-string": refused(lambda: jk.jacobian(mlp(), "abc", "d1")),
    "inputs-None": refused(lambda: jk.jacobian(mlp(), None, "d1")),
    "inputs-no-batch-axis": refused(lambda: jk.jacobian(mlp(), X[0], "d1")),
    "inputs-wrong-features": refused(
        lambda: jk.jacobian(mlp(), np.ones((4, 5), "float32"), "d1")
    ),
    "inputs-zero-examples": refused(lambda: jk.jacobian(mlp(), X[:0], "d1")),
    "inputs-dict-wrong-key": refused(lambda: jk.jacobian(mlp(), {"z": X}, "d1")),
    "inputs-two-arrays-one-input": refused(lambda: jk.jacobian(mlp(), (X, X), "d1")),
    "inputs-strings": refused(
        lambda: jk.jacobian(mlp(), np.array([["a", "b", "c"]]), "d1")
    ),
    "inputs-a-python-list-of-rows": works(
        lambda: jk.jacobian(mlp(), X.tolist(), "d1"), _against_reference("d1")
    ),
    "loss-without-labels": refused(lambda: jk.jacobian(mlp(), X, "d1", outputs=loss())),
    "loss-one-tuple": refused(lambda: jk.jacobian(mlp(), (X,), "d1", outputs=loss())),
    "loss-four-tuple": refused(
        lambda: jk.jacobian(mlp(), (X, Y, Y, Y), "d1", outputs=loss())
    ),
    "loss-labels-a-python-list": works(
        lambda: jk.jacobian(mlp(), (X, Y.tolist()), "d1", outputs=loss()),
        _against_reference("d1", outputs=loss()),
    ),
    "loss-labels-too-few": refused(
        lambda: jk.jacobian(mlp(), (X, Y[:3]), "d1", outputs=loss())
    ),
    "loss-sample_weight-too-few": refused(
        lambda: jk.jacobian(mlp(), (X, Y, np.ones(3, "float32")), "d1", outputs=loss())
    ),
    "loss-x-wrong-features": refused(
        lambda: jk.jacobian(
            mlp(), (np.ones((4, 5), "float32"), Y), "d1", outputs=loss()
        ),
        says="x of (x, y) does not fit the model",
    ),
    "loss-not-callable": refused(lambda: jk.Loss("crossentropy")),
    "loss-reduced-over-the-batch": refused(
        lambda: jk.jacobian(mlp(), (X, Y), "d1", outputs=batch_loss())
    ),
    "dataset-unbatched": refused(
        lambda: jk.jacobian(mlp(), dataset(X, Y, batch=None), "d1", outputs=loss())
    ),
    "dataset-unbatched-x-only": refused(
        lambda: jk.jacobian(mlp(), dataset(X, batch=None), "d1")
    ),
    "dataset-wrong-features": refused(
        lambda: jk.jacobian(mlp(), dataset(np.ones((4, 5), "float32")), "d1")
    ),
    "dataset-int-inputs": refused(
        lambda: jk.jacobian(mlp(), dataset(np.ones((4, 3), "int32")), "d1")
    ),
    "out-is-a-file": refused(
        lambda: jk.jacobian(mlp(), dataset(X), "d1", out=__file__)
    ),
    "distribute-a-string": refused(
        lambda: jk.jacobian(mlp(), X, "d1", distribute="mirrored")
    ),
    "inside-tf.function": refused(
        lambda: tf.function(lambda x: jk.jacobian(mlp(), x, "d1").kernel)(X),
        says="run_eagerly=True",
    ),
}

REDUCTIONS: dict[str, Case] = {
    "ClippedSum-zero": refused(lambda: jk.ClippedSum(0)),
    "ClippedSum-negative": refused(lambda: jk.ClippedSum(-1.0)),
    "ClippedSum-a-string": refused(lambda: jk.ClippedSum("1.0")),
    "ClippedSum-True": refused(lambda: jk.ClippedSum(True)),
    "ClippedSum-NaN": refused(lambda: jk.ClippedSum(float("nan"))),
    "ClippedSum-a-vector": refused(lambda: jk.ClippedSum(tf.constant([1.0, 2.0]))),
    "ClippedSum-pad_batches-a-string": refused(
        lambda: jk.ClippedSum(1.0, pad_batches="yes")
    ),
    "ClippedSum-pad_batches-without-loss": refused(
        lambda: jk.jacobian(mlp(), X, "d1", reduce=jk.ClippedSum(1.0, pad_batches=True))
    ),
    "ClippedSum-a-scalar-tensor": works(
        lambda: jk.jacobian(
            mlp(), (X, Y), "d1", outputs=loss(), reduce=jk.ClippedSum(tf.constant(0.5))
        ),
        _same_as(
            lambda: jk.jacobian(
                mlp(), (X, Y), "d1", outputs=loss(), reduce=jk.ClippedSum(0.5)
            )
        ),
    ),
    "Project-zero": refused(lambda: jk.Project(0)),
    "Project-negative": refused(lambda: jk.Project(-3)),
    "Project-a-float": refused(lambda: jk.Project(4.5)),
    "Project-a-string": refused(lambda: jk.Project("4")),
    "Project-seed-a-string": refused(lambda: jk.Project(4, seed="a")),
    "Project-small-unknown": refused(
        lambda: jk.Project(4, small="dense"), "expected one of 'countsketch'"
    ),
}

GRAM: dict[str, Case] = {
    "model-is-a-string": refused(lambda: jk.gram("mlp", X)),
    "layer-unknown": refused(lambda: jk.gram(mlp(), X, layer="dense")),
    "outputs-unknown": refused(lambda: jk.gram(mlp(), X, outputs="x")),
    "a-wrong-features": refused(lambda: jk.gram(mlp(), np.ones((4, 5), "float32"))),
    "b-wrong-features": refused(lambda: jk.gram(mlp(), X, np.ones((4, 5), "float32"))),
    "chunk_examples-zero": refused(lambda: jk.gram(mlp(), X, chunk_examples=0)),
    "chunk_examples-a-string": refused(lambda: jk.gram(mlp(), X, chunk_examples="2")),
    "norms-a-string": refused(lambda: jk.gram(mlp(), X, norms="yes")),
    "distribute-an-object": refused(lambda: jk.gram(mlp(), X, distribute=object())),
    "loss-labels-too-few": refused(lambda: jk.gram(mlp(), (X, Y[:3]), outputs=loss())),
    "dataset-unbatched": refused(
        lambda: jk.gram(mlp(), dataset(X, Y, batch=None), outputs=loss())
    ),
    "memory_budget-words": refused(lambda: jk.gram(mlp(), X, memory_budget="lots")),
}

VERIFY: dict[str, Case] = {
    "result-a-string": refused(lambda: jk.verify("abc", mlp(), X, "d1")),
    "result-too-few-jacobians": refused(lambda: jk.verify([], mlp(), X, "d1")),
    "result-wrong-shapes": refused(
        lambda: jk.verify([np.ones((2, 2)), np.ones(2)], mlp(), X, "d1")
    ),
    "result-of-another-layer": refused(
        lambda: jk.verify(rows_result(), mlp(), X, "d2")
    ),
    "probes-zero": refused(lambda: jk.verify(rows_result(), mlp(), X, "d1", probes=0)),
    "probes-a-float": refused(
        lambda: jk.verify(rows_result(), mlp(), X, "d1", probes=1.5)
    ),
    "layer-unknown": refused(lambda: jk.verify(rows_result(), mlp(), X, "dense")),
    "inputs-wrong-features": refused(
        lambda: jk.verify(rows_result(), mlp(), np.ones((4, 5), "float32"), "d1")
    ),
    "embedding-table": works(
        lambda: jk.verify(
            testing.float64_reference(classifier(), TOKENS, "emb", baseline=False),
            classifier(),
            TOKENS,
            "emb",
        ),
        _finite_float,
    ),
}

REFERENCE: dict[str, Case] = {
    "model-is-a-string": refused(lambda: testing.float64_reference("mlp", X, "d1")),
    "layer-unknown": refused(lambda: testing.float64_reference(mlp(), X, "dense")),
    "inputs-wrong-features": refused(
        lambda: testing.float64_reference(mlp(), np.ones((4, 5), "float32"), "d1")
    ),
    "outputs-unknown": refused(
        lambda: testing.float64_reference(mlp(), X, "d1", outputs="x")
    ),
    "loss-without-labels": refused(
        lambda: testing.float64_reference(mlp(), X, "d1", outputs=loss())
    ),
    "features-out-of-range": refused(
        lambda: testing.float64_reference(mlp(), X, "d1", features=[7])
    ),
}

EXPLAIN: dict[str, Case] = {
    "saliency-wrong-features": refused(
        lambda: explain.saliency(mlp(), np.ones((4, 5), "float32"))
    ),
    "saliency-classes-out-of-range": refused(
        lambda: explain.saliency(mlp(), X, classes=[9])
    ),
    "saliency-classes-a-string": refused(
        lambda: explain.saliency(mlp(), X, classes="ab")
    ),
    "saliency-channel_axis-out-of-range": refused(
        lambda: explain.saliency(cnn(), IMAGES, channel_axis=7)
    ),
    "gradient_x_input-classes-negative": refused(
        lambda: explain.gradient_x_input(mlp(), X, classes=[-9])
    ),
    "integrated_gradients-steps-zero": refused(
        lambda: explain.integrated_gradients(mlp(), X, steps=0)
    ),
    "integrated_gradients-rule-unknown": refused(
        lambda: explain.integrated_gradients(mlp(), X, rule="simpson")
    ),
    "integrated_gradients-baseline-wrong-shape": refused(
        lambda: explain.integrated_gradients(mlp(), X, baseline=np.zeros((4, 5)))
    ),
    "smoothgrad-samples-zero": refused(lambda: explain.smoothgrad(mlp(), X, samples=0)),
    "smoothgrad-noise-negative": refused(
        lambda: explain.smoothgrad(mlp(), X, noise=-1.0)
    ),
    "grad_cam-layer-unknown": refused(lambda: explain.grad_cam(cnn(), IMAGES, "nope")),
    "grad_cam-layer-not-spatial": refused(
        lambda: explain.grad_cam(cnn(), IMAGES, "head")
    ),
    "grad_cam-inputs-wrong-shape": refused(
        lambda: explain.grad_cam(cnn(), np.ones((2, 5, 5), "float32"), "conv")
    ),
    "tracin-no-checkpoints": refused(
        lambda: explain.tracin([], (X, Y), (X, Y), loss=loss())
    ),
    "tracin-loss-None": refused(
        lambda: explain.tracin(mlp(), (X, Y), (X, Y), loss=None)
    ),
    "tracin-loss-a-string": refused(
        lambda: explain.tracin(mlp(), (X, Y), (X, Y), loss="crossentropy")
    ),
    "tracin-learning_rates-too-many": refused(
        lambda: explain.tracin(
            mlp(), (X, Y), (X, Y), loss=loss(), learning_rates=[0.1, 0.2]
        )
    ),
    "tracin-top_k-zero": refused(
        lambda: explain.tracin(mlp(), (X, Y), (X, Y), loss=loss(), top_k=0)
    ),
    "tracin-train-without-labels": refused(
        lambda: explain.tracin(mlp(), X, (X, Y), loss=loss())
    ),
    "tracin-labels-a-python-list": works(
        lambda: explain.tracin(mlp(), (X, Y.tolist()), (X, Y), loss=loss()),
        lambda r: np.testing.assert_allclose(
            r.scores,
            explain.tracin(mlp(), (X, Y), (X, Y), loss=loss()).scores,
            rtol=1e-6,
        ),
    ),
    "grad_cos-train-wrong-features": refused(
        lambda: explain.grad_cos(
            mlp(), (np.ones((4, 5), "float32"), Y), (X, Y), loss=loss()
        )
    ),
    "grad_cos-test-labels-too-few": refused(
        lambda: explain.grad_cos(mlp(), (X, Y), (X, Y[:2]), loss=loss())
    ),
    "self_influence-sample_weight-too-few": refused(
        lambda: explain.self_influence(
            mlp(), (X, Y, np.ones(2, "float32")), loss=loss()
        )
    ),
    "self_influence-unbatched-dataset": refused(
        lambda: explain.self_influence(mlp(), dataset(X, Y, batch=None), loss=loss())
    ),
    "trak-one-hot-labels": refused(
        lambda: explain.trak(mlp(), (X, np.eye(3)[Y]), (X, Y), dim=4)
    ),
    "trak-one-output-model": refused(
        lambda: explain.trak(one_output(), (X, 0 * Y), (X, 0 * Y), dim=4)
    ),
    "trak-dim-zero": refused(lambda: explain.trak(mlp(), (X, Y), (X, Y), dim=0)),
    "trak-train-without-labels": refused(lambda: explain.trak(mlp(), X, (X, Y), dim=4)),
    "trak-unbatched-dataset": refused(
        lambda: explain.trak(mlp(), dataset(X, Y, batch=None), (X, Y), dim=4)
    ),
    "token_attribution-method-unknown": refused(
        lambda: explain.token_attribution(causal_lm(), TOKENS, method="lime")
    ),
    "token_attribution-one-token": refused(
        lambda: explain.token_attribution(causal_lm(), TOKENS[:, :1])
    ),
    "token_attribution-ids-past-the-vocabulary": refused(
        lambda: explain.token_attribution(causal_lm(), TOKENS + 11)
    ),
    "token_attribution-negative-ids": refused(
        lambda: explain.token_attribution(classifier(), TOKENS - 20)
    ),
    "token_attribution-float-ids": refused(
        lambda: explain.token_attribution(causal_lm(), TOKENS.astype("float32"))
    ),
    "token_attribution-positions-reversed": refused(
        lambda: explain.token_attribution(causal_lm(), TOKENS, positions=(3, 1))
    ),
    "token_attribution-targets-wrong-shape": refused(
        lambda: explain.token_attribution(causal_lm(), TOKENS, targets=TOKENS[:, :2])
    ),
    "token_attribution-embedding-unknown": refused(
        lambda: explain.token_attribution(causal_lm(), TOKENS, embedding="nope")
    ),
    "token_attribution-dict-without-token_ids": refused(
        lambda: explain.token_attribution(causal_lm(), {"ids": TOKENS})
    ),
    "token_attribution-ig-steps-one": refused(
        lambda: explain.token_attribution(
            causal_lm(), TOKENS, method="integrated_gradients", steps=1
        )
    ),
    "token_attribution-ig-rule-unknown": refused(
        lambda: explain.token_attribution(
            causal_lm(), TOKENS, method="integrated_gradients", rule="simpson"
        )
    ),
    "token_attribution-ig-baseline-unknown": refused(
        lambda: explain.token_attribution(
            causal_lm(), TOKENS, method="integrated_gradients", baseline="mean"
        ),
        "expected 'auto'",
    ),
    "generate_and_attribute-new_tokens-zero": refused(
        lambda: explain.generate_and_attribute(causal_lm(), TOKENS, new_tokens=0)
    ),
    "generate_and_attribute-new_tokens-a-string": refused(
        lambda: explain.generate_and_attribute(causal_lm(), TOKENS, new_tokens="2")
    ),
    "plot-maps-one-axis": refused(lambda: explain.plot(np.ones(4))),
    "plot-classes-too-few": refused(
        lambda: explain.plot(np.ones((1, 2, 6, 6)), classes=["a"])
    ),
    "plot_influence-result-a-string": refused(
        lambda: explain.plot_influence("scores", X, X)
    ),
    "plot_influence-tests-out-of-range": refused(
        lambda: explain.plot_influence(
            influence(), X[:2], X, tests=[5], image_shape=(3, 1)
        )
    ),
    "plot_tokens-attribution-a-string": refused(lambda: explain.plot_tokens("x")),
    "plot_tokens-example-out-of-range": refused(
        lambda: explain.plot_tokens(tokens_result(), example=9)
    ),
}

CASES = {
    **{f"jacobian:{k}": v for k, v in JACOBIAN.items()},
    **{f"reductions:{k}": v for k, v in REDUCTIONS.items()},
    **{f"gram:{k}": v for k, v in GRAM.items()},
    **{f"verify:{k}": v for k, v in VERIFY.items()},
    **{f"float64_reference:{k}": v for k, v in REFERENCE.items()},
    **{f"explain:{k}": v for k, v in EXPLAIN.items()},
}


def test_the_sweep_is_wide():
    assert len(CASES) >= 80
    assert {k.split(":")[0] for k in CASES} == {
        "jacobian",
        "reductions",
        "gram",
        "verify",
        "float64_reference",
        "explain",
    }


@pytest.fixture(autouse=True)
def _no_plots_shown():
    yield
    try:
        import matplotlib.pyplot as plt
    except ImportError:  # pragma: no cover - plots are optional
        return
    plt.close("all")


@pytest.mark.parametrize("name", list(CASES))
def test_wrong_input(name):
    case = CASES[name]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if case.check is not None:
            case.check(case.run())
            return
        with pytest.raises(Exception) as info:  # noqa: PT011 - checked below
            case.run()
    err = info.value
    message = str(err)
    assert isinstance(err, (ValueError, TypeError)), (
        f"{type(err).__module__}.{type(err).__name__}: {message}"
    )
    assert not isinstance(err, tf.errors.OpError), message
    assert type(err).__module__.split(".")[0] in ("builtins", "jacobkit"), (
        f"{type(err).__module__}.{type(err).__name__}: {message}"
    )
    assert NAMES_A_CALL.search(message), f"names no call: {message}"
    assert case.says in message, message
