"""``auto``'s tries keep the ski-rental promise: a try's predicted cost
counts its runs and a trace no lower than this problem's, a trial far slower
than the current strategy ends on its first untraced run, and what a try
cost beyond its prediction is earned back before the next one."""

from __future__ import annotations

import keras
import numpy as np
import pytest
import tensorflow as tf

import jacobkit as jk
from jacobkit import planner
from jacobkit.planner import Probe, estimates, selection, trials
from jacobkit.problem.plan import Estimate
from jacobkit.strategies import Batch, Chunked, While

#: float32 against the float64 tape loop, measured: at most 4.8e-7 of each
#: target's largest entry (batch, chunked(32), while(parallel=10); 3 seeds);
#: the bound leaves 10x for other CPUs' kernels
RTOL = 5e-6


def _convnet(dtype: str) -> keras.Model:
    """16x16x3 images -> two 3x3 relu convolutions -> pooling -> 5 logits
    (the shape of ``benchmarks/reductions_models.py``'s conv net, smaller)."""
    keras.utils.set_random_seed(0)
    inputs = keras.Input((16, 16, 3), dtype=dtype)
    h = keras.layers.Conv2D(8, 3, activation="relu", name="conv1", dtype=dtype)(inputs)
    h = keras.layers.Conv2D(
        16, 3, strides=2, activation="relu", name="conv2", dtype=dtype
    )(h)
    h = keras.layers.GlobalAveragePooling2D(dtype=dtype)(h)
    outputs = keras.layers.Dense(5, name="head", dtype=dtype)(h)
    return keras.Model(inputs, outputs)


def _loss(y, logits):
    return keras.losses.sparse_categorical_crossentropy(y, logits, from_logits=True)


def _reference(model: keras.Model, x: np.ndarray, y: np.ndarray) -> list:
    """Each example's loss gradient per trainable variable, in float64, by a
    tape per example (the obvious way): ``(B, *v.shape)`` each."""
    wide = _convnet("float64")
    wide.set_weights([w.astype("float64") for w in model.get_weights()])
    rows = []
    for i in range(len(x)):
        with tf.GradientTape() as tape:
            logits = wide(x[i : i + 1].astype("float64"))
            loss = _loss(y[i : i + 1], logits)[0]
        rows.append([g.numpy() for g in tape.gradient(loss, wide.trainable_variables)])
    return [np.stack(parts) for parts in zip(*rows, strict=True)]


def test_a_candidate_far_slower_is_judged_on_its_first_untraced_run():
    """Per-example loss gradients of a small conv net start on ``batch``
    (closed forms for every target); ``rent=0`` tries each candidate as soon
    as batch's rate is known. ``while(parallel=10)`` runs such rows one
    backward pass at a time (measured 15-20x batch's call on the larger conv
    net of ``benchmarks/reductions_models.py``; here 6.7-8.3x, 3 seeds,
    against the 2.3x that ends a trial): its trial ends on its first
    untraced run, not after ``trial_runs``, and the plan says so. Every
    answer against float64."""
    model = _convnet("float32")
    rng = np.random.default_rng(0)
    x = rng.standard_normal((32, 16, 16, 3)).astype("float32")
    y = rng.integers(0, 5, 32).astype("int64")
    want = _reference(model, x, y)
    ran = []
    with planner.use_policy(rent=0.0):
        for _ in range(8):
            result = jk.jacobian(
                model, (x, y), model.trainable_variables, outputs=jk.Loss(_loss)
            )
            (run,) = result.plan.last_call
            ran.append(run)
            for got, expected in zip(result.values(), want, strict=True):
                scale = np.max(np.abs(expected))
                np.testing.assert_allclose(got, expected, rtol=0, atol=RTOL * scale)
    plan = result.plan
    assert plan.settled and plan.strategy == Batch(), plan.summary()
    # the candidates run in turn (rent=0), whole calls each: while's trial
    # is its traced call and one untraced call, then it is judged
    slow = While(10)
    calls = [r.call for r in ran if r.strategy == slow]
    assert [r.traced for r in ran if r.strategy == slow] == [True, False], calls
    (back,) = [s for s in plan.switches if s.old == slow and s.new == Batch()]
    assert back.call == calls[-1] + 1, plan.summary()
    assert "judged on its first run" in back.reason, back.reason
    (rejected,) = [r for r in plan.rejected if r.strategy == slow]
    assert "judged on its first run" in rejected.reason, rejected.reason


def test_a_candidate_within_the_first_run_inflation_runs_its_whole_trial():
    """A first untraced run within ``first_run_inflation x noise`` of the
    current rate is what the allocator's growth explains: the trial goes on."""
    policy = planner.Policy()
    was, trying = Batch(), While(10)
    limit = policy.first_run_inflation * policy.noise

    def runs(first_ratio: float) -> list[Probe]:
        return [
            Probe(was, 1, 0, 32, 0.10, True),
            Probe(was, 2, 0, 32, 0.012, False),
            Probe(was, 3, 0, 32, 0.010, False),
            Probe(trying, 4, 0, 32, 0.5, True),
            Probe(trying, 5, 0, 32, 0.010 * first_ratio, False),
        ]

    assert not trials.ends_early(policy, runs(0.99 * limit), was, trying)
    assert trials.ends_early(policy, runs(1.01 * limit), was, trying)
    # before its first untraced run, nothing to judge
    assert not trials.ends_early(policy, runs(100.0)[:4], was, trying)


