"""The reductions of per-example loss gradients against materializing them:
the DP clipped sum, the Gram matrix and the projection, on the models of
``reductions_models.py`` (conv nets, an MLP, keras_hub BERT classifiers and
a keras_hub GPT-2 causal LM, batch 32, every trainable variable), beside one
plain summed-gradient step of the same model and, on the conv net, BERT
tiny, ``bert_small`` and GPT-2, PyTorch on identical weights
(``peers/reductions_torch.py``: Hugging Face's BERT and GPT-2 models,
``vmap(grad)`` and Opacus's modes; a mode that refuses the model or
disagrees with jacobkit's result is recorded with its reason, not a time).

Every run is a fresh process pinned to one core (``taskset -c 0``), timed by
``peers/protocol.py``: the first call (tracing included) and the growth of
the process's peak resident memory during it, then the median of
``--repeats`` steady calls and one steady call's growth. Rounds alternate the
runs; each figure is the median over rounds.

- ``plain step``: the gradient of the batch's summed loss (one
  ``tf.function`` of the batch, what a Keras train step computes; the
  batch is its argument, as in training: a step that captured it as a
  constant let TensorFlow's graph optimizer fold what depends on the
  inputs alone, BERT's attention mask among them, ahead of the call);
- ``clipped sum``: ``reduce=jk.ClippedSum(1.0)``; ``materialized clipped``:
  ``outputs=jk.Loss`` per-example gradients, then NumPy norms, clip and sum;
- ``gram``: ``jk.gram``; ``materialized gram``: the per-example gradients
  flattened, ``J Jᵀ``; ``budgeted gram`` (``bert_small``):
  ``jk.gram(memory_budget="2GiB")``, less than materializing holds, where
  the default 256 MiB cuts a batch into chunks of 5 examples whose features
  are recomputed for every pair of chunks;
- ``projection``: ``reduce=jk.Project(2048)``; ``materialized projection``:
  the per-example gradients times the same maps (``sketch.TargetMap``);
- ``convnet_medium`` and ``bert_small`` (larger models of the same kinds):
  the plain step and the clipped sum; on ``bert_small`` (a 30,522-token
  vocabulary) also the Gram matrix and the projection against materializing,
  2 steady calls per round (``reductions_models.REPEATS``);
- ``--paired``: the clipped sum against the plain step in one process,
  alternating, :data:`PAIRED_ROUNDS` rounds (the median per-round ratio and
  its bootstrap interval): on a shared machine the separate processes
  above move by ±10% from run to run, and a round's slowdown falls on both
  sides alike here;
- ``--maps-only`` (with ``--cases``): ``jk.Project(2048)`` with its small
  targets' maps CountSketches (the default) and Gaussian
  (``small="gaussian"``) against the plain step, the three alternating in
  one process (``--maps CASE``, :data:`PAIRED_ROUNDS` rounds), first calls
  beside them, merged into ``--out``'s results;
- ``--first-calls`` (with ``--cases``): the first call alone of the plain
  step, the Gram matrix, the clipped sum and the projection, each in a
  fresh process, the processes alternating within each round; the median
  per-round ratio to the plain step's first call and the graph ops each
  first call built (every trace), merged into ``--out``'s results;
- ``gram over N`` / ``projection over N``: a dataset of N examples in batches
  of 32, with TensorFlow's own allocator peak (its pooled CPU allocator):
  the peak must not grow with N.

    python benchmarks/reductions.py --peers-python /path/to/peers/bin/python \\
        --rounds 3 --out benchmarks/results/cpu
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import runs

HERE = Path(__file__).resolve().parent
DIM = 2048
CLIP = 1.0
#: the clipped sum against the plain step in one process: rounds, and calls
#: of each side per round
PAIRED_ROUNDS = 20
PAIRED_CALLS = 5
#: the issue's goal for the clipped sum (fastDP's claim): at most this many
#: plain steps
CLIP_GOAL = 1.25
METHODS = (
    "plain step",
    "clipped sum",
    "materialized clipped",
    "gram",
    "materialized gram",
    "projection",
    "materialized projection",
)
#: every jacobkit run, those of the larger cases too
OWN = (*METHODS, "budgeted gram")
#: Opacus's ways of taking per-example gradients, as the peer names them:
#: ``GradSampleModule``'s hooks, functorch and expanded weights, and ghost
#: clipping (``make_private(grad_sample_mode="ghost")``)
OPACUS_MODES = {
    "hooks": "hooks",
    "functorch": "functorch",
    "ew": "expanded weights",
    "ghost": "ghost clipping",
}
#: the conv net's PyTorch runs: label -> the peer script's --method; each
#: divided by PyTorch's own plain step
PEERS = {
    "PyTorch plain step": "plain",
    **{
        f"Opacus {label}, clipped": f"clipped_opacus_{m}"
        for m, label in OPACUS_MODES.items()
    },
    "PyTorch vmap(grad) clipped": "clipped_vmap",
    "PyTorch vmap(grad) gram": "gram_vmap",
    "PyTorch vmap(grad) projection (jacobkit's maps)": "project_vmap",
}
#: the DP-SGD training step (issue 49): PyTorch's plain SGD step and
#: Opacus's DP-SGD step in each mode, on the conv net's weights
DP_PEERS = {
    "PyTorch SGD step": "sgd_step",
    **{
        f"Opacus {label}, DP-SGD step": f"dp_step_opacus_{m}"
        for m, label in OPACUS_MODES.items()
    },
}
#: the cases PyTorch runs on (``peers/export_reductions.py --case``), and
#: the methods it leaves out on each: on ``bert_small`` (a plain step of
#: ~260 ms, per-example gradients of 1.4 GB) the DP-SGD steps
PEER_CASES = ("convnet", "bert", "gpt2", "bert_small")
PEER_SKIP: dict[str, tuple[str, ...]] = {"bert_small": tuple(DP_PEERS.values())}
#: the cases with the DP-SGD step table (TensorFlow's plain SGD step too)
DP_CASES = ("convnet", "bert", "gpt2")
#: the transformer cases, and issue 50's goal on them: each reduction at
#: most this many of its own plain step (PyTorch has no closed forms for
#: attention or LayerNorm)
TRANSFORMERS = ("bert", "bert_small", "gpt2")
TRANSFORMER_GOAL = 1.5
#: each reduction's PyTorch peers: the fastest that matched jacobkit's
#: result is the one jacobkit is compared with (issue 50)
KIND_PEERS = {
    "clipped sum": (
        *(f"Opacus {label}, clipped" for label in OPACUS_MODES.values()),
        "PyTorch vmap(grad) clipped",
    ),
    "gram": ("PyTorch vmap(grad) gram",),
    "projection": ("PyTorch vmap(grad) projection (jacobkit's maps)",),
}
#: TensorFlow's side of the DP-SGD step table: its plain SGD step, and
#: jacobkit's compiled DP step (its child method to be added where that
#: step lands: ``child`` names it by this label)
TF_SGD = "TensorFlow SGD step"
TF_DP = (TF_SGD, "jacobkit DP-SGD step")
#: the DP and plain steps' learning rate (the peer's ``LR``)
LR = 0.01
#: the label of every PyTorch run's own baseline
TORCH_PLAIN = "PyTorch plain step"
TORCH_SGD = "PyTorch SGD step"
SIZES = (64, 256, 1024)


def child(case: str, method: str, repeats: int, first_only: bool = False) -> None:
    """One run; prints one JSON line (``first_only``: the first call alone,
    with the graph ops it built, :func:`_counting_ops`)."""
    os.environ["TF_CPP_MIN_LOG_LEVEL"] = "3"
    sys.path.insert(0, str(HERE))
    sys.path.insert(0, str(HERE / "peers"))
    import footing
    import numpy as np
    import reductions_models
    import tensorflow as tf
    from protocol import measure, paired

    record = footing.pin_tensorflow("reductions")

    import jacobkit as jk
    from jacobkit.problem import sketch

    built = reductions_models.CASES[case]()
    model, x, y = built.model, built.x, built.y
    loss = jk.Loss(reductions_models.loss(case))
    variables = model.trainable_variables
    plans: list = []
    grams: list = []  # jk.gram's last result: its strategy and forms

    def jacobian(**kwargs):
        result = jk.jacobian(model, (x, y), variables, outputs=loss, **kwargs)
        plans[:] = [result.plan]
        return result

    def per_example() -> list[np.ndarray]:
        found = jacobian()
        return [np.asarray(v).reshape(len(y), -1) for v in found.values()]

    if method == "plain step":
        call = plain_step(built)
    elif method == TF_SGD:
        call = sgd_step(built)
    elif method == "clipped sum":

        def call():
            return [
                np.asarray(v) for v in jacobian(reduce=jk.ClippedSum(CLIP)).values()
            ]
    elif method == "materialized clipped":

        def call():
            flat = np.concatenate(per_example(), axis=1)
            scale = np.minimum(1.0, CLIP / np.linalg.norm(flat, axis=1))
            return scale @ flat
    elif method == "gram":

        def call():
            found = jk.gram(model, (x, y), outputs=loss)
            grams[:] = [found]
            return found.matrix
    elif method == "budgeted gram":  # chunks of what materializing holds

        def call():
            return jk.gram(model, (x, y), outputs=loss, memory_budget="2GiB").matrix
    elif method == "materialized gram":

        def call():
            flat = np.concatenate(per_example(), axis=1)
            return flat @ flat.T
    elif method == "projection":

        def call():
            return np.asarray(jacobian(reduce=jk.Project(DIM)).projection)
    elif method == "materialized projection":
        project = jk.Project(DIM)
        names = list(jacobian().jacobians)
        maps = [
            sketch.target_map(project, n, tuple(v.shape))
            for n, v in zip(names, variables)
        ]

        def call():
            rows = per_example()
            return sum(
                np.asarray(m.of_flat(tf.constant(r))) for m, r in zip(maps, rows)
            )
    else:
        raise SystemExit(f"unknown method {method!r}")

    def settled() -> bool:
        if grams:  # jk.gram's arrangements still timed: not steady yet
            return grams[0].arrangement.kept is not None
        return not plans or plans[0] is None or plans[0].settled

    if first_only:
        import time

        # a first call on a machine that has planned nothing: no plan kept on
        # disk by an earlier process (the plain step keeps none either)
        os.environ["JACOBKIT_CACHE_DIR"] = ""
        # jacobkit's own modules loaded before the clock starts, as TensorFlow's
        # and Keras's are for the plain step (``import jacobkit`` defers them
        # to the first use of its API): their load time is reported apart
        start = time.perf_counter()
        _load_api(jk)
        import_s = time.perf_counter() - start
        built_ops = _counting_ops()
        start = time.perf_counter()
        call()
        first_s = time.perf_counter() - start
        print(
            json.dumps(
                {"first_s": first_s, "graph_ops": len(built_ops), "import_s": import_s}
            )
        )
        return
    timings, _ = measure(call, repeats, settled=settled)
    if method in TF_DP and method != TF_SGD:
        # a DP step against TensorFlow's plain SGD step, in this process
        timings["paired"] = paired(call, sgd_step(built))
    elif method not in ("plain step", TF_SGD) and case in PEER_CASES:
        # against TensorFlow's own plain step, alternating in this process
        timings["paired"] = paired(call, plain_step(built))
    strategy = None if not plans or plans[0] is None else plans[0].strategy.label
    extra = {}
    if grams:  # the Gram matrix's strategy, and how many targets took each form
        strategy = grams[0].strategy
        forms = list(grams[0].forms.values())
        extra["gram_forms"] = {form: forms.count(form) for form in sorted(set(forms))}
        # the arrangement kept and what each measured (its best timed call)
        arranged = grams[0].arrangement
        extra["gram_arrangement"] = {
            "kept": arranged.kept,
            "best_ms": {k: 1e3 * v for k, v in arranged.best_s.items()},
        }
    print(json.dumps({**timings, "strategy": strategy, **extra, "footing": record}))


def _load_api(jk: Any) -> None:
    """Load the modules behind the API the first calls use (``import
    jacobkit`` loads them on first use): ``jk.jacobian``, ``jk.gram`` and
    the reductions, and the planner and strategies they import."""
    for name in ("jacobian", "gram", "ClippedSum", "Project"):
        getattr(jk, name)


def _counting_ops() -> list[str]:
    """The op types TensorFlow's graph building creates from now on in this
    process (the ops of every trace: a private hook of TensorFlow's, read
    by this benchmark only)."""
    from tensorflow.python.framework import ops

    built: list[str] = []
    create = ops.Graph._create_op_internal

    def counted(graph: Any, op_type: str, *args: Any, **kwargs: Any) -> Any:
        built.append(op_type)
        return create(graph, op_type, *args, **kwargs)

    ops.Graph._create_op_internal = counted
    return built


#: the first calls compared with the plain step's (``--first-calls``)
FIRST_METHODS = ("plain step", "gram", "clipped sum", "projection")


def first_calls(me: list[str], case: str, rounds: int) -> dict:
    """Each of :data:`FIRST_METHODS`' first call in a fresh process, the
    processes alternating within each round; per method the median first
    call, the median per-round ratio to the plain step's of the same round
    and the graph ops its first call built."""
    import statistics

    found: dict[str, list[dict]] = {m: [] for m in FIRST_METHODS}
    for _ in range(rounds):
        for method in FIRST_METHODS:
            found[method].append(runs.run([*me, "--first", case, method]))
    out: dict[str, dict] = {}
    for method, each in found.items():
        ratios = [
            run["first_s"] / plain["first_s"]
            for run, plain in zip(each, found["plain step"], strict=True)
            if "error" not in run and "error" not in plain
        ]
        good = [run for run in each if "error" not in run]
        if not good:
            out[method] = {"error": each[-1].get("error")}
            continue
        out[method] = {
            "first_s": statistics.median(r["first_s"] for r in good),
            "ratio": statistics.median(ratios) if ratios else None,
            "ratios": ratios,
            "graph_ops": good[-1]["graph_ops"],
            "import_s": statistics.median(r.get("import_s", 0.0) for r in good),
        }
    return out


def plain_step(built: Any) -> Callable[[], list]:
    """One plain summed-gradient step of ``built``'s model on its batch, a
    ``tf.function`` taking the batch as its argument (as a train step
    does), its gradients fetched as NumPy arrays."""
    import reductions_models
    import tensorflow as tf

    fn, model = reductions_models.loss(built.name), built.model
    variables = model.trainable_variables

    @tf.function
    def step(x, y):
        with tf.GradientTape() as tape:
            total = tf.reduce_sum(fn(y, model(x)))
        return tape.gradient(total, variables)

    def call() -> list:
        return [tf.convert_to_tensor(g).numpy() for g in step(built.x, built.y)]

    return call


def sgd_step(built: Any) -> Callable[[], None]:
    """One plain SGD training step of ``built``'s model (forward, the
    batch's mean loss, backward, ``keras.optimizers.SGD(LR)``'s update), a
    ``tf.function`` taking the batch as its argument: the DP step's
    baseline, as ``torch.optim.SGD``'s step is Opacus's."""
    import keras
    import reductions_models
    import tensorflow as tf

    fn, model = reductions_models.loss(built.name), built.model
    optimizer = keras.optimizers.SGD(LR)
    variables = model.trainable_variables

    @tf.function
    def step(x, y):
        with tf.GradientTape() as tape:
            # inference mode, as the plain step, the reductions and the
            # peer (whose dropout is 0) run: the same function on both sides
            mean = tf.reduce_mean(fn(y, model(x)))
        optimizer.apply_gradients(zip(tape.gradient(mean, variables), variables))

    def call() -> None:
        step(built.x, built.y)

    return call


def _pinned_case(case: str, label: str) -> tuple[dict, Any, Any]:
    """A one-process child's start: TensorFlow pinned to one core with one
    thread (``footing``'s record of it), ``case`` built and its per-example
    loss: ``(record, built, loss)``."""
    os.environ["TF_CPP_MIN_LOG_LEVEL"] = "3"
    sys.path.insert(0, str(HERE))
    sys.path.insert(0, str(HERE / "peers"))
    import footing
    import reductions_models

    import jacobkit as jk

    record = footing.pin_tensorflow(label)
    built = reductions_models.CASES[case]()
    return record, built, jk.Loss(reductions_models.loss(case))


def child_paired(case: str, rounds: int) -> None:
    """The clipped sum against the plain step in one process: every round
    times ``PAIRED_CALLS`` calls of each (the order alternating) and takes
    the ratio of their medians; prints one JSON line with the median ratio
    over the rounds, its bootstrap interval and both medians. A busy
    machine slows both sides of a round alike, which ratios of runs in
    separate processes (the tables above) do not cancel."""
    import time

    record, built, loss = _pinned_case(case, "reductions --paired")
    import numpy as np

    import jacobkit as jk
    from jacobkit.bench import stats

    variables = built.model.trainable_variables

    def clipped() -> list:
        found = jk.jacobian(
            built.model,
            (built.x, built.y),
            variables,
            outputs=loss,
            reduce=jk.ClippedSum(CLIP),
        )
        return [np.asarray(v) for v in found.values()]

    sides = {"plain step": plain_step(built), "clipped sum": clipped}
    for call in sides.values():  # first calls and warm-up
        for _ in range(3):
            call()
    times: dict[str, list[float]] = {name: [] for name in sides}
    ratios = []
    for round_ in range(rounds):
        order = list(sides) if round_ % 2 == 0 else list(sides)[::-1]
        medians = {}
        for name in order:
            found = []
            for _ in range(PAIRED_CALLS):
                start = time.perf_counter()
                sides[name]()
                found.append(time.perf_counter() - start)
            medians[name] = float(np.median(found))
            times[name].append(medians[name])
        ratios.append(medians["clipped sum"] / medians["plain step"])
    found = stats.ratios(ratios)
    print(
        json.dumps(
            {
                "ratio": found.median,
                "low": found.low,
                "high": found.high,
                "rounds": found.n,
                "plain_ms": 1e3 * float(np.median(times["plain step"])),
                "clipped_ms": 1e3 * float(np.median(times["clipped sum"])),
                "footing": record,
            }
        )
    )


def child_maps(case: str, rounds: int) -> None:
    """``jk.Project(DIM)`` with CountSketch small maps (the default) and with
    Gaussian ones, and the plain step, in one process: each one's first call
    (in that order: the plain step, then either projection tracing its own
    graph and drawing its maps), then ``rounds`` rounds, each timing
    ``PAIRED_CALLS`` calls of every side (the order rotating); the median
    per-round ratio to the plain step with its 95% bootstrap interval."""
    import time

    record, built, loss = _pinned_case(case, "reductions --maps")
    import numpy as np

    import jacobkit as jk
    from jacobkit.bench import stats

    variables = built.model.trainable_variables

    def projection(small: str) -> Callable[[], Any]:
        def call() -> Any:
            found = jk.jacobian(
                built.model,
                (built.x, built.y),
                variables,
                outputs=loss,
                reduce=jk.Project(DIM, small=small),
            )
            return np.asarray(found.projection)

        return call

    sides = {
        "plain step": plain_step(built),
        "countsketch": projection("countsketch"),
        "gaussian": projection("gaussian"),
    }
    first = {}
    for name, call in sides.items():
        start = time.perf_counter()
        call()
        first[name] = time.perf_counter() - start
        for _ in range(2):
            call()
    times: dict[str, list[float]] = {name: [] for name in sides}
    ratios: dict[str, list[float]] = {"countsketch": [], "gaussian": [], "cs/g": []}
    names = list(sides)
    for round_ in range(rounds):
        order = names[round_ % 3 :] + names[: round_ % 3]
        medians = {}
        for name in order:
            found = []
            for _ in range(PAIRED_CALLS):
                start = time.perf_counter()
                sides[name]()
                found.append(time.perf_counter() - start)
            medians[name] = float(np.median(found))
            times[name].append(medians[name])
        ratios["countsketch"].append(medians["countsketch"] / medians["plain step"])
        ratios["gaussian"].append(medians["gaussian"] / medians["plain step"])
        ratios["cs/g"].append(medians["countsketch"] / medians["gaussian"])
    out: dict[str, Any] = {"footing": record, "rounds": rounds}
    for key, values in ratios.items():
        found_ratio = stats.ratios(values)
        out[key] = [found_ratio.median, found_ratio.low, found_ratio.high]
    out["steady_ms"] = {k: 1e3 * float(np.median(v)) for k, v in times.items()}
    out["first_s"] = first
    print(json.dumps(out))


def child_over(method: str, examples: int) -> None:
    """``gram``/``projection`` over a dataset of ``examples`` conv-net
    examples: TensorFlow's allocator peak (the pooled CPU allocator)."""
    os.environ["TF_CPP_MIN_LOG_LEVEL"] = "3"
    from jacobkit import memory

    memory.enable_cpu_memory_stats()
    sys.path.insert(0, str(HERE))
    import numpy as np
    import reductions_models
    import tensorflow as tf

    import jacobkit as jk

    built = reductions_models.convnet(batch=examples)
    data = tf.data.Dataset.from_tensor_slices((built.x, built.y)).batch(32)
    loss = jk.Loss(reductions_models.loss())
    model = built.model

    def call() -> list:
        if method == "gram":
            return [jk.gram(model, data, outputs=loss, chunk_examples=32).matrix]
        found = jk.jacobian(
            model, data, model.trainable_variables, outputs=loss, reduce=jk.Project(DIM)
        )
        # each target's part, and their sum: the result holds both
        return [*found.values(), found.projection]

    call()  # traced
    with memory.PeakMemory("CPU:0") as peak:
        result = call()
    result_mib = sum(np.asarray(r).size for r in result) * 4 / 2**20
    print(json.dumps({"peak_mib": peak.extra_bytes / 2**20, "result_mib": result_mib}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--child", nargs=2, metavar=("CASE", "METHOD"))
    parser.add_argument("--over", nargs=2, metavar=("METHOD", "EXAMPLES"))
    parser.add_argument("--paired", metavar="CASE")
    parser.add_argument("--maps", metavar="CASE")
    parser.add_argument(
        "--maps-only",
        action="store_true",
        help="rerun jk.Project's CountSketch against Gaussian small maps and "
        "the plain step in one process only (--cases), keeping --out's other "
        "figures",
    )
    parser.add_argument("--first", nargs=2, metavar=("CASE", "METHOD"))
    parser.add_argument(
        "--first-calls",
        action="store_true",
        help="rerun the first calls against the plain step's only (--cases), "
        "keeping --out's other figures",
    )
    parser.add_argument("--peers-python")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument(
        "--cases", default="convnet,mlp,bert,convnet_medium,bert_small,gpt2"
    )
    parser.add_argument("--out", default="benchmarks/results/cpu")
    parser.add_argument(
        "--loaded",
        action="store_true",
        help="label the results as measured on a machine loaded by other work",
    )
    parser.add_argument(
        "--merge",
        action="store_true",
        help="keep --out's other runs, replacing those of --cases",
    )
    parser.add_argument(
        "--paired-only",
        action="store_true",
        help="rerun the clipped sum against the plain step in one process only",
    )
    parser.add_argument(
        "--over-only",
        action="store_true",
        help="rerun the peaks over datasets only, keeping --out's timings",
    )
    args = parser.parse_args()
    if args.child:
        return child(*args.child, args.repeats)
    if args.over:
        return child_over(args.over[0], int(args.over[1]))
    if args.paired:
        return child_paired(args.paired, PAIRED_ROUNDS)
    if args.maps:
        return child_maps(args.maps, PAIRED_ROUNDS)
    if args.first:
        return child(*args.first, repeats=0, first_only=True)
    me = [sys.executable, str(Path(__file__).resolve())]
    out = Path(args.out)
    if args.first_calls:
        data = json.loads((out / "reductions.json").read_text())
        data["first_calls"] = {
            **data.get("first_calls", {}),
            **{
                case: {
                    "machine": runs.machine(),
                    "loaded": args.loaded,
                    "rounds": args.rounds,
                    "methods": first_calls(me, case, args.rounds),
                }
                for case in args.cases.split(",")
            },
        }
        return _write(data, out)
    if args.maps_only:
        data = json.loads((out / "reductions.json").read_text())
        state = f"{runs.machine()}{', loaded' if args.loaded else ''}"
        data["maps"] = {
            **data.get("maps", {}),
            **{
                case: {**runs.run([*me, "--maps", case]), "measured_on": state}
                for case in args.cases.split(",")
            },
        }
        return _write(data, out)
    if args.over_only or args.paired_only:
        data = json.loads((out / "reductions.json").read_text())
        if args.over_only:
            data["over"] = _over(me)
        if args.paired_only:
            data["paired"] = {
                **data.get("paired", {}),
                **{
                    case: runs.run([*me, "--paired", case])
                    for case in args.cases.split(",")
                },
            }
            data["machine"] = runs.machine()
        data["loaded"] = args.loaded
        return _write(data, out)
    commands: dict[str, list[str]] = {}
    sys.path.insert(0, str(HERE))
    import reductions_models

    cases = args.cases.split(",")
    for case in cases:
        own = reductions_models.ONLY.get(case, METHODS)
        dp = (TF_SGD,) if case in DP_CASES and args.peers_python else ()
        for method in (*own, *dp):
            commands[f"{case}|{method}"] = [
                *me,
                "--child",
                case,
                method,
                "--repeats",
                str(reductions_models.REPEATS.get(case, args.repeats)),
            ]
    work = Path(tempfile.mkdtemp())
    for case in PEER_CASES if args.peers_python else ():
        if case not in cases:
            continue
        npz = work / f"{case}.npz"
        export = [sys.executable, str(HERE / "peers/export_reductions.py")]
        subprocess.run(
            [*export, "--case", case, "--out", str(npz)],
            check=True,
            capture_output=True,
        )
        for label, method in {**PEERS, **DP_PEERS}.items():
            if method in PEER_SKIP.get(case, ()):
                continue
            commands[f"{case}|{label}"] = [
                args.peers_python,
                str(HERE / "peers/reductions_torch.py"),
                "--npz",
                str(npz),
                "--repeats",
                str(reductions_models.REPEATS.get(case, args.repeats)),
                "--method",
                method,
            ]
    data = {
        "machine": runs.machine(),
        "loaded": args.loaded,
        "rounds": args.rounds,
        "repeats": args.repeats,
        "runs": runs.rounds(commands, args.rounds),
        "paired": {case: runs.run([*me, "--paired", case]) for case in cases},
        "over": {} if args.merge else _over(me),
    }
    # which machine and load each case was measured on: a merged file keeps
    # the other cases of an earlier run, perhaps of another machine
    state = f"{data['machine']}{', loaded' if args.loaded else ''}"
    data["case_machines"] = {case: state for case in cases}
    data["case_rounds"] = {case: args.rounds for case in cases}
    if args.merge:
        kept = json.loads((out / "reductions.json").read_text())
        earlier = {
            case: kept.get("machine", "not recorded")
            for case in {k.split("|")[0] for k in kept["runs"]}
        }
        data["case_machines"] = {
            **earlier,
            **kept.get("case_machines", {}),
            **data["case_machines"],
        }
        data["runs"] = {
            **{k: v for k, v in kept["runs"].items() if k.split("|")[0] not in cases},
            **data["runs"],
        }
        # the page's header tells the earlier runs' rounds; each merged case
        # its own beside its machine
        data["rounds"], data["repeats"] = kept["rounds"], kept["repeats"]
        data["case_rounds"] = {
            **kept.get("case_rounds", {}),
            **data["case_rounds"],
        }
        data["paired"] = {**kept.get("paired", {}), **data["paired"]}
        data["over"] = kept["over"]
        data["first_calls"] = kept.get("first_calls", {})
        data["maps"] = kept.get("maps", {})
        data["over_machine"] = kept.get("over_machine", kept.get("machine"))
    _write(data, out)


def _over(me: list[str]) -> dict[str, dict]:
    return {
        f"{method} over {n}": runs.run([*me, "--over", method, str(n)])
        for method in ("gram", "projection")
        for n in SIZES
    }


def _write(data: dict, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "reductions.json").write_text(json.dumps(data, indent=1))
    page = out / "reductions.md"
    text = _markdown(data)
    kept = _hand_sections(page.read_text() if page.exists() else "", text)
    page.write_text(text.rstrip("\n") + "\n" + "".join("\n" + s for s in kept))
    print(text)


def _hand_sections(old: str, new: str) -> list[str]:
    """The ``##`` and ``###`` sections of the page as it was whose headings
    the new page does not have: written by hand beside the generated tables
    (notes of a hand-run measurement; the generator writes no ``###``), kept
    at the end in their order."""
    import re

    titles = set(re.findall(r"^#{2,3} .*$", new, flags=re.MULTILINE))
    parts = re.split(r"^(?=#{2,3} )", old, flags=re.MULTILINE)[1:]
    return [
        part.rstrip("\n") + "\n" for part in parts if part.splitlines()[0] not in titles
    ]


def _markdown(data: dict) -> str:
    import reductions_models

    measured = data["runs"]
    fewer = ", ".join(f"{c}: {n}" for c, n in reductions_models.REPEATS.items())
    lines = [
        "# Reductions of per-example gradients against materializing them",
        "",
        "Written by `benchmarks/reductions.py`: batch 32, every trainable "
        "variable, per-example cross-entropy (on `gpt2`, a causal LM: each "
        "sequence's mean next-token cross-entropy over its 32 positions); "
        "one core (`taskset -c N`), fresh "
        f"processes, median of {data['rounds']} rounds of {data['repeats']} "
        f"steady calls ({fewer}). Ratios are within a model's rows of this one "
        "run.",
        "",
        f"Machine: {data.get('machine', 'not recorded')}.",
        "",
        *_footing(data),
    ]
    machines = data.get("case_machines", {})
    for case in sorted({k.split("|")[0] for k in measured}):
        lines += [
            f"## {case}",
            "",
            f"Measured on: {machines.get(case, data.get('machine'))}"
            + (
                f"; {data['case_rounds'][case]} round(s)."
                if case in data.get("case_rounds", {})
                else "."
            ),
            "",
            "| run | steady ms | × own plain step | paired in one process "
            "(95% interval) | × materialized | first call s | "
            "first 3 calls s | steady growth MiB | first-call growth MiB | strategy |",
            "|---|---|---|---|---|---|---|---|---|---|",
        ]
        for key, row in measured.items():
            label = key.split("|", 1)[1]
            if not key.startswith(case + "|") or label in DP_PEERS or label in TF_DP:
                continue
            label = key.split("|", 1)[1]
            base = measured.get(f"{case}|{_own_plain(label)}", {}).get("steady_s")
            if "error" in row:
                lines.append(f"| {label} | {_failure(row)} | | | | | | | | |")
                continue
            steady = row["steady_s"]
            versus = ""
            twin = measured.get(f"{case}|materialized {label.split()[-1]}", {})
            own = label in OWN and not label.startswith("materialized")
            if own and twin.get("steady_s"):
                versus = f"{steady / twin['steady_s']:.2f}"
            lines.append(
                f"| {label} | {steady * 1e3:.1f} | "
                f"{steady / base:.2f} | {_paired_cell(row)} | {versus} | "
                f"{row['first_s']:.2f} | "
                f"{row['first_three_s']:.2f} | {row['peak_growth_mib']:.1f} | "
                f"{row.get('first_growth_mib', float('nan')):.1f} | "
                f"{row.get('strategy') or ''} |"
                if base
                else f"| {label} | {steady * 1e3:.1f} | | | | | | | | |"
            )
        lines += _fastest_opacus(case, measured)
        lines += _versus_peers(case, measured)
        lines += ["", *_floor(case, measured)]
    for case in PEER_CASES:
        lines += _dp_step(case, measured)
    lines += _paired(data.get("paired", {}))
    lines += _maps(data.get("maps", {}))
    lines += _first_calls(data.get("first_calls", {}))
    lines += [
        "## Peak over a dataset (conv net, batches of 32)",
        "",
        f"Measured on: {data.get('over_machine', data.get('machine'))}.",
        "",
        "TensorFlow's allocator peak during the call (its pooled CPU allocator), "
        "beside the result's own size (a projection's result holds each "
        "target's part and their sum; the Gram matrix is float64, in NumPy):",
        "",
        "| run | peak MiB | result MiB |",
        "|---|---|---|",
    ]
    for key, row in data["over"].items():
        if "error" in row:
            lines.append(f"| {key} | error: {row['error']} | |")
        else:
            lines.append(f"| {key} | {row['peak_mib']:.1f} | {row['result_mib']:.2f} |")
    return "\n".join(lines) + "\n"


def _failure(row: dict) -> str:
    """A run that printed no timing, in words: a peer's reason (``not
    supported (...)``, ``disagrees with jacobkit (...)``) or the error's
    last line; never a number."""
    found = row["error"]
    text = " ".join(found) if isinstance(found, list) else str(found)
    text = text.removeprefix("reductions_torch: ").replace("|", "/")
    text = text.split(" (against jacobkit's results")[0]  # not the file's path
    text = text.split(" (checked against jacobkit's results")[0]
    reasons = (" not supported (", " disagrees with jacobkit (")
    return text if any(r in text for r in reasons) else f"error: {text}"


def _versus_peers(case: str, measured: dict) -> list[str]:
    """Issue 50's comparison: each reduction's time over TensorFlow's plain
    step against the fastest correct PyTorch method's over PyTorch's plain
    step (paired in one process where measured so), their quotient and the
    goal: at most the PyTorch method's ratio; on the transformers
    (:data:`TRANSFORMERS`) at most :data:`TRANSFORMER_GOAL`."""
    torch_base = measured.get(f"{case}|{TORCH_PLAIN}", {}).get("steady_s")
    tf_base = measured.get(f"{case}|plain step", {}).get("steady_s")
    rows = []
    for kind, peers in KIND_PEERS.items():
        ours = _ratio(measured.get(f"{case}|{kind}", {}), tf_base)
        good = {
            label: found
            for label in peers
            if (found := _ratio(measured.get(f"{case}|{label}", {}), torch_base))
            is not None
        }
        if ours is None or not good:
            continue
        best = min(good, key=good.__getitem__)
        goal = TRANSFORMER_GOAL if case in TRANSFORMERS else good[best]
        rows.append(
            f"| {kind} | {ours:.2f} | {best} | {good[best]:.2f} | "
            f"{ours / good[best]:.2f} | ≤ {goal:.2f}: "
            f"{'met' if ours <= goal else 'not met'} |"
        )
    if not rows:
        return []
    return [
        "jacobkit against the fastest correct PyTorch method (issue 50), each "
        "per unit of its own framework's plain step (paired in one process "
        "where it was); a peer that failed or disagreed with jacobkit's "
        "result is not a candidate. Goal: jacobkit's ratio at most the "
        "PyTorch method's; on the transformers, where PyTorch has no closed "
        f"forms for attention or LayerNorm, at most {TRANSFORMER_GOAL}:",
        "",
        "| reduction | jacobkit × TF plain step | fastest correct PyTorch "
        "| its × PyTorch plain step | jacobkit ÷ PyTorch | goal |",
        "|---|---|---|---|---|---|",
        *rows,
        "",
    ]


def _paired_cell(row: dict) -> str:
    """A run's paired ratio to its own plain step (``protocol.paired``):
    the median with its 95% interval."""
    found = row.get("paired")
    if not found:
        return ""
    return f"{found['ratio']:.2f} ({found['low']:.2f}–{found['high']:.2f})"


def _ratio(row: dict, base: float | None) -> float | None:
    """A run's ratio to its own plain step: paired in its process where it
    was, else of the separate processes' medians."""
    if row.get("paired"):
        return float(row["paired"]["ratio"])
    return row["steady_s"] / base if base and "steady_s" in row else None


def _own_plain(label: str) -> str:
    """The plain step a run is divided by: its own framework's."""
    return TORCH_PLAIN if label.startswith(("PyTorch", "Opacus")) else "plain step"


def _footing(data: dict) -> list[str]:
    """How the runs were pinned, each side's machine record and versions,
    and whether the machine was loaded."""
    sys.path.insert(0, str(HERE / "peers"))
    import footing

    sides: dict[str, dict] = {}
    for row in data["runs"].values():
        record = row.get("footing")
        if record:
            sides.setdefault(record["side"], record)
    if not sides:
        return ["No footing recorded for this run (before the one-thread check).", ""]
    lines = [
        "Each side on equal footing: one thread (PyTorch's intra- and inter-op "
        "threads; TensorFlow's intra- and inter-op parallelism), every process "
        "pinned to one core (the scripts refuse to run unpinned), and every "
        "time divided by the same framework's plain step on the same model "
        "and batch (× own plain step).",
        "",
        *[f"- {footing.describe(record)}" for _, record in sorted(sides.items())],
        "",
    ]
    if data.get("loaded"):
        lines += [
            "**Measured on a loaded machine** (the cases marked loaded: 2 "
            "cores shared with other work): absolute times are inflated "
            "and noisy; the ratios to each framework's own plain step are "
            "what to read, and even they move by more than on a quiet machine.",
            "",
        ]
    return lines


def _fastest_opacus(case: str, measured: dict) -> list[str]:
    """Which Opacus mode the comparison takes as the peer: the fastest of
    those whose clipped sums matched jacobkit's (a mode that disagreed or
    failed printed no timing)."""
    base = measured.get(f"{case}|{TORCH_PLAIN}", {}).get("steady_s")
    good = {
        label: found
        for label in PEERS
        if label.startswith("Opacus")
        and (found := _ratio(measured.get(f"{case}|{label}", {}), base)) is not None
    }
    if not good:
        return [""]
    best = min(good, key=good.__getitem__)
    ours = _ratio(
        measured.get(f"{case}|clipped sum", {}),
        measured.get(f"{case}|plain step", {}).get("steady_s"),
    )
    line = (
        f"Opacus's fastest correct mode here: {best.split(',')[0]} "
        f"({good[best]:.2f} × PyTorch's plain step)"
    )
    if ours:
        line += f"; jacobkit's clipped sum: {ours:.2f} × TensorFlow's plain step"
    return ["", line + ".", ""]


def _dp_step(case: str, measured: dict) -> list[str]:
    """The DP-SGD training step over the same framework's plain training
    step (issue 49): Opacus's modes now; jacobkit's compiled DP ``fit``
    step goes beside them when it lands."""
    rows = {
        k.split("|", 1)[1]: v
        for k, v in measured.items()
        if k.startswith(case + "|") and k.split("|", 1)[1] in (*DP_PEERS, *TF_DP)
    }
    if not rows:
        return []
    bases = {
        "PyTorch": rows.get(TORCH_SGD, {}).get("steady_s"),
        "TensorFlow": rows.get(TF_SGD, {}).get("steady_s"),
    }
    lines = [
        f"## DP-SGD training step ÷ the same framework's plain step ({case})",
        "",
        "One training step on the batch: forward, backward, the update (SGD, "
        f"learning rate {LR}), each framework's DP step over its own plain "
        "SGD step on the same weights. Opacus's DP-SGD step (`make_private`, "
        "flat clipping at C = 1, Gaussian noise σ = 1, no Poisson sampling: "
        "one batch of 32) in each of its modes; each mode is checked first (a "
        "noiseless twin's update at learning rate 1, times the batch, must "
        "equal jacobkit's clipped sum within 1e-4). TensorFlow's plain SGD "
        "step is a `tf.function` of the batch with `keras.optimizers.SGD`; "
        f"jacobkit's compiled DP step (`{TF_DP[1]}`) goes beside it when it "
        "lands.",
        "",
        "| step | framework | steady ms | × own plain SGD step | paired in one "
        "process (95% interval) | clipped sum error |",
        "|---|---|---|---|---|---|",
    ]
    for label, row in rows.items():
        side = "TensorFlow" if label in TF_DP else "PyTorch"
        if "error" in row:
            lines.append(f"| {label} | {side} | {_failure(row)} | | | |")
            continue
        base = bases[side]
        ratio = f"{row['steady_s'] / base:.2f}" if base else ""
        err = f"{row['clipped_err']:.1e}" if "clipped_err" in row else ""
        lines.append(
            f"| {label} | {side} | {row['steady_s'] * 1e3:.1f} | {ratio} | "
            f"{_paired_cell(row)} | {err} |"
        )
    base = bases["PyTorch"]
    good = {
        label: found
        for label, row in rows.items()
        if label in DP_PEERS
        and label != TORCH_SGD
        and (found := _ratio(row, base)) is not None
    }
    if good:
        best = min(good, key=good.__getitem__)
        lines += [
            "",
            f"Opacus's fastest correct DP step here: {best.split(',')[0]} "
            f"({good[best]:.2f} × PyTorch's plain SGD step).",
        ]
    return [*lines, ""]


#: the issue's goal for the Gram matrix and the projection: at most this
#: many times materializing the per-example gradients
GOAL = 0.5


def _paired(paired: dict) -> list[str]:
    """The clipped sum ÷ the plain step, both in one process (``--paired``)."""
    if not paired:
        return []
    lines = [
        "## The clipped sum ÷ the plain step, in one process",
        "",
        f"Each model in one fresh process: {PAIRED_ROUNDS} rounds, each timing "
        f"{PAIRED_CALLS} calls of either side (the order alternating), the "
        "ratio of their medians per round; the median ratio with its 95% "
        "bootstrap interval. Where the machine is shared, a round's slowdown "
        "falls on both sides alike; the runs above, in separate processes, "
        f"move by ±10% from run to run. Goal: ≤ {CLIP_GOAL}.",
        "",
        "| model | clipped sum ÷ plain step | 95% interval | plain step ms | "
        "clipped sum ms |",
        "|---|---|---|---|---|",
    ]
    for case, found in sorted(paired.items()):
        if "error" in found:
            lines.append(f"| {case} | failed: {found['error']} | | | |")
            continue
        interval = (
            f"{found['low']:.2f}–{found['high']:.2f}"
            if found.get("low") is not None
            else ""
        )
        lines.append(
            f"| {case} | {found['ratio']:.2f} | {interval} | "
            f"{found['plain_ms']:.1f} | {found['clipped_ms']:.1f} |"
        )
    return [*lines, ""]


def _maps(maps: dict) -> list[str]:
    """``jk.Project``'s small maps, CountSketch against Gaussian, beside the
    plain step in one process (``--maps``)."""
    if not maps:
        return []
    lines = [
        "## jk.Project's small maps: CountSketch against Gaussian, in one process",
        "",
        f"`jk.Project({DIM})` with the small targets' maps (at most "
        "`DENSE_ELEMENTS` numbers: biases, norms' scales and offsets, small "
        "tables and kernels) CountSketches (the default) and Gaussian "
        '(`small="gaussian"`), and the plain step: each model in one fresh '
        f"process, {PAIRED_ROUNDS} rounds timing {PAIRED_CALLS} calls of each "
        "(the order rotating), the median per-round ratio and its 95% "
        "bootstrap interval; first calls in that process, in that order.",
        "",
        "| model | measured on | CountSketch ÷ plain | Gaussian ÷ plain | "
        "CountSketch ÷ Gaussian | steady ms plain / CS / Gaussian | "
        "first call s plain / CS / Gaussian |",
        "|---|---|---|---|---|---|---|",
    ]
    for case, found in sorted(maps.items()):
        if "error" in found:
            lines.append(f"| {case} | failed: {found['error']} | | | | | |")
            continue

        def cell(key: str, found: dict = found) -> str:
            median, low, high = found[key]
            return f"{median:.2f} ({low:.2f}–{high:.2f})"

        steady = " / ".join(f"{v:.1f}" for v in found["steady_ms"].values())
        first = " / ".join(f"{v:.2f}" for v in found["first_s"].values())
        lines.append(
            f"| {case} | {found.get('measured_on', '')} | {cell('countsketch')} | "
            f"{cell('gaussian')} | {cell('cs/g')} | {steady} | {first} |"
        )
    return [*lines, ""]


def _first_calls(first: dict) -> list[str]:
    """The first calls over the plain step's (``--first-calls``)."""
    if not first:
        return []
    lines = [
        "## First calls ÷ the plain step's first call",
        "",
        "Each method's first call (tracing included) in its own fresh process, "
        "the processes alternating within each round; the median of the "
        "per-round ratios to the plain step's first call of the same round, and "
        "the graph ops TensorFlow built during the call (every trace: the "
        "inspecting pass, the checks, the computation). jacobkit's own modules "
        "are loaded before the clock starts (``import jacobkit`` loads them on "
        "the first use of its API), as TensorFlow's and Keras's are for the "
        "plain step; their load time is the last column, once per process. "
        "Goal: ≤ 1.5.",
        "",
        "| model | run | first call s | ÷ plain step's first call | per round | "
        "graph ops | jacobkit's modules loaded, s |",
        "|---|---|---|---|---|---|---|",
    ]
    for case, found in sorted(first.items()):
        loaded = ", loaded" if found.get("loaded") else ""
        for method, row in found["methods"].items():
            if "error" in row:
                lines.append(f"| {case} | {method} | error: {row['error']} | | | | |")
                continue
            ratio = "" if row["ratio"] is None else f"{row['ratio']:.2f}"
            each = ", ".join(f"{r:.2f}" for r in row["ratios"])
            lines.append(
                f"| {case} | {method} | {row['first_s']:.2f} | {ratio} | {each} | "
                f"{row['graph_ops']:,} | {_loaded_cell(method, row)} |"
            )
        lines.append(
            f"\n{case}: {found['rounds']} rounds on {found['machine']}{loaded}.\n"
        )
    return [*lines, ""]


def _loaded_cell(method: str, row: dict) -> str:
    """The load time of jacobkit's modules in a first call's process (none
    for the plain step, which uses none; not measured before this column)."""
    if method == "plain step" or "import_s" not in row:
        return ""
    return f"{row['import_s']:.2f}"


def _floor(case: str, measured: dict) -> list[str]:
    """The case's floor line: how far below materializing a Gram matrix or
    a projection can go. Either computes every example's cotangents at
    every layer, one forward and one backward pass of the batch: about the
    plain step (whose weight gradients it replaces by its own per-layer
    products)."""
    base = measured.get(f"{case}|plain step", {}).get("steady_s")
    found = {}
    for kind in ("gram", "projection"):
        twin = measured.get(f"{case}|materialized {kind}", {}).get("steady_s")
        if base and twin:
            found[kind] = base / twin
    if not found:
        return []
    below = [k for k, v in found.items() if v > GOAL]
    shown = ", ".join(f"{k} {v:.2f}" for k, v in found.items())
    line = (
        "Floor: a Gram matrix or a projection computes every example's "
        "cotangents at every layer, one forward and one backward pass of the "
        "batch, about the plain step; × materialized cannot go much below "
        f"plain step ÷ materialized: {shown}."
    )
    if below:
        line += (
            f" The goal (≤ {GOAL} × materialized) lies below that floor "
            f"for: {', '.join(below)}."
        )
    return [line, ""]


if __name__ == "__main__":
    main()
