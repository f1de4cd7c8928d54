"""Every generated token of a language model attributed to every earlier
token: jacobkit's one call (``explain.token_attribution``) against the
per-target loop (captum's semantics: one backward pass per generated token)
in TensorFlow, and against captum / PyTorch on a GPT-2 with identical
weights (``peers/tokens_torch.py``).

The setting is the issue's: a tiny keras_hub GPT-2 (2 layers, hidden 64,
vocabulary 1,000, random init), one prompt of 64 tokens and 32 greedily
generated ones; each of the 32 generated tokens' log-probability is
attributed to the 95 tokens before it (gradient and gradient x input at the
token embeddings). ``jacobkit`` is the default call (``auto``, which starts
on ``while`` and tries the vectorized ``chunked`` only once the calls have
paid for its tracing); ``strategy='chunked'`` names it from the first call.
The default calls run under a stated ``memory_budget`` (:data:`BUDGET`).
The per-target loop runs compiled (``tf.function``, its fastest) and eager
(a loop of ``GradientTape`` calls, as captum's PyTorch loop runs). Every run
is a fresh process pinned to one core with one thread on either side
(``peers/footing.py``), timed by ``peers/protocol.py``; each figure is the
median over rounds, and each run is divided by its own framework's plain
step (``TF plain step``, ``PyTorch plain step``: the gradient of the summed
next-token loss over every weight on the same 96 tokens). PyTorch's peer is
batched as jacobkit is (``tokens_torch.py --method torch_batched``: one
forward pass, the 32 backward passes batched by ``vmap``); its per-target
loops are extras.

    python benchmarks/token_attribution.py --peers-python /path/to/peers/bin/python \\
        --rounds 2 --out benchmarks/results/cpu

``--auto`` measures ``auto`` against each fixed strategy that runs here
instead, paired in one process (:func:`paired_child`), once with oneDNN's
kernels and once with ``TF_ENABLE_ONEDNN_OPTS=0`` (a separate process);
it writes the section "auto against each fixed strategy" of the same page
and ``token_attribution_auto.json``::

    python benchmarks/token_attribution.py --auto --rounds 7 \\
        --out benchmarks/results/cpu
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import model_configs
import runs

HERE = Path(__file__).resolve().parent
PROMPT, NEW = 64, 32
#: the stated memory budget of jacobkit's default calls (auto keeps its
#: predicted peak under it)
BUDGET = "256MiB"
METHODS = (
    "TF plain step",
    "jacobkit",
    "jacobkit gradient_x_input",
    "jacobkit strategy='chunked'",
    "TF per-target loop",
    "TF per-target loop, eager",
)
#: PyTorch's runs: label -> the peer script's arguments. The batched run is
#: the peer (jacobkit's work: one forward pass, one batched backward pass);
#: the per-target loops (captum's semantics) are extras, labelled so
PEERS = {
    "PyTorch plain step": ["--method", "plain_step"],
    "PyTorch batched (one pass, vmap'd backward)": ["--method", "torch_batched"],
    "extra: captum, per target": ["--method", "captum_gradient"],
    "extra: captum gradient x input, per target": [
        "--method",
        "captum_gradient_x_input",
    ],
    "extra: PyTorch per-target loop": ["--method", "torch_loop"],
}
#: each framework's own plain step, which its runs are divided by
PLAIN = {"tensorflow": "TF plain step", "torch": "PyTorch plain step"}


def build() -> tuple:
    """The model, the 96 tokens and the 32 targets' rows."""
    import keras
    import keras_hub
    import numpy as np

    keras.utils.set_random_seed(0)
    backbone = keras_hub.models.GPT2Backbone(**model_configs.GPT2)
    model = keras_hub.models.GPT2CausalLM(backbone, preprocessor=None)
    tokens = np.random.default_rng(0).integers(1, 1000, (1, PROMPT)).astype("int32")
    # greedy decoding, as explain.generate_and_attribute does, without its
    # attribution: the timed first call must be the first to trace
    for _ in range(NEW):
        x = {"token_ids": tokens, "padding_mask": np.ones_like(tokens)}
        following = np.argmax(np.asarray(model(x))[:, -1], axis=-1)
        tokens = np.concatenate([tokens, following[:, None].astype("int32")], 1)
    return model, tokens


