"""Run a suite: every (problem, strategy, chunk size) in a fresh subprocess.

Per problem, one child (:mod:`jacobkit.bench.processes`, running
:mod:`benchmarks.suite.child`) computes the reference Jacobians (saved to a
scratch ``.npz``); then one child per strategy configuration measures it with
:func:`jacobkit.bench.measure.measure` and
compares with that reference. A child that fails, runs out of memory or passes
the time limit gives a row saying so; the suite goes on. Once a strategy has
passed the time limit or run out of memory on a sweep, the larger points of
that sweep are recorded as skipped for the same reason instead of being run.

On the CPU the children are forked from a server process that has already
imported TensorFlow, which saves ~10 s of imports per child; on a GPU they
are spawned from scratch (see :mod:`jacobkit.bench.processes`).
"""

from __future__ import annotations

import contextlib
import json
import os
import statistics
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchmarks.suite import child, machine
from benchmarks.suite.problems import REFERENCES, BenchProblem
from jacobkit.bench import processes

#: failures that make the larger points of a sweep pointless to run
_SKIP_AFTER = ("time_limit", "out_of_memory")


class DeviceUnavailable(RuntimeError):
    """The device probe failed: no such device, or TensorFlow cannot start."""


@dataclass(frozen=True)
class Settings:
    """How to run a suite.

    Attributes:
        suite: the suite's name, for the records.
        device: ``"CPU:0"`` or ``"GPU:0"``; every child runs under it.
        repeats: timed calls after the warm-up (first) call.
        timeout_s: time limit of one strategy's child.
        reference_timeout_s: time limit of one reference child.
        memory_fraction: on the CPU, TensorFlow's allocator is capped at this
            fraction of the memory available when the suite starts, so that
            a strategy that needs too much fails with an out-of-memory error
            instead of meeting the operating system's out-of-memory killer.
        progress: show a progress bar.
        first_call_rounds: on problems with ``auto_targets``, rounds of
            first calls in alternating fresh processes: the fastest fixed
            strategy's against auto's (cold plan cache), and the strategy
            auto chose against auto with the warm plan cache. One first call
            per process moves by 15% and more between processes; the median
            of paired ratios moves less.
        held_calls: on problems with ``auto_targets``, calls made after the
            measured ones while the previous result is still held, for the
            process growth of a caller's loop (``held_growth_bytes``).
    """

    suite: str = "full"
    device: str = "CPU:0"
    repeats: int = 5
    timeout_s: float = 60.0
    reference_timeout_s: float = 180.0
    memory_fraction: float = 0.7
    progress: bool = True
    first_call_rounds: int = 0
    held_calls: int = 0


@dataclass(frozen=True)
class Config:
    """One row of a problem's table: a strategy configuration, or ``auto``.

    Attributes:
        label: the row's label (``"chunked(8)"``, ``"auto"``,
            ``"auto, warm cache"``).
        name: the registered name, or ``"auto"``.
        spec: :func:`jacobkit.strategies.to_spec` of the configuration
            (``None`` for auto).
        cache: for auto: ``"cold"`` (an empty plan cache) or ``"warm"`` (the
            cache the cold run left: a second run of the same script).
    """

    label: str
    name: str
    spec: dict[str, Any] | None = None
    cache: str | None = None

    @property
    def chunk_size(self) -> int | None:
        return (self.spec or {}).get("options", {}).get("chunk_size")


def strategy_configs(problem: BenchProblem) -> list[Config]:
    """What to run on ``problem``: :func:`jacobkit.bench.candidates.configurations`
    (every registered strategy at its defaults, ``chunked`` at the problem's
    chunk sizes and at every row) less the problem's ``skip``, then ``auto``
    with a cold and with a warm plan cache, each in a fresh process."""
    from jacobkit import strategies
    from jacobkit.bench.candidates import configurations

    configs = [
        Config(s.label, s.name, strategies.to_spec(s))
        for s in configurations(problem.num_rows, problem.chunk_sizes)
        if s.name not in problem.skip
    ]
    configs += [Config("auto", "auto", cache="cold")]
    configs += [Config("auto, warm cache", "auto", cache="warm")]
    return configs


