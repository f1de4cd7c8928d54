"""auto races its near-equal candidates on the first calls, then keeps the
fastest; every call's result is exact and stays within the budget."""

from __future__ import annotations

import dataclasses

import pytest

import jacobkit as jk
from jacobkit import examples, memory, planner, testing
from jacobkit.race import RUNS, Race
from jacobkit.strategies import Batch, Chunked, Strategy, While
from tests.cases import reference


def test_race_times_each_candidate_after_its_compiling_call():
    race = Race([Chunked(4), While()])
    order = []
    times = {Chunked(4): 0.5, While(): 0.3}
    while race.winner is None:
        pick = race.next()
        compiled = pick not in order  # its first call traces
        order.append(pick)
        race.record(pick, times[pick], compiled)
    # each compiles and is timed once, then they take turns (drift hits both)
    first = [Chunked(4), Chunked(4), While(), While()]
    assert order == first + [Chunked(4), While()] * (RUNS - 1)
    assert race.winner == While()
    assert race.next() == While()
    assert "while won" in race.summary()


def test_race_ignores_compiling_calls_and_strangers():
    race = Race([Chunked(4), While()])
    race.record(Chunked(4), 99.0, True)  # tracing time: not the speed
    race.record(Batch(), 0.001, False)  # not a candidate
    assert race.times == {Chunked(4): [], While(): []}
    for _ in range(RUNS):
        race.record(Chunked(4), 0.2, False)
        race.record(While(), 0.4, False)
    assert race.winner == Chunked(4)


def test_single_candidate_needs_no_race_and_finish_ends_one():
    assert Race([While()]).winner == While()
    race = Race([Chunked(8), Batch()])
    race.finish(Chunked(2))
    assert race.next() == Chunked(2)
    with pytest.raises(ValueError, match="at least one candidate"):
        Race([])


def test_auto_races_its_shortlist_then_keeps_the_fastest(monkeypatch):
    """Fake wall times make the race's outcome certain: chunked is 'fastest'."""
    monkeypatch.setattr(planner, "RACE_MARGIN", 1e9)  # everything that fits races
    fake_seconds = {"chunked": 0.1, "while": 0.2, "batch": 0.3}
    original = Strategy.run
    ran = []

    def run_with_fake_time(self, problem):
        flat, stats = original(self, problem)
        ran.append(self.label)
        return flat, dataclasses.replace(stats, wall_time_s=fake_seconds[self.name])

    ex = examples.build("generator")  # fresh model: no cached plan
    plan = jk.plan(ex.model, ex.inputs, ex.layer, memory_budget="1GiB")
    candidates = [plan.strategy, *plan.shortlist]
    assert {s.name for s in candidates} == {"chunked", "while", "batch"}
    assert "racing on the first calls" in plan.summary()
    monkeypatch.setattr(Strategy, "run", run_with_fake_time)
    limit = memory.parse_budget("1GiB")
    expected = reference("generator", "features")
    for _ in range(len(candidates) * (RUNS + 1)):
        with memory.PeakMemory("CPU:0") as peak:
            result = jk.jacobian(ex.model, ex.inputs, ex.layer, memory_budget="1GiB")
        testing.assert_close(result, expected)
        assert peak.extra_bytes <= limit
    assert sorted(set(ran)) == sorted(s.label for s in candidates)
    assert plan.race.winner.name == "chunked"
    ran.clear()
    result = jk.jacobian(ex.model, ex.inputs, ex.layer, memory_budget="1GiB")
    assert ran == [plan.race.winner.label] and result.strategy == "chunked"
    assert "chunked" in plan.summary().splitlines()[1].split(":")[-1]


def test_no_race_when_no_candidate_is_within_the_margin(monkeypatch):
    # below 1 nothing is within the margin (1.0 would still race exact ties:
    # on a busy machine two candidates can both be predicted as the forward
    # pass alone)
    monkeypatch.setattr(planner, "RACE_MARGIN", 0.5)
    ex = examples.build("generator")
    plan = jk.plan(ex.model, ex.inputs, ex.layer, memory_budget="1GiB")
    assert plan.shortlist == () and plan.race is None
    assert "racing" not in plan.summary()
