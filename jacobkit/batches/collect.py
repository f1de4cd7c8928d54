"""Beyond one batch: ``jacobian()`` over a dataset, in memory or into ``out=``.

``jacobian(model, inputs, layer, ...)`` comes here when ``inputs`` is a
``tf.data.Dataset`` or another iterable of batches (a generator, a
:func:`~jacobkit.batches.source.batches` view of an array), or when ``out=``
is given. For each batch it builds the per-batch
:class:`~jacobkit.problem.Problem` and runs the strategy through the same
path as a one-batch call (:mod:`jacobkit.engine`; ``strategy="auto"`` keeps
one planning session, made for the first batch's shapes, across the
batches, as it does across calls); then it accumulates or writes:

- ``outputs="features"`` (and a callable ``g(Y)`` whose rows do not depend on
  the batch size): the rows are summed over the whole dataset. The sum is
  kept in float64 and cast to the rows' dtype at the end.
- ``outputs="per_example"`` / ``"full"``: the rows of each batch follow those
  of the batch before, in dataset order: ``(N, F)`` rows for ``N`` examples.

A last, smaller batch is not planned for: it runs the strategy ``auto`` runs
next. With ``"per_example"``/``"full"`` rows and ``training=False`` it is
padded to the first batch's size (repeating its last example; the padding
rows are dropped), so nothing is traced again (see
:data:`jacobkit.batches.runners.PAD_LAST_BATCH` for the measured trade-off);
``"features"`` rows sum over the batch, so padding would change them, and
the smaller batch is traced once.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import tensorflow as tf

from jacobkit import engine
from jacobkit.batches import distribute, runners, source
from jacobkit.batches.fingerprint import fingerprint
from jacobkit.batches.manifest import EMPTY_CHAIN, TargetSpec, chain, digest_batch
from jacobkit.batches.store import Store
from jacobkit.keras import compat
from jacobkit.problem import Call, Problem, arguments
from jacobkit.problem.loss import Loss
from jacobkit.problem.solution import Stats
from jacobkit.result import JacobianResult


def jacobian_batches(call: Call, inputs: Any) -> JacobianResult:
    """:func:`jacobkit.jacobian` over the batches of ``inputs`` (see the module
    docstring). ``inputs`` that are one batch (arrays) are one batch here."""
    spread = call.distribute
    if spread is not None:
        distribute.check(spread, out=call.out)
    _check_reduce(call)
    replicas = None if spread is None else spread.num_replicas_in_sync
    how = reading(call)
    batches = source.open_source(inputs, call.steps, replicas, how)
    start = time.perf_counter()
    with engine.device_scope(call.device):
        first = next(batches.batches, None)
        if first is None:
            raise ValueError(
                "jacobian(inputs=...): the dataset has no batches, so there is "
                "nothing to differentiate."
            )
        source.check_batch(0, first, None, how)
        problem = call.problem(first)
        writer = _open_store(call, problem, first, batches.count)
        collector = Collector(
            problem,
            summed=call.summed or problem.reduction.sums_batches,
            writer=writer,
        )
        loop = _Loop(
            runner=_runner(call, problem),
            resume=_Resume(writer, call.out),
            collector=collector,
            start=start,
            rate=spread is None,
            reading=how,
        )
        loop.run(first, batches, progress=call.progress)
        collector.sums = loop.runner.all_sum(collector.sums)
        loop.resume.check_seen(loop.tally.batches)
    jacobians = collector.jacobians()
    tally, ran = loop.tally, loop.runner.ran()
    rows_shape = problem.rows_shape
    if not call.summed or problem.reduction.sums_batches:  # rows follow each other
        rows_shape = (tally.examples, *rows_shape[1:])
    return JacobianResult(
        jacobians=jacobians,
        rows_shape=rows_shape,
        strategy=ran.strategy,
        chunk_size=ran.chunk_size,
        stats=Stats(
            wall_time_s=time.perf_counter() - start,
            trace_time_s=tally.trace_s,
            traced=tally.traced,
            num_rows=tally.rows,
        ),
        roles=engine.target_roles(problem),
        plan=ran.plan,
        strategy_config=ran.config,
        reduce=call.reduce,
        norms=collector.norms(),
    )


def _check_reduce(call: Call) -> None:
    """Over a dataset, what the reduction refuses (:meth:`~jacobkit.problem.
    reduction.Reduction.check_batches`): a norm of rows summed over the
    batches is not their norms' sum; a clipped sum is kept in memory, on
    one host."""
    multi_worker = call.distribute is not None and distribute.is_multi_worker(
        call.distribute
    )
    call.reduction.check_batches(call, multi_worker=multi_worker)


def reading(call: Call) -> source.Reading:
    """How the batches are read: whole elements for loss rows (their labels),
    integers where the model declares integer inputs (token ids)."""
    try:
        declared = compat.declared_inputs(call.model)
    except ValueError:
        declared = []
    integers = any(
        tf.as_dtype(getattr(t, "dtype", "float32")).is_integer for t in declared
    )
    return source.Reading(whole=isinstance(call.outputs, Loss), integers=integers)


def _open_store(
    call: Call, problem: Problem, first: Any, count: int | None
) -> Store | None:
    """The ``out=`` directory (``None`` without ``out=``), for ``count``
    batches (``None``: unknown) like the ``first`` (arrays ``(B, ...)``)."""
    if call.out is None:
        return None
    summed = call.summed
    per_row = problem.rows_shape if summed else problem.rows_shape[1:]
    return Store(
        call.out,
        fingerprint=fingerprint(
            problem,
            outputs=call.outputs,
            strategy=engine.chosen(call),
            first=first,
            steps=call.steps,
        ),
        targets=[
            TargetSpec(name, per_row + _row_result(call, t), problem.output_dtype.name)
            for name, t in zip(problem.target_names, problem.targets, strict=True)
        ],
        kind="sum" if summed else "rows",
        num_batches=count,
        rows_capacity=None if count is None else count * source.batch_size(first),
        overwrite=call.overwrite,
    )


def _row_result(call: Call, target: Any) -> tuple[int, ...]:
    """What ``out=`` holds per row of a target: its Jacobian, its norm (no
    axes), or its part of the row's projection (``dim``)."""
    per_row = call.reduction.row_shape(target)
    assert per_row is not None, "a sum is not written out (check_batches)"
    return per_row


