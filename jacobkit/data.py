"""Beyond one batch: ``jacobian()`` over a dataset, in memory or into ``out=``.

``jacobian(model, inputs, layer, ...)`` comes here when ``inputs`` is a
``tf.data.Dataset`` or another iterable of batches (a generator, a
:func:`batches` view of an array), or when ``out=`` is given. For each batch
it builds the per-batch :class:`~jacobkit.problem.Problem` and runs the
strategy through the same path as a one-batch call (``strategy="auto"``
keeps one planning session, made for the first batch's shapes, across the
batches, as it does across calls); then it accumulates or writes:

- ``outputs="features"`` (and a callable ``g(Y)`` whose rows do not depend on
  the batch size): the rows are summed over the whole dataset. The sum is
  kept in float64 and cast to the rows' dtype at the end.
- ``outputs="per_example"`` / ``"full"``: the rows of each batch follow those
  of the batch before, in dataset order: ``(N, F)`` rows for ``N`` examples.

A last, smaller batch is not planned for: it runs the strategy ``auto`` runs
next. With
``"per_example"``/``"full"`` rows and ``training=False`` it is padded to the
first batch's size (repeating its last example; the padding rows are
dropped), so nothing is traced again (see :data:`PAD_LAST_BATCH` for the
measured trade-off); ``"features"`` rows sum over the batch, so padding would
change them, and the smaller batch is traced once.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import sys
import time
import warnings
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import numpy as np
import tensorflow as tf

from jacobkit import distribute as distributing
from jacobkit import planner, store, strategies
from jacobkit.problem import Problem
from jacobkit.result import JacobianResult, Stats

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


def is_batches(inputs: Any) -> bool:
    """Whether ``inputs`` is a dataset or iterable of batches (not the arrays
    of one batch: a list, tuple or dict is a multi-input model's inputs)."""
    if isinstance(inputs, tf.data.Dataset):
        return True
    # a tf.Variable is iterable too, but it is one batch (USERS.md case 4)
    return isinstance(inputs, Iterable) and not isinstance(
        inputs, (list, tuple, dict, np.ndarray, tf.Tensor, tf.Variable, str, bytes)
    )


# -- the source of batches -----------------------------------------------------
def _features_of(element: Any) -> Any:
    """``x`` of a dataset element: ``(x, y)`` and ``(x, y, w)`` tuples give
    ``x``, anything else is ``x`` itself (Keras' convention)."""
    if isinstance(element, tuple) and 1 <= len(element) <= 3:
        return element[0]
    return element


def _count(inputs: Any, steps: int | None) -> int | None:
    """The number of batches (``None`` if unknown), checked before any work."""
    if steps is not None and (
        isinstance(steps, bool) or not isinstance(steps, (int, np.integer))
    ):
        raise TypeError(f"jacobian(steps={steps!r}): expected a positive int or None.")
    if steps is not None and steps < 1:
        raise ValueError(
            f"jacobian(steps={steps}): must be >= 1 (the number of batches to "
            "take from the dataset), or None for all of them."
        )
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
        spec = _features_of(inputs.element_spec)
        for s in tf.nest.flatten(spec):
            if not isinstance(s, tf.TensorSpec) or not s.dtype.is_floating:
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


def _iterate(inputs: Any, steps: int | None) -> Iterator[Any]:
    """Each batch's ``x``, as NumPy arrays (nested like the model's inputs)."""
    if isinstance(inputs, tf.data.Dataset):
        source = inputs.take(steps) if steps is not None else inputs
        for element in source:
            yield tf.nest.map_structure(np.asarray, _features_of(element))
        return
    for k, element in enumerate(inputs):
        if steps is not None and k >= steps:
            return
        yield tf.nest.map_structure(np.asarray, _features_of(element))


def _check_batch(k: int, x: Any, first: Any) -> None:
    """Each batch: float arrays, one batch axis, shapes like the first batch's."""
    flat = tf.nest.flatten(x)
    for a in flat:
        if a.dtype.kind != "f":
            raise TypeError(
                f"jacobian(inputs=...): batch {k} holds {a.dtype} values; "
                "Jacobians need float inputs. Cast the batches to float32."
            )
        if a.ndim == 0:
            raise ValueError(
                f"jacobian(inputs=...): batch {k} is a scalar; each batch needs a "
                "leading batch axis (shape (B, ...))."
            )
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


def _pad(x: Any, size: int) -> Any:
    """``x`` with its last example repeated up to ``size`` examples."""

    def pad(a):
        extra = np.repeat(a[-1:], size - a.shape[0], axis=0)
        return np.concatenate([a, extra], axis=0)

    return tf.nest.map_structure(pad, x)


def _non_finite(x: Any) -> int:
    """How many NaN/Inf values the float arrays or tensors of ``x`` hold."""
    count = 0
    for a in tf.nest.flatten(x):
        if (
            isinstance(a, tf.Tensor)
            and a.dtype in (tf.float16, tf.float32, tf.float64)
            and ":CPU:" in getattr(a, "device", "")
        ):
            a = a.numpy()  # shares the CPU buffer; NumPy counts ~10x faster
        if isinstance(a, tf.Tensor):
            if a.dtype.is_floating:
                finite = tf.math.count_nonzero(tf.math.is_finite(a))
                count += int(tf.size(a, out_type=tf.int64) - finite)
        elif np.asarray(a).dtype.kind == "f":
            count += int(np.size(a) - np.count_nonzero(np.isfinite(a)))
    return count


def warn_non_finite(inputs: Any, batch: int | None = None, stacklevel: int = 3) -> bool:
    """Warn once if ``inputs`` hold NaN or Inf (they reach the rows: with
    ``outputs="features"`` every row would be NaN); whether it warned."""
    bad = _non_finite(inputs)
    if bad:
        where = "the inputs hold" if batch is None else f"batch {batch} holds"
        later = "" if batch is None else " Later batches are not reported."
        warnings.warn(
            f"jacobian(inputs=...): {where} {bad} NaN/Inf value(s); the "
            "Jacobians of every row they reach are NaN (with "
            f"outputs='features', every row).{later}",
            RuntimeWarning,
            stacklevel=stacklevel + 1,
        )
    return bool(bad)


# -- fingerprints of the call --------------------------------------------------
def _model_fingerprint(model: Any) -> str:
    """sha256 over the model's class and every weight (name, shape, values)."""
    h = hashlib.sha256(type(model).__qualname__.encode())
    weights = getattr(model, "weights", None)
    if weights is None:
        weights = getattr(model, "variables", ())
    for w in weights:
        name = getattr(w, "path", None) or getattr(w, "name", "")
        value = np.ascontiguousarray(np.asarray(w))
        h.update(f"{name}{value.dtype.str}{value.shape}".encode())
        h.update(memoryview(value).cast("B"))
    return h.hexdigest()[:32]


def _fingerprint(
    problem: Problem,
    *,
    outputs: Any,
    strategy: Any,
    first: Any,
    steps: int | None,
) -> dict[str, Any]:
    mode = (
        outputs
        if isinstance(outputs, str)
        else getattr(outputs, "__qualname__", type(outputs).__name__)
    )
    return {
        "model": _model_fingerprint(problem.model),
        "targets": [
            [name, list(t.shape), t.dtype.name]
            for name, t in zip(problem.target_names, problem.targets, strict=True)
        ],
        "rows": {
            "outputs": mode,
            "features": list(problem.rows_spec.features)
            if problem.rows_spec.features is not None
            else None,
            "training": problem.training,
            "unconnected": problem.unconnected,
        },
        "strategy": strategy if isinstance(strategy, str) else strategy.label,
        "inputs": {
            "structure": json.loads(
                json.dumps(
                    tf.nest.map_structure(
                        lambda a: [list(a.shape[1:]), a.dtype.name], first
                    ),
                    default=str,
                )
            ),
            "batch_size": int(tf.nest.flatten(first)[0].shape[0]),
            "steps": steps,
        },
    }


# -- the run -------------------------------------------------------------------
def _progress_disabled(progress: bool) -> bool | None:
    """tqdm's ``disable``: off on request and under pytest; ``None`` lets tqdm
    switch it off when the output is not a terminal."""
    if not progress or "PYTEST_CURRENT_TEST" in os.environ:
        return True
    return None


class _Collector:
    """Where each batch's Jacobians go: float64 sums (``"features"``, a
    callable), or rows in dataset order, kept in memory or written to
    ``out=`` (:class:`~jacobkit.store.Store`)."""

    def __init__(
        self, problem: Problem, *, summed: bool, writer: store.Store | None
    ) -> None:
        self.names = problem.target_names
        self.dtype = problem.output_dtype
        self.summed = summed
        self.writer = writer
        #: the float64 sums so far (``summed``), resumed from ``out=``
        self.sums: list[np.ndarray] | None = writer.saved_sum() if writer else None
        self._parts: list[list[tf.Tensor]] = [[] for _ in self.names]

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

    def jacobians(self) -> dict[str, Any]:
        """Each target's Jacobians: memory-mapped files with ``out=``, else
        ``tf.Tensor`` (sums cast to the rows' dtype)."""
        if self.writer is not None:
            return self.writer.finish(self.sums if self.summed else None)
        if self.summed:
            numpy_dtype = self.dtype.as_numpy_dtype
            return {
                name: tf.constant(s.astype(numpy_dtype))
                for name, s in zip(self.names, self.sums, strict=True)
            }
        return {
            name: tf.concat(part, axis=0) if len(part) > 1 else part[0]
            for name, part in zip(self.names, self._parts, strict=True)
        }


def jacobian_batches(
    model: Any,
    inputs: Any,
    layer: Any,
    *,
    strategy: str | strategies.Strategy,
    outputs: str | Callable[[Any], tf.Tensor],
    features: Sequence[int] | None,
    training: bool,
    unconnected: str,
    memory_budget: Any,
    device: str | None,
    steps: int | None = None,
    out: str | os.PathLike | None = None,
    overwrite: bool = False,
    progress: bool = True,
    distribute: tf.distribute.Strategy | None = None,
    cache: bool = True,
    output: int | str | None = None,
    reduce: str | None = None,
) -> JacobianResult:
    """:func:`jacobkit.jacobian` over the batches of ``inputs`` (see the module
    docstring). ``inputs`` that are one batch (arrays) are one batch here."""
    from tqdm import tqdm

    from jacobkit import api

    if reduce is not None:
        raise ValueError(
            f"jacobian(reduce={reduce!r}): norms are computed for one batch in "
            "memory only (the norm of a sum over batches is not the sum of "
            "their norms); drop out=/distribute=, or pass one batch of arrays."
        )
    chosen = None if strategy == "auto" else strategies.get(strategy)
    if distribute is not None:
        distributing.check(distribute, out=out)
    if is_batches(inputs):
        count = _count(inputs, steps)
        source = _iterate(inputs, steps)
    elif distribute is not None:  # one batch: its examples across replicas
        arrays = tf.nest.map_structure(np.asarray, inputs)
        size = int(tf.nest.flatten(arrays)[0].shape[0])
        split = batches(arrays, -(-size // distribute.num_replicas_in_sync))
        count, source = len(split), iter(split)
    else:
        count = 1
        source = iter([tf.nest.map_structure(np.asarray, inputs)])
    summed = not (isinstance(outputs, str) and outputs in ("per_example", "full"))

    def build(x: Any) -> Problem:
        return Problem(
            model,
            x,
            layer,
            outputs=outputs,
            features=features,
            training=training,
            unconnected=unconnected,
            output=output,
        )

    start_time = time.perf_counter()
    with api._device_scope(device):
        first = next(source, None)
        if first is None:
            raise ValueError(
                "jacobian(inputs=...): the dataset has no batches, so there is "
                "nothing to differentiate."
            )
        _check_batch(0, first, None)
        first_size = int(tf.nest.flatten(first)[0].shape[0])
        problem = build(first)
        rows_shape0 = problem.rows_shape
        per_row = problem.rows_shape if summed else problem.rows_shape[1:]
        writer = None
        if out is not None:
            writer = store.Store(
                out,
                fingerprint=_fingerprint(
                    problem,
                    outputs=outputs,
                    strategy=strategy,
                    first=first,
                    steps=steps,
                ),
                targets=[
                    (name, per_row + tuple(t.shape), problem.output_dtype.name)
                    for name, t in zip(
                        problem.target_names, problem.targets, strict=True
                    )
                ],
                kind="sum" if summed else "rows",
                num_batches=count,
                rows_capacity=None if count is None else count * first_size,
                overwrite=overwrite,
            )
        done = writer.batches_done if writer is not None else 0
        collected = _Collector(problem, summed=summed, writer=writer)
        chain = store.EMPTY_CHAIN
        plan = None
        ran_strategy = chosen
        trace = 0.0
        traced = False
        rows_computed = 0
        num_examples = 0
        warned_non_finite = False

        replicas = None
        pending: list[tuple[int, Any, int, str]] = []

        def flush_replicas() -> None:
            """Run the pending batches, one per replica, and deliver them."""
            nonlocal replicas, plan, rows_computed
            if not pending:
                return
            if replicas is None:
                ran = chosen
                if ran is None:
                    plan = planner.plan_problem(
                        problem,
                        memory_budget=memory_budget,
                        device=device,
                        cache=cache,
                    )
                    ran = plan.strategy
                replicas = distributing.Replicas(
                    distribute,
                    ran.compiled_for(problem).fn,
                    summed=summed,
                    batch_size=first_size,
                )
            for k, *_ in pending:
                logger.debug("computing batch %d", k)
            results = replicas.run([x for _, x, _, _ in pending])
            for (_, _, n, digest), flat in zip(pending, results, strict=True):
                rows_computed += (
                    problem.num_rows if summed else problem.num_rows // first_size * n
                )
                if flat is None:  # another worker's batch: in its sums
                    continue
                values = []
                for f, t in zip(flat, problem.targets, strict=True):
                    if summed:
                        values.append(np.reshape(f, rows_shape0 + tuple(t.shape)))
                    else:
                        shape = (-1, *rows_shape0[1:], *t.shape)
                        values.append(np.reshape(f, shape)[:n])
                collected.add(values, digest)
            bar.update(len(pending))
            pending.clear()

        bar = tqdm(
            total=count,
            unit="batch",
            desc="jacobian",
            delay=1.0,  # calls that take a moment show no bar
            disable=_progress_disabled(progress),
            file=sys.stderr,
        )
        k = -1
        try:
            for k, x in enumerate(_chain_first(first, source)):
                if k:
                    _check_batch(k, x, first)
                n = int(tf.nest.flatten(x)[0].shape[0])
                num_examples += n
                digest = store.digest_batch(tf.nest.flatten(x))
                if k < done:  # done by an earlier, interrupted call
                    chain = store.chain(chain, digest)
                    if k == done - 1 and chain != writer.inputs_chain:
                        raise ValueError(
                            f"jacobian(out={os.fspath(out)!r}): the inputs differ "
                            f"from those of the run that wrote it (within its "
                            f"first {done} batches, which it finished). Pass "
                            "overwrite=True to start afresh, or another out=."
                        )
                    bar.update(1)
                    continue
                if not warned_non_finite:
                    warned_non_finite = warn_non_finite(x, batch=k, stacklevel=4)
                if distribute is not None:
                    pending.append((k, x, n, digest))
                    if len(pending) == distribute.num_replicas_in_sync:
                        flush_replicas()
                    continue
                padded = (
                    not summed and PAD_LAST_BATCH and not training and n < first_size
                )
                batch_problem = build(_pad(x, first_size) if padded else x)
                if batch_problem.rows_shape != rows_shape0 and summed:
                    raise ValueError(
                        f"jacobian(outputs=...): batch {k} gives rows of shape "
                        f"{batch_problem.rows_shape}, batch 0 gave {rows_shape0}; "
                        "over a dataset, a callable's rows are summed, so they "
                        "must not depend on the batch size."
                    )
                logger.debug("computing batch %d", k)
                if chosen is not None:
                    result = api.run_strategy(batch_problem, chosen)
                elif _shapes(batch_problem.inputs) == _shapes(problem.inputs):
                    # auto's session for this shape: it keeps planning (and
                    # learning) across the batches as across calls
                    result = api.run_auto(
                        batch_problem,
                        memory_budget=memory_budget,
                        device=device,
                        cache=cache,
                    )
                    plan = result.plan
                else:
                    # a smaller batch: what auto runs next, not a new session
                    if isinstance(ran_strategy, JacobianResult):
                        following = ran_strategy.strategy_config
                    else:  # (the earlier batches were done by another call)
                        following = planner.plan_problem(
                            problem,
                            memory_budget=memory_budget,
                            device=device,
                            cache=cache,
                        ).strategy
                    result = api.run_strategy(batch_problem, following)
                ran_strategy = result
                trace += result.stats.trace_time_s if result.stats.traced else 0.0
                traced = traced or result.stats.traced
                # rows of this batch's examples (not of the padding)
                rows_computed += (
                    batch_problem.num_rows
                    * n
                    // max(n, int(tf.nest.flatten(batch_problem.inputs)[0].shape[0]))
                )
                values = [result.jacobians[name] for name in problem.target_names]
                collected.add([v[:n] for v in values] if padded else values, digest)
                bar.set_postfix_str(
                    f"{rows_computed / max(time.perf_counter() - start_time, 1e-9):.0f}"
                    " rows/s",
                    refresh=False,
                )
                bar.update(1)
            flush_replicas()
        finally:
            bar.close()
        if replicas is not None and summed:
            like = [np.zeros(rows_shape0 + tuple(t.shape)) for t in problem.targets]
            collected.sums = replicas.all_sum(collected.sums, like)
        if k + 1 < done:
            raise ValueError(
                f"jacobian(out={os.fspath(out)!r}): the directory counts {done} "
                f"batches done, but the inputs have only {k + 1}. Pass "
                "overwrite=True to start afresh, or another out=."
            )
    jacobians = collected.jacobians()
    total_rows_shape = rows_shape0 if summed else (num_examples, *rows_shape0[1:])
    shown = ran_strategy if isinstance(ran_strategy, JacobianResult) else None
    roles = {role: problem.target_names[i] for role, i in problem.roles.items()}
    return JacobianResult(
        jacobians=jacobians,
        rows_shape=total_rows_shape,
        strategy=shown.strategy if shown else (chosen.name if chosen else "auto"),
        chunk_size=shown.chunk_size
        if shown
        else (chosen.chunk_size if chosen else None),
        stats=Stats(
            wall_time_s=time.perf_counter() - start_time,
            trace_time_s=trace,
            traced=traced,
            num_rows=rows_computed,
        ),
        roles=roles,
        plan=plan,
        strategy_config=shown.strategy_config if shown else chosen,
    )


def _chain_first(first: Any, rest: Iterator[Any]) -> Iterator[Any]:
    yield first
    yield from rest


def _shapes(inputs: Any) -> tuple:
    return tuple(tuple(t.shape) for t in tf.nest.flatten(inputs))
