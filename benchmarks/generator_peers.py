"""The users' wide generator against its peers, on both kinds of TensorFlow
CPU kernels (oneDNN on and off): jacobkit's default call, TensorFlow's own
``tape.jacobian`` and ``tf.vectorized_map`` over the rows, PyTorch and JAX,
on the same weights (``peers/export_generator.py``): B=64, T=128, C=16,
Conv1D 64/128/128 -> Dense(144), the first Conv1D's Jacobian for the 144
features (every feature summed over the batch and the positions).

Every run is a fresh process pinned to one core (``footing.py``), timed by
``peers/protocol.py`` (the first call, tracing included; the first 3 calls;
the median of ``--repeats`` steady calls after ``auto`` settled). Each round
runs, for each kind, the GEMM probe of ``mlp_limit.py`` and the TensorFlow
runs with ``TF_ENABLE_ONEDNN_OPTS`` set for it, then each peer once: PyTorch
and JAX do not use TensorFlow's oneDNN switch, so their processes are the
same on both kinds and both tables show the same peer runs. Each run's time
over jacobkit's default is the median of the rounds' ratios (runs of one
round measured back to back), and each time reads as a share of its kind's
GEMM rate on the exact work (``conv_gradients.WORK_FLOP``). Every kernel
Jacobian is checked against jacobkit's default's of the same kind.

    python benchmarks/generator_peers.py --peers-python /path/to/peers/bin/python \\
        --rounds 2 --out benchmarks/results

writes ``cpu/generator_peers.{json,md}`` (oneDNN on) and
``cpu-onednn-off/generator_peers.{json,md}`` under ``--out``, and prints its
runtime. Without ``--peers-python`` only TensorFlow and jacobkit run.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import mlp_limit
from conv_channels import AFTER_FLOP
from conv_gradients import SIZES, WORK_FLOP, load_note

HERE = Path(__file__).resolve().parent
#: kind -> (``TF_ENABLE_ONEDNN_OPTS``, the results folder under ``--out``)
KINDS = {"on": ("1", "cpu"), "off": ("0", "cpu-onednn-off")}
#: TensorFlow's runs: label -> child argument
TENSORFLOW = {
    "jacobkit default (auto)": "auto",
    "TF tape.jacobian (pfor)": "tape.jacobian",
    "TF vectorized_map(tape.gradient)": "vectorized_map",
}
DEFAULT = "jacobkit default (auto)"
#: the peers' best settings from a first sweep (one call after the first,
#: 144 rows, one core, under load): PyTorch jacrev chunk_size 4 6.8 s, 8
#: 21.7 s, 16 23.9 s; vmap(vjp) over chunks of 1 7.4 s, 8 11.9 s, 16 9.3 s;
#: JAX lax.map(vjp) with the convolutions as shifted matmuls, batch_size 1
#: 4.1 s, 2 20.2 s, 4 24.6 s, 8 21.9 s; with XLA's own convolution,
#: batch_size 16: 117 s (16 rows alone: 10.3 s at batch_size 1, 13.0 s at 16).
#: PyTorch's loop of autograd.grad, tried after the first measured run (7.4 s
#: steady, load unknown against the others), runs too
PEERS = {
    "PyTorch jacrev(chunk_size=4)": [
        "generator_torch.py",
        *("--method", "jacrev", "--chunk-size", "4"),
    ],
    "PyTorch vmap(vjp) over chunks of 16": [
        "generator_torch.py",
        *("--method", "vjp", "--chunk-size", "16"),
    ],
    "PyTorch loop of autograd.grad": ["generator_torch.py", "--method", "loop"],
    "JAX lax.map(vjp, batch_size=1), shifted-matmul conv": [
        "generator_jax.py",
        *("--method", "lax_map", "--batch-size", "1", "--conv", "gemm"),
    ],
}


def child(strategy: str, weights: str, repeats: int) -> None:
    """One jacobkit (or raw TensorFlow) run on this process's kind of
    kernels; prints one JSON line, the kernel Jacobian saved beside
    ``weights``."""
    os.environ["TF_CPP_MIN_LOG_LEVEL"] = "3"
    sys.path.insert(0, str(HERE / "peers"))
    import footing
    import numpy as np
    import tensorflow as tf
    from protocol import measure

    import jacobkit as jk
    from jacobkit.testing import examples

    record = footing.pin_tensorflow("generator_peers")
    example = examples.build("generator", **SIZES)
    model, x = example.model, example.inputs
    saved = dict(np.load(weights))
    for name in ("conv1", "conv2", "conv3", "head"):  # the exported weights
        layer = model.get_layer(name)
        layer.set_weights([saved[f"{name}_kernel"], saved[f"{name}_bias"]])
    x = tf.constant(saved["x"])
    kernel = model.get_layer("conv1").kernel
    plans: list[Any] = []

    @tf.function
    def tape_jacobian() -> tf.Tensor:
        with tf.GradientTape() as tape:
            rows = tf.reduce_sum(model(x), axis=(0, 1))
        return tape.jacobian(rows, kernel)

    @tf.function
    def vectorized() -> tf.Tensor:
        def row(cotangent: tf.Tensor) -> tf.Tensor:
            with tf.GradientTape() as tape:
                rows = tf.reduce_sum(model(x), axis=(0, 1))
            return tape.gradient(rows, kernel, output_gradients=cotangent)

        return tf.vectorized_map(row, tf.eye(SIZES["features"]))

    def call() -> np.ndarray:
        if strategy == "tape.jacobian":
            return tape_jacobian().numpy()
        if strategy == "vectorized_map":
            return vectorized().numpy()
        result = jk.jacobian(model, x, "conv1")
        plans[:] = [result.plan]
        return result.kernel.numpy()

    def settled() -> bool:
        return not plans or plans[0] is None or plans[0].settled

    timings, result = measure(call, repeats, settled=settled)
    path = weights + f".{os.getpid()}.npy"
    np.save(path, result)
    plan = str(plans[0]).split(":")[0] if plans else strategy
    print(json.dumps({**timings, "kernel": path, "plan": plan, "footing": record}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--peers-python", help="the peers' environment's python")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--kinds", default="on,off", help="on, off or on,off")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    parser.add_argument("--loaded", action="store_true")
    parser.add_argument(
        "--only",
        action="append",
        help="run only the runs whose label contains this (repeatable; "
        "jacobkit's default always runs)",
    )
    parser.add_argument(
        "--render", action="store_true", help="only rewrite the markdown files"
    )
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--weights", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        return child(args.child, args.weights, args.repeats)
    if args.render:
        return render(args.out)
    began = time.perf_counter()
    kinds = args.kinds.split(",")
    work = Path(tempfile.mkdtemp())
    weights = str(work / "generator.npz")
    subprocess.run(
        [sys.executable, str(HERE / "peers" / "export_generator.py")]
        + ["--out", weights],
        check=True,
        capture_output=True,
    )
    base = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3", "JACOBKIT_CACHE_DIR": ""}
    flags = ["--weights", weights, "--repeats", str(args.repeats)]
    commands: dict[tuple[str, str], tuple[list[str], dict[str, str]]] = {}
    for kind in kinds:
        env = {**base, "TF_ENABLE_ONEDNN_OPTS": KINDS[kind][0]}
        probe = [sys.executable, str(HERE / "mlp_limit.py"), "--gemm"]
        commands[kind, "gemm"] = (probe, env)
        for label, strategy in TENSORFLOW.items():
            command = [sys.executable, __file__, "--child", strategy, *flags]
            commands[kind, label] = (command, env)
    if args.peers_python:
        for label, (script, *options) in PEERS.items():
            save = str(work / f"peer{len(commands)}.npy")
            command = [args.peers_python, str(HERE / "peers" / script), *options]
            commands["peers", label] = (command + flags + ["--save", save], base)
    if args.only:
        commands = {
            key: value
            for key, value in commands.items()
            if key[1] in ("gemm", DEFAULT) or any(o in key[1] for o in args.only)
        }
    found: dict[tuple[str, str], list[dict]] = {key: [] for key in commands}
    for round_ in range(args.rounds):
        for key, (command, env) in commands.items():
            result = mlp_limit._run(command, env)
            if "--save" in command and "error" not in result:
                result["kernel"] = command[command.index("--save") + 1]
            found[key].append(result)
            shown = {k: v for k, v in result.items() if k != "footing"}
            print(f"round {round_ + 1} {key}: {shown}", flush=True)
    for kind in kinds:
        data = _table(kind, found, args.rounds, args.loaded)
        out = args.out / KINDS[kind][1]
        out.mkdir(parents=True, exist_ok=True)
        (out / "generator_peers.json").write_text(json.dumps(data, indent=1) + "\n")
        (out / "generator_peers.md").write_text(_markdown(data))
        print(_markdown(data))
    shutil.rmtree(work, ignore_errors=True)
    print(f"runtime: {time.perf_counter() - began:.0f} s")


def _table(
    kind: str, found: dict[tuple[str, str], list[dict]], rounds: int, loaded: bool
) -> dict[str, Any]:
    """One kind's rows: medians over rounds, each run's per-round ratio to
    jacobkit's default, its share of the GEMM rate, and its agreement."""
    import numpy as np

    rates = [r["gflops"] for r in found[kind, "gemm"] if "gflops" in r]
    rate = statistics.median(rates)
    mine = {
        label: v for (k, label), v in found.items() if k == kind and label != "gemm"
    }
    mine.update({label: v for (k, label), v in found.items() if k == "peers"})
    default = mine[DEFAULT]
    reference = next((np.load(r["kernel"]) for r in default if "kernel" in r), None)
    rows: dict[str, Any] = {}
    for label, results in mine.items():
        good = [r for r in results if "error" not in r]
        if not good:
            rows[label] = {"error": results[-1]["error"]}
            continue
        row: dict[str, Any] = {
            key: statistics.median(r[key] for r in good)
            for key in ("first_s", "first_three_s", "steady_s", "peak_growth_mib")
        }
        row["method"] = good[-1].get("plan") or good[-1].get("method")
        ratios = [
            r["steady_s"] / d["steady_s"]
            for r, d in zip(results, default)
            if "error" not in r and "error" not in d
        ]
        row["to_default"] = statistics.median(ratios) if ratios else None
        row["ratios"] = ratios
        row["footing"] = good[-1].get("footing")
        if reference is not None:
            kernel = np.load(good[-1]["kernel"])
            row["agreement"] = float(
                np.abs(kernel - reference).max() / np.abs(reference).max()
            )
        rows[label] = row
    return {
        "kind": kind,
        "onednn": kind == "on",
        "gemm_gflops": rate,
        "gemm_probes": rates,
        "work_flop": WORK_FLOP,
        "one_channel_flop": AFTER_FLOP,
        "rounds": rounds,
        "loaded": loaded,
        "rows": rows,
    }


