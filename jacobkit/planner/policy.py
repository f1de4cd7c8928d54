"""``auto``'s tunables, in one frozen :class:`Policy` that every
:class:`~jacobkit.planner.session.Session` holds from its start.

The defaults are what was measured to work (each field says where);
:func:`use_policy` changes them for the sessions started within a ``with``
block (tests use it to try every candidate as soon as the current rate is
known)::

    with jacobkit.planner.use_policy(rent=0.0):
        jacobkit.jacobian(model, x, layer)  # a new model: a new session
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from contextvars import ContextVar
from dataclasses import dataclass, replace
from typing import Any


@dataclass(frozen=True)
class Policy:
    """What ``auto`` plans by.

    Attributes:
        trial_runs: a tried candidate's rate is the median of this many
            runs that did not trace (one is at the mercy of a busy machine).
        settle_runs: a tried candidate that would lose within ``noise`` of
            the current strategy's rate after its ``trial_runs`` runs again,
            up to this many timed runs, judged on its best of the newest
            ``rate_runs`` (:func:`~jacobkit.planner.trials.settling`): its
            first timed runs in a fresh process are slower than its steady
            ones. Measured (MLP 512-1024-1024-144 without oneDNN, B=256,
            one core, TensorFlow's default allocator, loaded): ``while(10)``
            was kept in one of two fresh processes, 1.13x faster than
            ``batch`` in the other's trial, 1.45x when steady.
        kept_probes: runs kept per strategy for its estimate (the newest).
        rate_runs: the steady rate is the median of this many newest runs
            that did not trace.
        rent: try a candidate once the current strategy has run this many
            times the try's predicted cost: its predicted tracing time and
            its trial's runs (the traced one and ``trial_runs`` more), each
            at no less than the current strategy's call
            (:func:`~jacobkit.planner.selection.try_cost_s`); what a try
            cost beyond its prediction is earned back at the same rate
            before the next one. The classic ski-rental bound
            is 2 (at most twice the cost of the better choice), but
            explainability code often stops after a few calls: at 5, a try
            costs at most 20% over never trying, which is what "the first 3
            calls within 1.2x the best fixed strategy" allows. Measured
            (2-core CPU, MLP 512-1024-1024-144, B=256): with 2, calls 2-3
            traced batch and chunked and the first 3 calls took 1.6x the
            best fixed strategy's; ``while`` alone took 1.04x.
        start_trace_factor: start on a candidate computing more rows at once
            than the cheapest to trace where it traces within this factor of
            it (``chunked`` against ``while``: 1.5) and its predicted peak
            is within ``start_peak_factor`` of it: its first call then costs
            about the same tracing and, where vectorizing rows costs little
            memory, less per row. Measured (2-core CPU):

            - MLP 512-1024-1024-144, B=256, target hidden1: chunked(144)
              predicted at 2.3x while's peak (measured 1.1x); first calls
              chunked(144) 1.43 s, tape.jacobian 1.24 s, while 1.61 s;
              steady 0.88, 0.77 and 1.19 s.
            - generator B=64 T=128 (64/128/128 filters), target conv1:
              chunked(144) predicted at 13x (chunked(36) measured at 23x);
              first calls while 1.97 s, chunked(36) 2.50 s. The smaller
              generators predict 4.4-13x. (Predictions of the prior before
              vectorized rows were counted by their own backward tensors:
              now chunked(144) 2614 MiB against while(10)'s 95.)
        start_peak_factor: see ``start_trace_factor``.
        start_slack_bytes: a vectorized start may also peak this much above
            ``start_peak_factor`` times the cheapest's predicted peak: a few
            MiB is little memory whatever the ratio, and small problems are
            where a row-by-row loop's per-op overhead costs the most.
            Measured (2-core CPU, under load, oneDNN on), 2-layer GPT-2 token
            attribution (96 tokens, hidden 64, 32 rows): ``chunked(32)``
            28.6 MiB against ``while(10)``'s 3.7 (predicted 33.6 and 7.3),
            steady 0.72x while's time, first call 1.67 s against 2.11;
            generator B=16 T=64 (8 -> 32 filters, 48 rows): ``chunked(48)``
            28 MiB against 2.6 (predicted 37.3 and 4.3), steady 0.65x,
            first call 0.44 s against 0.63. The wide generator (B=64, T=128,
            64/128/128, 144 rows) stays on ``while``: ``chunked(144)``
            predicted at 2.6 GiB (measured 2.2-2.7) against 95 MiB.
        noise: rates within this factor are measurement noise on a busy
            machine; the lower peak wins among them.
        first_run_inflation: the first untraced run after a trace is at
            most this many times the later rate (the allocator grows for
            the new function; measured 1.5-1.8x, every strategy, MLP
            512-1024-1024-144 on 2 CPU cores). A candidate whose first
            untraced run is slower than this times ``noise`` times the
            current strategy's rate is judged at once, on that run
            (:func:`~jacobkit.planner.trials.ends_early`): its other runs
            would only cost more. Measured (conv net of
            ``benchmarks/reductions_models.py``, 32 per-example loss rows,
            1 core): ``while(parallel=10)`` ran 15x ``batch``'s call and
            ``chunked(8)`` 28x on every run of their trials.
        race_peak_factor: a candidate is tried only if its predicted peak is
            at most this many times the current strategy's measured peak
            plus ``race_slack_bytes`` (times ``safety`` where its prior is
            not an upper bound: :func:`~jacobkit.planner.selection.
            race_margin`): the allocator keeps
            what it took, so a losing try leaves the process bigger, by
            about the candidate's whole peak (TensorFlow's allocator keeps
            the current strategy's region and adds one for the try).
            Measured on the MLP 512-1024-1024-144 (2-core CPU): batch alone
            grew the process by 474 MiB at a 388 MiB peak; a try of
            chunked(36) (702 MiB peak) took it to 1250 MiB, over the
            auto suite's bound of 2 x 388 + 256 MiB. At 1 the process stays
            within twice the current peak plus the slack.
        race_slack_bytes: see ``race_peak_factor``.
        safety: the plan keeps its predicted peak below this fraction of the
            budget: the memory prior was measured within ~10% of real peaks,
            the rest is allocator fragmentation.
        backoff_gain: a run over the budget is run with less at once
            (``smaller()``) on the next call only while the last such back-off
            lowered the measured peak below this fraction of what it was;
            else the budget is not held (warned), and nothing is traced
            again. Measured: a Conv1D generator's ``while`` peaks at 72 MiB
            with 10 rows in flight, 61 with 2, 38 with 1 (each back-off
            0.62-0.85 of the peak before, :class:`~jacobkit.strategies.While`);
            a frozen DenseNet121 head's separable shortcut at 253 MiB with 10,
            5, 2 and 1 on their first calls (its check, not its rows).
        eager_rows: problems of at most this many rows start on the eager
            ``loop``, which traces nothing, for the first ``eager_calls``
            calls. Measured, frozen ResNet50 + 3-class head, 16 images at 96
            px, each in a fresh process: loop's first answer 3.1 s, every
            traced strategy 4.4-6.5 s (the problem built in the first call);
            the problem built before, on an idle machine, 0.72 s against
            1.23 s for ``while``. A loop pass per row is a full backward
            pass, so more rows soon cost more than one trace.
        eager_calls: the eager start answers this many calls; the next one
            traces the candidate cheapest to trace (its ``trace_weight``,
            the shortcut's included), and from then on candidates are tried
            by ``rent``. The loop's steady call is 2-6x a traced one on the
            frozen heads (ResNet50 0.48 s against 0.21 s, MobileNetV2 0.26
            against 0.047 s, BERT 0.094 against 0.015 s; 2-core CPU, 3
            fresh processes each), and tracing after the loop costs what a
            traced first call does (ResNet50: ``while(3)`` 1.39-1.79 s at
            call 2 against 1.17-1.56 s first), so it pays back within 3-5
            calls. Waiting ``rent`` times the trace predicted from the loop's
            call kept ResNet50 on the loop until call 18, MobileNetV2 until
            call 9, BERT until call 12.
    """

    trial_runs: int = 2
    settle_runs: int = 4
    kept_probes: int = 8
    rate_runs: int = 3
    rent: float = 5.0
    start_trace_factor: float = 2.0
    start_peak_factor: float = 2.5
    start_slack_bytes: int = 64 * 2**20
    noise: float = 1.15
    first_run_inflation: float = 2.0
    race_peak_factor: float = 1
    race_slack_bytes: int = 256 * 2**20
    safety: float = 0.85
    backoff_gain: float = 0.9
    eager_rows: int = 4
    eager_calls: int = 1


#: (a frozen default: never changed in place)
_CURRENT: ContextVar[Policy] = ContextVar(
    "jacobkit_planner_policy",
    default=Policy(),  # noqa: B039
)


def current_policy() -> Policy:
    """The policy new sessions start with (:func:`use_policy` changes it)."""
    return _CURRENT.get()


@contextlib.contextmanager
def use_policy(policy: Policy | None = None, **changes: Any) -> Iterator[Policy]:
    """Within the ``with`` block, sessions that start use ``policy`` (default:
    the current one) with ``changes`` to its fields; yields that policy.

    A session keeps the policy it started with, and sessions are kept per
    policy too (besides model, targets, rows, input shapes, budget and
    device): within the block a model is planned anew under ``policy``,
    and after it, under the policy outside."""
    chosen = replace(policy or current_policy(), **changes)
    token = _CURRENT.set(chosen)
    try:
        yield chosen
    finally:
        _CURRENT.reset(token)
