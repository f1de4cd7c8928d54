"""``reduce=jk.Project``: the map is fixed by the seed and each target's key
(the same rows from any batching, order or resumed ``out=``), and its inner
products are those of the exact gradients in expectation, with the variance
the theory gives (``jacobkit.problem.sketch``).

The statistics are taken over 400 seeds of the map, on real per-example loss
gradients of a Dense kernel (each one rank 1: ``a δᵀ``), compared with
formulas for that case. Bounds are set from measured values (written beside
each) with room for the sampling error of a 400-seed variance (about ±7%
for the dense map; the Kronecker map's products are heavier tailed).
"""

from __future__ import annotations

import math

import keras
import numpy as np
import pytest
import tensorflow as tf

import jacobkit as jk
from jacobkit import testing
from jacobkit.problem import sketch
from tests.test_gram import _vocabulary
from tests.test_reductions import LOSS, _per_example, _wide

SEEDS = 400
DIM = 64  # a square: every coordinate of the 8 x 8 Kronecker product is kept


@pytest.fixture(scope="module")
def wide_gradients():
    """The ``wide`` Dense kernel's 5 per-example gradients, float64 ``(5, 64,
    256)``, and each one's rank-1 factors ``a (5, 64)``, ``δ (5, 256)``."""
    model, inputs = _wide()
    grads, _ = _per_example(model, inputs)
    paths = [v.path for v in model.trainable_variables]
    kernel = grads[[p.endswith("wide/kernel") for p in paths].index(True)]
    a, d = [], []
    for g in kernel:
        u, s, vt = np.linalg.svd(g)
        assert s[1] < 1e-9 * s[0], "a Dense kernel's gradient of one example"
        a.append(u[:, 0] * s[0])
        d.append(vt[0])
    return kernel, np.array(a), np.array(d)


def _inner_products(kernel, kind: str) -> np.ndarray:
    """``<M g_i, M g_j>`` for every pair, for each of SEEDS maps: ``(S, 5, 5)``."""
    flat = kernel.reshape(len(kernel), -1)
    found = []
    for seed in range(SEEDS):
        m = _map(kind, seed, kernel.shape[1:])
        if not m.kronecker:  # a Gaussian or CountSketch matrix
            p = flat @ m.matrix().astype(np.float64)
        else:
            left, right = m.left.astype(np.float64), m.right.astype(np.float64)
            p = np.einsum("ia,rio,ob->rab", left, kernel, right).reshape(len(flat), -1)
            p = p[:, :DIM] / math.sqrt(DIM)
        found.append(p @ p.T)
    return np.array(found)


def _map(kind: str, seed: int, shape) -> sketch.TargetMap:
    """The map jacobkit draws for ``wide/kernel``, forced small (``"dense"``:
    Gaussian, or ``"countsketch"``) or Kronecker."""
    limit = 0 if kind == "kronecker" else 10**12
    small = "gaussian" if kind == "dense" else "countsketch"
    original = sketch.DENSE_ELEMENTS
    try:
        sketch.DENSE_ELEMENTS = limit
        project = jk.Project(DIM, seed=seed, small=small)
        m = sketch.target_map(project, "wide/kernel", shape)
    finally:
        sketch.DENSE_ELEMENTS = original
    assert m.kronecker == (kind == "kronecker")
    assert m.sparse == (kind == "countsketch")
    return m


