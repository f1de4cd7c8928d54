"""distribute=: batches across tf.distribute replicas, on devices and workers.

Both tests run in subprocesses: logical CPU devices must be configured before
TensorFlow starts, and each worker of a MultiWorkerMirroredStrategy is its
own process (on 127.0.0.1 ports).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import tensorflow as tf

import jacobkit as jk
from jacobkit import testing
from jacobkit.testing import examples

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
#: 10 examples in batches of 3: four batches, a last one of 1 (padded for the
#: per-example rows), and a last group with one replica idle
EXAMPLES, BATCH = 10, 3
OUTPUTS = ("features", "per_example")


def _env(**extra: str) -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": ROOT, "TF_CPP_MIN_LOG_LEVEL": "3", **extra}


#: a script's lines that give it two logical CPU devices and a
#: MirroredStrategy over them (before TensorFlow starts)
_TWO_CPUS = """
    import tensorflow as tf
    cpu = tf.config.list_physical_devices("CPU")[0]
    tf.config.set_logical_device_configuration(
        cpu, [tf.config.LogicalDeviceConfiguration()] * 2)
    strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
"""


def _run_on_two_cpus(tmp_path, name: str, source: str) -> subprocess.CompletedProcess:
    """Runs ``source`` (after :data:`_TWO_CPUS`) as a script in a fresh
    process, its first argument ``tmp_path``; it must succeed."""
    script = tmp_path / f"{name}.py"
    script.write_text(textwrap.dedent(_TWO_CPUS) + source)
    ran = subprocess.run(
        [sys.executable, str(script), str(tmp_path)],
        env=_env(),
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
    )
    assert ran.returncode == 0, ran.stderr[-3000:]
    return ran


def _assert_same_arrays(one, two) -> None:
    """Two ``np.load``-ed archives hold the same arrays, within 1e-5 of the
    largest value."""
    assert sorted(one.files) == sorted(two.files)
    for key in one.files:
        assert one[key].shape == two[key].shape, key
        assert testing.max_relative_difference(two[key], one[key]) <= 1e-5, key


def _single_device() -> dict[str, np.ndarray]:
    ex = examples.build("mlp", batch=EXAMPLES)
    dataset = tf.data.Dataset.from_tensor_slices(ex.inputs).batch(BATCH)
    return {
        outputs: jk.jacobian(
            ex.model, dataset, ex.layer, outputs=outputs, strategy="chunked"
        ).kernel.numpy()
        for outputs in OUTPUTS
    }


_RUN = f"""
    import numpy as np
    import jacobkit as jk
    from jacobkit.testing import examples

    ex = examples.build("mlp", batch={EXAMPLES})
    dataset = tf.data.Dataset.from_tensor_slices(ex.inputs).batch({BATCH})
    for outputs in {OUTPUTS}:
        result = jk.jacobian(ex.model, dataset, ex.layer, outputs=outputs,
                             strategy="chunked", distribute=strategy)
        np.save(f"{{out}}/{{name}}-{{outputs}}.npy", np.asarray(result.kernel))
        # one batch of arrays: its examples split across the replicas
        result = jk.jacobian(ex.model, ex.inputs, ex.layer, outputs=outputs,
                             strategy="chunked", distribute=strategy)
        np.save(f"{{out}}/{{name}}-array-{{outputs}}.npy", np.asarray(result.kernel))
