"""``jk.ClippedSum(clip_norm, pad_batches=True)``: a batch of loss rows
padded with examples of weight 0 up to one of a few sizes.

Each new input shape traces the compiled computation once. DP-SGD's Poisson
samples differ in size from step to step (an expected batch of 64 draws
sizes from about 40 to 90), so an unpadded training run traces once per
size it meets. Padded to :func:`bucket`'s sizes (four per doubling: ..., 32,
40, 48, 56, 64, 80, ...), they trace a few times (the DP-SGD example's
eager loop, which ``examples/dp_sgd.py`` had before it moved to
``jk.privacy``: 6 traces where it made 41).

NOTE (why it is exact). A padded example is a copy of the batch's last one
with sample weight 0 (:func:`padded`): its loss row is ``0 * loss``, so its
gradient is exactly zero, its norm 0, its scale 1, and it adds exactly 0 to
the clipped sum. Its norm is dropped from the result
(:func:`jacobkit.engine.trimmed`). The examples must not mix (no batch
statistics), which a per-example loss gradient needs anyway: ``batch``
checks it before its first run. Nor may the loss depend on the batch size (a
mean over the batch inside it would scale every row by ``n / padded``: 0.146
off in issue 48's case): :func:`check_batch_size` compares, on the first
padded call per model and loss, the real examples' loss rows within the
padded batch with their rows alone, from one forward pass.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import tensorflow as tf

from jacobkit.problem import loss as losses
from jacobkit.problem.cache import PerModel

_CHECKED = PerModel(
    "pad_batches: the losses found not to depend on the batch size (checked "
    "once, on the first padded call)"
)

#: sizes per doubling of the batch: a batch is padded by at most a quarter
#: of its size
SIZES_PER_DOUBLING = 4


def bucket(size: int, per_doubling: int = SIZES_PER_DOUBLING) -> int:
    """The padded size of a batch of ``size`` examples: ``size`` rounded up
    to a multiple of ``2**floor(log2(size)) / per_doubling`` (a power of
    two; sizes up to ``2 * per_doubling`` are their own): with the default 4,
    ..., 32, 40, 48, 56, 64, 80, ...; with 2, ..., 32, 48, 64, 96, ..."""
    if size < 1:
        raise ValueError(f"a batch of {size} examples has nothing to pad")
    step = 2 ** max(0, size.bit_length() - 1 - (per_doubling.bit_length() - 1))
    return -(-size // step) * step


def check(outputs: Any) -> None:
    """Refuse ``pad_batches=True`` where rows have no sample weight to set
    to 0: only a loss's rows do."""
    if not isinstance(outputs, losses.Loss):
        raise ValueError(
            "jacobian(reduce=jk.ClippedSum(..., pad_batches=True)): padding "
            "adds examples of sample weight 0, which only loss rows have; pass "
            f"outputs=jk.Loss(loss_fn), not outputs={outputs!r}."
        )


def padded(inputs: Any) -> tuple[Any, int | None]:
    """A loss's inputs ``(x, y)`` or ``(x, y, sample_weight)`` of ``n``
    examples as ``(x', y', w')`` of ``bucket(n)``: ``x`` and ``y`` with their
    last example repeated (:func:`repeat_last`), ``w'`` the weights (ones
    where none were given) followed by zeros; and ``n``. A batch already of
    its size gets its weights only; an empty batch is returned as it is,
    with ``None``, for the usual refusal."""
    x, labels = losses.split(inputs)
    n = int(np.shape(labels[0])[0])
    if not n:
        return inputs, None
    size = bucket(n)
    # a batch already of its size still gets weights: every batch of one
    # size is then one structure, one trace
    weights = np.asarray(labels[1]) if len(labels) > 1 else np.ones((n,), np.float32)
    zeros = np.zeros((size - n, *weights.shape[1:]), weights.dtype)
    found = (
        repeat_last(x, size),
        repeat_last(labels[0], size),
        np.concatenate([weights, zeros]),
    )
    return found, n


