"""The plan cache on disk: a second run plans nothing; a corrupt entry, a
directory that cannot be written and two processes writing at once are
survived."""

from __future__ import annotations

import glob
import json
import os
import subprocess
import sys
import warnings

import numpy as np
import pytest

import jacobkit as jk
from jacobkit import planner, testing
from jacobkit.planner import cache
from jacobkit.testing import examples
from tests.cases import kernel_scratch, reference

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    folder = tmp_path / "plans"
    monkeypatch.setenv("JACOBKIT_CACHE_DIR", str(folder))
    return folder


@pytest.fixture
def eager_trials():
    """Try every candidate as soon as the current strategy's rate is known."""
    with planner.use_policy(rent=0.0):
        yield


def _settle(ex) -> jk.JacobianResult:
    # one segment per call: 3 calls per candidate tried, 5 where it lost
    # within the noise and was timed until settled (Policy.settle_runs)
    for _ in range(20):
        result = jk.jacobian(ex.model, ex.inputs, ex.layer)
        if result.plan.settled:
            break
    assert result.plan.settled, result.plan.summary()
    return result


def _entries(folder) -> list[str]:
    return sorted(glob.glob(os.path.join(folder, "*.json")))


def test_second_run_plans_nothing(cache_dir, eager_trials):
    first = _settle(examples.build("mlp"))
    assert len(_entries(cache_dir)) == 1
    # a new model of the same architecture (other weights would not matter):
    # what a second run of the same script builds
    again = examples.build("mlp")
    plan = jk.plan(again.model, again.inputs, again.layer)
    assert plan.source == "disk cache" and plan.settled
    assert plan.strategy == first.plan.strategy
    result = jk.jacobian(again.model, again.inputs, again.layer)
    testing.assert_close(result, reference("mlp", "features"))
    assert result.plan.switches == ()  # nothing tried, nothing switched
    assert {p.strategy for p in result.plan.last_call} == {first.plan.strategy}
    # what the first run measured is known without measuring it again
    assert {e.strategy for e in result.plan.estimates} == {
        e.strategy for e in first.plan.estimates
    }


def test_cache_off(cache_dir, monkeypatch):
    ex = examples.build("mlp")
    jk.jacobian(ex.model, ex.inputs, ex.layer, cache=False)
    assert not cache_dir.exists()
    monkeypatch.setenv("JACOBKIT_CACHE_DIR", "")
    jk.jacobian(ex.model, ex.inputs, ex.layer)
    assert not cache_dir.exists()


@pytest.mark.parametrize(
    "content", ["{not json", json.dumps({"format": 1, "current": "nonsense"}), "[]"]
)
def test_corrupt_entry_warns_once_and_is_rewritten(cache_dir, content):
    ex = examples.build("mlp")
    jk.jacobian(ex.model, ex.inputs, ex.layer)
    (path,) = _entries(cache_dir)
    with open(path, "w") as f:
        f.write(content)
    again = examples.build("mlp")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = jk.jacobian(again.model, again.inputs, again.layer)
        jk.jacobian(again.model, again.inputs, again.layer)
    found = [w for w in caught if issubclass(w.category, cache.CacheWarning)]
    assert len(found) == 1, [str(w.message) for w in caught]
    assert path in str(found[0].message) or "unusable" in str(found[0].message)
    assert result.plan.source == "measured"
    testing.assert_close(result, reference("mlp", "features"))
    with open(path) as f:
        assert json.load(f)["format"] == cache.FORMAT  # rewritten, whole


def test_unwritable_directory_warns_once(tmp_path, monkeypatch):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    readonly = tmp_path / "readonly"
    readonly.mkdir()
    readonly.chmod(0o555)
    # root writes into read-only directories: use one under a file instead
    writable = os.access(readonly, os.W_OK)
    folder = blocker / "plans" if writable else readonly
    monkeypatch.setenv("JACOBKIT_CACHE_DIR", str(folder))
    ex = examples.build("mlp")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(2):
            result = jk.jacobian(ex.model, ex.inputs, ex.layer)
        other = examples.build("mlp", batch=5)
        jk.jacobian(other.model, other.inputs, other.layer)
    found = [w for w in caught if issubclass(w.category, cache.CacheWarning)]
    assert len(found) == 1 and "cannot write the plan cache" in str(found[0].message)
    testing.assert_close(result, reference("mlp", "features"))
    readonly.chmod(0o755)


