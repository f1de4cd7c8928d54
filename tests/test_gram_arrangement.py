"""``jk.gram``'s arrangement chosen by measurement
(:mod:`jacobkit.reductions.arrangement`): the cost rule's forms, every
target's rows formed, or the per-example gradients materialized as
``jacobian()`` gives them, then ``J Jᵀ``. The decisions are tested on
injected times (never on the wall clock); the matrices of each arrangement
against the float64 Gram computed the obvious way (per-example gradients by
a float64 tape loop, then ``J Jᵀ``: ``tests/test_gram.py``'s reference and
tolerance, 1e-5 of the largest entry; measured on the wide model below,
largest error over the largest entry, oneDNN on / off: the rule's 3.2e-7 /
3.8e-7, formed 1.7e-7 / 1.4e-7, materialized 1.7e-7 / 1.4e-7).
"""

from __future__ import annotations

import types

import keras
import numpy as np
import pytest
import tensorflow as tf

import jacobkit as jk
from jacobkit.planner import paired
from jacobkit.planner.paired import OTHER, PRIOR
from jacobkit.problem.reduction import Flat, Ghost
from jacobkit.reductions import arrangement, blocks, grams
from jacobkit.reductions import features as feats
from jacobkit.reductions.arrangement import FORMED, MATERIALIZED, RULE
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


def test_where_every_target_is_formed_only_materializing_is_timed():
    """Targets all formed under the rule (the wide model of
    tests/test_reductions, its convolution alone): the formed arrangement
    is the rule's, and the materializing one alone is timed against it."""
    model, inputs = _wide()
    conv = [v for v in model.trainable_variables if "conv" in v.path]
    first = jk.gram(model, inputs, layer=conv, outputs=LOSS, progress=False)
    assert set(first.forms.values()) == {"materialized"}
    assert first.arrangement.ran == RULE and first.arrangement.kept is None
    assert first.arrangement.pending == (MATERIALIZED,)


def _wide_vectors():
    """A Dense kernel on vectors whose rows formed (131,072 numbers per
    example) dwarf its factors (256 inputs, 512 cotangents): the rule
    ghosts it."""
    rng = np.random.default_rng(5)
    keras.utils.set_random_seed(5)
    model = keras.Sequential(
        [
            keras.Input((256,)),
            keras.layers.Dense(512, activation="tanh", name="wide"),
            keras.layers.Dense(3, name="head"),
        ]
    )
    x = rng.normal(size=(8, 256)).astype("float32")
    return model, (x, rng.integers(0, 3, 8))


@pytest.mark.parametrize("room", [-8, 0])
def test_a_budget_too_small_for_the_formed_rows_times_nothing(room):
    """Under a budget that holds two chunks of the rule's features but not
    two of the rows formed (``B x P`` float32 numbers) within half, neither
    the formed nor the materializing arrangement is timed: the rule's is
    kept from the first call; with those bytes exactly, both are."""
    model, inputs = _wide_vectors()
    examples = len(inputs[1])
    formed = examples * sum(4 * int(v.shape.num_elements()) for v in model.weights)
    budget = 4 * formed + room
    found = jk.gram(model, inputs, outputs=LOSS, memory_budget=budget, progress=False)
    assert found.chunk_examples >= examples  # one chunk: rows_fit's B
    assert "ghost" in found.forms.values()
    (trial,) = arrangement._TRIALS.of(model).values()
    if room < 0:
        assert found.arrangement == arrangement.Arranged(RULE, RULE)
        assert trial.kept == RULE and trial.trial.calls == 0
    else:
        assert found.arrangement.pending == (FORMED, MATERIALIZED)
        assert trial.kept is None


