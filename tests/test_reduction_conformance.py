"""Every reduction kind × every strategy × every row mode, against float64.

The kinds are :data:`tests.cases.REDUCTIONS` (the rows themselves,
``"norm"``, ``jk.ClippedSum``, ``jk.Project`` and the Gram's factors through
``jk.gram``), the strategies every entry of ``jk.strategies.REGISTRY`` plus
``"auto"``: registering either puts it here. Each case compares jacobkit's
answer with the one computed the obvious way from every row's float64
gradient (a tape per row on a float64 copy of the model), reduced in NumPy:
per-target norms, ``Σ_r g_r min(1, C/|g_r|)`` with each row's norm over every
target together (only loss rows, one per example: clipping the others is
refused), the library's own projection maps applied to the float64 rows,
``G Gᵀ``.

A strategy may refuse a problem, in words: a ``ValueError`` raised by
jacobkit itself (never a TensorFlow error passed on), and the case is then
skipped with its reason. ``auto`` never refuses.

Then ``training=True``, where the model draws randomness (Dropout) or keeps
state (BatchNormalization): the clipped sum of one example's loss (the
others' sample weights 0) must have norm ``min(|g_i|, C)``, from the same
draw as the norm it was scaled by, and a call must move BatchNormalization's
moving statistics exactly as one training call of the model does.
"""

from __future__ import annotations

import functools
import math
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import keras
import numpy as np
import pytest
import tensorflow as tf

import jacobkit as jk
from jacobkit import testing
from jacobkit.testing.reference_targets import resolve
from tests.cases import REDUCTIONS, PerRow, ReductionCase

#: each registered strategy with its defaults, and auto
STRATEGIES = [*jk.strategies.REGISTRY, "auto"]

LOSS = jk.Loss(
    keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction=None)
)

#: the largest ``max|found - expected| / max|expected|`` allowed per kind,
#: over every array a kind returns (the clipped sum's norms among them).
#: Measured, the worst case of each kind over every model, row mode and
#: strategy (slow cases included), float32, oneDNN on / off
#: (``TF_ENABLE_ONEDNN_OPTS=0``):
TOLERANCE = {
    "rows": 2e-6,  # 2.8e-7 / 2.8e-7 (the MLP's loss rows)
    "norm": 1e-6,  # 1.6e-7 / 1.6e-7
    "clipped_sum": 1e-6,  # 1.3e-7 (the MLP's loss rows, loop; GPT-2's
    # tokens, 2.1e-7 with oneDNN off, are one row per token: refused now)
    "project": 2e-6,  # 2.4e-7 / 2.7e-7
    "gram": 3e-6,  # 2.4e-7 / 5.6e-7 (GPT-2's tokens, loop)
}


# -- the models ------------------------------------------------------------------
@dataclass(frozen=True)
class Subject:
    """A model, its batch, and how its rows are formed.

    ``twin`` is a float64 model with the same weights where
    :func:`jacobkit.testing.float64_copy` cannot build one (a subclassed
    model); ``labels`` is ``(y,)`` or ``(y, sample_weight)`` for loss rows.
    """

    model: Any
    x: Any
    labels: tuple[Any, ...]
    loss: jk.Loss = LOSS
    twin: Any = None

    def inputs(self, mode: str) -> Any:
        return (self.x, *self.labels) if mode == "loss" else self.x

    def outputs(self, mode: str) -> Any:
        return self.loss if mode == "loss" else mode

    @property
    def targets(self) -> list[Any]:
        return self.model.trainable_variables


def _mlp() -> Subject:
    keras.utils.set_random_seed(0)
    rng = np.random.default_rng(0)
    model = keras.Sequential(
        [
            keras.Input((5,)),
            keras.layers.Dense(8, activation="tanh", name="hidden"),
            keras.layers.Dense(3, name="head"),
        ]
    )
    x = rng.normal(size=(6, 5)).astype("float32")
    return Subject(model, x, (rng.integers(0, 3, 6),))


def _conv() -> Subject:
    keras.utils.set_random_seed(1)
    rng = np.random.default_rng(1)
    model = keras.Sequential(
        [
            keras.Input((6, 6, 2)),
            keras.layers.Conv2D(3, 3, activation="relu", name="conv"),
            keras.layers.Conv2D(4, 2, activation="tanh", name="conv2"),
            keras.layers.Flatten(),
            keras.layers.Dense(3, name="head"),
        ]
    )
    x = rng.normal(size=(5, 6, 6, 2)).astype("float32")
    weights = rng.uniform(0.5, 2.0, 5).astype("float32")
    return Subject(model, x, (rng.integers(0, 3, 5), weights))


