"""What runs inside each child process of :mod:`jacobkit.bench.processes`.

``jacobkit compare`` starts a fresh process per strategy, so that peak memory
starts clean and one strategy's crash or time limit cannot take the others
down. Each task is a plain dict; the child writes its answer as JSON to
``result_path`` and exits. One kind here, ``measure``: one strategy (or
auto) on one problem, through :func:`jacobkit.bench.measure.measure` (the
problem of ``jacobkit compare``: its built-in generator or a saved model, or
a problem of the benchmark suite, which adds its own kinds of task on top of
these: :func:`run` takes the table of kinds).

Everything runs under ``tf.device(task["device"])``; peak memory is measured
on that device.
"""

from __future__ import annotations

import json
import os
import sys
import traceback
from collections.abc import Callable, Mapping
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


#: a kind of task: the task -> its JSON answer
Task = Callable[[dict[str, Any]], dict[str, Any]]


def main(task: dict[str, Any], result_path: str, log_path: str) -> None:
    """Run ``task`` (a kind of :data:`TASKS`): see :func:`run`."""
    run(task, result_path, log_path, TASKS)


def run(
    task: dict[str, Any], result_path: str, log_path: str, tasks: Mapping[str, Task]
) -> None:
    """Run ``task`` by its kind in ``tasks`` and write its JSON answer to
    ``result_path``; TensorFlow's own output goes to ``log_path``."""
    _redirect_output(log_path)
    try:
        answer = tasks[task["kind"]](task)
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


def check_device(device: str) -> None:
    import tensorflow as tf

    kind = device.split(":")[0]
    if not tf.config.list_physical_devices(kind):
        raise RuntimeError(
            f"--device {device}: TensorFlow sees no {kind} here "
            f"(visible: {[d.name for d in tf.config.list_physical_devices()]})."
        )


def build(task: dict[str, Any], dtype: str) -> tuple[Any, Any, Any]:
    """The model, its inputs and the Problem, built the same way in every
    child: the example ``task["builder"]`` at ``task["sizes"]``, or (``jacobkit
    compare --model``) the saved model at ``task["model_path"]`` with the
    ``.npy`` inputs at ``task["inputs_path"]``."""
    import keras

    from jacobkit.problem import Call
    from jacobkit.testing import examples

    if task.get("model_path"):
        from jacobkit.keras import saved

        custom = task.get("custom_objects")
        objects = (
            saved.custom_objects(custom, search=task.get("import_path"))
            if custom
            else None
        )
        model = saved.load(task["model_path"], custom_objects=objects)
        inputs, layer = np.load(task["inputs_path"]), task["layer"]
    else:
        # Same seed in every process: builders that draw initial weights from
        # Keras's generator (the ResNet) get the same weights each time.
        keras.utils.set_random_seed(task.get("seed", 0))
        example = examples.build(task["builder"], dtype, **task["sizes"])
        model, inputs = example.model, example.inputs
        layer = task["layer"] or example.layer
    call = Call(model, layer, outputs=task["outputs"], features=task.get("features"))
    problem = call.problem(inputs)
    return model, inputs, problem


def strategy_of(task: dict[str, Any]) -> Any:
    """The task's configured strategy, or ``None`` for auto (whose plan cache,
    empty before the cold run and its result after, is set up here; without
    ``task["plan_cache"]``, the user's), once the device is checked."""
    from jacobkit import strategies

    check_device(task["device"])
    if task["strategy"] == "auto":
        if task.get("plan_cache") is not None:
            os.environ["JACOBKIT_CACHE_DIR"] = task["plan_cache"]
        return None
    return strategies.from_spec(task["spec"])


#: more of a ``measure`` task's answer, from the problem and its measurement
#: (the benchmark suite's paired rounds), computed under the task's device
Extra = Callable[[dict[str, Any], Any, Any], dict[str, Any]]


def measure_task(task: dict[str, Any], extra: Extra | None = None) -> dict[str, Any]:
    """One strategy (``task["spec"]``) or auto on the task's problem, against
    the reference saved at ``task["reference_path"]`` if any; the answer is
    the :class:`~jacobkit.bench.measure.Measurement`, with
    ``extra(task, problem, measurement)`` added."""
    import tensorflow as tf

    from jacobkit.bench import measure

    strategy = strategy_of(task)
    reference = None
    if task.get("reference_path") and os.path.exists(task["reference_path"]):
        with np.load(task["reference_path"]) as saved:
            reference = [saved[f"arr_{i}"] for i in range(len(saved.files))]
    more: dict[str, Any] = {}
    with tf.device(task["device"]):
        *_, problem = build(task, "float32")
        if strategy is None:
            measured = measure.measure_auto(
                problem,
                reference,
                repeats=task["repeats"],
                device=task["device"],
                memory_budget=task.get("memory_budget"),
                held_calls=task.get("held_calls", 0),
            )
        else:
            measured = measure.measure(
                problem,
                strategy,
                reference,
                repeats=task["repeats"],
                device=task["device"],
                held_calls=task.get("held_calls", 0),
            )
        if extra is not None:
            more = extra(task, problem, measured)
    answer = measured.as_dict()
    # the caller's label stays the row's label; what ran (auto: what it
    # settled on) is recorded beside it
    answer["ran"] = answer.pop("strategy")
    answer["num_rows"] = problem.num_rows
    answer.update(more)
    if measured.error:
        answer["failure"] = classify_failure(measured.error)
    return answer


TASKS: dict[str, Task] = {"measure": measure_task}
