"""The child process of ``benchmarks/auto_budgets.py``: one model, several
labels (fixed strategies and ``auto@budget``), in one fresh process.

For each label: what ``auto`` predicts before its first call (``jk.plan``:
the strategy and the memory prior's peak; ``{"refused": message}`` where it
refuses the budget, and nothing more is run of that label), the peak memory
of the first
call, of every call until ``auto`` settles (at most :data:`jacobkit.SETTLE_CALLS`), then
``rounds`` interleaved timing rounds (each calls every label once, so that a
load change on a shared machine hits every label alike), then one steady
call's peak. Fixed labels are the labels of
:func:`jacobkit.bench.candidates.configurations` (the list ``jacobkit compare`` and
the suite measure); ``auto`` runs with an empty plan cache.

    python -m benchmarks.suite.budget_child '{"problem": ..., "sizes": ...,
        "labels": [...], "rounds": 7, "chunk_sizes": [...]}'

prints one line ``RESULT {json}``: ``{label: measurements}``.
"""

from __future__ import annotations

import functools
import json
import os
import statistics
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Caller:
    """One label's call, and (``auto`` only) its plan before any call."""

    call: Callable[[], Any]
    plan: Callable[[], Any] | None = None


def callers(spec: dict[str, Any]) -> dict[str, Caller]:
    """``label -> Caller`` for every label of ``spec``."""
    import jacobkit as jk
    from jacobkit.bench.candidates import configurations
    from jacobkit.testing import examples

    ex = examples.build(spec["problem"], **spec["sizes"])
    # rows for the chunk sizes: the output's features (a classifier's
    # sizes name them "classes")
    rows = spec["sizes"].get("features") or int(ex.model(ex.inputs).shape[-1])
    fixed = {s.label: s for s in configurations(rows, spec.get("chunk_sizes", ()))}
    found = {}
    for label in spec["labels"]:
        if label.startswith("auto"):
            budget = label.partition("@")[2] or None
            kwargs: dict[str, Any] = {"memory_budget": budget}
        elif label in fixed:
            kwargs = {"strategy": fixed[label]}
        else:
            raise ValueError(
                f"budget_child: {label!r} is neither auto@BUDGET nor one of "
                f"{sorted(fixed)}"
            )
        found[label] = Caller(
            call=functools.partial(
                jk.jacobian, ex.model, ex.inputs, ex.layer, **kwargs
            ),
            # what auto plans before its first call: the memory prior
            plan=(
                functools.partial(jk.plan, ex.model, ex.inputs, ex.layer, **kwargs)
                if label.startswith("auto")
                else None
            ),
        )
    return found


def measure(spec: dict[str, Any]) -> dict[str, Any]:
    """Every label's peaks, settling calls, interleaved times and choice."""
    from jacobkit import memory
    from jacobkit.bench.measure import SETTLE_CALLS

    calls = callers(spec)
    found: dict[str, Any] = {}
    for label, caller in list(calls.items()):
        try:
            prior = caller.plan() if caller.plan is not None else None
        except ValueError as err:  # a budget refused before anything ran
            found[label] = {"refused": str(err).splitlines()[0]}
            del calls[label]
            continue
        call = caller.call
        with memory.PeakMemory() as first:
            result = call()
        peaks: list[int] = [first.extra_bytes or 0]
        count = 1
        while (
            result.plan is not None and not result.plan.settled and count < SETTLE_CALLS
        ):
            with memory.PeakMemory() as settling:
                result = call()
            peaks.append(settling.extra_bytes or 0)
            count += 1
        plan = result.plan
        found[label] = {
            "first_peak": first.extra_bytes,
            "max_peak": max(peaks),
            "settle_calls": count,
            "times": [],
            "predicted_peak": plan.predicted_peak_bytes if plan else None,
            "prior_peak": prior.predicted_peak_bytes if prior else None,
            "prior_strategy": prior.strategy.label if prior else None,
            "predicted_s": plan.predicted_time_s if plan else None,
            "plan": plan.summary() if plan else None,
        }
    for _ in range(spec["rounds"]):
        for label, caller in calls.items():
            found[label]["times"].append(caller.call().stats.wall_time_s)
    for label, caller in calls.items():
        with memory.PeakMemory() as steady:
            result = caller.call()
        ran = result.strategy_config
        found[label].update(
            steady_peak=steady.extra_bytes,
            chosen=ran.label,
            ran=ran.label,
            steady_s=statistics.median(found[label]["times"] or [float("nan")]),
        )
    return found


def main(argv: list[str]) -> None:
    spec = json.loads(argv[0])
    # auto starts cold: an empty plan cache of this process's own
    os.environ["JACOBKIT_CACHE_DIR"] = tempfile.mkdtemp(prefix="jacobkit-plans-")
    print("RESULT " + json.dumps(measure(spec)))


if __name__ == "__main__":
    main(sys.argv[1:])