class Residual(keras.Model):
    """Layers called from Python, one of them twice."""

    def __init__(self, dtype: str = "float32") -> None:
        super().__init__(dtype=dtype, name="residual")
        self.hidden = keras.layers.Dense(6, activation="tanh", dtype=dtype)
        self.mix = keras.layers.Dense(6, activation="tanh", dtype=dtype)
        self.head = keras.layers.Dense(3, dtype=dtype)

    def call(self, x: Any) -> Any:
        h = self.hidden(x)
        h = h + self.mix(self.mix(h))
        return self.head(h)


def _subclassed() -> Subject:
    keras.utils.set_random_seed(2)
    rng = np.random.default_rng(2)
    x = rng.normal(size=(5, 4)).astype("float32")
    model, twin = Residual(), Residual("float64")
    model(x)
    twin(x.astype("float64"))
    twin.set_weights([w.astype("float64") for w in model.get_weights()])
    weights = rng.uniform(0.5, 2.0, 5).astype("float32")
    return Subject(model, x, (rng.integers(0, 3, 5), weights), twin=twin)


def _gpt2() -> Subject:
    """keras_hub's GPT2CausalLM (tiny, random init): each token's next-token
    loss its own row, a padded token's weight 0."""
    keras_hub = pytest.importorskip("keras_hub")
    from tests import hub_models

    keras.utils.set_random_seed(3)
    rng = np.random.default_rng(3)
    model = keras_hub.models.GPT2CausalLM(
        hub_models.gpt2(50, hidden=8, intermediate=16, length=6), preprocessor=None
    )
    ids = rng.integers(1, 50, (2, 6)).astype("int32")
    mask = np.ones((2, 6), "int32")
    mask[1, 4:] = 0
    x = {"token_ids": ids, "padding_mask": mask}
    y = np.roll(ids, -1, axis=1)
    each = jk.Loss(LOSS.fn, each=True)
    return Subject(model, x, (y, mask.astype("float32")), loss=each)


SUBJECTS: dict[str, Callable[[], Subject]] = {
    "mlp": _mlp,
    "conv": _conv,
    "subclassed": _subclassed,
    "gpt2": _gpt2,
}
#: (model, row mode) pairs; GPT-2's rows are its tokens' losses (its
#: features are a 50-token vocabulary: 50 or 100 rows through a transformer)
ROW_MODES = [
    *(
        (name, mode)
        for name in SUBJECTS
        if name != "gpt2"
        for mode in ("features", "per_example", "loss")
    ),
    ("gpt2", "loss"),
]


@functools.cache
def _subject(name: str) -> Subject:
    return SUBJECTS[name]()


@functools.cache
def _per_row(name: str, mode: str) -> PerRow:
    """Every row's float64 gradient for a model and a row mode (cached)."""
    subject = _subject(name)
    inputs, outputs = subject.inputs(mode), subject.outputs(mode)
    if subject.twin is None:
        ref = testing.float64_reference(
            subject.model, inputs, subject.targets, outputs=outputs, baseline=False
        )
        assert ref.description.startswith("float64 loop"), ref.description
        gradients, names = tuple(ref.jacobians), tuple(ref.names)
    else:
        gradients = tuple(
            testing.reference_jacobian(
                subject.twin,
                tf.nest.map_structure(_float64, inputs),
                subject.twin.trainable_variables,
                outputs=outputs,
            )
        )
        names = resolve(subject.targets, subject.model, subject.x).names
    first = subject.targets[0]
    rows_shape = gradients[0].shape[: gradients[0].ndim - len(first.shape)]
    return PerRow(
        tuple(np.asarray(g, np.float64) for g in gradients), rows_shape, names
    )


def _float64(value: Any) -> Any:
    array = np.asarray(value)
    return array.astype("float64") if array.dtype.kind == "f" else value


# -- refusals and comparisons ----------------------------------------------------
_JACOBKIT = str(Path(jk.__file__).parent)


def _skip_if_refused(strategy: str, err: ValueError) -> None:
    """A refusal in words is a skip: a ValueError raised by jacobkit that
    names the strategy. Anything else fails the case."""
    raised_in = traceback.extract_tb(err.__traceback__)[-1].filename
    assert raised_in.startswith(_JACOBKIT), (
        f"strategy {strategy!r} raised a ValueError from {raised_in}, not a "
        f"refusal of jacobkit's: {err}"
    )
    assert f"strategy={strategy!r}" in str(err), f"not a refusal: {err}"
    assert strategy != "auto", f"auto refused: {err}"
    pytest.skip(f"{strategy} refuses: {str(err)[:300]}")


