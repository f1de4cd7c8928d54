"""The strategy list and the problem list, each defined once.

The conformance tests take their product. A strategy registered in
``jacobkit.strategies.REGISTRY`` is picked up here with no other change.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import keras
import numpy as np
import pytest
import tensorflow as tf

import jacobkit as jk
from jacobkit import runtime, testing
from jacobkit.problem.reduction import KINDS
from jacobkit.testing import examples


@dataclass(frozen=True)
class StrategyCase:
    """A strategy configuration; ``make(R)`` builds it for a problem with R rows."""

    id: str
    make: Callable[[int], jk.strategies.Strategy]


def _chunked(label: str, size: Callable[[int], int]) -> StrategyCase:
    return StrategyCase(
        f"chunked({label})", lambda rows: jk.strategies.Chunked(size(rows))
    )


STRATEGIES = [
    StrategyCase(name, lambda rows, cls=cls: cls())
    for name, cls in jk.strategies.REGISTRY.items()
] + [
    _chunked("1", lambda r: 1),
    _chunked("2", lambda r: 2),
    _chunked("3", lambda r: 3),
    _chunked("7", lambda r: 7),
    _chunked("R", lambda r: r),
    _chunked("R+1000", lambda r: r + 1000),
    # one row in flight: what auto runs under a tight budget
    StrategyCase("while(parallel=1)", lambda rows: jk.strategies.While(1)),
]


def same_chunks_as(case: StrategyCase, made_with: int, rows: int) -> str | None:
    """The id of an earlier case of :data:`STRATEGIES` that runs the same
    computation as ``case`` on a problem of ``rows`` rows (each case made by
    ``make(made_with)``), or ``None``.

    ``chunked`` depends on its chunk size only through ``min(chunk_size,
    rows)`` (``jacobkit.strategies.chunks.map_chunks``; checked by
    ``tests/test_conformance.py::test_chunk_sizes_beyond_the_rows_are_the_rows``):
    ``chunked(R+1000)`` is ``chunked(R)``, and on 3 rows ``chunked(7)`` and
    ``chunked(16)`` are ``chunked(3)``. Such a case checks nothing its
    earlier twin does not, and runs with ``--slow`` only
    (:func:`skip_same_chunks`; ``--slow -m slow`` selects it too:
    ``conftest.py``)."""
    strategy = case.make(made_with)
    if not isinstance(strategy, jk.strategies.Chunked):
        return None
    size = strategy.rows_at_once(rows)
    for other in STRATEGIES:
        if other is case:
            return None
        twin = other.make(made_with)
        if isinstance(twin, jk.strategies.Chunked) and twin.rows_at_once(rows) == size:
            return other.id
    return None


def skip_same_chunks(
    request: pytest.FixtureRequest, case: StrategyCase, made_with: int, rows: int
) -> None:
    """Skip ``case`` (unless ``--slow``) where an earlier case runs the same
    chunks (:func:`same_chunks_as`), naming that case."""
    twin = same_chunks_as(case, made_with, rows)
    slow = request.config.getoption("--slow")
    if twin is not None and not slow:
        pytest.skip(
            f"slow: {case.id} runs chunks of min(size, {rows} rows), as {twin} "
            "does in the same test"
        )
    if (
        twin is None
        and case.id.startswith("chunked(")
        and slow
        and request.config.getoption("markexpr") == "slow"
    ):
        # selected by ``--slow -m slow`` as a possible twin (conftest.py)
        pytest.skip(f"{case.id} on {rows} rows runs in the plain pytest")


#: every test problem; the frozen backbones are benchmark-sized and tested
#: alone (tests/test_real_models.py: MobileNetV2 and BERT at small sizes)
PROBLEMS = [
    name
    for name in examples.BUILDERS
    if name
    not in (
        "frozen_resnet",
        "frozen_mobilenet",
        "frozen_efficientnet",
        "bert_classifier",
    )
]


def _square_over_batch(y: tf.Tensor) -> tf.Tensor:
    """A callable ``outputs=``: rows are ``sum_b Y[b, ...]**2``."""
    return tf.reduce_sum(y * y, axis=0)


OUTPUTS = {
    "features": "features",
    "per_example": "per_example",
    "full": "full",
    "callable": _square_over_batch,
}

#: (problem, reason) pairs where the batch strategy must refuse, with the
#: start of its message
BATCH_REFUSES = {
    "tf_module": "supports Dense, Conv1D, Conv2D",
}


#: (problem, outputs) pairs where the structured strategy applies (with the
#: structure it finds); on every other pair it must refuse with
#: STRUCTURED_REFUSES. The residual block ends in Dense(4) on 3 pooled
#: channels (a linear head); dense_head's target is its head, followed only
#: by an elementwise sigmoid (separable channels).
STRUCTURED_APPLIES = {
    **{
        ("residual", mode): "linear head"
        for mode in ("features", "per_example", "full")
    },
    **{
        ("dense_head", mode): "separable channels"
        for mode in ("features", "per_example")
    },
}
STRUCTURED_REFUSES = "no exact shortcut applies"


def structured_refuses(problem: str, outputs: str) -> bool:
    """Whether the structured strategy must refuse ``problem`` with these rows."""
    return (problem, outputs) not in STRUCTURED_APPLIES


def call_kwargs(model) -> dict:
    return {} if isinstance(model, examples.Affine) else {"training": False}


def target_variables(example: examples.Example) -> list:
    """The target variables of an example, found the plain Keras way."""
    if isinstance(example.layer, list):
        return example.layer
    layer = example.model.get_layer(example.layer)
    return [layer.kernel, layer.bias]


@functools.cache
def example(name: str, dtype: str = "float32") -> examples.Example:
    return examples.build(name, dtype)


@functools.cache
def reference(name: str, outputs: str, features: tuple | None = None) -> list:
    """float64 reference for a problem and an ``outputs`` mode (cached)."""
    ex = example(name, "float64")
    return testing.reference_jacobian(
        ex.model,
        ex.inputs,
        target_variables(ex),
        outputs=OUTPUTS[outputs],
        features=features,
        call_kwargs=call_kwargs(ex.model),
    )


# -- tensor targets: jk.Inputs() and jk.Output(layer) ----------------------------
@dataclass(frozen=True)
class TargetCase:
    """A problem with a tensor target. ``split(ex)`` takes the float64
    example and returns ``(rest, tensor)``: the target tensor's value and the
    rest of the model as a function of it, written out by hand (the obvious
    reference, :func:`jacobkit.testing.reference_tensor_jacobian`)."""

    id: str
    problem: str
    target: object
    split: Callable[[examples.Example], tuple[Callable, object]]


def _whole_model(ex):
    return (lambda x: ex.model(x, **call_kwargs(ex.model))), ex.inputs


def _generator_conv2(ex):
    layer = ex.model.get_layer
    a = layer("conv2")(layer("conv1")(ex.inputs))
    return (lambda a: layer("head")(layer("conv3")(a))), a


def _residual_conv_a(ex):
    layer, x = ex.model.get_layer, ex.inputs

    def rest(a):
        h = tf.nn.relu(layer("bn")(a, training=False))
        h = x + layer("conv_b")(h)
        return layer("head")(tf.reduce_mean(h, axis=(1, 2)))

    return rest, layer("conv_a")(x)


def _multi_input_b(ex):
    xa, xb = ex.inputs
    xa = tf.constant(xa)  # Keras refuses a mix of arrays and tensors
    return (lambda b: ex.model((xa, b), training=False)), xb


def _tf_keras_hidden(ex):
    layer = ex.model.get_layer
    return (lambda a: layer("k2_head")(a)), layer("k2_hidden")(ex.inputs)


TARGETS = [
    TargetCase("inputs", "generator", jk.Inputs(), _whole_model),
    TargetCase("inputs", "tf_module", jk.Inputs(), _whole_model),
    TargetCase("inputs(b)", "multi_input", jk.Inputs("b"), _multi_input_b),
    TargetCase("output(conv2)", "generator", jk.Output("conv2"), _generator_conv2),
    TargetCase("output(conv_a)", "residual", jk.Output("conv_a"), _residual_conv_a),
    TargetCase(
        "output(k2_hidden)", "tf_keras", jk.Output("k2_hidden"), _tf_keras_hidden
    ),
]


@functools.cache
def tensor_reference(index: int, outputs: str):
    """float64 reference for ``TARGETS[index]`` and an ``outputs`` mode."""
    case = TARGETS[index]
    rest, tensor = case.split(example(case.problem, "float64"))
    return testing.reference_tensor_jacobian(rest, tensor, outputs=OUTPUTS[outputs])


@contextlib.contextmanager
def unless_kernels_exceed_the_budget() -> Iterator[None]:
    """Where this CPU's convolution gradient kernels alone take more work
    space than a budget allows, jacobkit refuses the budget before running
    (see ``jacobkit.planner.scratch``: measured 32 MiB per backward pass
    without oneDNN on a 32 MiB-L3 EPYC, ~0 with it): the test is then an
    expected failure naming the CPU and the measured figure, not a pass."""
    try:
        yield
    except ValueError as err:
        if "convolution gradient kernels take" not in str(err):
            raise
        pytest.xfail(f"{runtime.cpu_kind().describe()}: {err}")


def two_blocks() -> tuple[keras.Model, np.ndarray]:
    """A functional model with two blocks, ``block_0`` and ``block_1``, each
    holding a Dense named ``query`` (as each transformer layer of a BERT holds
    its own), then a Dense ``head``; on (3, 4) inputs."""
    x_in = keras.Input((4,), name="x")
    h = x_in
    for i in range(2):
        block = keras.Sequential(
            [keras.layers.Dense(3, activation="tanh", name="query")], name=f"block_{i}"
        )
        h = block(h)
    model = keras.Model(x_in, keras.layers.Dense(2, name="head")(h), name="blocks")
    x = np.random.default_rng(0).normal(size=(3, 4)).astype("float32")
    return model, x


def token_classifier(
    vocab: int, length: int, width: int, hidden: int, size: int, seed: int
) -> tuple[keras.Model, np.ndarray, np.ndarray, np.random.Generator]:
    """An embedding, a GELU Dense over each token, average pooling and a
    3-class head: the model, ``size`` examples' ids ``(size, length)`` and
    labels ``(size,)``, and the generator they were drawn from (``seed``,
    as the weights)."""
    rng = np.random.default_rng(seed)
    keras.utils.set_random_seed(seed)
    ids = keras.Input((length,), dtype="int32")
    h = keras.layers.Embedding(vocab, width, name="embed")(ids)
    h = keras.layers.Dense(hidden, activation="gelu", name="ffn")(h)
    h = keras.layers.GlobalAveragePooling1D()(h)
    out = keras.layers.Dense(3, name="head")(h)
    x = rng.integers(0, vocab, size=(size, length)).astype("int32")
    return keras.Model(ids, out), x, rng.integers(0, 3, size), rng


def kernel_scratch(problem: Any) -> int:
    """What this CPU's convolution gradient kernels allocate in
    ``problem``'s backward pass beside its tensors, as the planner measures
    and adds it (:mod:`jacobkit.planner.scratch`): about 0 under oneDNN,
    32 MiB for TensorFlow's own kernels (their im2col buffer). A test's
    budget is set beyond it: a fixed one fits no candidate without oneDNN."""
    from jacobkit.planner import scratch

    return scratch.scratch_bytes(problem.convolutions, problem.output_dtype, "CPU:0")


# -- reduction kinds: what each row's gradient is reduced to ---------------------
@dataclass(frozen=True)
class PerRow:
    """Every row's gradient in float64, computed the obvious way (a tape per
    row on a float64 copy): one array per target, ``rows_shape + v.shape``,
    in the order and under the names :func:`jacobkit.jacobian` gives them."""

    gradients: tuple[np.ndarray, ...]
    rows_shape: tuple[int, ...]
    names: tuple[str, ...]

    @property
    def num_rows(self) -> int:
        return int(np.prod(self.rows_shape))

    def of_target(self, index: int) -> np.ndarray:
        """Target ``index``'s rows, ``(R, *v.shape)``."""
        g = self.gradients[index]
        return g.reshape(self.num_rows, *g.shape[len(self.rows_shape) :])

    @property
    def flat(self) -> np.ndarray:
        """``(R, P)``: each row's whole gradient, over every target."""
        return np.concatenate(
            [g.reshape(self.num_rows, -1) for g in self.gradients], axis=1
        )

    @property
    def norms(self) -> np.ndarray:
        """``(R,)``: each row's norm over every target together."""
        return np.linalg.norm(self.flat, axis=1)


