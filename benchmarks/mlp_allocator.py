"""The MLP of ``benchmarks/mlp_limit.py`` under the CPU allocator this
process runs with: ``batch``'s whole call and a hand-written pipeline of
the same products, each against TensorFlow's GEMM probe in the same
process, by CPU time (the process's, one core: a loaded machine's other
work on the core is not counted), with the minor page faults and system
time of each call.

The hand-written pipeline is the least TensorFlow can run for this work:
the head's columns times ``tanh'`` as one broadcasting product, one
``(R·256, 1024) @ W2ᵀ`` product (``W2`` transposed once), the ReLU mask as
one broadcasting product, ``xᵀ @`` the cotangents by ``BatchMatMulV2``, the
bias sums, each chunk of ``R`` rows written into the result as ``batch``
writes it; no pfor (no ``Tile`` of the activations), no checks.

Run it once per allocator, each a fresh process on one core::

    TF_CPU_ALLOCATOR_USE_BFC=false taskset -c 0 python benchmarks/mlp_allocator.py
    TF_CPU_ALLOCATOR_USE_BFC=true taskset -c 0 python benchmarks/mlp_allocator.py

Rounds alternate the cases; every call's result is fetched as NumPy views
(``np.asarray``: ``Tensor.numpy()`` would copy it) and dropped before the
next. Results: ``results/cpu-onednn-off/mlp_floor.md``.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
B, IN, H, F = 256, 512, 1024, 144
FLOPS = 2 * B * (H * H + IN * H) * F
PROBE_FLOPS = 2 * 4096 * H * H


def hand(tf: Any, model: Any, x: Any, rows: int) -> Callable[[], Any]:
    """The hand-written pipeline (see the module's docstring), ``rows`` rows
    a chunk (a divisor of 144)."""
    import numpy as np

    w1, b1 = model.get_layer("hidden1").kernel, model.get_layer("hidden1").bias
    w2, b2 = model.get_layer("hidden2").kernel, model.get_layer("hidden2").bias
    w3 = model.get_layer("head").kernel

    def copy_t(m: Any) -> Any:  # a copy grappler does not fold into a flag
        m = tf.convert_to_tensor(m)
        return tf.reshape(tf.transpose(m[None], (0, 2, 1)), m.shape[::-1])

    @tf.function(autograph=False)
    def jacobian(x: Any) -> Any:
        z1 = x @ w1 + b1
        a2 = tf.tanh(tf.nn.relu(z1) @ w2 + b2)
        tanh_d, relu_d = 1 - a2 * a2, tf.cast(z1 > 0, x.dtype)
        w2t, columns, xt = copy_t(w2), copy_t(w3), copy_t(x)

        def body(i: Any, kernel: Any, bias: Any) -> tuple[Any, ...]:
            seeds = columns[i * rows : (i + 1) * rows]
            dz2 = tf.reshape(tanh_d[None] * seeds[:, None, :], (rows * B, H))
            dz1 = tf.reshape(dz2 @ w2t, (rows, B, H)) * relu_d[None]
            index = tf.range(i * rows, (i + 1) * rows)
            kernel = tf.raw_ops.InplaceUpdate(x=kernel, i=index, v=xt[None] @ dz1)
            bias = tf.raw_ops.InplaceUpdate(x=bias, i=index, v=tf.reduce_sum(dz1, 1))
            return i + 1, kernel, bias

        start = (
            tf.constant(0),
            tf.raw_ops.Empty(shape=(F, IN, H), dtype=x.dtype),
            tf.raw_ops.Empty(shape=(F, H), dtype=x.dtype),
        )
        _, kernel, bias = tf.while_loop(
            lambda i, *_: i < F // rows, body, start, parallel_iterations=1
        )
        return kernel, bias

    return lambda: [np.asarray(t) for t in jacobian(x)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--rows", type=int, nargs="+", default=[12])
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    sys.path.insert(0, str(HERE / "peers"))
    import footing
    import numpy as np
    import tensorflow as tf

    import jacobkit as jk
    from jacobkit.testing import example_models

    record = footing.pin_tensorflow("mlp_allocator")
    e = example_models.mlp(batch=B, inputs=IN, hidden=H, features=F)
    a, b = tf.random.normal((4096, H)), tf.random.normal((H, H))
    probe = tf.function(lambda: tf.matmul(a, b))

    def batch() -> Any:
        found = jk.jacobian(e.model, e.inputs, "hidden1", strategy="batch")
        return [np.asarray(found.kernel), np.asarray(found.bias)]

    # NumPy views, no copy (``Tensor.numpy()`` copies)
    calls = {"probe": lambda: np.asarray(probe()), "jacobkit batch": batch}
    for rows in args.rows:
        calls[f"hand pipeline, {rows} rows a chunk"] = hand(tf, e.model, e.inputs, rows)
    reference = None
    for label, call in calls.items():
        found = call()
        if label != "probe":  # every kernel Jacobian against batch's
            reference = found[0] if reference is None else reference
            diff = np.abs(found[0] - reference).max() / np.abs(reference).max()
            print(label, "max rel diff against batch", float(diff), flush=True)
        del found
    each: dict[str, dict[str, list[float]]] = {
        k: {"cpu_s": [], "faults": [], "sys_s": []} for k in calls
    }
    for _ in range(args.rounds):
        for label, call in calls.items():
            before = resource.getrusage(resource.RUSAGE_SELF)
            start = time.process_time()
            call()
            cpu = time.process_time() - start
            after = resource.getrusage(resource.RUSAGE_SELF)
            each[label]["cpu_s"].append(cpu)
            each[label]["faults"].append(after.ru_minflt - before.ru_minflt)
            each[label]["sys_s"].append(after.ru_stime - before.ru_stime)
    rate = PROBE_FLOPS / min(each["probe"]["cpu_s"])
    out: dict[str, Any] = {
        "onednn": record["onednn"],
        "allocator_bfc": os.environ.get("TF_CPU_ALLOCATOR_USE_BFC"),
        "load": os.getloadavg(),
        "probe_gflops_least_cpu": rate / 1e9,
        "limit_s": FLOPS / rate,
    }
    for label, found in each.items():
        if label == "probe":
            continue
        least = min(found["cpu_s"])
        out[label] = {
            "least_cpu_s": least,
            "median_cpu_s": statistics.median(found["cpu_s"]),
            "of_limit": FLOPS / rate / least,
            "faults": statistics.median(found["faults"]),
            "sys_s": statistics.median(found["sys_s"]),
        }
    text = json.dumps(out, indent=1)
    print(text)
    if args.json:
        args.json.write_text(text + "\n")


if __name__ == "__main__":
    main()