def _theory(kind: str, a: np.ndarray, d: np.ndarray) -> np.ndarray:
    """The variance of ``<M g_i, M g_j>`` for ``g = a δᵀ``:

    - dense: ``(<g,h>² + |g|²|h|²) / dim``;
    - CountSketch: ``(<g,h>² + |g|²|h|² - 2 Σ_k g_k² h_k²) / dim``;
    - Kronecker, every coordinate kept (dim = s²): the product ``X Y`` of two
      independent dense sketches of size ``s``, of ``<a_i, a_j>`` and
      ``<δ_i, δ_j>``: ``Var X Var Y + Var X (E Y)² + Var Y (E X)²``.
    """
    aa, dd = a @ a.T, d @ d.T
    exact = aa * dd
    if kind == "dense":
        return (exact**2 + np.outer(np.diag(exact), np.diag(exact))) / DIM
    if kind == "countsketch":  # Σ_k g_k² h_k² of the rank-1 grids, (a²)(δ²)ᵀ
        fourth = (a**2 @ (a**2).T) * (d**2 @ (d**2).T)
        gaussian = (exact**2 + np.outer(np.diag(exact), np.diag(exact))) / DIM
        return gaussian - 2 * fourth / DIM
    side = math.isqrt(DIM)
    var_a = (aa**2 + np.outer(np.diag(aa), np.diag(aa))) / side
    var_d = (dd**2 + np.outer(np.diag(dd), np.diag(dd))) / side
    return var_a * var_d + var_a * dd**2 + var_d * aa**2


@pytest.mark.parametrize("kind", ["dense", "countsketch", "kronecker"])
def test_inner_products_are_unbiased_with_the_theorys_variance(wide_gradients, kind):
    kernel, a, d = wide_gradients
    exact = np.einsum("iab,jab->ij", kernel, kernel)
    found = _inner_products(kernel, kind)
    mean, var = found.mean(0), found.var(0, ddof=1)
    # unbiased: the mean of 400 maps within 4 standard errors of the exact
    # inner product (measured: at most 1.0 standard error)
    np.testing.assert_array_less(np.abs(mean - exact), 4 * np.sqrt(var / SEEDS))
    ratio = var / _theory(kind, a, d)
    # measured over the 25 pairs: dense 0.86-1.02, CountSketch 0.90-1.06
    # (its mean within 1.4 standard errors), Kronecker 0.81-1.01
    assert ratio.min() > 0.7 and ratio.max() < 1.4, ratio


def test_countsketch_variance_formula_and_bound(wide_gradients):
    """The CountSketch's variance in closed form (``_theory``) equals the
    sum it comes from, ``Σ_{i≠j} (g_i² h_j² + g_i h_i g_j h_j) / dim``,
    computed term by term on random vectors; and it is at most the Gaussian
    map's on the real gradients (by the formulas: 0.9998-0.9999 of it over
    these pairs: 16,384 coordinates spread out, ``Σ_k g_k² h_k²`` is small
    beside ``|g|² |h|²``; the bound is tight for spread-out gradients, the
    gain is for concentrated ones)."""
    rng = np.random.default_rng(0)
    g, h = rng.standard_normal((2, 40))
    outer = np.outer(g**2, h**2) + np.outer(g * h, g * h)
    direct = (outer.sum() - np.trace(outer)) / DIM
    closed = ((g @ h) ** 2 + (g @ g) * (h @ h) - 2 * np.sum(g**2 * h**2)) / DIM
    np.testing.assert_allclose(closed, direct, rtol=1e-12)
    kernel, a, d = wide_gradients
    ratio = _theory("countsketch", a, d) / _theory("dense", a, d)
    assert ratio.max() <= 1 and ratio.min() > 0.99, ratio


def test_kronecker_variance_is_larger_than_dense(wide_gradients):
    """The price of never forming the gradient: for rank-1 gradients the
    Kronecker map's variance is up to about ``2 sqrt(dim)`` times the dense
    map's (by the formulas: 11-18× over these pairs at dim 64; measured over
    300 seeds: 9-15× at dim 64, 18-32× at dim 256)."""
    kernel, a, d = wide_gradients
    ratio = _theory("kronecker", a, d) / _theory("dense", a, d)
    assert ratio.min() > 4 and ratio.max() < 4 * math.sqrt(DIM), ratio


