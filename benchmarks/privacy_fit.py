"""``jk.privacy``'s compiled DP ``fit`` step against a compiled plain ``fit``
step (issue 49), paired in one process, fed the same way.

Models: the reductions benchmark's conv net
(``benchmarks/reductions_models.py``), its BERT tiny classifier, a
tiny-config keras_hub ``GPT2CausalLM`` (random init, ``preprocessor=None``)
and the same LM after ``backbone.enable_lora(4)``. Each trains on ``N``
random examples, Poisson-sampled at rate ``q`` (expected batch ``q * N``)
by a :class:`jk.privacy.PoissonSampler`, padded to its sizes:

- ``dp``: ``make_private(model, C=1, sigma=1).compile(SGD, loss)``,
  ``fit(sampler)`` (compiled: no ``run_eagerly``);
- ``switch``: the same private step as ``dp`` under Keras's own train
  function (what ``fit`` ran before ``SizedSteps``): the batch taken inside
  the trace, its size unknown, the step switching on it, so that its first
  trace traces every padded size; ``dp`` traces one size per size met, when
  first met (``jacobkit.privacy.sized``). Each side has its own twin model;
- ``plain``: a twin of the model (same weights) compiled with the same
  per-example loss (Keras averages it) and SGD, ``fit`` on a sampler of the
  same seed: the same batches, the same padding, the same ``PyDataset``
  feeding, so that the ratio measures the DP work alone.

Both with ``jit_compile=False``. A step's time is the interval between
consecutive ``on_train_batch_end`` calls inside ``fit`` (what ``fit`` spends
per step, the feeding included); each round runs ``--steps`` steps of one
side then of the other (the order alternating), and a round's ratio is the
quotient of their median steps. Reported: the median ratio over the rounds
and its 95% bootstrap interval, each side's median step, the planning
(``prepare``, timed apart, the ``dp`` side first: a later side may find the
plan in jacobkit's disk cache) and the first step of each side's first
``fit`` (tracing: one size for ``dp``, every size for ``switch``), and, for
``dp``, the sizes traced over the whole run and the steps that traced them
(their time beyond the median step).

The Python overhead of a compiled step: the same two ``fit`` loops on a
trivial model (``Dense(1)`` on one feature, same sampler sizes): Keras's loop,
the callbacks, the feeding and a near-empty step; and the feeding alone
(the sampler's ``__getitem__`` per step, in Python).

Every (model, oneDNN state) runs in a fresh process pinned to one core
(``taskset -c 1``) with one intra- and one inter-op thread; oneDNN off by
``TF_ENABLE_ONEDNN_OPTS=0`` in its environment. One command reruns it all:

    python benchmarks/privacy_fit.py --out benchmarks/results/cpu

(``--models convnet,bert --onednn on`` for a part; ``--quick`` for a smoke
run.) Opacus's side (``benchmarks/peers/reductions_torch.py``, its rows in
``benchmarks/results/cpu/reductions.json``, or ``--peers``) fills the last
column: Opacus's fastest correct mode over PyTorch's own plain step (see
:func:`_peers`).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import numpy as np

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE / "peers"))

import footing  # noqa: E402
import model_configs  # noqa: E402
import protocol  # noqa: E402

MODELS = ("convnet", "bert", "gpt2", "gpt2_lora")
LABELS = {
    "convnet": "conv net (Conv 3-32, Conv 32-64 s2, Dense 64-10; 32x32x3)",
    "bert": "BERT tiny classifier (2 layers, hidden 64, vocab 1000, 32 tokens)",
    "gpt2": "GPT2CausalLM (2 layers, hidden 64, vocab 1000, 32 tokens)",
    "gpt2_lora": "the same GPT2CausalLM, enable_lora(4)",
}
#: training-set size and expected batch per model
SIZES = {"convnet": (512, 32), "bert": (512, 32), "gpt2": (256, 16)}
SIZES["gpt2_lora"] = SIZES["gpt2"]
CORE = "1"


# --------------------------------------------------------------------------
# one process: one model, one oneDNN state


def _case(name: str) -> tuple[Any, Any, Any, Any]:
    """``(build, x, y, loss)``: ``build()`` makes the model with the same
    weights every call (seeded)."""
    import keras

    n, _ = SIZES[name]
    if name in ("convnet", "bert"):
        sys.path.insert(0, str(ROOT))
        from benchmarks import reductions_models

        make = getattr(reductions_models, name)
        case = make(batch=n)
        return (lambda: make(batch=n).model), case.x, case.y, reductions_models.loss()

    import keras_hub

    length = 32
    vocabulary = model_configs.GPT2["vocabulary_size"]

    def build() -> Any:
        keras.utils.set_random_seed(0)
        backbone = keras_hub.models.GPT2Backbone(**model_configs.gpt2(length))
        if name == "gpt2_lora":
            backbone.enable_lora(4)
        return keras_hub.models.GPT2CausalLM(backbone, preprocessor=None)

    rng = np.random.default_rng(0)
    x = {
        "token_ids": rng.integers(1, vocabulary, (n, length)).astype("int32"),
        "padding_mask": np.ones((n, length), "int32"),
    }
    y = np.roll(x["token_ids"], -1, axis=1)

    def next_tokens(y_true: Any, y_pred: Any) -> Any:
        """Each sequence's summed next-token cross-entropy (one row each)."""
        return keras.ops.sum(
            keras.losses.sparse_categorical_crossentropy(
                y_true, y_pred, from_logits=True
            ),
            axis=-1,
        )

    return build, x, y, next_tokens


