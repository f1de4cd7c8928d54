"""``auto``: the fastest strategy and chunk size that fit a memory budget.

How a plan is made (nothing of the full Jacobian's size is allocated):

1. The budget (``memory_budget``; default :data:`jacobkit.memory.
   DEFAULT_BUDGET_FRACTION` of free device memory) is checked against the
   result itself, ``R × P × itemsize`` (P = parameters of the targets), and a
   budget that cannot hold it is refused with the bytes needed.
2. Short probes run the ``chunked`` computation on the first few rows only
   (three chunks of ``c`` rows, for ``c = 1`` and for the largest ``c <= 32``
   that the budget safely allows) and measure the peak memory and the steady
   time per chunk; one more runs ``while`` (``tape.jacobian`` without pfor)
   on the first 8 rows, with as many rows in flight (``parallel_iterations``,
   at most TensorFlow's 10) as the budget holds twice their one-row peaks,
   and one measures the forward pass alone.
3. Peak memory is modelled as ``fixed + per_row × c + result``, and time as
   ``forward + ceil(R / c) × (chunk_fixed + chunk_per_row × c)``, both fitted
   to the probes. When the budget only allows a probe of fewer than 8 rows,
   memory per row is taken as the forward pass's activations
   (:func:`activation_bytes`), an upper bound. The plan is the chunk size with
   the least predicted time whose predicted peak fits the budget (with
   :data:`SAFETY` headroom), or ``while`` (``forward + R × time per row``,
   peak at most one one-row peak per row in flight) if that is predicted
   faster and fits.

Where the ``batch`` strategy applies, it is probed on the first few output
features and its time and peak scaled to all of them; it is chosen if
predicted faster and to fit.

Candidates that fit and are predicted within :data:`RACE_MARGIN` of the
fastest (the best chunk size, ``while``, ``batch``) form the plan's
shortlist: ``jacobian(strategy="auto")`` races them on its first calls and
then keeps the one that was fastest (:mod:`jacobkit.race`).

At run time an out-of-memory error halves the chunk size (or the rows in
flight) and retries (:func:`run_plan`), warns once, and remembers what
worked.
"""

from __future__ import annotations

import math
import time
import warnings
import weakref
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
import tensorflow as tf

from jacobkit import memory, strategies
from jacobkit.problem import Problem, per_model
from jacobkit.race import Race

#: the plan keeps its predicted peak below this fraction of the budget: the
#: linear memory model was measured within ~10% of real peaks (see the
#: benchmark results), the rest is allocator fragmentation.
SAFETY = 0.85

#: the larger probe's chunk has at most this many rows
_PROBE_MAX_ROWS = 32
#: a probe of at least this many rows measures the per-row memory reliably
_TRUSTED_SLOPE_ROWS = 8
#: each chunk probe runs at least this many rows (a one-row chunk is short:
#: with fewer rows the forward pass's timing noise swamps it)
_PROBE_MIN_ROWS = 8
#: the batch probe vectorizes over this many output features
_BATCH_PROBE_FEATURES = 8
#: the ``while`` probe runs this many rows
_WHILE_PROBE_ROWS = 8
#: TensorFlow's default ``parallel_iterations`` of a while loop
_WHILE_MAX_PARALLEL = 10
#: each probe runs this many chunks (fewer if the problem has fewer rows)
_PROBE_CHUNKS = 3
#: candidates predicted within this factor of the fastest are raced on the
#: first real calls (see :mod:`jacobkit.race`): on a busy machine probe times
#: moved by up to ~1.3x between runs
RACE_MARGIN = 1.5

_PLANS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_WORKED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


