"""``jacobkit compare``: every strategy on one problem, in a table.

The problem is a saved Keras model with ``.npy`` inputs, or the built-in
generator; the reference is the float64 loop on a float64 copy of the model
where Keras can build one. TensorFlow is imported when the command runs.

The parent process loads the problem (a mistake in it is a usage error) and
computes the reference once, with no time limit
(:mod:`jacobkit.cli._compare_problem`); it goes to each strategy as
an ``.npz`` file. Each strategy then runs in a fresh child process
(:mod:`jacobkit.bench.processes`, as the benchmark suite runs them) that
rebuilds the problem itself: the saved model and inputs loaded from their
paths, or the generator built from its sizes. A child that passes
``--time-limit`` is killed (a TensorFlow op cannot be interrupted inside a
process) and its row says so; the others still run and the table prints.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import sys
from typing import Any

from jacobkit import runtime
from jacobkit.cli import _compare_problem as compared
from jacobkit.cli._common import UsageError, add_custom_objects, check_model_flags

#: exit code of a run the user interrupted (Ctrl-C), after the rows so far
INTERRUPTED = 130
#: seconds each strategy's child may run, by default
DEFAULT_TIME_LIMIT_S = 120.0


def add(subparsers: Any, common: argparse.ArgumentParser) -> None:
    """Add ``jacobkit compare`` to the subcommands."""
    p = subparsers.add_parser(
        "compare",
        parents=[common],
        help="run every strategy on one problem and print a table",
        description=(
            "Run every strategy on one problem, each in a fresh process with a "
            "time limit: time, peak memory and agreement with a reference. With "
            "no --model, a built-in Conv1D generator with 144 output features on "
            "random inputs. Ctrl-C stops the running strategy and prints the "
            "rows so far (exit code 130)."
        ),
    )
    p.add_argument("--model", help="a saved Keras model (.keras)")
    p.add_argument("--inputs", help="inputs as a .npy file (with --model)")
    p.add_argument("--layer", help="the target layer's name (with --model)")
    add_custom_objects(p)
    p.add_argument(
        "--outputs", default="features", choices=["features", "per_example", "full"]
    )
    p.add_argument("--features", type=int, nargs="+", help="keep these output features")
    for name, value in compared.DEFAULT_SIZES.items():
        p.add_argument(
            _size_flag(name),
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
    p.add_argument(
        "--repeats",
        type=int,
        default=5,
        help="timed calls after the first (default 5: the fewest with which the "
        "rank test behind 'faster' can reach p < 0.05; with 3 it cannot)",
    )
    p.add_argument(
        "--time-limit",
        type=_time_limit,
        default=DEFAULT_TIME_LIMIT_S,
        metavar="SECONDS",
        help="wall time of each strategy, which runs in a fresh process of its "
        "own (its start and the problem's rebuild included); one past it is "
        "stopped, its row says TimeLimit and the next one runs (default "
        f"{DEFAULT_TIME_LIMIT_S:g}; 0 or 'none': no limit)",
    )
    p.add_argument("--device", help="CPU:0 or GPU:0 (default: TensorFlow's choice)")
    p.set_defaults(run=run)


def _size_flag(name: str) -> str:
    return "--num-features" if name == "features" else f"--{name}"


def _time_limit(text: str) -> float | None:
    """``--time-limit``: seconds, or ``None`` for no limit (0, ``none``)."""
    if text.strip().lower() == "none":
        return None
    try:
        seconds = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a number of seconds (0 or 'none': no limit)"
        ) from None
    if not seconds >= 0:  # negative, or nan
        raise argparse.ArgumentTypeError(
            f"{text} is negative: give the seconds each strategy may run "
            "(0 or 'none': no limit)"
        )
    return None if seconds == 0 or math.isinf(seconds) else seconds


def _check_args(args: argparse.Namespace) -> None:
    """Refuse option combinations that would be ignored (before TF loads)."""
    check_model_flags(args)
    sizes = [
        _size_flag(name)
        for name in compared.DEFAULT_SIZES
        if getattr(args, f"size_{name}") is not None
    ]
    if args.model and sizes:
        raise UsageError(
            f"{', '.join(sizes)} size the built-in problem; with --model the "
            "model and --inputs give the sizes. Drop them."
        )


def _candidates(args: argparse.Namespace) -> tuple[str, list[Any] | None]:
    """The device and the strategies asked for (``None``: all), checked."""
    from jacobkit import memory, strategies

    try:
        device = memory.normalize_device(args.device)
        if args.memory_budget is not None:
            memory.parse_budget(args.memory_budget, device=device)
        if not args.strategies:
            return device, None
        return device, [
            "auto" if name.strip() == "auto" else strategies.get(name.strip())
            for name in args.strategies.split(",")
        ]
    except (ValueError, TypeError) as err:
        raise UsageError(str(err)) from err


def run(args: argparse.Namespace) -> int:
    """Measure, print the table; 1 if a strategy disagrees or all failed."""
    _check_args(args)
    if not runtime.tensorflow_started():
        # the parent's reference leaves a GPU's memory to the children
        os.environ.setdefault("TF_FORCE_GPU_ALLOW_GROWTH", "true")
    if not args.verbose:
        runtime.start_tensorflow_quietly()
    import tensorflow as tf
    from tqdm import tqdm

    from jacobkit.bench import candidates as defaults
    from jacobkit.bench import processes
    from jacobkit.problem import Call

    device, candidates = _candidates(args)
    loaded = compared.load_problem(args)
    with tf.device(device):
        try:
            call = Call(
                loaded.model, loaded.layer, outputs=args.outputs, features=args.features
            )
            problem = call.problem(loaded.inputs)
        except (ValueError, TypeError) as err:
            raise UsageError(str(err)) from err
    # on the CPU, the fork server imports TensorFlow while the reference runs
    with processes.open_pool(device, quiet=not args.verbose) as pool:
        with tf.device(device):
            reference, ref_name = compared.reference(problem, loaded, args)
        task = _task(args, device, loaded, reference, pool.scratch)
        skipped: list = []
        if candidates is None:
            chosen, skipped = defaults.default_strategies(problem)
            candidates = [*chosen, "auto"]
        bar = tqdm(candidates, desc="strategies", unit="strategy", file=sys.stderr)
        measurements: list = []
        try:
            for strategy in bar:
                bar.set_postfix_str("auto" if strategy == "auto" else strategy.label)
                measurements.append(_measure_one(pool, task, strategy, args.time_limit))
        except KeyboardInterrupt:  # Ctrl-C: the rows measured so far
            bar.close()
            _print_table(loaded, problem, args, device, ref_name, measurements)
            _print_skipped(skipped)
            print(
                f"interrupted: {len(measurements)} of {len(candidates)} "
                "strategies measured"
            )
            return INTERRUPTED
    code = _print_table(loaded, problem, args, device, ref_name, measurements)
    _print_skipped(skipped)
    return code


def _print_skipped(skipped: list) -> None:
    """The default set's left-out configurations, each with why."""
    if skipped:
        reasons = "; ".join(f"{s.strategy.name}: {s.reason}" for s in skipped)
        names = ",".join(s.strategy.name for s in skipped)
        print(
            f"skipped (predicted hopeless here): {reasons}. To run it anyway, "
            f"name it: --strategies {names},loop"
        )


