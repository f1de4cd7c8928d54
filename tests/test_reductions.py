"""Per-example losses (``outputs=jk.Loss``) and the clipped sum
(``reduce=jk.ClippedSum``) by every registered strategy, against the float64
reference computed the obvious way: every row's gradient in float64, then
each norm, scale and sum in numpy.

Tolerance: the largest error measured over these cases and strategies was
1.9e-7 of the result's largest value (float32, oneDNN on and off);
the bound below is 1e-5, the suite's float32 bound.
"""

from __future__ import annotations

import keras
import numpy as np
import pytest
import tensorflow as tf

import jacobkit as jk
from jacobkit import testing
from jacobkit.problem import sketch
from tests import cases
from tests.cases import STRATEGIES, skip_same_chunks

RTOL = 1e-5
LOSS = jk.Loss(
    keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction=None)
)


def _mlp(size: int = 9) -> tuple[keras.Model, tuple[np.ndarray, ...]]:
    rng = np.random.default_rng(0)
    keras.utils.set_random_seed(0)
    model = keras.Sequential(
        [
            keras.Input((6,)),
            keras.layers.Dense(8, activation="tanh", name="hidden"),
            keras.layers.Dense(3, name="head"),
        ]
    )
    x = rng.normal(size=(size, 6)).astype("float32")
    y = rng.integers(0, 3, size)
    return model, (x, y)


def _tokens(size: int = 7) -> tuple[keras.Model, tuple[np.ndarray, ...]]:
    model, x, y, rng = cases.token_classifier(11, 5, 4, 6, size, seed=1)
    w = rng.uniform(0.5, 2.0, size).astype("float32")
    return model, (x, y, w)


def _conv() -> tuple[keras.Model, tuple[np.ndarray, ...]]:
    rng = np.random.default_rng(2)
    keras.utils.set_random_seed(2)
    model = keras.Sequential(
        [
            keras.Input((6, 6, 2)),
            keras.layers.Conv2D(3, 3, activation="relu", name="conv"),
            keras.layers.Flatten(),
            keras.layers.Dense(3, name="head"),
        ]
    )
    x = rng.normal(size=(6, 6, 6, 2)).astype("float32")
    y = rng.integers(0, 3, 6)
    return model, (x, y)


MODELS = {"mlp": _mlp, "tokens": _tokens, "conv": _conv}


#: the float64 references computed in this process, by what they are of and
#: the model's layers, weights and inputs (:func:`_once`)
_REFERENCES: dict[tuple, tuple[np.ndarray, ...]] = {}


def _once(what: str, model, inputs, compute) -> list[np.ndarray]:
    """``compute()``'s float64 arrays, computed once per process for a model
    of these layers and weights on these inputs: every strategy's case of a
    test checks the same rows (a float64 loop per row otherwise, per case).
    Each case still builds its own model; the cached arrays are read-only."""
    key = (
        what,
        tuple(
            (type(layer).__name__, repr(layer.get_config() | {"name": None}))
            for layer in model.layers
        ),
        tuple((w.dtype.str, w.shape, w.tobytes()) for w in model.get_weights()),
        tuple((a.dtype.str, a.shape, a.tobytes()) for a in map(np.asarray, inputs)),
    )
    if key not in _REFERENCES:
        arrays = tuple(np.array(r, np.float64) for r in compute())
        for array in arrays:
            array.setflags(write=False)
        _REFERENCES[key] = arrays
    return list(_REFERENCES[key])


def _per_example(model, inputs):
    """Every trainable variable's per-example loss gradient, float64, flat
    ``(B, P)`` beside the list in the variables' shapes."""
    grads = _once(
        "loss rows",
        model,
        inputs,
        lambda: testing.float64_reference(
            model, inputs, model.trainable_variables, outputs=LOSS
        ),
    )
    flat = np.concatenate([g.reshape(g.shape[0], -1) for g in grads], 1)
    return grads, flat


def _close(got, want) -> None:
    scale = max(float(np.abs(w).max()) for w in want)
    for g, w in zip(got, want):
        np.testing.assert_allclose(np.asarray(g), w, rtol=0, atol=RTOL * scale)


def _refuses(strategy) -> bool:
    """The structural shortcut serves linear heads, not losses."""
    return strategy.name == "structured"


def _forwards_kinds(names) -> list:
    """``(case, name)`` for every strategy and model, ``forward`` on the
    token model and the conv net marked slow: ``forward`` computes the rows
    only (no ``builds`` of its own), so its clipped sums and projections
    are each kind's generic computation from its rows, checked on
    ``forward`` by the MLP here, and its rows of those two models by
    ``test_loss_rows_agree_with_float64[forward-tokens]`` and
    ``[forward-conv]`` (7-20 s a case under load)."""
    return [
        pytest.param(
            case,
            name,
            id=f"{case.id}-{name}",
            marks=[pytest.mark.slow]
            if case.id == "forward" and name in ("tokens", "conv")
            else [],
        )
        for case in STRATEGIES
        for name in names
    ]