@dataclass(frozen=True)
class Plan:
    """What ``auto`` chose, and why.

    Attributes:
        strategy: the configured strategy to run.
        budget_bytes: the memory budget planned for.
        predicted_peak_bytes: predicted peak memory above the baseline.
        predicted_time_s: predicted steady-state time of one call.
        result_bytes: size of the Jacobians themselves.
        rejected: ``(label, reason)`` for each candidate not chosen.
        probes: what the probes measured,
            ``{"chunk c": (peak bytes, seconds per chunk)}``.
    """

    strategy: strategies.Strategy
    budget_bytes: int
    predicted_peak_bytes: int | None = None
    predicted_time_s: float | None = None
    result_bytes: int = 0
    rejected: list[tuple[str, str]] = field(default_factory=list)
    probes: dict[str, Any] = field(default_factory=dict)
    race: Race | None = field(default=None, compare=False, repr=False)

    @property
    def chunk_size(self) -> int | None:
        return self.strategy.chunk_size

    @property
    def shortlist(self) -> tuple[strategies.Strategy, ...]:
        """The candidates raced against :attr:`strategy` on the first calls."""
        return tuple(self.race.candidates[1:]) if self.race is not None else ()

    def summary(self) -> str:
        """A few lines: the choice, the prediction, the rejected candidates."""
        peak = (
            memory.format_bytes(self.predicted_peak_bytes)
            if self.predicted_peak_bytes is not None
            else "unknown"
        )
        when = (
            f"{self.predicted_time_s * 1e3:.1f} ms"
            if self.predicted_time_s is not None
            else "unknown"
        )
        lines = [
            f"auto -> {self.strategy.label}: predicted peak {peak} of a "
            f"{memory.format_bytes(self.budget_bytes)} budget, predicted time {when}"
            f" (result {memory.format_bytes(self.result_bytes)})"
        ]
        if self.race is not None:
            lines.append(f"  {self.race.summary()}")
        lines += [f"  rejected {label}: {why}" for label, why in self.rejected]
        return "\n".join(lines)

    __str__ = summary


class _Prefix:
    """A view of a problem whose rows are only its first ``count`` rows (probes)."""

    def __init__(self, problem: Problem, count: int) -> None:
        self._problem = problem
        self.num_rows = count
        self.targets = problem.targets
        self.model = problem.model
        self.key = (problem.key, "prefix", count)

    def rows(self, inputs: Any) -> tf.Tensor:
        return self._problem.rows(inputs)[: self.num_rows]


def _result_bytes(problem: Problem) -> int:
    itemsize = problem.output_dtype.size
    params = sum(t.shape.num_elements() for t in problem.targets)
    return problem.num_rows * params * itemsize


def _timed(fn, inputs, repeats: int = 3) -> float:
    fn(inputs)  # trace and warm up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        out = fn(inputs)
        tf.nest.map_structure(lambda t: t.numpy() if hasattr(t, "numpy") else t, out)
        times.append(time.perf_counter() - start)
    return float(np.median(times))


def _peak(fn, inputs, device: str) -> int | None:
    try:
        with memory.PeakMemory(device) as peak:
            tf.nest.map_structure(lambda t: t.numpy(), fn(inputs))
    except RuntimeError:  # no allocator statistics on this device
        return None
    return peak.extra_bytes


def activation_bytes(problem: Problem) -> int:
    """Bytes of every floating tensor the forward pass makes (traced, not run):
    an upper bound on what one row's backward pass keeps per row."""
    graph = tf.function(problem.rows).get_concrete_function(problem.inputs).graph
    total = 0
    for op in graph.get_operations():
        if op.type in _NOT_ACTIVATIONS:
            continue
        for out in op.outputs:
            if out.dtype.is_floating and out.shape.is_fully_defined():
                total += out.shape.num_elements() * out.dtype.size
    return total


_NOT_ACTIVATIONS = {"Const", "Placeholder", "ReadVariableOp", "Identity", "NoOp"}


