"""``auto``: every row computed once and kept, switches between real calls,
budgets respected, out-of-memory back-off through ``smaller()``."""

from __future__ import annotations

import functools
import re
import warnings

import keras
import numpy as np
import pytest
import tensorflow as tf

import jacobkit as jk
from jacobkit import engine, memory, planner, testing
from jacobkit.planner import Probe, estimates, scratch
from jacobkit.problem import Call
from jacobkit.problem.liveness import SequentialMemory
from jacobkit.strategies import Batch, Chunked, Jacobian, While, gradients
from jacobkit.strategies.structured import NoShortcut
from jacobkit.testing import examples
from tests.cases import (
    OUTPUTS,
    call_kwargs,
    kernel_scratch,
    reference,
    target_variables,
)

# A generator big enough that budgets matter (48 rows). Measured on CPU:
# while(10) peaks near 3 MiB, chunked(48) and batch near 10-20 MiB.
SIZES = {"batch": 16, "sequence": 64, "channels": 8, "filters": 32, "features": 48}


@pytest.fixture(autouse=True)
def _no_structure(monkeypatch):
    """These tests exercise switches and budgets, which ``auto``
    skips where an exact structural shortcut applies (this generator ends in
    a linear head on 32 < 48 channels). tests/test_structure.py covers auto
    with the shortcut."""

    def refuse(self, problem):
        raise NoShortcut("off in test_planner")

    monkeypatch.setattr(jk.strategies.Structured, "check", refuse)


@pytest.fixture(autouse=True)
def _cheapest_start():
    """These tests follow switches from the start cheapest to trace
    (``while``): no slack for a vectorized start, which this generator's
    few MiB per vectorized row would take (``chunked(48)`` predicted at
    37.3 MiB against ``while(10)``'s 4.3, measured 28 and 2.6;
    :func:`test_starts_vectorized_where_it_costs_little_memory` tests the
    slack)."""
    with planner.use_policy(start_slack_bytes=0):
        yield


@pytest.fixture
def generator():
    """A fresh model per test: a fresh plan."""
    return examples.build("generator", **SIZES)


@functools.cache
def generator_reference() -> list:
    ex = examples.build("generator", "float64", **SIZES)
    return testing.reference_jacobian(
        ex.model, ex.inputs, target_variables(ex), call_kwargs=call_kwargs(ex.model)
    )


@pytest.fixture
def eager_trials():
    """Try every candidate, and run every row at once, as soon as the
    current strategy's rate is known."""
    with planner.use_policy(rent=0.0):
        yield


def _covers_every_row_once(plan: jk.Plan) -> None:
    rows = sorted(
        (p.start, p.start + p.rows) for p in plan.last_call if p.call == plan.calls
    )
    assert rows[0][0] == 0 and rows[-1][1] == plan.num_rows, rows
    assert all(a[1] == b[0] for a, b in zip(rows, rows[1:])), rows


def test_settled_calls_run_every_row_at_once(generator, eager_trials):
    """A settled plan runs its strategy on every row in one run, as the fixed
    strategy would. The current strategy's rate takes two calls, and each of
    the two candidates a traced call and two timed ones (four where it lost
    within the noise, ``Policy.settle_runs``): the ninth call, or at most
    the thirteenth, judges the last try."""
    ex = generator
    for _ in range(13):
        result = jk.jacobian(ex.model, ex.inputs, ex.layer)
        if result.plan.settled:
            break
    plan = result.plan
    assert plan.settled, str(plan)
    (whole,) = plan.last_call
    assert (whole.start, whole.rows, whole.strategy) == (0, 48, plan.strategy)
    testing.assert_close(result, generator_reference())