def test_projected_gram_follows_the_exact_one():
    """One map of dim 2,048, through jacobkit's own path (a Kronecker map on
    the conv and wide kernels, dense maps on the rest), against the exact
    Gram matrix of the loss gradients. Measured: off-diagonal correlation
    0.9999, squared-norm ratios 1.03-1.10."""
    model, inputs = _wide()
    _, flat = _per_example(model, inputs)
    exact = flat @ flat.T
    result = jk.jacobian(
        model,
        inputs,
        model.trainable_variables,
        outputs=LOSS,
        reduce=jk.Project(2048, seed=0),
    )
    p = np.asarray(result.projection, np.float64)
    projected = p @ p.T
    off = ~np.eye(len(p), dtype=bool)
    correlation = np.corrcoef(projected[off], exact[off])[0, 1]
    norms = np.diag(projected) / np.diag(exact)
    assert correlation > 0.95, correlation
    assert np.all(np.abs(norms - 1) < 0.25), norms


@pytest.mark.parametrize("strategy", ["batch", "loop"])
def test_the_same_rows_from_any_batching_order_and_resume(strategy, tmp_path):
    model, inputs = _wide()
    project = jk.Project(512, seed=3)
    variables = model.trainable_variables

    def projected(data, **kwargs):
        result = jk.jacobian(
            model,
            data,
            variables,
            outputs=LOSS,
            reduce=project,
            strategy=strategy,
            **kwargs,
        )
        return np.asarray(result.projection)

    whole = projected(inputs)
    twos = projected(tf.data.Dataset.from_tensor_slices(inputs).batch(2))
    order = np.array([4, 2, 0, 3, 1])
    shuffled = projected(tuple(x[order] for x in inputs))
    stored = projected(
        tf.data.Dataset.from_tensor_slices(inputs).batch(3), out=tmp_path / "p"
    )
    resumed = projected(
        tf.data.Dataset.from_tensor_slices(inputs).batch(3), out=tmp_path / "p"
    )
    scale = np.abs(whole).max()
    for other in (twos, shuffled[np.argsort(order)], stored, resumed):
        # measured: at most 2.3e-7 of the largest entry (float32 sums in
        # another order; 0 for most)
        np.testing.assert_allclose(other, whole, rtol=0, atol=1e-5 * scale)


def test_an_embeddings_lookup_is_projected_from_its_ids():
    """A Kronecker map of an embedding's rows (300 x 16 at dim 1,024: over
    sketch.DENSE_ELEMENTS) takes the left factor's rows at the ids: equal to
    the map of the formed float64 tables, and to the loop strategy's."""
    model, inputs = _vocabulary()
    table = model.get_layer("embed").embeddings
    project = jk.Project(1024, seed=2)
    found = jk.jacobian(model, inputs, [table], outputs=LOSS, reduce=project)
    looped = jk.jacobian(
        model, inputs, [table], outputs=LOSS, reduce=project, strategy="loop"
    )
    mapped = sketch.target_map(project, "embed/embeddings", tuple(table.shape))
    assert mapped.kronecker
    (exact,) = testing.float64_reference(model, inputs, [table], outputs=LOSS)
    want = np.asarray(mapped.of_flat(tf.constant(np.asarray(exact, np.float32))))
    scale = np.abs(want).max()
    # measured: 2.4e-7 of the largest entry (float32 against float64 tables)
    np.testing.assert_allclose(found.projection, want, rtol=0, atol=1e-5 * scale)
    np.testing.assert_allclose(looped.projection, want, rtol=0, atol=1e-5 * scale)


