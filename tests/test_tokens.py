"""``explain.token_attribution``: every target position (or class) of a
keras_hub language model against every input token in one call, against
float64 computed the obvious way (a float64 tape per row: each position's
log-probability of its target token, or each class's logit, differentiated
at the token embeddings), on tiny random-init GPT-2, Gemma, Llama and BERT.

Tolerance: 1e-4 of the largest value (the issue's bound); measured at most
2.3e-7 (Llama; float32, oneDNN on).
"""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import tensorflow as tf

import jacobkit as jk
from jacobkit import explain, testing
from jacobkit.explain import CompletenessWarning
from jacobkit.explain.tokens import _log_likelihood, _targets
from jacobkit.keras.lm_head import linear_head
from tests import hub_models
from tests.cases import STRATEGIES

keras = pytest.importorskip("keras")
keras_hub = pytest.importorskip("keras_hub")

B, T, VOCABULARY = 3, 8, 50
SIZES = dict(layers=1, hidden=16, intermediate=32, length=T)
#: the registered strategies, each as auto would configure it
REGISTERED = [c for c in STRATEGIES if c.id in jk.strategies.REGISTRY]


def _tokens(segment: bool = False) -> dict:
    rng = np.random.default_rng(0)
    x = {
        "token_ids": rng.integers(1, VOCABULARY, (B, T)).astype("int32"),
        "padding_mask": np.ones((B, T), "int32"),
    }
    x["padding_mask"][1, 6:] = 0  # the second example is 6 tokens long
    if segment:
        x["segment_ids"] = np.zeros((B, T), "int32")
    return x


@pytest.fixture(scope="module")
def gpt2():
    keras.utils.set_random_seed(0)
    backbone = hub_models.gpt2(VOCABULARY, **SIZES)
    return keras_hub.models.GPT2CausalLM(backbone, preprocessor=None)


@pytest.fixture(scope="module")
def gemma():
    """Gemma: the tied embedding's lookup is scaled by sqrt(hidden_dim)
    before the first block (no Add), RMS norms, grouped attention."""
    keras.utils.set_random_seed(0)
    backbone = hub_models.gemma(VOCABULARY)
    return keras_hub.models.GemmaCausalLM(backbone, preprocessor=None)


@pytest.fixture(scope="module")
def llama():
    """Llama: untied reverse embeddings, its own RMS norms, grouped
    attention with rotary positions."""
    keras.utils.set_random_seed(0)
    backbone = hub_models.llama(VOCABULARY)
    return keras_hub.models.LlamaCausalLM(backbone, preprocessor=None)


@pytest.fixture(scope="module")
def bert():
    keras.utils.set_random_seed(0)
    backbone = hub_models.bert(VOCABULARY, **SIZES)
    return keras_hub.models.BertTextClassifier(
        backbone, num_classes=3, preprocessor=None
    )


def _close(got, want) -> None:
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-4 * np.abs(want).max())


@pytest.mark.parametrize("method", ["gradient", "gradient_x_input"])
@pytest.mark.parametrize("name", ["gpt2", "gemma", "llama"])
def test_causal_lm_equals_float64_per_row(request, name, method):
    model = request.getfixturevalue(name)
    x = _tokens()
    found = explain.token_attribution(model, x, method=method, per_dimension=True)
    assert found.kind == "causal_lm" and found.scores.shape == (B, T - 1, T)
    assert found.embedding == "token_embedding"
    ids, mask = x["token_ids"], x["padding_mask"].astype("float32")
    wanted, weights = _targets(ids, mask, None)
    rows = jk.Loss(_log_likelihood, each=True)
    target = jk.Output(found.embedding)
    want = testing.float64_reference(model, (x, wanted, weights), target, outputs=rows)
    want = np.asarray(want[0])
    _close(found.gradients, want)
    if method == "gradient":
        _close(found.scores, np.linalg.norm(want, axis=-1))
    else:
        embedded = np.asarray(model.backbone.token_embedding(ids))
        _close(found.scores, np.einsum("bktd,btd->bkt", want, embedded))


