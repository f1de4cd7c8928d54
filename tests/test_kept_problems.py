"""A steady call reuses what the call before it derived from the same
arguments (its :class:`~jacobkit.problem.Problem`, kept per model and input
signature by ``Call.problem``) and runs its compiled computation's trace
directly (:class:`jacobkit.problem.cache.Dispatched`). Each change that
changes the answer must be noticed: another batch size or dtype, the
``training=`` flag, another ``reduce=``, new weights, a layer made
non-trainable or given new variables, two threads at once. Every result is
held to a float64 reference computed the obvious way (one tape gradient per
example on a float64 copy).

Tolerance (measured on this suite's MLP, every test here): the float32
results differ from the float64 reference by at most 1.8e-7 of the largest
value with oneDNN on, 3.6e-7 with it off;
``RTOL = 1e-5`` of it leaves room, and is far below every change tested
(each changes the answer by more than 1e-2 of it, checked)."""

from __future__ import annotations

import threading

import keras
import numpy as np
import pytest
import tensorflow as tf

import jacobkit as jk
from jacobkit.problem import Call
from jacobkit.problem.cache import Dispatched, signature

RTOL = 1e-5
LOSS = keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction=None)


def _mlp(dtype="float32", norm=False, seed=0):
    """Dense(6, tanh) [-> BatchNormalization] -> Dense(3, "head"), the
    hidden layers inside a block (a layer of layers) when ``norm``."""
    keras.utils.set_random_seed(seed)
    inner = [keras.layers.Dense(6, activation="tanh", dtype=dtype, name="hidden")]
    if norm:
        inner.append(keras.layers.BatchNormalization(dtype=dtype, name="norm"))
    block = keras.Sequential(inner, name="block")
    head = keras.layers.Dense(3, dtype=dtype, name="head")
    inputs = keras.Input((4,), dtype=dtype)
    return keras.Model(inputs, head(block(inputs)))


def _copy64(model, norm=False):
    """``model`` in float64, its weights the same values."""
    wide = _mlp("float64", norm)
    wide.set_weights([np.asarray(w, np.float64) for w in model.get_weights()])
    return wide


def _data(batch, seed=1, labels="int64"):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(batch, 4)).astype("float32")
    return x, rng.integers(0, 3, size=batch).astype(labels)


def _per_example(model, x, y, variables, training=False):
    """Each example's loss gradient, float64, one tape per example (the
    batch's forward pass each time: batch statistics with ``training``)."""
    x64 = tf.constant(x, tf.float64)
    rows = []
    for i in range(len(x)):
        with tf.GradientTape() as tape:
            out = model(x64, training=training)
            loss = LOSS(y[i : i + 1], out[i : i + 1])[0]
        rows.append([g.numpy() for g in tape.gradient(loss, variables)])
    return [np.stack(parts) for parts in zip(*rows, strict=True)]


def _wide_variables(model, wide, variables):
    """The float64 copy's variables at the positions of ``variables`` among
    the model's weights."""
    ids = [id(v) for v in model.weights]
    return [wide.weights[ids.index(id(v))] for v in variables]


def _reference(model, x, y, variables, reduce=None, training=False, norm=False):
    """The float64 answer of ``jacobian(model, (x, y), variables,
    outputs=jk.Loss(LOSS), reduce=reduce)``: per-example gradients, or their
    clipped sum."""
    wide = _copy64(model, norm)
    grads = _per_example(wide, x, y, _wide_variables(model, wide, variables), training)
    if reduce is None:
        return grads
    flat = np.concatenate([g.reshape(len(x), -1) for g in grads], axis=1)
    scales = np.minimum(1.0, reduce.clip_norm / np.linalg.norm(flat, axis=1))
    return [np.tensordot(scales, g, 1) for g in grads]


def _close(found, want):
    found = [np.asarray(f) for f in found]
    scale = max(np.abs(w).max() for w in want)
    for f, w in zip(found, want, strict=True):
        np.testing.assert_allclose(f, w, rtol=0, atol=RTOL * scale)


def _far(a, b):
    """The answers differ by more than 1e-2 of the largest value."""
    scale = max(np.abs(w).max() for w in b)
    assert max(np.abs(np.asarray(f) - w).max() for f, w in zip(a, b, strict=True)) > (
        1e-2 * scale
    )


def _jacobian(model, x, y, variables, reduce=None, training=False):
    result = jk.jacobian(
        model,
        (x, y),
        variables,
        outputs=jk.Loss(LOSS),
        reduce=reduce,
        training=training,
    )
    return list(result.jacobians.values())


