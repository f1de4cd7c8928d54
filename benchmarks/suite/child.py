"""What runs inside each of the suite's subprocesses: the kinds of task of
:mod:`jacobkit.bench.child` (``measure``, as ``jacobkit compare`` runs it)
and the suite's own. Each task is a plain dict; the child writes its answer
as JSON (and the reference Jacobians to an ``.npz`` file) and exits:

- ``probe``: the device's name and the TensorFlow and Keras versions;
- ``reference``: the reference Jacobians of one problem;
- ``measure``: one strategy on one problem (:func:`jacobkit.bench.child.measure_task`);
  for auto with ``task["pair_with"]``, then auto against that fixed strategy
  and against the one it ran, in paired rounds
  (:func:`benchmarks.suite.paired.paired_rounds`);
- ``first_call``: the first call alone
  (:func:`benchmarks.suite.paired.first_call_s`), for first calls paired in
  alternating fresh processes.

Everything runs under ``tf.device(task["device"])``; peak memory is measured
on that device.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np

from jacobkit.bench import child


def main(task: dict[str, Any], result_path: str, log_path: str) -> None:
    """Run ``task`` (a kind of :data:`TASKS`): see
    :func:`jacobkit.bench.child.run`."""
    child.run(task, result_path, log_path, TASKS)


def _probe(task: dict[str, Any]) -> dict[str, Any]:
    import keras
    import tensorflow as tf

    device = task["device"]
    child.check_device(device)
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


def _reference(task: dict[str, Any]) -> dict[str, Any]:
    import tensorflow as tf

    from jacobkit import strategies, testing

    child.check_device(task["device"])
    start = time.perf_counter()
    with tf.device(task["device"]):
        if task["reference"] == "float64":
            # a float64 copy of the float32 build: a float64 build may keep
            # float32 parts (ResNet50 takes no dtype)
            model, inputs, problem = child.build(task, "float32")
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
            *_, problem = child.build(task, "float32")
            jacobians = [np.asarray(j) for j in strategies.Loop().run(problem)[0]]
        else:
            raise ValueError(f"unknown reference kind {task['reference']!r}")
    np.savez(task["reference_path"], *jacobians)
    return {"seconds": time.perf_counter() - start, "num_rows": problem.num_rows}


def _measure(task: dict[str, Any]) -> dict[str, Any]:
    return child.measure_task(task, extra=_paired)


def _paired(task: dict[str, Any], problem: Any, measured: Any) -> dict[str, Any]:
    """For auto with ``task["pair_with"]``: auto against that fixed strategy
    (``paired``) and against the one it ran, fixed (``overhead``), each in
    paired rounds in this process."""
    from benchmarks.suite.paired import paired_rounds
    from jacobkit import strategies

    if measured.name != "auto" or not task.get("pair_with") or measured.error:
        return {}
    paired = paired_rounds(
        problem,
        strategies.from_spec(task["pair_with"]),
        rounds=task["repeats"],
        device=task["device"],
    )
    own = paired
    if measured.ran_spec != task["pair_with"]:
        # auto's per-call overhead: against what it runs, fixed
        own = paired_rounds(
            problem,
            strategies.from_spec(measured.ran_spec),
            rounds=task["repeats"],
            device=task["device"],
        )
    return {"paired": paired.as_dict(), "overhead": own.as_dict()}


def _first_call(task: dict[str, Any]) -> dict[str, Any]:
    import tensorflow as tf

    from benchmarks.suite.paired import first_call_s

    strategy = child.strategy_of(task)
    with tf.device(task["device"]):
        *_, problem = child.build(task, "float32")
        seconds = first_call_s(problem, strategy, device=task["device"])
    return {"first_call_s": seconds}


#: the suite's kinds of task
TASKS: dict[str, child.Task] = {
    **child.TASKS,
    "probe": _probe,
    "reference": _reference,
    "measure": _measure,
    "first_call": _first_call,
}
