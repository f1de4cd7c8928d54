"""``jk.gram``'s arrangement chosen by measurement
(:mod:`jacobkit.reductions.arrangement`): the cost rule's forms, or every
target's rows formed. The decisions are tested on injected times (never on
the wall clock); the matrices of either arrangement against the float64
Gram computed the obvious way (``tests/test_gram.py``'s reference and
tolerance, 1e-5 of the largest entry).
"""

from __future__ import annotations

import pytest
import tensorflow as tf

import jacobkit as jk
from jacobkit.planner import paired
from jacobkit.planner.paired import OTHER, PRIOR
from jacobkit.problem.reduction import Flat, Ghost
from jacobkit.reductions import arrangement
from jacobkit.reductions import features as feats
from tests.test_gram import _close, _rows
from tests.test_reductions import LOSS, _wide


def test_the_faster_best_call_is_kept_the_prior_on_a_tie():
    assert paired.choose({PRIOR: [3.0, 1.0], OTHER: [1.5, 0.9]}) == OTHER
    assert paired.choose({PRIOR: [3.0, 1.0], OTHER: [1.5, 1.2]}) == PRIOR
    assert paired.choose({PRIOR: [1.0, 1.0], OTHER: [1.0, 1.0]}) == PRIOR
    assert paired.choose({PRIOR: [1.0], OTHER: []}) == PRIOR
    # within the noise (reduced calls: jacobian's trials' 15%), the prior
    assert paired.choose({PRIOR: [1.0], OTHER: [0.9]}, noise=1.15) == PRIOR
    assert paired.choose({PRIOR: [1.0], OTHER: [0.8]}, noise=1.15) == OTHER


def test_the_schedule_times_steady_calls_of_each_then_keeps_one():
    """The first call runs the prior's way, the third traces the other;
    neither trace is counted; the faster is kept after six calls."""
    trial = paired.Trial()
    # seconds per call: the traces (calls 0 and 2) slow, the other faster
    seconds = [9.0, 2.0, 9.0, 1.5, 2.2, 1.1]
    ran = []
    for took in seconds:
        way = trial.next()
        ran.append(way)
        trial.record(way, took)
    assert tuple(ran) == paired.SCHEDULE
    assert trial.times == {PRIOR: [2.0, 2.2], OTHER: [1.5, 1.1]}
    assert trial.kept == OTHER
    assert [trial.next() for _ in range(3)] == [OTHER] * 3
    trial.record(OTHER, 99.0)  # nothing more is timed
    assert trial.times == {PRIOR: [2.0, 2.2], OTHER: [1.5, 1.1]}


def test_a_much_slower_other_way_is_dropped_after_one_timed_call():
    trial = paired.Trial()
    for took in [9.0, 1.0, 9.0, 2.0 * paired.GIVE_UP]:
        trial.record(trial.next(), took)
    assert trial.kept == PRIOR
    assert trial.times == {PRIOR: [1.0], OTHER: [2.0 * paired.GIVE_UP]}


def test_the_rule_kept_from_the_start_where_nothing_differs(monkeypatch):
    """Targets all formed under the rule (the wide model
    of tests/test_reductions, its convolution alone): no other
    arrangement, nothing timed, the rule's kept after the first call."""
    model, inputs = _wide()
    conv = [v for v in model.trainable_variables if "conv" in v.path]
    first = jk.gram(model, inputs, layer=conv, outputs=LOSS, progress=False)
    assert set(first.forms.values()) == {"materialized"}
    (trial,) = arrangement._TRIALS.of(model).values()
    assert trial.kept == PRIOR and trial.calls == 0


def test_the_formed_rows_tried_only_where_factors_are_and_they_fit():
    small = tf.Variable(tf.zeros((8, 4)))
    flat = feats.ChunkFeatures((Flat(tf.zeros((6, 32))),), 6, "batch")
    ghost = feats.ChunkFeatures(
        (Ghost(tf.zeros((6, 1, 8)), tf.zeros((6, 1, 1, 4))),), 6, "batch"
    )
    assert not arrangement.differs(flat, [small], 2**20)
    # formed: 6 rows x 32 float32 = 768 bytes; two chunks within half
    assert arrangement.differs(ghost, [small], 4 * 768)
    assert not arrangement.differs(ghost, [small], 4 * 768 - 1)
    # the factored target a small share of the numbers: not timed
    large = tf.Variable(tf.zeros((8, 4 * 10)))
    both = feats.ChunkFeatures((*ghost.features, *flat.features), 6, "batch")
    share = 32 / (32 + 320)
    assert share < arrangement.MIN_SHARE
    assert not arrangement.differs(both, [small, large], 2**30)
    assert arrangement.differs(both, [small, small], 2**30)


def test_factors_formed_forms_every_targets_rows():
    """``Factors(formed=True)``: the batch strategy's features all
    :class:`Flat`, where the rule ghosts the Dense kernel on vectors."""
    from jacobkit.problem import Call
    from jacobkit.problem.reduction import Factors
    from jacobkit.strategies.batch import Batch

    model, inputs = _wide()
    call = Call(model, model.trainable_variables, outputs=LOSS, strategy=None)
    problem = call.problem(inputs)
    rule, _ = Batch().run(problem.with_reduction(Factors()))
    formed, _ = Batch().run(problem.with_reduction(Factors(formed=True)))
    assert any(isinstance(f, Ghost) for f in rule.values)
    assert all(isinstance(f, Flat) for f in formed.values)


@pytest.mark.parametrize("keep", [False, True])
def test_gram_follows_the_schedule_then_runs_the_one_chosen(keep, monkeypatch):
    """Six calls of one problem run the schedule's arrangements (each
    matrix the float64 reference's), then the one ``choose`` returns on the
    times the calls measured (injected here: whatever the clock said)."""
    seen = []

    def chosen(times, noise=1.0):
        seen.append({k: len(v) for k, v in times.items()})
        return OTHER if keep else PRIOR

    monkeypatch.setattr(paired, "choose", chosen)
    monkeypatch.setattr(paired, "GIVE_UP", float("inf"))  # whatever the clock
    model, inputs = _wide()
    rows = _rows(model, inputs, LOSS)
    every = set()
    for way in (*paired.SCHEDULE, int(keep), int(keep)):
        result = jk.gram(model, inputs, outputs=LOSS, progress=False)
        forms = set(result.forms.values())
        every |= forms
        assert (forms == {"materialized"}) is (way == OTHER), result.forms
        _close(result.matrix, rows @ rows.T)
    assert seen == [{PRIOR: 2, OTHER: 2}]
    assert every == {"ghost", "materialized"}