def plain_step(model, tokens):  # noqa: ANN001, ANN201 - Keras, NumPy
    """The gradient of the summed next-token loss over every variable on
    the same 96 tokens, one ``tf.function`` taking the batch as its argument
    (a Keras train step's work, without the update), fetched as arrays."""
    import tensorflow as tf

    variables = model.trainable_variables
    ids, labels = tf.constant(tokens[:, :-1]), tf.constant(tokens[:, 1:])

    @tf.function
    def step(ids, labels):
        with tf.GradientTape() as tape:
            inputs = {"token_ids": ids, "padding_mask": tf.ones_like(ids)}
            logits = model(inputs)
            total = tf.reduce_sum(
                tf.nn.sparse_softmax_cross_entropy_with_logits(labels, logits)
            )
        return tape.gradient(total, variables)

    def call() -> list:
        return [tf.convert_to_tensor(g).numpy() for g in step(ids, labels)]

    return call


def child(method: str, repeats: int) -> None:
    """One run; prints one JSON line."""
    os.environ["TF_CPP_MIN_LOG_LEVEL"] = "3"
    sys.path.insert(0, str(HERE / "peers"))
    import footing
    import numpy as np
    import tensorflow as tf
    from protocol import measure, paired

    from jacobkit import explain
    from jacobkit.keras import graph
    from jacobkit.testing.reference_targets import watched_output

    record = footing.pin_tensorflow("token_attribution")
    model, tokens = build()
    x = {"token_ids": tokens, "padding_mask": np.ones_like(tokens)}
    targets = np.concatenate([tokens[:, 1:], tokens[:, -1:]], axis=1)
    rows = slice(PROMPT - 1, PROMPT - 1 + NEW)
    if method == "TF plain step":
        call = plain_step(model, tokens)
    elif method.startswith("jacobkit"):
        kind = "gradient_x_input" if "input" in method else "gradient"
        # auto starts on chunked(32) here (its vectorized rows cost a few
        # MiB); named, chunked runs its default chunks of 16 rows
        strategy = "chunked" if "chunked" in method else "auto"

        def call():
            found = explain.token_attribution(
                model,
                x,
                method=kind,
                targets=targets,
                positions=(rows.start, rows.stop),
                strategy=strategy,
                # a budget is auto's to plan for; a named strategy is sized
                # by its caller (jacobian() refuses both at once)
                memory_budget=BUDGET if strategy == "auto" else None,
            )
            return found.scores
    elif method.startswith("TF per-target loop"):
        # the tied embedding tapped at its lookup call
        tap = graph.LayerTap(model, model.backbone.token_embedding, lookup=True)

        def one(position, target):
            with tf.GradientTape() as tape:
                logits, embedded = watched_output(tap, tape, x, False)
                log_p = tf.nn.log_softmax(logits[0, position])[target]
            return tape.gradient(log_p, embedded)

        if not method.endswith("eager"):
            # compiled once: the loop at its fastest; eager, as a loop of
            # GradientTape calls is written (captum's loop is eager PyTorch)
            one = tf.function(one)

        def call():
            found = []
            for t in range(rows.start, rows.stop):
                grads = one(tf.constant(t), tf.constant(int(targets[0, t])))
                found.append(tf.norm(grads[0], axis=-1).numpy())
            return np.stack(found)[None]
    else:
        raise SystemExit(f"unknown method {method!r}")
    timings, result = measure(call, repeats)
    if method != "TF plain step":
        # against TensorFlow's own plain step, alternating in this process
        timings["paired"] = paired(call, plain_step(model, tokens))
    reference = explain.token_attribution(model, x, targets=targets).scores[:, rows]
    row = {**timings, "footing": record}
    if method not in ("jacobkit gradient_x_input", "TF plain step"):
        scale = float(np.abs(reference).max())
        row["agreement"] = float(np.abs(np.asarray(result) - reference).max() / scale)
    print(json.dumps(row))


