"""``jacobkit bench``: its options (:mod:`jacobkit.bench.command`), checked
before the suite starts on what it would otherwise fail on late."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from jacobkit import runtime
from jacobkit.cli._common import UsageError


def add(subparsers: Any, common: argparse.ArgumentParser) -> None:
    """Add ``jacobkit bench`` to the subcommands."""
    from jacobkit.bench import command

    p = subparsers.add_parser(
        "bench",
        parents=[common],
        help="run the benchmark suite: every strategy, each in a fresh subprocess",
        description=(
            "Time, peak memory and agreement with a reference of every strategy "
            "on the benchmark problems; writes results.json, results.md and PNG "
            "plots to --out."
        ),
    )
    command.add_arguments(p)
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    """``jacobkit bench``, after checking what it would fail on late."""
    from jacobkit.bench import command

    if args.report_only:
        saved = Path(args.out) / "results.json"
        if not saved.exists():
            raise UsageError(
                f"--report-only: {saved} does not exist; run jacobkit bench "
                f"--out {args.out} first."
            )
    else:
        if not args.verbose:  # its runs are child processes
            runtime.start_tensorflow_quietly(runtime=False)
        from jacobkit import memory

        try:
            memory.normalize_device(args.device)
        except ValueError as err:
            raise UsageError(f"--device {args.device}: {err}") from err
    return command.run(args)