@pytest.mark.parametrize("case", REGISTERED, ids=lambda c: c.id)
def test_every_strategy_differentiates_the_body_below_its_head(gpt2, case):
    """The rows of a split causal LM (``tokens.HiddenRows``) take each
    row's cotangent from the head in the same pass, held fixed: every
    registered strategy (vectorized, forward mode, the eager loop) against
    float64 through the whole model."""
    x = _tokens()
    strategy = case.make(3)
    if strategy.name in ("batch", "structured"):  # kernels, and no shortcut
        with pytest.raises(ValueError, match="Dense or Conv|no exact shortcut"):
            explain.token_attribution(gpt2, x, strategy=strategy)
        return
    found = explain.token_attribution(gpt2, x, strategy=strategy, per_dimension=True)
    wanted, weights = _targets(x["token_ids"], x["padding_mask"], None)
    rows = jk.Loss(_log_likelihood, each=True)
    want = testing.float64_reference(
        gpt2, (x, wanted, weights), jk.Output("token_embedding"), outputs=rows
    )
    _close(found.gradients, np.asarray(want[0]))


@pytest.mark.parametrize("name", ["gpt2", "gemma", "llama"])
def test_causal_structure_and_padding_give_exact_zeros(request, name):
    x = _tokens()
    found = explain.token_attribution(
        request.getfixturevalue(name), x, per_dimension=True
    )
    later = np.triu(np.ones((T - 1, T), bool), 1)  # input s after target t
    assert np.all(found.gradients[:, later] == 0)
    # example 1 has 6 tokens: its padded inputs, and its rows whose target
    # is padding (rows 5 and 6), are exactly zero
    assert np.all(found.gradients[1, :, 6:] == 0)
    assert np.all(found.gradients[1, 5:] == 0)
    assert np.all(found.scores[0, np.arange(T - 1), np.arange(T - 1)] > 0)


def test_given_targets(gpt2):
    x = _tokens()
    targets = np.roll(x["token_ids"], 3, axis=1)
    found = explain.token_attribution(gpt2, x, targets=targets, per_dimension=True)
    assert found.scores.shape == (B, T, T)
    np.testing.assert_array_equal(found.targets, targets)
    rows = jk.Loss(_log_likelihood, each=True)
    weights = x["padding_mask"].astype("float32")
    target = jk.Output(found.embedding)
    want = testing.float64_reference(gpt2, (x, targets, weights), target, outputs=rows)
    _close(found.gradients, np.asarray(want[0]))


def test_text_classifier_every_class_against_every_token(bert):
    x = _tokens(segment=True)
    found = explain.token_attribution(bert, x, per_dimension=True)
    assert found.kind == "classifier" and found.scores.shape == (B, 3, T)
    target = jk.Output(found.embedding)
    want = testing.float64_reference(bert, x, target, outputs="per_example")
    want = np.asarray(want[0]) * x["padding_mask"][:, None, :, None]
    _close(found.gradients, want)
    assert np.all(found.gradients[1, :, 6:] == 0)


def test_bad_arguments_are_refused(gpt2):
    x = _tokens()
    with pytest.raises(ValueError, match="method='saliency'"):
        explain.token_attribution(gpt2, x, method="saliency")
    with pytest.raises(ValueError, match="integer token ids"):
        explain.token_attribution(gpt2, np.ones((2, 3, 4), "float32"))
    with pytest.raises(ValueError, match="no layer of that name"):
        explain.token_attribution(gpt2, x, embedding="nowhere")
    with pytest.raises(ValueError, match=r"targets=.*one target token per position"):
        explain.token_attribution(gpt2, x, targets=np.ones((B, 2), "int32"))


def test_a_tied_embeddings_output_is_its_lookups(gpt2):
    """The tied embedding runs twice (the lookup, the logits): its Output is
    the lookup's, whose gradient is that of the Add it feeds (token plus
    position embeddings). A layer that runs twice on floats (shared) has no
    one output tensor and is refused."""
    x = _tokens()
    rows = dict(outputs="per_example", strategy="loop")
    found = jk.jacobian(gpt2, x, jk.Output("token_embedding"), **rows)
    added = jk.jacobian(gpt2, x, jk.Output("embeddings_add"), **rows)
    np.testing.assert_array_equal(np.asarray(found[0]), np.asarray(added[0]))
    inputs = keras.Input((4,))
    shared = keras.layers.Dense(4, name="shared")
    model = keras.Model(inputs, shared(shared(inputs)))
    with pytest.raises(ValueError, match="runs 2 times per forward pass"):
        jk.jacobian(model, np.ones((2, 4), "float32"), jk.Output("shared"))