#: the fixed strategies timed beside auto (as auto configures them for the
#: 32 rows, and as named): ``batch`` has no closed form of a tensor,
#: ``forward`` pushes one tangent per embedding element (6,144)
FIXED = ("while", "chunked(32)", "chunked", "jacobian", "loop")


def _fixed(label: str):
    from jacobkit import strategies

    return {
        "while": strategies.While(10),
        "chunked(32)": strategies.Chunked(32),
        "chunked": strategies.Chunked(),
        "jacobian": strategies.Jacobian(),
        "loop": strategies.Loop(),
    }[label]


def paired_child(rounds: int, first_only: str | None = None) -> None:
    """auto against each fixed strategy in one process: each one's first
    call (the problem built before, by a plan that runs nothing, so no
    first call pays for it), then ``rounds`` rounds of one steady call of
    each in turn; prints one JSON line."""
    os.environ["TF_CPP_MIN_LOG_LEVEL"] = "3"
    os.environ["JACOBKIT_CACHE_DIR"] = ""  # auto plans from nothing
    import statistics
    import time

    import numpy as np

    from jacobkit import api, explain, runtime

    model, tokens = build()
    x = {"token_ids": tokens, "padding_mask": np.ones_like(tokens)}
    targets = np.concatenate([tokens[:, 1:], tokens[:, -1:]], axis=1)
    rows = (PROMPT - 1, PROMPT - 1 + NEW)
    plans: list = []
    real = api.jacobian

    def kept(*args, **kwargs):  # the plan of auto's call, to report it
        result = real(*args, **kwargs)
        plans.append(result.plan)
        return result

    api.jacobian = kept

    def call(label: str) -> float:
        auto = label == "auto"
        start = time.perf_counter()
        explain.token_attribution(
            model,
            x,
            targets=targets,
            positions=rows,
            strategy="auto" if auto else _fixed(label),
            memory_budget=BUDGET if auto else None,
        )
        return time.perf_counter() - start

    # the problem (its traced pass) built once, before any timed call
    explain.token_attribution(
        model, x, targets=targets, positions=rows, strategy=_fixed("loop")
    )
    if first_only is not None:
        first_s = call(first_only)
        label = plans[-1].strategy.label if first_only == "auto" else ""
        print(json.dumps({"first_s": first_s, "auto_first": label}))
        return
    labels = ("auto", *FIXED)
    first: dict[str, float | None] = {label: None for label in labels}
    times: dict[str, list[float]] = {label: [] for label in labels}
    for _ in range(3):  # calls 1-3 of each, untimed
        for label in labels:
            call(label)
    for _ in range(rounds):
        for label in labels:
            times[label].append(call(label))
    ratios = {
        label: statistics.median(t / a for t, a in zip(times[label], times["auto"]))
        for label in labels
    }
    last = [p for p in plans if p is not None][-1]
    print(
        json.dumps(
            {
                "machine": runtime.cpu_kind().describe(),
                "first_s": first,
                "steady_s": {k: statistics.median(v) for k, v in times.items()},
                "per_auto": ratios,
                "auto_first": "",
                "auto_last": last.summary().splitlines()[0],
                "calls": 3 + rounds,  # auto's calls in the paired process
            }
        )
    )


