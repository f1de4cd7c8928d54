"""Poisson sampling for DP-SGD: each example joins each step's batch
independently with probability ``q`` (the sampling the accountant's
``PoissonSampledDpEvent`` assumes), batches padded with weight-0 examples
to a few sizes.

:class:`PoissonSampler` is a ``keras.utils.PyDataset``, what ``fit`` takes
for data drawn by Python: ``len(sampler)`` steps per epoch (``round(1 /
q)`` by default, one expected pass over the data), step ``t`` of the run
drawn by NumPy's generator seeded with ``(seed, t)``, so a run is
reproducible whatever ``fit`` peeks at or prefetches.

Padding: a draw of ``n`` examples is padded to ``bucket(n)`` (four sizes
per doubling by default: ..., 32, 40, 48, 56, 64, 80, ...;
:func:`jacobkit.problem.padding.bucket`) by repeating its last example with
sample weight 0, so a compiled step traces a few times, once per size a
draw comes in (:mod:`jacobkit.privacy.sized`), not once per batch size. A
padded example adds exactly 0 to the clipped sum (its loss row is ``0 *
loss``), but costs as a real one.

Fewer sizes per doubling (``sizes_per_doubling=2``: ..., 32, 48, 64, 96,
...) trace fewer sizes over a run and pad more: for ``N = 512, q = 1/16``
(an expected batch of 32; ten sizes by default) a run meets about 4, 6 and
7.6 sizes in 10, 100 and 1000 steps with four per doubling, 2.6, 3.3 and
4.5 with two, whose padded batch is 11% larger on average (38.6 examples
against 34.7; the draw's mean is 32). Two per doubling pays where the
traces saved cost more than the padding: runs shorter than the traces'
time over the padding's time per step (see ``docs/privacy.md``). The sizes
(:attr:`PoissonSampler.sizes`) run from the bucket of the draw size the
binomial undershoots with probability :data:`SMALL` (smaller draws are
padded up to it: only cost) to the bucket of the size it exceeds with
probability :data:`OVERFLOW` per step. A draw larger than that stops the
run with an error, never cut: the draw's size does not depend on the data,
so the stop reveals nothing of it, and at worst it adds ``OVERFLOW`` per
step to ``delta`` (1e-10 per step: 1e-5 after 1e5 steps). An empty draw is
one example of weight 0 padded likewise (the step then applies the noise
alone, as it must: skipping it would leak that the draw was empty).

The expected batch size ``q * N``, not the draw's size, is what the noisy
sum is divided by (dividing by the draw's size would make the update depend
on it, which is not private).
"""

from __future__ import annotations

from typing import Any

import keras
import numpy as np
import tensorflow as tf

from jacobkit.privacy.accounting import check_parameters
from jacobkit.problem.padding import SIZES_PER_DOUBLING, bucket

#: the probability per step of a draw larger than the largest size
OVERFLOW = 1e-10
#: the probability per step of a draw smaller than the smallest size (padded
#: up to it)
SMALL = 1e-3


def padded_sizes(
    num_examples: int, sampling_rate: float, per_doubling: int = SIZES_PER_DOUBLING
) -> tuple[int, ...]:
    """The sizes a Poisson draw of ``binomial(num_examples, sampling_rate)``
    examples is padded to: every bucket (``per_doubling`` sizes per
    doubling) from the :data:`SMALL` quantile's to the ``1 - OVERFLOW``
    quantile's."""
    from scipy.stats import binom

    low = max(1, int(binom.ppf(SMALL, num_examples, sampling_rate)))
    high = max(low, int(binom.isf(OVERFLOW, num_examples, sampling_rate)) + 1)
    return tuple(sorted({bucket(n, per_doubling) for n in range(low, high + 1)}))