def per_example_gradients(
    forward: Callable[[Any], Any],
    variables: Sequence[Any],
    data: tuple,
    loss: Callable[[Any, Any], Any],
) -> PerRow:
    """Every example's loss gradient in float64, the obvious way: one
    ``tf.GradientTape`` per example, on that example alone.

    ``data`` is ``(x, y)`` or ``(x, y, w)``, ``x`` any nest of arrays (a
    dict of tensors, as keras_hub models take) sliced to example ``i`` leaf
    by leaf, its floating leaves cast to float64; row ``i`` is
    ``w_i * sum(loss(y_i, forward(x_i)))``, as ``jk.Loss`` weighs it.
    ``forward`` is called as it is (a float64 copy of the model, or the
    model written out on float64 variables); each gradient is made dense
    (an embedding's) and float64, zeros where a variable is not reached.
    """
    x, y, *weight = data
    rows: list[list[np.ndarray]] = []
    for i in range(len(y)):
        one = tf.nest.map_structure(lambda t, i=i: _float64(t[i : i + 1]), x)
        with tf.GradientTape() as tape:
            value = tf.reduce_sum(loss(y[i : i + 1], forward(one)))
            if weight:
                value = tf.cast(weight[0][i], value.dtype) * value
        grads = tape.gradient(
            value, variables, unconnected_gradients=tf.UnconnectedGradients.ZERO
        )
        rows.append([np.asarray(tf.convert_to_tensor(g), np.float64) for g in grads])
    names = tuple(getattr(v, "path", v.name) for v in variables)
    gradients = tuple(np.stack(each) for each in zip(*rows, strict=True))
    return PerRow(gradients, (len(y),), names)