def _row_values(model, x, layer_name, offset, wanted):
    """Each row's log-probability with the tapped layer's output shifted by
    ``offset`` (a forward pass, float64 afterwards)."""
    from jacobkit.keras import graph

    layer = model.backbone.get_layer(layer_name)

    def hook(call, args, kwargs):
        return call(*args, **kwargs) + offset

    logits = graph.LayerTap(model, layer, lookup=True)(x, False, hook)
    logp = tf.nn.log_softmax(tf.cast(logits, tf.float64), axis=-1)[:, : T - 1]
    return np.take_along_axis(logp.numpy(), wanted[..., None], -1)[..., 0]


def test_integrated_gradients_complete_the_path(gpt2):
    """Integrated gradients' completeness: each row's attributions sum to its
    log-probability at the embeddings minus at the baseline (here token 7's
    embedding at every position). Riemann sums of 128 points, ends included:
    measured within 1.8e-3 of the largest difference (3.6e-3 at 64 points,
    1.5e-2 at 16: the Riemann error, about 1 / steps); bound 5e-3."""
    x = _tokens()
    x["padding_mask"][:] = 1
    found = explain.token_attribution(
        gpt2, x, method="integrated_gradients", steps=128, baseline=7, rule="riemann"
    )
    embedding = gpt2.backbone.token_embedding
    e = np.asarray(embedding(x["token_ids"]))
    e0 = np.asarray(embedding(np.full_like(x["token_ids"], 7)))
    wanted = x["token_ids"][:, 1:]
    end = _row_values(gpt2, x, found.embedding, 0.0, wanted)
    begin = _row_values(gpt2, x, found.embedding, e0 - e, wanted)
    change = end - begin
    np.testing.assert_allclose(
        found.scores.sum(-1), change, rtol=0, atol=5e-3 * np.abs(change).max()
    )
    # the reported gap is this one: the same rows (float32 logits, float64
    # afterwards) computed apart, measured 8.7e-15 of the largest change
    np.testing.assert_allclose(
        found.gap, found.scores.sum(-1) - change, atol=1e-5 * np.abs(change).max()
    )
    assert found.baseline == "token 7"


def test_generation_then_every_generated_token_attributed(gpt2):
    prompt = {
        "token_ids": _tokens()["token_ids"][:, :4],
        "padding_mask": np.ones((B, 4), "int32"),
    }
    tokens, found = explain.generate_and_attribute(
        gpt2, prompt, new_tokens=3, per_dimension=True
    )
    assert tokens.shape == (B, 7)
    # greedy decoding, step by step
    grown = prompt["token_ids"]
    for _ in range(3):
        x = {"token_ids": grown, "padding_mask": np.ones_like(grown)}
        following = np.argmax(np.asarray(gpt2(x))[:, -1], axis=-1)
        grown = np.concatenate([grown, following[:, None].astype("int32")], 1)
    np.testing.assert_array_equal(tokens, grown)
    assert found.scores.shape == (B, 3, 7)
    np.testing.assert_array_equal(found.targets, tokens[:, 4:])
    # row j (generating token 4 + j) against float64, nothing from later
    x = {"token_ids": tokens, "padding_mask": np.ones_like(tokens)}
    targets = np.concatenate([tokens[:, 1:], tokens[:, -1:]], 1)
    rows = jk.Loss(_log_likelihood, each=True)
    weights = np.ones(tokens.shape, "float32")
    target = jk.Output(found.embedding)
    want = testing.float64_reference(gpt2, (x, targets, weights), target, outputs=rows)
    _close(found.gradients, np.asarray(want[0])[:, 3:6])
    for j in range(3):
        assert np.all(found.gradients[:, j, 4 + j :] == 0)


def test_plot_tokens_draws_one_example():
    matplotlib = pytest.importorskip("matplotlib")
    matplotlib.use("Agg")
    scores = np.arange(2 * 3 * 4, dtype=float).reshape(2, 3, 4)
    found = explain.TokenAttribution(scores, None, "causal_lm", "gradient", "e", None)
    fig = explain.plot_tokens(found, example=1, tokens=["a", "b", "c", "d"])
    ax = fig.axes[0]
    assert [t.get_text() for t in ax.get_xticklabels()] == ["a", "b", "c", "d"]
    np.testing.assert_array_equal(ax.images[0].get_array(), scores[1])
    with pytest.raises(ValueError, match="3 strings for 4"):
        explain.plot_tokens(found, tokens=["a", "b", "c"])