def paired(rounds: int, out: Path) -> None:
    """:func:`paired_child` with oneDNN on and off (separate processes, one
    core: ``taskset -c 1``), written into the page's own section."""
    me = [sys.executable, str(Path(__file__).resolve())]
    found = {}
    kinds = {"oneDNN on": {}, "oneDNN off": {"TF_ENABLE_ONEDNN_OPTS": "0"}}
    for kind, extra in kinds.items():
        env = {**os.environ, **extra}

        def one(*flags: str, env: dict = env) -> dict:
            command = ["taskset", "-c", "1", *me, *flags]
            done = subprocess.run(command, capture_output=True, text=True, env=env)
            lines = [x for x in done.stdout.splitlines() if x.startswith("{")]
            return json.loads(lines[-1]) if lines else {"error": done.stderr[-800:]}

        found[kind] = one("--paired-child", str(rounds))
        if "error" not in found[kind]:
            # first calls in fresh processes: strategies share compiled
            # computations within one (auto's while is while's)
            for label in ("auto", *FIXED):
                first = one("--first-child", label)
                found[kind]["first_s"][label] = first.get("first_s")
                if label == "auto":
                    found[kind]["auto_first"] = first.get("auto_first", "")
        print(kind, found[kind], file=sys.stderr)
    out.mkdir(parents=True, exist_ok=True)
    (out / "token_attribution_auto.json").write_text(json.dumps(found, indent=1))
    page = out / "token_attribution.md"
    text = page.read_text() if page.exists() else ""
    text = text.split(AUTO_SECTION)[0].rstrip("\n") + "\n\n" + _auto_markdown(found)
    page.write_text(text)
    print(_auto_markdown(found))


AUTO_SECTION = "## auto against each fixed strategy"


def _auto_markdown(found: dict) -> str:
    lines = [
        AUTO_SECTION,
        "",
        "Written by `benchmarks/token_attribution.py --auto`: the same GPT-2 and "
        "rows as above, the default method (`gradient`); auto under "
        f"memory_budget={BUDGET!r}, its plan cache off. One process per kind "
        "of CPU (oneDNN on, then `TF_ENABLE_ONEDNN_OPTS=0`), pinned to one core "
        "(`taskset -c 1`), **measured while other engineers loaded the "
        "machine** (2 cores shared): absolute times move, ratios within one "
        "process are paired. First calls: each in a fresh process (within "
        "one, strategies share compiled computations: auto's `while` is "
        "`while`'s), the problem built before it by a `loop` call, so a first "
        "call is the strategy's own tracing and run (auto's: its planning "
        "too); one process each, they move the most under load (auto's "
        "first call runs what its first strategy's does: see the auto page). "
        "Steady: "
        "the median of one call of each in turn per round (after calls 1-3 of "
        "each), "
        "and the median of the per-round ratios to auto's call.",
        "",
    ]
    for kind, data in found.items():
        if "error" in data:
            lines += [f"### {kind}", "", f"error: {data['error']}", ""]
            continue
        lines += [
            f"### {kind}: {data['machine']}",
            "",
            f"auto's first call ran {data['auto_first']}; after "
            f"{data['calls']} calls: `{data['auto_last']}`.",
            "",
            "| run | first call s | steady ms | steady / auto's (paired) |",
            "|---|---|---|---|",
        ]
        for label, first in data["first_s"].items():
            shown = "" if first is None else f"{first:.2f}"
            lines.append(
                f"| {label} | {shown} | {data['steady_s'][label] * 1e3:.1f} | "
                f"{data['per_auto'][label]:.2f} |"
            )
        lines.append("")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--child")
    parser.add_argument("--auto", action="store_true")
    parser.add_argument("--paired-child", type=int)
    parser.add_argument("--first-child")
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
        return child(args.child, args.repeats)
    if args.paired_child:
        return paired_child(args.paired_child)
    if args.first_child:
        return paired_child(0, args.first_child)
    if args.auto:
        return paired(args.rounds, Path(args.out))
    me = [sys.executable, str(Path(__file__).resolve())]
    repeats = ["--repeats", str(args.repeats)]
    commands = {m: [*me, "--child", m, *repeats] for m in METHODS}
    if args.peers_python:
        npz = str(Path(tempfile.mkdtemp()) / "gpt2.npz")
        export = [sys.executable, str(HERE / "peers" / "export_gpt2.py")]
        subprocess.run([*export, "--out", npz], check=True, capture_output=True)
        script = str(HERE / "peers" / "tokens_torch.py")
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
    (out / "token_attribution.json").write_text(json.dumps(data, indent=1))
    page = out / "token_attribution.md"
    kept = page.read_text().partition(AUTO_SECTION) if page.exists() else ("", "", "")
    # the section --auto wrote stays: the two runs are separate
    page.write_text(_markdown(data).rstrip("\n") + "\n\n" + "".join(kept[1:]))
    print(_markdown(data))