def _relative_error(found: list[np.ndarray], expected: list[np.ndarray]) -> float:
    assert [np.shape(f) for f in found] == [np.shape(e) for e in expected]
    scale = testing.largest_value(expected)
    return max(
        testing.max_relative_difference(f, e, scale=scale)
        for f, e in zip(found, expected, strict=True)
    )


def _cases() -> list[Any]:
    found = []
    for reduction in REDUCTIONS:
        for strategy in STRATEGIES:
            for name, mode in ROW_MODES:
                if name == "gpt2" and strategy == "forward" and reduction.id != "rows":
                    # forward's rows of GPT-2 take 70-100 s (a pass per chunk
                    # of its parameters), and every other kind is composed
                    # from those rows by the kind's generic computation,
                    # which the other subjects check on forward: the rows
                    # case checks forward on GPT-2 (the three others took
                    # 220 s of the slow job)
                    continue
                # GPT-2 by the others: forward's rows took 94-97 s, the
                # loop's 9-12 s
                slow = name == "gpt2" and strategy not in ("auto", "chunked")
                # forward computes rows only (every other kind is the
                # kind's generic computation from them): its rows are
                # checked on every subject and row mode, and the kinds on
                # forward by the MLP in every row mode; on the conv net and
                # the subclassed model the 24 cases took 43 s in one process
                # on a lightly loaded machine (1.4-4.0 s each; 40-50 s each
                # under heavy load)
                slow |= (
                    strategy == "forward"
                    and reduction.id != "rows"
                    and name in ("conv", "subclassed")
                )
                found.append(
                    pytest.param(
                        reduction,
                        strategy,
                        name,
                        mode,
                        id=f"{reduction.id}-{strategy}-{name}-{mode}",
                        marks=[pytest.mark.slow] if slow else [],
                    )
                )
    return found


@pytest.mark.parametrize(("reduction", "strategy", "name", "mode"), _cases())
def test_reduction_agrees_with_float64(
    reduction: ReductionCase, strategy: str, name: str, mode: str
) -> None:
    subject = _subject(name)
    outputs = subject.outputs(mode)
    one_per_example = isinstance(outputs, jk.Loss) and not outputs.each
    if reduction.id == "clipped_sum" and not one_per_example:
        # clipping rows that are not one per example (GPT-2's: one per token)
        # bounds no example's contribution: refused by every strategy
        with pytest.raises(ValueError, match="clipped sum clips one row per example"):
            reduction.found(
                subject.model,
                subject.inputs(mode),
                subject.targets,
                jk.ClippedSum(1.0),
                outputs=subject.outputs(mode),
                strategy=strategy,
            )
        return
    rows = _per_row(name, mode)
    argument = reduction.argument(rows)
    try:
        found = reduction.found(
            subject.model,
            subject.inputs(mode),
            subject.targets,
            argument,
            outputs=subject.outputs(mode),
            strategy=strategy,
        )
    except ValueError as err:
        _skip_if_refused(strategy, err)
    error = _relative_error(found, reduction.expected(rows, argument))
    assert error <= TOLERANCE[reduction.id], error


def _linear_closed_forms(x: np.ndarray, clip: float) -> dict[str, list[np.ndarray]]:
    """A linear Dense layer's per-example rows ``(b, f)`` in closed form:
    the kernel's gradient is ``x_b e_fᵀ`` and the bias's ``e_f``, so each
    kind's expected result is known by hand."""
    batch = len(x)
    features = 2
    eye = np.eye(features)
    kernel = np.einsum("bi,fg->bfig", x, eye)
    bias = np.broadcast_to(eye, (batch, features, features))
    norms = np.sqrt(np.sum(x**2, axis=1) + 1)  # each row's, over both targets
    scales = np.minimum(1.0, clip / norms)
    return {
        "rows": [kernel, bias],
        "norm": [
            np.repeat(np.linalg.norm(x, axis=1)[:, None], features, 1),
            np.ones((batch, features)),
        ],
        "clipped_sum": [
            np.repeat((scales @ x)[:, None], features, 1),
            np.full(features, scales.sum()),
            np.repeat(norms[:, None], features, 1),
        ],
        "gram": [np.kron(x @ x.T + 1, eye)],
    }


