"""``auto`` keeps ``while`` at fewer rows in flight where its default does
not fit, tries it within the room a try may take (its prior an upper
bound), and counts the ``MatMul`` rule's transposed copies in its peaks.

The planner runs for real here: real strategies, the problem's own memory
prior, ``jk.plan``; budgets and peaks are set from the prior's predictions,
never hard-coded."""

from __future__ import annotations

from dataclasses import replace

import keras
import numpy as np
import pytest

import jacobkit as jk
from jacobkit import planner
from jacobkit.planner import estimates, probes, selection
from jacobkit.planner.footprint import Footprint
from jacobkit.planner.opening import memory_prior
from jacobkit.problem import Problem, eager_inspect, inspect
from jacobkit.problem.operands import Transposed
from jacobkit.problem.plan import Estimate
from jacobkit.strategies import Batch, Chunked, While, gradients
from jacobkit.testing import example_models

#: a small MLP of the benchmark's shape: summed rows of the first Dense
SIZES = {"batch": 64, "inputs": 32, "hidden": 64, "features": 12}
MiB = 2**20


def _problem() -> tuple[keras.Model, np.ndarray, Problem]:
    example = example_models.mlp(**SIZES)
    model, x = example.model, example.inputs
    return model, x, Problem(model, x, "hidden1")


def _footprint(problem: Problem, allowed: float) -> Footprint:
    prior = memory_prior(problem, problem.activation_bytes, None)
    return Footprint(problem.num_rows, probes.result_bytes(problem), allowed, prior)


#: the rows in flight ``While.smaller()`` walks from the default
COUNTS = (10, 5, 2, 1)


def _split(footprint: Footprint) -> tuple[int, int, int]:
    """The most rows in flight predicted below ``while(10)``'s peak, and a
    peak between its prediction and that of the count before it."""
    peaks = [footprint.predicted_peak(While(p)) for p in COUNTS]
    # a row in flight holds its own tensors (at most 2 per inter-op thread)
    assert peaks == sorted(peaks, reverse=True) and peaks[-1] < peaks[0], peaks
    k = next(i for i, peak in enumerate(peaks) if peak < peaks[0])
    return COUNTS[k], peaks[k], (peaks[k] + peaks[k - 1]) // 2


def test_a_budget_too_small_for_while_10_keeps_while_at_fewer_rows_in_flight():
    """Under a budget between the predicted peaks of two of
    ``smaller()``'s counts (``while(2)`` and ``while(5)`` on 2 inter-op
    threads), ``while`` stays among auto's candidates at the larger count
    that fits, not dropped."""
    model, x, problem = _problem()
    count, _, between = _split(_footprint(problem, float("inf")))
    assert count < 10
    budget = int(between / planner.Policy().safety)
    plan = jk.plan(model, x, "hidden1", memory_budget=budget, cache=False)
    considered = [plan.strategy, *plan.pending]
    whiles = [s for s in considered if s.name == "while"]
    assert whiles == [While(count)], plan.summary()
    # and with room for all 10, the default
    roomy = jk.plan(model, x, "hidden1", memory_budget=2**34, cache=False)
    assert While(10) in [roomy.strategy, *roomy.pending], roomy.summary()


def _next(footprint: Footprint, current_peak: int, pending: list) -> selection.NextTry:
    """What a call tries after ``batch`` measured ``current_peak``, every
    candidate due at once (rent 0)."""
    # no slack: the room is the current peak (this MLP's peaks are a few MiB)
    policy = planner.Policy(rent=0.0, race_slack_bytes=0)
    current = Estimate(
        Batch(), seconds_per_row=1e-3, trace_s=0.1, peak_bytes=current_peak
    )

    def fits(strategy, room):
        return footprint.fits(strategy, None, room)

    return selection.next_try(
        policy,
        pending,
        current,
        1.0,
        lambda s: None,
        footprint.predicted_peak,
        fits,
        (footprint.allowed_bytes, footprint.num_rows),
    )


