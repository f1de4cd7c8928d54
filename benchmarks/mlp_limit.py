"""The MLP at the FLOP limit: jacobkit's strategies against TensorFlow's own
``tape.jacobian``, PyTorch and JAX on the benchmark MLP (Dense 512→1024 relu
→ 1024 tanh → 144, B=256, every feature's gradient summed over the batch
with respect to the first Dense: a 288 MiB result).

Every TensorFlow run returns its result as NumPy views of the tensors
(``np.asarray``, no copy), as PyTorch's runs return their tensors and JAX's
its arrays: ``Tensor.numpy()`` copies, and ``batch``'s call with that copy
of the 288 MiB result took 1.19x its least CPU time with a view (paired in
one process, 9 rounds, oneDNN off, malloc, loaded; 1.65x the median of the
rounds' ratios), and its 288 MiB counted in every TensorFlow run's resident
growth (``batch``'s steady call: 685 MiB with the copy, 432 MiB without, one
loaded round each).

Every run is a fresh process pinned to one core (``taskset -c 0``), with the
same weights (``peers/export_mlp.py``): the first call (tracing included),
the median of the next ``--repeats`` calls (5; ``auto`` tries its other
candidates on some of them, and has no plan from an earlier process), and
the growth of the process's peak resident memory during the first call and
during one steady call (with the previous result freed;
``peers/memory.py``). Rounds alternate the runs, and
each figure is the median over rounds. The GEMM rate of the machine is
probed the same way, so each time also reads as a fraction of the limit
(the FLOPs every method must do, at that rate).

    python benchmarks/mlp_limit.py --peers-python /path/to/peers/bin/python \\
        --rounds 3 --out benchmarks/results/cpu

Without ``--peers-python`` only TensorFlow and jacobkit run. PyTorch and JAX
are not dependencies of jacobkit: ``peers/README.md`` says how to make their
environment.
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

import runs
from runs import CORE

HERE = Path(__file__).resolve().parent
SIZES = {"batch": 256, "inputs": 512, "hidden": 1024, "features": 144}
#: MACs of one row: the backward pass through the head and hidden2 at B=256,
#: and the contraction with hidden1's input (the head's is F x smaller)
ROW_MACS = SIZES["batch"] * (
    SIZES["hidden"] * SIZES["hidden"] + SIZES["inputs"] * SIZES["hidden"]
)
FLOPS = 2 * ROW_MACS * SIZES["features"]
RESULT_MIB = SIZES["features"] * (SIZES["inputs"] + 1) * SIZES["hidden"] * 4 / 2**20

#: jacobkit's runs: label -> strategy argument (None: the default call)
#: (``jacobian`` is left out: it is ``tape.jacobian`` with jacobkit's
#: checks, within noise of it in a first sweep)
JACOBKIT = {
    "jacobkit default (auto)": None,
    "jacobkit batch": "batch",
    "jacobkit chunked(144)": "chunked",
    "jacobkit while": "while",
    "TF tape.jacobian (pfor)": "tape.jacobian",
}
#: each peer framework's GEMM probe: the table's name -> ``gemm_probe.py``'s
PEER_FRAMEWORKS = {"PyTorch": "torch", "JAX": "jax"}
#: the peers' best settings from a first sweep (chunk sizes 4, 8, 16 and 36
#: for PyTorch, 8 and 16 for JAX; one core): 16 and 36 were slower
PEERS = {
    "PyTorch jacrev(chunk_size=4)": ["mlp_torch.py", "--chunk-size", "4"],
    "PyTorch jacrev(chunk_size=8)": ["mlp_torch.py", "--chunk-size", "8"],
    "PyTorch loop of autograd.grad": ["mlp_torch.py", "--method", "loop"],
    "JAX lax.map(vjp, batch_size=8)": ["mlp_jax.py", "--batch-size", "8"],
}


def child(strategy: str, weights: str, repeats: int) -> None:
    """One jacobkit (or raw TensorFlow) run; prints one JSON line."""
    os.environ["TF_CPP_MIN_LOG_LEVEL"] = "3"
    sys.path.insert(0, str(HERE / "peers"))
    import footing
    import numpy as np
    import tensorflow as tf
    from protocol import measure

    import jacobkit as jk
    from jacobkit.testing import example_models

    record = footing.pin_tensorflow("mlp_limit")

    example = example_models.mlp(**SIZES)
    model, x = example.model, example.inputs
    layer = model.get_layer("hidden1")

    if strategy == "tape.jacobian":

        @tf.function
        def jacobian() -> list[tf.Tensor]:
            with tf.GradientTape() as tape:
                rows = tf.reduce_sum(model(x), axis=0)
            return tape.jacobian(rows, [layer.kernel, layer.bias])

        def call() -> list[tf.Tensor]:
            return [np.asarray(t) for t in jacobian()]
    else:
        kwargs = {} if strategy == "auto" else {"strategy": strategy}
        plans = []
        #: what each call ran (auto: the strategy of its last run)
        each: list[str] = []

        def call() -> list[tf.Tensor]:
            result = jk.jacobian(model, x, "hidden1", **kwargs)
            plans[:] = [result.plan]
            plan = result.plan
            each.append(plan.last_call[-1].strategy.label if plan else strategy)
            return [np.asarray(result.kernel), np.asarray(result.bias)]

        def settled() -> bool:
            return plans[0] is None or plans[0].settled

    if os.environ.get("TF_CPU_ALLOCATOR_USE_BFC") == "true":
        # TensorFlow's own count of the bytes it allocated (pooled allocator)
        result = call()
        del result
        tf.config.experimental.reset_memory_stats("CPU:0")
        base = tf.config.experimental.get_memory_info("CPU:0")["current"]
        result = call()
        peak = tf.config.experimental.get_memory_info("CPU:0")["peak"] - base
        del result
        # the steady time under the pooled allocator (jacobkit's default
        # where it is imported before TensorFlow starts): no fresh pages for
        # each call's result, which glibc's malloc maps anew above 32 MiB
        timings, _ = measure(
            call, repeats, settled=lambda: strategy == "tape.jacobian" or settled()
        )
        return print(
            json.dumps(
                {
                    "allocator_peak_mib": peak / 2**20,
                    "pooled_steady_s": timings["steady_s"],
                }
            )
        )
    # auto tries its other candidates on later calls: steady is after it
    # settled
    timings, result = measure(
        call, repeats, settled=lambda: strategy == "tape.jacobian" or settled()
    )
    np.save(weights + f".{os.getpid()}.npy", result[0])
    ran = {}
    if strategy == "auto" and plans[0] is not None:
        # what auto runs after its tries, and the switches it made
        # the steady calls' own strategies (and the peak call's): a try
        # among them would make the steady time not the kept strategy's
        ran = {
            "ran": plans[0].strategy.label,
            "settled": plans[0].settled,
            "calls": len(each),
            "steady_ran": sorted(set(each[-(repeats + 1) :])),
            "switches": [str(s) for s in plans[0].switches],
        }
    print(
        json.dumps(
            {
                **timings,
                **ran,
                "kernel": weights + f".{os.getpid()}.npy",
                "footing": record,
            }
        )
    )


def gemm_rate() -> float:
    """GFLOP/s of one (4096 x 1024) @ (1024 x 1024) float32 matmul."""
    import numpy as np
    import tensorflow as tf

    a = tf.random.normal((4096, 1024))
    b = tf.random.normal((1024, 1024))
    matmul = tf.function(lambda: tf.matmul(a, b))
    np.asarray(matmul())
    times = []
    for _ in range(7):
        start = time.perf_counter()
        np.asarray(matmul())
        times.append(time.perf_counter() - start)
    return 2 * 4096 * 1024 * 1024 / statistics.median(times) / 1e9


def _pinned(command: list[str]) -> list[str]:
    return runs.pinned(command)


def _run(command: list[str], env: dict[str, str]) -> dict:
    out = subprocess.run(
        _pinned(command), capture_output=True, text=True, env=env, check=False
    )
    lines = [line for line in out.stdout.splitlines() if line.startswith("{")]
    if out.returncode or not lines:
        return {"error": (out.stderr or out.stdout).strip().splitlines()[-1:]}
    return json.loads(lines[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--peers-python", help="the peers' environment's python")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", type=Path, default=Path("."))
    parser.add_argument("--loaded", action="store_true")
    parser.add_argument(
        "--only",
        nargs="+",
        metavar="WORD",
        help="run only the runs whose label contains one of these words "
        "(e.g. --only auto batch 'jacobkit while'); the GEMM probe always runs",
    )
    parser.add_argument(
        "--probes-only",
        action="store_true",
        help="rerun each framework's GEMM probe only (--rounds), keeping "
        "--out's timings",
    )
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--weights", help=argparse.SUPPRESS)
    parser.add_argument("--gemm", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        return child(args.child, args.weights, args.repeats)
    if args.gemm:
        return print(json.dumps({"gflops": gemm_rate()}))
    if args.probes_only:
        return _probes_only(args)

    work = Path(tempfile.mkdtemp())
    weights = str(work / "mlp.npz")
    subprocess.run(
        [sys.executable, str(HERE / "peers" / "export_mlp.py"), "--out", weights],
        check=True,
        capture_output=True,
    )
    # TensorFlow's default CPU allocator (jacobkit turns the pooled one on
    # where the variable is unset)
    env = {**os.environ, "TF_CPU_ALLOCATOR_USE_BFC": "false"}
    env["TF_CPP_MIN_LOG_LEVEL"] = "3"
    # no plan from an earlier process: every run starts cold, as a new
    # user's first process does
    env["JACOBKIT_CACHE_DIR"] = ""
    runs = {
        label: [sys.executable, __file__, "--child", strategy or "auto"]
        + ["--weights", weights, "--repeats", str(args.repeats)]
        for label, strategy in JACOBKIT.items()
    }
    if args.peers_python:
        for label, (script, *flags) in PEERS.items():
            runs[label] = [args.peers_python, str(HERE / "peers" / script), *flags]
            runs[label] += ["--weights", weights, "--repeats", str(args.repeats)]
            runs[label] += ["--save", str(work / f"{len(runs)}.npy")]
    if args.only:
        runs = {k: v for k, v in runs.items() if any(w in k for w in args.only)}
    rates, rounds = [], {label: [] for label in runs}
    peer_rates: dict[str, list[float]] = {}
    for round_ in range(args.rounds):
        rates.append(_run([sys.executable, __file__, "--gemm"], env)["gflops"])
        _peer_probes(args.peers_python, env, peer_rates)
        for label, command in runs.items():
            result = _run(command, env)
            if label in JACOBKIT and "error" not in result:
                pooled = {**env, "TF_CPU_ALLOCATOR_USE_BFC": "true"}
                result.update(_run(command, pooled))
            rounds[label].append(result)
            print(f"round {round_ + 1}: {label}: {result}", flush=True)
    _report(rounds, runs, statistics.median(rates), work, args.out, args.loaded)
    _with_peer_rates(args.out, peer_rates)
    shutil.rmtree(work, ignore_errors=True)


def _peer_probes(
    python: str | None, env: dict[str, str], found: dict[str, list[float]]
) -> None:
    """One GEMM probe of each peer framework's own (``peers/gemm_probe.py``)
    into ``found``, where the peers' environment is given."""
    if not python:
        return
    for name, framework in PEER_FRAMEWORKS.items():
        command = [python, str(HERE / "peers" / "gemm_probe.py")]
        probe = _run([*command, "--framework", framework], env)
        if "gflops" in probe:
            found.setdefault(name, []).append(probe["gflops"])


