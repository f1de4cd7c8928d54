"""out= directories: .npy files and a manifest, bounded memory, resume."""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest

import jacobkit as jk
from jacobkit import testing
from jacobkit.testing import examples

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _manifest(directory) -> dict:
    with open(os.path.join(directory, "manifest.json")) as f:
        return json.load(f)


@pytest.fixture(scope="module")
def mlp():
    return examples.build("mlp", batch=30)


def test_out_writes_npy_files_equal_to_the_in_memory_result(mlp, tmp_path):
    strategy = jk.strategies.Chunked(chunk_size=4)
    for outputs in ("per_example", "features"):
        in_memory = jk.jacobian(
            mlp.model,
            jk.data.batches(mlp.inputs, 7),
            mlp.layer,
            outputs=outputs,
            strategy=strategy,
        )
        # a generator: the number of rows is known only at the end
        generator = (mlp.inputs[i : i + 7] for i in range(0, 30, 7))
        for name, inputs in (
            ("known", jk.data.batches(mlp.inputs, 7)),
            ("grown", generator),
        ):
            out = tmp_path / f"{outputs}-{name}"
            result = jk.jacobian(
                mlp.model,
                inputs,
                mlp.layer,
                outputs=outputs,
                strategy=strategy,
                out=out,
            )
            assert isinstance(result.kernel, np.memmap)
            assert result.rows_shape == in_memory.rows_shape
            manifest = _manifest(out)
            assert manifest["complete"] and manifest["batches_done"] == 5
            for target in manifest["targets"]:
                on_disk = np.load(out / target["file"])
                # the same computation: equal bit for bit
                np.testing.assert_array_equal(
                    on_disk, in_memory[target["name"]].numpy()
                )
                np.testing.assert_array_equal(result[target["name"]], on_disk)
    testing.assert_close(
        result,
        testing.reference_jacobian(
            mlp.model,
            mlp.inputs,
            [
                mlp.model.get_layer(mlp.layer).kernel,
                mlp.model.get_layer(mlp.layer).bias,
            ],
        ),
        tolerance=1e-5,
    )


def test_a_directory_of_another_call_is_refused(mlp, tmp_path):
    strategy = jk.strategies.Chunked(chunk_size=4)
    x = mlp.inputs[:12]
    jk.jacobian(
        mlp.model, jk.data.batches(x, 4), mlp.layer, strategy=strategy, out=tmp_path
    )
    other = examples.build("mlp", seed=1, batch=12)
    with pytest.raises(ValueError, match=r"another call \(model differ: stored"):
        jk.jacobian(
            other.model,
            jk.data.batches(x, 4),
            other.layer,
            strategy=strategy,
            out=tmp_path,
        )
    with pytest.raises(ValueError, match=r"rows differ: .*\"features\": \[1\]"):
        jk.jacobian(
            mlp.model,
            jk.data.batches(x, 4),
            mlp.layer,
            strategy=strategy,
            features=[1],
            out=tmp_path,
        )
    with pytest.raises(ValueError, match=r"the inputs differ .*first 3 batches"):
        jk.jacobian(
            mlp.model,
            jk.data.batches(x + 1, 4),
            mlp.layer,
            strategy=strategy,
            out=tmp_path,
        )
    mine = tmp_path / "01-my-data.npy"  # not jacobkit's: overwrite keeps it
    np.save(mine, np.zeros(3))
    fresh = jk.jacobian(
        other.model,
        jk.data.batches(x, 4),
        other.layer,
        strategy=strategy,
        out=tmp_path,
        overwrite=True,
    )
    expected = jk.jacobian(
        other.model, jk.data.batches(x, 4), other.layer, strategy=strategy
    )
    np.testing.assert_array_equal(fresh.kernel, expected.kernel.numpy())
    assert mine.exists()


def test_ctrl_c_then_the_same_call_continues(mlp, tmp_path, caplog):
    # KeyboardInterrupt from inside the loop (what Ctrl-C raises), with a
    # growing file (unknown number of batches); the same call then computes
    # only the batches not done
    strategy = jk.strategies.Chunked(chunk_size=4)

    def interrupted(at):
        for k, i in enumerate(range(0, 30, 5)):
            if k == at:
                raise KeyboardInterrupt
            yield mlp.inputs[i : i + 5]

    with pytest.raises(KeyboardInterrupt):
        jk.jacobian(
            mlp.model,
            interrupted(4),
            mlp.layer,
            outputs="per_example",
            strategy=strategy,
            out=tmp_path,
        )
    assert _manifest(tmp_path)["batches_done"] == 4
    with caplog.at_level(logging.DEBUG, logger="jacobkit.batches"):
        resumed = jk.jacobian(
            mlp.model,
            interrupted(None),
            mlp.layer,
            outputs="per_example",
            strategy=strategy,
            out=tmp_path,
        )
    computed = [r.getMessage() for r in caplog.records]
    assert computed == ["computing batch 4", "computing batch 5"]
    expected = jk.jacobian(
        mlp.model,
        jk.data.batches(mlp.inputs, 5),
        mlp.layer,
        outputs="per_example",
        strategy=strategy,
    )
    np.testing.assert_array_equal(resumed.kernel, expected.kernel.numpy())
    np.testing.assert_array_equal(resumed.bias, expected.bias.numpy())