def test_a_try_of_while_takes_the_most_rows_in_flight_the_room_holds():
    """The room a try may take (the current peak, no slack here) between
    two counts' predictions (``while(2)``'s and ``while(5)``'s on 2
    inter-op threads): the larger count that fits is tried."""
    _, _, problem = _problem()
    footprint = _footprint(problem, float("inf"))
    count, _, between = _split(footprint)
    due = _next(footprint, between, [While(10)])
    assert due.candidate == While(count), due
    # below while(1)'s prediction: dropped, with its smallest's prediction
    due = _next(footprint, footprint.predicted_peak(While(1)) - 1, [While(10)])
    assert due.candidate is None
    (dropped,) = due.dropped
    assert "at its smallest" in dropped.reason, dropped.reason


def test_the_safety_margin_is_not_taken_twice_from_an_upper_bound_prior():
    """``while``'s prior walks the traced tensors and is never below its
    measured peak: it may take the whole room. A vectorized candidate
    predicted as high keeps the safety margin (its prior is not a bound:
    the MLP's ``chunked(72)`` measured 1.06x its prediction)."""
    _, _, problem = _problem()
    footprint = _footprint(problem, float("inf"))
    safety = planner.Policy().safety
    # the room: while(1)'s prediction, under it once the margin is taken
    peak = footprint.predicted_peak(While(1))
    assert safety * peak < peak
    assert _next(footprint, peak, [While(1)]).candidate == While(1)
    chunked = Chunked(1)
    vectorized = footprint.predicted_peak(chunked)
    assert _next(footprint, vectorized, [chunked]).candidate is None
    assert _next(footprint, int(vectorized / safety) + 1, [chunked]).candidate == (
        chunked
    )


def _by_hand(model: keras.Model, batch: int) -> list[Transposed]:
    """The MLP's products whose gradients take an operand transposed, for
    the first Dense's weights, the obvious way: the first Dense's input
    (for its kernel's gradient), then each later Dense's kernel (for its
    input's gradient)."""
    dense = [layer for layer in model.layers if isinstance(layer, keras.layers.Dense)]
    found = [Transposed(batch, batch * int(dense[0].kernel.shape[0]) * 4)]
    found += [Transposed(batch, int(np.prod(d.kernel.shape)) * 4) for d in dense[1:]]
    return found


@pytest.mark.parametrize("batch", [3, 64])
def test_the_transposed_operands_are_read_from_both_inspections(batch):
    """The traced and the eager inspection (one exact pass at 3 examples,
    two passes extrapolated at 64) find the same operands as the layers'
    shapes say."""
    example = example_models.mlp(**{**SIZES, "batch": batch})
    problem = Problem(example.model, example.inputs, "hidden1")
    expected = sorted(_by_hand(example.model, batch), key=lambda t: t.bytes)
    traced = inspect.trace(problem).transposed
    eager = eager_inspect.inspection(problem)
    assert eager is not None
    assert sorted(traced, key=lambda t: t.bytes) == expected
    assert sorted(eager.transposed, key=lambda t: t.bytes) == expected


def test_the_copies_are_counted_where_the_rule_makes_them():
    """What the prior adds: the operands of products of at least
    ``MATMUL_ROWS`` rows, each at most ``MATMUL_COPY_BYTES``, where the
    rule replaces anything (oneDNN off); nothing elsewhere."""
    operands = [
        Transposed(gradients.MATMUL_ROWS, 3 * MiB),
        Transposed(gradients.MATMUL_ROWS - 1, 5 * MiB),  # too few rows
        Transposed(256, gradients.MATMUL_COPY_BYTES + 4),  # too large
        Transposed(256, gradients.MATMUL_COPY_BYTES),
    ]
    expected = 3 * MiB + gradients.MATMUL_COPY_BYTES
    assert gradients.hoisted_bytes(operands) == (
        expected if gradients.replaces() else 0
    )
    _, _, problem = _problem()
    prior = memory_prior(problem, problem.activation_bytes, None)
    assert prior.hoisted_bytes == gradients.hoisted_bytes(problem.transposed)
    without = estimates.predicted_peak(
        While(10), problem.num_rows, replace(prior, hoisted_bytes=0), 0
    )
    assert estimates.predicted_peak(While(10), problem.num_rows, prior, 0) == (
        without + prior.hoisted_bytes
    )
