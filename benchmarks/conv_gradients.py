"""A convolution's input gradient as the forward convolution of the flipped
kernel (:mod:`jacobkit.strategies.gradients`) against TensorFlow's own
``Conv2DBackpropInput``, on the users' wide generator (B=64, T=128, C=16,
Conv1D 64/128/128 -> Dense(144), the first Conv1D's Jacobians for the 144
features), paired in one process.

Each candidate runs on two copies of the model (the same weights): one
traced with jacobkit's rule, one with TensorFlow's own gradient; rounds
alternate them and each reports the median of the per-round ratios (rule /
own), and of each time. ``TF tape.jacobian`` (pfor, TensorFlow's own
gradients) runs beside them as TensorFlow's peer. The GEMM probe of
``mlp_limit.py`` runs in the same process, so each time also reads as a
share of the GEMM rate on the exact work (:data:`WORK_FLOP`).

The rule is jacobkit's default only with oneDNN off; here it is forced on
and off on either kind of kernels, so that both kinds' ratios are measured:

    TF_ENABLE_ONEDNN_OPTS=0 taskset -c 0 python benchmarks/conv_gradients.py \\
        --rounds 5 --out benchmarks/results/cpu
    TF_ENABLE_ONEDNN_OPTS=1 taskset -c 0 python benchmarks/conv_gradients.py \\
        --rounds 5 --out benchmarks/results/cpu

Each run adds its kind's section to ``conv_gradients.json`` and rewrites
``conv_gradients.md`` from it.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

# the repository's root: the suite's problems, this checkout's jacobkit
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.suite.problems import WIDE_GENERATOR  # noqa: E402

#: the suite's wide generator, ``auto``'s headline problem
SIZES = WIDE_GENERATOR
#: rows after the linear head's shortcut (its 128 input channels)
ROWS = SIZES["filters3"]
_POSITIONS = SIZES["batch"] * SIZES["sequence"]
#: multiply-adds of one row: conv3's input gradient (k=3, 128 -> 128), conv2's
#: (k=5, 64 -> 128), conv1's kernel gradient (k=5, 16 -> 64)
ROW_MACS = _POSITIONS * (3 * 128 * 128 + 5 * 64 * 128 + 5 * 16 * 64)
WORK_FLOP = 2 * ROW_MACS * ROWS

#: label -> strategy (``None``: the default call)
CANDIDATES = {
    "default (auto)": None,
    "structured(while)": "structured(while)",
    "structured(batch)": "structured(batch)",
    "structured(chunked(16))": "structured(chunked(16))",
}


def _strategy(spec: str | None) -> Any:
    import jacobkit as jk

    s = jk.strategies
    return {
        None: None,
        "structured(while)": lambda: s.Structured(s.While()),
        "structured(batch)": lambda: s.Structured(s.Batch()),
        "structured(chunked(16))": lambda: s.Structured(s.Chunked(16)),
    }[spec]


def measure(rounds: int, labels: list[str]) -> dict[str, Any]:
    """Every candidate with and without the rule, and TF's peer, alternating
    in each of ``rounds`` rounds (the first call of each left out)."""
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    import numpy as np
    import tensorflow as tf

    tf.config.threading.set_intra_op_parallelism_threads(1)
    tf.config.threading.set_inter_op_parallelism_threads(1)
    import mlp_limit

    import jacobkit as jk
    from jacobkit import runtime
    from jacobkit.strategies import gradients
    from jacobkit.testing import examples

    ruled = {"on": False}
    gradients.rules.replaces = lambda: ruled["on"]  # forced, on either kind
    base = examples.build("generator", **SIZES)
    runs: dict[str, tuple[Any, Any, bool]] = {}
    for label in labels:
        for on in (False, True):
            copy = examples.build("generator", **SIZES)
            copy.model.set_weights(base.model.get_weights())
            runs[f"{label} [{'rule' if on else 'own'}]"] = (copy, label, on)
    peer = examples.build("generator", **SIZES)
    peer.model.set_weights(base.model.get_weights())
    layer = peer.model.get_layer("conv1")

    @tf.function
    def tape_jacobian() -> Any:
        with tf.GradientTape() as tape:
            rows = tf.reduce_sum(peer.model(peer.inputs), axis=(0, 1))
        return tape.jacobian(rows, layer.kernel)

    def call(key: str) -> np.ndarray:
        if key == "TF tape.jacobian (pfor)":
            return np.asarray(tape_jacobian())
        ex, label, on = runs[key]
        ruled["on"] = on
        spec = CANDIDATES[label]
        kwargs = {} if spec is None else {"strategy": _strategy(spec)()}
        result = jk.jacobian(ex.model, ex.inputs, "conv1", outputs="features", **kwargs)
        return np.asarray(result.kernel)

    keys = [*runs, "TF tape.jacobian (pfor)"]
    times: dict[str, list[float]] = {k: [] for k in keys}
    rates: list[float] = []  # the GEMM probe, once a round
    first: dict[str, float] = {}
    found: dict[str, np.ndarray] = {}
    for r in range(rounds + 1):
        for key in keys:
            start = time.perf_counter()
            value = call(key)
            took = time.perf_counter() - start
            if r == 0:
                first[key], found[key] = took, value
            else:
                times[key].append(took)
            print(f"round {r} {key}: {took:.3f} s", flush=True)
        if r:
            rates.append(mlp_limit.gemm_rate())
    reference = found[keys[0]]
    scale = float(np.abs(reference).max())
    rows = {}
    for key in keys:
        steady = statistics.median(times[key])
        rows[key] = {
            "first_s": first[key],
            "steady_s": steady,
            # each round's time against that round's GEMM probe
            "of_gemm_rate": statistics.median(
                WORK_FLOP / t / 1e9 / g for t, g in zip(times[key], rates)
            ),
            "max_rel_diff": float(np.abs(found[key] - reference).max()) / scale,
        }
    for label in labels:
        ratios = [
            a / b for a, b in zip(times[f"{label} [rule]"], times[f"{label} [own]"])
        ]
        rows[f"{label} [rule]"]["ratio_to_own"] = statistics.median(ratios)
        rows[f"{label} [rule]"]["ratios"] = ratios
    return {
        "kind": runtime.cpu_kind().describe(),
        "onednn": runtime.cpu_kind().onednn,
        "gemm_gflops": statistics.median(rates),
        "work_gflop": WORK_FLOP / 1e9,
        "rounds": rounds,
        "rows": rows,
    }


#: the generator's two input gradients: (input channels, output channels,
#: window)
OPS = {"conv3": (128, 128, 3), "conv2": (64, 128, 5)}


def op_rates(rows_at_once: tuple[int, ...] = (1, 4)) -> dict[str, Any]:
    """GFLOP/s of one input gradient of the generator's shapes, ``rows``
    rows stacked on the batch axis, four ways: TensorFlow's
    ``Conv2DBackpropInput``; the forward convolution of the flipped kernel
    (jacobkit's rule); the cotangent's patches (im2col) times the kernel as
    one GEMM; ``k`` shifted GEMMs summed. Each the median of 7 calls, and
    the GEMM probe beside."""
    import mlp_limit
    import tensorflow as tf

    from jacobkit.strategies import gradients

    def rate(fn: Any, macs: int) -> float:
        fn()
        took = []
        for _ in range(7):
            start = time.perf_counter()
            np_value = fn()
            np_value.numpy()
            took.append(time.perf_counter() - start)
        return 2 * macs / statistics.median(took) / 1e9

    found: dict[str, Any] = {"gemm": mlp_limit.gemm_rate()}
    batch, length = SIZES["batch"], SIZES["sequence"]
    for name, (cin, cout, k) in OPS.items():
        for rows in rows_at_once:
            n = rows * batch
            dy = tf.random.normal((n, 1, length, cout))
            w = tf.random.normal((1, k, cin, cout))
            pad = (k - 1) // 2
            unfolded = tf.reshape(
                tf.transpose(tf.reverse(w[0], [0]), (0, 2, 1)), (k * cout, cin)
            )

            def own(dy=dy, w=w, n=n, cin=cin) -> Any:
                return tf.raw_ops.Conv2DBackpropInput(
                    input_sizes=[n, 1, length, cin],
                    filter=w,
                    out_backprop=dy,
                    strides=[1, 1, 1, 1],
                    padding="SAME",
                )

            def rule(dy=dy, w=w, pad=pad, k=k) -> Any:
                return gradients.input_gradient(dy, w, [[0, 0], [pad, k - 1 - pad]])

            def im2col(dy=dy, u=unfolded, pad=pad, k=k, cout=cout) -> Any:
                padded = tf.pad(dy[:, 0], [[0, 0], [pad, k - 1 - pad], [0, 0]])
                cols = tf.concat([padded[:, i : i + length] for i in range(k)], -1)
                return tf.matmul(tf.reshape(cols, (-1, k * cout)), u)

            def shifted(dy=dy, u=unfolded, pad=pad, k=k, cout=cout) -> Any:
                padded = tf.pad(dy[:, 0], [[0, 0], [pad, k - 1 - pad], [0, 0]])
                parts = [
                    tf.matmul(
                        tf.reshape(padded[:, i : i + length], (-1, cout)),
                        u[i * cout : (i + 1) * cout],
                    )
                    for i in range(k)
                ]
                return tf.add_n(parts)

            macs = n * length * k * cin * cout
            found[f"{name} x{rows}"] = {
                label: rate(tf.function(fn, autograph=False), macs)
                for label, fn in (
                    ("Conv2DBackpropInput", own),
                    ("forward conv, flipped kernel", rule),
                    ("im2col + GEMM", im2col),
                    ("k shifted GEMMs", shifted),
                )
            }
    return found


def kind_name(onednn: bool) -> str:
    """A section's name in the results: the kind of convolution kernels."""
    return "onednn on" if onednn else "onednn off"


def save_kind(path: Path, data: dict[str, Any], loaded: bool) -> dict[str, Any]:
    """``data`` (marked ``loaded`` or not) written as its kind's section of
    the JSON file at ``path``, the other kind's kept; every section."""
    path.parent.mkdir(parents=True, exist_ok=True)
    every = json.loads(path.read_text()) if path.exists() else {}
    data["loaded"] = loaded
    every[kind_name(data["onednn"])] = data
    path.write_text(json.dumps(every, indent=1) + "\n")
    return every


def load_note(section: dict[str, Any]) -> str:
    """The sentence a section measured under load carries (else nothing)."""
    if not section.get("loaded"):
        return ""
    return (
        " **Measured under load** (2 cores shared with other work): "
        "absolute times are inflated; read the paired ratios."
    )


def write(out: Path, data: dict[str, Any], loaded: bool) -> None:
    """Add ``data`` to the kind's section of ``conv_gradients.json``; the
    markdown rewritten from every section."""
    every = save_kind(out / "conv_gradients.json", data, loaded)
    lines = [
        "# A convolution's input gradient as a forward convolution",
        "",
        "`python benchmarks/conv_gradients.py` (see its docstring): the users' "
        "wide generator (B=64, T=128, C=16, Conv1D 64/128/128 -> Dense(144)), "
        "the first Conv1D's Jacobians for the 144 features; one core, one "
        "thread, one process: each candidate traced with jacobkit's rule "
        "(`[rule]`) and with TensorFlow's own `Conv2DBackpropInput` "
        "(`[own]`) on two copies of the model, alternating; ratio = median "
        "of the rounds' rule/own. Exact work "
        f"{WORK_FLOP / 1e9:.1f} GFLOP (128 rows after the linear head: "
        "conv3's and conv2's input gradients, conv1's kernel gradient).",
        "",
    ]
    for name, section in sorted(every.items()):
        lines += [
            f"## {name}: {section['kind']}",
            "",
            f"GEMM probe {section['gemm_gflops']:.0f} GFLOP/s (median of "
            "one probe a round; each time's share of the rate is against its "
            f"round's probe); {section['rounds']} rounds." + load_note(section),
            "",
            "| run | steady | first call | of the GEMM rate | rule / own "
            "(paired) | max rel. diff |",
            "|---|---:|---:|---:|---:|---:|",
        ]
        for key, row in section["rows"].items():
            ratio = row.get("ratio_to_own")
            lines.append(
                f"| {key} | {row['steady_s']:.2f} s | {row['first_s']:.2f} s | "
                f"{100 * row['of_gemm_rate']:.0f}% | "
                f"{'' if ratio is None else f'{ratio:.2f}'} | "
                f"{row['max_rel_diff']:.1e} |"
            )
        lines.append("")
        ops = section.get("ops")
        if ops:
            labels = list(next(v for k, v in ops.items() if k != "gemm"))
            lines += [
                f"One input gradient alone (GFLOP/s; GEMM probe {ops['gemm']:.0f}; "
                "`x4`: 4 rows stacked on the batch axis, as pfor stacks them):",
                "",
                "| shape | " + " | ".join(labels) + " |",
                "|---|" + "---:|" * len(labels),
            ]
            for key, row in ops.items():
                if key != "gemm":
                    lines.append(
                        f"| {key} | "
                        + " | ".join(f"{row[x]:.0f}" for x in labels)
                        + " |"
                    )
            lines.append("")
    # the one-channel step's section (``conv_channels.py``), kept after these
    from conv_channels import section

    lines += section(out)
    (out / "conv_gradients.md").write_text("\n".join(lines))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--out", type=Path, default=Path("."))
    parser.add_argument("--only", nargs="*", default=list(CANDIDATES))
    parser.add_argument("--loaded", action="store_true")
    parser.add_argument(
        "--ops-only",
        action="store_true",
        help="only the input gradients' rates, added to the kind's section",
    )
    args = parser.parse_args()
    if args.ops_only:
        os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
        import tensorflow as tf

        tf.config.threading.set_intra_op_parallelism_threads(1)
        tf.config.threading.set_inter_op_parallelism_threads(1)
        from jacobkit import runtime

        path = args.out / "conv_gradients.json"
        every = json.loads(path.read_text()) if path.exists() else {}
        data = every[kind_name(runtime.cpu_kind().onednn)]
        data["ops"] = op_rates()
        return write(args.out, data, data.get("loaded", args.loaded))
    data = measure(args.rounds, args.only)
    write(args.out, data, args.loaded)  # kept if the rates below fail
    data["ops"] = op_rates()
    write(args.out, data, args.loaded)


if __name__ == "__main__":
    main()