def _steady(model, x, y, variables, **options):
    """Three calls (the first traces, the last two are steady): the last
    one's answer, each checked against the first's."""
    first = _jacobian(model, x, y, variables, **options)
    for _ in range(2):
        again = _jacobian(model, x, y, variables, **options)
        for a, b in zip(again, first, strict=True):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    return again


CHANGES = ["batch size", "label dtype", "reduce", "clip", "weights"]


@pytest.mark.parametrize("change", CHANGES)
def test_a_steady_call_notices_what_changes_its_answer(change):
    """Steady calls, then one argument, input or weight changed: the steady
    calls after it give the float64 answer of the change, which differs
    from the answer before it."""
    model = _mlp()
    variables = model.trainable_variables
    x, y = _data(8)
    reduce = jk.ClippedSum(0.5)
    before = _steady(model, x, y, variables, reduce=reduce)
    _close(before, _reference(model, x, y, variables, reduce))
    if change == "batch size":
        x, y = _data(5, seed=2)
    elif change == "label dtype":
        y = y.astype("int32")
        y[0] = (y[0] + 1) % 3
    elif change == "reduce":
        reduce = None
    elif change == "clip":
        reduce = jk.ClippedSum(0.05)
    else:  # new values of the same variables, read by the kept trace
        model.get_layer("head").kernel.assign(
            np.asarray(model.get_layer("head").kernel) * 3.0
        )
    after = _steady(model, x, y, variables, reduce=reduce)
    want = _reference(model, x, y, variables, reduce)
    _close(after, want)
    if change == "reduce":  # the rows' plain sum: far from the clipped one
        want = [w.sum(0) for w in want]
    _far(before, want)


def test_a_steady_call_notices_the_training_flag():
    """``training=`` picks batch statistics or the moving ones (a
    BatchNormalization layer): each flag's steady calls give its float64
    answer, whichever ran before."""
    model = _mlp(norm=True)
    variables = model.get_layer("head").trainable_variables
    x, y = _data(8)
    x = x * 3.0 + 1.0  # batch statistics far from the moving ones (0, 1)
    answers = {}
    for training in (False, True, False):
        weights = [np.asarray(w) for w in model.get_weights()]
        found = _steady(model, x, y, variables, training=training)
        want = _reference(model, x, y, variables, training=training, norm=True)
        _close(found, want)
        answers[training] = want
        if not training:  # an inference call moves nothing
            for w, v in zip(weights, model.get_weights(), strict=True):
                np.testing.assert_array_equal(w, v)
    _far(answers[True], answers[False])


def test_a_steady_call_notices_a_frozen_layer_and_new_variables():
    """``model.trainable_variables`` after a layer is frozen are fewer: the
    steady calls differentiate those. ``layer="head"`` after
    ``enable_lora`` (new variables, the kernel frozen) differentiates the
    LoRA factors and the bias (jacobkit's LoRA rule), not the kept
    problem's kernel: held to a float64 loop on the LoRA product written out."""
    model = _mlp()
    x, y = _data(8)
    reduce = jk.ClippedSum(0.5)
    _steady(model, x, y, model.trainable_variables, reduce=reduce)
    model.get_layer("block").trainable = False
    variables = model.trainable_variables
    assert len(variables) == 2
    found = _steady(model, x, y, variables, reduce=reduce)
    _close(found, _reference(model, x, y, variables, reduce))
    model.get_layer("block").trainable = True

    head = model.get_layer("head")
    before = _steady(model, x, y, "head", reduce=reduce)
    _close(before, _reference(model, x, y, [head.kernel, head.bias], reduce))
    frozen = np.asarray(head.kernel)  # after enable_lora, .kernel adds A B
    head.enable_lora(2)
    head.lora_kernel_b.assign(np.random.default_rng(7).normal(size=(2, 3)))
    result = jk.jacobian(model, (x, y), "head", outputs=jk.Loss(LOSS), reduce=reduce)
    for _ in range(2):
        result = jk.jacobian(
            model, (x, y), "head", outputs=jk.Loss(LOSS), reduce=reduce
        )
    names = [n.split("/")[-1] for n in result.jacobians]
    assert sorted(names) == ["bias", "lora_kernel_a", "lora_kernel_b"]
    want = _lora_reference(model, frozen, x, y, reduce)
    _close(list(result.jacobians.values()), [want[n] for n in names])


