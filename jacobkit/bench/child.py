"""What runs inside each benchmark subprocess.

The runner starts a fresh process per task, so that peak memory starts clean
and one strategy's crash or time limit cannot take the suite down. Each task
is a plain dict; the child writes its answer as JSON to ``result_path`` (and
the reference Jacobians to an ``.npz`` file) and exits. Four kinds:

- ``probe``: the device's name and the TensorFlow and Keras versions;
- ``reference``: the reference Jacobians of one problem;
- ``measure``: one strategy on one problem, through
  :func:`jacobkit.bench.measure.measure` (a benchmark problem, or the problem
  of ``jacobkit compare``: its built-in generator or a saved model);
- ``first_call``: the first call alone (:func:`jacobkit.bench.measure.first_call_s`),
  for first calls paired in alternating fresh processes.

Everything runs under ``tf.device(task["device"])``; peak memory is measured
on that device.
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback
from typing import Any

import numpy as np

#: how a failure reads in the results, by the words in its message
_FAILURE_KINDS = (
    ("ResourceExhausted", "out_of_memory"),
    ("OOM", "out_of_memory"),
    ("MemoryError", "out_of_memory"),
    ("vectoriz", "vectorization"),
    ("pfor", "vectorization"),
)


def classify_failure(error: str) -> str:
    """``"out_of_memory"``, ``"vectorization"`` or ``"error"``, from an
    ``"ExceptionName: message"`` string."""
    for words, kind in _FAILURE_KINDS:
        if words.lower() in error.lower():
            return kind
    return "error"


def main(task: dict[str, Any], result_path: str, log_path: str) -> None:
    """Run ``task`` and write its JSON answer to ``result_path``; TensorFlow's
    own output goes to ``log_path``."""
    _redirect_output(log_path)
    try:
        answer = _TASKS[task["kind"]](task)
    except Exception as err:  # a failure is a result: record it, whatever it is
        traceback.print_exc()
        message = f"{type(err).__name__}: {_first_line(err)}"[:300]
        answer = {"error": message, "failure": classify_failure(message)}
    with open(result_path + ".part", "w") as out:
        json.dump(answer, out)
    os.replace(result_path + ".part", result_path)


def _redirect_output(log_path: str) -> None:
    sys.stdout.flush()
    sys.stderr.flush()
    log = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.close(log)


def _first_line(err: BaseException) -> str:
    text = str(err).strip()
    return text.splitlines()[0] if text else ""


def _check_device(device: str) -> None:
    import tensorflow as tf

    kind = device.split(":")[0]
    if not tf.config.list_physical_devices(kind):
        raise RuntimeError(
            f"--device {device}: TensorFlow sees no {kind} here "
            f"(visible: {[d.name for d in tf.config.list_physical_devices()]})."
        )


def _probe(task: dict[str, Any]) -> dict[str, Any]:
    import keras
    import tensorflow as tf

    device = task["device"]
    _check_device(device)
    name = task.get("cpu_model") or "CPU"
    if device.startswith("GPU"):
        index = int(device.split(":")[1])
        physical = tf.config.list_physical_devices("GPU")[index]
        details = tf.config.experimental.get_device_details(physical)
        name = details.get("device_name", physical.name)
    return {
        "device": device,
        "device_name": name,
        "tensorflow": tf.__version__,
        "keras": keras.__version__,
    }


def _build(task: dict[str, Any], dtype: str) -> tuple[Any, Any, Any]:
    """The model, its inputs and the Problem, built the same way in every
    child: the example ``task["builder"]`` at ``task["sizes"]``, or (``jacobkit
    compare --model``) the saved model at ``task["model_path"]`` with the
    ``.npy`` inputs at ``task["inputs_path"]``."""
    import keras

    from jacobkit.problem import Problem
    from jacobkit.testing import examples

    if task.get("model_path"):
        from jacobkit.keras import saved

        model = saved.load(task["model_path"])
        inputs, layer = np.load(task["inputs_path"]), task["layer"]
    else:
        # Same seed in every process: builders that draw initial weights from
        # Keras's generator (the ResNet) get the same weights each time.
        keras.utils.set_random_seed(task.get("seed", 0))
        example = examples.build(task["builder"], dtype, **task["sizes"])
        model, inputs = example.model, example.inputs
        layer = task["layer"] or example.layer
    problem = Problem(
        model, inputs, layer, outputs=task["outputs"], features=task.get("features")
    )
    return model, inputs, problem


def _reference(task: dict[str, Any]) -> dict[str, Any]:
    import tensorflow as tf

    from jacobkit import strategies, testing

    _check_device(task["device"])
    start = time.perf_counter()
    with tf.device(task["device"]):
        if task["reference"] == "float64":
            # a float64 copy of the float32 build: a float64 build may keep
            # float32 parts (ResNet50 takes no dtype)
            model, inputs, problem = _build(task, "float32")
            reference = testing.float64_reference(
                model,
                inputs,
                list(problem.targets),
                outputs=task["outputs"],
                call_kwargs={"training": False},
                baseline=False,
            )
            if not reference.description.startswith("float64"):
                raise ValueError(f"no float64 reference: {reference.description}")
            jacobians = list(reference)
        elif task["reference"] == "float32-loop":
            *_, problem = _build(task, "float32")
            jacobians = [np.asarray(j) for j in strategies.Loop().run(problem)[0]]
        else:
            raise ValueError(f"unknown reference kind {task['reference']!r}")
    np.savez(task["reference_path"], *jacobians)
    return {"seconds": time.perf_counter() - start, "num_rows": problem.num_rows}


def _strategy_of(task: dict[str, Any]) -> Any:
    """The task's configured strategy, or ``None`` for auto (whose plan cache,
    empty before the cold run and its result after, is set up here; without
    ``task["plan_cache"]``, the user's), once the device is checked."""
    from jacobkit import strategies

    _check_device(task["device"])
    if task["strategy"] == "auto":
        if task.get("plan_cache") is not None:
            os.environ["JACOBKIT_CACHE_DIR"] = task["plan_cache"]
        return None
    return strategies.from_spec(task["spec"])