def run_suite(
    problems: Sequence[BenchProblem], settings: Settings, out_dir: str | Path
) -> dict[str, Any]:
    """Run ``problems`` and write ``results.json``, ``results.md`` and the
    plots to ``out_dir``. Returns what ``results.json`` holds."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    started = time.time()
    configs = {p.id: strategy_configs(p) for p in problems}
    total = len(problems) + sum(len(c) for c in configs.values())
    results: dict[str, Any] = {
        "suite": settings.suite,
        "settings": {
            "device": settings.device,
            "repeats": settings.repeats,
            "timeout_s": settings.timeout_s,
            "reference_timeout_s": settings.reference_timeout_s,
        },
        "machine": machine.describe(),
        "references": REFERENCES,
        "problems": [p.to_dict() for p in problems],
        "rows": [],
    }
    with (
        processes.open_pool(
            settings.device,
            memory_fraction=settings.memory_fraction,
            target=child.main,
        ) as pool,
        _progress(total, settings.progress) as bar,
    ):
        bar.set_postfix_str("probe")
        probe = pool.run(
            {
                "kind": "probe",
                "device": settings.device,
                "cpu_model": results["machine"]["cpu_model"],
            },
            settings.reference_timeout_s,
        )
        if "error" in probe:
            raise DeviceUnavailable(f"the device probe failed: {probe['error']}")
        results["device"] = probe
        stopped: dict[tuple[str, str, str], tuple[int, str]] = {}
        for problem in problems:
            base = {**problem.to_dict(), **probe}
            bar.set_postfix_str(f"{problem.id} reference")
            reference_path = str(pool.scratch / f"{problem.id}.npz")
            task = {**base, "kind": "reference", "reference_path": reference_path}
            ref = pool.run(task, settings.reference_timeout_s)
            base["reference_seconds"] = ref.get("seconds")
            base["reference_error"] = ref.get("error")
            bar.update()
            plan_cache = str(pool.scratch / f"{problem.id}-plans")
            for config in configs[problem.id]:
                label = config.label
                bar.set_postfix_str(f"{problem.id} {label}")
                row = {
                    **base,
                    "strategy": label,
                    "name": config.name,
                    "chunk_size": config.chunk_size,
                    "default": config.chunk_size is None and config.cache != "warm",
                }
                skip = _skip_reason(stopped, problem, label)
                if skip:
                    row.update(skip)
                else:
                    task = {
                        **base,
                        "kind": "measure",
                        "strategy": config.name,
                        "spec": config.spec,
                        "plan_cache": plan_cache if config.cache else None,
                        "repeats": settings.repeats,
                        "held_calls": (
                            settings.held_calls if problem.auto_targets else 0
                        ),
                        "reference_path": None if ref.get("error") else reference_path,
                    }
                    if config.cache == "cold":
                        task["pair_with"] = _fastest_steady(
                            results["rows"], problem, configs[problem.id]
                        )
                    row.update(pool.run(task, settings.timeout_s))
                    row["repeats"] = settings.repeats
                _remember_stop(stopped, problem, label, row)
                row["ok"] = not row.get("error")
                results["rows"].append(row)
                bar.update()
            if problem.auto_targets and settings.first_call_rounds:
                bar.set_postfix_str(f"{problem.id} first calls, paired")
                _paired_first_calls(
                    pool,
                    base,
                    [r for r in results["rows"] if r["problem"] == problem.id],
                    configs[problem.id],
                    plan_cache,
                    settings,
                )
            with contextlib.suppress(OSError):
                os.remove(reference_path)
            results["duration_s"] = time.time() - started
            _write_json(results, out / "results.json")
    results["duration_s"] = time.time() - started
    return write_outputs(results, out)


def write_outputs(results: dict[str, Any], out_dir: str | Path) -> dict[str, Any]:
    """Write ``results.json``, ``results.md`` and the plots for ``results``
    (also used to redraw them from a saved ``results.json``)."""
    from benchmarks.suite import plots, report

    out = Path(out_dir)
    report.write(results, out / "results.md")
    results["plots"] = [p.name for p in plots.write_all(results, out)]
    _write_json(results, out / "results.json")
    return results


def _fastest_steady(
    rows: list[dict[str, Any]], problem: BenchProblem, configs: list[Config]
) -> Any:
    """The spec of the fixed configuration (among ``configs``) with the least
    steady time on ``problem`` so far (``None`` if none ran): auto is timed
    against it in paired rounds in one process, free of the
    process-to-process noise."""
    fixed = [
        r
        for r in rows
        if r["problem"] == problem.id and r.get("ok") and r["name"] != "auto"
    ]
    if not fixed:
        return None
    best = min(fixed, key=lambda r: r["steady_s"])
    return next((c.spec for c in configs if c.label == best["strategy"]), None)


def _paired_first_calls(
    pool: Any,
    base: dict[str, Any],
    rows: list[dict[str, Any]],
    configs: list[Config],
    plan_cache: str,
    settings: Settings,
) -> None:
    """Time first calls in alternating fresh processes: the fastest fixed
    first call against auto's with an empty plan cache (a new one each
    round), and the strategy auto chose against auto with the plan cache its
    cold run left. The median of the per-round ratios goes to the auto rows
    as ``first_paired``."""
    ok = [r for r in rows if r.get("ok")]
    fixed = [r for r in ok if r["name"] != "auto" and r.get("first_call_s")]
    by_label = {r["strategy"]: r for r in ok}
    auto, warm = by_label.get("auto"), by_label.get("auto, warm cache")
    if auto is None or not fixed:
        return
    from benchmarks.suite import auto_report

    spec_of = {c.label: c.spec for c in configs}
    fastest = min(fixed, key=lambda r: r["first_call_s"])
    ran = (auto.get("ran") or "").removeprefix("auto: ")
    chosen = auto_report.chosen_fixed(fixed, ran)
    pairs: list[tuple[dict[str, Any], dict[str, Any], str | None]] = [
        (auto, fastest, None)
    ]
    if warm is not None and chosen is not None:
        pairs.append((warm, chosen, plan_cache))
    for row, other, cache in pairs:
        ratios = []
        for i in range(settings.first_call_rounds):
            fresh = str(pool.scratch / f"{base['problem']}-first-{i}")
            times = []
            for name, spec, folder in (
                (other["name"], spec_of.get(other["strategy"]), None),
                ("auto", None, cache or fresh),
            ):
                task = {
                    **base,
                    "kind": "first_call",
                    "strategy": name,
                    "spec": spec,
                    "plan_cache": folder,
                }
                times.append(pool.run(task, settings.timeout_s).get("first_call_s"))
            if all(times):
                ratios.append(times[1] / times[0])
        if ratios:
            row["first_paired"] = {
                "strategy": other["strategy"],
                "ratios": ratios,
                "ratio": statistics.median(ratios),
                "rounds": len(ratios),
            }


def _skip_reason(stopped, problem: BenchProblem, label: str) -> dict[str, Any] | None:
    for sweep in problem.sweeps:
        hit = stopped.get((sweep.group, sweep.axis, label))
        if hit and problem.sizes[sweep.axis] > hit[0]:
            value, failure = hit
            return {
                "error": f"Skipped: {failure.replace('_', ' ')} already at "
                f"{sweep.axis}={value}",
                "failure": failure,
                "skipped": True,
            }
    return None


def _remember_stop(
    stopped, problem: BenchProblem, label: str, row: dict[str, Any]
) -> None:
    if row.get("failure") not in _SKIP_AFTER:
        return
    for sweep in problem.sweeps:
        key = (sweep.group, sweep.axis, label)
        value = problem.sizes[sweep.axis]
        if key not in stopped or value < stopped[key][0]:
            stopped[key] = (value, row["failure"])


def _write_json(results: dict[str, Any], path: Path) -> None:
    path.write_text(json.dumps(results, indent=1, default=str) + "\n")


@contextlib.contextmanager
def _progress(total: int, enabled: bool) -> Iterator[Any]:
    from tqdm import tqdm

    with tqdm(
        total=total, desc="bench", unit="run", file=sys.stderr, disable=not enabled
    ) as bar:
        yield bar