def _lora_reference(model, frozen, x, y, reduce):
    """The clipped sum over the LoRA head's factors and bias, float64: one
    tape per example on ``tanh(x W1 + b1) (W2 + (alpha / rank) A B) + b2``
    (``frozen``: ``W2``)."""
    hidden, head = model.get_layer("block").get_layer("hidden"), model.get_layer("head")

    def wide(v):
        return tf.constant(np.asarray(v), tf.float64)

    w1, b1, w2 = wide(hidden.kernel), wide(hidden.bias), wide(frozen)
    parts = {
        "lora_kernel_a": tf.Variable(wide(head.lora_kernel_a)),
        "lora_kernel_b": tf.Variable(wide(head.lora_kernel_b)),
        "bias": tf.Variable(wide(head.bias)),
    }
    scale = head.lora_alpha / head.lora_rank
    rows = []
    for i in range(len(x)):
        with tf.GradientTape() as tape:
            h = tf.tanh(tf.constant(x[i : i + 1], tf.float64) @ w1 + b1)
            kernel = w2 + scale * parts["lora_kernel_a"] @ parts["lora_kernel_b"]
            loss = LOSS(y[i : i + 1], h @ kernel + parts["bias"])[0]
        grads = tape.gradient(loss, list(parts.values()))
        rows.append(np.concatenate([g.numpy().ravel() for g in grads]))
    flat = np.stack(rows)
    scales = np.minimum(1.0, reduce.clip_norm / np.linalg.norm(flat, axis=1))
    summed, out, at = scales @ flat, {}, 0
    for name, v in parts.items():
        out[name] = summed[at : at + v.shape.num_elements()].reshape(v.shape)
        at += v.shape.num_elements()
    return out


def test_two_threads_calling_one_model_get_its_answer():
    """Two threads, each with its own batch, call the same model at once
    (first calls and steady ones): every answer is its batch's."""
    model = _mlp()
    variables = model.trainable_variables
    reduce = jk.ClippedSum(0.5)
    batches = [_data(8, seed=s) for s in (3, 4)]
    found: dict[int, list] = {0: [], 1: []}
    errors = []

    def run(i):
        try:
            for _ in range(4):
                found[i].append(_jacobian(model, *batches[i], variables, reduce))
        except Exception as err:  # noqa: BLE001 - reported below
            errors.append(err)

    threads = [threading.Thread(target=run, args=(i,)) for i in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    for i, (x, y) in enumerate(batches):
        want = _reference(model, x, y, variables, reduce)
        for answer in found[i]:
            _close(answer, want)


def test_a_kept_problem_is_the_one_built_afresh():
    """``Call.problem`` on a signature it kept gives the problem a new
    build gives: its key, targets, names, rows and reduction; on these
    inputs, and holding none of the first call's."""
    model = _mlp()
    call = Call(model, "head", outputs=jk.Loss(LOSS), reduce=jk.ClippedSum(1.0))
    first = call.problem(_data(8))
    x, y = _data(8, seed=5)
    kept = call.problem((x, y))
    fresh = Call(
        model, "head", outputs=jk.Loss(LOSS), reduce=jk.ClippedSum(2.0)
    ).problem((x, y))
    assert kept is not first and kept.key == first.key
    assert fresh.key != kept.key  # another reduce: another problem
    assert kept.targets == fresh.targets and kept.target_names == fresh.target_names
    assert kept.rows_shape == fresh.rows_shape == (8,)
    np.testing.assert_array_equal(np.asarray(kept.inputs[0]), x)


def test_dispatched_runs_the_trace_of_each_signature():
    """A :class:`Dispatched` function gives the ``tf.function``'s answer on
    every signature, traces each once, and reads its variables' new values."""
    v = tf.Variable(2.0)
    fn = Dispatched(tf.function(lambda a: (a * v, tf.reduce_sum(a))))
    for shape in [(3,), (3,), (4,), (3,), (4, 2)]:
        a = tf.random.uniform(shape)
        out = fn(a)
        np.testing.assert_allclose(out[0].numpy(), a.numpy() * v.numpy(), rtol=1e-7)
    assert fn.experimental_get_tracing_count() == 3
    v.assign(5.0)
    a = tf.ones((3,))
    np.testing.assert_allclose(fn(a)[0].numpy(), 5.0 * np.ones(3))
    assert fn.experimental_get_tracing_count() == 3
    t = tf.zeros((2, 3))
    keys = [
        signature(n) for n in [t, (t,), [t], {"a": t}, (t, tf.zeros((2, 3), tf.int32))]
    ]
    assert len(set(keys)) == len(keys)
    assert signature((t, np.zeros(3))) is None  # an array: not kept