_KILLED = textwrap.dedent(
    """
    import logging, sys, time
    import jacobkit as jk
    from jacobkit.testing import examples

    out, log = sys.argv[1], sys.argv[2]
    handler = logging.FileHandler(log)  # flushed after every record
    logger = logging.getLogger("jacobkit.batches")
    logger.addHandler(handler)
    logger.setLevel(logging.DEBUG)
    ex = examples.build("mlp", batch=72)

    class Slow(jk.data.batches):
        def __iter__(self):
            for x in super().__iter__():
                time.sleep(0.2)  # slow batches: killed in the middle of a run
                yield x

    jk.jacobian(ex.model, Slow(ex.inputs, 3), ex.layer, outputs="per_example",
                strategy=jk.strategies.Chunked(chunk_size=4), out=out)
    """
)


def test_kill_9_then_resume_equals_an_uninterrupted_run(tmp_path, caplog):
    out, log = tmp_path / "out", tmp_path / "computed.log"
    script = tmp_path / "killed.py"
    script.write_text(_KILLED)
    env = {**os.environ, "PYTHONPATH": ROOT, "TF_CPP_MIN_LOG_LEVEL": "3"}
    child = subprocess.Popen(
        [sys.executable, str(script), str(out), str(log)],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and child.poll() is None:
            try:
                if _manifest(out)["batches_done"] >= 5:
                    break
            except (FileNotFoundError, json.JSONDecodeError):
                pass
            time.sleep(0.02)
        assert child.poll() is None, "the run finished before it could be killed"
        os.kill(child.pid, signal.SIGKILL)
    finally:
        child.wait()
    done = _manifest(out)["batches_done"]
    assert 5 <= done < 24
    before = [int(line.split()[-1]) for line in log.read_text().splitlines()]
    # the killed run computed the batches it finished, and at most the next
    assert before[:done] == list(range(done)) and len(before) <= done + 1

    ex = examples.build("mlp", batch=72)
    strategy = jk.strategies.Chunked(chunk_size=4)
    with caplog.at_level(logging.DEBUG, logger="jacobkit.batches"):
        resumed = jk.jacobian(
            ex.model,
            jk.data.batches(ex.inputs, 3),
            ex.layer,
            outputs="per_example",
            strategy=strategy,
            out=out,
        )
    after = [int(r.getMessage().split()[-1]) for r in caplog.records]
    # no finished batch computed twice; every batch computed
    assert after == list(range(done, 24))
    uninterrupted = jk.jacobian(
        ex.model,
        jk.data.batches(ex.inputs, 3),
        ex.layer,
        outputs="per_example",
        strategy=strategy,
        out=tmp_path / "whole",
    )
    for name in resumed:
        np.testing.assert_array_equal(resumed[name], uninterrupted[name])


_MEMORY = textwrap.dedent(
    """
    import json, sys, threading, time
    import jacobkit as jk
    from jacobkit.testing import examples

    def rss():
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmRSS"):
                    return int(line.split()[1]) * 1024

    budget = 32 * 2**20
    ex = examples.build("mlp", batch=64, inputs=256, hidden=256)
    def run(x, out=None):
        return jk.jacobian(ex.model, jk.data.batches(x, 4), ex.layer,
                           outputs="per_example", memory_budget=budget, out=out)
    run(ex.inputs[:8])  # plan and trace outside the measurement
    peak, stop = [0], []
    def sample():
        while not stop:
            peak[0] = max(peak[0], rss())
            time.sleep(0.002)
    sampler = threading.Thread(target=sample)
    base = rss()
    sampler.start()
    result = run(ex.inputs, out=sys.argv[1])
    stop.append(1)
    sampler.join()
    print(json.dumps({
        "growth": peak[0] - base,
        "budget": budget,
        "result": sum(v.nbytes for v in result.jacobians.values()),
        "batch_result": sum(v[:4].nbytes for v in result.jacobians.values()),
    }))
    """
)


def test_out_keeps_memory_bounded_by_the_budget_not_the_result(tmp_path):
    # A per-example run whose result (160 MiB) is 5x the budget (32 MiB).
    # The process's resident memory (RSS, sampled every 2 ms) may grow by the
    # budget plus one batch's Jacobians (10 MiB); holding the result would
    # grow it by 160 MiB. Measured: 3 MiB (the written pages are unmapped
    # after each batch's flush, so the page cache does not count).
    script = tmp_path / "memory.py"
    script.write_text(_MEMORY)
    env = {**os.environ, "PYTHONPATH": ROOT, "TF_CPP_MIN_LOG_LEVEL": "3"}
    ran = subprocess.run(
        [sys.executable, str(script), str(tmp_path / "out")],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert ran.returncode == 0, ran.stderr[-2000:]
    measured = json.loads(ran.stdout.strip().splitlines()[-1])
    assert measured["result"] >= 4 * measured["budget"]
    assert measured["growth"] < measured["budget"] + measured["batch_result"], measured
