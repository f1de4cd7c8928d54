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
from jacobkit.problem.reduction import Flat, Ghost
from jacobkit.reductions import arrangement
from jacobkit.reductions import features as feats
from tests.test_gram import _close, _rows
from tests.test_reductions import LOSS, _wide


def test_the_faster_median_is_chosen_the_rule_on_a_tie():
    assert arrangement.choose({False: [3.0, 1.0], True: [1.5, 1.5]}) is True
    assert arrangement.choose({False: [1.0, 2.0], True: [1.6, 1.6]}) is False
    assert arrangement.choose({False: [1.0, 1.0], True: [1.0, 1.0]}) is False
    assert arrangement.choose({False: [1.0], True: []}) is False


def test_the_schedule_times_steady_calls_of_each_then_keeps_one():
    """The first call runs the rule's arrangement, the third traces the
    formed one; neither trace is counted; the faster is kept after six."""
    trial = arrangement.Trial()
    # seconds per call: the traces (calls 0 and 2) slow, formed faster
    seconds = [9.0, 2.0, 9.0, 1.0, 2.2, 1.1]
    ran = []
    for took in seconds:
        formed = trial.next()
        ran.append(formed)
        trial.record(formed, took, differs=True)
    assert tuple(ran) == arrangement.SCHEDULE
    assert trial.times == {False: [2.0, 2.2], True: [1.0, 1.1]}
    assert trial.chosen is True
    assert [trial.next() for _ in range(3)] == [True] * 3
    trial.record(True, 99.0, differs=True)  # nothing more is timed
    assert trial.times == {False: [2.0, 2.2], True: [1.0, 1.1]}


def test_the_rule_kept_from_the_start_where_nothing_differs():
    trial = arrangement.Trial()
    trial.record(trial.next(), 1.0, differs=False)
    assert trial.chosen is False
    assert [trial.next() for _ in range(3)] == [False] * 3


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

    def chosen(times):
        seen.append({k: len(v) for k, v in times.items()})
        return keep

    monkeypatch.setattr(arrangement, "choose", chosen)
    model, inputs = _wide()
    rows = _rows(model, inputs, LOSS)
    every = set()
    for formed in (*arrangement.SCHEDULE, keep, keep):
        result = jk.gram(model, inputs, outputs=LOSS, progress=False)
        forms = set(result.forms.values())
        every |= forms
        assert (forms == {"materialized"}) is formed, result.forms
        _close(result.matrix, rows @ rows.T)
    assert seen == [{False: 2, True: 2}]
    assert every == {"ghost", "materialized"}
