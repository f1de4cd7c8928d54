"""The command line: ``jacobkit compare`` (and the subcommands registered below).

Building the parser imports no TensorFlow (``jacobkit --help`` answers at
once); each command imports it when it runs. A user's mistake (a bad option, a
missing file, an unknown layer) ends in one line on stderr and exit code 2.
TensorFlow's C++ start-up logs and its Python warnings are hidden unless
``-v`` is given.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import warnings
from collections.abc import Iterator, Sequence

from jacobkit import quiet

#: Must be set before TensorFlow starts: TF's pooled CPU allocator is the one
#: that reports peak memory on CPU.
os.environ.setdefault("TF_CPU_ALLOCATOR_USE_BFC", "true")

#: exit code for a user's mistake (argparse's own for a bad option)
USAGE_ERROR = 2


class UsageError(Exception):
    """A mistake in what the user asked for: reported in one line, exit code 2."""


class _Parser(argparse.ArgumentParser):
    """argparse, with its errors in one line (no usage block)."""

    def error(self, message: str):
        self.exit(
            USAGE_ERROR,
            f"{self.prog}: error: {message} (see {self.prog} --help)\n",
        )


#: the built-in problem: the users' generator at a size that runs in seconds
DEFAULT_SIZES = {
    "batch": 16,
    "sequence": 64,
    "channels": 8,
    "filters": 32,
    "features": 144,
}


def _add_compare(subparsers, common) -> None:
    p = subparsers.add_parser(
        "compare",
        parents=[common],
        help="run every strategy on one problem and print a table",
        description=(
            "Run every strategy on one problem: time, peak memory and agreement "
            "with a reference. With no --model, a built-in Conv1D generator "
            "with 144 output features on random inputs."
        ),
    )
    p.add_argument("--model", help="a saved Keras model (.keras)")
    p.add_argument("--inputs", help="inputs as a .npy file (with --model)")
    p.add_argument("--layer", help="the target layer's name (with --model)")
    p.add_argument(
        "--outputs", default="features", choices=["features", "per_example", "full"]
    )
    p.add_argument("--features", type=int, nargs="+", help="keep these output features")
    for name, value in DEFAULT_SIZES.items():
        flag = "--num-features" if name == "features" else f"--{name}"
        p.add_argument(
            flag,
            dest=f"size_{name}",
            type=int,
            default=None,
            help=f"built-in model's {name} (default {value})",
        )
    p.add_argument(
        "--strategies", help="comma-separated names, 'auto' among them (default: all)"
    )
    p.add_argument(
        "--memory-budget",
        help="for the auto row: bytes, '512MiB' or a fraction of free memory "
        "(default: 80%% of free memory)",
    )
    p.add_argument("--repeats", type=int, default=3, help="timed calls after the first")
    p.add_argument("--device", help="CPU:0 or GPU:0 (default: TensorFlow's choice)")
    p.set_defaults(run=_run_compare)


def _check_compare_args(args) -> None:
    """Refuse option combinations that would be ignored (before TF loads)."""
    sizes = [
        "--num-features" if name == "features" else f"--{name}"
        for name in DEFAULT_SIZES
        if getattr(args, f"size_{name}") is not None
    ]
    if args.model:
        if not (args.inputs and args.layer):
            raise UsageError("--model needs --inputs X.npy and --layer NAME")
        if sizes:
            raise UsageError(
                f"{', '.join(sizes)} size the built-in problem; with --model the "
                "model and --inputs give the sizes. Drop them."
            )
    else:
        given = [flag for flag in ("inputs", "layer") if getattr(args, flag)]
        if given:
            flags = " and ".join(f"--{flag}" for flag in given)
            raise UsageError(
                f"{flags} need{'s' if len(given) == 1 else ''} --model (a saved "
                "Keras model); without --model the built-in generator runs."
            )


def _load_inputs(path: str):
    import numpy as np

    if not os.path.exists(path):
        raise UsageError(f"--inputs {path}: no such file.")
    try:
        return np.load(path)
    except (OSError, ValueError) as err:
        raise UsageError(f"--inputs {path}: not a .npy array ({err}).") from err


def _load_problem(args):
    from jacobkit import examples, saved_models

    if args.model:
        from jacobkit import testing

        try:
            model = saved_models.load(args.model)
        except ValueError as err:
            raise UsageError(str(err)) from err
        inputs = _load_inputs(args.inputs)
        try:
            model64 = testing.float64_copy(model)
        except TypeError:
            model64 = None
        return model, inputs, args.layer, model64, inputs, args.model
    sizes = {
        name: getattr(args, f"size_{name}") or value
        for name, value in DEFAULT_SIZES.items()
    }
    ex = examples.build("generator", **sizes)
    ex64 = examples.build("generator", "float64", **sizes)
    text = ", ".join(f"{k}={v}" for k, v in sizes.items())
    described = f"built-in generator ({text})"
    return ex.model, ex.inputs, ex.layer, ex64.model, ex64.inputs, described


def _reference(problem, model64, inputs64, layer, args):
    """float64 loop on the float64 copy, or the float32 loop without one."""
    from jacobkit import strategies, testing
    from jacobkit.engine import run_strategy
    from jacobkit.problem import Problem

    if model64 is None:
        result = run_strategy(problem, strategies.Loop())
        policy = getattr(getattr(problem.model, "dtype_policy", None), "name", None)
        return list(result.jacobians.values()), (
            f"{policy or 'float32'} loop on the model itself (no float64 copy: "
            "Keras cannot rebuild this model from its config)"
        )
    ref_problem = Problem(
        model64, inputs64, layer, outputs=args.outputs, features=args.features
    )
    reference = testing.reference_jacobian(
        model64,
        inputs64,
        list(ref_problem.targets),
        outputs=args.outputs,
        features=args.features,
        call_kwargs={"training": False},
    )
    built = "a float64 copy of the model" if args.model else "the float64 build"
    return reference, f"float64 loop on {built} (every variable float64)"


def _run_compare(args) -> int:
    _check_compare_args(args)
    if not args.verbose:
        quiet.start_tensorflow_quietly()
    import tensorflow as tf
    from tqdm import tqdm

    from jacobkit import compare, memory, strategies, testing
    from jacobkit.problem import Problem

    try:
        device = memory.normalize_device(args.device)
        if args.memory_budget is not None:
            memory.parse_budget(args.memory_budget, device=device)
        candidates = None
        if args.strategies:
            candidates = [
                "auto" if name.strip() == "auto" else strategies.get(name.strip())
                for name in args.strategies.split(",")
            ]
    except (ValueError, TypeError) as err:
        raise UsageError(str(err)) from err
    model, inputs, layer, model64, inputs64, described = _load_problem(args)
    with tf.device(device):
        try:
            problem = Problem(
                model, inputs, layer, outputs=args.outputs, features=args.features
            )
        except (ValueError, TypeError) as err:
            raise UsageError(str(err)) from err
        reference, ref_name = _reference(problem, model64, inputs64, layer, args)
        if candidates is None:
            candidates = [*compare.default_strategies(problem.num_rows), "auto"]
        bar = tqdm(candidates, desc="strategies", unit="strategy", file=sys.stderr)
        measurements = []
        for strategy in bar:
            if strategy == "auto":
                bar.set_postfix_str("auto")
                measured = compare.measure_auto(
                    problem,
                    reference,
                    repeats=args.repeats,
                    device=device,
                    memory_budget=args.memory_budget,
                )
            else:
                bar.set_postfix_str(strategy.label)
                measured = compare.measure(
                    problem, strategy, reference, repeats=args.repeats, device=device
                )
            measurements.append(measured)
    print(
        f"problem: {described}; target {layer!r}; "
        f"rows {problem.rows_shape} ({args.outputs})"
    )
    print(f"device: {device}; TensorFlow {tf.__version__}; reference: {ref_name}")
    print(compare.format_table(measurements))
    failed = [m for m in measurements if m.error]
    # a strategy disagrees when it is further from the reference than twice
    # the loop's own error (mixed precision, deep models), or than 1e-4
    loop_diff = max(
        (m.max_rel_diff or 0.0 for m in measurements if m.name == "loop"), default=0.0
    )
    limit = max(1e-4, testing.BASELINE_FACTOR * loop_diff)
    disagree = [
        m for m in measurements if m.max_rel_diff is not None and m.max_rel_diff > limit
    ]
    if disagree:
        print(
            f"DISAGREE (max rel. diff > {limit:.1e}): "
            + ", ".join(m.strategy for m in disagree)
        )
    return 1 if disagree or len(failed) == len(measurements) else 0


def _add_bench(subparsers, common) -> None:
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
    p.set_defaults(run=_run_bench)


def _run_bench(args) -> int:
    """``jacobkit bench``, after checking what it would fail on late."""
    from pathlib import Path

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
            quiet.start_tensorflow_quietly(runtime=False)
        from jacobkit import memory

        try:
            memory.normalize_device(args.device)
        except ValueError as err:
            raise UsageError(f"--device {args.device}: {err}") from err
    return command.run(args)


def _add_run(subparsers, common) -> None:
    from jacobkit import run_command

    p = subparsers.add_parser(
        "run",
        parents=[common],
        help="Jacobians of a whole dataset, in memory or written to --out",
        description=(
            "Jacobians of a model over a dataset of .npy inputs, batch by batch; "
            "with --out, written to .npy files and resumable. With no --model, "
            "the built-in generator on synthetic inputs."
        ),
    )
    run_command.add_arguments(p)
    p.set_defaults(run=run_command.run)


#: subcommand name -> function adding it to the parser
SUBCOMMANDS = {"compare": _add_compare, "bench": _add_bench, "run": _add_run}


def _parser() -> argparse.ArgumentParser:
    verbose = {
        "action": "store_true",
        "help": "show TensorFlow's start-up logs and warnings",
    }
    # -v before or after the subcommand (the subcommand's must not reset it)
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("-v", "--verbose", default=argparse.SUPPRESS, **verbose)
    parser = _Parser(
        prog="jacobkit",
        description="Per-output Jacobians of TensorFlow/Keras models.",
    )
    parser.add_argument("-v", "--verbose", **verbose)
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
    quiet.hide_startup_logs()
    with quiet.tensorflow_warnings(all_threads=True), warnings.catch_warnings():
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


if __name__ == "__main__":
    sys.exit(main())