def test_a_settled_call_costs_what_the_kept_strategy_does(generator, eager_trials):
    """Once settled, a call runs the kept strategy's own compiled computation,
    and nothing else: no retrace (its tf.function's trace count stays put),
    one untraced run of every row, and a fixed call of that configuration
    shares the computation (the same problem key and strategy key: it does
    not trace either), so auto's steady call costs what the fixed strategy's
    does (the timing itself is a benchmark's: on the MLP of
    ``benchmarks/mlp_limit.py``, oneDNN off, TensorFlow's default allocator,
    one core, paired in one process, loaded, auto kept ``while(10)`` and the
    fixed strategies took 0.96-1.04x its steady call's time, 0.94-1.03x its
    user CPU time, none retraced: ``benchmarks/mlp_auto_paired.py``)."""
    ex = generator
    for _ in range(13):
        result = jk.jacobian(ex.model, ex.inputs, ex.layer)
        if result.plan.settled:
            break
    kept = result.plan.strategy
    assert result.plan.settled, str(result.plan)
    compiled = kept.compiled_for(Call(ex.model, ex.layer).problem(ex.inputs))
    traces = compiled.tracing_count
    assert traces >= 1, "auto ran the kept strategy's computation, traced"
    expected = generator_reference()
    for _ in range(3):
        result = jk.jacobian(ex.model, ex.inputs, ex.layer)
        (run,) = result.plan.last_call
        assert (run.strategy, run.traced, run.rows) == (kept, False, 48), run
        assert not result.stats.traced and result.plan.strategy == kept
        testing.assert_close(result, expected)
    fixed = jk.jacobian(ex.model, ex.inputs, ex.layer, strategy=kept)
    assert not fixed.stats.traced, "the fixed call reuses auto's computation"
    testing.assert_close(fixed, expected)
    assert compiled.tracing_count == traces


def test_every_call_runs_every_row_at_once_by_default(generator, eager_trials):
    """By default no call is split: the first runs the starting strategy on
    every row (one trace, no joining), and a candidate is tried on whole
    calls, from call 3 (call 2 measures the untraced rate)."""
    ex = generator
    expected = generator_reference()
    for call in range(1, 6):
        result = jk.jacobian(ex.model, ex.inputs, ex.layer)
        testing.assert_close(result, expected)
        (run,) = result.plan.last_call
        assert (run.start, run.rows) == (0, 48)
        assert run.traced == (call in (1, 3)), (call, run)
        assert run.strategy.name == ("while" if call < 3 else "chunked")
    plan = result.plan
    assert plan.segment_rows == plan.num_rows == 48
    first = plan.switches[0]
    assert (first.call, first.row, first.old, first.new) == (
        3,
        0,
        While(10),
        Chunked(48),
    )
    assert "trying it" in first.reason


#: a generator whose vectorized rows cost much more memory than ``while``:
#: measured (TF 2.21, 2-core CPU, oneDNN on) ``chunked(144)`` 2184-2756 MiB,
#: ``chunked(36)`` 1182 MiB, ``while(10)`` 38-60 MiB
WIDE_CONV = {
    "batch": 64,
    "sequence": 128,
    "channels": 8,
    "filters": 64,
    "filters2": 128,
    "filters3": 128,
    "features": 144,
}


def test_starts_vectorized_where_it_costs_little_memory():
    """Where computing every row at once is predicted to peak within
    ``Policy.start_peak_factor`` of ``while``'s plus its ``start_slack_bytes``
    (a wide MLP: the result dominates; a small generator: a few MiB), the
    first call vectorizes every row (on a Dense target, by the closed
    form of ``batch``, whose chunks of rows cost the least work and
    memory); where it costs much more (the wide generator's conv cotangents
    per row), it starts on ``while``. Predicted: squared outputs (no closed
    form) on the MLP at B=64, ``chunked(144)`` 724 MiB against ``while``'s
    584 (the 288 MiB result twice; measured 577 and 578); the small
    generator's ``chunked(48)`` 37.3 MiB against 4.3 (measured 28 and 2.6,
    steady 0.65x while's time); the wide one's ``chunked(144)`` 2614 MiB
    against 95 (measured: :data:`WIDE_CONV`)."""
    with planner.use_policy(planner.Policy()):
        wide = examples.build("mlp", batch=256, inputs=512, hidden=1024, features=144)
        assert jk.plan(wide.model, wide.inputs, wide.layer).strategy == Batch()
        narrow = examples.build("mlp", batch=64, inputs=512, hidden=1024, features=144)
        square = jk.plan(
            narrow.model, narrow.inputs, narrow.layer, outputs=OUTPUTS["callable"]
        )
        assert square.strategy == Chunked(144)
        small = examples.build("generator", **SIZES)
        assert jk.plan(small.model, small.inputs, small.layer).strategy == Chunked(48)
        conv = examples.build("generator", **WIDE_CONV)
        assert jk.plan(conv.model, conv.inputs, conv.layer).strategy == While(10)
        # a budget that shrinks chunked to while's size does not change that
        tight = jk.plan(conv.model, conv.inputs, conv.layer, memory_budget="256MiB")
        assert tight.strategy.name == "while"


