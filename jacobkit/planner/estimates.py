"""From measured runs to estimates (:class:`Measurements` keeps a session's
runs), and the priors used before a strategy ran: its peak memory and its
tracing time."""

from __future__ import annotations

import statistics
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any

from jacobkit import strategies
from jacobkit.planner.policy import Policy
from jacobkit.planner.scratch import MemoryPrior
from jacobkit.problem import Problem
from jacobkit.problem.plan import Estimate, Probe
from jacobkit.strategies import Strategy


def estimate(
    strategy: Strategy,
    probes: Sequence[Probe],
    earlier: Estimate | None = None,
    rate_runs: int = Policy.rate_runs,
) -> Estimate:
    """What ``probes`` (runs of ``strategy``) say of it.

    The steady rate is the median over the newest ``rate_runs`` runs
    that did not trace (seconds per row): a process's first calls are slow
    while the allocator grows (measured: 1.7-2x the later rate on the MLP
    512-1024-1024-144), and a candidate tried later must be compared with
    what the current strategy does now. The tracing time is the largest
    excess of a traced run over its rows at the fastest rate seen (a strategy traced
    again for another number of rows reuses much of the first trace, so the
    first one is what a new strategy costs); where the strategy's computation
    was compiled before its first run here (:attr:`~jacobkit.problem.plan.
    Probe.first_call_s`), the excess of that traced first call. ``earlier``
    (e.g. from the disk cache) fills what the probes do not measure yet.
    """
    mine = [p for p in probes if p.strategy == strategy]
    steady = [p.seconds / p.rows for p in mine if not p.traced]
    traced = [p for p in mine if p.traced]
    peaks = [p.peak_bytes for p in mine if p.peak_bytes is not None]
    rate = statistics.median(steady[-rate_runs:]) if steady else None
    trace_s = None
    if traced and steady:
        # against the fastest rate seen: a slow run after the trace (a busy
        # machine, the allocator growing) must not make tracing look free.
        # While no run has been faster than the traced one, the trace is not
        # measured yet (None: no candidate is tried on its account). Taken
        # as 0 it let auto try every candidate from the third call on, after
        # one slow second call (MLP 512-1024-1024-144: 1.27 s after a 1.08 s
        # first call, once tracing had become cheap)
        fastest = min(steady)
        excess = max(p.seconds - fastest * p.rows for p in traced)
        trace_s = excess if excess > 0 else None
    elif steady:
        # compiled before this plan ran it (a fixed strategy's call in this
        # process): no run traces, and unmeasured, its trace made every
        # other candidate's unpredictable (None): none was ever tried
        fastest = min(steady)
        before = [p.first_call_s - fastest * p.rows for p in mine if p.first_call_s]
        excess = max(before, default=0.0)
        trace_s = excess if excess > 0 else None
    if earlier is not None:
        rate = earlier.seconds_per_row if rate is None else rate
        trace_s = earlier.trace_s if trace_s is None else trace_s
        if earlier.peak_bytes is not None:
            peaks.append(earlier.peak_bytes)
    return Estimate(
        strategy=strategy,
        seconds_per_row=rate,
        trace_s=trace_s,
        peak_bytes=max(peaks) if peaks else None,
        predicted_peak_bytes=earlier.predicted_peak_bytes if earlier else None,
    )


def predicted_peak(
    strategy: Strategy,
    num_rows: int,
    prior: MemoryPrior,
    result_bytes: int,
    working_bytes: int = 0,
) -> int:
    """Peak memory before ``strategy`` ran: the forward pass kept by the tape
    and one forward pass's activations per row alive at once (where rows run
    one after another, :meth:`~jacobkit.strategies.Strategy.sequential_rows`:
    the traced pass's tensors alive at its peak and each further row's own,
    :class:`~jacobkit.problem.liveness.SequentialMemory`; where pfor
    vectorizes them, :meth:`~jacobkit.strategies.Strategy.vectorized_rows`,
    the same with the rows it holds formed at once,
    :meth:`~jacobkit.strategies.Strategy.rows_formed`: two chunks' for
    ``chunked``; never more than the activations' count), the gradient
    kernels' scratch space per backward pass in flight
    (:mod:`jacobkit.planner.scratch`), the ``MatMul`` rule's transposed
    copies (:attr:`~jacobkit.planner.scratch.MemoryPrior.hoisted_bytes`:
    oneDNN off, once per call whatever the rows), the Jacobians (twice, where
    they are stacked into the result:
    :attr:`~jacobkit.strategies.Strategy.result_copies`), what a reduction
    holds beside its result (``working_bytes``: :meth:`~jacobkit.problem.
    reduction.Reduction.working_bytes`), and for an eager
    strategy every activation of the forward pass (an eager Keras call holds
    them until it returns); for an exact shortcut, at least its first call's
    check (:func:`check_peak`).

    NOTE (measured, why ``batch`` keeps a forward pass's activations per
    row). The walked count of its 16 rows in flight (as ``chunked(16)``'s)
    put its full Jacobian under the measured peak: the generator (B=32,
    T=128, 32 -> 64 channels) 72 MiB against 139-146, 136 with 32 rows; the
    count here 291 (2.0-2.1x); oneDNN on, loaded."""
    at_once = strategy.rows_at_once(num_rows)
    scratch = prior.scratch_in_flight(
        strategy.passes_in_flight(num_rows), prior.way(strategy)
    )
    eager = 0 if strategy.compiled else prior.eager_bytes
    results = strategy.result_copies * result_bytes
    rows = None
    if strategy.sequential_rows():
        rows = prior.sequential_peak(at_once)
    elif strategy.vectorized_rows():
        rows = prior.vectorized_peak(strategy.rows_formed(num_rows))
    whole = (1 + at_once) * prior.row_bytes
    rows = whole if rows is None else min(rows, whole)
    run = int(rows + scratch + prior.hoisted_bytes + results + working_bytes + eager)
    return max(run, check_peak(strategy, prior, result_bytes))