def _task(args, device, loaded: compared.Loaded, reference, scratch) -> dict[str, Any]:
    """What each strategy's child gets (:func:`jacobkit.bench.child.main`):
    the problem to build again (the saved model and inputs by their paths, or
    the generator by its sizes), ``reference``, saved to ``scratch``, and the
    plan cache directory of this process for the auto row."""
    import numpy as np

    from jacobkit.planner import cache

    reference_path = os.path.join(scratch, "reference.npz")
    np.savez(reference_path, *[np.asarray(r) for r in reference])
    task: dict[str, Any] = {
        "kind": "measure",
        "device": device,
        "outputs": args.outputs,
        "features": args.features,
        "repeats": args.repeats,
        "memory_budget": args.memory_budget,
        "reference_path": reference_path,
        # this process's plan cache now ("": off): the children are forked
        # from a server that keeps the environment it started with
        "plan_cache": cache.directory() or "",
    }
    if args.model:
        return {
            **task,
            "model_path": os.path.abspath(args.model),
            "inputs_path": os.path.abspath(args.inputs),
            "layer": args.layer,
            # resolved again in the child, from this directory
            "custom_objects": args.custom_objects,
            "import_path": os.getcwd(),
        }
    return {**task, "builder": "generator", "sizes": loaded.sizes, "layer": None}


def _measure_one(pool, task: dict[str, Any], strategy, time_limit) -> Any:
    """``strategy`` (or ``"auto"``) measured in a child of ``pool``: its
    :class:`~jacobkit.bench.measure.Measurement`, or a failed one saying why
    there is none (the time limit, a crash)."""
    from jacobkit import strategies
    from jacobkit.bench.measure import Measurement

    if strategy == "auto":
        base, spec = Measurement("auto", "auto", None), None
    else:
        base = Measurement(strategy.label, strategy.name, strategy.chunk_size)
        spec = strategies.to_spec(strategy)
    answer = pool.run({**task, "strategy": base.name, "spec": spec}, time_limit)
    if "ran" not in answer:  # no measurement came back
        return dataclasses.replace(base, error=answer["error"])
    return Measurement.from_dict({**answer, "strategy": answer["ran"]})


def _print_table(loaded, problem, args, device, ref_name, measurements) -> int:
    """Print the problem, the table and any disagreement; the exit code."""
    import tensorflow as tf

    from jacobkit.bench import disagreement, measure

    print(
        f"problem: {loaded.described}; target {loaded.layer!r}; "
        f"rows {problem.rows_shape} ({args.outputs})"
    )
    print(f"device: {device}; TensorFlow {tf.__version__}; reference: {ref_name}")
    limited = "no time limit" if args.time_limit is None else f"{args.time_limit:g} s"
    print(f"each strategy in a fresh process ({limited})")
    print(measure.format_table(measurements))
    failed = [m for m in measurements if m.error]
    loop_diff = max(
        (m.max_rel_diff or 0.0 for m in measurements if m.name == "loop"), default=0.0
    )
    limit = disagreement.disagreement_limit(loop_diff)
    disagree = [
        m for m in measurements if disagreement.disagrees(m.max_rel_diff, limit)
    ]
    if disagree:
        print(disagreement.disagreement_line([m.strategy for m in disagree], limit))
    return 1 if disagree or len(failed) == len(measurements) else 0