def repeat_last(x: Any, size: int) -> Any:
    """``x`` (arrays ``(n, ...)``, nested as a model's inputs) with its last
    example repeated up to ``size`` examples: arrays ``(size, ...)``; arrays
    of ``size`` or more examples are returned as they are. (A dataset's
    short last batch is padded so too: :mod:`jacobkit.batches.runners`.)"""

    def pad_one(a: Any) -> np.ndarray:
        a = np.asarray(a)
        if a.shape[0] >= size:
            return a
        return np.concatenate([a, np.repeat(a[-1:], size - a.shape[0], axis=0)])

    return tf.nest.map_structure(pad_one, x)


def check_batch_size(problem: Any, examples: int) -> None:
    """Refuse a loss whose rows depend on the batch size (a mean over the
    batch inside it): ``problem`` is of a batch padded from ``examples``
    examples. One forward pass of the padded batch
    (no variable of the model assigned: :func:`jacobkit.keras.state.drawn`),
    then its loss rows of the real examples against theirs alone; once per
    model and loss."""
    loss = problem.rows_spec.loss
    if loss is None:
        return
    _, labels = losses.split(problem.inputs)
    if int(np.shape(labels[0])[0]) == examples:
        return
    checked = _CHECKED.of(problem.model)
    try:
        if checked.get(loss):
            return
    except TypeError:  # a loss function that cannot be hashed: checked each call
        checked = {}
    outputs = problem.call_model(problem.inputs)
    within = problem.rows_spec.of(outputs, labels)[:examples]
    alone = problem.rows_spec.of(
        tf.nest.map_structure(lambda t: t[:examples], outputs),
        tuple(a[:examples] for a in labels),
    )
    # rows of one example formed in two batches: equal but for the order of
    # a sum over a sequence's tokens (a few roundings of the rows' dtype)
    tolerance = 8 * np.finfo(alone.dtype.as_numpy_dtype).eps
    within, alone = np.asarray(within, np.float64), np.asarray(alone, np.float64)
    scale = max(float(np.max(np.abs(alone))), np.finfo(np.float32).tiny)
    worst = int(np.argmax(np.abs(within - alone)))
    if np.abs(within - alone).flat[worst] > tolerance * scale:
        size = int(np.shape(labels[0])[0])
        example = int(np.unravel_index(worst, alone.shape)[0])
        raise ValueError(
            f"jacobian(reduce=jk.ClippedSum(..., pad_batches=True)): the loss "
            f"jk.Loss({_named(loss.fn)}) depends on the batch size: example "
            f"{example}'s loss is "
            f"{alone.flat[worst]:.6g} in its batch of {examples} and "
            f"{within.flat[worst]:.6g} in that batch padded to {size}. A mean "
            "over the batch inside the loss? Padding would then scale every "
            f"gradient by {examples}/{size}. Make the loss one value per example "
            "that does not depend on the others (a Keras loss with "
            "reduction=None), or drop pad_batches=True."
        )
    checked[loss] = True


def _named(fn: Any) -> str:
    return str(getattr(fn, "name", None) or getattr(fn, "__name__", type(fn).__name__))


def padded_to(inputs: Any, size: int, *, loss: bool) -> Any:
    """``inputs`` (tensors, eager or traced, their batch size known or not)
    as a batch of ``size`` examples, by the same rule as :func:`padded`
    (``jk.function``'s padding: :mod:`jacobkit.compiled`): a loss's
    ``(x, y[, w])`` as ``(x', y', w')``, ``w'`` the weights (ones where none
    were given) then zeros; other inputs with their last example repeated,
    for rows of one example each, whose padding rows are then cut. The
    batch must hold 1 to ``size`` examples (the caller checks it)."""
    first = tf.nest.flatten(inputs)[0]
    count = tf.shape(first)[0]
    index = tf.minimum(tf.range(size), count - 1)

    def take(a: Any) -> tf.Tensor:
        return tf.gather(tf.convert_to_tensor(a), index)

    if not loss:
        return tf.nest.map_structure(take, inputs)
    x, labels = losses.split(inputs)
    if len(labels) > 1:
        weights = tf.convert_to_tensor(labels[1])
    else:
        weights = tf.ones(tf.shape(tf.nest.flatten(x)[0])[:1], tf.float32)
    real = tf.cast(tf.range(size) < count, weights.dtype)
    real = tf.reshape(real, [size] + [1] * (weights.shape.rank - 1))
    return (
        tf.nest.map_structure(take, x),
        tf.nest.map_structure(take, labels[0]),
        take(weights) * real,
    )
