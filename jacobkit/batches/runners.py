"""Compute one batch's Jacobians: on one device, or on the replicas of a
``tf.distribute.Strategy``.

Both runners take the batches one at a time (:meth:`submit`) and give back
:class:`Computed` batches, in dataset order, as soon as they are computed:
the one-device runner at once, the replicas' one group of
``num_replicas_in_sync`` batches at a time (the last group at
:meth:`finish`). What ran is described by :meth:`ran`.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import tensorflow as tf

from jacobkit import engine, strategies
from jacobkit.batches import distribute, source
from jacobkit.problem import Call, Problem, padding
from jacobkit.problem.plan import Plan
from jacobkit.problem.solution import Solver
from jacobkit.result import JacobianResult

logger = logging.getLogger(__name__)

#: Pad a smaller batch of per-example rows (``training=False``) to the first
#: batch's size instead of tracing the computation for its shape. Measured on
#: a loaded 2-core CPU, a last batch of 5 of 16 examples, per-example rows
#: (padded full batch / first call of the new shape): the mlp example 10 ms /
#: 637 ms (chunked), 7 / 428 ms (batch); the generator at 64x8x32x144:
#: 2340 / 1178 ms (chunked), 1132 / 1087 ms (batch). Neither wins everywhere
#: and either costs about one batch once per dataset. Padding is the rule
#: because it does not depend on timings: a run's numbers (a padded batch's
#: rows differ from an unpadded one's in the last float32 bits) must not
#: depend on how loaded the machine was, or a resumed run would not equal an
#: uninterrupted one bit for bit.
PAD_LAST_BATCH = True


@dataclass(frozen=True)
class Computed:
    """One batch done: its ``digest``; ``values``, each target's Jacobians
    ``rows_shape + v.shape`` for the batch's own examples (``None``: a batch
    another worker holds); the ``rows`` computed and the tracing it took."""

    digest: str
    values: list[Any] | None
    rows: int
    trace_s: float = 0.0
    traced: bool = False
    norms: Any = None


@dataclass(frozen=True)
class Ran:
    """What computed the batches, as the result names it."""

    strategy: str
    chunk_size: int | None
    config: strategies.Strategy | None
    plan: Plan[strategies.Strategy] | None


class Runner(Protocol):
    def submit(self, k: int, x: Any, digest: str) -> list[Computed]: ...

    def finish(self) -> list[Computed]: ...

    def all_sum(self, sums: list[np.ndarray] | None) -> list[np.ndarray] | None: ...

    def ran(self) -> Ran: ...


def _named(
    chosen: Solver[strategies.Strategy], plan: Plan[strategies.Strategy] | None
) -> Ran:
    """``chosen`` as what ran (where no batch ran here): a configured
    strategy with its options, ``auto`` by its name."""
    if isinstance(chosen, strategies.Strategy):
        return Ran(chosen.name, chosen.chunk_size, chosen, plan)
    return Ran(chosen.name, None, None, plan)


class OneDevice:
    """Each batch through :mod:`jacobkit.engine`, as a one-batch call runs it.

    ``auto`` keeps one planning session, made for the ``first`` batch's
    shapes, across the batches; a smaller batch runs what ``auto`` runs next.
    """

    def __init__(self, call: Call, first: Problem) -> None:
        self.call = call
        self.chosen = engine.chosen(call)
        self.first = first
        self.first_size = source.batch_size(first.inputs)
        self._last: JacobianResult | None = None
        self._plan: Plan[strategies.Strategy] | None = None

    def submit(self, k: int, x: Any, digest: str) -> list[Computed]:
        n = source.batch_size(x)
        clipping = self.first.reduction.sums_batches
        padded = (
            not self.call.summed
            and not clipping  # a padded example would join the clipped sum
            and PAD_LAST_BATCH
            and not self.call.training
            and n < self.first_size
        )
        # the clipped sum's own padding (weight 0, exact), where it asks
        x, examples = self.call.padded(
            padding.repeat_last(x, self.first_size) if padded else x
        )
        problem = self.call.problem(x)
        if examples is not None:  # padded: the loss must not see the batch size
            padding.check_batch_size(problem, examples)
        if problem.rows_shape != self.first.rows_shape and self.call.summed:
            raise ValueError(
                f"jacobian(outputs=...): batch {k} gives rows of shape "
                f"{problem.rows_shape}, batch 0 gave {self.first.rows_shape}; "
                "over a dataset, a callable's rows are summed, so they "
                "must not depend on the batch size."
            )
        logger.debug("computing batch %d", k)
        result = self._run(problem)
        if examples is not None:  # the clipped sum's padding: its norms dropped
            result = engine.trimmed(result, examples)
        self._last = result
        values = [result.jacobians[name] for name in self.first.target_names]
        stats = result.stats
        return [
            Computed(
                digest=digest,
                values=[v[:n] for v in values] if padded else values,
                norms=result.norms,
                # rows of this batch's examples (not of the padding)
                rows=problem.num_rows * n // max(n, source.batch_size(problem.inputs)),
                trace_s=stats.trace_time_s if stats.traced else 0.0,
                traced=stats.traced,
            )
        ]

    def _run(self, problem: Problem) -> JacobianResult:
        chosen = self.chosen
        if source.shapes(problem.inputs) == source.shapes(self.first.inputs):
            # auto's session for this shape: it keeps planning (and learning)
            # across the batches as across calls (a strategy has no plan)
            result = engine.run(problem, chosen)
            self._plan = result.plan
            return result
        # a smaller batch: what ran last (auto: what it runs next, not a new
        # session; a configured strategy: itself)
        following = None if self._last is None else self._last.strategy_config
        if following is None:  # (the earlier batches were done by another call)
            following = chosen.planned(self.first)
        return engine.run(problem, following)

    def finish(self) -> list[Computed]:
        return []

    def all_sum(self, sums: list[np.ndarray] | None) -> list[np.ndarray] | None:
        return sums

    def ran(self) -> Ran:
        last = self._last
        if last is None:
            return _named(self.chosen, self._plan)
        return Ran(last.strategy, last.chunk_size, last.strategy_config, self._plan)


@dataclass(frozen=True)
class _Pending:
    index: int
    x: Any
    size: int
    digest: str


class OnReplicas:
    """The batches in groups of ``num_replicas_in_sync``, one per replica
    (:mod:`jacobkit.batches.distribute`); ``auto`` runs the strategy it
    plans for the ``first`` batch everywhere."""

    def __init__(
        self,
        call: Call,
        first: Problem,
        strategy: tf.distribute.Strategy,
    ) -> None:
        self.call = call
        self.chosen = engine.chosen(call)
        self.first = first
        self.first_size = source.batch_size(first.inputs)
        self.strategy = strategy
        self._pending: list[_Pending] = []
        self._replicas: distribute.Replicas | None = None
        self._plan: Plan[strategies.Strategy] | None = None

    def submit(self, k: int, x: Any, digest: str) -> list[Computed]:
        self._pending.append(_Pending(k, x, source.batch_size(x), digest))
        if len(self._pending) == self.strategy.num_replicas_in_sync:
            return self.finish()
        return []

    def finish(self) -> list[Computed]:
        """Run the pending batches, one per replica."""
        pending, self._pending = self._pending, []
        if not pending:
            return []
        replicas = self._started()
        for p in pending:
            logger.debug("computing batch %d", p.index)
        results = replicas.run([p.x for p in pending])
        first, summed = self.first, self.call.summed
        computed = []
        for p, flat in zip(pending, results, strict=True):
            rows = distribute.piece_rows(
                first.num_rows, self.first_size, p.size, summed=summed
            )
            norms = None
            if flat is not None and self._clipping:  # sums, then the rows' norms
                flat, norms = flat[:-1], flat[-1][:rows]
            computed.append(
                Computed(
                    digest=p.digest,
                    values=None if flat is None else self._shaped(flat, p.size),
                    norms=norms,
                    rows=rows,
                )
            )
        return computed

    @property
    def _clipping(self) -> bool:
        """Whether the batches' results are added up, each row's norm beside
        (a clipped sum)."""
        return self.first.reduction.sums_batches

    def _started(self) -> distribute.Replicas:
        if self._replicas is None:
            # auto: its plan, and the strategy it plans (a strategy: itself)
            self._plan = self.chosen.plan(self.first)
            ran = self.chosen.planned(self.first)
            self._replicas = distribute.Replicas(
                self.strategy,
                ran.flat_computation(self.first),
                # a clipped sum's batches are not padded: a padded example
                # would join the sum
                summed=self.call.summed or self._clipping,
                batch_size=self.first_size,
            )
        return self._replicas

    def _shaped(self, flat: Sequence[np.ndarray], size: int) -> list[np.ndarray]:
        """Flat ``(R, *v.shape)`` Jacobians as ``rows_shape + v.shape`` (per
        example: the batch's ``size`` examples only)."""
        rows_shape = self.first.rows_shape
        kind = self.first.reduction
        values = []
        for f, t in zip(flat, self.first.targets, strict=True):
            per_row = kind.row_shape(t)
            if per_row is None:  # a sum, in the target's shape
                values.append(np.asarray(f))
            elif self.call.summed:
                values.append(np.reshape(f, rows_shape + per_row))
            else:
                values.append(np.reshape(f, (-1, *rows_shape[1:], *per_row))[:size])
        return values

    def all_sum(self, sums: list[np.ndarray] | None) -> list[np.ndarray] | None:
        """Every worker's sums added up (``"features"`` rows)."""
        if self._replicas is None or not self.call.summed:
            return sums
        rows_shape = self.first.rows_shape
        like = [np.zeros(rows_shape + tuple(t.shape)) for t in self.first.targets]
        return self._replicas.all_sum(sums, like)

    def ran(self) -> Ran:
        return _named(self.chosen, self._plan)
