"""jacobkit.privacy's compiled DP step on models jacobkit did not write:
keras_hub's ``GPT2CausalLM`` with its dropout on, a BERT classifier with its
dropout on, and GPT-2 with LoRA (only the low-rank factors trained). All
slow (each traces a keras_hub model per padded size). Without dropout
(``training=False``) the same three against a float64 tape per example
(:func:`test_a_compiled_step_without_dropout_equals_float64`).

The reference, independent of jacobkit: a float32 ``tf.GradientTape`` over
the sampler's padded batch inside ``keras.StatelessScope()`` taken before
the step (the model's seed state as the step finds it: the same dropout
masks, and nothing moves), one gradient per example, each clipped over all
trained variables, summed; the noise drawn by the documented recipe;
divided by ``q * N``; SGD's update. Float32, not float64: a float64 copy
draws other dropout masks (the uniform draw depends on the dtype), so no
float64 reference holds the same masks.

Tolerance: the weights after the step against the reference's, beyond one
float32 spacing, relative to the update's largest value. Measured (this
version, two steps each): GPT-2 with dropout 1.4e-7, BERT with dropout
1.4e-7, GPT-2 LoRA 8.4e-8; held to RTOL = 2e-6.
"""

from __future__ import annotations

import math

import keras
import numpy as np
import pytest
import tensorflow as tf

import jacobkit as jk
from jacobkit.privacy import step as privacy_step
from jacobkit.testing import examples
from tests import hub_models

# in the default run: issue 49 asks that one compiled DP step equal a
# reference on these models (about 20 s in all)

RTOL = 2e-6
N, Q, SEED, LR, SIGMA = 24, 0.25, 5, 0.05, 0.6


def _next_token_loss(y_true, y_pred):
    """Each sequence's summed next-token cross-entropy: one row per example."""
    tokens = keras.losses.sparse_categorical_crossentropy(
        y_true, y_pred, from_logits=True
    )
    return keras.ops.sum(tokens, axis=-1)


CLASS_LOSS = keras.losses.SparseCategoricalCrossentropy(
    from_logits=True, reduction=None
)


def _gpt2(lora: bool = False):
    keras_hub = pytest.importorskip("keras_hub")
    keras.utils.set_random_seed(2)
    backbone = hub_models.gpt2(50, length=8)  # keras_hub's default dropout, 0.1
    if lora:
        backbone.enable_lora(2)
    model = keras_hub.models.GPT2CausalLM(backbone, preprocessor=None)
    rng = np.random.default_rng(2)
    x = {
        "token_ids": rng.integers(1, 50, (N, 8)).astype("int32"),
        "padding_mask": np.ones((N, 8), "int32"),
    }
    return model, x, np.roll(x["token_ids"], -1, axis=1), _next_token_loss


def _bert():
    example = examples.build("bert_classifier", batch=N, layers=1, hidden=32)
    model = example.model
    rng = np.random.default_rng(3)
    return model, example.inputs, rng.integers(0, 3, N), CLASS_LOSS


def _reference(model, data, loss, clip, step, groups=None):
    """The SGD update of one DP step, float32 tape per example (``groups``:
    ``(indices, clip)`` each, per-layer clipping)."""
    x, y, w = data
    variables = model.trainable_variables
    with keras.StatelessScope(), tf.GradientTape(persistent=True) as tape:
        rows = tf.unstack(loss(y, model(x, training=True)) * w)
    sums = [np.zeros(v.shape, np.float64) for v in variables]
    for row in rows:
        grads = [
            np.asarray(tf.convert_to_tensor(g), np.float64)
            for g in tape.gradient(row, variables)
        ]
        _add_clipped(sums, grads, clip, groups)
    return _noisy_update(variables, sums, clip, step)


@pytest.mark.parametrize(
    "build, per_layer, eager",
    [
        (_gpt2, False, False),
        (_bert, False, False),
        (lambda: _gpt2(lora=True), False, False),
        (_bert, True, False),
        (_bert, True, True),
    ],
    ids=["gpt2", "bert", "lora", "bert-per_layer", "bert-per_layer-eager"],
)
def test_a_compiled_step_under_dropout_equals_the_tape(build, per_layer, eager):
    """Per layer (``per_layer=True``), every layer's clipped sum from one
    forward pass: one draw of the dropout masks for all layers, the tape's
    (one ``jk.jacobian`` per layer drew its own masks per layer)."""
    model, x, y, loss = build()
    dropout = [
        layer
        for layer in model._flatten_layers()
        if isinstance(layer, keras.layers.Dropout) and layer.rate > 0
    ]
    assert dropout  # the masks matter: the reference must draw the step's
    sampler = jk.privacy.PoissonSampler(
        (x, y), Q, seed=1, sizes=(8,)
    )  # draws of 4 and 8
    clip = 1.0
    private = jk.privacy.make_private(
        model,
        l2_norm_clip=clip,
        noise_multiplier=SIGMA,
        sampling_rate=Q,
        num_examples=N,
        seed=SEED,
        per_layer=per_layer,
    )
    private.compile(keras.optimizers.SGD(LR), loss, run_eagerly=eager)
    if not eager:
        private.prepare(sampler)
    clipping = privacy_step.clipping_for(
        model, model.trainable_variables, clip, per_layer
    )
    groups = list(zip(clipping.groups, clipping.clips))
    assert len(groups) > 1 or not per_layer
    worst = 0.0
    for t in range(2):
        data = sampler[t]
        before = [np.asarray(v, np.float64) for v in model.trainable_variables]
        update = _reference(model, data, loss, clip, t, groups)
        private.train_on_batch(*data[:2], sample_weight=data[2])
        after = [np.asarray(v, np.float64) for v in model.trainable_variables]
        scale = max(float(np.abs(u).max()) for u in update)
        for b, a, u in zip(before, after, update):
            want = b - u
            spacing = np.spacing(np.abs(want).astype(np.float32)).astype(np.float64)
            error = np.maximum(np.abs(a - want) - spacing, 0)
            worst = max(worst, float(error.max()) / scale)
    print(f"largest error relative to the update: {worst:.1e}")
    assert worst <= RTOL