@pytest.mark.parametrize("strategy", ["auto", "loop", "batch"])
def test_a_tied_embeddings_gradient_sums_both_calls(gpt2, strategy):
    """The tied table's per-example gradient has the lookup's part and the
    logits' part; every strategy equals float64. ``batch`` sums the two
    calls' closed forms (issue 49: it refused before, the table, Keras's own
    ``ReversibleEmbedding``, falling to the plain ``Embedding`` rule, whose
    lookup was computed on the reverse call's hidden states)."""
    x = _tokens()
    y = np.roll(x["token_ids"], -1, axis=1)
    loss = jk.Loss(
        keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction=None)
    )
    layer = "token_embedding"
    found = jk.jacobian(gpt2, (x, y), layer, outputs=loss, strategy=strategy)
    want = testing.float64_reference(gpt2, (x, y), layer, outputs=loss)
    _close(np.asarray(found[0]), np.asarray(want[0]))


@pytest.mark.parametrize("name", ["gpt2", "gemma", "llama"])
def test_a_causal_lm_is_split_at_its_tied_head(request, name):
    """keras_hub's causal LMs are ``token_embedding(backbone(x),
    reverse=True)``: token attribution differentiates the backbone alone,
    from each row's cotangent at the hidden states (what the float64
    comparisons above check the values of)."""
    model = request.getfixturevalue(name)
    split = linear_head(model)
    assert split is not None
    assert split.body is model.backbone
    assert split.head is model.backbone.token_embedding
    assert split.kwargs == (("reverse", True),)
    x = _tokens()
    hidden = model.backbone(x)
    np.testing.assert_allclose(
        split.logits(hidden), model(x), rtol=0, atol=1e-5 * np.abs(model(x)).max()
    )


def test_a_model_without_a_head_over_a_body_is_not_split(bert):
    """A classifier's head reads a pooled, dropped-out state (not a body's
    one output), and a Sequential's head reads a layer: both run whole."""
    assert linear_head(bert) is None
    sequential = keras.Sequential(
        [
            keras.Input((T,), dtype="int32"),
            keras.layers.Embedding(VOCABULARY, 4),
            keras.layers.Dense(VOCABULARY),
        ]
    )
    assert linear_head(sequential) is None


def _path_reference64(model, x, start, weights, alphas=None):
    """float64, the obvious way: at each point ``e0 + a (e - e0)`` of the path,
    a tape through a float64 copy of ``model`` (its embedding's output
    shifted), each row's gradient at the shifted embeddings (row ``k``
    summed over the examples, which do not mix: each example's own); the
    weighted sum times ``(e - e0)`` summed over the embedding, and every row
    at both ends: ``(scores, f(e), f(e0))``. The points ``alphas`` (default
    ``linspace(0, 1, len(weights))``)."""
    from jacobkit.keras import graph

    model64 = testing.float64_copy(model)
    layer = model64.backbone.token_embedding
    tap = graph.LayerTap(model64, layer, lookup=True)
    e = np.asarray(layer(x["token_ids"]), np.float64)
    e0 = start.astype(np.float64)
    wanted = x["token_ids"][:, 1:]

    def rows(offset):
        def hook(call, args, kwargs):
            return call(*args, **kwargs) + offset

        logp = tf.nn.log_softmax(tap(x, False, hook), axis=-1)[:, : T - 1]
        return tf.gather(logp, wanted, batch_dims=2)  # (B, T - 1)

    if alphas is None:
        alphas = np.linspace(0.0, 1.0, len(weights))
    mean = 0.0
    for a, w in zip(alphas, weights, strict=True):
        offset = tf.constant(-(1 - a) * (e - e0))
        with tf.GradientTape(persistent=True) as tape:
            tape.watch(offset)
            values = rows(offset)
            summed = tf.unstack(tf.reduce_sum(values, axis=0))  # no mixing
        grads = [tape.gradient(row, offset) for row in summed]
        mean = mean + w * np.stack([g.numpy() for g in grads], axis=1)
    scores = np.einsum("bktd,btd->bkt", mean, e - e0)
    return scores, rows(0.0).numpy(), rows(tf.constant(e0 - e)).numpy()


