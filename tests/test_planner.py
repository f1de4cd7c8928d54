"""Memory-aware ``auto``: budgets are respected, refused when impossible, and
out-of-memory errors back off to smaller chunks."""

from __future__ import annotations

import re
import warnings

import pytest
import tensorflow as tf

import jacobkit as jk
from jacobkit import examples, memory, planner, testing
from jacobkit.race import RUNS
from jacobkit.strategies import Chunked, While
from tests.cases import reference, target_variables

# A generator big enough that the budget matters. Measured on CPU: chunks of
# 1-16 rows peak near 33 MiB (fixed buffers dominate), all 48 rows at 55 MiB.
SIZES = {"batch": 16, "sequence": 64, "channels": 8, "filters": 32, "features": 48}


@pytest.fixture(scope="module")
def generator():
    return examples.build("generator", **SIZES)


@pytest.mark.parametrize("budget", ["40MiB", "64MiB", "128MiB", "1GiB"])
def test_measured_peak_stays_within_budget(generator, budget):
    ex = generator
    limit = memory.parse_budget(budget)
    with memory.PeakMemory("CPU:0") as first:  # planning probes included
        result = jk.jacobian(ex.model, ex.inputs, ex.layer, memory_budget=budget)
    assert first.extra_bytes <= limit, result.plan.summary()
    race = result.plan.race
    for _ in range(3 * (RUNS + 1)):  # every raced candidate stays within it too
        if race is None or race.winner is not None:
            break
        with memory.PeakMemory("CPU:0") as call:
            jk.jacobian(ex.model, ex.inputs, ex.layer, memory_budget=budget)
        assert call.extra_bytes <= limit, result.plan.summary()
    with memory.PeakMemory("CPU:0") as steady:
        again = jk.jacobian(ex.model, ex.inputs, ex.layer, memory_budget=budget)
    assert steady.extra_bytes <= limit, result.plan.summary()
    if race is not None:
        assert race.winner is not None and again.strategy == race.winner.name
    assert result.plan.predicted_peak_bytes <= limit


def test_tighter_budget_rejects_what_does_not_fit(generator):
    ex = generator
    small = jk.plan(ex.model, ex.inputs, ex.layer, memory_budget="40MiB")
    large = jk.plan(ex.model, ex.inputs, ex.layer, memory_budget="1GiB")
    assert small.predicted_peak_bytes <= 40 * 2**20 * planner.SAFETY
    # all 48 rows at once peak near 55 MiB: over 40 MiB, well under 1 GiB
    over = "% of the budget"
    assert any(over in why for _, why in small.rejected), small.summary()
    assert not any(over in why for _, why in large.rejected), large.summary()


def test_plan_explains_itself(generator):
    ex = generator
    plan = jk.plan(ex.model, ex.inputs, ex.layer, memory_budget="64MiB")
    assert isinstance(plan, jk.Plan)
    assert plan.budget_bytes == 64 * 2**20
    assert plan.result_bytes == 48 * (5 * 8 * 32 + 32) * 4
    assert plan.predicted_time_s > 0
    text = plan.summary()
    assert text.startswith(f"auto -> {plan.strategy.label}: predicted peak")
    assert "64.0 MiB budget" in text
    labels = {label for label, _ in plan.rejected}
    assert {"jacobian", "loop"} <= labels
    # every kind of candidate is accounted for: chosen, raced or rejected
    kinds = {label.split("(")[0] for label in labels}
    kinds |= {s.name for s in (plan.strategy, *plan.shortlist)}
    assert {"chunked", "while", "batch", "jacobian", "loop"} <= kinds