def _runner(call: Call, problem: Problem) -> runners.Runner:
    """What computes the batches: the replicas of ``distribute=``, or the
    device (``problem`` is the first batch's)."""
    if call.distribute is not None:
        return runners.OnReplicas(call, problem, call.distribute)
    return runners.OneDevice(call, problem)


class _Resume:
    """The batches an earlier, interrupted call into ``out=`` finished: they
    are skipped, but read again, to check they are the same inputs."""

    def __init__(
        self, writer: Store | None, out: str | os.PathLike[str] | None
    ) -> None:
        self.done = writer.batches_done if writer is not None else 0
        self.expected = writer.inputs_chain if writer is not None else EMPTY_CHAIN
        # only read where batches are done, which needs a directory
        self.out: str | os.PathLike[str] = out if out is not None else ""
        self._chain = EMPTY_CHAIN

    def skips(self, k: int, digest: str) -> bool:
        """Whether batch ``k`` (``digest``) is done already; raise if the
        batches done differ from those the earlier call wrote."""
        if k >= self.done:
            return False
        self._chain = chain(self._chain, digest)
        if k == self.done - 1 and self._chain != self.expected:
            raise ValueError(
                f"jacobian(out={os.fspath(self.out)!r}): the inputs differ "
                f"from those of the run that wrote it (within its "
                f"first {self.done} batches, which it finished). Pass "
                "overwrite=True to start afresh, or another out=."
            )
        return True

    def check_seen(self, seen: int) -> None:
        """Raise if the inputs had fewer batches (``seen``) than were done."""
        if seen < self.done:
            raise ValueError(
                f"jacobian(out={os.fspath(self.out)!r}): the directory counts "
                f"{self.done} batches done, but the inputs have only {seen}. Pass "
                "overwrite=True to start afresh, or another out=."
            )


@dataclass
class _Tally:
    """What the batches computed so far add up to."""

    batches: int = 0
    examples: int = 0
    rows: int = 0
    trace_s: float = 0.0
    traced: bool = False

    def add(self, computed: runners.Computed) -> None:
        self.rows += computed.rows
        self.trace_s += computed.trace_s
        self.traced = self.traced or computed.traced