class _Clock:
    """Keras callback: the time of each ``on_train_batch_end``."""

    def __init__(self) -> None:
        import keras

        class Clock(keras.callbacks.Callback):
            def __init__(self, owner: _Clock) -> None:
                super().__init__()
                self.owner = owner

            def on_train_batch_end(self, batch: int, logs: Any = None) -> None:
                self.owner.ends.append(time.perf_counter())
                count = getattr(self.model.train_function, "tracing_count", None)
                self.owner.traces.append(count)

        self.start = 0.0
        self.ends: list[float] = []
        #: the step's traces after each step (``dp``'s train function)
        self.traces: list[int | None] = []
        self.callback = Clock(self)


def _sides(build: Any, x: Any, y: Any, loss: Any, n: int, q: float) -> dict:
    """``{"dp": fit(steps), "switch": fit(steps), "plain": fit(steps)}``,
    each ``fit`` one epoch of ``steps`` steps on its own sampler of the same
    seed, returning the start time and the clock (``fit.prepare()``: the DP
    sides' planning, before their first ``fit``)."""
    import keras

    import jacobkit as jk

    def fitter(model: Any) -> Any:
        def fit(steps: int) -> tuple[float, list[float]]:
            sampler = fit.sampler
            sampler.steps_per_epoch = steps
            clock = _Clock()
            fit.clocks.append(clock)
            start = clock.start = time.perf_counter()
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                # a keras_hub task's own fit maps its preprocessor over a
                # tf.data set, which a PyDataset is not: Keras's fit, as
                # PrivateModel's calls
                fitted = model.fit if hasattr(model, "privacy") else keras.Model.fit
                args = () if hasattr(model, "privacy") else (model,)
                fitted(*args, sampler, epochs=1, verbose=0, callbacks=[clock.callback])
            return start, clock.ends

        fit.sampler = jk.privacy.PoissonSampler((x, y), q, seed=0)
        fit.model = model
        fit.clocks = []
        return fit

    def private(switch: bool) -> Any:
        found = jk.privacy.make_private(
            build(),
            l2_norm_clip=1.0,
            noise_multiplier=1.0,
            sampling_rate=q,
            num_examples=n,
        )
        found.compile(keras.optimizers.SGD(0.01), _per_example(loss), jit_compile=False)
        fit = fitter(found)

        def prepare() -> None:
            found.prepare(fit.sampler)
            if switch:  # Keras's own train function (fit keeps a made one)
                keras.Model.make_train_function(found, force=True)

        fit.prepare = prepare
        return fit

    plain = build()
    plain.compile(keras.optimizers.SGD(0.01), _mean(loss), jit_compile=False)
    return {"dp": private(False), "switch": private(True), "plain": fitter(plain)}


