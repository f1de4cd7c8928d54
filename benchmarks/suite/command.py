"""``python -m benchmarks.suite``: the suite's command line.

Run from the repository's root, so that ``benchmarks`` and this checkout's
``jacobkit`` are the ones imported. TensorFlow is imported only once the
options are checked; the suite itself runs in child processes.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
from collections.abc import Sequence
from pathlib import Path

#: how the command names itself in its messages
PROG = "python -m benchmarks.suite"
#: exit code for a user's mistake (argparse's own for a bad option)
USAGE_ERROR = 2


class UsageError(Exception):
    """A mistake in what the user asked for: one line, exit code 2."""


def parser() -> argparse.ArgumentParser:
    """The command's parser."""
    found = argparse.ArgumentParser(
        prog=PROG,
        description=(
            "Time, peak memory and agreement with a reference of every strategy "
            "on the benchmark problems, each in a fresh subprocess; writes "
            "results.json, results.md and PNG plots to --out."
        ),
    )
    found.add_argument(
        "-v", "--verbose", action="store_true", help="show TensorFlow's start-up logs"
    )
    add_arguments(found)
    return found


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of the suite."""
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


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; the exit code (2 for a user's mistake)."""
    from jacobkit import runtime

    # the children's TensorFlow uses its pooled CPU allocator, the one that
    # reports peak memory on CPU (see jacobkit.runtime)
    runtime.enable_bfc_cpu_allocator()
    args = parser().parse_args(argv)
    if args.verbose:
        quiet: contextlib.AbstractContextManager[None] = contextlib.nullcontext()
    else:  # TensorFlow's start-up lines and warnings hidden; its runs are children
        runtime.start_tensorflow_quietly(runtime=False)
        quiet = runtime.tensorflow_warnings(all_threads=True)
    with quiet:
        try:
            _check(args)
        except UsageError as err:
            print(f"{PROG}: error: {err}", file=sys.stderr)
            return USAGE_ERROR
        return run(args)


def _check(args: argparse.Namespace) -> None:
    """What the suite would otherwise fail on late."""
    from jacobkit import memory

    if args.report_only:
        saved = Path(args.out) / "results.json"
        if not saved.exists():
            raise UsageError(
                f"--report-only: {saved} does not exist; run {PROG} "
                f"--out {args.out} first."
            )
        return
    try:
        memory.normalize_device(args.device)
    except ValueError as err:
        raise UsageError(f"--device {args.device}: {err}") from err


def run(args: argparse.Namespace) -> int:
    """Run the suite; 1 if a successful row disagrees with its reference."""
    from benchmarks.suite import plots, problems, runner
    from jacobkit import memory
    from jacobkit.bench.disagreement import (
        disagreement_limit,
        disagreement_line,
        disagrees,
    )

    try:  # before the suite runs, not after it
        plots.require_matplotlib()
    except plots.MatplotlibMissing as err:
        print(f"{PROG}: error: {err}", file=sys.stderr)
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
        print(f"{PROG}: error: {err}", file=sys.stderr)
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
