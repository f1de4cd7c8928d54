"""``jacobkit bench``: its arguments and what it runs.

Kept free of TensorFlow imports until the command runs, so that building the
command-line parser stays fast.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of ``jacobkit bench``."""
    parser.add_argument(
        "--quick",
        action="store_true",
        help="small problems, every strategy: a few minutes on two CPU cores",
    )
    parser.add_argument(
        "--suite",
        choices=["quick", "full", "auto", "auto-quick"],
        help="the problems: quick (= --quick), full (default), auto (auto's "
        "targets: the wide generator and MLP; auto-quick: the same, small)",
    )
    parser.add_argument(
        "--device", default="CPU:0", help="CPU:0 or GPU:0 (default CPU:0)"
    )
    parser.add_argument(
        "--out", default="bench-results", help="output folder (default bench-results)"
    )
    parser.add_argument(
        "--repeats",
        type=int,
        help="timed calls after the warm-up (default 3 with --quick, else 5)",
    )
    parser.add_argument(
        "--timeout",
        type=float,
        default=60.0,
        help="time limit of one strategy's run, in seconds (default 60)",
    )
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    parser.add_argument(
        "--report-only",
        action="store_true",
        help="run nothing: redraw results.md and the plots from --out/results.json",
    )


def run(args: argparse.Namespace) -> int:
    """Run the suite; 1 if a successful row disagrees with its reference."""
    from jacobkit import memory
    from jacobkit.bench import plots, problems, runner
    from jacobkit.bench.disagreement import (
        disagreement_limit,
        disagreement_line,
        disagrees,
    )

    try:  # before the suite runs, not after it
        plots.require_matplotlib()
    except plots.MatplotlibMissing as err:
        print(f"jacobkit bench: error: {err}", file=sys.stderr)
        return 2
    if args.report_only:
        saved = Path(args.out) / "results.json"
        runner.write_outputs(json.loads(saved.read_text()), args.out)
        return 0
    suite = args.suite or ("quick" if args.quick else "full")
    settings = runner.Settings(
        suite=suite,
        device=memory.normalize_device(args.device),
        repeats=args.repeats or (3 if "quick" in suite else 5),
        timeout_s=args.timeout,
        progress=not args.no_progress,
        first_call_rounds=3 if suite.startswith("auto") else 0,
        held_calls=3 if suite.startswith("auto") else 0,
    )
    try:
        results = runner.run_suite(problems.SUITES[suite](), settings, args.out)
    except runner.DeviceUnavailable as err:
        print(err, file=sys.stderr)
        return 2
    rows = results["rows"]
    # the floor alone, without the loop's own error: see disagreement_limit
    limit = disagreement_limit()
    disagree = [
        f"{r['problem']} {r['strategy']}"
        for r in rows
        if r.get("ok") and disagrees(r.get("max_rel_diff"), limit)
    ]
    failed = sum(not r.get("ok") for r in rows)
    print(
        f"{len(rows)} runs in {results['duration_s'] / 60:.1f} min, {failed} failed; "
        f"results in {args.out}/results.md",
        file=sys.stderr,
    )
    if disagree:
        print(disagreement_line(disagree, limit), file=sys.stderr)
        return 1
    return 0