@pytest.mark.parametrize("name", list(MODELS))
@pytest.mark.parametrize("case", STRATEGIES, ids=lambda c: c.id)
def test_loss_rows_agree_with_float64(case, name, request):
    model, inputs = MODELS[name]()
    skip_same_chunks(request, case, len(inputs[0]), len(inputs[0]))
    strategy = case.make(inputs[0].shape[0])
    variables = model.trainable_variables
    if _refuses(strategy):
        with pytest.raises(ValueError):
            jk.jacobian(model, inputs, variables, strategy=strategy, outputs=LOSS)
        return
    want, _ = _per_example(model, inputs)
    result = jk.jacobian(model, inputs, variables, strategy=strategy, outputs=LOSS)
    assert result.rows_shape == (inputs[0].shape[0],)
    _close(list(result.jacobians.values()), want)


@pytest.mark.parametrize(("case", "name"), _forwards_kinds(MODELS))
def test_clipped_sum_agrees_with_float64(case, name, request):
    model, inputs = MODELS[name]()
    skip_same_chunks(request, case, len(inputs[0]), len(inputs[0]))
    strategy = case.make(inputs[0].shape[0])
    variables = model.trainable_variables
    want, flat = _per_example(model, inputs)
    norms = np.linalg.norm(flat, axis=1)
    clip = float(np.median(norms))  # some rows clipped, some not
    reduce = jk.ClippedSum(clip)
    if _refuses(strategy):
        with pytest.raises(ValueError):
            jk.jacobian(
                model, inputs, variables, strategy=strategy, outputs=LOSS, reduce=reduce
            )
        return
    scales = np.minimum(1.0, clip / norms)
    sums = [np.tensordot(scales, g, 1) for g in want]
    result = jk.jacobian(
        model, inputs, variables, strategy=strategy, outputs=LOSS, reduce=reduce
    )
    _close(list(result.jacobians.values()), sums)
    np.testing.assert_allclose(
        np.asarray(result.norms), norms, rtol=0, atol=RTOL * norms.max()
    )


#: the groups of each model's targets (positions in trainable_variables):
#: per layer, and on the MLP the hidden layer's kernel and bias apart (a
#: group that splits a layer: ``batch`` contracts its cotangents twice)
GROUPS = {
    "mlp": ((0,), (1,), (2, 3)),
    "tokens": ((0,), (1, 2), (3, 4)),
    "conv": ((0, 1), (2, 3)),
}


@pytest.mark.parametrize(("case", "name"), _forwards_kinds(MODELS))
def test_grouped_clipped_sum_agrees_with_float64(case, name, request):
    """``jk.ClippedSum(clips, groups=...)``: each group's part of every
    row's gradient clipped to its own norm (per-layer DP-SGD), in one call;
    the reference: every row's float64 gradient, each group's norm, scale
    and sum in numpy. ``result.norms``: the whole row's norm."""
    model, inputs = MODELS[name]()
    skip_same_chunks(request, case, len(inputs[0]), len(inputs[0]))
    strategy = case.make(inputs[0].shape[0])
    variables = model.trainable_variables
    want, flat = _per_example(model, inputs)
    groups = GROUPS[name]
    assert sorted(i for g in groups for i in g) == list(range(len(variables)))
    parts = [
        np.sqrt(sum(np.sum(want[i].reshape(len(flat), -1) ** 2, 1) for i in g))
        for g in groups
    ]
    # each group's median: some rows clipped in each group, some not
    clips = tuple(float(np.median(n)) for n in parts)
    reduce = jk.ClippedSum(clips, groups=groups)
    if _refuses(strategy):
        with pytest.raises(ValueError):
            jk.jacobian(
                model, inputs, variables, strategy=strategy, outputs=LOSS, reduce=reduce
            )
        return
    sums = [None] * len(variables)
    for g, clip, n in zip(groups, clips, parts):
        assert 0 < np.sum(n > clip) < len(n)
        scales = np.minimum(1.0, clip / n)
        for i in g:
            sums[i] = np.tensordot(scales, want[i], 1)
    result = jk.jacobian(
        model, inputs, variables, strategy=strategy, outputs=LOSS, reduce=reduce
    )
    _close(list(result.jacobians.values()), sums)
    norms = np.linalg.norm(flat, axis=1)
    np.testing.assert_allclose(
        np.asarray(result.norms), norms, rtol=0, atol=RTOL * norms.max()
    )