def result_bytes(strategy: Strategy, problem: Problem) -> int:
    """Bytes of ``problem``'s reduced result as ``strategy`` computes it:
    the kind's count (:meth:`~jacobkit.problem.reduction.Reduction.
    result_bytes`, its generic computation's), or, where only a closed
    form's trace tells them (:attr:`~jacobkit.problem.reduction.Reduction.
    traced_result`: ``jk.gram``'s factors) and ``strategy`` computes the
    kind itself, compiled, its traced outputs as the kind counts them
    (:meth:`~jacobkit.problem.reduction.Reduction.traced_bytes`). The trace
    is the compiled computation's, which a run of ``strategy`` then calls.

    NOTE (measured, why). Counted as every row formed, ``jk.gram``'s
    budgeted call on bert_small (32 loss rows) predicted ``batch`` at 2.0
    GiB, 1.3 GiB of it the rows formed, and refused a 2 GiB budget; its
    factors are 388 MiB, the call measured 410 MiB.

    A strategy of several parts (``grouped``: ``batch`` on the targets
    closed forms serve, a generic strategy on the others) counts each
    part's result as it computes it, on its targets: counted as every row
    formed, a token table of 4,000 x 32 beside an LSTM (32 loss rows, 16
    MiB formed, never formed by ``batch``) predicted ``grouped(batch |
    chunked(1))``'s ``jk.gram`` at 36.1 MiB against 2.5 measured (14.5x)."""
    kind = problem.reduction
    parts = strategy.parts(problem)
    if kind.traced_result and len(parts) > 1:
        return sum(result_bytes(s, p) for s, p in parts)
    if not (kind.traced_result and strategy.compiled and strategy.computes(problem)):
        return kind.result_bytes(problem)
    try:
        fn: Any = strategy.compiled_for(problem).fn  # a tf.function: compiled
        traced = fn.get_concrete_function(problem.inputs).structured_outputs
    except ValueError:  # refused where it runs, in its own words
        return kind.result_bytes(problem)
    return kind.traced_bytes(traced.values)


#: an eager forward pass's measured peak over the layers' outputs it holds
#: (:attr:`MemoryPrior.eager_bytes`): frozen DenseNet121 head, 16 images at
#: 64 px, 253.6 MiB against 250.0 (TF 2.21, CPU); MobileNetV2's head at 96
#: px, 248.7 against 247
EAGER_MARGIN = 1.1


def check_peak(strategy: Strategy, prior: MemoryPrior, result_bytes: int) -> int:
    """Peak of the check an exact shortcut (``structured``) makes of its
    first call (:func:`jacobkit.verify`, ``probes`` backward passes with
    random cotangents), while the call's result is held; 0 for any other
    strategy, or a shortcut with no check.

    NOTE (why it is counted). The check runs eagerly: its forward pass is an
    eager Keras call, which holds every layer's output until it returns, as
    the eager ``loop`` does, and the run's peak meter counts it. Frozen
    DenseNet121 + Dense(7) head, 16 images at 64 px: 253 MiB on the first
    call, 11.3 MiB on every later one (the traced run); uncounted, a 64 MiB
    budget planned ``structured(while)`` at 19 MiB, measured 253 MiB and
    backed off its rows in flight (5, 2, 1), which the check does not
    hold, retracing on each of the next 3 calls. Its backward passes (one
    at a time, after the forward pass) hold what a row of ``loop`` holds,
    their convolution gradients taken the ``while`` loop's way (:func:`
    jacobkit.strategies.gradients.patches_in_pass`): the patches, not
    TensorFlow's kernel scratch. Conv1D generator, oneDNN off: 13.1 MiB
    predicted, 11.8-12.3 measured (44.5 predicted, 41 measured when the check
    ran TensorFlow's kernels)."""
    if not isinstance(strategy, strategies.Structured) or strategy.probes < 1:
        return 0
    backward = prior.sequential_peak(1)
    if backward is None:
        backward = 2 * prior.row_bytes
    # through the loop's rules (jacobkit.strategies.gradients.
    # patches_in_pass): its kernels' scratch and the patches it forms
    backward += prior.scratch_in_flight(1, "loop")
    return int(result_bytes + max(EAGER_MARGIN * prior.eager_bytes, backward))


