"""Training-data attribution, timed: jacobkit's ``explain.tracin``,
``grad_cos``, ``self_influence`` and ``trak`` against materializing every
example's loss gradient in TensorFlow (``jk.jacobian`` per-example loss rows,
then the products in NumPy), and against PyTorch on identical weights
(``peers/influence_torch.py``: captum's ``TracInCP``, TRAK's ``TRAKer``,
``torch.func.vmap(grad)``).

The setup is notebook 07's: scikit-learn's digits, an MLP of 2,410
parameters, 1,000 training and 100 test examples, 3 checkpoints (TracIn) and
an ensemble of 10 models on random halves (TRAK, 64 dimensions), written by
``peers/export_influence.py``. Every run is a fresh process pinned to one
core, timed by ``peers/protocol.py``: the first call (tracing included) and
its growth of the peak resident memory, the median of ``--repeats`` steady
calls and one steady call's growth; each figure the median over rounds.

    python benchmarks/influence.py --peers-python /path/to/peers/bin/python \\
        --rounds 2 --out benchmarks/results/cpu
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import runs

HERE = Path(__file__).resolve().parent
METHODS = (
    "TF plain step",
    "tracin",
    "grad_cos",
    "self_influence",
    "trak",
    "materialized tracin",
)
#: PyTorch's runs: label -> the peer script's arguments
PEERS = {
    "PyTorch plain step": ["--method", "plain_step"],
    "captum TracInCP": ["--method", "tracin_captum"],
    "captum TracInCP (loop)": ["--method", "tracin_captum", "--captum-grads", "loop"],
    "captum self_influence": ["--method", "self_influence_captum"],
    "TRAK TRAKer (BasicProjector)": ["--method", "trak"],
    "TRAK TRAKer (jacobkit's maps)": ["--method", "trak_jacobkit_maps"],
    "TRAK TRAKer (jacobkit's maps, dense)": [
        "--method",
        "trak_jacobkit_maps_dense",
    ],
    "PyTorch vmap(grad) TracIn": ["--method", "tracin_vmap"],
}


def child(npz: str, method: str, repeats: int) -> None:
    """One run; prints one JSON line."""
    os.environ["TF_CPP_MIN_LOG_LEVEL"] = "3"
    sys.path.insert(0, str(HERE / "peers"))
    import footing
    import keras
    import numpy as np
    import tensorflow as tf
    from protocol import measure, paired

    record = footing.pin_tensorflow("influence")

    import jacobkit as jk
    from jacobkit import explain

    d = np.load(npz)
    train = (d["x_train"], d["y_train"])
    test = (d["x_test"], d["y_test"])

    def models(prefix: str) -> list:
        found = []
        for m in range(d[f"{prefix}_hidden_kernel"].shape[0]):
            model = keras.Sequential(
                [
                    keras.Input((64,)),
                    keras.layers.Dense(32, activation="relu", name="hidden"),
                    keras.layers.Dense(10, name="logits"),
                ]
            )
            model.set_weights(
                [
                    d[f"{prefix}_{layer}_{part}"][m]
                    for layer in ("hidden", "logits")
                    for part in ("kernel", "bias")
                ]
            )
            found.append(model)
        return found

    checkpoints, ensemble = models("checkpoint"), models("ensemble")
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction=None)
    rows = jk.Loss(loss)
    want = None

    def plain_step():  # noqa: ANN202 - a call returning arrays
        # the first checkpoint's summed-loss gradient over the 1,000 training
        # examples, one tf.function taking the batch as its argument
        model, variables = checkpoints[0], checkpoints[0].trainable_variables

        @tf.function
        def step(x, y):
            with tf.GradientTape() as tape:
                total = tf.reduce_sum(loss(y, model(x)))
            return tape.gradient(total, variables)

        return lambda: [tf.convert_to_tensor(g).numpy() for g in step(*train)]

    if method == "TF plain step":
        call = plain_step()
    elif method == "tracin":

        def call():
            return explain.tracin(checkpoints, train, test, loss=loss).scores

        want = d["tracin"]
    elif method == "grad_cos":

        def call():
            return explain.grad_cos(checkpoints, train, test, loss=loss).scores
    elif method == "self_influence":

        def call():
            return explain.self_influence(checkpoints, train, loss=loss)

        want = d["self_influence"]
    elif method == "trak":

        def call():
            return explain.trak(ensemble, train, test, dim=int(d["dim"])).scores

        want = d["trak"]
    elif method == "materialized tracin":

        def flat(model, data):
            found = jk.jacobian(model, data, model.trainable_variables, outputs=rows)
            return np.concatenate(
                [np.asarray(v).reshape(len(data[1]), -1) for v in found.values()], 1
            )

        def call():
            return sum(flat(m, test) @ flat(m, train).T for m in checkpoints)

        want = d["tracin"]
    else:
        raise SystemExit(f"unknown method {method!r}")
    timings, result = measure(call, repeats)
    if method != "TF plain step":
        # against TensorFlow's own plain step, alternating in this process
        timings["paired"] = paired(call, plain_step())
    scores = 0 if method == "TF plain step" else int(np.asarray(result).size)
    row = {**timings, "scores_per_s": scores / timings["steady_s"], "footing": record}
    if want is not None:
        row["error"] = float(np.abs(result - want).max() / np.abs(want).max())
        row["agreement"] = row.pop("error")
    print(json.dumps(row))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--child", nargs=2, metavar=("NPZ", "METHOD"))
    parser.add_argument("--peers-python")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", default="benchmarks/results/cpu")
    parser.add_argument(
        "--loaded",
        action="store_true",
        help="label the results as measured on a machine loaded by other work",
    )
    args = parser.parse_args()
    if args.child:
        return child(*args.child, args.repeats)
    work = Path(tempfile.mkdtemp())
    npz = str(work / "influence.npz")
    subprocess.run(
        [sys.executable, str(HERE / "peers" / "export_influence.py"), "--out", npz],
        check=True,
        capture_output=True,
    )
    me = [sys.executable, str(Path(__file__).resolve())]
    repeats = ["--repeats", str(args.repeats)]
    commands = {m: [*me, "--child", npz, m, *repeats] for m in METHODS}
    if args.peers_python:
        script = str(HERE / "peers" / "influence_torch.py")
        for label, extra in PEERS.items():
            commands[label] = [
                args.peers_python,
                script,
                "--npz",
                npz,
                *repeats,
                *extra,
            ]
    data = {
        "machine": runs.machine(),
        "loaded": args.loaded,
        "rounds": args.rounds,
        "repeats": args.repeats,
        "runs": runs.rounds(commands, args.rounds),
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "influence.json").write_text(json.dumps(data, indent=1))
    (out / "influence.md").write_text(_markdown(data))
    print(_markdown(data))


def _ratio(row: dict, base: float | None) -> float | None:
    """A run's ratio to its own plain step: paired in its process where it
    was, else of the separate processes' medians."""
    if row.get("paired"):
        return float(row["paired"]["ratio"])
    return row["steady_s"] / base if base and "steady_s" in row else None


