"""Per-example, per-class gradients with respect to the inputs, through
:func:`jacobkit.jacobian` (one call per chunk of copies of the batch)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import tensorflow as tf

from jacobkit.api import jacobian
from jacobkit.memory.budget import parse_budget
from jacobkit.problem.call import Call
from jacobkit.problem.tensor_targets import Inputs

#: the share of the memory budget one chunk's gradients may take (the rest is
#: the backward pass's activations and what the caller accumulates)
RESULT_SHARE = 0.25


def as_batch(x: Any, call: str) -> tf.Tensor:
    """``x`` as a floating ``tf.Tensor`` with its batch axis first (``call``:
    the explain function's name, for its messages)."""
    try:
        tensor = tf.convert_to_tensor(x)
    except (ValueError, TypeError) as err:
        raise TypeError(
            f"explain.{call}(x=...): expected a floating array or tensor, shape "
            f"(B, ...), got {type(x).__name__}."
        ) from err
    if not tensor.dtype.is_floating:
        raise TypeError(
            f"explain.{call}(x=...): the inputs must be floating (got "
            f"{tensor.dtype.name}); "
            "attributions of integer ids need the embedding's output "
            "(jk.jacobian(model, x, jk.Output('embedding')))."
        )
    if tensor.shape.rank is None or tensor.shape.rank < 2:
        raise ValueError(
            f"explain.{call}(x=...): expected a batch of inputs, shape (B, ...), "
            "got shape "
            f"{tuple(tensor.shape)}. Add the batch axis: x[None]."
        )
    return tensor


def input_gradients(
    model: Any,
    x: tf.Tensor,
    classes: Sequence[int] | None,
    **kwargs: Any,
) -> tf.Tensor:
    """``d Y[b, k] / d x[b]`` for every example ``b`` and class ``k``:
    shape ``(B, K, *x.shape[1:])`` (``K`` = ``len(classes)``, or the
    output's last axis)."""
    res = jacobian(
        model,
        x,
        Inputs(),
        outputs="per_example",
        features=None if classes is None else list(classes),
        **kwargs,
    )
    return tf.convert_to_tensor(res[0])


def row_values(
    model: Any,
    points: Sequence[tf.Tensor],
    classes: Sequence[int] | None,
    **kwargs: Any,
) -> list[np.ndarray]:
    """The rows :func:`input_gradients` differentiates, at each of
    ``points`` (batches of one shape, ``(B, ...)``): ``(B, K)`` each
    (float64), one forward pass each, in order, with the call's
    ``training=`` and ``output=``. Each pass is one of the call's draw
    (:func:`jacobkit.keras.state.one_call`; outside one, nothing moves):
    with ``training=True`` the last point's pass is the one whose moves the
    call keeps, and each point sees its own batch statistics, as
    ``model(point, training=True)`` would."""
    call = Call(
        model,
        Inputs(),
        outputs="per_example",
        features=None if classes is None else list(classes),
        training=kwargs.get("training", False),
        output=kwargs.get("output"),
    )
    problem = call.problem(points[0])
    found = []
    for point in points:
        rows = problem.per_example_rows(point)
        found.append(np.asarray(tf.cast(rows, tf.float64)))
    return found


def copies_per_call(
    x: tf.Tensor, num_classes: int, copies: int, memory_budget: Any
) -> int:
    """How many copies of the batch (interpolation steps, noisy samples) one
    call may take: their gradients, ``copies x B x K x x[0].size`` floats,
    within :data:`RESULT_SHARE` of the budget (default: all in one call)."""
    if memory_budget is None:
        return copies
    budget = parse_budget(memory_budget)
    one = int(np.prod(x.shape)) * num_classes * x.dtype.size
    return int(max(1, min(copies, int(budget * RESULT_SHARE) // max(one, 1))))


def mean_gradients(
    model: Any,
    batches: Sequence[tf.Tensor],
    classes: Sequence[int] | None,
    memory_budget: Any,
    weights: Sequence[float] | None = None,
    **kwargs: Any,
) -> tf.Tensor:
    """The mean over ``batches`` (copies of one batch, each ``(B, ...)``) of
    their per-class input gradients, ``(B, K, ...)``, computed a chunk of
    copies at a time (equal chunks, so one trace serves them all); with
    ``weights`` (one per copy, summing to 1), their weighted sum."""
    count = len(batches)
    if weights is None:
        weights = [1.0 / count] * count
    first = batches[0]
    batch = int(first.shape[0])
    num_classes = (
        len(classes) if classes is not None else int(model(first[:1]).shape[-1])
    )
    per_call = copies_per_call(first, num_classes, count, memory_budget)
    chunks = -(-count // per_call)
    per_call = -(-count // chunks)
    total = None
    for c in range(chunks):
        part = list(batches[c * per_call : (c + 1) * per_call])
        real = len(part)
        part += [part[-1]] * (per_call - real)  # equal chunks: padded, unweighted
        grads = input_gradients(
            model,
            tf.concat(part, axis=0),
            classes,
            memory_budget=memory_budget,
            **kwargs,
        )
        grads = tf.reshape(grads, (per_call, batch, *grads.shape[1:]))
        share = tf.constant(weights[c * per_call : c * per_call + real], grads.dtype)
        summed = tf.tensordot(share, grads[:real], axes=1)
        total = summed if total is None else total + summed
    assert total is not None
    return total