def _with_peer_rates(out: Path, peer_rates: dict[str, list[float]]) -> None:
    """``out``'s table with each peer framework's median GEMM probe and every
    peer run's share of its own framework's limit."""
    if not peer_rates:
        return
    path = out / "mlp_limit.json"
    data = json.loads(path.read_text())
    data["peer_gemm_gflops"] = {
        name: statistics.median(rates) for name, rates in peer_rates.items()
    }
    path.write_text(json.dumps(data, indent=2) + "\n")
    (out / "mlp_limit.md").write_text(_markdown(data))


def _probes_only(args: argparse.Namespace) -> None:
    """Each framework's GEMM probe alone, ``--rounds`` times alternating;
    ``--out``'s timings kept, its limit moved to this run's TensorFlow
    probe only where none was recorded."""
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3"}
    rates: list[float] = []
    peer_rates: dict[str, list[float]] = {}
    for _ in range(args.rounds):
        rates.append(_run([sys.executable, __file__, "--gemm"], env)["gflops"])
        _peer_probes(args.peers_python, env, peer_rates)
    print(f"TensorFlow {statistics.median(rates):.0f} GFLOP/s (limit kept)")
    _with_peer_rates(args.out, peer_rates)
    print((args.out / "mlp_limit.md").read_text())


def _agreement(rounds: dict, runs: dict, work: Path) -> dict[str, float]:
    """Max |kernel - reference| / max |reference| against the float64 loop."""
    import numpy as np

    from jacobkit.testing import example_models, reference_jacobian

    example = example_models.mlp("float64", **SIZES)
    layer = example.model.get_layer("hidden1")
    reference = reference_jacobian(
        example.model, example.inputs, [layer.kernel, layer.bias]
    )[0]
    scale = np.abs(reference).max()
    out = {}
    for label, results in rounds.items():
        path = next((r.get("kernel") for r in results if "kernel" in r), None)
        if path is None and "--save" in runs[label]:
            path = runs[label][runs[label].index("--save") + 1]
        if path and Path(path).exists():
            out[label] = float(np.abs(np.load(path) - reference).max() / scale)
    return out