def _markdown(data: dict) -> str:
    sys.path.insert(0, str(HERE / "peers"))
    import footing

    measured = data["runs"]
    lines = [
        "# Training-data attribution: jacobkit, materializing, PyTorch",
        "",
        "Written by `benchmarks/influence.py`: notebook 07's digits MLP (2,410 "
        "parameters), 100 test x 1,000 training examples, 3 checkpoints "
        "(TracIn, Grad-Cos, self-influence; self-influence scores 1,000 "
        "examples) and 10 ensemble models (TRAK, 64 dimensions); fresh "
        "processes, median of "
        f"{data['rounds']} rounds of {data['repeats']} steady calls.",
        "",
        "Each side on equal footing: one thread each, every process pinned to "
        "one core (the scripts refuse to run unpinned), and each run divided "
        "by **its own framework's plain step** (the first checkpoint's "
        "summed-loss gradient over the 1,000 training examples: one forward "
        "and one backward pass), in separate processes and, robust to a busy "
        "machine, paired in one process (the median ratio over rounds that "
        "time either side alternately, with its 95% bootstrap interval). "
        "`× jacobkit` compares those ratios (paired where measured): a "
        "PyTorch run's plain steps over jacobkit's. `TRAKer (jacobkit's "
        "maps)` projects by the maps jacobkit drew (exported with the "
        "weights), each CountSketch by `index_add_` (one add per coordinate, "
        "as jacobkit) or, `dense`, by a matmul of the matrix it stands for; "
        "the peer is the faster correct one (named below the table).",
        "",
    ]
    lines += footing.machine_lines(data, measured)
    lines += [
        "| run | steady ms | × own plain step | paired in one process (95% "
        "interval) | × jacobkit (in own plain steps) | "
        "scores/s | first call s | first 3 calls s | steady growth MiB | "
        "first-call growth MiB | agreement with jacobkit |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    ours = {
        "captum TracInCP": "tracin",
        "captum TracInCP (loop)": "tracin",
        "PyTorch vmap(grad) TracIn": "tracin",
        "materialized tracin": "tracin",
        "captum self_influence": "self_influence",
        "TRAK TRAKer (BasicProjector)": "trak",
        "TRAK TRAKer (jacobkit's maps)": "trak",
        "TRAK TRAKer (jacobkit's maps, dense)": "trak",
    }
    plain = {
        "tensorflow": measured.get("TF plain step", {}).get("steady_s"),
        "torch": measured.get("PyTorch plain step", {}).get("steady_s"),
    }
    for key, row in measured.items():
        if "error" in row:
            lines.append(f"| {key} | error: {row['error']} | | | | | | | | | |")
            continue
        side = "torch" if key in PEERS else "tensorflow"
        base = plain[side]
        own = row["steady_s"] / base if base else None
        versus = ""
        twin = measured.get(ours.get(key, ""), {})
        mine, theirs = _ratio(row, base), _ratio(twin, plain["tensorflow"])
        if mine and theirs:
            versus = f"{mine / theirs:.2f}"
        found = row.get("paired")
        pair = (
            f"{found['ratio']:.2f} ({found['low']:.2f}–{found['high']:.2f})"
            if found
            else ""
        )
        # jacobkit's own runs are compared with the exported reference, its
        # own numbers: only the materializing run's agreement says anything
        agreement = row.get("agreement") if key == "materialized tracin" else None
        if agreement is None:
            for name in ("tracin_err", "self_influence_err", "trak_err", "spearman"):
                if name in row:
                    agreement = f"{name} {row[name]:.3g}"
                    break
        elif isinstance(agreement, float):
            agreement = f"{agreement:.2g}"
        scores = f"{row['scores_per_s']:,.0f}" if row.get("scores_per_s") else ""
        lines.append(
            f"| {key} | {row['steady_s'] * 1e3:.1f} | "
            f"{'' if own is None else f'{own:.2f}'} | {pair} | {versus} | {scores} | "
            f"{row['first_s']:.2f} | {row['first_three_s']:.2f} | "
            f"{row['peak_growth_mib']:.1f} | "
            f"{row.get('first_growth_mib', float('nan')):.1f} | {agreement or ''} |"
        )
    lines += _fastest_maps(measured, plain["torch"])
    return "\n".join(lines) + "\n"


#: TRAKer with jacobkit's maps: each way of applying a CountSketch
MAPS = {
    "TRAK TRAKer (jacobkit's maps)": "index_add_",
    "TRAK TRAKer (jacobkit's maps, dense)": "dense matmul",
}


def _fastest_maps(measured: dict, base: float | None) -> list[str]:
    """Which way of applying jacobkit's maps the comparison takes as the
    peer: the faster of those whose scores matched jacobkit's (a way that
    disagreed or failed printed no timing)."""
    good = {
        label: found
        for label in MAPS
        if "error" not in measured.get(label, {"error": None})
        and (found := _ratio(measured[label], base)) is not None
    }
    if not good:
        return []
    best = min(good, key=good.__getitem__)
    shown = ", ".join(f"{MAPS[label]} {r:.2f}" for label, r in good.items())
    return [
        "",
        f"TRAKer with jacobkit's maps, its fastest correct way here: "
        f"{MAPS[best]} ({good[best]:.2f} × PyTorch's plain step; {shown}).",
    ]


if __name__ == "__main__":
    main()