def test_the_reference_meets_a_linear_layers_closed_form() -> None:
    """The float64 rows and each kind's reduction of them, on a linear Dense
    layer, against the closed form (STYLE 5: the reference checked once)."""
    layer = keras.layers.Dense(2, dtype="float64")
    model = keras.Sequential([keras.Input((3,), dtype="float64"), layer])
    x = np.random.default_rng(6).normal(size=(4, 3))
    ref = testing.float64_reference(
        model, x, [layer.kernel, layer.bias], outputs="per_example"
    )
    rows = PerRow(tuple(ref.jacobians), (4, 2), tuple(ref.names))
    clip = float(np.median(rows.norms))
    closed = _linear_closed_forms(x, clip)
    for reduction in REDUCTIONS:
        if reduction.id not in closed:  # the projection: the library's own map
            continue
        argument = reduction.argument(rows)
        assert reduction.id != "clipped_sum" or argument.clip_norm == clip
        expected = reduction.expected(rows, argument)
        for found, want in zip(expected, closed[reduction.id], strict=True):
            np.testing.assert_allclose(found, want, rtol=1e-12, atol=1e-12)


# -- training=True: one draw of the model's randomness per call -------------------
def _dropout_mlp() -> Subject:
    keras.utils.set_random_seed(4)
    rng = np.random.default_rng(4)
    model = keras.Sequential(
        [
            keras.Input((6,)),
            keras.layers.Dense(16, activation="tanh", name="hidden"),
            keras.layers.Dropout(0.5, name="dropout"),
            keras.layers.Dense(3, name="head"),
        ]
    )
    x = rng.normal(size=(4, 6)).astype("float32")
    return Subject(model, x, (rng.integers(0, 3, 4),))


def _batch_norm_conv() -> Subject:
    keras.utils.set_random_seed(5)
    rng = np.random.default_rng(5)
    model = keras.Sequential(
        [
            keras.Input((6, 6, 2)),
            keras.layers.Conv2D(4, 3, name="conv"),
            keras.layers.BatchNormalization(name="bn"),
            keras.layers.ReLU(),
            keras.layers.Flatten(),
            keras.layers.Dense(3, name="head"),
        ]
    )
    x = rng.normal(loc=0.5, size=(4, 6, 6, 2)).astype("float32")
    return Subject(model, x, (rng.integers(0, 3, 4),))


TRAINING = {"mlp_dropout": _dropout_mlp, "conv_batch_norm": _batch_norm_conv}
#: below every example's loss gradient norm, so that every row is clipped
#: (measured in training: 0.37-7.8 on the dropout MLP over 20 draws of its
#: masks, 4.0-12.6 on the batch-normalized conv net)
CLIP_NORM = 0.1

#: what the code did before one draw per call, measured (issue 47): the
#: clipped sum by a strategy without its own took the norms from one pass
#: of the model and the scaled gradient from a second, with another
#: dropout mask (one
#: example's clipped contribution 0.27-3.9 times C); each pass moves the
#: moving statistics (2 updates; ``forward``: a pass per chunk of tangents,
#: 10; ``auto``'s planning runs passes on other batches); ``forward`` draws
#: a mask per chunk of tangents within one call (its rows are no one
#: draw's), and ``batch`` checks the model by a pass of its own on its first
#: call with a problem (a second draw, its rows not the first's)
#: (so the cases below failed: the contribution on loop, jacobian, while,
#: chunked and forward; the moving statistics on those and auto; the rows
#: on batch and forward)


def _one_example(subject: Subject, i: int) -> tuple[Any, ...]:
    """The batch with sample weights one-hot at ``i``: only example ``i``'s
    row has a gradient (the others' losses are multiplied by 0)."""
    weights = np.zeros(len(subject.x), "float32")
    weights[i] = 1.0
    return (subject.x, subject.labels[0], weights)