def test_a_position_tables_rows_are_projected_at_its_positions():
    """keras_hub's ``PositionEmbedding`` (a 128 x 32 table under sequences of
    9, a Kronecker map at dim 2,048) is a lookup of the positions: the left
    factor's rows at them, equal to the map of the formed float64 tables
    (zero beyond the sequence)."""
    keras_hub = pytest.importorskip("keras_hub")
    keras.utils.set_random_seed(5)
    ids = keras.Input((9,), dtype="int32")
    h = keras.layers.Embedding(50, 32, name="embed")(ids)
    h = h + keras_hub.layers.PositionEmbedding(128, name="positions")(h)
    h = keras.layers.GlobalAveragePooling1D()(keras.layers.Dense(8, "tanh")(h))
    model = keras.Model(ids, keras.layers.Dense(3, name="head")(h))
    rng = np.random.default_rng(5)
    inputs = (rng.integers(0, 50, (6, 9)).astype("int32"), rng.integers(0, 3, 6))
    table = model.get_layer("positions").position_embeddings
    project = jk.Project(2048, seed=3)
    found = jk.jacobian(model, inputs, [table], outputs=LOSS, reduce=project)
    mapped = sketch.target_map(project, table.path, tuple(table.shape))
    assert mapped.kronecker
    (exact,) = testing.float64_reference(model, inputs, [table], outputs=LOSS)
    want = np.asarray(mapped.of_flat(tf.constant(np.asarray(exact, np.float32))))
    scale = np.abs(want).max()
    # measured: 2.1e-7 of the largest entry (float32 against float64 tables)
    np.testing.assert_allclose(found.projection, want, rtol=0, atol=1e-5 * scale)


#: the layers whose kernels ``ConvRule.unfold_times`` maps
_CONVOLUTIONS = {
    "conv1d": keras.layers.Conv1D,
    "conv2d": keras.layers.Conv2D,
    "separable": keras.layers.SeparableConv2D,
}


@pytest.mark.parametrize(
    "conv",
    [
        dict(filters=16, kernel_size=3, strides=2, padding="same"),
        dict(filters=16, kernel_size=(2, 3), dilation_rate=2, padding="valid"),
        dict(
            filters=32, kernel_size=3, padding="causal", dilation_rate=2, kind="conv1d"
        ),
        dict(filters=96, kernel_size=3, padding="same", kind="separable"),
    ],
    ids=["strided-same", "dilated-valid", "causal-conv1d", "separable"],
)
def test_a_convolutions_patches_are_mapped_by_a_convolution(conv):
    """A convolution's Kronecker projection convolves its input with the
    left factor (``ConvRule.unfold_times``) instead of unfolding it: equal
    to the map of the formed float64 per-example gradients, for strides,
    dilation, SAME and causal padding, and a separable convolution's
    pointwise half (a 1x1 convolution: it convolved with the layer's 3x3
    window, and Xception's projection failed)."""
    conv = dict(conv)
    kind = conv.pop("kind", "conv2d")
    layer_class = _CONVOLUTIONS[kind]
    shape = (9, 24) if kind == "conv1d" else (9, 8, 24)
    inputs = keras.Input(shape)
    h = layer_class(**conv, activation="tanh", name="conv")(inputs)
    h = keras.layers.Flatten()(h)
    model = keras.Model(inputs, keras.layers.Dense(2, name="head")(h))
    rng = np.random.default_rng(4)
    x = rng.normal(size=(3, *shape)).astype("float32")
    layer = model.get_layer("conv")
    project = jk.Project(2048, seed=5)
    found = jk.jacobian(model, x, layer, strategy="batch", reduce=project)
    variables = layer.trainable_weights
    exact = testing.float64_reference(model, x, variables)
    # the kernel (a separable layer's pointwise kernel, 24 x 96) takes a
    # Kronecker map at dim 2,048, the other variables dense ones
    separable = isinstance(layer, keras.layers.SeparableConv2D)
    factored = layer.pointwise_kernel if separable else layer.kernel
    want = 0
    for name, variable, rows in zip(found.jacobians, variables, exact, strict=True):
        mapped = sketch.target_map(project, name, tuple(variable.shape))
        assert mapped.kronecker == (variable is factored), name
        rows = np.asarray(rows, np.float32).reshape(-1, *variable.shape)
        want = want + np.asarray(mapped.of_flat(tf.constant(rows)))
    scale = np.abs(want).max()
    # measured: at most 6.3e-7 of the largest entry (the separable layer's:
    # 3.4e-7)
    np.testing.assert_allclose(
        np.reshape(found.projection, want.shape), want, rtol=0, atol=1e-5 * scale
    )


