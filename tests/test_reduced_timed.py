"""``auto``'s reduced calls timed where the prior is unsure
(:mod:`jacobkit.planner.reduced` with :mod:`jacobkit.planner.paired`): the
first candidate that fits against the next of another strategy, on steady
calls, the faster kept. The decisions are tested on injected verdicts
(``paired.choose`` replaced: never the wall clock); every call's result
against the same call's first (each checked against float64 in
``test_reductions.py``), within 1e-5 of the largest value (measured: 2.4e-7,
another chunking's float32 sums, ``test_reductions_budget.py``).
"""

from __future__ import annotations

import pytest

import jacobkit as jk
from jacobkit.planner import paired
from tests.test_reductions import _wide
from tests.test_reductions_budget import _call, _lstm, _same


@pytest.fixture
def verdict(monkeypatch):
    """``paired.choose`` answering ``way`` (after recording what it saw),
    and no early drop whatever the clock says."""
    seen: list[dict[int, int]] = []

    def answer(way):
        def choose(times, noise=1.0):
            seen.append({k: len(v) for k, v in times.items()})
            return way

        monkeypatch.setattr(paired, "choose", choose)
        monkeypatch.setattr(paired, "GIVE_UP", float("inf"))
        return seen

    return answer


@pytest.mark.parametrize("way", [paired.OTHER, paired.PRIOR])
def test_grouped_is_timed_against_chunked_and_the_faster_kept(way, verdict):
    """The LSTM's first candidate is ``grouped`` (batch on the head, chunked
    on the LSTM); the next of another strategy, ``chunked(16)``, is timed
    against it: pending until the sixth call, then the verdict's kept."""
    seen = verdict(way)
    model, inputs = _lstm()
    results = [_call(model, inputs, "norm") for _ in range(8)]
    plans = [r.plan for r in results]
    first, other = plans[0].strategy, plans[0].pending
    assert first.name == "grouped" and [s.label for s in other] == ["chunked(16)"]
    assert [p.settled for p in plans] == [False] * 5 + [True] * 3
    assert seen == [{paired.PRIOR: 2, paired.OTHER: 2}]
    last = plans[-1]
    if way == paired.OTHER:
        assert last.strategy == other[0]
        assert [(s.old, s.new) for s in last.switches] == [(first, other[0])]
        assert any(
            r.strategy == first and "slower when timed" in r.reason
            for r in last.rejected
        )
    else:
        assert last.strategy == first and not last.switches
        assert any(
            r.strategy == other[0] and "not faster when timed" in r.reason
            for r in last.rejected
        )
    timed = {e.strategy.label: e.seconds_per_row for e in plans[5].estimates}
    assert set(timed) <= {first.label, other[0].label}
    assert all(v is not None and v > 0 for v in timed.values())
    for result in results[1:]:
        _same(result, results[0])


def test_the_closed_forms_of_every_target_are_never_timed(verdict):
    seen = verdict(paired.OTHER)
    model, inputs = _wide()
    plans = [_call(model, inputs, "norm").plan for _ in range(7)]
    assert all(p.strategy == jk.strategies.Batch() and p.settled for p in plans)
    assert not seen