def _gemma_ig(gemma, steps, **kwargs):
    x = _tokens()
    x["padding_mask"][:] = 1
    with warnings.catch_warnings(record=True):  # a few steps: a large gap
        warnings.simplefilter("always")
        found = explain.token_attribution(
            gemma, x, method="integrated_gradients", steps=steps, **kwargs
        )
    assert np.isfinite(found.scores).all() and np.isfinite(found.gap).all()
    return x, found


def test_gemma_default_baseline_is_rms_safe_and_complete(gemma):
    """On an RMS-normalized model the default baseline is the pad token's
    embedding scaled to each position's RMS (see ``explain.token_paths``).
    The gap is the float64 reference's on the same path (the default
    Gauss-Legendre rule, 4 points, from scipy's roots), and the attributions
    sum to f(e) - f(e0) within it."""
    from scipy.special import roots_legendre

    x, found = _gemma_ig(gemma, 4)
    assert found.baseline == "pad token 0, scaled to each position's RMS"
    e = np.asarray(gemma.backbone.token_embedding(x["token_ids"]))
    pad = np.asarray(gemma.backbone.token_embedding(np.zeros((1, 1), "int32")))[0, 0]
    rms = lambda v: np.sqrt(np.mean(np.square(v), -1, keepdims=True))  # noqa: E731
    start = pad / rms(pad) * rms(e)
    nodes, weights = roots_legendre(4)
    scores, end, begin = _path_reference64(
        gemma, x, start, weights / 2, (1 + nodes) / 2
    )
    change = end - begin
    # float32 against float64, the same path and weights: measured 2.6e-7 of
    # the largest change (scores), 3.5e-7 (gap); 1e-4 allowed
    bound = 1e-4 * np.abs(change).max()
    np.testing.assert_allclose(found.scores, scores, rtol=0, atol=bound)
    np.testing.assert_allclose(found.gap, scores.sum(-1) - change, atol=bound)
    # completeness within the measured gap (its float32 error aside)
    sums = found.scores.sum(-1)
    assert np.all(np.abs(sums - change) <= np.abs(found.gap) + bound)


@pytest.mark.slow
def test_gemma_gap_shrinks_with_steps_and_a_zero_baseline_warns(gemma):
    """The default baseline's gap shrinks as steps grow (the Riemann mean's
    1 / steps: measured largest gap 0.46 at 4 steps, 0.10 at 16, 4.6x).
    A zero embedding makes RMSNorm's gradient 1 / sqrt(eps) at the path's
    start: measured gap 1.3e5 x the largest change at 2 steps (3.3e4 at 8,
    8.3e3 at 32), asserted > 100, with a warning that names the baseline.
    (Three calls, each tracing its own path: 15 s on a loaded machine.)"""
    small, large = (
        np.abs(_gemma_ig(gemma, s, rule="riemann")[1].gap).max() for s in (16, 4)
    )
    assert small < large / 3, (small, large)
    x = _tokens()
    x["padding_mask"][:] = 1
    with pytest.warns(
        CompletenessWarning, match="baseline is zeros; try baseline='pad'"
    ):
        zeros = explain.token_attribution(
            gemma,
            x,
            method="integrated_gradients",
            steps=2,
            baseline="zeros",
            rule="riemann",  # its points include the start, where it is steep
        )
    assert np.isfinite(zeros.scores).all()
    zero_change = np.abs(zeros.scores.sum(-1) - zeros.gap)
    assert np.abs(zeros.gap).max() > 100 * zero_change.max()


@pytest.mark.parametrize("name", ["gpt2", "gemma", "llama", "bert"])
def test_the_auto_baseline_is_the_scaled_pad_token_where_rms_norms_are(request, name):
    """``baseline="auto"``: zeros where a position embedding is added before
    the first normalization (GPT-2, BERT), the pad token's embedding scaled
    to each position's RMS on RMS-normalized models (Gemma, Llama). No model
    call: the embeddings alone."""
    from jacobkit.explain.token_paths import baseline_embeddings

    model = request.getfixturevalue(name)
    layer = model.backbone.token_embedding
    embedded = np.asarray(layer(_tokens()["token_ids"]))
    start, described = baseline_embeddings(model, layer, embedded, "auto")
    if name in ("gpt2", "bert"):
        assert described == "zeros" and not start.any()
        return
    assert described == "pad token 0, scaled to each position's RMS"
    rms = lambda v: np.sqrt(np.mean(np.square(v, dtype=np.float64), -1))  # noqa: E731
    np.testing.assert_allclose(rms(start), rms(embedded), rtol=1e-6)
    pad = np.asarray(layer(np.zeros((1, 1), "int32")))[0, 0]
    cosine = start @ pad / (np.linalg.norm(start, axis=-1) * np.linalg.norm(pad))
    np.testing.assert_allclose(cosine, 1.0, rtol=1e-6)