def _gpt2_float64_lora(model):
    """The LoRA GPT-2's float64 twin (keras_hub rebuilds no LoRA model from
    its config): the same backbone built in float64, LoRA enabled, every
    weight copied."""
    import keras_hub

    backbone = keras_hub.models.GPT2Backbone(
        vocabulary_size=50,
        num_layers=1,
        num_heads=2,
        hidden_dim=16,
        intermediate_dim=32,
        max_sequence_length=8,
        dtype="float64",
    )
    backbone.enable_lora(2)
    copy = keras_hub.models.GPT2CausalLM(backbone, preprocessor=None, dtype="float64")
    assert len(copy.weights) == len(model.weights)
    for mine, theirs in zip(copy.weights, model.weights):
        mine.assign(np.asarray(theirs, np.float64))
    return copy


def _reference64(copy, data, loss, clip, step):
    """The SGD update of one DP step, a float64 tape per example."""
    x, y, w = data
    variables = copy.trainable_variables
    sums = [np.zeros(v.shape, np.float64) for v in variables]
    for i in range(len(w)):
        one = tf.nest.map_structure(lambda a, i=i: a[i : i + 1], x)
        with tf.GradientTape() as tape:
            row = loss(y[i : i + 1], copy(one, training=False))[0] * float(w[i])
        grads = [
            np.asarray(tf.convert_to_tensor(g), np.float64)
            for g in tape.gradient(row, variables)
        ]
        _add_clipped(sums, grads, clip)
    return _noisy_update(variables, sums, clip, step)


@pytest.mark.parametrize("name", ["gpt2", "bert", "lora"])
def test_a_compiled_step_without_dropout_equals_float64(name):
    """``make_private(..., training=False)``: one compiled step against a
    float64 tape per example (measured: GPT-2 9.7e-8, BERT 1.6e-7, LoRA
    9.1e-8 of the update beyond one float32 spacing; held to RTOL)."""
    model, x, y, loss = {"gpt2": _gpt2, "bert": _bert, "lora": lambda: _gpt2(True)}[
        name
    ]()
    copy = (
        _gpt2_float64_lora(model) if name == "lora" else jk.testing.float64_copy(model)
    )
    assert len(copy.trainable_variables) == len(model.trainable_variables)
    sampler = jk.privacy.PoissonSampler((x, y), Q, seed=1, sizes=(8,))
    private = jk.privacy.make_private(
        model,
        l2_norm_clip=1.0,
        noise_multiplier=SIGMA,
        sampling_rate=Q,
        num_examples=N,
        seed=SEED,
        training=False,
    )
    private.compile(keras.optimizers.SGD(LR), loss)
    private.prepare(sampler)
    data = sampler[0]
    before = [np.asarray(v, np.float64) for v in model.trainable_variables]
    update = _reference64(copy, data, loss, 1.0, 0)
    private.train_on_batch(*data[:2], sample_weight=data[2])
    after = [np.asarray(v, np.float64) for v in model.trainable_variables]
    scale = max(float(np.abs(u).max()) for u in update)
    worst = 0.0
    for b, a, u in zip(before, after, update):
        want = b - u
        spacing = np.spacing(np.abs(want).astype(np.float32)).astype(np.float64)
        worst = max(worst, float(np.maximum(np.abs(a - want) - spacing, 0).max()))
    print(f"largest error relative to the update: {worst / scale:.1e}")
    assert worst <= RTOL * scale


def _add_clipped(sums: list, grads: list, clip: float, groups=None) -> None:
    """One example's gradients (float64), clipped to ``clip``, added in
    place; with ``groups`` (``(indices, clip)`` each), each group's part
    clipped to its own."""
    for group, bound in groups or [(range(len(grads)), clip)]:
        norm = math.sqrt(sum(float(np.sum(grads[j] ** 2)) for j in group))
        scale = min(1.0, bound / norm) if norm > 0 else 1.0
        for j in group:
            sums[j] += scale * grads[j]


def _noisy_update(variables, sums: list, clip: float, step: int) -> list:
    """The SGD update from the clipped sums: the documented stateless noise
    of each variable (seed, step, its index), divided by ``q * N``."""
    update = []
    for j, (v, s) in enumerate(zip(variables, sums)):
        seed = tf.random.experimental.stateless_fold_in(
            tf.constant([SEED, step], tf.int64), j
        )
        draw = tf.random.stateless_normal(v.shape, seed=seed, dtype=tf.float32)
        noise = SIGMA * clip * np.asarray(draw, np.float64)
        update.append(LR * (s + noise) / (Q * N))
    return update