@dataclass
class _Loop:
    """The batches, one after the other: checked, skipped if done (``out=``),
    computed by ``runner`` and handed to ``collector``; ``rate``: show rows/s."""

    runner: runners.Runner
    resume: _Resume
    collector: Collector
    start: float
    rate: bool
    reading: source.Reading

    tally: _Tally = field(default_factory=_Tally, init=False)

    def run(self, first: Any, batches: source.Source, *, progress: bool) -> None:
        """Every batch (``first``, then the rest of ``batches``)."""
        from tqdm import tqdm

        bar = tqdm(
            total=batches.count,
            unit="batch",
            desc="jacobian",
            delay=1.0,  # calls that take a moment show no bar
            disable=progress_disabled(progress),
            file=sys.stderr,
        )
        try:
            warned_non_finite = False
            for k, x in enumerate(_chained(first, batches.batches)):
                if k:
                    source.check_batch(k, x, first, self.reading)
                self.tally.batches = k + 1
                self.tally.examples += source.batch_size(x)
                digest = digest_batch(tf.nest.flatten(x))
                if self.resume.skips(k, digest):
                    bar.update(1)
                    continue
                if not warned_non_finite:
                    warned_non_finite = arguments.warn_non_finite(x, batch=k)
                self._collect(self.runner.submit(k, x, digest), bar)
            self._collect(self.runner.finish(), bar)
        finally:
            bar.close()

    def _collect(self, computed: list[runners.Computed], bar: Any) -> None:
        for batch in computed:
            self.tally.add(batch)
            if batch.values is not None:  # (else another worker's: in its sums)
                self.collector.add(batch.values, batch.digest)
                self.collector.add_norms(batch.norms)
            if self.rate:
                elapsed = max(time.perf_counter() - self.start, 1e-9)
                bar.set_postfix_str(
                    f"{self.tally.rows / elapsed:.0f} rows/s", refresh=False
                )
            bar.update(1)


def progress_disabled(progress: bool) -> bool | None:
    """tqdm's ``disable``: off on request and under pytest; ``None`` lets tqdm
    switch it off when the output is not a terminal."""
    if not progress or "PYTEST_CURRENT_TEST" in os.environ:
        return True
    return None


def _chained(first: Any, rest: Iterable[Any]) -> Iterable[Any]:
    yield first
    yield from rest


class Collector:
    """Where each batch's Jacobians go: float64 sums (``"features"``, a
    callable), or rows in dataset order, kept in memory or written to
    ``out=`` (:class:`~jacobkit.batches.store.Store`)."""

    def __init__(self, problem: Problem, *, summed: bool, writer: Store | None) -> None:
        self.names = problem.target_names
        self.dtype = problem.output_dtype
        self.summed = summed
        self.writer = writer
        #: the float64 sums so far (``summed``), resumed from ``out=``
        self.sums: list[np.ndarray] | None = writer.saved_sum() if writer else None
        self._parts: list[list[tf.Tensor]] = [[] for _ in self.names]
        #: each batch's rows' norms (``reduce=jk.ClippedSum``)
        self._norms: list[tf.Tensor] = []

    def add(self, values: Sequence[Any], digest: str) -> None:
        """One batch's Jacobians, each ``rows_shape + v.shape`` (per-example:
        its own examples' rows only); with ``out=`` it is then done."""
        if self.summed:
            if self.sums is None:
                self.sums = [np.zeros(v.shape, np.float64) for v in values]
            for total, v in zip(self.sums, values, strict=True):
                total += np.asarray(v, dtype=np.float64)
            if self.writer is not None:
                self.writer.write_sum(self.sums, digest)
        elif self.writer is not None:
            self.writer.write_rows([np.asarray(v) for v in values], digest)
        else:
            for part, v in zip(self._parts, values, strict=True):
                part.append(v)

    def add_norms(self, norms: Any) -> None:
        """One batch's rows' norms (a clipped sum's), kept in dataset order."""
        if norms is not None:
            self._norms.append(norms)

    def norms(self) -> Any:
        """Every row's norm, in dataset order (``None`` without them)."""
        if not self._norms:
            return None
        return tf.concat(self._norms, axis=0)

    def jacobians(self) -> dict[str, Any]:
        """Each target's Jacobians: memory-mapped files with ``out=``, else
        ``tf.Tensor`` (sums cast to the rows' dtype)."""
        if self.writer is not None:
            return self.writer.finish(self.sums if self.summed else None)
        if self.summed:
            assert self.sums is not None, "summed rows keep their sums"
            numpy_dtype = self.dtype.as_numpy_dtype
            return {
                name: tf.constant(s.astype(numpy_dtype))
                for name, s in zip(self.names, self.sums, strict=True)
            }
        return {
            name: tf.concat(part, axis=0) if len(part) > 1 else part[0]
            for name, part in zip(self.names, self._parts, strict=True)
        }