def _arrays(data: Any) -> tuple[Any, ...]:
    """``(x, y)`` or ``(x, y, sample_weight)`` as NumPy arrays (``x``
    nested as the model's inputs), from arrays or a finite ``tf.data`` set
    of single examples (read once into memory)."""
    if isinstance(data, tf.data.Dataset):
        if data.cardinality() == tf.data.INFINITE_CARDINALITY:
            raise ValueError(
                "jacobkit.privacy.PoissonSampler: the dataset is infinite; Poisson "
                "sampling draws from a finite set of N examples (pass the "
                "dataset before .repeat())."
            )
        elements = list(data.as_numpy_iterator())
        if not elements:
            raise ValueError("jacobkit.privacy.PoissonSampler: the dataset is empty.")
        data = tf.nest.map_structure(lambda *parts: np.stack(parts), *elements)
    if not isinstance(data, (tuple, list)) or len(data) not in (2, 3):
        raise ValueError(
            "jacobkit.privacy.PoissonSampler: expected (x, y) or (x, y, "
            "sample_weight), arrays of one example per row along their first "
            "axis, or a tf.data.Dataset of single (x, y) examples (unbatched); "
            f"got {type(data).__name__}."
        )
    found = tuple(tf.nest.map_structure(np.asarray, part) for part in data)
    lengths = {len(a) for a in tf.nest.flatten(found) if np.ndim(a)}
    if len(lengths) != 1 or any(np.ndim(a) == 0 for a in tf.nest.flatten(found)):
        raise ValueError(
            "jacobkit.privacy.PoissonSampler: x, y (and sample_weight) must hold "
            f"the same number of examples along their first axis; got {lengths}."
        )
    return found


