"""The benchmark suite (``benchmarks/suite``, run from a checkout) end to end:
the quick suite, once, in fresh subprocesses.

Times are never asserted (they depend on the machine); the rows, their
agreement with the reference and the output files are.
"""

from __future__ import annotations

import json

import pytest

import jacobkit as jk
from benchmarks.suite import command, plots, problems, runner

#: agreement every successful benchmark row must reach with its reference
#: (the strategies agree to ~2e-7 on the quick problems; see results.md)
TOLERANCE = 1e-4


@pytest.fixture(scope="module")
def quick_results(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench")
    settings = runner.Settings(suite="quick", repeats=2, progress=False)
    runner.run_suite(problems.quick_suite(), settings, out)
    return out, json.loads((out / "results.json").read_text())


def test_every_strategy_has_a_row_on_every_quick_problem(quick_results):
    _, results = quick_results
    seen = {(row["problem"], row["name"]) for row in results["rows"]}
    expected = {
        (problem.id, name)
        for problem in problems.quick_suite()
        for name in jk.strategies.REGISTRY
    }
    assert expected <= seen


def test_successful_rows_agree_with_the_reference(quick_results):
    _, results = quick_results
    ok = [row for row in results["rows"] if row["ok"]]
    assert ok, "no strategy succeeded on any quick problem"
    for row in ok:
        assert row["max_rel_diff"] is not None, row
        assert row["max_rel_diff"] <= TOLERANCE, (row["problem"], row["strategy"])


def test_rows_record_the_environment_and_the_measurements(quick_results):
    _, results = quick_results
    for row in results["rows"]:
        assert row["device"] == "CPU:0"
        assert row["tensorflow"] and row["keras"]
        if row["ok"]:
            assert row["first_call_s"] > 0 and row["steady_s"] > 0
            assert row["spread_s"] >= 0 and row["peak_bytes"] is not None


def test_the_report_and_the_plots_are_written(quick_results):
    out, results = quick_results
    for name in ("results.md", "time_vs_rows.png", "memory_vs_rows.png"):
        assert (out / name).stat().st_size > 0, name
    assert (out / "time_vs_chunk.png").stat().st_size > 0
    assert "## Headline" in (out / "results.md").read_text()
    assert results["plots"] == [
        "time_vs_rows.png",
        "memory_vs_rows.png",
        "time_vs_chunk.png",
    ]


def test_a_time_limit_is_a_result_not_a_crash(tmp_path):
    """A run past its time limit gives a failure row and the suite goes on."""
    tiny = problems.BenchProblem(
        id="mlp-tiny",
        builder="mlp",
        sizes={"batch": 2, "features": 3},
        layer="hidden1",
        sweeps=(problems.Sweep("mlp", "features"),),
        # structured refuses this model (no shortcut applies): whether that
        # error or the 0.05 s limit comes first depends on the machine's load
        # (a first call of this tiny MLP can finish in under 0.5 s)
        skip=("structured",),
    )
    settings = runner.Settings(
        suite="test", repeats=1, timeout_s=0.05, reference_timeout_s=120, progress=False
    )
    results = runner.run_suite([tiny], settings, tmp_path)
    # every other registered strategy, and auto with a cold and a warm plan cache
    assert len(results["rows"]) == len(runner.strategy_configs(tiny))
    names = {*jk.strategies.REGISTRY, "auto"} - {"structured"}
    assert {row["name"] for row in results["rows"]} == names
    assert {row["failure"] for row in results["rows"]} == {"time_limit"}, [
        (r["name"], r.get("error"))
        for r in results["rows"]
        if r["failure"] != "time_limit"
    ]


def test_auto_is_timed_against_the_fastest_fixed_strategy_in_one_process(tmp_path):
    """The cold auto row carries paired rounds against the fixed strategy
    with the least steady time, and the auto table shows their ratio."""
    tiny = problems.BenchProblem(
        id="mlp-tiny-auto",
        builder="mlp",
        sizes={"batch": 2, "features": 3},
        layer="hidden1",
        auto_targets=True,
        skip=("loop", "forward", "jacobian", "structured"),
    )
    settings = runner.Settings(
        suite="test",
        repeats=2,
        timeout_s=120,
        reference_timeout_s=120,
        progress=False,
        first_call_rounds=1,
        held_calls=1,
    )
    results = runner.run_suite([tiny], settings, tmp_path)
    rows = {row["strategy"]: row for row in results["rows"]}
    fixed = [r for r in rows.values() if r["name"] != "auto" and r["ok"]]
    fastest = min(fixed, key=lambda r: r["steady_s"])
    paired = rows["auto"]["paired"]
    assert paired["strategy"] == fastest["strategy"] and paired["rounds"] == 2
    assert paired["ratio"] == paired["auto_s"] / paired["fixed_s"] > 0
    assert "paired" not in rows["auto, warm cache"]
    table = (tmp_path / "results.md").read_text()
    assert f"({fastest['strategy']}, 2 rounds)" in table
    # first calls in alternating fresh processes: the fastest fixed first call
    # against auto's cold one, the chosen strategy's against auto's warm one
    first = min(fixed, key=lambda r: r["first_call_s"])
    cold, warm = rows["auto"]["first_paired"], rows["auto, warm cache"]["first_paired"]
    assert cold["strategy"] == first["strategy"] and cold["rounds"] == 1
    chosen = rows["auto"]["ran"].removeprefix("auto: ")
    assert warm["strategy"] in (chosen, chosen.split("(")[0])  # or its defaults
    assert all(p["ratio"] == p["ratios"][0] > 0 for p in (cold, warm))
    assert table.count("; paired fresh processes") == 2
    # growth with no result held between calls, and with one held across a
    # further call: TensorFlow's pool only grows, so the second is not
    # smaller (1 MiB of slack for what Python's own heap may give back)
    for row in (r for r in rows.values() if r["ok"]):
        assert row["held_growth_bytes"] + 2**20 >= row["growth_bytes"] >= 0, row
    assert "one result held across calls: " in table


def test_without_matplotlib_the_suite_says_how_to_install_it(
    monkeypatch, tmp_path, capsys
):
    """matplotlib is an extra: without it, the suite stops before running
    anything, naming what failed and the install command."""
    import sys

    monkeypatch.setitem(sys.modules, "matplotlib", None)
    with pytest.raises(plots.MatplotlibMissing, match=r"\.\[bench\]"):
        plots.require_matplotlib()
    code = command.main(["--quick", "--no-progress", "--out", str(tmp_path / "b")])
    err = capsys.readouterr().err
    assert code == 2 and "matplotlib" in err, err
    assert 'pip install -e ".[bench]"' in err
    assert not (tmp_path / "b").exists()