def _per_example(loss: Any) -> Any:
    return loss


def _mean(loss: Any) -> Any:
    """The same per-example loss, which Keras's ``compile`` averages over the
    batch (a Keras loss: its reduction reset; a function: wrapped)."""
    import keras

    if isinstance(loss, keras.losses.Loss):
        config = loss.get_config() | {"reduction": "sum_over_batch_size"}
        return type(loss).from_config(config)
    return loss


def _paired(sides: dict, rounds: int, steps: int) -> dict[str, Any]:
    """First steps, then ``rounds`` alternating rounds of ``steps`` steps."""
    found: dict[str, Any] = {}
    for name, fit in sides.items():  # the first fit: planning, tracing
        planning = 0.0
        if hasattr(fit, "prepare"):
            begin = time.perf_counter()
            fit.prepare()
            planning = time.perf_counter() - begin
            found[f"{name}_plan_s"] = planning
        start, ends = fit(max(3, steps // 2))
        # as before the planning was timed apart: planning and first step
        found[f"{name}_first_s"] = planning + ends[0] - start
    ratios: dict[str, list[float]] = {k: [] for k in sides if k != "plain"}
    medians: dict[str, list[float]] = {k: [] for k in sides}
    fastest = {k: float("inf") for k in sides}
    for r in range(rounds):
        order = list(sides) if r % 2 == 0 else list(sides)[::-1]
        this = {}
        for name in order:
            _, ends = sides[name](steps + 1)
            this[name] = statistics.median(np.diff(ends))
            medians[name].append(this[name])
            fastest[name] = min(fastest[name], float(np.min(np.diff(ends))))
        for name, found_ratios in ratios.items():
            found_ratios.append(this[name] / this["plain"])
    low, high = protocol.bootstrap(ratios["dp"])
    found |= {"ratio": statistics.median(ratios["dp"]), "low": low, "high": high}
    if "switch" in ratios:
        low, high = protocol.bootstrap(ratios["switch"])
        found |= {
            "switch_ratio": statistics.median(ratios["switch"]),
            "switch_low": low,
            "switch_high": high,
        }
    found |= {f"{k}_ms": 1e3 * statistics.median(v) for k, v in medians.items()}
    found |= _traced(sides["dp"], found["dp_ms"] / 1e3)
    # the fastest steps, which other jobs slowed least: a second estimate
    found |= {f"{k}_fastest_ms": 1e3 * v for k, v in fastest.items()}
    found["fastest_ratio"] = fastest["dp"] / fastest["plain"]
    found["rounds"], found["steps"] = rounds, steps
    return found


def _traced(fit: Any, step: float) -> dict[str, Any]:
    """The ``dp`` side's whole run: its steps, the sizes its step traced (of
    the sampler's), and the time of the steps that traced beyond ``step``
    (the median step, s; the first step of a ``fit`` from its start: its
    first-ever step, planning aside, included)."""
    steps, extra, count = 0, 0.0, 0
    for clock in fit.clocks:
        for i, traces in enumerate(clock.traces):
            steps += 1
            if traces is not None and traces > count:
                count = traces
                before = clock.ends[i - 1] if i else clock.start
                extra += clock.ends[i] - before - step
    return {
        "run_steps": steps,
        "run_traced": count,
        "run_trace_s": extra,
        "n_sizes": len(fit.sampler.sizes),
    }


def _by_size(fit: Any, switch: Any, repeats: int) -> dict[str, Any]:
    """The ``dp`` side's step on a batch of each size its run traced (all
    real examples; its trace called as ``fit`` calls it), ``repeats`` rounds
    over the sizes, the order alternating: the median per size (ms) and the
    line ``a + b * size`` through them (least squares), ``b`` what one
    padded example costs. Beside it, paired (the order alternating), the
    ``switch`` side's train function on the same batch from a ``tf.data``
    iterator of unknown batch size (the switch, as in its ``fit``, the
    feeding aside): the median over sizes and rounds of by size over
    switch, the step alone."""
    import tensorflow as tf

    steps = fit.model.train_function
    count = steps.tracing_count
    sizes = sorted({key[0][0][0] for key in steps.traces})
    batches = {
        size: tf.nest.map_structure(
            tf.convert_to_tensor, fit.sampler.batch(np.arange(size))
        )
        for size in sizes
    }
    # each size's batch again and again, its size unknown to the trace
    iterators = {
        size: iter(tf.data.Dataset.from_tensors(b).repeat().unbatch().batch(size))
        for size, b in batches.items()
    }
    sides = {
        "dp": lambda size: steps.run(batches[size]),
        "switch": lambda size: switch.model.train_function(iterators[size]),
    }
    begin = time.perf_counter()
    for size in sizes:  # the switch's first calls: not timed with the rest
        sides["switch"](size)
    warm = time.perf_counter() - begin  # a retrace would show here
    times: dict[int, list[float]] = {size: [] for size in sizes}
    ratios: list[float] = []
    for r in range(repeats):
        for size in sizes if r % 2 == 0 else sizes[::-1]:
            this = {}
            for name in sides if r % 2 == 0 else list(sides)[::-1]:
                start = time.perf_counter()
                float(sides[name](size)["loss"])
                this[name] = time.perf_counter() - start
            times[size].append(this["dp"])
            ratios.append(this["dp"] / this["switch"])
    medians = [1e3 * statistics.median(times[size]) for size in sizes]
    slope, intercept = (
        np.polyfit(sizes, medians, 1) if len(sizes) > 1 else (float("nan"), 0.0)
    )
    return {
        "by_size": dict(zip(map(str, sizes), medians)),
        "per_example_ms": float(slope),
        "fixed_ms": float(intercept),
        "by_size_retraced": steps.tracing_count - count,
        "step_by_switch": statistics.median(ratios),
        "switch_warm_s": warm,
    }


def _ladders(n: int, q: float) -> dict[str, Any]:
    """Per spacing (sizes per doubling, 4 and 2): the sizes, the expected
    padded batch, and the expected sizes a run meets after ``T`` steps (each
    size ``s`` met with probability ``1 - (1 - p_s)^T``), from the binomial."""
    from scipy.stats import binom

    from jacobkit.privacy.sampling import padded_sizes

    draws = np.arange(n + 1)
    mass = binom.pmf(draws, n, q)
    found = {}
    for per in (4, 2):
        sizes = np.array(padded_sizes(n, q, per))
        # a draw above the largest: probability < 1e-10, counted at the largest
        index = np.minimum(np.searchsorted(sizes, np.maximum(draws, 1)), len(sizes) - 1)
        each = np.bincount(index, weights=mass, minlength=len(sizes))
        found[str(per)] = {
            "sizes": sizes.tolist(),
            "padded": float(np.sum(mass * sizes[index])),
            "met": {
                str(t): float(np.sum(1 - (1 - each) ** t))
                for t in (10, 100, 1000, 10000)
            },
        }
    return found


def _trivial(q: float, n: int, rounds: int, steps: int) -> dict[str, Any]:
    """The loops on a trivial model, and the feeding alone (ms per step)."""
    import keras

    import jacobkit as jk

    def build() -> Any:
        keras.utils.set_random_seed(0)
        return keras.Sequential([keras.Input((1,)), keras.layers.Dense(1)])

    x = np.linspace(-1, 1, n, dtype="float32")[:, None]
    y = np.zeros((n, 1), "float32")
    loss = keras.losses.MeanSquaredError(reduction=None)
    found = _paired(_sides(build, x, y, loss, n, q), rounds, steps)
    sampler = jk.privacy.PoissonSampler((x, y), q, seed=0)
    times = []
    for i in range(len(sampler)):
        start = time.perf_counter()
        sampler[i]
        times.append(time.perf_counter() - start)
    return {
        "trivial_dp_ms": found["dp_ms"],
        "trivial_switch_ms": found["switch_ms"],
        "trivial_plain_ms": found["plain_ms"],
        "feeding_ms": 1e3 * statistics.median(times),
    }


def _child(name: str, rounds: int, steps: int) -> dict[str, Any]:
    import keras
    import keras_hub
    import tensorflow as tf

    from jacobkit import runtime

    build, x, y, loss = _case(name)
    n, batch = SIZES[name]
    q = batch / n
    sides = _sides(build, x, y, loss, n, q)
    found = _paired(sides, rounds, steps)
    found |= _by_size(sides["dp"], sides["switch"], rounds)
    found |= {"ladders": _ladders(n, q)}
    found |= _trivial(q, n, rounds, steps)
    import jacobkit as jk

    found |= {
        "model": name,
        "n": n,
        "expected_batch": batch,
        "sizes": list(jk.privacy.PoissonSampler((x, y), q).sizes),
        "onednn": runtime.cpu_kind().onednn,
        "versions": {
            "tensorflow": tf.__version__,
            "keras": keras.__version__,
            "keras_hub": keras_hub.__version__,
        },
        "commit": _commit(),
    }
    return found


def _commit() -> str:
    out = subprocess.run(
        ["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"],
        capture_output=True,
        text=True,
        check=False,
    )
    return out.stdout.strip() or "unknown"


# --------------------------------------------------------------------------
# the driver: a process per (model, oneDNN state), the table


def _run(name: str, onednn: str, rounds: int, steps: int) -> dict[str, Any]:
    env = {
        **os.environ,
        "TF_CPP_MIN_LOG_LEVEL": "3",
        "TF_ENABLE_ONEDNN_OPTS": "1" if onednn == "on" else "0",
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
        "OMP_NUM_THREADS": "1",
    }
    command = [sys.executable, __file__, "--child", name]
    command += ["--rounds", str(rounds), "--steps", str(steps)]
    if shutil.which("taskset"):
        command = ["taskset", "-c", CORE, *command]
    out = subprocess.run(command, capture_output=True, text=True, env=env, check=False)
    lines = [line for line in out.stdout.splitlines() if line.startswith("{")]
    if out.returncode or not lines:
        return {"model": name, "error": (out.stderr or out.stdout).strip()[-800:]}
    found: dict[str, Any] = json.loads(lines[-1])
    found["onednn_asked"] = onednn
    return found


def _peers(path: Path) -> dict[str, Any]:
    """Opacus's fastest correct DP step over PyTorch's own plain step, per
    model, from the peers' rows of ``benchmarks/reductions.py``'s JSON
    (``benchmarks/peers/reductions_torch.py``: ``runs``' keys ``"<case>|Opacus
    <mode>, DP-SGD step"``, each with its ``paired`` ratio; a mode whose step failed
    its check has no row there): ``{model: {"mode", "ratio", "low", "high"}}``.
    Absent: an empty dict (the column reads "not run")."""
    if not path.exists():
        return {}
    found: dict[str, Any] = {}
    runs = json.loads(path.read_text()).get("runs", {})
    for key, row in runs.items():
        case, _, label = key.partition("|")
        paired = row.get("paired") if isinstance(row, dict) else None
        if not (label.startswith("Opacus") and label.endswith("DP-SGD step")):
            continue
        if not paired or "error" in row:
            continue
        mode = label.removeprefix("Opacus ").removesuffix(", DP-SGD step")
        if case not in found or paired["ratio"] < found[case]["ratio"]:
            found[case] = {"mode": mode, **paired}
    return found


def _machine() -> str:
    found = footing.machine()
    shown = [
        f for f in found["flags"] if f in ("avx2", "avx512f", "avx512_bf16", "amx_tile")
    ]
    return f"{found['cpu']} ({', '.join(shown)}), {found['logical_cpus']} cores"


def _table(rows: list[dict], peers: dict, args: argparse.Namespace) -> str:
    first = next((r for r in rows if "error" not in r), {})
    versions = first.get("versions", {})
    lines = [
        "# The compiled DP fit step against a compiled plain fit step "
        "(benchmarks/privacy_fit.py)",
        "",
        f"Machine: {_machine()}, measured under load (other jobs on both "
        "cores): each (model, oneDNN state) in a fresh process pinned to core "
        f"{CORE} (`taskset -c {CORE}`), one intra-op and one inter-op thread. "
        f"TensorFlow {versions.get('tensorflow')}, Keras {versions.get('keras')}, "
        f"keras_hub {versions.get('keras_hub')}. oneDNN off: "
        "`TF_ENABLE_ONEDNN_OPTS=0`. Rerun on a quiet machine: "
        "`python benchmarks/privacy_fit.py --out benchmarks/results/cpu`.",
        "",
        "Both sides `fit` on a PoissonSampler of the same seed (same batches, "
        "padding and feeding), `jit_compile=False`, SGD; DP: C = 1, sigma = 1, "
        "all trainable variables clipped together. A step: the interval between "
        "consecutive `on_train_batch_end` (the feeding included). "
        f"{_spread(rows, 'rounds')} alternating rounds of "
        f"{_spread(rows, 'steps')} steps a side; ratio: "
        "median over rounds of the rounds' median DP step over their median "
        "plain step [95% bootstrap interval]; fastest: the fastest DP step over "
        "the fastest plain step (ms), which the load slowed least. First: the "
        "first step of the first `fit`, planning included (DP: planning and "
        "tracing the first batch's size; rows of the table below with a switch "
        "column, and every row before it had one, traced every padded size "
        "there).",
        "",
        "| model | oneDNN | commit | N, E[batch], sizes | DP step (ms) | plain "
        "step (ms) | DP / plain | fastest: DP / plain | first DP (s) | first "
        "plain (s) | Opacus DP / plain |",
        "|---|---|---|---|---:|---:|---:|---:|---:|---:|---|",
    ]
    for r in rows:
        if "error" in r:
            lines.append(
                f"| {r['model']} | {r.get('onednn_asked')} | error: "
                f"{r['error'].splitlines()[-1][:120]} |||||||||"
            )
            continue
        peer = peers.get(r["model"])
        opacus = (
            f"{peer['ratio']:.2f} [{peer['low']:.2f}, {peer['high']:.2f}] "
            f"({peer['mode']})"
            if peer
            else "not run"
        )
        sizes = r["sizes"]
        lines.append(
            f"| {r['model']} | {'on' if r['onednn'] else 'off'} | {r['commit']} | "
            f"{r['n']}, {r['expected_batch']}, {sizes[0]}..{sizes[-1]} "
            f"({len(sizes)}) | {r['dp_ms']:.1f} | {r['plain_ms']:.1f} | "
            f"{r['ratio']:.2f} [{r['low']:.2f}, {r['high']:.2f}] | "
            f"{_fastest(r)} | {r['dp_first_s']:.1f} | {r['plain_first_s']:.2f} | "
            f"{opacus} |"
        )
    lines += [
        "",
        "Models: " + "; ".join(f"`{k}`: {v}" for k, v in LABELS.items()) + ".",
        "",
        "Opacus: its fastest mode whose step passed the peers' check, over "
        "PyTorch's own plain SGD step, paired in one process "
        "(`benchmarks/peers/reductions_torch.py`, read from "
        "`benchmarks/results/cpu/reductions.json`): a fixed batch of 32, no "
        "sampler, BERT without dropout, measured in its own run (oneDNN's "
        "state is TensorFlow's: one figure for both rows). Compare ratios, not "
        "times.",
        "",
        "The Python overhead per compiled step: the same two `fit` loops on a "
        "trivial model (`Dense(1)` on one feature, the same sampler sizes) and "
        "the sampler's `__getitem__` alone, per step (ms, median), in each "
        "model's process:",
        "",
        "| process | oneDNN | trivial DP step | trivial DP step, switch | "
        "trivial plain step | feeding alone |",
        "|---|---|---:|---:|---:|---:|",
    ]
    for r in rows:
        if "error" not in r:
            switch = r.get("trivial_switch_ms")
            lines.append(
                f"| {r['model']} | {'on' if r['onednn'] else 'off'} | "
                f"{r['trivial_dp_ms']:.2f} | "
                f"{'-' if switch is None else f'{switch:.2f}'} | "
                f"{r['trivial_plain_ms']:.2f} | {r['feeding_ms']:.2f} |"
            )
    return "\n".join(lines) + _first_steps(rows) + _ladder_table(rows) + "\n"


def _first_steps(rows: list[dict]) -> str:
    """The first steps' table: the rows that timed the switch beside."""
    rows = [r for r in rows if "switch_first_s" in r]
    if not rows:
        return ""
    lines = [
        "",
        "",
        "The first step, by size or by switch, paired in one process (each side "
        "its own twin model, the by-size side first): planning (`prepare`, "
        "timed apart), then the first step of the first `fit`: `dp` traces the "
        "first batch's size (`jacobkit.privacy.sized`), `switch` (Keras's own "
        "train function, what `fit` ran before) every padded size. The run: "
        "every step of `dp` over the benchmark (first steps and rounds), the "
        "sizes its step traced when first met, and those steps' time beyond "
        "the median step (the first step's included). Switch / plain: its "
        "steady step's ratio, as the first table's (the same rounds). The step "
        "alone: each size the run traced, the by-size step on a batch of it "
        "against the switch's on the same batch from a `tf.data` iterator of "
        "unknown batch size (the feeding aside), paired, alternating: the "
        "median of the pairs' ratios.",
        "",
        "| model | oneDNN | commit | planning: by size / switch (s) | first "
        "step by size (s) | first step by switch (s) | first plain (s) | run: "
        "sizes traced, steps | run: tracing steps' extra (s) | switch / plain | "
        "step alone: by size / switch |",
        "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['model']} | {'on' if r['onednn'] else 'off'} | {r['commit']} | "
            f"{r['dp_plan_s']:.1f} / {r['switch_plan_s']:.1f} | "
            f"{r['dp_first_s'] - r['dp_plan_s']:.1f} | "
            f"{r['switch_first_s'] - r['switch_plan_s']:.1f} | "
            f"{r['plain_first_s']:.2f} | {r['run_traced']} of {r['n_sizes']}, "
            f"{r['run_steps']} | {r['run_trace_s']:.1f} | "
            f"{r['switch_ratio']:.2f} [{r['switch_low']:.2f}, "
            f"{r['switch_high']:.2f}] | "
            f"{_optional(r, 'step_by_switch')} |"
        )
    return "\n".join(lines)


def _ladder_table(rows: list[dict]) -> str:
    """Four sizes per doubling against two: the traces each costs over a
    run and its padding's compute, from the measured trace and step."""
    rows = [r for r in rows if "ladders" in r and r.get("run_traced")]
    if not rows:
        return ""
    horizons = ("100", "1000", "10000")
    lines = [
        "",
        "",
        "Fewer sizes (`PoissonSampler(sizes_per_doubling=2)`) against the "
        "default four per doubling: a size's trace is the mean extra time of "
        "the run's steps that traced (the table above), one padded example's "
        "cost the slope of the DP step's time against its batch size (each "
        "traced size timed on a batch of it, all examples real; `a + b * "
        "size` by least squares, over the sizes the run traced); the sizes "
        "met and the expected padded batch from the binomial. Cost over T "
        "steps: the sizes met by T times a size's trace, plus T times the "
        "expected padded batch times b; the table gives two per doubling's "
        "cost minus four's (s; negative: two per doubling is cheaper).",
        "",
        "| model | oneDNN | commit | a size's trace (s) | step: a + b * size "
        "(ms) | 4 per doubling: sizes, E[padded] | 2 per doubling: sizes, "
        "E[padded] | sizes met after 100 / 1000 / 10000 steps (4; 2) | 2 minus "
        "4 after 100 / 1000 / 10000 steps (s) |",
        "|---|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        trace = r["run_trace_s"] / r["run_traced"]
        b = r["per_example_ms"] / 1e3
        four, two = r["ladders"]["4"], r["ladders"]["2"]

        def cost(ladder: dict, steps: str, trace: float = trace, b: float = b) -> float:
            return float(
                ladder["met"][steps] * trace + int(steps) * b * ladder["padded"]
            )

        met = " / ".join(f"{four['met'][t]:.1f}; {two['met'][t]:.1f}" for t in horizons)
        minus = " / ".join(f"{cost(two, t) - cost(four, t):+.0f}" for t in horizons)
        lines.append(
            f"| {r['model']} | {'on' if r['onednn'] else 'off'} | {r['commit']} | "
            f"{trace:.1f} | {r['fixed_ms']:.1f} + {r['per_example_ms']:.2f} * "
            f"size | {len(four['sizes'])}, {four['padded']:.1f} | "
            f"{len(two['sizes'])}, {two['padded']:.1f} | {met} | {minus} |"
        )
    return "\n".join(lines)


def _optional(row: dict, key: str) -> str:
    return f"{row[key]:.2f}" if key in row else "-"


def _spread(rows: list[dict], key: str) -> str:
    """``rows``' values of ``key``: one, or the smallest to the largest."""
    found = sorted({r[key] for r in rows if key in r})
    if not found:
        return "?"
    return str(found[0]) if len(found) == 1 else f"{found[0]} to {found[-1]}"


def _fastest(row: dict) -> str:
    if "fastest_ratio" not in row:
        return "-"
    return (
        f"{row['fastest_ratio']:.2f} ({row['dp_fastest_ms']:.1f} / "
        f"{row['plain_fastest_ms']:.1f})"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--child", choices=MODELS)
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--onednn", default="on,off")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--quick", action="store_true", help="3 rounds of 4 steps")
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument(
        "--rows",
        type=Path,
        nargs="*",
        help="the table of these JSON files' rows (earlier runs), none run",
    )
    parser.add_argument(
        "--peers", type=Path, default=HERE / "results" / "cpu" / "reductions.json"
    )
    args = parser.parse_args()
    if args.quick:
        args.rounds, args.steps = 3, 4
    if args.child:
        import tensorflow as tf

        tf.config.threading.set_intra_op_parallelism_threads(1)
        tf.config.threading.set_inter_op_parallelism_threads(1)
        from jacobkit import runtime

        runtime.start_tensorflow_quietly()
        print(json.dumps(_child(args.child, args.rounds, args.steps)))
        return
    rows = [r for path in args.rows or () for r in json.loads(path.read_text())]
    for onednn in () if args.rows else args.onednn.split(","):
        for name in args.models.split(","):
            row = _run(name, onednn, args.rounds, args.steps)
            print(json.dumps(row), file=sys.stderr)
            rows.append(row)
    text = _table(rows, _peers(args.peers), args)
    print(text)
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "privacy_fit.md").write_text(text)
        (args.out / "privacy_fit.json").write_text(json.dumps(rows, indent=1) + "\n")


if __name__ == "__main__":
    main()
