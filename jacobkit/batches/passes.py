"""Every pass over a dataset sees the same examples in the same order.

A Gram matrix reads one set again for each chunk of the other, and TracIn,
Grad-Cos and self-influence read both sets again for each checkpoint: a
result's column ``j`` is the ``j``-th example of every pass. A
``tf.data.Dataset`` made with ``shuffle()`` reshuffles on each iteration by
default, so each pass would read another order and column ``j`` would mean
another example per pass (TracIn over 3 checkpoints of a reshuffled set:
0.98 relative error against the same arrays, silently; issue 48).

:class:`Checked` reads a dataset as an iterable and fingerprints each batch
(a hash of its arrays' bytes, shapes and dtypes: about 1 GB/s, far below
the cost of a batch's gradients); every later pass is compared with the
first, batch by batch, and a difference is refused in words.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import tensorflow as tf


def digest(batch: Any) -> str:
    """A fingerprint of one batch: its structure and every array's dtype,
    shape and bytes."""
    h = hashlib.blake2b(digest_size=16)
    h.update(str(tf.nest.map_structure(lambda _: 0, batch)).encode())
    for leaf in tf.nest.flatten(batch):
        array = np.asarray(leaf)
        h.update(f"{array.dtype.str}{array.shape}".encode())
        if array.dtype.kind in "OSU":  # strings: their text, not pointers
            h.update(repr(array.tolist()).encode())
        else:
            h.update(np.ascontiguousarray(array).tobytes())
    return h.hexdigest()


@dataclass
class Checked:
    """A dataset read again and again (an iterable of its elements as NumPy
    arrays), each pass checked against the first: the same number of
    batches, each with the same examples in the same order.

    Attributes:
        dataset: the ``tf.data.Dataset``.
        argument: how the call names it in a refusal (``"gram(b=...)"``).
    """

    dataset: tf.data.Dataset
    argument: str
    #: each batch's digest, as far as the passes so far have read
    digests: list[str] = field(default_factory=list)
    #: whether a pass has read every batch (a probe reads only the first)
    complete: bool = False
    passes: int = 0

    def __iter__(self) -> Iterator[Any]:
        self.passes += 1
        k = -1
        for k, element in enumerate(self.dataset):
            batch = tf.nest.map_structure(np.asarray, element)
            found = digest(batch)
            if k < len(self.digests):
                if found != self.digests[k]:
                    self._refuse(f"its batch {k} holds other examples")
            elif self.complete:
                self._refuse(f"it has more than {len(self.digests)} batches")
            else:
                self.digests.append(found)
            yield batch
        if self.complete and k + 1 != len(self.digests):
            self._refuse(f"it ended after {k + 1} batches, not {len(self.digests)}")
        self.complete = True

    def __len__(self) -> int:
        """The number of batches, where the dataset knows it (progress bars'
        ETA); ``TypeError`` where not, as for any iterable without one."""
        count = int(self.dataset.cardinality())
        if count < 0:
            raise TypeError("a dataset of unknown cardinality has no len()")
        return count

    def rebatched(self, size: int) -> Checked:
        """The same examples in batches of ``size``, checked afresh."""
        return Checked(self.dataset.unbatch().batch(size), self.argument)

    def _refuse(self, what: str) -> None:
        raise ValueError(
            f"{self.argument}: the dataset is read once per pass (per checkpoint, "
            f"per chunk of the other set), and pass {self.passes} differs from "
            f"the first: {what}. A result's row or column j must be the same "
            "example on every pass. A dataset made with shuffle() reshuffles on "
            "each iteration: use dataset.shuffle(..., "
            "reshuffle_each_iteration=False), or pass arrays."
        )


def checked(inputs: Any, argument: str) -> Any:
    """``inputs`` as a :class:`Checked` where it is a finite
    ``tf.data.Dataset`` (else as it is: arrays are the same on every pass, a
    generator is read once and kept, an infinite dataset is refused where it
    is read)."""
    if (
        isinstance(inputs, tf.data.Dataset)
        and int(inputs.cardinality()) != tf.data.INFINITE_CARDINALITY
    ):
        return Checked(inputs, argument)
    return inputs