def test_two_processes_writing_at_once(cache_dir):
    env = {**os.environ, "JACOBKIT_CACHE_DIR": str(cache_dir), "PYTHONPATH": ROOT}
    children = [
        subprocess.Popen(
            [sys.executable, "-m", "tests.cache_writer", "200"],
            cwd=ROOT,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for _ in range(2)
    ]
    outputs = [child.communicate(timeout=240) for child in children]
    for child, (_, err) in zip(children, outputs):
        assert child.returncode == 0, err[-2000:]
    names = {out.strip() for out, _ in outputs}
    assert len(names) == 1  # both computed the same fingerprint
    (path,) = _entries(cache_dir)
    assert not [p for p in os.listdir(cache_dir) if p.endswith(".tmp")]
    with open(path) as f:
        assert json.load(f)["format"] == cache.FORMAT
    # and this process, with the same architecture, starts from it
    ex = examples.build("mlp")
    with warnings.catch_warnings():
        warnings.simplefilter("error", cache.CacheWarning)
        plan = jk.plan(ex.model, ex.inputs, ex.layer)
    assert plan.source == "disk cache" and plan.estimates


def test_cached_plan_over_the_budget_is_planned_again(cache_dir):
    ex = examples.build("mlp")
    first = jk.jacobian(ex.model, ex.inputs, ex.layer)
    (path,) = _entries(cache_dir)
    with open(path) as f:
        entry = json.load(f)
    # as if the cached strategy had measured a peak far over today's budget
    for estimate in entry["estimates"]:
        estimate["peak_bytes"] = 2**50
    with open(path, "w") as f:
        json.dump(entry, f)
    again = examples.build("mlp")
    plan = jk.plan(again.model, again.inputs, again.layer, memory_budget="1GiB")
    assert plan.source == "not run yet" and plan.estimates == ()
    assert plan.strategy == first.plan.strategy  # planned afresh, and it fits
    result = jk.jacobian(again.model, again.inputs, again.layer, memory_budget="1GiB")
    testing.assert_close(result, reference("mlp", "features"))
    with open(path) as f:  # rewritten with what this run measured
        assert all(e["peak_bytes"] < 2**30 for e in json.load(f)["estimates"])


@pytest.mark.parametrize(
    "strategy",
    [s for cls in jk.strategies.REGISTRY.values() if (s := cls.for_auto(16))]
    + [jk.strategies.Structured(jk.strategies.While(5))],
    ids=lambda s: s.label,
)
def test_cache_entries_round_trip_configured_strategies(strategy):
    """A cached configuration (nested ones included: the shortcut's inner
    strategy under a tight budget) reads back as the same configuration."""
    text = json.dumps(jk.strategies.to_spec(strategy))
    assert jk.strategies.from_spec(json.loads(text)) == strategy


def test_cache_entry_round_trips_through_json():
    chunked, batch = jk.strategies.Chunked(8), jk.strategies.Batch()
    entry = planner.CacheEntry(
        current=chunked,
        pending=(batch,),
        segment_rows=16,
        row_bytes=1024,
        spent_s=0.5,
        estimates=(planner.Estimate(chunked, 1e-3, 0.2, 4096),),
        rejected=(
            planner.Rejection("loop", "eager Python loop: slowest"),
            planner.Rejection(batch, "predicted peak over the budget", memory=True),
        ),
        allowed_bytes=2**30,
        cpu="Some CPU (avx2 fma; oneDNN off)",
    )
    data = json.loads(json.dumps(entry.to_json()))
    assert set(data) == {
        "current",
        "pending",
        "segment_rows",
        "row_bytes",
        "spent_s",
        "estimates",
        "rejected",
        "allowed_bytes",
        "cpu",
    }
    assert planner.CacheEntry.from_json(data) == entry
    # an entry written before the CPU's kind was kept reads as not saying it
    older = {k: v for k, v in data.items() if k != "cpu"}
    assert planner.CacheEntry.from_json(older).cpu is None
    with pytest.raises(KeyError):
        planner.CacheEntry.from_json({k: v for k, v in data.items() if k != "current"})


def test_the_cache_name_never_serializes_the_model(cache_dir):
    # the entry's name once hashed the model's get_config(): 0.1-0.3 s of a
    # 0.6 s first call on a frozen MobileNetV2. It reads the layers' classes,
    # names and activations and the variables instead, and the entry is
    # still written.
    import keras

    calls = []

    class Counting(keras.Model):
        def get_config(self):
            calls.append(1)
            return super().get_config()

    inp = keras.Input((6,))
    h = keras.layers.Dense(8, activation="tanh", name="hidden")(inp)
    model = Counting(inp, keras.layers.Dense(3, name="head")(h))
    x = np.random.default_rng(0).normal(size=(4, 6)).astype("float32")
    for _ in range(3):
        jk.jacobian(model, x, "hidden")
    assert calls == []
    assert list(cache_dir.glob("*.json")), "the plan was written"


def _tiny_mlp():
    import keras

    inp = keras.Input((6,))
    h = keras.layers.Dense(8, activation="tanh", name="hidden")(inp)
    return keras.Model(inp, keras.layers.Dense(3, name="head")(h))


def test_an_entry_made_on_another_kind_of_cpu_misses(cache_dir, monkeypatch):
    """A plan measured under oneDNN's kernels is not one for TensorFlow's own
    (nor for another CPU model or instruction set): the kind is part of the
    entry's name and of the entry, so the other kind misses, writes its own
    entry, and the first kind hits its own again. (Each plan is of a new
    model of the same architecture: a new session, which reads the disk.)"""
    from jacobkit import runtime

    x = np.random.default_rng(0).normal(size=(4, 6)).astype("float32")
    jk.jacobian(_tiny_mlp(), x, "hidden")
    assert len(_entries(cache_dir)) == 1
    here = runtime.cpu_kind()
    assert jk.plan(_tiny_mlp(), x, "hidden").source == "disk cache"
    others = (
        runtime.CpuKind(here.model, here.flags, not here.onednn),
        runtime.CpuKind("Another CPU", here.flags, here.onednn),
        runtime.CpuKind(here.model, here.flags[:-1] or ("avx2",), here.onednn),
    )
    for other in others:
        with monkeypatch.context() as patch:
            # what the kind reports, not the user's environment
            patch.setattr(runtime, "cpu_kind", lambda other=other: other)
            assert jk.plan(_tiny_mlp(), x, "hidden").source == "not run yet", other
    assert jk.plan(_tiny_mlp(), x, "hidden").source == "disk cache"
    # the other kind's own run writes an entry of its own beside this one
    with monkeypatch.context() as patch:
        patch.setattr(runtime, "cpu_kind", lambda: others[0])
        jk.jacobian(_tiny_mlp(), x, "hidden")
    written = []
    for path in _entries(cache_dir):
        with open(path) as f:
            written.append(json.load(f))
    assert sorted(e["cpu"] for e in written) == sorted(
        [here.describe(), others[0].describe()]
    )
    assert {e["format"] for e in written} == {cache.FORMAT}


def test_an_entry_read_on_another_kind_of_cpu_is_not_continued(cache_dir, monkeypatch):
    """An entry moved into another machine's cache under the same name (its
    own ``cpu`` says another kind) is read as missing."""
    from jacobkit import runtime

    model = _tiny_mlp()
    x = np.random.default_rng(0).normal(size=(4, 6)).astype("float32")
    jk.jacobian(model, x, "hidden")
    (path,) = _entries(cache_dir)
    with open(path) as f:
        data = json.load(f)
    data["cpu"] = "Another CPU (avx2 fma; oneDNN off)"
    with open(path, "w") as f:
        json.dump(data, f)
    # a new model of the same architecture: a new session reads the entry
    again = _tiny_mlp()
    assert jk.plan(again, x, "hidden").source == "not run yet"
    jk.jacobian(again, x, "hidden")  # planned afresh and rewritten
    with open(path) as f:
        assert json.load(f)["cpu"] == runtime.cpu_kind().describe()


def test_a_different_activation_is_another_entry(cache_dir):
    """Two models alike but for one activation do not share a plan."""
    import keras

    def build(activation):
        inp = keras.Input((6,))
        h = keras.layers.Dense(8, activation=activation, name="hidden")(inp)
        return keras.Model(inp, keras.layers.Dense(3, name="head")(h))

    x = np.random.default_rng(0).normal(size=(4, 6)).astype("float32")
    jk.jacobian(build("tanh"), x, "hidden")
    jk.jacobian(build("relu"), x, "hidden")
    assert len(list(cache_dir.glob("*.json"))) == 2


def test_repeated_call_fingerprints_the_model_once(cache_dir, monkeypatch):
    # the entry's name reads the model's config and variables (tens of ms on a
    # backbone): a repeated call reuses its session's name, so auto's steady
    # call costs what the strategy it runs costs
    calls = []
    fingerprint = cache.fingerprint

    def counted(problem, device):
        calls.append(device)
        return fingerprint(problem, device)

    monkeypatch.setattr(cache, "fingerprint", counted)
    ex = examples.build("mlp")
    first = jk.jacobian(ex.model, ex.inputs, ex.layer)
    for _ in range(3):
        again = jk.jacobian(ex.model, ex.inputs, ex.layer)
    assert len(calls) == 1
    assert len(_entries(cache_dir)) == 1
    # the answer is still the float64 reference's (tolerance as in the tests
    # above: testing.assert_close's, derived from the loop's own error)
    testing.assert_close(first, reference("mlp", "features"))
    testing.assert_close(again, reference("mlp", "features"))


def _per_example_cnn():
    """Per-example rows of a Conv2D layer (16 images of 64 x 32, 48 rows):
    ``batch``'s closed form is the start where it fits (predicted 51 MiB),
    ``while`` under 32 MiB (beyond the kernels' scratch, :func:`_tight`)."""
    return examples.build("cnn2d", batch=16, height=64, width=32)


def _tight(ex) -> int:
    """32 MiB beyond what this CPU's convolution gradient kernels take
    (:func:`~tests.cases.kernel_scratch`: a fixed 32 MiB fit no candidate
    without oneDNN)."""
    from jacobkit.problem import Problem

    return 32 * 2**20 + kernel_scratch(
        Problem(ex.model, ex.inputs, ex.layer, outputs="per_example")
    )


@pytest.mark.parametrize("written", ["now", "before budgets were kept"])
def test_a_plan_cached_under_a_tight_budget_is_planned_again_under_a_larger(
    cache_dir, eager_trials, written
):
    """Issue 37, item 6: a plan written under a budget that left ``batch``
    out (predicted over it) is not reused under one it fits: the next run
    starts where a fresh plan starts, knowing what the first measured, and
    later candidates measured slower there are not tried again. Entries
    written before the budget and the reasons' kind were kept read the
    same (by their reasons). Before, the larger budget reran the cached
    ``while`` (a frozen DenseNet121's per-example layer: 9.4 s a call, where
    ``batch`` takes 0.78 s)."""
    ex = _per_example_cnn()
    budget = _tight(ex)
    for _ in range(8):
        tight = jk.jacobian(
            ex.model, ex.inputs, ex.layer, outputs="per_example", memory_budget=budget
        )
    assert tight.plan.strategy.name != "batch", str(tight.plan)
    (path,) = _entries(cache_dir)
    if written != "now":
        with open(path) as f:
            entry = json.load(f)
        entry.pop("allowed_bytes", None)
        for rejection in entry["rejected"]:
            rejection.pop("memory", None)
        with open(path, "w") as f:
            json.dump(entry, f)
    again = _per_example_cnn()
    kwargs = {"outputs": "per_example", "memory_budget": "1GiB"}
    plan = jk.plan(again.model, again.inputs, again.layer, **kwargs)
    assert plan.strategy == jk.strategies.Batch(), str(plan)
    assert {e.strategy for e in tight.plan.estimates} <= {
        e.strategy for e in plan.estimates
    }, "what the tight plan measured is known"
    result = jk.jacobian(again.model, again.inputs, again.layer, **kwargs)
    assert [p.strategy for p in result.plan.last_call] == [jk.strategies.Batch()]
    # and a third run, under the same larger budget, continues from this one
    third = _per_example_cnn()
    assert jk.plan(third.model, third.inputs, third.layer, **kwargs).strategy == (
        jk.strategies.Batch()
    )
    # the tight budget again: batch's measured peak (6 MiB; predicted 51)
    # fits it, and the plan continues from the entry
    tight_again = jk.plan(
        third.model,
        third.inputs,
        third.layer,
        outputs="per_example",
        memory_budget=budget,
    )
    assert tight_again.source == "disk cache", str(tight_again)
    assert tight_again.predicted_peak_bytes <= budget * planner.Policy().safety


def test_a_candidate_measured_slower_by_an_earlier_run_is_not_tried_again():
    from jacobkit.planner import selection

    policy = planner.Policy()
    batch, loop = jk.strategies.Batch(), jk.strategies.While(10)
    current = planner.Estimate(batch, seconds_per_row=1e-3)
    slow = planner.Estimate(loop, seconds_per_row=10e-3, trace_s=0.1)
    due = selection.next_try(
        policy,
        (loop,),
        current,
        100.0,  # spent: any candidate would be due
        lambda s: slow if s == loop else None,
        lambda s: 0,
        lambda s, room: True,
        (2**30, 48),
    )
    assert due.candidate is None
    (dropped,) = due.dropped
    assert dropped.strategy == loop and "measured slower" in dropped.reason


def _frozen_head():
    """A frozen Conv2D backbone under a Dense(3) head (no activation: the
    separable shortcut applies), 3 rows: auto starts on the eager loop."""
    import keras

    keras.utils.set_random_seed(0)
    inputs = keras.Input((32, 32, 3))
    h = inputs
    for i in range(3):
        h = keras.layers.Conv2D(8, 3, padding="same", activation="relu", name=f"c{i}")(
            h
        )
    h = keras.layers.GlobalAveragePooling2D()(h)
    backbone = keras.Model(inputs, h)
    backbone.trainable = False
    outer = keras.Input((32, 32, 3))
    model = keras.Model(outer, keras.layers.Dense(3, name="head")(backbone(outer)))
    x = np.random.default_rng(0).normal(size=(8, 32, 32, 3)).astype("float32")
    return model, x


def test_a_warm_cache_starts_where_the_cold_run_ended_beside_a_shortcut(cache_dir):
    """Issue 37, item 11: where an exact shortcut applies and few rows start
    on the eager loop, the entry was never read (the shortcut was taken for
    the one candidate): every process started on the loop again and traced
    its candidate on a later call (frozen MobileNetV2 and BERT heads: calls
    8-12). A warm process starts on what the cold one ran last."""
    model, x = _frozen_head()
    with planner.use_policy(rent=0.0):  # the cold run tries at once
        for _ in range(6):
            cold = jk.jacobian(model, x, "head")
    assert cold.plan.strategy.compiled, str(cold.plan)
    again, _ = _frozen_head()
    plan = jk.plan(again, x, "head")
    assert plan.source == "disk cache" and plan.strategy == cold.plan.strategy, plan
    warm = jk.jacobian(again, x, "head")
    assert [p.strategy for p in warm.plan.last_call] == [cold.plan.strategy]
    testing.assert_close(warm, list(cold.jacobians.values()))