def test_grouped_clipped_sum_refuses_bad_groups_in_words():
    model, inputs = _mlp()
    variables = model.trainable_variables
    for groups in (((0, 1), (2,)), ((0, 1), (1, 2, 3))):
        with pytest.raises(ValueError, match="exactly once"):
            jk.jacobian(
                model,
                inputs,
                variables,
                outputs=LOSS,
                reduce=jk.ClippedSum(1.0, groups=groups),
            )
    with pytest.raises(ValueError, match="one clip norm per group"):
        jk.ClippedSum((1.0, 2.0), groups=((0, 1, 2, 3),))
    with pytest.raises(ValueError, match="one per group"):
        jk.ClippedSum((1.0, -2.0), groups=((0, 1), (2, 3)))
    with pytest.raises(ValueError, match="each group not empty"):
        jk.ClippedSum(1.0, groups=((0, 1), ()))
    with pytest.raises(ValueError, match="positive number"):
        jk.ClippedSum((1.0, 2.0))  # several norms need groups


@pytest.mark.parametrize("strategy", ["batch", "loop", "auto"])
def test_clipped_sum_over_a_dataset_is_one_sum(strategy):
    model, inputs = _tokens()
    want, flat = _per_example(model, inputs)
    norms = np.linalg.norm(flat, axis=1)
    clip = float(np.median(norms))
    sums = [np.tensordot(np.minimum(1.0, clip / norms), g, 1) for g in want]
    data = tf.data.Dataset.from_tensor_slices(inputs).batch(3)  # 3 + 3 + 1
    result = jk.jacobian(
        model,
        data,
        model.trainable_variables,
        strategy=strategy,
        outputs=LOSS,
        reduce=jk.ClippedSum(clip),
    )
    _close(list(result.jacobians.values()), sums)
    np.testing.assert_allclose(
        np.asarray(result.norms), norms, rtol=0, atol=RTOL * norms.max()
    )


@pytest.mark.parametrize(
    "outputs",
    ["features", "per_example", "full", lambda y: y[:, 0], jk.Loss(LOSS.fn, each=True)],
    ids=["features", "per_example", "full", "callable", "loss-each"],
)
@pytest.mark.parametrize("strategy", ["auto", "batch", "chunked"])
def test_clipped_sum_of_rows_not_one_per_example_is_refused(strategy, outputs):
    """Issue 48: ``outputs="features"`` clipped the output features summed
    over the batch (norms of shape ``(F,)``), silently: for DP-SGD no
    example's contribution was bounded. Every row mode but one loss per
    example is refused, naming the fix."""
    model, (x, y) = _mlp()
    inputs = (x, y) if isinstance(outputs, jk.Loss) else x
    refusal = "clipped sum clips one row per example"
    with pytest.raises(ValueError, match=refusal) as err:
        jk.jacobian(
            model,
            inputs,
            model.trainable_variables,
            strategy=strategy,
            outputs=outputs,
            reduce=jk.ClippedSum(1.0),
        )
    assert "outputs=jk.Loss(loss_fn) (without each=True)" in str(err.value)


@pytest.mark.parametrize("clip", [0, -1.0, "1", True, float("nan")])
def test_clip_norm_must_be_positive(clip):
    with pytest.raises(ValueError, match="positive number"):
        jk.ClippedSum(clip)


def test_clipped_sum_of_a_tensor_target_is_refused():
    model, inputs = _mlp()
    with pytest.raises(ValueError, match="clips the gradients of variables"):
        jk.jacobian(
            model,
            inputs,
            jk.Inputs(),
            strategy="loop",
            outputs=LOSS,
            reduce=jk.ClippedSum(1.0),
        )


def test_clipped_sum_of_a_dataset_is_not_written_out(tmp_path):
    model, inputs = _mlp()
    data = tf.data.Dataset.from_tensor_slices(inputs).batch(4)
    with pytest.raises(ValueError, match="ClippedSum"):
        jk.jacobian(
            model,
            data,
            model.trainable_variables,
            outputs=LOSS,
            reduce=jk.ClippedSum(1.0),
            out=str(tmp_path / "sums"),
        )


@pytest.mark.parametrize(
    "strategy", ["loop", "while", "jacobian", "chunked", "forward"]
)
@pytest.mark.parametrize("target", ["inputs", "embedding output"])
def test_loss_rows_of_a_tensor_keep_each_examples_own_block(strategy, target):
    """The loss's gradient with respect to each example's own input (saliency
    of the loss), ``(B, *x.shape[1:])``; the labels are not inputs."""
    if target == "inputs":
        model, inputs = _mlp()
        layer = jk.Inputs()
    else:
        model, inputs = _tokens()
        layer = jk.Output("embed")
    (want,) = testing.float64_reference(model, inputs, layer, outputs=LOSS)
    result = jk.jacobian(model, inputs, layer, strategy=strategy, outputs=LOSS)
    (got,) = result.jacobians.values()
    assert got.shape == want.shape
    assert want.shape[0] == inputs[0].shape[0]
    _close([got], [np.asarray(want)])


