"""The command line: ``jacobkit compare`` (and the subcommands registered below)."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence

#: Must be set before TensorFlow starts: TF's pooled CPU allocator is the one
#: that reports peak memory on CPU.
os.environ.setdefault("TF_CPU_ALLOCATOR_USE_BFC", "true")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

#: the built-in problem: the users' generator at a size that runs in seconds
DEFAULT_SIZES = {
    "batch": 16,
    "sequence": 64,
    "channels": 8,
    "filters": 32,
    "features": 144,
}


def _add_compare(subparsers) -> None:
    p = subparsers.add_parser(
        "compare",
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
            default=value,
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


def _load_problem(args):
    import numpy as np

    from jacobkit import examples

    if args.model:
        if not (args.inputs and args.layer):
            raise SystemExit(
                "jacobkit compare --model needs --inputs X.npy and --layer NAME"
            )
        import keras

        from jacobkit import testing

        model = keras.saving.load_model(args.model, compile=False)
        inputs = np.load(args.inputs)
        try:
            model64 = testing.float64_copy(model)
        except TypeError:
            model64 = None
        return model, inputs, args.layer, model64, inputs, args.model
    sizes = {name: getattr(args, f"size_{name}") for name in DEFAULT_SIZES}
    ex = examples.build("generator", **sizes)
    ex64 = examples.build("generator", "float64", **sizes)
    text = ", ".join(f"{k}={v}" for k, v in sizes.items())
    described = f"built-in generator ({text})"
    return ex.model, ex.inputs, ex.layer, ex64.model, ex64.inputs, described


def _reference(problem, model64, inputs64, layer, args):
    """float64 loop on the float64 copy, or the float32 loop without one."""
    from jacobkit import strategies, testing
    from jacobkit.api import run_strategy
    from jacobkit.problem import Problem

    if model64 is None:
        result = run_strategy(problem, strategies.Loop())
        return list(result.jacobians.values()), "float32 loop (no float64 copy)"
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
    return reference, "float64 loop"


def _run_compare(args) -> int:
    import tensorflow as tf
    from tqdm import tqdm

    from jacobkit import compare, memory, strategies
    from jacobkit.problem import Problem

    device = memory.normalize_device(args.device)
    model, inputs, layer, model64, inputs64, described = _load_problem(args)
    with tf.device(device):
        problem = Problem(
            model, inputs, layer, outputs=args.outputs, features=args.features
        )
        reference, ref_name = _reference(problem, model64, inputs64, layer, args)
        if args.strategies:
            candidates = [
                "auto" if name.strip() == "auto" else strategies.get(name.strip())
                for name in args.strategies.split(",")
            ]
        else:
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
    disagree = [
        m for m in measurements if m.max_rel_diff is not None and m.max_rel_diff > 1e-4
    ]
    if disagree:
        print(
            "DISAGREE (max rel. diff > 1e-4): "
            + ", ".join(m.strategy for m in disagree)
        )
    return 1 if disagree or len(failed) == len(measurements) else 0


def _add_bench(subparsers) -> None:
    from jacobkit.bench import command

    p = subparsers.add_parser(
        "bench",
        help="run the benchmark suite: every strategy, each in a fresh subprocess",
        description=(
            "Time, peak memory and agreement with a reference of every strategy "
            "on the benchmark problems; writes results.json, results.md and PNG "
            "plots to --out."
        ),
    )
    command.add_arguments(p)
    p.set_defaults(run=command.run)


def _add_run(subparsers) -> None:
    from jacobkit import run_command

    p = subparsers.add_parser(
        "run",
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


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="jacobkit", description="Per-output Jacobians of TensorFlow/Keras models."
    )
    subparsers = parser.add_subparsers(dest="command", required=True)
    for add in SUBCOMMANDS.values():
        add(subparsers)
    args = parser.parse_args(argv)
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())