def predicted_trace_s(
    strategy: Strategy,
    known: Estimate | None,
    reference: Estimate | None,
    num_rows: int,
    others: Sequence[Estimate] = (),
) -> float | None:
    """Tracing time of ``strategy``: measured if it was traced before (in this
    process or one that wrote the disk cache), else scaled from a measured
    strategy by their :attr:`~jacobkit.strategies.Strategy.trace_weight`.
    From the eager ``loop``, which traces nothing: its weight times the
    loop's steady call of ``num_rows`` rows (tracing runs the model's Python
    once, as an eager call does, then compiles what it recorded).

    Scaled from a compiled ``reference`` (the current strategy), never below
    its measured trace: every compiled strategy traces the model's forward
    and backward passes, which is most of what the measured trace holds;
    the weights only rank what each adds. Where ``others`` (strategies
    measured on this problem, e.g. tried before) scale to more, the most.

    Measured (conv net of ``benchmarks/reductions_models.py``, 32
    per-example loss rows, 1 core, oneDNN on): ``batch`` traced in 0.11 s,
    so the weights predicted ``while(parallel=10)`` at 0.03 s and
    ``chunked(8)`` at 0.04 s; they traced in 0.15 s and 0.37-0.39 s."""
    if known is not None and known.trace_s is not None:
        return known.trace_s
    if (
        reference is not None
        and not reference.strategy.compiled
        and reference.seconds_per_row is not None
    ):
        return strategy.trace_weight * reference.seconds_per_row * num_rows
    if reference is None or reference.trace_s is None:
        return None
    measured = [o for o in others if o.strategy.compiled and o.trace_s is not None]
    scaled = max(_scaled_trace(strategy, m) for m in (reference, *measured))
    return max(scaled, reference.trace_s) if strategy.compiled else scaled


def _scaled_trace(strategy: Strategy, measured: Estimate) -> float:
    """``measured``'s trace scaled to ``strategy`` by their weights."""
    assert measured.trace_s is not None
    weight = max(measured.strategy.trace_weight, 1e-3)
    return measured.trace_s * strategy.trace_weight / weight


def timed_runs(probes: Sequence[Probe], strategy: Strategy) -> int:
    """Runs of ``strategy`` among ``probes`` that did not trace."""
    return sum(p.strategy == strategy and not p.traced for p in probes)


class Measurements:
    """The runs of one problem's strategies, and what they say.

    Args:
        policy: how many runs are kept and how many make a rate.
        predicted_peak: a strategy's predicted peak, which its estimate
            carries beside the measured one (the session's
            :meth:`~jacobkit.planner.footprint.Footprint.predicted_peak`,
            which predicts with this module).
    """

    def __init__(
        self, policy: Policy, predicted_peak: Callable[[Strategy], int]
    ) -> None:
        self._policy = policy
        self._predicted_peak = predicted_peak
        self._probes: list[Probe] = []
        self._known: dict[Strategy, Estimate] = {}

    @property
    def probes(self) -> tuple[Probe, ...]:
        """The runs kept, oldest first."""
        return tuple(self._probes)

    def ran(self, strategy: Strategy) -> bool:
        """Whether ``strategy`` ran in this process."""
        return any(p.strategy == strategy for p in self._probes)

    def timed_runs(self, strategy: Strategy) -> int:
        """Runs of ``strategy`` that did not trace (its rate's evidence)."""
        return timed_runs(self._probes, strategy)

    def add(self, probe: Probe) -> None:
        """Keep a run (of each strategy the traced one and the newest)."""
        self._probes.append(probe)
        mine = [p for p in self._probes if p.strategy == probe.strategy]
        if len(mine) > self._policy.kept_probes:
            old = next(p for p in mine if not p.traced)
            self._probes.remove(old)

    def know(self, estimates: tuple[Estimate, ...]) -> None:
        """What an earlier process measured (the disk cache), until runs here
        measure it again; ``()`` forgets it."""
        self._known = {e.strategy: e for e in estimates}

    def earlier(self, strategy: Strategy) -> Estimate | None:
        """What an earlier process measured of ``strategy``, if anything."""
        return self._known.get(strategy)

    def estimate(self, strategy: Strategy) -> Estimate | None:
        """What is known of ``strategy`` (``None`` if nothing)."""
        earlier = self._known.get(strategy)
        if not self.ran(strategy):
            return earlier
        found = estimate(strategy, self._probes, earlier, self._policy.rate_runs)
        peak = self._predicted_peak(strategy)
        return replace(found, predicted_peak_bytes=peak)

    def estimates(self) -> tuple[Estimate, ...]:
        """What is known of every strategy that ran or was known, by label."""
        ran = {p.strategy for p in self._probes} | set(self._known)
        found = [e for s in ran if (e := self.estimate(s)) is not None]
        return tuple(sorted(found, key=lambda e: e.strategy.label))
