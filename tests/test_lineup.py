"""A session's lineup (``planner.lineup.Lineup``) and what the disk cache
keeps of a session (``planner.keeping``): each change a new frozen record,
read without a model (the sessions that use them are tested through
``jk.jacobian`` in ``test_planner.py`` and ``test_plan_cache.py``)."""

from __future__ import annotations

import dataclasses

import pytest
import tensorflow as tf

from jacobkit import strategies
from jacobkit.planner.lineup import Lineup
from jacobkit.problem.plan import Rejection, Switch

LOOP = strategies.Loop()
WHILE = strategies.While()
CHUNKED = strategies.Chunked(chunk_size=4)
BATCH = strategies.Batch()


def test_a_lineup_is_frozen_and_a_change_leaves_it_as_it_was():
    start = Lineup(WHILE, (CHUNKED, BATCH))
    with pytest.raises(dataclasses.FrozenInstanceError):
        start.current = CHUNKED  # type: ignore[misc]
    tried = start.trial(CHUNKED, 2, "due")
    assert start == Lineup(WHILE, (CHUNKED, BATCH))
    assert tried == Lineup(
        WHILE, (BATCH,), CHUNKED, (), (Switch(2, 0, WHILE, CHUNKED, "due"),)
    )


def test_candidates_dropped_at_the_head_of_the_queue_are_rejected():
    dropped = (Rejection(CHUNKED, "too big", memory=True),)
    after = Lineup(WHILE, (CHUNKED, BATCH)).without(dropped)
    assert (after.pending, after.rejected) == ((BATCH,), dropped)


def test_a_failed_run_drops_a_trial_or_a_start_that_computed_nothing():
    trial = Lineup(WHILE, (BATCH,), trying=CHUNKED)
    dropped = trial.failed(CHUNKED, "ValueError: no\nmore", ran=True)
    assert dropped == Lineup(
        WHILE, (BATCH,), rejected=(Rejection(CHUNKED, "ValueError: no"),)
    )
    start = Lineup(WHILE, (BATCH,))
    assert start.failed(WHILE, "why", ran=False) == Lineup(
        BATCH, rejected=(Rejection(WHILE, "why"),)
    )
    assert start.failed(WHILE, "why", ran=True) is None  # the caller's error
    assert Lineup(WHILE).failed(WHILE, "why", ran=False) is None


def test_a_back_off_runs_the_smaller_and_raises_at_one_row():
    after = Lineup(CHUNKED).backed_off(CHUNKED, CHUNKED.smaller(), 3, "ran out")
    smaller = strategies.Chunked(chunk_size=2)
    assert after == Lineup(
        smaller,
        rejected=(Rejection(CHUNKED, "ran out", memory=True),),
        switches=(Switch(3, 0, CHUNKED, smaller, "ran out"),),
    )
    trial = Lineup(WHILE, trying=CHUNKED)
    assert trial.backed_off(CHUNKED, smaller, 3, "x").trying == smaller
    assert trial.backed_off(CHUNKED, None, 3, "x").rejected == (
        Rejection(CHUNKED, "x at its smallest"),
    )
    with pytest.raises(tf.errors.ResourceExhaustedError) as err:
        Lineup(WHILE).backed_off(WHILE, None, 3, "went over the budget")
    assert err.value.message == (
        f"jacobkit: {WHILE.label} went over the budget computing one row at a time"
    )
