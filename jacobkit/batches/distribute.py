"""``distribute=``: the batches of a dataset across ``tf.distribute`` replicas.

``jacobian(model, dataset, layer, distribute=strategy)`` hands the batches
out in groups of ``strategy.num_replicas_in_sync``: in each group, replica
``i`` computes the Jacobians of batch ``group × replicas + i`` with
``strategy.run`` (the same compiled computation a one-device call runs,
placed on the replica's device), and the results are taken back in batch
order. Per-example batches smaller than the first are padded to its size
(repeating their last example; the padding rows are dropped), so that one
computation serves every replica:

- ``tf.distribute.MirroredStrategy`` (several GPUs, or logical CPU devices of
  one host): every replica is local; its results are read with
  ``experimental_local_results``, and summed (float64, in batch order) or
  written exactly as a one-device call does.
- ``tf.distribute.MultiWorkerMirroredStrategy`` (hosts listed in
  ``TF_CONFIG``): every worker runs the same call on the same dataset and
  computes only its own replicas' batches. Per-example rows are collected on
  every worker with ``strategy.gather`` after each group;
  ``"features"`` sums are kept per worker and gathered once at the end. Every
  worker's call returns the full result, in memory.

Arrays (one batch) are split into one batch per replica first.

``auto`` picks its starting strategy (``jacobkit.plan``) on the first batch,
for the first replica's device (a plan cached on disk gives the strategy that
won earlier); every replica then runs it (no switching, no back-off).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import tensorflow as tf

from jacobkit.problem.padding import repeat_last

logger = logging.getLogger(__name__)


def is_multi_worker(strategy: tf.distribute.Strategy) -> bool:
    """Whether ``strategy`` spans more than one worker (process)."""
    return bool(getattr(strategy.extended, "_num_workers", 1) > 1)


def check(strategy: Any, *, out: Any) -> None:
    """Raise a clear error for what ``distribute=`` does not take."""
    if not isinstance(strategy, tf.distribute.Strategy):
        raise TypeError(
            f"jacobian(distribute={strategy!r}): expected a tf.distribute.Strategy "
            "(tf.distribute.MirroredStrategy() for the devices of this host, "
            "tf.distribute.MultiWorkerMirroredStrategy() for several hosts), "
            f"got {type(strategy).__name__}."
        )
    if out is not None and is_multi_worker(strategy):
        raise ValueError(
            f"jacobian(distribute=MultiWorkerMirroredStrategy, out={out!r}): "
            "writing one directory from several workers is not supported; "
            "every worker returns the full result in memory. Drop out=, or use "
            "MirroredStrategy on one host with out=."
        )


def piece_rows(num_rows: int, padded: int, size: int, *, summed: bool) -> int:
    """The rows of a piece of ``size`` examples, where a piece of ``padded``
    examples (what every replica computes, :class:`Replicas`) has
    ``num_rows``: per-example rows scale with the examples, the rest of a
    padded piece's are cut; rows summed over the batch are ``num_rows``."""
    return num_rows if summed else num_rows // padded * size


class Replicas:
    """Runs a compiled Jacobian computation on every replica of ``strategy``.

    Args:
        strategy: the ``tf.distribute.Strategy``.
        compute: ``inputs -> [flat Jacobian (R, *v.shape) per target]`` (a
            strategy's compiled computation).
        rows_shape: shape the flat rows of a full batch take.
        summed: ``"features"``-like rows (summed over batches).
        batch_size: the first batch's size (per-example batches are padded to
            it for ``gather``).
    """

    def __init__(
        self,
        strategy: tf.distribute.Strategy,
        compute: Callable[[Any], Sequence[tf.Tensor]],
        *,
        summed: bool,
        batch_size: int,
    ) -> None:
        self.strategy = strategy
        self.summed = summed
        self.batch_size = batch_size
        self.num_replicas = strategy.num_replicas_in_sync
        self.multi_worker = is_multi_worker(strategy)

        self._compute = compute
        self._traced: set[Any] = set()

        def step(replica_id, x):
            # a leading replica axis, along which strategy.gather stacks
            return replica_id, [tf.expand_dims(j, 0) for j in compute(x)]

        self._step = step

    def _trace(self, x: Any) -> None:
        """Trace ``compute`` for ``x``'s shapes before the replicas call it:
        replicas call it concurrently, and two traces of one function at once
        (two batch sizes in one group) mixed their gradients' shapes."""
        specs = tf.nest.map_structure(
            lambda a: tf.TensorSpec(np.shape(a), tf.as_dtype(np.asarray(a).dtype)), x
        )
        key = tuple((tuple(s.shape), s.dtype) for s in tf.nest.flatten(specs))
        if key not in self._traced and hasattr(self._compute, "get_concrete_function"):
            self._compute.get_concrete_function(specs)
            self._traced.add(key)

    def run(self, batches: list[Any]) -> list[list[np.ndarray] | None]:
        """The flat Jacobians of each of ``batches`` (at most one per
        replica), in order; ``None`` for a batch another worker computed
        (``"features"`` rows on several workers: see :meth:`all_sum`)."""
        count = len(batches)
        if count > self.num_replicas:
            raise ValueError(f"{count} batches for {self.num_replicas} replicas")
        # replicas with no batch of their own in the last group repeat the
        # first one; their results are dropped
        filled = [
            batches[min(i, count - 1)] if i < count else batches[0]
            for i in range(self.num_replicas)
        ]
        if not self.summed:  # one computation for per-example rows of B examples
            filled = [repeat_last(x, self.batch_size) for x in filled]

        for x in filled:
            self._trace(x)

        def value(context):
            i = context.replica_id_in_sync_group
            x = tf.nest.map_structure(tf.constant, filled[i])
            return tf.constant(i), x

        values = self.strategy.experimental_distribute_values_from_function(value)
        replica_ids, jacobians = self.strategy.run(self._step, args=values)
        results: list[list[np.ndarray] | None] = [None] * count
        if self.multi_worker and not self.summed:
            gathered = [self.strategy.gather(j, axis=0).numpy() for j in jacobians]
            for i in range(count):
                n = int(tf.nest.flatten(batches[i])[0].shape[0])
                rows = gathered[0].shape[1] // self.batch_size * n
                results[i] = [g[i][:rows] for g in gathered]
            return results
        local_ids = self.strategy.experimental_local_results(replica_ids)
        local = [self.strategy.experimental_local_results(j) for j in jacobians]
        for position, replica in enumerate(local_ids):
            i = int(replica)
            if i < count:
                results[i] = [np.asarray(values_[position])[0] for values_ in local]
                logger.debug("replica %d computed on %s", i, local[0][position].device)
        return results

    def all_sum(
        self, sums: list[np.ndarray] | None, like: list[Any]
    ) -> list[np.ndarray]:
        """Every worker's float64 sums added up (in worker order), on every
        worker; the sums themselves on one worker."""
        if not self.multi_worker:
            assert sums is not None, "one worker always has its sums"
            return sums
        local = (
            sums if sums is not None else [np.zeros(v.shape, np.float64) for v in like]
        )

        def value(context):
            # one worker's sums on its first local replica, zeros elsewhere
            first = (
                context.replica_id_in_sync_group
                % len(self.strategy.extended.worker_devices)
                == 0
            )
            return [
                tf.constant((s if first else np.zeros_like(s))[None]) for s in local
            ]

        per_replica = self.strategy.experimental_distribute_values_from_function(value)
        return [
            self.strategy.gather(s, axis=0).numpy().sum(axis=0) for s in per_replica
        ]