def _float64(t: Any) -> Any:
    """A floating input as float64; ids and masks as they are."""
    t = tf.convert_to_tensor(t)
    return tf.cast(t, tf.float64) if t.dtype.is_floating else t


def clipped_sums(
    rows: PerRow,
    clips: float | Sequence[float],
    groups: Sequence[Sequence[int]] | None = None,
) -> tuple[list[np.ndarray], np.ndarray]:
    """``Σ_r min(1, C / |g_r|) g_r`` per target, in NumPy from the float64
    rows, and every row's norm (over every target together).

    With ``groups`` (each a list of target indices, one clip each), each
    group's rows are clipped by their norm over that group's targets alone
    (DP-SGD's per-layer clipping). A row of norm 0 (an example of weight 0)
    adds 0.
    """
    groups = groups if groups is not None else [range(len(rows.gradients))]
    clips = [float(clips)] * len(groups) if np.ndim(clips) == 0 else clips
    sums: list[np.ndarray] = [np.zeros(0)] * len(rows.gradients)
    for group, clip in zip(groups, clips, strict=True):
        flat = np.concatenate(
            [rows.of_target(j).reshape(rows.num_rows, -1) for j in group], axis=1
        )
        scales = np.minimum(
            1.0, clip / np.maximum(np.linalg.norm(flat, axis=1), 1e-300)
        )
        for j in group:
            sums[j] = np.tensordot(scales, rows.of_target(j), 1)
    return sums, rows.norms.reshape(rows.rows_shape)