def _plans_of_each_call(monkeypatch) -> list:
    """The plan of every ``jacobian`` call that follows, in order (through the
    ``api`` module, as ``explain`` calls it), with no measurements read from
    or written to the cache: this process's own."""
    from jacobkit import api

    monkeypatch.setenv("JACOBKIT_CACHE_DIR", "")
    plans = []
    real = api.jacobian

    def keeping_plans(*args, **kwargs):
        result = real(*args, **kwargs)
        plans.append(result.plan)
        return result

    monkeypatch.setattr(api, "jacobian", keeping_plans)
    return plans


def test_auto_starts_token_attribution_vectorized(monkeypatch):
    """Given its prior, ``auto``'s first call of token attribution runs
    every row at once by ``chunked``: a vectorized row holds its own
    backward tensors, not a forward pass's activations, so its predicted
    peak is within ``Policy.start_peak_factor`` of ``while``'s plus
    ``start_slack_bytes`` (the benchmark's GPT-2: ``chunked(32)`` predicted
    at 33.6 MiB against 7.3, measured 28.6 and 3.7; it was predicted at
    201 MiB and never tried). That GPT-2 and rows: 32 rows, over
    ``while``'s 10 in flight (at or under them, both compute every row at
    once, and the cheaper to trace starts)."""
    keras.utils.set_random_seed(0)
    backbone = hub_models.gpt2(
        1000, layers=2, hidden=64, intermediate=128, length=128, heads=4
    )
    gpt2 = keras_hub.models.GPT2CausalLM(backbone, preprocessor=None)
    ids = np.random.default_rng(0).integers(1, 1000, (1, 96)).astype("int32")
    x = {"token_ids": ids, "padding_mask": np.ones_like(ids)}
    plans = _plans_of_each_call(monkeypatch)
    explain.token_attribution(
        gpt2, x, positions=(63, 95), targets=ids, memory_budget="256MiB"
    )
    (run,) = plans[-1].last_call
    assert run.strategy.name == "chunked", plans[-1].summary()
    assert run.strategy.rows_at_once(run.rows) == run.rows == plans[-1].num_rows


def test_auto_ends_on_the_strategy_its_own_probes_measured_fastest(monkeypatch):
    """``auto``'s decision on token attribution (rows of a tensor target,
    the embeddings' output, below the head): every candidate tried as soon
    as the current rate is known (``rent=0``), it settles on the one its
    own probes measured fastest, beyond the policy's noise (the decision
    logic, no clock limit). ``batch`` has no closed form of a tensor: it is
    left out before it runs (it was tried after every other candidate, so
    such a session never settled). A model of its own: where another test
    compiled a strategy for the same problem, auto's first call traces
    nothing (its trace is then its computation's first call's,
    ``Probe.first_call_s``)."""
    from jacobkit import planner

    keras.utils.set_random_seed(0)
    backbone = hub_models.gpt2(VOCABULARY, **SIZES)
    gpt2 = keras_hub.models.GPT2CausalLM(backbone, preprocessor=None)

    plans = _plans_of_each_call(monkeypatch)
    with planner.use_policy(rent=0.0) as policy:
        for _ in range(10):
            explain.token_attribution(gpt2, _tokens())
            if plans[-1].settled:
                break
    plan = plans[-1]
    assert plan.settled, plan.summary()
    assert "batch" in {r.label for r in plan.rejected}
    assert all(s.new.name != "batch" for s in plan.switches), plan.summary()
    measured = [e for e in plan.estimates if e.seconds_per_row is not None]
    assert {e.strategy.name for e in measured} >= {"while", "chunked"}
    chosen = plan.estimate(plan.strategy)
    assert chosen is not None and chosen.seconds_per_row is not None
    for other in measured:
        assert other.seconds_per_row is not None
        assert chosen.seconds_per_row <= policy.noise * other.seconds_per_row, (
            plan.summary()
        )