@pytest.mark.parametrize(
    "kind, shape",
    [
        ("kronecker", (64, 4, 16)),  # units < inputs: Lᵀ first
        ("kronecker", (3, 40)),  # units >= inputs: R first
        ("dense", (8, 16)),  # fewer rows than TRANSPOSED_ELEMENTS
        ("dense", (32, 64)),  # as many as BERT's position table: (Mᵀ gᵀ)ᵀ
        ("countsketch", (8, 16)),
        ("countsketch", (32, 64)),
    ],
)
def test_of_flat_is_the_map_applied(kind, shape):
    """``TargetMap.of_flat`` of formed gradients against the map applied the
    obvious way in float64: ``g M`` (dense) or ``vec(Lᵀ G R)[:dim] /
    sqrt(dim)`` (Kronecker), for each order of the Kronecker factors and
    each layout of the dense map. Measured: float64 within 5e-15 of the
    reference (relative to its largest entry; 1.7e-8 while the scale went
    through float32), float32 within 5.5e-7."""
    m = _map(kind, 0, shape)
    rows = np.random.default_rng(1).standard_normal((7, *shape))
    flat = rows.reshape(7, -1)
    if kind == "dense":
        assert (flat.shape[1] >= sketch.TRANSPOSED_ELEMENTS) == (shape == (32, 64))
        want = flat @ m.dense.astype(np.float64)
    elif kind == "countsketch":  # each coordinate times its sign, to its bucket
        assert m.buckets.min() >= 0 and m.buckets.max() < DIM
        assert set(np.unique(m.signs)) == {-1.0, 1.0}
        want = np.zeros((7, DIM))
        for i, (bucket, sign) in enumerate(zip(m.buckets, m.signs, strict=True)):
            want[:, bucket] += sign * flat[:, i]
    else:
        left, right = m.left.astype(np.float64), m.right.astype(np.float64)
        grid = flat.reshape(7, m.inputs, m.units)
        want = np.einsum("ia,rio,ob->rab", left, grid, right).reshape(7, -1)
        want = want[:, :DIM] / math.sqrt(DIM)
    scale = np.abs(want).max()
    for dtype, tolerance in ((tf.float64, 1e-13), (tf.float32, 3e-6)):
        found = np.asarray(m.of_flat(tf.constant(rows, dtype)), np.float64)
        assert found.shape == (7, DIM)
        np.testing.assert_allclose(found, want, rtol=0, atol=tolerance * scale)


def test_a_store_of_gaussian_projections_resumes_only_with_gaussian_maps(tmp_path):
    """``out=`` keys on ``repr(reduce)``: ``small="gaussian"`` keeps the repr
    of the versions whose small maps were Gaussian (``Project(dim=64,
    seed=0)``), so their stores resume with it; the CountSketch default's
    differs, and mixing the two is refused."""
    assert repr(jk.Project(64, small="gaussian")) == "Project(dim=64, seed=0)"
    assert repr(jk.Project(64)) == "Project(dim=64, seed=0, small='countsketch')"
    model, inputs = _wide()
    data = tf.data.Dataset.from_tensor_slices(inputs).batch(3)

    def projected(small):
        return jk.jacobian(
            model,
            data,
            model.trainable_variables,
            outputs=LOSS,
            reduce=jk.Project(64, small=small),
            out=tmp_path / "p",
        ).projection

    stored = np.asarray(projected("gaussian"))
    np.testing.assert_array_equal(np.asarray(projected("gaussian")), stored)
    with pytest.raises(ValueError, match="holds the results of another call"):
        projected("countsketch")