"""

_MIRRORED = textwrap.dedent(
    """
    import logging, sys
    logging.basicConfig(stream=sys.stdout, format="%(message)s")
    logging.getLogger("jacobkit.batches.distribute").setLevel(logging.DEBUG)
    out, name = sys.argv[1], "mirrored"
    """
) + textwrap.dedent(_RUN)

_WORKER = textwrap.dedent(
    """
    import json, os, sys
    import tensorflow as tf
    strategy = tf.distribute.MultiWorkerMirroredStrategy()
    out = sys.argv[1]
    name = "worker{}".format(json.loads(os.environ["TF_CONFIG"])["task"]["index"])
    """
) + textwrap.dedent(_RUN)


def _assert_agree(directory, names) -> None:
    # conformance tolerance (float32: 1e-5). Measured: per-example rows
    # equal bit for bit; the sums differ by 4.6e-7 across two workers (each
    # worker sums its own batches, then the two sums are added)
    expected = _single_device()
    for name in names:
        for outputs in OUTPUTS:
            got = np.load(directory / f"{name}-{outputs}.npy")
            assert got.shape == expected[outputs].shape
            assert testing.max_relative_difference(got, expected[outputs]) <= 1e-5


def test_mirrored_strategy_on_two_logical_cpus(tmp_path):
    ran = _run_on_two_cpus(tmp_path, "mirrored", _MIRRORED)
    # both replicas computed batches, each on its own device
    devices = {
        line.split(" on ")[-1]
        for line in ran.stdout.splitlines()
        if "computed on" in line
    }
    assert {d.split("device:")[-1] for d in devices} == {"CPU:0", "CPU:1"}, devices
    _assert_agree(tmp_path, ["mirrored", "mirrored-array"])


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_multi_worker_mirrored_strategy_on_two_local_workers(tmp_path):
    script = tmp_path / "worker.py"
    script.write_text(_WORKER)
    workers = [f"127.0.0.1:{_free_port()}" for _ in range(2)]
    children = []
    for index in range(2):
        config = {
            "cluster": {"worker": workers},
            "task": {"type": "worker", "index": index},
        }
        children.append(
            subprocess.Popen(
                [sys.executable, str(script), str(tmp_path)],
                env=_env(TF_CONFIG=json.dumps(config)),
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
        )
    try:
        outputs = [child.communicate(timeout=300)[0] for child in children]
    finally:
        for child in children:
            if child.poll() is None:
                child.kill()
                child.wait()
    for child, printed in zip(children, outputs, strict=True):
        assert child.returncode == 0, printed[-3000:]
    # every worker's call returns the full result
    _assert_agree(tmp_path, ["worker0", "worker1", "worker0-array", "worker1-array"])


_REDUCTIONS = textwrap.dedent(
    """
    import sys
    import numpy as np
    import jacobkit as jk
    from tests.test_reductions import LOSS, _wide

    model, inputs = _wide()
    data = tf.data.Dataset.from_tensor_slices(inputs).batch(2)  # 2 + 2 + 1
    for name in ("batch", "loop"):
        for reduce in (jk.ClippedSum(0.5), jk.Project(64, seed=1)):
            for where, spread in (("one", None), ("two", strategy)):
                result = jk.jacobian(model, data, model.trainable_variables,
                                     outputs=LOSS, reduce=reduce, strategy=name,
                                     distribute=spread)
                kind = type(reduce).__name__
                values = [np.asarray(v) for v in result.values()]
                if result.norms is not None:
                    values.append(np.asarray(result.norms))
                np.savez(f"{sys.argv[1]}/{name}-{kind}-{where}.npz", *values)
    """
)


def test_clipped_sums_and_projections_on_two_replicas(tmp_path):
    """reduce=: the rows of a dataset's batches on two replicas (a last batch
    of one example, not padded into the clipped sum) give what one device
    gives. Measured: equal for ``batch``, 4.3e-7 of the largest value for
    ``loop`` (float32 sums in another order); bound 1e-5."""
    _run_on_two_cpus(tmp_path, "reductions", _REDUCTIONS)
    for name in ("batch", "loop"):
        for kind in ("ClippedSum", "Project"):
            one = np.load(tmp_path / f"{name}-{kind}-one.npz")
            two = np.load(tmp_path / f"{name}-{kind}-two.npz")
            assert len(one.files) == len(two.files) == 6 + (kind == "ClippedSum")
            _assert_same_arrays(one, two)


_GRAMS = textwrap.dedent(
    """
    import sys
    import keras
    import numpy as np
    import jacobkit as jk
    from jacobkit import explain
    from tests.test_reductions import LOSS, _wide

    model, inputs = _wide()  # 5 examples: chunks of 4 and 1
    test = tuple(a[:3] for a in inputs)
    keras.utils.set_random_seed(4)
    lstm = keras.Sequential(
        [keras.Input((5, 3)), keras.layers.LSTM(4), keras.layers.Dense(2)])
    rng = np.random.default_rng(4)
    data = (rng.normal(size=(5, 5, 3)).astype("float32"), rng.integers(0, 2, 5))
    for where, spread in (("one", None), ("two", strategy)):
        found = {
            "gram": jk.gram(model, inputs, outputs=LOSS, chunk_examples=4,
                            distribute=spread).matrix,
            "between": jk.gram(model, inputs, test, outputs=LOSS,
                               chunk_examples=4, distribute=spread).matrix,
            "features": jk.gram(model, inputs[0], outputs="features",
                                chunk_examples=4, distribute=spread).matrix,
            "no closed form": jk.gram(lstm, data, outputs=LOSS,
                                      distribute=spread).matrix,
            "tracin": explain.tracin(model, inputs, test, loss=LOSS,
                                     distribute=spread).scores,
            "grad_cos": explain.grad_cos(model, inputs, test, loss=LOSS,
                                         distribute=spread).scores,
            "self_influence": explain.self_influence(model, inputs, loss=LOSS,
                                                     distribute=spread),
            "trak": explain.trak(model, inputs, test, dim=64,
                                 distribute=spread).scores,
        }
        np.savez(f"{sys.argv[1]}/grams-{where}.npz", **found)
    """
)


def test_grams_and_influence_on_two_replicas(tmp_path):
    """gram(distribute=) and the influence methods on it: each chunk's
    examples split across two replicas give what one device gives (rows
    computed by the closed forms, by a strategy where none serves (an LSTM),
    and summed over the set). Bound 1e-5 of the largest value."""
    _run_on_two_cpus(tmp_path, "grams", _GRAMS)
    _assert_same_arrays(
        np.load(tmp_path / "grams-one.npz"), np.load(tmp_path / "grams-two.npz")
    )