def test_vectorized_rows_are_predicted_from_their_own_backward_tensors():
    """A pfor-vectorized pass keeps the forward pass once and batches each
    row's backward tensors: the sequential rows' count
    (:class:`~jacobkit.problem.liveness.SequentialMemory`) for its rows in
    flight, two chunks' where there is more than one, never more than a
    forward pass's activations per row."""
    rows = SequentialMemory(first_row=3 * 2**20, per_row=2**20)
    prior = planner.MemoryPrior(row_bytes=6 * 2**20, sequential=rows)
    result = 2**20

    def peak(strategy):
        return estimates.predicted_peak(strategy, 32, prior, result)

    two_results = 2 * result
    assert peak(Chunked(32)) == rows.peak(32) + two_results
    assert peak(Jacobian()) == rows.peak(32) + two_results
    assert peak(Chunked(8)) == rows.peak(16) + two_results
    assert peak(Chunked(1)) == rows.peak(2) + two_results
    # the activations' count bounds it (here: 2 rows of 6 MiB)
    few = planner.MemoryPrior(row_bytes=2**20 // 2, sequential=rows)
    assert estimates.predicted_peak(Chunked(32), 32, few, result) == (
        33 * 2**19 + two_results
    )
    # unknown sequential memory: the activations per row, as before
    unknown = planner.MemoryPrior(row_bytes=2**20)
    assert estimates.predicted_peak(Chunked(4), 32, unknown, 0) == 5 * 2**20


def test_the_start_takes_the_slack_for_little_memory_only():
    """:func:`~jacobkit.planner.selection.starting_first` given priors: the
    vectorized candidate starts within ``start_peak_factor`` x the cheapest's
    peak + ``start_slack_bytes``, not beyond; nor where it traces more than
    ``start_trace_factor`` x the cheapest."""
    from jacobkit.planner import selection

    policy = planner.Policy()
    mib = 2**20
    found = [While(10), Chunked(32), Jacobian()]

    def first(chunked_peak, jacobian_peak=10**12):
        peaks = {"while": 8 * mib, "chunked": chunked_peak, "jacobian": jacobian_peak}
        return selection.starting_first(
            list(found), 32, lambda s: peaks[s.name], policy
        )[0]

    limit = int(policy.start_peak_factor * 8 * mib + policy.start_slack_bytes)
    assert first(limit) == Chunked(32)
    assert first(limit + 1) == While(10)
    # jacobian traces 2.5x while: never the start, however little it takes
    assert first(10**12, jacobian_peak=8 * mib) == While(10)


def test_plan_before_any_call_runs_nothing(generator):
    ex = generator
    plan = jk.plan(ex.model, ex.inputs, ex.layer, memory_budget="64MiB")
    assert isinstance(plan, jk.Plan)
    assert plan.source == "not run yet" and plan.calls == 0
    assert plan.estimates == () and plan.predicted_time_s is None
    assert plan.budget_bytes == 64 * 2**20
    assert plan.result_bytes == 48 * (5 * 8 * 32 + 32) * 4
    assert plan.strategy.name == "while"
    assert plan.predicted_peak_bytes <= 64 * 2**20 * planner.Policy().safety
    text = plan.summary()
    assert "64.0 MiB budget" in text and "not run yet" in text
    kinds = {r.label.split("(")[0] for r in plan.rejected}
    kinds |= {s.name for s in (plan.strategy, *plan.pending)}
    assert {"chunked", "while", "batch", "jacobian", "loop", "forward"} <= kinds


@pytest.mark.parametrize("budget", ["4MiB", "12MiB", "1GiB"])
def test_measured_peak_stays_within_budget(generator, eager_trials, budget):
    ex = generator
    limit = memory.parse_budget(budget)
    for _ in range(4):  # trials included
        with memory.PeakMemory("CPU:0") as call:
            result = jk.jacobian(ex.model, ex.inputs, ex.layer, memory_budget=budget)
        assert call.extra_bytes <= limit, result.plan.summary()
    assert result.plan.predicted_peak_bytes <= limit


@pytest.mark.parametrize("budget", ["48MiB", "96MiB"])
def test_the_first_call_stays_within_budget_where_kernels_take_scratch(
    generator, budget
):
    """Where this CPU's convolution gradient kernels allocate work space (32
    MiB per backward pass without oneDNN, see ``jacobkit.planner.scratch``),
    the prior counts it per pass in flight, so the very first call fits:
    48 MiB leaves room for one pass, 96 MiB for two (the default start,
    ``while(10)``, runs two at once on two cores: 65 MiB measured). With
    oneDNN the kernels take none and any start fits."""
    limit = memory.parse_budget(budget)
    with memory.PeakMemory("CPU:0") as call:
        result = jk.jacobian(
            generator.model, generator.inputs, generator.layer, memory_budget=budget
        )
    assert call.extra_bytes <= limit, result.plan.summary()


def test_tighter_budget_holds_fewer_rows_at_once(generator):
    """A row in flight of ``while`` is predicted at its own tensors over the
    forward pass kept once: ``while(10)`` 4.3 MiB, ``while(2)`` 2.8 MiB,
    measured 2.2 and 1.3 MiB."""
    ex = generator
    small = jk.plan(ex.model, ex.inputs, ex.layer, memory_budget="4MiB")
    large = jk.plan(ex.model, ex.inputs, ex.layer, memory_budget="1GiB")
    assert large.strategy == While(10)
    assert small.strategy.name == "while"
    assert small.strategy.parallel_iterations < 10, small.summary()
    assert small.predicted_peak_bytes <= 4 * 2**20 * planner.Policy().safety


def test_budget_below_result_is_refused_before_allocating(generator):
    ex = generator
    needed = 48 * (5 * 8 * 32 + 32) * 4
    message = (
        f"the result alone needs {memory.format_bytes(needed)} ({needed} bytes: "
        "48 rows × 1312 parameters × 4 bytes), more than the 85.0 KiB (85% of "
        "the budget) a plan may use. Raise memory_budget, keep fewer rows with "
        "features=[...], or use a smaller batch."
    )
    with (
        memory.PeakMemory("CPU:0") as peak,
        pytest.raises(ValueError, match=re.escape(message)),
    ):
        jk.jacobian(ex.model, ex.inputs, ex.layer, memory_budget="100KiB")
    assert peak.extra_bytes < 2**20  # nothing of the Jacobian's size was made


def test_budget_below_one_row_is_refused(generator):
    ex = generator
    with pytest.raises(ValueError, match=r"even one row at a time needs about"):
        jk.jacobian(ex.model, ex.inputs, ex.layer, memory_budget="1MiB")


def _refused(ex, budget: int) -> str:
    with pytest.raises(ValueError) as refused:
        jk.jacobian(ex.model, ex.inputs, ex.layer, memory_budget=budget)
    return str(refused.value)


@pytest.mark.parametrize("what", ["the result alone", "even one row at a time"])
def test_a_refusal_below_the_budget_states_the_share_a_plan_may_use(generator, what):
    """A need between 85% of the budget (``Policy.safety``) and the budget:
    "more than the budget allows" contradicted the figures it gave (12.1 MiB
    needed "more than" a 16 MiB budget)."""
    ex = generator
    if what == "the result alone":
        need = 48 * (5 * 8 * 32 + 32) * 4
    else:
        text = _refused(ex, 2**20)
        found = re.search(r"needs about ([\d.]+ \w+)", text)
        assert found, text
        need = memory.parse_budget(found.group(1).replace(" ", ""))
    budget = int(need / 0.92)  # the need is 92% of it
    safety = planner.Policy().safety
    text = _refused(ex, budget)
    assert f"{what} needs" in text, text
    allowed = memory.format_bytes(int(budget * safety))
    assert f"more than the {allowed} (85% of the budget) a plan may use" in text
    assert "more than the budget" not in text


def inject_out_of_memory(monkeypatch, cls, size_of, most: int) -> list:
    """Make ``cls.run`` raise TensorFlow's out-of-memory error whenever
    ``size_of(strategy) > most``; returns the list of sizes tried."""
    original = cls.run
    tried = []

    def run_with_small_memory(self, problem):
        tried.append(size_of(self))
        if size_of(self) > most:
            raise tf.errors.ResourceExhaustedError(None, None, "injected OOM")
        return original(self, problem)

    monkeypatch.setattr(cls, "run", run_with_small_memory)
    return tried


def test_out_of_memory_in_while_halves_the_rows_in_flight(monkeypatch):
    # 10 rows: one segment; a callable outputs= (rows that mix examples), so
    # that auto starts on while rather than the Dense layer's closed form
    ex = examples.build("mlp")
    outputs = OUTPUTS["callable"]
    tried = inject_out_of_memory(monkeypatch, While, lambda s: s.parallel_iterations, 2)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = jk.jacobian(ex.model, ex.inputs, ex.layer, outputs=outputs)
    assert tried == [10, 5, 2] and result.strategy_config == While(2)
    assert len([w for w in caught if "ran out of memory" in str(w.message)]) == 1
    testing.assert_close(result, reference("mlp", "callable"))
    switch = result.plan.switches[-1]
    assert (switch.old, switch.new, switch.reason) == (
        While(5),
        While(2),
        "ran out of memory",
    )
    tried.clear()
    jk.jacobian(ex.model, ex.inputs, ex.layer, outputs=outputs)
    assert tried == [2], "remembered what worked"


@pytest.fixture
def chunked_only(monkeypatch):
    """auto lists only chunked (a strategy joins auto through for_auto)."""
    for cls in (While, Batch):
        monkeypatch.setattr(cls, "for_auto", classmethod(lambda cls, rows: None))


def test_out_of_memory_in_chunked_halves_the_chunk(monkeypatch, chunked_only):
    ex = examples.build("generator", **SIZES)
    sizes = inject_out_of_memory(monkeypatch, Chunked, lambda s: s.chunk_size, 12)
    assert jk.plan(ex.model, ex.inputs, ex.layer).strategy == Chunked(48)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = jk.jacobian(ex.model, ex.inputs, ex.layer)
    # 48 -> 24 -> 12, each run of every row; the next call runs 12 at once
    assert sizes == [48, 24, 12] and result.chunk_size == 12
    jk.jacobian(ex.model, ex.inputs, ex.layer)
    assert sizes == [48, 24, 12, 12], "remembered what worked"
    assert len([w for w in caught if "ran out of memory" in str(w.message)]) == 1
    testing.assert_close(result, generator_reference())


def test_out_of_memory_at_one_row_is_raised(monkeypatch, chunked_only):
    ex = examples.build("mlp", batch=5)

    def always_oom(self, problem):
        raise tf.errors.ResourceExhaustedError(None, None, "injected OOM")

    monkeypatch.setattr(Chunked, "run", always_oom)
    with pytest.raises(tf.errors.ResourceExhaustedError), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        jk.jacobian(ex.model, ex.inputs, ex.layer)


def test_auto_agrees_with_reference():
    ex = examples.build("generator")
    result = jk.jacobian(ex.model, ex.inputs, ex.layer)
    assert result.plan is not None and result.strategy == "while"
    testing.assert_close(result, reference("generator", "features"))


def test_auto_is_one_more_solver():
    """``auto`` and a configured strategy answer the same questions
    (:class:`~jacobkit.problem.solution.Solver`): which strategy computes a
    problem (auto's plan's; the strategy itself) and what was decided (the
    plan; ``None``), and the engine runs either by one path."""
    ex = examples.build("mlp")
    problem = Call(ex.model, ex.layer).problem(ex.inputs)
    auto = planner.Auto(cache=False)
    assert auto.planned(problem) == auto.plan(problem).strategy
    chunked = jk.strategies.Chunked(chunk_size=4)
    assert chunked.planned(problem) is chunked and chunked.plan(problem) is None
    ran = engine.run(problem, auto)
    assert ran.plan is not None and ran.strategy_config == ran.plan.strategy
    ran = engine.run(problem, chunked)
    assert ran.plan is None and ran.strategy_config is chunked


def test_default_budget_is_a_fraction_of_free_memory(generator):
    ex = generator
    plan = jk.plan(ex.model, ex.inputs, ex.layer)
    free = memory.free_bytes("CPU:0")
    assert 0.5 * memory.DEFAULT_BUDGET_FRACTION * free < plan.budget_bytes
    assert plan.budget_bytes <= free
    assert planner.Policy().safety < 1


def test_per_example_rows_of_a_dense_layer_run_whole(eager_trials):
    """Per-example rows of a Dense layer start on batch (its closed form
    costs about what the summed rows cost), every row at once."""
    ex = examples.build("mlp")  # 4 examples x 10 features
    for call in range(4):
        result = jk.jacobian(ex.model, ex.inputs, ex.layer, outputs="per_example")
        testing.assert_close(result, reference("mlp", "per_example"))
        _covers_every_row_once(result.plan)
        if call == 0:
            assert [p.strategy.name for p in result.plan.last_call] == ["batch"]
    plan = result.plan
    assert plan.segment_rows == plan.num_rows == 40
    assert "batch" not in [r.label for r in plan.rejected]
    assert plan.estimate(jk.strategies.Batch()) is not None, plan


def test_a_slow_run_after_the_trace_does_not_make_tracing_free():
    """The tracing time is the traced run's excess over the fastest untraced
    run. While no untraced run has been faster than the traced one, it is
    unknown, not 0 (0 let auto try every candidate from the third call on,
    after one slow second call); a faster run then measures it."""
    strategy = jk.strategies.Chunked(144)

    def probe(call, seconds, traced):
        return Probe(strategy, call, 0, 144, seconds, traced)

    slow = [probe(1, 1.08, True), probe(2, 1.27, False)]
    assert estimates.estimate(strategy, slow).trace_s is None
    faster = [*slow, probe(3, 0.78, False)]
    assert estimates.estimate(strategy, faster).trace_s == pytest.approx(0.30)


def test_a_strategy_compiled_before_the_plan_has_its_trace_measured():
    """Where the current strategy's computation was compiled before the plan
    ran it (a fixed strategy's call in this process), no run traces: its
    trace is its computation's first call's excess over the fastest run
    (:attr:`~jacobkit.problem.plan.Probe.first_call_s`). Unmeasured, it
    left every other candidate's predicted trace unknown, never tried."""
    strategy = While(10)

    def probe(call, seconds, first=None):
        return Probe(strategy, call, 0, 144, seconds, False, first_call_s=first)

    runs = [probe(1, 0.30, first=2.0), probe(2, 0.20), probe(3, 0.25)]
    found = estimates.estimate(strategy, runs)
    assert found.trace_s == pytest.approx(1.80)
    chunked = estimates.predicted_trace_s(Chunked(144), None, found, 144)
    assert chunked == pytest.approx(1.80 * Chunked.trace_weight / While.trace_weight)
    assert estimates.estimate(strategy, runs[1:]).trace_s is None


def test_auto_after_a_fixed_strategy_still_tries_the_others(generator):
    """``auto`` after ``strategy=While(10)`` on the same problem: its first
    call reuses while's computation (nothing traces), and the candidates
    are tried as after a trace of its own (``rent=0``: as soon as the rate
    is known)."""
    ex = generator
    jk.jacobian(ex.model, ex.inputs, ex.layer, strategy=While(10))
    ran = []
    with planner.use_policy(rent=0.0):
        for _ in range(2):
            result = jk.jacobian(ex.model, ex.inputs, ex.layer)
            (run,) = result.plan.last_call
            ran.append(run)
    assert ran[0].strategy == While(10) and not ran[0].traced
    assert ran[0].first_call_s is not None
    assert result.plan.estimate(While(10)).trace_s is not None
    # the second call tries the next candidate (it traces)
    assert ran[1].strategy == Chunked(48) and ran[1].traced, result.plan.summary()


def test_use_policy_changes_new_sessions_and_restores_the_outer_policy(generator):
    outer = planner.current_policy()
    with planner.use_policy(eager_rows=100) as policy:
        assert planner.current_policy() == policy and policy.eager_rows == 100
        with planner.use_policy(rent=0.0):
            assert planner.current_policy().eager_rows == 100  # nested: both
            assert planner.current_policy().rent == 0.0
        ex = generator
        # 48 rows, at most 100 start on the eager loop
        assert jk.plan(ex.model, ex.inputs, ex.layer).strategy.name == "loop"
    # the outer policy: this module's (:func:`_cheapest_start`)
    assert planner.current_policy() == outer == planner.Policy(start_slack_bytes=0)
    # sessions are kept per policy: outside the block, a traced start again
    assert jk.plan(ex.model, ex.inputs, ex.layer).strategy.name == "while"


def _frozen_backbone_head():
    """A frozen conv backbone whose activations (16 x 32 x 32 x 16 floats,
    1 MiB each) dwarf its head's (16 x 3): what a keras.applications
    backbone with a new head looks like, small."""
    keras.utils.set_random_seed(0)
    inputs = keras.Input((32, 32, 3))
    h = inputs
    for i in range(4):
        h = keras.layers.Conv2D(
            16, 3, padding="same", activation="relu", name=f"conv{i}"
        )(h)
    h = keras.layers.GlobalAveragePooling2D()(h)
    backbone = keras.Model(inputs, h)
    backbone.trainable = False
    outer = keras.Input((32, 32, 3))
    model = keras.Model(outer, keras.layers.Dense(3, name="head")(backbone(outer)))
    x = np.random.default_rng(0).normal(size=(16, 32, 32, 3)).astype("float32")
    return model, x


def test_frozen_backbone_is_not_counted_in_the_head_prior():
    # the head's backward pass never differentiates the frozen convs: its
    # predicted peak is far below that of a target under all of them (traced
    # starts: an eager one holds every layer's output for either target)
    model, x = _frozen_backbone_head()
    with planner.use_policy(eager_rows=0):
        head = jk.plan(model, x, "head", cache=False).predicted_peak_bytes
        conv = jk.plan(model, x, "conv0", cache=False).predicted_peak_bytes
    assert head is not None and conv is not None
    # predicted 3.8 and 16.8 MiB; measured 3.0 and 10.9 MiB (TF 2.21, CPU)
    assert head * 3 < conv


def test_few_rows_start_eager_then_trace_as_calls_repeat():
    """Three rows (``Policy.eager_rows`` is 4): the first call runs the eager
    ``loop``, which traces nothing; once the time spent on the loop pays
    for a candidate's predicted tracing (rent 0 here: at once), auto tries
    the traced candidates and keeps the fastest. Every call agrees with
    float64 (assert_close's derived tolerance: measured max relative error
    ~1e-6 on this generator)."""
    ex = examples.build("generator", **SIZES)
    rows = [0, 5, 47]
    wide = examples.build("generator", "float64", **SIZES)
    expected = testing.reference_jacobian(
        wide.model,
        wide.inputs,
        target_variables(wide),
        call_kwargs=call_kwargs(wide.model),
    )
    expected = [np.asarray(e)[rows] for e in expected]
    with planner.use_policy(rent=0.0):
        first = jk.jacobian(ex.model, ex.inputs, ex.layer, features=rows)
        assert first.strategy == "loop"
        assert first.stats.traced is False
        testing.assert_close(first, expected)
        plan = first.plan
        assert plan.pending, "traced candidates are left to try"
        assert "loop" not in {r.label for r in plan.rejected}
        ran = {first.strategy}
        for _ in range(8):
            res = jk.jacobian(ex.model, ex.inputs, ex.layer, features=rows)
            testing.assert_close(res, expected)
            ran.add(res.plan.strategy.name)
            ran.update(s.new.name for s in res.plan.switches)
    assert ran - {"loop"}, f"auto never tried a traced candidate: {ran}"


def test_many_rows_do_not_start_eager(generator):
    """Above ``Policy.eager_rows`` the first call is traced as before (the
    loop stays out of auto's candidates: one backward pass per row)."""
    with planner.use_policy(eager_rows=2):
        res = jk.jacobian(
            generator.model, generator.inputs, "conv1", features=[0, 1, 2]
        )
    assert res.strategy != "loop"
    assert "loop" in {r.label for r in res.plan.rejected}


#: models whose first traced call runs ``while``
SEQUENTIAL_CASES = {
    "generator": lambda: examples.build("generator", **SIZES),
    "cnn2d": lambda: examples.build("cnn2d", batch=8, height=32, width=16),
}


@pytest.mark.parametrize("name", SEQUENTIAL_CASES)
def test_the_while_prior_is_never_below_its_measured_peak(name):
    """The prior of rows run one after another walks the traced pass's
    tensors (``jacobkit.problem.liveness``). Measured against it (TF 2.21,
    CPU): 1.1-2.2x on ten problems' second calls, never under; here the
    first traced call, tracing and checks included, must stay under it, and
    within 4x (this generator's: 1.4-2.2 MiB against 4.3 predicted) beside
    the kernels' scratch the prior counts.

    Why the scratch stands beside the 4x: the prior adds the measured
    scratch of TensorFlow's own convolution gradient kernels per pass in
    flight (:mod:`jacobkit.planner.scratch`; 32 MiB a pass with oneDNN off,
    about 0 with it on) where they run. With oneDNN off a ``while`` loop's
    stride-1 ``Conv2D`` gradients run jacobkit's rules instead
    (:mod:`jacobkit.strategies.gradients.convolution`: the forward
    convolution of the flipped kernel, the shared patches' product), which
    take no im2col buffer: the inspection records each gradient op
    (:class:`jacobkit.layers.convolutions.Gradient`) and the prior counts
    none for them, only the patches the loop holds. Before, it kept the
    bound: 2.8 MiB measured against 68.2 predicted on the generator, 0.38
    against 64.6 on the conv net (oneDNN on 2.7 against 4.3, 0.31 against
    0.72, 26 KiB of scratch). So the liveness part alone must be within 4x."""
    ex = SEQUENTIAL_CASES[name]()
    model, inputs, layer = ex.model, ex.inputs, ex.layer
    with planner.use_policy(eager_rows=0):
        plan = jk.plan(model, inputs, layer, cache=False)
        assert plan.strategy.name == "while", str(plan)
        with memory.PeakMemory("CPU:0") as peak:
            jk.jacobian(model, inputs, layer, cache=False)
    measured = peak.extra_bytes
    problem = Call(model, layer).problem(inputs)
    passes = plan.strategy.passes_in_flight(problem.num_rows)
    kinds = scratch.kinds_run(problem, "loop", gradients.replaces())
    per_pass = kernel_scratch(problem) if kinds else 0
    counted = min(passes, scratch.inter_op_threads()) * per_pass
    counted += scratch.patches_held(problem, gradients.replaces())
    assert measured <= plan.predicted_peak_bytes, str(plan)
    assert plan.predicted_peak_bytes <= 4 * measured + counted, (counted, str(plan))


def test_the_eager_start_answers_the_first_call_only():
    """Issue 37, item 11: few rows start on the eager loop (no trace: the
    fastest first answer), and the second call traces the candidate cheapest
    to trace, so that from the fourth call auto runs a traced strategy.
    Before, the loop ran until 5 x a candidate's predicted tracing had been
    spent on it (frozen ResNet50 head: still the loop at call 4, 0.34 s
    against 0.13 s for while)."""
    ex = examples.build("generator", **SIZES)
    rows = [0, 5, 47]
    calls = [
        jk.jacobian(ex.model, ex.inputs, ex.layer, features=rows) for _ in range(5)
    ]
    ran = [r.plan.last_call[-1].strategy for r in calls]
    assert ran[0].name == "loop" and not calls[0].stats.traced
    assert ran[1] == While(3) and calls[1].stats.traced, calls[1].plan
    assert all(s.compiled for s in ran[1:]), [s.label for s in ran]
    switch = calls[1].plan.switches[0]
    assert (switch.call, switch.old.name, switch.new) == (2, "loop", While(3))
    assert "answers the first 1 call(s) only" in switch.reason