def test_a_try_costs_its_trace_and_its_runs():
    """The rule waits ``rent`` times the trace and the trial's runs (the
    traced one and ``trial_runs``) at the current call's time."""
    policy = planner.Policy()
    cost = selection.try_cost_s(policy, 0.11, 0.009)
    assert cost == pytest.approx(0.11 + (1 + policy.trial_runs) * 0.009)
    assert not selection.should_try(policy, 0.99 * policy.rent * cost, cost)
    assert selection.should_try(policy, policy.rent * cost, cost)
    assert not selection.should_try(policy, 1e9, None)


def test_a_compiled_candidate_is_not_predicted_to_trace_faster_than_the_current():
    """Scaled by the trace weights from ``batch``'s measured trace,
    ``while`` was predicted at a quarter of it (0.03 s against 0.11 s;
    measured 0.15 s): every compiled strategy traces the model's forward
    and backward passes, so the current one's trace is the floor. Upwards
    the weights still scale, from every strategy measured on the problem
    (``chunked(8)`` then traced in 0.37-0.39 s)."""
    batch = Estimate(Batch(), seconds_per_row=3e-4, trace_s=0.11)
    assert estimates.predicted_trace_s(While(10), None, batch, 32) == 0.11
    slow = Estimate(While(10), seconds_per_row=5e-3, trace_s=0.15)
    chunked = estimates.predicted_trace_s(Chunked(8), None, slow, 32)
    assert chunked == pytest.approx(0.15 * Chunked.trace_weight / While.trace_weight)
    # strategies tried before on this problem scale too: the most of them
    both = estimates.predicted_trace_s(Chunked(8), None, batch, 32, (slow,))
    assert both == pytest.approx(0.15 * Chunked.trace_weight / While.trace_weight)
    # measured before: the measurement
    known = Estimate(While(10), trace_s=0.2)
    assert estimates.predicted_trace_s(While(10), known, batch, 32) == 0.2


def test_what_a_try_cost_beyond_its_prediction_is_owed():
    """A trial's runs, the traced one included, against its predicted cost."""
    trying = While(10)
    probes = [
        Probe(Batch(), 1, 0, 32, 0.01, False),
        Probe(trying, 2, 0, 32, 0.32, True),
        Probe(trying, 3, 0, 32, 0.17, False),
    ]
    assert trials.overrun_s(probes, trying, 0.14) == pytest.approx(0.35)
    assert trials.overrun_s(probes, trying, 1.0) == 0.0


def test_a_trial_lost_within_the_noise_runs_until_settled():
    """After its ``trial_runs``, a candidate that would lose with its best
    rate within ``noise`` of the current one's (its first timed runs in a
    fresh process are slower than its steady ones: ``while(10)`` on the MLP
    without oneDNN measured 1.13x ``batch``'s rate in one trial, 1.45x
    steady) runs again, up to ``settle_runs`` timed runs, and is judged on
    its best of the newest ``rate_runs``; a candidate clearly faster, or
    clearly slower, ends its trial as before."""
    policy = planner.Policy()
    was, trying = Batch(), While(10)
    mib = 2**20

    def runs(*ratios: float) -> list[Probe]:
        return [
            Probe(was, 1, 0, 32, 0.10, True, 400 * mib),
            Probe(was, 2, 0, 32, 0.012, False, 400 * mib),
            Probe(was, 3, 0, 32, 0.010, False, 400 * mib),
            Probe(trying, 4, 0, 32, 0.5, True, 600 * mib),
            *(
                Probe(trying, 5 + i, 0, 32, 0.010 * r, False, 600 * mib)
                for i, r in enumerate(ratios)
            ),
        ]

    def state(probes: list[Probe]) -> tuple[bool, trials.Verdict | None]:
        ests = (
            estimates.estimate(was, probes, rate_runs=policy.rate_runs),
            estimates.estimate(trying, probes, rate_runs=policy.rate_runs),
        )
        if not trials.over(policy, probes, was, trying, ests):
            return False, None
        return True, trials.judge(policy, probes, was, trying, ests, (9, 0))

    faster = 1 / policy.noise
    # within the noise (0.9x, higher peak): not over after trial_runs
    assert state(runs(1.0, 0.9)) == (False, None)
    # its third run settles clearly faster: over, and it wins
    done, verdict = state(runs(1.0, 0.9, 0.97 * faster))
    assert done and verdict is not None and verdict.won
    assert "3 timed runs" in verdict.switch.reason
    # never settling: over at settle_runs (lost within the noise)
    probes = runs(1.0, 0.95, 0.93, 0.96)
    assert len(probes) - 4 == policy.settle_runs
    done, verdict = state(probes)
    assert done and verdict is not None and not verdict.won
    # clear outcomes end after trial_runs, as before
    done, verdict = state(runs(1.0, 0.97 * faster))
    assert done and verdict is not None and verdict.won
    done, verdict = state(runs(1.3, 1.02 * policy.noise))
    assert done and verdict is not None and not verdict.won
    # within the noise with a lower peak, it wins without more runs
    lower = [
        Probe(p.strategy, p.call, p.start, p.rows, p.seconds, p.traced, 300 * mib)
        if p.strategy == trying
        else p
        for p in runs(1.0, 0.9)
    ]
    done, verdict = state(lower)
    assert done and verdict is not None and verdict.won