def test_budget_below_result_is_refused_before_allocating(generator):
    ex = generator
    needed = 48 * (5 * 8 * 32 + 32) * 4
    message = (
        f"the result alone needs {memory.format_bytes(needed)} ({needed} bytes: "
        "48 rows × 1312 parameters × 4 bytes), more than the budget allows. "
        "Raise memory_budget, keep fewer rows with features=[...], or use a "
        "smaller batch."
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


@pytest.fixture
def chunked_only(monkeypatch):
    """Keep plans on chunk sizes: batch or while may be faster on small problems."""
    monkeypatch.setattr(planner, "_consider_batch", lambda *args: ([], []))
    monkeypatch.setattr(planner, "_consider_while", lambda *args: [])


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


def test_out_of_memory_backs_off_and_remembers(monkeypatch, chunked_only):
    ex = examples.build("mlp")
    sizes_tried = inject_out_of_memory(monkeypatch, Chunked, lambda s: s.chunk_size, 2)
    # plan all rows in one chunk, whatever the (noisy) timing probes say
    monkeypatch.setattr(planner, "_candidate_sizes", lambda rows: [rows])
    plan = jk.plan(ex.model, ex.inputs, ex.layer, memory_budget="1GiB")
    assert plan.chunk_size == 10, "the injected error must hit the planned size"
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = jk.jacobian(ex.model, ex.inputs, ex.layer, memory_budget="1GiB")
    assert result.chunk_size == 2
    assert sizes_tried[0] == plan.chunk_size and sizes_tried[-1] == 2
    backoff = [w for w in caught if "ran out of memory" in str(w.message)]
    assert len(backoff) == 1, "warn once, however many halvings"
    testing.assert_close(result, reference("mlp", "features"))
    sizes_tried.clear()
    again = jk.jacobian(ex.model, ex.inputs, ex.layer, memory_budget="1GiB")
    assert again.chunk_size == 2 and sizes_tried == [2], "remembered the size"


def test_out_of_memory_in_while_halves_the_rows_in_flight(monkeypatch):
    ex = examples.build("mlp")
    # plan while only, with as many rows in flight as TensorFlow's default
    monkeypatch.setattr(planner, "_consider_batch", lambda *args: ([], []))
    monkeypatch.setattr(planner, "_candidate_sizes", lambda rows: [])
    tried = inject_out_of_memory(monkeypatch, While, lambda s: s.parallel_iterations, 2)
    plan = jk.plan(ex.model, ex.inputs, ex.layer, memory_budget="1GiB")
    assert plan.strategy == While(10)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = jk.jacobian(ex.model, ex.inputs, ex.layer, memory_budget="1GiB")
    assert tried == [10, 5, 2] and result.strategy == "while"
    assert len([w for w in caught if "ran out of memory" in str(w.message)]) == 1
    testing.assert_close(result, reference("mlp", "features"))
    tried.clear()
    jk.jacobian(ex.model, ex.inputs, ex.layer, memory_budget="1GiB")
    assert tried == [2], "remembered what worked"


def test_out_of_memory_at_one_row_is_raised(monkeypatch, chunked_only):
    ex = examples.build("mlp", batch=5)

    def always_oom(self, problem):
        raise tf.errors.ResourceExhaustedError(None, None, "injected OOM")

    monkeypatch.setattr(Chunked, "run", always_oom)
    with pytest.raises(tf.errors.ResourceExhaustedError), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        jk.jacobian(ex.model, ex.inputs, ex.layer, memory_budget="1GiB")


def test_auto_agrees_with_reference():
    ex = examples.build("generator")
    result = jk.jacobian(ex.model, ex.inputs, ex.layer)
    assert result.plan is not None and result.strategy in ("chunked", "batch", "while")
    testing.assert_close(result, reference("generator", "features"))
    assert target_variables(examples.build("generator"))  # builder is deterministic


def test_default_budget_is_a_fraction_of_free_memory(generator):
    ex = generator
    plan = jk.plan(ex.model, ex.inputs, ex.layer)
    free = memory.free_bytes("CPU:0")
    assert 0.5 * memory.DEFAULT_BUDGET_FRACTION * free < plan.budget_bytes
    assert plan.budget_bytes <= free
    assert planner.SAFETY < 1