def _report(
    rounds: dict, runs: dict, rate: float, work: Path, out: Path, loaded: bool
) -> None:
    limit_s = FLOPS / rate / 1e9
    agreement = _agreement(rounds, runs, work)
    rows = {}
    for label, results in rounds.items():
        good = [r for r in results if "error" not in r]
        if not good:
            rows[label] = {"error": results[-1]["error"]}
            continue
        rows[label] = {
            key: statistics.median(r[key] for r in good)
            for key in (
                "first_s",
                "first_three_s",
                "steady_s",
                "first_growth_mib",
                "peak_growth_mib",
            )
        }
        pooled = [r["allocator_peak_mib"] for r in good if "allocator_peak_mib" in r]
        if pooled:
            rows[label]["allocator_peak_mib"] = statistics.median(pooled)
        pooled_s = [r["pooled_steady_s"] for r in good if "pooled_steady_s" in r]
        if pooled_s:
            rows[label]["pooled_steady_s"] = statistics.median(pooled_s)
        rows[label]["of_limit"] = limit_s / rows[label]["steady_s"]
        ran = [r["ran"] for r in good if "ran" in r]
        if ran:
            rows[label]["ran"] = ", ".join(sorted(set(ran)))
        steady = sorted({s for r in good for s in r.get("steady_ran", ())})
        if len(steady) > 1:  # a try among the steady calls: not steady
            rows[label]["steady_ran"] = steady
        rows[label]["agreement"] = agreement.get(label)
    out.mkdir(parents=True, exist_ok=True)
    data = {
        "gemm_gflops": rate,
        "flops": FLOPS,
        "limit_s": limit_s,
        "result_mib": RESULT_MIB,
        "rounds": len(next(iter(rounds.values()))),
        "onednn": os.environ.get("TF_ENABLE_ONEDNN_OPTS") != "0",
        "core": CORE,
        "loaded": loaded,
        "rows": rows,
    }
    (out / "mlp_limit.json").write_text(json.dumps(data, indent=2) + "\n")
    (out / "mlp_limit.md").write_text(_markdown(data))
    print(_markdown(data))