@pytest.mark.parametrize(
    ("name", "strategy"),
    [(name, s) for name in TRAINING for s in STRATEGIES],
)
def test_each_examples_clipped_contribution_is_at_most_the_clip_norm(
    name: str, strategy: str
) -> None:
    """DP-SGD's bound: with only example ``i`` weighted, the clipped sum is
    ``g_i min(1, C/|g_i|)``, of norm ``min(|g_i|, C) <= C``, where ``g_i``
    is one draw's gradient and ``|g_i|`` the norm reported beside it."""
    subject = TRAINING[name]()
    contributions, norms_of_each = [], []
    for i in range(len(subject.x)):
        try:
            result = jk.jacobian(
                subject.model,
                _one_example(subject, i),
                subject.targets,
                outputs=LOSS,
                reduce=jk.ClippedSum(CLIP_NORM),
                training=True,
                strategy=strategy,
            )
        except ValueError as err:
            _skip_if_refused(strategy, err)
        norms = np.asarray(result.norms, np.float64)
        assert np.all(np.delete(norms, i) == 0), norms
        assert norms[i] > CLIP_NORM, "the clip norm is below every row's norm"
        norms_of_each.append(norms[i])
        contributions.append(
            math.sqrt(
                sum(
                    float(np.sum(np.square(v, dtype=np.float64)))
                    for v in result.jacobians.values()
                )
            )
        )
    ratios = np.array(contributions) / np.minimum(norms_of_each, CLIP_NORM)
    # float32 sums of float32 scaled rows (measured: 1 within 1.9e-7)
    np.testing.assert_array_less(contributions, CLIP_NORM * (1 + 1e-5))
    np.testing.assert_allclose(ratios, 1.0, rtol=1e-5)


def _moving_statistics(model: Any) -> list[np.ndarray]:
    bn = model.get_layer("bn")
    return [np.asarray(bn.moving_mean), np.asarray(bn.moving_variance)]


def _clipped_sum_call(subject: Subject, strategy: str, training: bool) -> None:
    try:
        jk.jacobian(
            subject.model,
            (subject.x, subject.labels[0], np.ones(len(subject.x), "float32")),
            subject.targets,
            outputs=LOSS,
            reduce=jk.ClippedSum(CLIP_NORM),
            training=training,
            strategy=strategy,
        )
    except ValueError as err:
        _skip_if_refused(strategy, err)


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_an_inference_call_leaves_batch_statistics(strategy: str) -> None:
    subject = _batch_norm_conv()
    before = _moving_statistics(subject.model)
    _clipped_sum_call(subject, strategy, training=False)
    for found, want in zip(_moving_statistics(subject.model), before, strict=True):
        np.testing.assert_array_equal(found, want)


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_a_training_call_moves_batch_statistics_as_one_step(strategy: str) -> None:
    """The moving statistics after a ``training=True`` call are those after
    one ``model(x, training=True)`` of an identical copy."""
    subject = _batch_norm_conv()
    twin = keras.models.clone_model(subject.model)
    twin.set_weights(subject.model.get_weights())
    before = _moving_statistics(subject.model)
    _clipped_sum_call(subject, strategy, training=True)
    twin(subject.x, training=True)
    moved = f"moved as {_training_calls(subject, before)} training calls"
    pairs = zip(_moving_statistics(subject.model), _moving_statistics(twin))
    for found, want in pairs:
        np.testing.assert_allclose(found, want, rtol=1e-6, atol=1e-7, err_msg=moved)


def _training_calls(subject: Subject, before: list[np.ndarray]) -> list[float]:
    """How many ``model(x, training=True)`` calls would have moved the moving
    mean from ``before`` to where it is, per channel: ``k`` updates by the
    same batch mean ``μ`` take ``m`` to ``μ + (m - μ) momentum^k`` (not a
    whole number where passes ran on other batches)."""
    bn, conv = subject.model.get_layer("bn"), subject.model.get_layer("conv")
    mean = np.asarray(conv(subject.x)).mean(axis=(0, 1, 2))
    now = np.asarray(bn.moving_mean)
    calls = np.log((now - mean) / (before[0] - mean)) / np.log(bn.momentum)
    return np.round(calls, 2).tolist()


@pytest.mark.parametrize("strategy", [s for s in STRATEGIES if s != "loop"])
def test_rows_under_dropout_agree_with_the_loops(strategy: str) -> None:
    """From the same state of the dropout layer's seed generator, a
    strategy's first call draws the masks the eager loop draws: the same
    rows (a fresh model: nothing traced or checked before)."""
    subject = _dropout_mlp()
    model = subject.model
    state = model.get_layer("dropout").seed_generator.state
    start = np.asarray(state)

    def rows(strategy: str, training: bool = True) -> list[np.ndarray]:
        state.assign(start)
        result = jk.jacobian(
            model,
            subject.inputs("loss"),
            subject.targets,
            outputs=LOSS,
            training=training,
            strategy=strategy,
        )
        return [np.asarray(v) for v in result.jacobians.values()]

    try:
        found = rows(strategy)
    except ValueError as err:
        _skip_if_refused(strategy, err)
    want = rows("loop")
    assert _relative_error(rows("loop", training=False), want) > 0.1, "masks drawn"
    error = _relative_error(found, want)
    # measured: 1.4e-7 (float32 rounding, the same masks)
    assert error <= TOLERANCE["rows"], error
