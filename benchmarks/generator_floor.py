"""Where the users' wide generator's default call spends its time, piece by
piece, against the GEMM rate: each piece of one row's work timed alone on
its exact shapes, with TensorFlow's other kernels for the same work beside
it, and the default call itself (B=64, T=128, C=16, Conv1D 64/128/128 ->
Dense(144), the first Conv1D's Jacobian for the 144 features).

The default call (``structured(while)`` after the linear head and the
one-channel step) runs, for each of the head's 128 rows, in turn:

- ``seed``: the row's one-channel cotangent at conv3's input, ``(B, T, 128)``
  (:meth:`jacobkit.problem.conv_channels.ConvChannels.cotangents`: with
  oneDNN off its 3 shifted windows times the kernel's column, with it on a
  depthwise convolution);
- ``relu2``: conv2's ReLU derivative times it (``ReluGrad``);
- ``conv2``: conv2's input gradient, ``(B, T, 128) -> (B, T, 64)`` by 5, as
  the forward convolution of the flipped kernel
  (:mod:`jacobkit.strategies.gradients`): 671 MFLOP;
- ``relu1``: conv1's ReLU derivative times that (``ReluGrad``);
- ``filter``: conv1's kernel gradient, its input's patches (formed once
  before the loop, held transposed) times the row's cotangent (one
  ``MatMul``; the same with ``transpose_a`` on the patches and TensorFlow's
  own ``Conv2DBackpropFilter`` beside it): 84 MFLOP;
- ``bias``: conv1's bias gradient (``BiasAddGrad``).

Each piece runs ``--iterations`` times in a ``tf.while_loop`` of one
iteration at a time (its time a row: the loop's over the iterations), every
piece once a round and the GEMM probe of ``mlp_limit.py`` once a round, so
each piece's rate reads against its round's probe; the default call's
steady time is taken in the same rounds. Each time is taken as wall time
and as this process's CPU time (on a loaded machine the CPU time leaves out
the time other processes held the core); the shares read each against the
probe timed the same way. The floor is the fastest kernel
measured for each piece of work, summed, against the limit (the exact
work at the GEMM probe's rate).

    TF_ENABLE_ONEDNN_OPTS=0 taskset -c 0 python benchmarks/generator_floor.py \\
        --rounds 3 --out benchmarks/results/cpu-onednn-off [--loaded]

writes ``generator_floor.{json,md}`` under ``--out`` (the page's
hand-written sections, under ``##`` headings, kept after the table).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from conv_channels import AFTER_FLOP
from conv_gradients import ROWS, SIZES

_B, _T = SIZES["batch"], SIZES["sequence"]
_N = _B * _T
#: piece -> (the work it does, its flop, the bytes an elementwise piece
#: reads and writes at least)
WORK = {
    "seed": ("one-channel cotangent, (B, T, 128)", 2 * _N * 3 * 128, 4 * _N * 128),
    "relu2": ("conv2's ReLU derivative, (B, T, 128)", 0, 12 * _N * 128),
    "conv2": ("conv2's input gradient, 128 -> 64 by 5", 2 * _N * 5 * 64 * 128, 0),
    "relu1": ("conv1's ReLU derivative, (B, T, 64)", 0, 12 * _N * 64),
    "filter": ("conv1's kernel gradient, 16 -> 64 by 5", 2 * _N * 5 * 16 * 64, 0),
    "bias": ("conv1's bias gradient", 0, 4 * _N * 64),
}


def _kernels(
    tf: Any, model: Any, x: Any, onednn: bool
) -> dict[str, tuple[str, bool, Callable]]:
    """label -> (the piece of work, whether the default call runs it on this
    kind (``onednn``), ``i -> the piece's output`` for row ``i``), on the
    model's exact tensors."""
    from jacobkit.strategies import gradients

    layer = {n: model.get_layer(n) for n in ("conv1", "conv2", "conv3")}
    k1, k2, k3 = (tf.convert_to_tensor(layer[n].kernel)[None] for n in layer)
    x = tf.convert_to_tensor(x)[:, None]  # (B, 1, T, 16): a Conv1D's Conv2D
    h1 = tf.nn.relu(tf.nn.conv2d(x, k1, 1, "SAME") + layer["conv1"].bias)
    h2 = tf.nn.relu(tf.nn.conv2d(h1, k2, 1, "SAME") + layer["conv2"].bias)
    z3 = tf.nn.conv2d(h2, k3, 1, "SAME") + layer["conv3"].bias
    slopes = 1 - tf.tanh(z3) ** 2  # (B, 1, T, 128)
    seed = tf.random.stateless_normal((_B, 1, _T, 128), (1, 2))
    mask2 = tf.cast(h2 > 0, tf.float32)
    dz2 = tf.raw_ops.ReluGrad(gradients=seed, features=h2)
    dh1 = gradients.input_gradient(dz2, k2, [[0, 0], [2, 2]])
    dz1 = tf.raw_ops.ReluGrad(gradients=dh1, features=h1)
    padded = tf.pad(x[:, 0], [[0, 0], [2, 2], [0, 0]])
    patches = tf.reshape(
        tf.stack([padded[:, a : a + _T] for a in range(5)], 2), (_N, 80)
    )
    rows4 = tf.random.stateless_normal((_N, 4 * 64), (3, 4))

    # rows first and padded, as ConvChannels.slopes holds them: (R, B, 1, T + 2)
    rows_first = tf.pad(tf.transpose(slopes, (3, 0, 1, 2)), [[0, 0]] * 3 + [[1, 1]])
    columns = tf.transpose(tf.reverse(k3, [0, 1]), (3, 0, 1, 2))  # (R, 1, 3, 128)
    patches_t = tf.transpose(patches) + 0.0  # a copy, (80, N)

    def depthwise(i: Any) -> Any:
        r = (i % 128)[None]
        flipped = tf.transpose(tf.gather(columns, r), (1, 2, 0, 3))
        padded = tf.transpose(tf.gather(rows_first, r), (1, 2, 3, 0))
        return tf.nn.depthwise_conv2d(padded, flipped, [1, 1, 1, 1], "VALID")

    def shifted(i: Any) -> Any:
        r = (i % 128)[None]
        one = tf.gather(rows_first, r)  # (1, B, 1, T + 2)
        taps = tf.stack([one[:, :, :, a : a + _T] for a in range(3)], -1)
        column = tf.reshape(tf.gather(columns, r), (1, 3, 128))
        return tf.matmul(tf.reshape(taps, (1, _N, 3)), column)

    def filter_own(i: Any) -> Any:
        return tf.raw_ops.Conv2DBackpropFilter(
            input=x,
            filter_sizes=[1, 5, 16, 64],
            out_backprop=dz1,
            strides=[1, 1, 1, 1],
            padding="SAME",
        )

    def backprop_input(i: Any) -> Any:
        return tf.raw_ops.Conv2DBackpropInput(
            input_sizes=[_B, 1, _T, 64],
            filter=k2,
            out_backprop=dz2,
            strides=[1, 1, 1, 1],
            padding="SAME",
        )

    flat = tf.reshape(dz1, (_N, 64))
    return {
        "depthwise convolution": ("seed", onednn, depthwise),
        "3 shifted windows x kernel column (matmul)": ("seed", not onednn, shifted),
        "ReluGrad (conv2)": (
            "relu2",
            True,
            lambda i: tf.raw_ops.ReluGrad(gradients=seed, features=h2),
        ),
        "times a float mask": ("relu2", False, lambda i: seed * mask2),
        "forward conv, flipped kernel": (
            "conv2",
            not onednn,
            lambda i: gradients.input_gradient(dz2, k2, [[0, 0], [2, 2]]),
        ),
        "Conv2DBackpropInput": ("conv2", onednn, backprop_input),
        "ReluGrad (conv1)": (
            "relu1",
            True,
            lambda i: tf.raw_ops.ReluGrad(gradients=dh1, features=h1),
        ),
        "Conv2DBackpropFilter": ("filter", onednn, filter_own),
        "patches (shared by the rows), transpose_a @ cotangent": (
            "filter",
            False,
            lambda i: tf.matmul(patches, flat, transpose_a=True),
        ),
        "transposed patches (a copy, shared) @ cotangent": (
            "filter",
            not onednn,
            lambda i: tf.matmul(patches_t, flat),
        ),
        "the same, 4 rows side by side (a row's share)": (
            "filter",
            False,
            lambda i: tf.matmul(patches_t, rows4),
        ),
        "BiasAddGrad": (
            "bias",
            True,
            lambda i: tf.raw_ops.BiasAddGrad(out_backprop=dz1),
        ),
    }


def _loop_time(
    tf: Any, fn: Callable, iterations: int
) -> Callable[[], tuple[float, float]]:
    """A timer of ``fn`` run ``iterations`` times in a ``tf.while_loop``
    (one at a time; each iteration's output carried, so none is skipped):
    seconds an iteration, wall and this process's CPU."""

    @tf.function(autograph=False)
    def loop() -> Any:
        first = fn(tf.constant(0))

        def body(i: Any, _: Any) -> Any:
            return i + 1, fn(i)

        return tf.while_loop(
            lambda i, _: i < iterations,
            body,
            (tf.constant(1), first),
            parallel_iterations=1,
        )[1]

    loop()

    def timed() -> tuple[float, float]:
        wall, cpu = time.perf_counter(), time.process_time()
        loop().numpy()
        return (
            (time.perf_counter() - wall) / iterations,
            (time.process_time() - cpu) / iterations,
        )

    return timed


def _gemm_rates(tf: Any) -> tuple[float, float]:
    """The GEMM probe of ``mlp_limit.py`` (one ``(4096 x 1024) @ (1024 x
    1024)`` float32 matmul, median of 7): GFLOP/s by wall time and by this
    process's CPU time."""
    a = tf.random.normal((4096, 1024))
    b = tf.random.normal((1024, 1024))
    matmul = tf.function(lambda: tf.matmul(a, b))
    matmul().numpy()
    walls, cpus = [], []
    for _ in range(7):
        wall, cpu = time.perf_counter(), time.process_time()
        matmul().numpy()
        walls.append(time.perf_counter() - wall)
        cpus.append(time.process_time() - cpu)
    flop = 2 * 4096 * 1024 * 1024 / 1e9
    return flop / statistics.median(walls), flop / statistics.median(cpus)


def measure(rounds: int, iterations: int) -> dict[str, Any]:
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    import numpy as np
    import tensorflow as tf

    tf.config.threading.set_intra_op_parallelism_threads(1)
    tf.config.threading.set_inter_op_parallelism_threads(1)

    import jacobkit as jk
    from jacobkit import runtime
    from jacobkit.testing import examples

    onednn = runtime.cpu_kind().onednn
    example = examples.build("generator", **SIZES)
    kernels = _kernels(tf, example.model, example.inputs, onednn)
    timers = {
        label: _loop_time(tf, fn, iterations) for label, (_, _, fn) in kernels.items()
    }

    def call() -> str:
        result = jk.jacobian(example.model, example.inputs, "conv1", outputs="features")
        np.asarray(result.kernel)
        return str(result.plan).split(":")[0]

    for _ in range(4):  # auto's trials: steady after
        plan = call()
    times: dict[str, list[tuple[float, float]]] = {label: [] for label in timers}
    calls, calls_cpu, rates, rates_cpu = [], [], [], []
    for r in range(rounds):
        for label, timer in timers.items():
            times[label].append(timer())
        wall, cpu = time.perf_counter(), time.process_time()
        call()
        calls.append(time.perf_counter() - wall)
        calls_cpu.append(time.process_time() - cpu)
        rate, rate_cpu = _gemm_rates(tf)
        rates.append(rate)
        rates_cpu.append(rate_cpu)
        print(
            f"round {r}: call {calls[-1]:.2f} s ({calls_cpu[-1]:.2f} CPU), "
            f"probe {rate:.0f} ({rate_cpu:.0f} CPU)",
            flush=True,
        )
    pieces = {}
    for label, (piece, default, _) in kernels.items():
        share = 4 if "4 rows" in label else 1
        seconds = [t / share for t, _ in times[label]]
        seconds_cpu = [c / share for _, c in times[label]]
        flop, nbytes = WORK[piece][1], WORK[piece][2]
        pieces[label] = {
            "piece": piece,
            "default": default,
            "ms": 1e3 * statistics.median(seconds),
            "cpu_ms": 1e3 * statistics.median(seconds_cpu),
            "gflops": statistics.median(flop / t / 1e9 for t in seconds)
            if flop
            else None,
            "of_gemm_rate": statistics.median(
                flop / t / 1e9 / g for t, g in zip(seconds, rates)
            )
            if flop
            else None,
            "of_gemm_rate_cpu": statistics.median(
                flop / t / 1e9 / g for t, g in zip(seconds_cpu, rates_cpu)
            )
            if flop
            else None,
            "gbps": statistics.median(nbytes / t / 1e9 for t in seconds)
            if nbytes
            else None,
            "rounds_s": seconds,
            "rounds_cpu_s": seconds_cpu,
        }
    return {
        "kind": runtime.cpu_kind().describe(),
        "onednn": onednn,
        "plan": plan,
        "gemm_gflops": statistics.median(rates),
        "gemm_probes": rates,
        "gemm_gflops_cpu": statistics.median(rates_cpu),
        "gemm_probes_cpu": rates_cpu,
        "call_s": statistics.median(calls),
        "calls_s": calls,
        "call_cpu_s": statistics.median(calls_cpu),
        "calls_cpu_s": calls_cpu,
        "call_of_gemm_rate": statistics.median(
            AFTER_FLOP / t / 1e9 / g for t, g in zip(calls, rates)
        ),
        "call_of_gemm_rate_cpu": statistics.median(
            AFTER_FLOP / t / 1e9 / g for t, g in zip(calls_cpu, rates_cpu)
        ),
        "work_flop": AFTER_FLOP,
        "rows": ROWS,
        "rounds": rounds,
        "iterations": iterations,
        "pieces": pieces,
    }


def _summary(data: dict[str, Any], cpu: bool) -> str:
    """The limit, the default's pieces, the floor and the call, by wall time
    or by CPU time against the probe timed the same way."""
    key, suffix = ("cpu_ms", "_cpu") if cpu else ("ms", "")
    rate, rows = data["gemm_gflops" + suffix], data["rows"]
    pieces = data["pieces"]
    limit_ms = data["work_flop"] / rows / rate / 1e6
    default_ms = sum(p[key] for p in pieces.values() if p["default"])
    best: dict[str, float] = {}
    for p in pieces.values():
        best[p["piece"]] = min(best.get(p["piece"], float("inf")), p[key])
    floor_ms = sum(best.values())
    call_s = data["call" + suffix + "_s"]
    call_ms = 1e3 * call_s / rows
    return (
        f"By {'CPU' if cpu else 'wall'} time: GEMM probe {rate:.0f} GFLOP/s "
        f"(median). A row's exact work at that rate (the limit): "
        f"{limit_ms:.2f} ms. The default call's pieces summed: "
        f"{default_ms:.2f} ms ({limit_ms / default_ms:.0%} of the rate); the "
        f"fastest kernel of each piece summed (the floor): {floor_ms:.2f} ms "
        f"({limit_ms / floor_ms:.0%}); the default call itself: "
        f"{call_ms:.2f} ms a row ({call_s:.2f} s, "
        f"{data['call_of_gemm_rate' + suffix]:.0%} of its rounds' probes), "
        f"the rest (the loop, the gathers, the forward pass, the head's "
        f"combination) {call_ms - default_ms:.2f} ms a row."
    )


def _markdown(data: dict[str, Any]) -> str:
    row_flop = data["work_flop"] / data["rows"]
    kind = "on" if data["onednn"] else "off"
    lines = [
        f"# The generator's floor, piece by piece (oneDNN {kind})",
        "",
        "`python benchmarks/generator_floor.py` (see its docstring): the users' "
        "wide generator (B=64, T=128, C=16, Conv1D 64/128/128 -> Dense(144)), "
        "the first Conv1D's Jacobian for the 144 features; one core, one "
        f"thread, one process. {data['kind']}. Default call: "
        f"`{data['plan']}`, {data['rows']} rows of "
        f"{row_flop / 1e6:.0f} MFLOP of exact work each. Each piece of a row "
        f"timed alone on its exact shapes ({data['iterations']} iterations "
        "of a `tf.while_loop`, one at a time), every piece, the default call "
        f"and the GEMM probe once a round, {data['rounds']} rounds, medians; "
        "wall time and this process's CPU time, each share against the "
        "probe timed the same way.",
        "",
    ]
    if data.get("loaded"):
        lines += [
            "**Measured under load** (2 cores shared with other work, the "
            f"GEMM probe {min(data['gemm_probes']):.0f}-"
            f"{max(data['gemm_probes']):.0f} GFLOP/s by wall time over the "
            f"rounds, {min(data['gemm_probes_cpu']):.0f}-"
            f"{max(data['gemm_probes_cpu']):.0f} by CPU time, against 133 on "
            "a quiet core): absolute times are inflated; read the shares of "
            "each round's probe and the ratios, the CPU time's first.",
            "",
        ]
    lines += [
        "| piece | kernel | default | ms a row | CPU ms | GFLOP/s | "
        "of the GEMM rate | by CPU time | GB/s |",
        "|---|---|:-:|---:|---:|---:|---:|---:|---:|",
    ]
    for label, p in data["pieces"].items():
        gflops = "" if p["gflops"] is None else f"{p['gflops']:.1f}"
        share = "" if p["of_gemm_rate"] is None else f"{p['of_gemm_rate']:.0%}"
        cpu = p.get("of_gemm_rate_cpu")
        share_cpu = "" if cpu is None else f"{cpu:.0%}"
        gbps = "" if p["gbps"] is None else f"{p['gbps']:.1f}"
        lines.append(
            f"| {WORK[p['piece']][0]} | {label} | {'x' if p['default'] else ''} "
            f"| {p['ms']:.2f} | {p['cpu_ms']:.2f} | {gflops} | {share} "
            f"| {share_cpu} | {gbps} |"
        )
    lines += ["", _summary(data, cpu=True), "", _summary(data, cpu=False), ""]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--iterations", type=int, default=16)
    parser.add_argument("--out", type=Path, default=Path("."))
    parser.add_argument("--loaded", action="store_true")
    parser.add_argument("--render", action="store_true")
    args = parser.parse_args()
    path = args.out / "generator_floor.json"
    if not args.render:
        data = measure(args.rounds, args.iterations)
        data["loaded"] = args.loaded
        args.out.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(data, indent=1) + "\n")
    data = json.loads(path.read_text())
    text = _markdown(data)
    page = path.with_suffix(".md")
    if page.exists():  # the hand-written sections (## headings) kept after it
        kept = page.read_text().split("\n## ", 1)
        if len(kept) == 2:
            text += "\n## " + kept[1]
    page.write_text(text)
    print(text)


if __name__ == "__main__":
    main()