def _probe(problem: Problem, device: str, allowed: float) -> dict[Any, Any]:
    """Measure the forward pass, then ``chunked`` on the first row, then on as
    many first rows as the budget safely allows (at most 32)."""
    inputs = problem.inputs
    forward = tf.function(problem.rows)
    found: dict[Any, Any] = {"forward_s": _timed(forward, inputs)}
    found["per_row_bytes"] = activation_bytes(problem)
    sizes = [1]
    for size in sizes:
        # a few chunks on the first rows: the loop's per-chunk overhead shows
        count = min(problem.num_rows, max(_PROBE_CHUNKS * size, _PROBE_MIN_ROWS))
        view = _Prefix(problem, count)
        fn = tf.function(strategies.Chunked(size).build(view))
        seconds = _timed(fn, inputs) - found["forward_s"]
        per_chunk = max(seconds, 0.0) / math.ceil(count / size)
        found[size] = (_peak(fn, inputs, device), per_chunk)
        if len(sizes) == 1:
            fixed = found[1][0] or 0
            per_probe = _PROBE_CHUNKS * max(found["per_row_bytes"], 1)
            room = (allowed - fixed) / per_probe
            larger = min(
                _PROBE_MAX_ROWS, problem.num_rows, 2 ** int(math.log2(max(room, 1)))
            )
            if larger > 1:
                sizes.append(larger)
    # ``while``: rows in a tf.while_loop, timed per row. Each row in flight
    # holds one backward pass, and may need scratch buffers of its own that a
    # one-row probe found already allocated (measured on CPU: 2 rows in
    # flight peaked at 63 MiB where the one-row chunk had peaked at 25 MiB).
    # So ``p`` rows in flight are allowed only where twice ``p`` one-row peaks
    # fit, up to TensorFlow's default of 10; without allocator statistics,
    # TensorFlow's default is probed.
    found["while"] = None
    one_row = found[1][0]
    parallel = None
    if one_row is not None and one_row > allowed:
        return found  # not even one row fits: the plan is refused
    if one_row is not None:
        fits = int(allowed // max(2 * one_row, 1))
        parallel = max(1, min(_WHILE_MAX_PARALLEL, problem.num_rows, fits))
    count = min(problem.num_rows, _WHILE_PROBE_ROWS)
    fn = tf.function(strategies.While(parallel).build(_Prefix(problem, count)))
    seconds = max(_timed(fn, inputs) - found["forward_s"], 0.0)
    found["while"] = (_peak(fn, inputs, device), seconds / count, parallel)
    return found


def _fit(points: list[tuple[int, float]]) -> tuple[float, float]:
    """(intercept, slope) through the probe points (a flat line for one)."""
    if len(points) == 1:
        return points[0][1], 0.0
    (x0, y0), (x1, y1) = points[0], points[-1]
    slope = max((y1 - y0) / (x1 - x0), 0.0)
    return y0 - slope * x0, slope


def _candidate_sizes(num_rows: int) -> list[int]:
    sizes = {num_rows}
    size = 1
    while size < num_rows:
        sizes.add(size)
        size *= 2
    return sorted(sizes)


def plan_problem(
    problem: Problem, *, memory_budget: Any = None, device: str | None = None
) -> Plan:
    """Plan ``problem`` under ``memory_budget`` (see the module docstring)."""
    device = memory.normalize_device(device)
    # keyed by the budget as given: a fraction of free memory stays one plan
    # although free memory moves a little between calls
    # (and by the input shapes: the rows may not change with the batch size,
    # but the activations do)
    shapes = tuple(tuple(t.shape) for t in tf.nest.flatten(problem.inputs))
    cache_key = (problem.key, shapes, repr(memory_budget), device)
    cached = per_model(_PLANS, problem.model).get(cache_key)
    if cached is not None:  # (asking the device for free memory takes time)
        return cached
    budget = memory.parse_budget(memory_budget, device=device)
    result_bytes = _result_bytes(problem)
    if result_bytes > budget * SAFETY:
        raise ValueError(
            f"jacobian(memory_budget={memory.format_bytes(budget)}): the result "
            f"alone needs {memory.format_bytes(result_bytes)} ({result_bytes} "
            f"bytes: {problem.num_rows} rows × "
            f"{sum(t.shape.num_elements() for t in problem.targets)} parameters × "
            f"{problem.output_dtype.size} bytes), more than the budget allows. "
            "Raise memory_budget, keep fewer rows with features=[...], or use a "
            "smaller batch."
        )
    probes = _probe(problem, device, budget * SAFETY - result_bytes)
    plan, contenders = _choose(problem, budget, result_bytes, probes)
    worked = per_model(_WORKED, problem.model).get(problem.key)
    if worked is None:
        batch, why = _consider_batch(problem, plan, device)
        contenders += batch
        plan = replace(plan, rejected=plan.rejected + why)
    plan = _select(plan, contenders)
    if worked is not None:  # it ran out of memory before: run what worked
        plan = _pinned(plan, worked)
    per_model(_PLANS, problem.model)[cache_key] = plan
    return plan


def _select(plan: Plan, contenders: list[tuple[Any, float, int | None]]) -> Plan:
    """The fastest contender ``(strategy, seconds, peak)`` (all fit the budget)
    becomes the plan; those within :data:`RACE_MARGIN` of it are raced."""
    ranked = sorted(contenders, key=lambda c: c[1])
    strategy, seconds, peak = ranked[0]
    shortlist = tuple(s for s, t, _ in ranked[1:] if t <= RACE_MARGIN * seconds)
    rejected = [
        (s.label, f"slower ({t * 1e3:.1f} ms predicted)")
        for s, t, _ in ranked[1:]
        if s not in shortlist
    ]
    return replace(
        plan,
        strategy=strategy,
        predicted_time_s=seconds,
        predicted_peak_bytes=peak,
        rejected=rejected + plan.rejected,
        race=Race([strategy, *shortlist]) if shortlist else None,
    )


def _consider_batch(
    problem: Problem, plan: Plan, device: str
) -> tuple[list[tuple[Any, float, int | None]], list[tuple[str, str]]]:
    """Probe the ``batch`` strategy where it applies, on the first few output
    features only: ``([(batch, seconds, peak)], [])`` if it is predicted to
    fit, else ``([], [("batch", why)])``.

    Its cost grows with the number of features it vectorizes over: time
    ``forward + (t_k - forward) × F / k`` and peak
    ``fixed + (peak_k - fixed) × F / k`` from a probe with ``k`` features, but
    no less than the predicted peak of chunks of all rows (it vectorizes over
    all rows too); tried only where that fits the budget.
    """

    def rejected(why: str) -> tuple[list, list[tuple[str, str]]]:
        return [], [("batch", why)]

    all_rows = plan.probes.get("peak, all rows at once")
    if all_rows is not None and all_rows > plan.budget_bytes * SAFETY:
        return rejected("vectorizes all rows at once: over the budget")
    batch = strategies.Batch()
    try:
        batch.check(problem)
    except ValueError as err:
        return rejected(str(err).split(": ", 1)[-1][:80])
    chosen = problem.rows_spec.features
    width = len(chosen) if chosen else int(problem.output_width)
    count = min(width, _BATCH_PROBE_FEATURES)
    sub = Problem(
        problem.model,
        problem.inputs,
        problem.layer,
        outputs=problem.rows_spec.mode,
        features=list(chosen or range(width))[:count],
        training=problem.training,
        unconnected="zero",
    )
    fn = tf.function(batch.build(sub))
    try:
        seconds = _timed(fn, sub.inputs)
        peak = _peak(fn, sub.inputs, device)
    except tf.errors.ResourceExhaustedError:
        return rejected("ran out of memory on its probe")
    scale = width / count
    forward_s = plan.probes.get("forward_s", 0.0)
    seconds = forward_s + max(seconds - forward_s, 0.0) * scale
    if peak is not None:
        fixed = plan.probes["chunk 1"][0] or 0
        peak = int(fixed + max(peak - fixed, 0) * scale + plan.result_bytes)
        # a probe of few features can hide under fixed buffers: never predict
        # less than chunks of every row
        peak = max(peak, all_rows or 0)
        if peak > plan.budget_bytes * SAFETY:
            size = memory.format_bytes(peak)
            return rejected(f"predicted peak {size} > {SAFETY:.0%} of the budget")
    return [(batch, seconds, peak)], []


def _choose(
    problem: Problem, budget: int, result_bytes: int, probes: dict[str, Any]
) -> tuple[Plan, list[tuple[Any, float, int | None]]]:
    """The plan's budget, probes and rejected candidates, and as
    ``(strategy, seconds, peak)`` contenders the fastest chunk size that fits
    and ``while`` if it fits (:func:`_select` picks among them)."""
    rows = problem.num_rows
    sizes = [k for k in probes if isinstance(k, int)]
    forward_s = probes["forward_s"]
    time_fit = _fit([(c, probes[c][1]) for c in sizes])
    peaks = [(c, probes[c][0]) for c in sizes if probes[c][0] is not None]
    memory_fit = _fit([(c, float(p)) for c, p in peaks]) if peaks else None
    if memory_fit is not None and max(c for c, _ in peaks) < _TRUSTED_SLOPE_ROWS:
        # Peaks of a few rows hide the per-row cost under fixed buffers (a
        # measured slope of ~0 up to 16 rows, then growth): without a probe
        # of enough rows, assume each row keeps the forward pass's activations.
        slope = max(memory_fit[1], float(probes["per_row_bytes"]))
        memory_fit = (memory_fit[0] + memory_fit[1] - slope, slope)
    allowed = budget * SAFETY
    rejected: list[tuple[str, str]] = []
    best = None
    for size in _candidate_sizes(rows):
        chunks = math.ceil(rows / size)
        seconds = forward_s + chunks * (time_fit[0] + time_fit[1] * size)
        label = strategies.Chunked(size).label
        peak = None
        if memory_fit is not None:
            # the stacked chunks and their concatenation: up to twice the result
            copies = 1 if chunks == 1 else 2
            peak = int(memory_fit[0] + memory_fit[1] * size + copies * result_bytes)
            if size == rows:
                probes["peak, all rows at once"] = peak
            if peak > allowed:
                rejected.append(
                    (
                        label,
                        f"predicted peak {memory.format_bytes(peak)} > "
                        f"{SAFETY:.0%} of the budget",
                    )
                )
                continue
        if best is None or seconds < best[1]:
            if best is not None:
                rejected.append(
                    (best[0].label, f"slower ({best[1] * 1e3:.1f} ms predicted)")
                )
            best = (strategies.Chunked(size), seconds, peak)
        else:
            rejected.append((label, f"slower ({seconds * 1e3:.1f} ms predicted)"))
    contenders = [best] if best is not None else []
    contenders += _consider_while(problem, probes, result_bytes, allowed, rejected)
    if not contenders:
        smallest = min(p for _, p in peaks) + result_bytes
        raise ValueError(
            f"jacobian(memory_budget={memory.format_bytes(budget)}): even one row "
            f"at a time needs about {memory.format_bytes(smallest)} (measured), "
            "more than the budget allows. Raise memory_budget, keep fewer rows "
            "with features=[...], or use a smaller batch."
        )
    rejected += [
        ("jacobian", "the same computation as chunked(R), without a budget"),
        ("loop", "eager Python loop: slowest"),
    ]
    plan = Plan(
        strategy=contenders[0][0],  # until _select ranks the contenders
        budget_bytes=budget,
        result_bytes=result_bytes,
        rejected=rejected,
        probes={
            "forward_s": forward_s,
            "peak, all rows at once": probes.get("peak, all rows at once"),
            **{f"chunk {c}": probes[c] for c in sizes},
            **({"while, per row": probes["while"][:2]} if probes["while"] else {}),
        },
    )
    return plan, contenders


def _consider_while(problem, probes, result_bytes, allowed, rejected):
    """``while`` as a contender: predicted time ``forward + R × per-row time``;
    peak: the probe's, or ``min(p, R)`` one-row peaks if more (``p`` rows in
    flight), plus the result; ``[]`` (and the reason in ``rejected``) if it
    was not probed or does not fit."""
    if probes["while"] is None:
        rejected.append(("while", "not probed: one row does not fit the budget"))
        return []
    peak, per_row, parallel = probes["while"]
    seconds = probes["forward_s"] + problem.num_rows * per_row
    strategy = strategies.While(parallel)
    if peak is not None:
        in_flight = min(parallel or _WHILE_MAX_PARALLEL, problem.num_rows)
        bound = in_flight * (probes[1][0] or 0)
        peak = int(max(peak, bound) + result_bytes)
        if peak > allowed:
            size = memory.format_bytes(peak)
            rejected.append(
                (strategy.label, f"predicted peak {size} > {SAFETY:.0%} of the budget")
            )
            return []
    return [(strategy, seconds, peak)]


def run_plan(problem: Problem, plan: Plan) -> tuple[strategies.Strategy, Any]:
    """Run the plan; on out-of-memory retry with half the chunk size (or half
    the rows in flight for ``while``).

    While the plan races its shortlist (:mod:`jacobkit.race`), each call runs
    the candidate the race asks for and reports its time. Returns the strategy
    that finished and its ``Strategy.run`` output. Warns once per problem when
    it had to back off, and remembers the strategy that worked: every plan for
    the same problem runs it from then on (and races no more).
    """
    first = plan.race.next() if plan.race is not None else plan.strategy
    strategy = first
    warned = False
    while True:
        try:
            output = strategy.run(problem)
        except tf.errors.ResourceExhaustedError:
            smaller = _smaller(strategy, problem.num_rows)
            if smaller is None:
                raise
            if not warned:
                warnings.warn(
                    f"jacobkit: {strategy.label} ran out of memory; retrying "
                    f"with less at once ({smaller.label}).",
                    ResourceWarning,
                    stacklevel=3,
                )
                warned = True
            strategy = smaller
            continue
        if strategy is not first:
            per_model(_WORKED, problem.model)[problem.key] = strategy
            if plan.race is not None:
                plan.race.finish(strategy)
            plans = per_model(_PLANS, problem.model)
            for key in [k for k in plans if k[0] == problem.key]:
                plans[key] = _pinned(plans[key], strategy)
        elif plan.race is not None:
            _, stats = output
            plan.race.record(strategy, stats.wall_time_s, stats.traced)
        return strategy, output


def _smaller(strategy: strategies.Strategy, num_rows: int):
    """Half as much at once, or ``None`` where one row at a time ran out."""
    smaller = strategy.smaller()
    if smaller is None and strategy.chunk_size is None and num_rows > 1:
        # batch (or jacobian) vectorizes all rows at once: chunks of half
        return strategies.Chunked(num_rows // 2)
    return smaller


def _pinned(plan: Plan, worked: strategies.Strategy) -> Plan:
    """``plan`` running ``worked``, the strategy that finished after an
    out-of-memory back-off (not re-planned: new probes would be noisy, and
    could pick more than what worked)."""
    return replace(plan, strategy=worked, race=None)