def _measure(task: dict[str, Any]) -> dict[str, Any]:
    import tensorflow as tf

    from jacobkit import strategies
    from jacobkit.bench import measure

    strategy = _strategy_of(task)
    auto = strategy is None
    reference = None
    if task.get("reference_path") and os.path.exists(task["reference_path"]):
        with np.load(task["reference_path"]) as saved:
            reference = [saved[f"arr_{i}"] for i in range(len(saved.files))]
    with tf.device(task["device"]):
        *_, problem = _build(task, "float32")
        paired = own = None
        if auto:
            measured = measure.measure_auto(
                problem,
                reference,
                repeats=task["repeats"],
                device=task["device"],
                memory_budget=task.get("memory_budget"),
                held_calls=task.get("held_calls", 0),
            )
            if task.get("pair_with") and not measured.error:
                paired = measure.paired_rounds(
                    problem,
                    strategies.from_spec(task["pair_with"]),
                    rounds=task["repeats"],
                    device=task["device"],
                )
                if measured.ran_spec != task["pair_with"]:
                    # auto's per-call overhead: against what it runs, fixed
                    own = measure.paired_rounds(
                        problem,
                        strategies.from_spec(measured.ran_spec),
                        rounds=task["repeats"],
                        device=task["device"],
                    )
                else:
                    own = paired
        else:
            measured = measure.measure(
                problem,
                strategy,
                reference,
                repeats=task["repeats"],
                device=task["device"],
                held_calls=task.get("held_calls", 0),
            )
    answer = measured.as_dict()
    # the runner's label stays the row's label; what ran (auto: what it
    # settled on) is recorded beside it
    answer["ran"] = answer.pop("strategy")
    answer["num_rows"] = problem.num_rows
    if paired is not None:
        answer["paired"] = paired.as_dict()
    if own is not None:
        answer["overhead"] = own.as_dict()
    if measured.error:
        answer["failure"] = classify_failure(measured.error)
    return answer


def _first_call(task: dict[str, Any]) -> dict[str, Any]:
    import tensorflow as tf

    from jacobkit.bench.measure import first_call_s

    strategy = _strategy_of(task)
    with tf.device(task["device"]):
        *_, problem = _build(task, "float32")
        seconds = first_call_s(problem, strategy, device=task["device"])
    return {"first_call_s": seconds}


_TASKS = {
    "probe": _probe,
    "reference": _reference,
    "measure": _measure,
    "first_call": _first_call,
}