@dataclass(frozen=True)
class ReductionCase:
    """One kind of ``reduce=`` (or ``jk.gram``'s factors), as the suite tests it.

    ``argument(rows)`` is what the call takes for these rows (a clip norm
    that clips some rows and not others); ``expected(rows, argument)`` the
    result computed from the float64 rows in NumPy; ``found(...)`` runs
    jacobkit (``jk.jacobian``, or ``jk.gram`` for the Gram's factors) and
    returns the arrays to compare with it, in the same order.
    """

    id: str
    kind: Any
    argument: Callable[[PerRow], Any]
    expected: Callable[[PerRow, Any], list[np.ndarray]]
    found: Callable[..., list[np.ndarray]]


def _by_jacobian(values: Callable[[Any], list[Any]]) -> Callable[..., list]:
    """``found`` for a kind ``jk.jacobian`` returns: ``values(result)``."""

    def found(model, inputs, targets, reduce, **kwargs) -> list[np.ndarray]:
        result = jk.jacobian(model, inputs, targets, reduce=reduce, **kwargs)
        return [np.asarray(v, np.float64) for v in values(result)]

    return found


def _gram_found(model, inputs, targets, reduce, **kwargs) -> list[np.ndarray]:
    result = jk.gram(model, inputs, None, targets, **kwargs)
    return [np.asarray(result.matrix, np.float64)]


def _norms_of_each_target(rows: PerRow, _: Any) -> list[np.ndarray]:
    return [
        np.linalg.norm(g.reshape(*rows.rows_shape, -1), axis=-1) for g in rows.gradients
    ]


def _clip_norm(rows: PerRow) -> jk.ClippedSum:
    """The median row norm: some rows clipped, some not."""
    return jk.ClippedSum(float(np.median(rows.norms)))