class PoissonSampler(keras.utils.PyDataset):
    """Poisson-sampled, padded batches ``(x, y, sample_weight)`` for
    ``fit`` (see the module's docstring).

    Args:
        data: ``(x, y)`` or ``(x, y, sample_weight)`` arrays, ``N`` examples
            along the first axis (``x`` may be nested as the model's inputs),
            or a finite ``tf.data.Dataset`` of single ``(x, y)`` examples.
        sampling_rate: ``q`` in ``(0, 1]``.
        seed: seeds every draw (step ``t`` by ``(seed, t)``).
        steps_per_epoch: the batches of an epoch; ``round(1 / q)`` by default.
        sizes: the padded sizes, increasing (default: :func:`padded_sizes`);
            a draw above the largest stops the run (see the module's
            docstring: choose the largest with a negligible probability to
            be exceeded).
        sizes_per_doubling: the default sizes' spacing, a power of two: 4
            (..., 32, 40, 48, 56, 64, ...), or 2 (..., 32, 48, 64, ...),
            fewer traces for more padding (see the module's docstring); not
            with ``sizes``.
        **kwargs: ``keras.utils.PyDataset``'s (``workers``, ...).

    Attributes:
        num_examples: ``N``.
        expected_batch_size: ``q * N``, the divisor of the noisy sum.
    """

    def __init__(
        self,
        data: Any,
        sampling_rate: float,
        *,
        seed: int = 0,
        steps_per_epoch: int | None = None,
        sizes: tuple[int, ...] | None = None,
        sizes_per_doubling: int | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        if sizes_per_doubling is not None and (
            isinstance(sizes_per_doubling, bool)
            or not isinstance(sizes_per_doubling, int)
            or sizes_per_doubling < 1
            or sizes_per_doubling & (sizes_per_doubling - 1)
            or sizes is not None
        ):
            raise ValueError(
                "jacobkit.privacy.PoissonSampler(sizes_per_doubling="
                f"{sizes_per_doubling!r}): expected a power of two (1, 2, 4, "
                "8, ...), and no sizes= beside it (it spaces the default sizes)."
            )
        check_parameters(sampling_rate, 0.0)
        self.arrays = _arrays(data)
        self.num_examples = len(tf.nest.flatten(self.arrays[1])[0])
        self.sampling_rate = float(sampling_rate)
        self.seed = int(seed)
        self.steps_per_epoch = (
            max(1, round(1 / self.sampling_rate))
            if steps_per_epoch is None
            else int(steps_per_epoch)
        )
        #: the epoch whose steps are drawn (step ``t`` of the run is
        #: ``epoch * steps_per_epoch + index``)
        self.epoch = 0
        self._begun = False
        #: the padded sizes, smallest to largest (:func:`padded_sizes`)
        self.sizes = (
            padded_sizes(
                self.num_examples,
                self.sampling_rate,
                sizes_per_doubling or SIZES_PER_DOUBLING,
            )
            if sizes is None
            else tuple(int(s) for s in sizes)
        )
        if (
            not self.sizes
            or list(self.sizes) != sorted(set(self.sizes))
            or (self.sizes[0] < 1)
        ):
            raise ValueError(
                f"jacobkit.privacy.PoissonSampler(sizes={sizes!r}): expected "
                "increasing batch sizes >= 1."
            )

    @property
    def expected_batch_size(self) -> float:
        return self.sampling_rate * self.num_examples

    def __len__(self) -> int:
        return self.steps_per_epoch

    def indices(self, step: int) -> np.ndarray:
        """The examples drawn at step ``step`` of the run, shape ``(n,)``:
        each independently with probability ``q``."""
        rng = np.random.default_rng((self.seed, step))
        return np.flatnonzero(rng.random(self.num_examples) < self.sampling_rate)

    def size(self, n: int) -> int:
        """The padded size of a draw of ``n`` examples (a refusal above the
        largest: see the module's docstring)."""
        fits = [s for s in self.sizes if s >= n]
        if not fits:
            raise RuntimeError(
                f"jacobkit.privacy.PoissonSampler: a draw of {n} examples, above "
                f"the largest padded size {self.sizes[-1]} (a draw that large has "
                f"probability below {OVERFLOW:g} per step). The run stops here "
                "rather than cut the draw, which would change the sampling the "
                "accountant assumes; the steps taken keep their guarantee (with "
                "this probability added to delta). Start again with another seed."
            )
        return fits[0]

    def batch(self, indices: np.ndarray) -> tuple[Any, Any, np.ndarray]:
        """The examples ``indices`` as ``(x, y, sample_weight)`` padded to
        :meth:`size` examples, the padding of weight 0 (an empty draw: all
        of weight 0)."""
        n = len(indices)
        taken = indices if n else np.zeros((1,), np.int64)
        size = self.size(n)
        order = np.concatenate([taken, np.repeat(taken[-1:], size - len(taken))])
        x, y = (
            tf.nest.map_structure(lambda a: a[order], part) for part in self.arrays[:2]
        )
        given = (
            self.arrays[2][indices].astype(np.float32)
            if len(self.arrays) > 2
            else np.ones((n,), np.float32)
        )
        weights = np.zeros((size, *given.shape[1:]), np.float32)
        weights[:n] = given
        return x, y, weights

    def __getitem__(self, index: int) -> tuple[Any, Any, np.ndarray]:
        if not 0 <= index < self.steps_per_epoch:
            raise IndexError(index)
        return self.batch(self.indices(self.epoch * self.steps_per_epoch + index))

    def on_epoch_begin(self) -> None:
        """An epoch begins: its end moves the draws on (:meth:`on_epoch_end`)."""
        self._begun = True

    def on_epoch_end(self) -> None:
        """The next epoch draws the next steps of the run, where an epoch
        began (:meth:`on_epoch_begin`) since the last end.

        NOTE (why not every call). Keras's ``fit`` calls ``on_epoch_end``
        once more, before its first epoch (its epoch iterator's ``reset``):
        counted, a run's first step drew step ``steps_per_epoch``'s
        examples, not step 0's, and the steps of a run were not those
        ``(seed, t)`` names. A loop of one's own calls
        ``on_epoch_begin()`` and ``on_epoch_end()`` around each epoch."""
        if self._begun:
            self.epoch += 1
            self._begun = False
