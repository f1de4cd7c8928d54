"""Where the MLP's time goes: each op of ``benchmarks/mlp_limit.py``'s
computation (Dense 512→1024 relu → 1024 tanh → 144, B=256, every feature
summed over the batch, with respect to the first Dense) alone on its exact
shapes, with the transposes the strategies issue, against TensorFlow's own
GEMM probe ((4096 x 1024) @ (1024 x 1024)) measured in the same rounds.

One process pinned to one core (one TensorFlow thread); every case is a
``tf.function`` on fixed random operands, its first call discarded; rounds
alternate the cases and each figure is the median over rounds of the case's
time (each round: the median of ``--repeats`` calls), the GFLOP/s as a
fraction of the probe's in the same round (median of the rounds' ratios).

    taskset -c 0 python benchmarks/mlp_floor.py --rounds 5 --json out.json

``--profile STRATEGY`` instead runs ``jk.jacobian`` with that strategy and
prints TensorFlow's profiler's per-op-type time of one steady call;
``--pages`` times the result's first touch alone (fresh pages of
TensorFlow's default allocator against a buffer held across calls);
``--whole [LABEL ...]`` times the whole call of each of :data:`WHOLE`'s
variants (TensorFlow's own ``MatMul`` gradient or jacobkit's, ``batch``'s
rows at once) paired in one process. Results, measured under load:
``results/cpu-onednn-off/mlp_floor.md``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
B, IN, H, F = 256, 512, 1024, 144


def _cases(tf: Any, rows: int) -> dict[str, tuple[Callable[[], Any], float]]:
    """label -> (a traced call, its FLOPs) for chunks of ``rows`` rows."""
    g = tf.random.Generator.from_seed(0)

    def normal(*shape: int) -> Any:
        return g.normal(shape)

    x, w2 = normal(B, IN), normal(H, H)
    xt, w2t = tf.transpose(x), tf.transpose(w2)
    a4096, dy = normal(4096, H), normal(rows * B, H)
    dy1 = normal(B, H)
    g3 = normal(rows, B, H)
    g3t = tf.transpose(g3, (0, 2, 1))  # (rows, H, B)
    gb = tf.transpose(g3, (1, 0, 2))  # (B, rows, H)
    a2, z1 = normal(B, H), normal(B, H)
    seeds = normal(rows, H)

    def fn(f: Callable[[], Any]) -> Callable[[], Any]:
        return tf.function(f, autograph=False)

    mac_h = B * H * H  # one row through hidden2's backward
    mac_c = B * IN * H  # one row's contraction with hidden1's input
    cases: dict[str, tuple[Callable[[], Any], float]] = {
        "probe (4096,1024)@(1024,1024)": (
            fn(lambda: tf.matmul(a4096, w2)),
            2 * 4096 * H * H,
        ),
        f"hidden2 bwd: ({rows}*256,1024)@W2, transpose_b (pfor's)": (
            fn(lambda: tf.matmul(dy, w2, transpose_b=True)),
            2 * rows * mac_h,
        ),
        f"hidden2 bwd: ({rows}*256,1024)@W2ᵀ pre-transposed": (
            fn(lambda: tf.matmul(dy, w2t)),
            2 * rows * mac_h,
        ),
        "hidden2 bwd, one row: (256,1024)@W2, transpose_b": (
            fn(lambda: tf.matmul(dy1, w2, transpose_b=True)),
            2 * mac_h,
        ),
        "hidden2 bwd, one row: (256,1024)@W2ᵀ pre-transposed": (
            fn(lambda: tf.matmul(dy1, w2t)),
            2 * mac_h,
        ),
        f"contract: BatchMatMulV2 xᵀ[None] (1,512,256) @ ({rows},256,1024), jk's": (
            fn(lambda: tf.matmul(tf.transpose(x)[None], g3)),
            2 * rows * mac_c,
        ),
        f"contract: BatchMatMulV2 x[None] adj_x @ ({rows},256,1024)": (
            fn(lambda: tf.matmul(x[None], g3, transpose_a=True)),
            2 * rows * mac_c,
        ),
        f"contract: BatchMatMulV2 xᵀ tiled ({rows},512,256) @ ({rows},256,1024)": (
            fn(lambda: tf.matmul(tf.broadcast_to(xt[None], (rows, IN, B)), g3)),
            2 * rows * mac_c,
        ),
        f"contract: {rows} 2-D MatMuls xᵀ (512,256) @ (256,1024), stacked": (
            fn(lambda: tf.stack([tf.matmul(xt, g3[k]) for k in range(rows)])),
            2 * rows * mac_c,
        ),
        f"contract: 2-D MatMul xᵀ (512,256) @ (256,{rows}*1024) (b-major cotangents)": (
            fn(lambda: tf.matmul(xt, tf.reshape(gb, (B, rows * H)))),
            2 * rows * mac_c,
        ),
        f"contract: 2-D MatMul ({rows}*1024,256)@x (transposed: out (k,o,i))": (
            fn(lambda: tf.matmul(tf.reshape(g3t, (rows * H, B)), x)),
            2 * rows * mac_c,
        ),
        "contract, one row: MatMul x (256,512) transpose_a @ (256,1024)": (
            fn(lambda: tf.matmul(x, dy1, transpose_a=True)),
            2 * mac_c,
        ),
        "contract, one row: MatMul xᵀ pre-transposed (512,256) @ (256,1024)": (
            fn(lambda: tf.matmul(xt, dy1)),
            2 * mac_c,
        ),
        f"elementwise: seeds ({rows},256,1024) * tanh' (pfor's tiled TanhGrad)": (
            fn(
                lambda: tf.raw_ops.TanhGrad(
                    y=tf.tile(a2[None], (rows, 1, 1)),
                    dy=tf.broadcast_to(seeds[:, None], (rows, B, H)),
                )
            ),
            0.0,
        ),
        f"elementwise: ReluGrad, features tiled ({rows},256,1024) (pfor's)": (
            fn(
                lambda: tf.raw_ops.ReluGrad(
                    gradients=g3, features=tf.tile(z1[None], (rows, 1, 1))
                )
            ),
            0.0,
        ),
        f"elementwise: ReluGrad as a mask product ({rows},256,1024), no tile": (
            fn(lambda: g3 * tf.cast(z1 > 0, g3.dtype)),
            0.0,
        ),
        f"bias: reduce_sum ({rows},256,1024) -> ({rows},1024)": (
            fn(lambda: tf.reduce_sum(g3, axis=1)),
            0.0,
        ),
        f"write: InplaceUpdate of ({rows},512,1024) into (144,512,1024)": (
            fn(
                lambda: tf.raw_ops.InplaceUpdate(
                    x=tf.raw_ops.Empty(shape=(F, IN, H), dtype=tf.float32),
                    i=tf.range(rows),
                    v=tf.zeros((rows, IN, H)),
                )
            ),
            0.0,
        ),
    }
    return cases


def _rounds(
    calls: dict[str, Callable[[], Any]], rounds: int, repeats: int
) -> list[dict[str, float]]:
    """Each round's median of ``repeats`` timed calls of each of ``calls``
    (by label), the calls alternating within a round: figures of one round
    share its load."""
    found = []
    for _ in range(rounds):
        round_ = {}
        for label, call in calls.items():
            each = []
            for _ in range(repeats):
                start = time.perf_counter()
                call()
                each.append(time.perf_counter() - start)
            round_[label] = statistics.median(each)
        found.append(round_)
    return found


def _fetched(call: Callable[[], Any]) -> Callable[[], Any]:
    """``call``, its result fetched (a tensor's ``numpy()``)."""

    def fetched() -> Any:
        found = call()
        return found.numpy() if hasattr(found, "numpy") else found

    return fetched


def per_op(rounds: int, repeats: int, rows: int) -> dict[str, Any]:
    import tensorflow as tf

    cases = _cases(tf, rows)
    for call, _ in cases.values():
        call()
    probe = next(iter(cases))
    timed = _rounds(
        {label: _fetched(call) for label, (call, _) in cases.items()}, rounds, repeats
    )
    out = {}
    for label, (_, flops) in cases.items():
        ms = statistics.median(r[label] for r in timed) * 1e3
        # each round's rate over the probe's in the same round
        of_probe = [(flops / r[label]) / (cases[probe][1] / r[probe]) for r in timed]
        out[label] = {
            "ms": ms,
            "gflops": flops / ms / 1e6 if flops else None,
            "of_probe": statistics.median(of_probe) if flops else None,
        }
    return out


def profile(strategy: str, calls: int) -> dict[str, float]:
    """TensorFlow's profiler's time per op type (ms) of one steady call."""
    import numpy as np
    import tensorflow as tf
    from tensorflow.tsl.profiler.protobuf import xplane_pb2

    import jacobkit as jk
    from jacobkit.testing import example_models

    model, x = (
        (e := example_models.mlp(batch=B, inputs=IN, hidden=H, features=F)).model,
        e.inputs,
    )
    kwargs = {} if strategy == "auto" else {"strategy": strategy}
    for _ in range(calls):
        result = jk.jacobian(model, x, "hidden1", **kwargs)
        np.asarray(result.kernel)
    logdir = tempfile.mkdtemp()
    tf.profiler.experimental.start(logdir)
    start = time.perf_counter()
    result = jk.jacobian(model, x, "hidden1", **kwargs)
    np.asarray(result.kernel)
    wall = time.perf_counter() - start
    tf.profiler.experimental.stop()
    (path,) = Path(logdir).rglob("*.xplane.pb")
    space = xplane_pb2.XSpace()
    space.ParseFromString(path.read_bytes())
    found: dict[str, float] = defaultdict(float)
    for plane in space.planes:
        if not plane.name.startswith("/host:CPU"):
            continue
        names = {k: m.name for k, m in plane.event_metadata.items()}
        for line in plane.lines:
            # the executor's op events (not the Python side's, nor its
            # "Process" events, which enclose the ops)
            if not line.name.startswith("tf_Compute"):
                continue
            for event in line.events:
                kind = names.get(event.metadata_id, "?").split(":")[-1]
                if kind != "Process":
                    found[kind] += event.duration_ps / 1e9
    top = dict(sorted(found.items(), key=lambda kv: -kv[1])[:30])
    return {"wall_ms": wall * 1e3, "plan": str(result.strategy), **top}


def _advised_huge(array: Any) -> Any:
    """``madvise(MADV_HUGEPAGE)`` on the 2 MiB-aligned pages inside
    ``array``'s buffer (a prototype: ``--pages``); the call's return code."""
    import ctypes

    import numpy as np

    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    huge, address = 2**21, array.ctypes.data
    start = -(-address // huge) * huge
    end = (address + array.nbytes) // huge * huge
    madv_hugepage = 14
    code = libc.madvise(start, end - start, madv_hugepage) if end > start else 0
    return np.int32(code)


def pages(rounds: int, repeats: int, rows: int) -> dict[str, Any]:
    """The result's first touch alone: the kernel Jacobian's ``(144, 512,
    1024)`` float32 buffer made by ``Empty`` and written ``rows`` rows at a
    time by ``InplaceUpdate`` (as ``map_chunks`` writes it), each call a
    fresh buffer; beside it the same with the buffer's pages advised huge
    first (``MADV_HUGEPAGE`` from a ``numpy_function`` that sees the
    buffer: a prototype, not what jacobkit runs), and the same writes into
    one buffer held across calls (no fresh pages). Each case's CPU time
    (the process's, one core), minor page faults and system time per call,
    rounds alternating; medians over every call, and the least time."""
    import resource

    import numpy as np
    import tensorflow as tf

    shape = (F, IN, H)

    def written(advise: bool, held: bool) -> Callable[[], Any]:
        @tf.function(autograph=False)
        def fill(buffer: Any) -> Any:
            if advise:
                code = tf.numpy_function(
                    _advised_huge, [buffer], tf.int32, stateful=True
                )
                with tf.control_dependencies([code]):
                    buffer = tf.identity(buffer)

            def body(i: Any, b: Any) -> tuple[Any, Any]:
                chunk = tf.fill((rows, IN, H), tf.cast(i, tf.float32))
                index = tf.range(i * rows, (i + 1) * rows)
                return i + 1, tf.raw_ops.InplaceUpdate(x=b, i=index, v=chunk)

            loop = (tf.constant(0), buffer)
            _, buffer = tf.while_loop(
                lambda i, _: i < F // rows, body, loop, parallel_iterations=1
            )
            return buffer

        kept = tf.zeros(shape)  # held across calls: its pages faulted once

        def call() -> Any:
            # a NumPy view (``Tensor.numpy()`` would copy the buffer)
            if held:
                return np.asarray(fill(kept))
            return np.asarray(fill(tf.raw_ops.Empty(shape=shape, dtype=tf.float32)))

        return call

    cases = {
        "fresh buffer (malloc: a new mapping)": written(False, False),
        "fresh buffer, pages advised huge (prototype)": written(True, False),
        "buffer held across calls": written(False, True),
    }
    found: dict[str, dict[str, list[float]]] = {
        label: {"cpu_s": [], "faults": [], "sys_s": []} for label in cases
    }
    for call in cases.values():
        call()
    for _ in range(rounds):
        for label, call in cases.items():
            for _ in range(repeats):
                before = resource.getrusage(resource.RUSAGE_SELF)
                start = time.process_time()
                call()
                cpu = time.process_time() - start
                after = resource.getrusage(resource.RUSAGE_SELF)
                found[label]["cpu_s"].append(cpu)
                found[label]["faults"].append(after.ru_minflt - before.ru_minflt)
                found[label]["sys_s"].append(after.ru_stime - before.ru_stime)
    return {
        "allocator_bfc": os.environ.get("TF_CPU_ALLOCATOR_USE_BFC"),
        **{
            label: {
                "cpu_s": statistics.median(each["cpu_s"]),
                "least_cpu_s": min(each["cpu_s"]),
                "faults": statistics.median(each["faults"]),
                "sys_s": statistics.median(each["sys_s"]),
            }
            for label, each in found.items()
        },
    }


#: the whole call's variants (``--whole``): label -> (strategy, TensorFlow's
#: own MatMul gradient instead of jacobkit's, ``batch``'s rows at once)
WHOLE = {
    "batch, own MatMul gradient, 16 rows at once": ("batch", True, 16),
    "batch, 16 rows at once": ("batch", False, 16),
    "batch, 4 rows at once": ("batch", False, 4),
    "batch, 1 row at once": ("batch", False, 1),
    "while, own MatMul gradient": ("while", True, 16),
    "while": ("while", False, 16),
    "while, 1 row in flight": ("while(1)", False, 16),
    "while, 4 rows in flight": ("while(4)", False, 16),
}


def whole(rounds: int, repeats: int, labels: list[str]) -> dict[str, Any]:
    """Each variant's steady ``jk.jacobian`` call, paired in this process
    (a model of the same weights per variant: each is traced once, under its
    own settings), rounds alternating; the median over rounds of each one's
    time relative to the first variant's in the same round."""
    import numpy as np
    from tensorflow.python.ops import math_grad  # noqa: F401

    import jacobkit as jk
    from jacobkit.strategies import batch as batch_module
    from jacobkit.strategies import gradients
    from jacobkit.testing import example_models

    calls = {}
    reference = None
    for label in labels:
        strategy, own, rows = WHOLE[label]
        e = example_models.mlp(batch=B, inputs=IN, hidden=H, features=F)
        gradients.matmul.MATMUL_ROWS = 10**9 if own else 64
        batch_module.ROWS_AT_ONCE = rows

        chosen: Any = strategy
        if strategy.startswith("while("):  # rows in flight
            chosen = jk.strategies.While(int(strategy[6:-1]))

        def call(e: Any = e, strategy: Any = chosen) -> Any:
            return np.asarray(
                jk.jacobian(e.model, e.inputs, "hidden1", strategy=strategy).kernel
            )

        found = call()  # traced now, under this variant's settings
        if reference is None:
            reference = found
        scale = float(np.abs(reference).max())
        print(label, "max rel diff", float(np.abs(found - reference).max()) / scale)
        calls[label] = call
    gradients.matmul.MATMUL_ROWS, batch_module.ROWS_AT_ONCE = 64, 16
    timed = _rounds(calls, rounds, repeats)
    return {
        label: {
            "s": statistics.median(r[label] for r in timed),
            "of_first": statistics.median(r[label] / r[labels[0]] for r in timed),
        }
        for label in calls
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--rows", type=int, default=16)
    parser.add_argument("--profile")
    parser.add_argument("--calls", type=int, default=4)
    parser.add_argument("--json", type=Path)
    parser.add_argument("--whole", nargs="*", help="labels of WHOLE, or none: all")
    parser.add_argument(
        "--pages",
        action="store_true",
        help="the result's first touch alone (TensorFlow's default allocator "
        "unless TF_CPU_ALLOCATOR_USE_BFC is set)",
    )
    args = parser.parse_args()
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    if args.pages:  # before jacobkit's import asks for the pooled allocator
        os.environ.setdefault("TF_CPU_ALLOCATOR_USE_BFC", "false")
    sys.path.insert(0, str(HERE / "peers"))
    import footing

    record = footing.pin_tensorflow("mlp_floor")
    if args.pages:
        found: dict[str, Any] = pages(args.rounds, args.repeats, args.rows)
    elif args.whole is not None:
        found = whole(args.rounds, args.repeats, args.whole or list(WHOLE))
    elif args.profile:
        found = profile(args.profile, args.calls)
    else:
        found = per_op(args.rounds, args.repeats, args.rows)
    found = {"onednn": record["onednn"], **found}
    text = json.dumps(found, indent=1)
    print(text)
    if args.json:
        args.json.write_text(text + "\n")


if __name__ == "__main__":
    main()
