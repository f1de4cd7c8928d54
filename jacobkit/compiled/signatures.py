"""What ``jk.function`` does with each input signature it is traced for.

A :class:`~jacobkit.problem.Problem` has static shapes: strategies size
their rows, chunks and closed forms from them (``batch``'s forward pass
reads the batch size as an int). A traced signature whose shapes are all
known is planned as it is (:func:`feeding`: a problem of that batch size,
built from the example). One whose batch size is unknown (``model.fit``
traces its step with ``(None, ...)`` inputs: its dataset's batches may end
short) is padded, in the trace, to a size known when it is planned: the
example's (``ceiling``), and the rows of the padding are cut from the
result. That is exact only where each row is one example's and a padding
example adds nothing: rows of one example each (``"per_example"``,
``"full"``, a :class:`~jacobkit.Loss`'s), and for a clipped sum only a
loss's rows, whose padding examples have sample weight 0
(:func:`jacobkit.problem.padding.padded_to`, the rule of
``ClippedSum(pad_batches=True)``). Everything else is refused, in words,
when the signature is traced (:func:`refuse_unknown`).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import numpy as np
import tensorflow as tf

from jacobkit.keras import compat
from jacobkit.problem import Call, padding
from jacobkit.problem.loss import Loss

T = TypeVar("T")


def in_own_thread(fn: Callable[[Any], T], argument: Any) -> T:
    """``fn(argument)`` run in a new thread (eager, no tape paused, no scope
    of the caller's), its exception raised here."""
    found: list[Any] = []
    failed: list[BaseException] = []

    def run() -> None:
        try:
            found.append(fn(argument))
        except BaseException as err:  # noqa: BLE001 - raised in the caller
            failed.append(err)

    thread = threading.Thread(target=run, name="jacobkit-plan")
    thread.start()
    thread.join()
    if failed:
        raise failed[0]
    result: T = found[0]
    return result


@dataclass(frozen=True)
class Feeding:
    """How the inputs of one traced signature reach the planned computation.

    Attributes:
        padded: the batch size they are padded to (``None``: fed as they
            are).
        count: the examples of the signature's batches where known
            (``None``: unknown in the trace, read at run time).
    """

    padded: int | None
    count: int | None


def signature(inputs: Any) -> tuple[Any, ...]:
    """What identifies one traced signature of ``inputs`` (tensors, traced
    or eager): their structure, shapes (``None`` where unknown) and dtypes."""
    flat = tf.nest.flatten(inputs)
    return (
        tf.nest.map_structure(lambda _: 0, inputs).__repr__(),
        tuple((tuple(t.shape.as_list()), t.dtype.name) for t in flat),
    )


def batch_size(inputs: Any) -> int | None:
    """The batch size of ``inputs`` as the trace knows it (``None``:
    unknown); a clear error where another axis is unknown (each signature
    is planned with static shapes)."""
    flat = tf.nest.flatten(inputs)
    for t in flat:
        if t.shape.rank is None or None in t.shape.as_list()[1:]:
            raise ValueError(
                f"jk.function: an input of shape {t.shape} in this trace: only "
                "the batch axis may be unknown (None); every other axis must be "
                "known when the traced function is traced (each signature is "
                "planned with static shapes). Give the tf.function an "
                "input_signature with those axes, or pad them to a fixed size."
            )
    sizes = {t.shape[0] for t in flat if t.shape.rank}
    return None if None in sizes or not sizes else int(max(sizes))


def feeding(call: Call, count: int | None, ceiling: int) -> Feeding:
    """How a signature of ``count`` examples (``None``: unknown) is fed:
    as it is; padded to its bucket (``ClippedSum(pad_batches=True)``); or,
    unknown, padded to ``ceiling`` (refused where that would change the
    result: :func:`refuse_unknown`)."""
    if count is None:
        refuse_unknown(call)
        return Feeding(padding.bucket(ceiling) if call.pads_batches else ceiling, None)
    if call.pads_batches:
        return Feeding(padding.bucket(count), count)
    return Feeding(None, count)


def refuse_unknown(call: Call) -> None:
    """Refuse, in words, padding a batch of unknown size where the padding
    would change the result."""
    loss = isinstance(call.outputs, Loss)
    fix = (
        "Trace it with a known batch size (a tf.function input_signature with "
        "the batch axis set; a dataset batched with drop_remainder=True, as "
        "model.fit traces its step with the dataset's shapes)"
    )
    if call.summed:
        raise ValueError(
            f"jk.function(outputs={call.outputs!r}): this trace's batch size is "
            "unknown (None), and these rows sum over the batch, so they cannot "
            f"be planned for a padded batch. {fix}, or use rows of one example "
            "each (outputs='per_example', or jk.Loss(...))."
        )
    if call.reduction.sums_batches and not loss:  # a sum of the rows
        raise ValueError(
            f"jk.function(reduce={call.reduce!r}, outputs={call.outputs!r}): "
            "this trace's batch size is unknown (None); a padded batch's extra "
            "rows would add to the clipped sum. Use outputs=jk.Loss(...), whose "
            f"padding examples have sample weight 0 and add exactly 0. {fix}."
        )
    if call.training and _has_batch_statistics(call.model):
        raise ValueError(
            "jk.function(training=True): this trace's batch size is unknown "
            "(None), and the model normalizes by batch statistics "
            "(BatchNormalization), which padding examples would change. "
            f"{fix}."
        )


def _has_batch_statistics(model: Any) -> bool:
    return any(
        "BatchNormalization" in (c.__name__ for c in type(layer).__mro__)
        for layer in compat.flatten_layers(model)
    )


def sample(example: Any, inputs: Any, count: int) -> Any:
    """Inputs of ``count`` examples shaped like the traced ``inputs``, to
    build a signature's problem from, eagerly: the example's first
    ``count`` (its last repeated where it has fewer) where each input has
    its dtype and its shape but the batch axis, else zeros."""
    flat = tf.nest.flatten(inputs)
    same = tf.nest.is_nested(example) == tf.nest.is_nested(inputs) and len(
        tf.nest.flatten(example)
    ) == len(flat)
    if same:
        try:
            tf.nest.assert_same_structure(example, inputs)
        except (TypeError, ValueError):
            same = False
    if not same:
        return tf.nest.map_structure(lambda t: _zeros(t, count), inputs)

    def one(given: tf.Tensor, traced: tf.Tensor) -> tf.Tensor:
        if given.dtype != traced.dtype or given.shape[1:] != traced.shape[1:]:
            return _zeros(traced, count)
        index = np.minimum(np.arange(count), int(given.shape[0]) - 1)
        return tf.gather(given, index)

    return tf.nest.map_structure(one, example, inputs)


def _zeros(traced: tf.Tensor, count: int) -> tf.Tensor:
    return tf.zeros((count, *traced.shape.as_list()[1:]), traced.dtype)


def checked_count(inputs: Any, padded: int) -> tf.Tensor:
    """The examples in ``inputs`` (a traced batch of unknown size), with
    the run-time checks that it is 1 to ``padded``."""
    count = tf.shape(tf.nest.flatten(inputs)[0])[0]
    tf.debugging.assert_positive(
        count, message="jk.function: a batch of 0 examples has no rows"
    )
    tf.debugging.assert_less_equal(
        count,
        tf.constant(padded, count.dtype),
        message=(
            f"jk.function: a batch of more examples than the {padded} it pads "
            "batches of unknown size to (the example's size): pass an example "
            "batch as large as the largest batch"
        ),
    )
    return count
