"""The command line: ``jacobkit compare`` and ``jacobkit run``.

Building the parser imports no TensorFlow (``jacobkit --help`` answers at
once); each command imports it when it runs. A user's mistake (a bad option, a
missing file, an unknown layer) ends in one line on stderr and exit code 2.
TensorFlow's C++ start-up logs and its Python warnings are hidden unless
``-v`` is given.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import warnings
from collections.abc import Iterator, Sequence
from typing import Any

from jacobkit import __version__, runtime
from jacobkit.cli import compare, run
from jacobkit.cli._common import USAGE_ERROR, Parser, UsageError

# Before TensorFlow starts: TF's pooled CPU allocator is the one that reports
# peak memory on CPU.
runtime.enable_bfc_cpu_allocator()

__all__ = ["USAGE_ERROR", "UsageError", "main"]

#: subcommand name -> function adding it to the parser
SUBCOMMANDS = {"compare": compare.add, "run": run.add}


def _parser() -> argparse.ArgumentParser:
    verbose: dict[str, Any] = {
        "action": "store_true",
        "help": "show TensorFlow's start-up logs and warnings",
    }
    # -v before or after the subcommand (the subcommand's must not reset it)
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("-v", "--verbose", default=argparse.SUPPRESS, **verbose)
    parser = Parser(
        prog="jacobkit",
        description="Per-output Jacobians of TensorFlow/Keras models.",
    )
    parser.add_argument("-v", "--verbose", **verbose)
    parser.add_argument(
        "--version", action="version", version=f"jacobkit {__version__}"
    )
    subparsers = parser.add_subparsers(dest="command", required=True)
    for add in SUBCOMMANDS.values():
        add(subparsers, common)
    return parser


@contextlib.contextmanager
def _quiet_tensorflow(verbose: bool) -> Iterator[None]:
    """Unless ``verbose``: TensorFlow's C++ logs off (if the user has not set
    their level; only effective before TensorFlow loads) and its and Keras'
    Python warnings hidden."""
    if verbose:
        yield
        return
    runtime.hide_startup_logs()
    with runtime.tensorflow_warnings(all_threads=True), warnings.catch_warnings():
        for module in ("keras", "tf_keras", "tensorflow", "absl"):
            warnings.filterwarnings("ignore", module=rf"{module}(\.|$)")
        yield


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the exit code (2 for a user's mistake)."""
    args = _parser().parse_args(argv)
    with _quiet_tensorflow(args.verbose):
        try:
            return args.run(args)
        except UsageError as err:
            print(f"jacobkit {args.command}: error: {err}", file=sys.stderr)
            return USAGE_ERROR