def _markdown(data: dict) -> str:
    lines = [
        "# The MLP at the FLOP limit",
        "",
        "`python benchmarks/mlp_limit.py` (see its docstring): Dense "
        "512→1024→1024→144, B=256, target the first Dense, rows summed over "
        f"the batch; result {data['result_mib']:.0f} MiB. One core per run "
        f"(`taskset -c {data.get('core', 0)}`), fresh processes, median of "
        f"{data['rounds']} "
        f"alternating rounds. GEMM probe: {data['gemm_gflops']:.0f} GFLOP/s, "
        f"so the {data['flops'] / 1e9:.0f} GFLOP every method must do take "
        f"at least {data['limit_s']:.2f} s (the limit). TensorFlow's oneDNN "
        f"{'on' if data.get('onednn', True) else 'off'} (PyTorch and JAX do "
        "not read its switch)."
        + (
            " **Measured under load** (2 cores shared with other work): "
            "absolute times are inflated; compare runs of this table."
            if data.get("loaded")
            else ""
        ),
        *_peer_rate_lines(data),
        "",
        "Peak growth: how much the process's peak resident memory grew during "
        "one steady call (the previous result freed and the heap trimmed "
        "first), the same measure for every framework. TensorFlow keeps "
        "memory it freed for reuse even with its default allocator (every "
        "TensorFlow run reads about the result's size there), so for "
        "TensorFlow the exact figure is its own allocator's peak (its pooled "
        "allocator, in a separate process), given beside it. PyTorch's and "
        "JAX's resident growth is the comparable figure for them.",
        "",
        "Steady, pooled: the steady time of the separate process that runs "
        "TensorFlow's pooled allocator (jacobkit's default where it is "
        "imported before TensorFlow starts), and its share of the limit. "
        "Under glibc's malloc every call maps its result's pages afresh (an "
        "allocation over 32 MiB is always a new mapping: 74k page faults for "
        "this result); with oneDNN on TensorFlow's CPU allocator pools "
        "large blocks itself, so the two kinds' first columns differ there.",
        "",
        "| run | steady | first call | first 3 calls | of the limit "
        "| steady, pooled | peak growth, steady call | TF allocator peak "
        "| peak growth, first call | max rel. diff vs float64 |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for label, row in data["rows"].items():
        if "error" in row:
            lines.append(
                f"| {label} | failed: {' '.join(row['error'])} | | | | | | | | |"
            )
            continue
        diff = row["agreement"]
        ran = f" → {row['ran']}" if row.get("ran") else ""
        if row.get("steady_ran"):
            ran += f" (steady calls ran {', '.join(row['steady_ran'])})"
        lines.append(
            f"| {label}{ran} | {row['steady_s']:.2f} s | {row['first_s']:.2f} s "
            f"| {row['first_three_s']:.2f} s "
            f"| {row['of_limit']:.0%}{_own_limit(label, row, data)} "
            f"| {_pooled_steady(row, data['limit_s'])} "
            f"| {row['peak_growth_mib']:.0f} MiB "
            f"({row['peak_growth_mib'] / data['result_mib']:.2f}× result) "
            f"| {_pooled(row, data['result_mib'])} "
            f"| {row['first_growth_mib']:.0f} MiB "
            f"| {'' if diff is None else f'{diff:.1e}'} |"
        )
    lines += [
        "",
        "PyTorch and JAX differ from float64 at one hidden unit only: for one "
        "example its pre-activation is 4.5e-8, within float32 rounding of "
        "ReLU's kink, and their forward pass rounds it to the other side "
        "(the same weights; excluding that unit they agree to 6e-7).",
    ]
    return "\n".join(lines) + "\n"


def _peer_rate_lines(data: dict) -> list[str]:
    rates = data.get("peer_gemm_gflops")
    if not rates:
        return []
    each = ", ".join(f"{name} {rate:.0f}" for name, rate in rates.items())
    return [
        "",
        "Each peer framework's own GEMM probe (the same product, one thread, "
        f"`peers/gemm_probe.py`): {each} GFLOP/s, against TensorFlow's "
        f"{data['gemm_gflops']:.0f}. A peer's share of its own framework's "
        "limit is in brackets: how far its Jacobian method is from its own "
        "library's products, apart from how fast those are on this CPU.",
    ]


def _own_limit(label: str, row: dict, data: dict) -> str:
    """`` (own: 71%)`` for a peer's run where its framework's GEMM rate was
    probed."""
    rates = data.get("peer_gemm_gflops", {})
    name = next((n for n in rates if label.startswith(n)), None)
    if name is None:
        return ""
    own_limit_s = data["flops"] / rates[name] / 1e9
    return f" ({own_limit_s / row['steady_s']:.0%} of own)"


def _pooled_steady(row: dict, limit_s: float) -> str:
    steady = row.get("pooled_steady_s")
    if steady is None:
        return ""
    return f"{steady:.2f} s ({limit_s / steady:.0%})"


def _pooled(row: dict, result_mib: float) -> str:
    peak = row.get("allocator_peak_mib")
    if peak is None:
        return ""
    return f"{peak:.0f} MiB ({peak / result_mib:.2f}×)"


if __name__ == "__main__":
    main()