def _markdown(data: dict[str, Any]) -> str:
    sys.path.insert(0, str(HERE / "peers"))
    import footing

    kind = "on" if data["onednn"] else "off"
    lines = [
        f"# The users' generator against its peers (TensorFlow's oneDNN {kind})",
        "",
        "`python benchmarks/generator_peers.py` (see its docstring): B=64, "
        "T=128, C=16, Conv1D 64/128/128 -> Dense(144), the first Conv1D's "
        "Jacobian for the 144 features, the same weights in every framework. "
        "One core, one thread per run, fresh processes, median of "
        f"{data['rounds']} alternating rounds. GEMM probe "
        f"{data['gemm_gflops']:.0f} GFLOP/s (this kind's TensorFlow, one "
        "probe a round); the share of the rate is on the exact work, "
        f"{data['work_flop'] / 1e9:.1f} GFLOP (128 rows after the linear "
        "head: conv3's and conv2's input gradients, conv1's kernel gradient; "
        "jacobkit's one-channel step through conv3 needs "
        f"{data['one_channel_flop'] / 1e9:.1f} GFLOP of it). × default: the "
        "median of the rounds' ratios of steady times. PyTorch and JAX do "
        "not read TensorFlow's oneDNN switch: their runs are the same "
        "processes in both kinds' tables.",
        "",
    ]
    lines += footing.machine_lines({"machine": f"oneDNN {kind}"}, data["rows"])
    if data["loaded"]:
        lines += [load_note(data).strip(), ""]
    lines += [
        "| run | method | steady | first call | first 3 calls | × default "
        f"| of the GEMM rate, {data['work_flop'] / 1e9:.1f} GFLOP "
        f"| of the GEMM rate, {data['one_channel_flop'] / 1e9:.1f} GFLOP "
        "| peak growth | max rel. diff vs jacobkit |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for label, row in data["rows"].items():
        if "error" in row:
            lines.append(f"| {label} | failed: {' '.join(row['error'])} ||||||||")
            continue
        ratio = row["to_default"]
        lines.append(
            f"| {label} | `{row['method']}` | {row['steady_s']:.2f} s "
            f"| {row['first_s']:.2f} s | {row['first_three_s']:.2f} s "
            f"| {'' if ratio is None else f'{ratio:.2f}'} "
            f"| {_share(data, data['work_flop'], row)} "
            f"| {_share(data, data['one_channel_flop'], row)} "
            f"| {row['peak_growth_mib']:.0f} MiB "
            f"| {row.get('agreement', float('nan')):.1e} |"
        )
    return "\n".join(lines) + "\n"


def _share(data: dict[str, Any], flop: float, row: dict[str, Any]) -> str:
    """``flop`` at the GEMM probe's rate over the run's steady time."""
    return f"{flop / 1e9 / data['gemm_gflops'] / row['steady_s']:.0%}"


def render(out: Path) -> None:
    """Rewrite each kind's markdown from its JSON under ``out``."""
    for _, folder in KINDS.values():
        path = out / folder / "generator_peers.json"
        if path.exists():
            data = json.loads(path.read_text())
            path.with_suffix(".md").write_text(_markdown(data))


if __name__ == "__main__":
    main()