def test_materializing_applies_wherever_the_rows_fit():
    small = tf.Variable(tf.zeros((8, 4)))
    flat = feats.ChunkFeatures((Flat(tf.zeros((6, 32))),), 6, "batch")
    # 6 rows x 32 float32 = 768 bytes; two chunks within half the budget
    assert arrangement.applying(flat, [small], 4 * 768) == [MATERIALIZED]
    assert arrangement.applying(flat, [small], 4 * 768 - 1) == []
    ghost = feats.ChunkFeatures(
        (Ghost(tf.zeros((6, 1, 8)), tf.zeros((6, 1, 1, 4))),), 6, "batch"
    )
    assert arrangement.applying(ghost, [small], 4 * 768) == [FORMED, MATERIALIZED]


#: the ways each call runs, as the chain of pairings schedules them: the
#: rule's against the formed (paired.SCHEDULE), then the faster against the
#: materializing one
def _schedule(first: str) -> list[str]:
    ways = {paired.PRIOR: RULE, paired.OTHER: FORMED}
    then = {paired.PRIOR: first, paired.OTHER: MATERIALIZED}
    return [ways[w] for w in paired.SCHEDULE] + [then[w] for w in paired.SCHEDULE]


@pytest.mark.parametrize("faster", [RULE, FORMED, MATERIALIZED])
def test_auto_times_the_three_and_keeps_what_it_measured_faster(faster, monkeypatch):
    """Each call's time injected (a clock only ``jk.gram`` reads, advanced
    by what its arrangement is said to take): the calls run the chain's
    schedule, each matrix the float64 reference's, and the one measured
    faster is kept; the result records what ran, what is kept and each
    arrangement's best timed call."""
    seconds = {RULE: 1.5, FORMED: 1.4, MATERIALIZED: 1.3}
    seconds[faster] = 1.0
    clock = [0.0]
    matrix = blocks.Blocks.matrix

    def timed(self):
        found = matrix(self)
        clock[0] += seconds[self.way]
        return found

    monkeypatch.setattr(blocks.Blocks, "matrix", timed)
    monkeypatch.setattr(
        grams, "time", types.SimpleNamespace(perf_counter=lambda: clock[0])
    )
    model, inputs = _wide()
    rows = _rows(model, inputs, LOSS)
    first = RULE if seconds[RULE] < seconds[FORMED] else FORMED
    ways = [*_schedule(first), faster, faster]
    for call, way in enumerate(ways):
        result = jk.gram(model, inputs, outputs=LOSS, progress=False)
        assert result.arrangement.ran == way, call
        forms = set(result.forms.values())
        assert (forms == {"materialized"}) is (way != RULE), result.forms
        _close(result.matrix, rows @ rows.T)
    assert result.arrangement.kept == faster
    assert result.arrangement.best_s == pytest.approx(seconds, abs=1e-9)


@pytest.mark.parametrize("sets", ["itself", "two arrays", "streamed"])
def test_the_materializing_arrangement_against_float64(sets, monkeypatch):
    """Every call run materializing (the trial's choice forced): a set with
    itself, two sets of arrays in one call, and a dataset in chunks of 2
    against arrays, each the float64 reference's within the tolerance
    above."""
    monkeypatch.setattr(arrangement.Arrangements, "next", lambda self: MATERIALIZED)
    model, inputs = _wide()
    rows = _rows(model, inputs, LOSS)
    other = tuple(a[:3] for a in inputs)
    if sets == "itself":
        result = jk.gram(model, inputs, outputs=LOSS, progress=False)
        want = rows @ rows.T
    elif sets == "two arrays":
        result = jk.gram(model, inputs, other, outputs=LOSS, progress=False)
        want = rows @ rows[:3].T
    else:
        train = tf.data.Dataset.from_tensor_slices(inputs).batch(2)
        result = jk.gram(
            model, train, other, outputs=LOSS, chunk_examples=2, progress=False
        )
        want = rows @ rows[:3].T
    assert result.arrangement.ran == MATERIALIZED
    assert set(result.forms.values()) == {"materialized"}
    _close(result.matrix, want)
