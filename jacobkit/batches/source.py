"""Where the batches come from: a dataset, an iterable, or one batch of arrays.

:func:`open_source` turns what ``jacobian(inputs=...)`` was given into a
:class:`Source`: the number of batches (``None`` if unknown) and an iterator
over each batch's ``x`` as NumPy arrays (nested like the model's inputs).
Every check on the inputs that can be made before any work is made here.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import tensorflow as tf

from jacobkit.problem import arguments


class batches:  # noqa: N801 - reads as a function: jk.data.batches(x, 64)
    """The batches ``x[i:i + batch_size]`` of an array (or a tuple/dict of
    arrays with a common first axis), without copying: slices of a
    ``numpy.memmap`` are read only when their batch is computed.

    Its length (the number of batches) is known, so progress shows an ETA.

    >>> len(batches(np.zeros((10, 3)), 4))
    3
    """

    def __init__(self, x: Any, batch_size: int) -> None:
        if isinstance(batch_size, bool) or not isinstance(batch_size, int):
            raise TypeError(
                f"batches(batch_size={batch_size!r}): expected a positive int."
            )
        if batch_size < 1:
            raise ValueError(f"batches(batch_size={batch_size}): must be >= 1.")
        sizes = {int(np.shape(a)[0]) for a in tf.nest.flatten(x)}
        if len(sizes) != 1:
            raise ValueError(
                f"batches(x): the arrays' first axes differ ({sorted(sizes)}); "
                "every input needs one entry per example."
            )
        self.x = x
        self.batch_size = batch_size
        self.num_examples = sizes.pop()

    def __len__(self) -> int:
        return -(-self.num_examples // self.batch_size)

    def __iter__(self) -> Iterator[Any]:
        for start in range(0, self.num_examples, self.batch_size):
            window = slice(start, start + self.batch_size)
            yield tf.nest.map_structure(
                lambda a, window=window: np.asarray(a[window]), self.x
            )


@dataclass(frozen=True)
class Reading:
    """How batches are read.

    Attributes:
        whole: keep a dataset element's ``(x, y)`` or ``(x, y, w)`` whole (loss
            rows take the labels, :mod:`jacobkit.problem.loss`); else ``x``.
        integers: ``x`` may hold integers (a model that declares integer
            inputs: token ids); else it must be floating.
    """

    whole: bool = False
    integers: bool = False

    def element(self, element: Any) -> Any:
        """What is kept of a dataset element: ``x`` of ``(x, y)`` and ``(x,
        y, w)`` tuples (Keras' convention), or all of it where ``whole``."""
        if not self.whole and isinstance(element, tuple) and 1 <= len(element) <= 3:
            return element[0]
        return element

    def x(self, batch: Any) -> Any:
        """The model's inputs of a kept batch."""
        if self.whole and isinstance(batch, (tuple, list)) and len(batch) in (2, 3):
            return batch[0]
        return batch

    def allows(self, dtype: Any) -> bool:
        """Whether ``x`` may hold ``dtype`` (a NumPy or TensorFlow dtype)."""
        kind = np.dtype(tf.as_dtype(dtype).as_numpy_dtype).kind
        return kind == "f" or (self.integers and kind in "iu")


def count_batches(
    inputs: Any, steps: int | None, reading: Reading = Reading()
) -> int | None:
    """The number of batches (``None`` if unknown), checked before any work."""
    arguments.check_steps(steps)
    if isinstance(inputs, tf.data.Dataset):
        cardinality = int(inputs.cardinality())
        if cardinality == tf.data.INFINITE_CARDINALITY:
            if steps is None:
                raise ValueError(
                    "jacobian(inputs=<tf.data.Dataset>): the dataset is infinite "
                    "(it repeats). Pass steps=N to take its first N batches, or "
                    "drop .repeat()."
                )
            count = int(steps)
        elif cardinality == tf.data.UNKNOWN_CARDINALITY:
            count = None
        else:
            count = cardinality if steps is None else min(cardinality, int(steps))
        spec = reading.x(reading.element(inputs.element_spec))
        for s in tf.nest.flatten(spec):
            if not isinstance(s, tf.TensorSpec) or not reading.allows(s.dtype):
                what = (
                    s.dtype.name if isinstance(s, tf.TensorSpec) else type(s).__name__
                )
                raise TypeError(
                    f"jacobian(inputs=<tf.data.Dataset>): its elements hold {what} "
                    f"(element_spec {inputs.element_spec}); Jacobians need float "
                    "inputs. Cast them with dataset.map(lambda x: tf.cast(x, "
                    "tf.float32)), or pick the features with dataset.map."
                )
    else:
        try:
            count = len(inputs)
        except TypeError:
            count = None
        if count is not None and steps is not None:
            count = min(count, int(steps))
    if count == 0:
        raise ValueError(
            "jacobian(inputs=...): the dataset has no batches, so there is "
            "nothing to differentiate. Check the dataset (a filter or take(0)?)."
        )
    return count


def iterate(
    inputs: Any, steps: int | None, reading: Reading = Reading()
) -> Iterator[Any]:
    """Each batch's ``x`` (or whole element, :class:`Reading`), as NumPy
    arrays (nested like the model's inputs)."""
    if isinstance(inputs, tf.data.Dataset):
        source = inputs.take(steps) if steps is not None else inputs
        for element in source:
            yield tf.nest.map_structure(np.asarray, reading.element(element))
        return
    for k, element in enumerate(inputs):
        if steps is not None and k >= steps:
            return
        yield tf.nest.map_structure(np.asarray, reading.element(element))


def check_batch(k: int, x: Any, first: Any, reading: Reading = Reading()) -> None:
    """Each batch: float arrays (integers too where the model takes them;
    labels of any dtype), one batch axis, shapes like the first batch's."""
    flat = tf.nest.flatten(x)
    for a in tf.nest.flatten(reading.x(x)):
        if not reading.allows(a.dtype):
            raise TypeError(
                f"jacobian(inputs=...): batch {k} holds {a.dtype} values; "
                "Jacobians need float inputs. Cast the batches to float32."
            )
        if a.ndim == 0:
            raise ValueError(
                f"jacobian(inputs=...): batch {k} is a scalar; each batch needs a "
                "leading batch axis (shape (B, ...))."
            )
    scalars = [a for a in flat if a.ndim == 0]
    if scalars:  # labels of an unbatched set: one number per element
        raise ValueError(
            f"jacobian(inputs=...): batch {k} holds a scalar (shapes "
            f"{[tuple(a.shape) for a in flat]}): each element of the inputs "
            "must be a batch, shape (B, ...). Is the tf.data set unbatched? "
            "Call dataset.batch(32) (any size) before passing it."
        )
    arguments.check_examples(x, batch=k)
    if len({a.shape[0] for a in flat}) != 1:
        raise ValueError(
            f"jacobian(inputs=...): in batch {k} the inputs' batch axes differ "
            f"({[a.shape[0] for a in flat]})."
        )
    if first is None:
        return
    try:
        tf.nest.assert_same_structure(x, first)
    except (ValueError, TypeError) as err:
        raise ValueError(
            f"jacobian(inputs=...): batch {k} is structured differently from "
            "batch 0; every batch must hold the same inputs."
        ) from err
    for a, b in zip(flat, tf.nest.flatten(first), strict=True):
        if a.shape[1:] != b.shape[1:] or a.dtype != b.dtype:
            raise ValueError(
                f"jacobian(inputs=...): batch {k} has shape {a.shape} ({a.dtype}) "
                f"but batch 0 has {b.shape} ({b.dtype}); batches may differ only "
                "in the batch axis (the first). Resize or pad the examples."
            )


@dataclass(frozen=True)
class Source:
    """The batches to compute: ``count`` of them (``None``: unknown), each
    ``x`` in ``batches`` as NumPy arrays, nested like the model's inputs."""

    count: int | None
    batches: Iterator[Any]


def open_source(
    inputs: Any,
    steps: int | None,
    replicas: int | None,
    reading: Reading = Reading(),  # noqa: B008 - frozen
) -> Source:
    """The batches of ``inputs``: a dataset's or iterable's (at most ``steps``),
    or one batch of arrays, split into one batch per replica when there are
    ``replicas`` (``distribute=``)."""
    if arguments.is_batches(inputs):
        return Source(
            count_batches(inputs, steps, reading), iterate(inputs, steps, reading)
        )
    arrays = tf.nest.map_structure(np.asarray, inputs)
    arguments.check_examples(arrays)
    if replicas is None:
        return Source(1, iter([arrays]))
    size = int(tf.nest.flatten(arrays)[0].shape[0])
    split = batches(arrays, -(-size // replicas))
    return Source(len(split), iter(split))


def batch_size(x: Any) -> int:
    """The number of examples in ``x`` (the first axis of its first array)."""
    return int(tf.nest.flatten(x)[0].shape[0])


def shapes(x: Any) -> tuple[tuple[int, ...], ...]:
    """The shapes of ``x``'s arrays or tensors, flattened."""
    return tuple(tuple(t.shape) for t in tf.nest.flatten(x))
