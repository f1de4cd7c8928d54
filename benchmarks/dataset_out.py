"""Per-example Jacobians of a whole dataset written to disk (``out=``).

One row of measurements: rows/s, the process's resident-memory growth
against the result's size, and the time a resume saves after an interruption
halfway through. Writes ``dataset_out.json`` and ``dataset_out.md`` to --out.

    python benchmarks/dataset_out.py --out benchmarks/results/cpu

The interruption is a ``KeyboardInterrupt`` raised between two batches (what
Ctrl-C does); the tests cover ``kill -9`` (``tests/test_store.py``).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import tempfile
import threading
import time
from pathlib import Path

import tensorflow as tf

import jacobkit as jk
from jacobkit import memory, testing
from jacobkit.testing import examples

SIZES = {"sequence": 32, "channels": 4, "filters": 8, "features": 16}


def _rss() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS")


class _Peak:
    """Peak RSS sampled every 5 ms while active."""

    def __enter__(self):
        self.base, self.peak, self._stop = _rss(), 0, False
        self._thread = threading.Thread(target=self._sample)
        self._thread.start()
        return self

    def _sample(self):
        while not self._stop:
            self.peak = max(self.peak, _rss())
            time.sleep(0.005)

    def __exit__(self, *exc):
        self._stop = True
        self._thread.join()


def _machine_note() -> str:
    """The machine and its load while this ran (absolute times follow it)."""
    note = f"measured on a {os.cpu_count()}-core machine"
    if hasattr(os, "getloadavg"):
        note += ", load average {:.1f} / {:.1f} / {:.1f} (1 / 5 / 15 min)".format(
            *os.getloadavg()
        )
    return note


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default="benchmarks/results/cpu")
    parser.add_argument("--examples", type=int, default=4096)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--memory-budget", default="64MiB")
    args = parser.parse_args()
    ex = examples.build("generator", batch=args.examples, **SIZES)
    x = ex.inputs
    work = Path(tempfile.mkdtemp(prefix="jacobkit-dataset-"))

    def call(inputs, out):
        return jk.jacobian(
            ex.model,
            inputs,
            ex.layer,
            outputs="per_example",
            out=out,
            progress=False,
        )

    call(
        jk.data.batches(x[: 2 * args.batch_size], args.batch_size), None
    )  # plan, trace
    with _Peak() as peak:
        start = time.perf_counter()
        whole = call(jk.data.batches(x, args.batch_size), work / "whole")
        full_s = time.perf_counter() - start
    num_batches = len(jk.data.batches(x, args.batch_size))
    half = num_batches // 2

    class Interrupted(jk.data.batches):
        """The same batches (same length), with Ctrl-C halfway through."""

        def __iter__(self):
            for k, batch in enumerate(super().__iter__()):
                if k == half:
                    raise KeyboardInterrupt
                yield batch

    with contextlib.suppress(KeyboardInterrupt):
        call(Interrupted(x, args.batch_size), work / "resumed")
    start = time.perf_counter()
    resumed = call(jk.data.batches(x, args.batch_size), work / "resumed")
    resume_s = time.perf_counter() - start
    # auto may run another strategy on some batches of either run: equal
    # within the float32 tolerance, not necessarily bit for bit
    difference = max(
        testing.max_relative_difference(resumed[n], whole[n]) for n in whole
    )
    result_bytes = sum(int(v.nbytes) for v in whole.jacobians.values())
    rows = whole.stats.num_rows
    record = {
        "problem": f"generator ({', '.join(f'{k}={v}' for k, v in SIZES.items())}),"
        f" target conv1, per_example",
        "examples": args.examples,
        "batch_size": args.batch_size,
        "batches": num_batches,
        "rows": rows,
        "strategy": whole.strategy_config.label
        if whole.strategy_config
        else whole.strategy,
        "seconds": round(full_s, 2),
        "rows_per_s": round(rows / full_s),
        "result_bytes": result_bytes,
        "rss_growth_bytes": peak.peak - peak.base,
        "rss_peak_bytes": peak.peak,
        "resume_after_half_s": round(resume_s, 2),
        "resume_saves_s": round(full_s - resume_s, 2),
        "memory_budget": args.memory_budget,
        "resumed_vs_whole_max_rel_diff": difference,
        "tensorflow": tf.__version__,
        "cpu_count": os.cpu_count(),
        "note": _machine_note(),
    }
    shutil.rmtree(work)
    os.makedirs(args.out, exist_ok=True)
    Path(args.out, "dataset_out.json").write_text(json.dumps(record, indent=1) + "\n")
    f = memory.format_bytes
    table = (
        "| examples | rows | strategy | time | rows/s | result on disk | RSS growth "
        "| budget | resume after half | resume saves | resumed vs whole |\n"
        "|---|---|---|---|---|---|---|---|---|---|---|\n"
        f"| {args.examples} | {rows} | {record['strategy']} | {full_s:.1f} s "
        f"| {record['rows_per_s']} | {f(result_bytes)} "
        f"| {f(record['rss_growth_bytes'])} "
        f"| {args.memory_budget} | {resume_s:.1f} s | {full_s - resume_s:.1f} s "
        f"| {difference:.1e} |\n"
    )
    Path(args.out, "dataset_out.md").write_text(
        f"# Per-example Jacobians of a dataset into out=\n\n{record['problem']}; "
        f"batches of {args.batch_size}; TF {tf.__version__}; "
        f"{record['note']}. The resume runs in the same process as the whole "
        "run, so auto's plan is already settled there (a new process starts "
        "from the plan cache on disk); RSS growth is sampled every 5 ms during "
        f"the whole run.\n\n{table}"
    )
    print(table)


if __name__ == "__main__":
    main()
