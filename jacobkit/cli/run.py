"""``jacobkit run``: Jacobians of a whole dataset, in memory or into ``--out``.

Kept free of TensorFlow imports until the command runs, so that building the
command-line parser stays fast.
"""

from __future__ import annotations

import argparse
import os
import re
import resource
import sys
import time
from collections.abc import Iterator
from typing import Any

from jacobkit import runtime
from jacobkit.cli._common import (
    UsageError,
    add_custom_objects,
    check_model_flags,
    load_model,
)

#: the built-in problem's generator sizes and number of synthetic examples
BUILTIN = {"sequence": 64, "channels": 8, "filters": 32, "features": 144}
BUILTIN_EXAMPLES = 256


def add(subparsers: Any, common: argparse.ArgumentParser) -> None:
    """Add ``jacobkit run`` to the subcommands."""
    parser = subparsers.add_parser(
        "run",
        parents=[common],
        help="Jacobians of a whole dataset, in memory or written to --out",
        description=(
            "Jacobians of a model over a dataset of .npy inputs, batch by batch; "
            "with --out, written to .npy files and resumable. With no --model, "
            "the built-in generator on synthetic inputs."
        ),
    )
    parser.add_argument("--model", help="a saved Keras model (.keras)")
    parser.add_argument(
        "--inputs",
        help="a .npy file (memory-mapped) or a directory of them (read in name "
        "order, one after the other); with --model",
    )
    parser.add_argument("--layer", help="the target layer's name (with --model)")
    add_custom_objects(parser)
    parser.add_argument(
        "--outputs", default="features", choices=["features", "per_example", "full"]
    )
    parser.add_argument(
        "--batch-size", type=int, default=64, help="examples per batch (default 64)"
    )
    parser.add_argument(
        "--out",
        help="write the Jacobians there (.npy files and manifest.json); the same "
        "command continues an interrupted run",
    )
    parser.add_argument(
        "--overwrite", action="store_true", help="discard what --out holds"
    )
    parser.add_argument(
        "--memory-budget",
        help="bytes, '512MiB' or a fraction of free memory (default: 80%% of free)",
    )
    parser.add_argument(
        "--strategy", default="auto", help="auto (default) or a strategy's name"
    )
    parser.add_argument(
        "--examples",
        type=int,
        default=BUILTIN_EXAMPLES,
        help=f"without --model: synthetic examples (default {BUILTIN_EXAMPLES})",
    )
    parser.add_argument("--device", help="CPU:0 or GPU:0 (default: TensorFlow's)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    parser.set_defaults(run=run)


class _Synthetic:
    """Seeded random batches of the built-in generator's input shape."""

    def __init__(self, examples: int, batch_size: int, shape: tuple[int, ...]):
        self.examples, self.batch_size, self.shape = examples, batch_size, shape

    def __len__(self) -> int:
        return -(-self.examples // self.batch_size)

    def __iter__(self) -> Iterator[Any]:
        import numpy as np

        rng = np.random.default_rng(0)
        for start in range(0, self.examples, self.batch_size):
            n = min(self.batch_size, self.examples - start)
            yield rng.normal(size=(n, *self.shape)).astype("float32")


class _Files:
    """The batches of one or more ``.npy`` files, memory-mapped, in order."""

    def __init__(self, paths: list[str], batch_size: int) -> None:
        import numpy as np

        from jacobkit.batches import source

        self.parts = [
            source.batches(np.load(p, mmap_mode="r"), batch_size) for p in paths
        ]

    def __len__(self) -> int:
        return sum(len(p) for p in self.parts)

    def __iter__(self) -> Iterator[Any]:
        for part in self.parts:
            yield from part


def _inputs(args: argparse.Namespace) -> tuple[Any, Any, str, str]:
    """(model, batches, layer, description); a user's mistake is a
    :class:`~jacobkit.cli._common.UsageError` (one line, exit code 2)."""
    if args.model is None:
        from jacobkit.testing import examples

        ex = examples.build("generator", "float32", 0, batch=1, **BUILTIN)
        shape = tuple(ex.inputs.shape[1:])
        sizes = ", ".join(f"{k}={v}" for k, v in BUILTIN.items())
        return (
            ex.model,
            _Synthetic(args.examples, args.batch_size, shape),
            ex.layer,
            f"built-in generator ({sizes}), {args.examples} synthetic examples",
        )
    if not os.path.exists(args.inputs):
        raise UsageError(f"--inputs {args.inputs}: no such file or directory.")
    if os.path.isdir(args.inputs):
        paths = sorted(
            os.path.join(args.inputs, name)
            for name in os.listdir(args.inputs)
            if name.endswith(".npy")
        )
        if not paths:
            raise UsageError(f"--inputs {args.inputs}: no .npy files there.")
    else:
        paths = [args.inputs]
    return (
        load_model(args.model, args.custom_objects),
        _Files(paths, args.batch_size),
        args.layer,
        args.model,
    )


def _budget(text: str | None) -> Any:
    if text is None:
        return None
    try:
        return float(text) if "." in text else int(text)
    except ValueError:
        return text


#: the library's words for an argument -> the command line's flag
_FLAGS = {
    "overwrite=True": "--overwrite",
    "another out=": "another --out",
}


def _in_flags(message: str) -> str:
    """A library error as the command line says it: its remedies name the
    flags (``--overwrite``), not the keyword arguments behind them."""
    message = re.sub(r"jacobian\(out=('[^']*')\)", r"--out \1", message)
    for words, flag in _FLAGS.items():
        message = message.replace(words, flag)
    return message


def run(args: argparse.Namespace) -> int:
    """Compute, then print a summary: rows, time, peak memory, where it is."""
    # the options' mistakes first, before TensorFlow starts
    if args.batch_size < 1:
        raise UsageError(f"--batch-size {args.batch_size}: must be >= 1")
    check_model_flags(args)
    if not args.verbose:
        # TF_CPP_MIN_LOG_LEVEL alone does not hide the lines its native
        # libraries print while they load
        runtime.start_tensorflow_quietly()
    import jacobkit as jk
    from jacobkit import memory

    model, batches, layer, described = _inputs(args)
    start = time.perf_counter()
    try:
        result = jk.jacobian(
            model,
            batches,
            layer,
            outputs=args.outputs,
            strategy=args.strategy,
            memory_budget=_budget(args.memory_budget),
            device=args.device,
            out=args.out,
            overwrite=args.overwrite,
            progress=not args.no_progress,
        )
    except (ValueError, TypeError) as err:  # jacobkit's own messages
        raise UsageError(_in_flags(str(err))) from err
    seconds = time.perf_counter() - start
    rows = result.stats.num_rows or 0
    size = sum(
        int(v.nbytes) if hasattr(v, "nbytes") else 0 for v in result.jacobians.values()
    )
    tensors: list[Any] = list(result.jacobians.values())
    size = size or sum(int(v.shape.num_elements()) * v.dtype.size for v in tensors)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    where = (
        os.path.abspath(args.out)
        if args.out
        else "in memory only (pass --out DIR to keep it)"
    )
    ran = result.strategy_config.label if result.strategy_config else result.strategy
    print(f"problem: {described}; target {layer!r}; {len(batches)} batches")
    print(
        f"rows: {result.rows_shape} ({args.outputs}); computed {rows} rows in "
        f"{seconds:.1f} s ({rows / max(seconds, 1e-9):.0f} rows/s); strategy {ran}"
    )
    print(
        f"result: {memory.format_bytes(size)}; peak process memory (RSS) "
        f"{memory.format_bytes(peak)}"
    )
    for name, value in result.jacobians.items():
        print(f"  {name}: {tuple(value.shape)}")
    print(f"result at: {where}")
    sys.stdout.flush()
    return 0