# -- reduce=jk.Project --------------------------------------------------------


def _wide() -> tuple[keras.Model, tuple[np.ndarray, ...]]:
    """Kernels large enough for Kronecker maps at dim=512 (a map of more than
    sketch.DENSE_ELEMENTS numbers), a Conv2D beside a Dense."""
    rng = np.random.default_rng(3)
    keras.utils.set_random_seed(3)
    model = keras.Sequential(
        [
            keras.Input((8, 8, 16)),
            keras.layers.Conv2D(64, 3, activation="relu", name="conv"),
            keras.layers.GlobalAveragePooling2D(),
            keras.layers.Dense(256, activation="tanh", name="wide"),
            keras.layers.Dense(3, name="head"),
        ]
    )
    x = rng.normal(size=(5, 8, 8, 16)).astype("float32")
    y = rng.integers(0, 3, 5)
    return model, (x, y)


def _projected_reference(project, names, variables, grads):
    """Each row's projection in float64, from the maps' own matrices."""
    total = 0.0
    for name, variable, g in zip(names, variables, grads):
        m = sketch.target_map(project, name, tuple(variable.shape))
        rows = g.reshape(g.shape[0], m.inputs, m.units)
        if not m.kronecker:  # a CountSketch or Gaussian matrix
            total = total + rows.reshape(g.shape[0], -1) @ m.matrix().astype(np.float64)
        else:
            left, right = m.left.astype(np.float64), m.right.astype(np.float64)
            both = np.einsum("ia,rio,ob->rab", left, rows, right)
            total = total + both.reshape(g.shape[0], -1)[:, : m.dim] / np.sqrt(m.dim)
    return total


@pytest.mark.parametrize(
    ("case", "name"), _forwards_kinds(["mlp", "tokens", "conv", "wide"])
)
def test_projection_agrees_with_float64(case, name, request):
    model, inputs = {**MODELS, "wide": _wide}[name]()
    skip_same_chunks(request, case, len(inputs[0]), len(inputs[0]))
    strategy = case.make(inputs[0].shape[0])
    variables = model.trainable_variables
    project = jk.Project(512 if name == "wide" else 32, seed=7)
    # forward mode predicts 9,490 passes for the wide kernels and refuses
    slow = strategy.name == "forward" and name == "wide"
    if _refuses(strategy) or slow:
        with pytest.raises(ValueError, match="forward mode needs" if slow else None):
            jk.jacobian(
                model,
                inputs,
                variables,
                strategy=strategy,
                outputs=LOSS,
                reduce=project,
            )
        return
    grads, _ = _per_example(model, inputs)
    result = jk.jacobian(
        model, inputs, variables, strategy=strategy, outputs=LOSS, reduce=project
    )
    want = _projected_reference(project, list(result.jacobians), variables, grads)
    assert result.projection.shape == (inputs[0].shape[0], project.dim)
    _close([result.projection], [want])


def _sequence() -> tuple[keras.Model, tuple[np.ndarray, ...]]:
    """Per-token outputs ``(B, T, classes)``, labels and a 0/1 weight per
    token (padding)."""
    rng = np.random.default_rng(6)
    keras.utils.set_random_seed(6)
    ids = keras.Input((5,), dtype="int32")
    h = keras.layers.Embedding(11, 4, name="embed")(ids)
    h = keras.layers.Dense(6, activation="tanh", name="mix")(h)
    out = keras.layers.Dense(11, name="head")(h)
    model = keras.Model(ids, out)
    x = rng.integers(0, 11, size=(4, 5)).astype("int32")
    y = rng.integers(0, 11, size=(4, 5))
    w = np.ones((4, 5), "float32")
    w[2, 3:] = 0
    return model, (x, y, w)


@pytest.mark.parametrize("case", STRATEGIES, ids=lambda c: c.id)
def test_loss_rows_of_each_token(case, request):
    """``jk.Loss(fn, each=True)``: every token's loss its own row, ``(B,
    T)``, a padded token's row exactly zero."""
    model, inputs = _sequence()
    skip_same_chunks(request, case, len(inputs[0]), inputs[1].size)
    strategy = case.make(inputs[0].shape[0])
    each = jk.Loss(LOSS.fn, each=True)
    variables = model.trainable_variables
    if _refuses(strategy):
        with pytest.raises(ValueError):
            jk.jacobian(model, inputs, variables, strategy=strategy, outputs=each)
        return
    want = _once(
        "each token's loss rows",
        model,
        inputs,
        lambda: testing.float64_reference(model, inputs, variables, outputs=each),
    )
    result = jk.jacobian(model, inputs, variables, strategy=strategy, outputs=each)
    assert result.rows_shape == (4, 5)
    _close(list(result.jacobians.values()), want)
    assert all(np.all(np.asarray(g)[2, 3:] == 0) for g in result.jacobians.values())