def _clipped_sum(rows: PerRow, clipped: jk.ClippedSum) -> list[np.ndarray]:
    """``Σ_r g_r min(1, C / |g_r|)`` per target (each row's norm over every
    target together, or over each of its ``groups``), then every row's
    norm (:func:`clipped_sums`)."""
    sums, norms = clipped_sums(rows, clipped.clip_norm, clipped.groups)
    return [*sums, norms]


def _projection(rows: PerRow, project: jk.Project) -> list[np.ndarray]:
    """``Σ_v M_v g_v`` per row, ``rows_shape + (dim,)``, from the library's own
    maps (:func:`jacobkit.problem.sketch.target_map`: fixed by the seed and
    each target's name and shape) applied to the float64 rows in NumPy."""
    from jacobkit.problem import sketch

    total = np.zeros((rows.num_rows, project.dim))
    for i, name in enumerate(rows.names):
        g = rows.of_target(i)
        m = sketch.target_map(project, name, tuple(g.shape[1:]))
        matrices = g.reshape(rows.num_rows, m.inputs, m.units)
        if not m.kronecker:  # a CountSketch or Gaussian matrix
            total += matrices.reshape(rows.num_rows, -1) @ m.matrix().astype(np.float64)
        else:
            left, right = m.left.astype(np.float64), m.right.astype(np.float64)
            both = np.einsum("ia,rio,ob->rab", left, matrices, right)
            total += both.reshape(rows.num_rows, -1)[:, : m.dim] / np.sqrt(m.dim)
    return [total.reshape(*rows.rows_shape, project.dim)]


#: each kind's case, by the kind's name (``KINDS``)
_CASE_OF_KIND = {
    "rows": ReductionCase(
        "rows",
        None,
        lambda rows: None,
        lambda rows, _: list(rows.gradients),
        _by_jacobian(lambda result: list(result.jacobians.values())),
    ),
    "norm": ReductionCase(
        "norm",
        "norm",
        lambda rows: "norm",
        _norms_of_each_target,
        _by_jacobian(lambda result: list(result.jacobians.values())),
    ),
    "clipped_sum": ReductionCase(
        "clipped_sum",
        jk.ClippedSum,
        _clip_norm,
        _clipped_sum,
        _by_jacobian(lambda result: [*result.jacobians.values(), result.norms]),
    ),
    "project": ReductionCase(
        "project",
        jk.Project,
        lambda rows: jk.Project(16, seed=7),
        _projection,
        _by_jacobian(lambda result: [result.projection]),
    ),
    "factors": ReductionCase(
        "gram",
        KINDS["factors"],
        lambda rows: None,
        lambda rows, _: [rows.flat @ rows.flat.T],
        _gram_found,
    ),
}


def _reduction_case(name: str) -> ReductionCase:
    """The case of a kind the library lists; a kind without a float64
    reference here is a case that fails and says so."""
    if name in _CASE_OF_KIND:
        return _CASE_OF_KIND[name]
    kind = KINDS[name]

    def missing(*_: Any) -> list[np.ndarray]:
        raise AssertionError(
            f"reduction kind {kind!r} has no float64 reference: add one to "
            "tests/cases.py (_CASE_OF_KIND)"
        )

    return ReductionCase(name, kind, lambda rows: None, missing, missing)


#: Every reduction kind the library has (``jacobkit.problem.reduction.KINDS``:
#: the rows themselves, ``"norm"``, ``jk.ClippedSum``, ``jk.Project`` and
#: ``jk.gram``'s factors): a new kind joins the suite by being defined in
#: that package (and fails here until it has a reference).
REDUCTIONS = [_reduction_case(name) for name in KINDS]


def lstm_classifier(batch: int) -> tuple[keras.Model, tuple[np.ndarray, np.ndarray]]:
    """An LSTM(64) over 12 steps of 6 features and a Dense(3) head, with
    ``batch`` examples and integer labels: no closed form for the LSTM's
    kernels (a generic strategy runs it), and its loop keeps 1.5 MiB for its
    gradient at 32 examples, which the traced pass's ops do not show."""
    rng = np.random.default_rng(4)
    keras.utils.set_random_seed(4)
    model = keras.Sequential(
        [
            keras.Input((12, 6)),
            keras.layers.LSTM(64, name="rnn"),
            keras.layers.Dense(3, name="head"),
        ]
    )
    x = rng.normal(size=(batch, 12, 6)).astype("float32")
    return model, (x, rng.integers(0, 3, batch))