def _markdown(data: dict) -> str:
    sys.path.insert(0, str(HERE / "peers"))
    import footing

    measured = data["runs"]
    lines = [
        "# Token attribution: one call against the per-target loop",
        "",
        "Written by `benchmarks/token_attribution.py`: a keras_hub GPT-2 (2 "
        "layers, hidden 64, vocabulary 1,000, random init), a 64-token prompt "
        "and 32 generated tokens, each attributed to every earlier token; "
        f"jacobkit's default calls (auto) under memory_budget={BUDGET!r}; "
        "PyTorch (Hugging Face's `GPT2LMHeadModel`) on the same weights and the "
        "same tokens. Fresh processes, median of "
        f"{data['rounds']} rounds of {data['repeats']} steady calls.",
        "",
        "Each side on equal footing: one thread each (PyTorch's intra- and "
        "inter-op threads; TensorFlow's intra- and inter-op parallelism), "
        "every process pinned to one core (the scripts refuse to run "
        "unpinned), and each run divided by **its own framework's plain "
        "step** on the same model and tokens (the gradient of the summed "
        "next-token loss over every weight: one forward and one backward "
        "pass), in separate processes and, robust to a busy machine, paired in "
        "one process (each round times either side alternately; the median "
        "ratio over rounds and its 95% bootstrap interval). The batched "
        "PyTorch run does jacobkit's work (one forward "
        "pass, the 32 targets' backward passes batched by `vmap`); the "
        "per-target loops (captum's semantics, 32 forward and backward "
        "passes on growing prefixes) are labelled extras.",
        "",
    ]
    lines += footing.machine_lines(data, measured)
    lines += [
        "| run | steady ms | × own plain step | paired in one process (95% "
        "interval) | first call s | first 3 calls s | "
        "steady growth MiB | first-call growth MiB | agreement |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for key, row in measured.items():
        if "error" in row:
            lines.append(f"| {key} | error: {row['error']} | | | | | | | |")
            continue
        side = "torch" if "PyTorch" in key or "captum" in key else "tensorflow"
        base = measured.get(PLAIN[side], {}).get("steady_s")
        versus = f"{row['steady_s'] / base:.2f}" if base else ""
        # jacobkit's default call is the reference: no agreement to show
        agreement = row.get("agreement", row.get("scores_err", ""))
        if key in ("jacobkit", "jacobkit gradient_x_input", *PLAIN.values()):
            agreement = ""
        if isinstance(agreement, float):
            agreement = f"{agreement:.2g}"
        found = row.get("paired")
        pair = (
            f"{found['ratio']:.2f} ({found['low']:.2f}–{found['high']:.2f})"
            if found
            else ""
        )
        lines.append(
            f"| {key} | {row['steady_s'] * 1e3:.1f} | {versus} | {pair} | "
            f"{row['first_s']:.2f} | {row['first_three_s']:.2f} | "
            f"{row['peak_growth_mib']:.1f} | "
            f"{row.get('first_growth_mib', float('nan')):.1f} | {agreement} |"
        )
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
