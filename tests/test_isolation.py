"""A test's verdict does not depend on the user's plan cache, environment or
core count (the root ``conftest.py``): the user's caches are never read or
written, each test and each notebook starts with an empty plan cache of its
own, the user's TensorFlow variables are dropped, and TensorFlow runs 2
inter-op threads, which ``auto``'s memory prior reads.
"""

from __future__ import annotations

import os
import pathlib
import shutil
import subprocess
import sys

import pytest
import tensorflow as tf

import conftest
from jacobkit.planner import scratch

ROOT = pathlib.Path(__file__).parent.parent
#: a test whose verdict a plan cache entry for its problem would change: it
#: asserts that the first plan is "not run yet", not read from the disk cache
COLD_PLAN = "tests/test_planner.py::test_plan_before_any_call_runs_nothing"
#: the problem of that test (tests/test_planner.py's SIZES, its structural
#: shortcut refused as the test's fixture refuses it)
PROBLEM = (
    "import jacobkit as jk\n"
    "from jacobkit.strategies.structured import NoShortcut\n"
    "from jacobkit.testing import examples\n"
    "def refuse(self, problem):\n"
    "    raise NoShortcut('off in test_planner')\n"
    "jk.strategies.Structured.check = refuse\n"
    "ex = examples.build('generator', batch=16, sequence=64, channels=8,\n"
    "                    filters=32, features=48)\n"
)
#: a user's earlier runs of it, which write its plan to their cache
RUN_IT = (
    PROBLEM + "for _ in range(3):\n    jk.jacobian(ex.model, ex.inputs, ex.layer)\n"
)
#: where a new process's first plan of it comes from
PLAN_IT = PROBLEM + "print(jk.plan(ex.model, ex.inputs, ex.layer).source)\n"


def _python(code: str, env: dict[str, str]) -> str:
    done = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        env=env,
        cwd=ROOT,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout.strip()


def _files(folder: pathlib.Path) -> dict[str, bytes]:
    return {str(p): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def _users_environment(tmp_path: pathlib.Path) -> dict[str, str]:
    """What a user's shell may hold: their plan caches in every place jacobkit
    looks, and TensorFlow variables that change what it does."""
    env = {k: v for k, v in os.environ.items() if k != "PYTEST_CURRENT_TEST"}
    env.update(
        HOME=str(tmp_path / "home"),
        XDG_CACHE_HOME=str(tmp_path / "xdg"),
        JACOBKIT_CACHE_DIR=str(tmp_path / "own"),
        PYTHONPATH=str(ROOT),
        TF_NUM_INTEROP_THREADS="1",
        TF_XLA_FLAGS="--tf_xla_auto_jit=2",
        TF_CPU_BFC_MEM_LIMIT_IN_MB="64",
    )
    return env


def test_a_populated_user_cache_changes_no_verdict(tmp_path):
    user = _users_environment(tmp_path)
    # the user ran the problem before: its plan is in the cache jacobkit reads
    # (JACOBKIT_CACHE_DIR), and in the two places it reads without it
    plain = {k: v for k, v in user.items() if k not in conftest._BEHAVIOUR}
    own = pathlib.Path(user["JACOBKIT_CACHE_DIR"])
    _python(RUN_IT, plain)
    shutil.copytree(own, tmp_path / "home" / ".cache" / "jacobkit")
    shutil.copytree(own, tmp_path / "xdg" / "jacobkit")
    caches = {d: _files(d) for d in (own, tmp_path / "home", tmp_path / "xdg")}
    assert all(caches.values())
    # outside the tests, it decides the next process's first plan
    assert _python(PLAN_IT, plain).splitlines()[-1] == "disk cache"
    # the test that asserts a cold first plan, run in the user's environment
    this = pathlib.Path(__file__).relative_to(ROOT)
    done = subprocess.run(
        [
            *(sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider"),
            COLD_PLAN,
            f"{this}::test_the_users_tensorflow_variables_are_dropped",
        ],
        capture_output=True,
        text=True,
        env=user,
        cwd=ROOT,
        timeout=600,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
    assert "2 passed" in done.stdout, done.stdout[-3000:]
    # and the user's caches are as they were
    for folder, files in caches.items():
        assert _files(folder) == files, folder


def test_the_users_tensorflow_variables_are_dropped():
    assert [name for name in conftest._BEHAVIOUR if name in os.environ] == []
    assert tf.config.threading.get_inter_op_parallelism_threads() == 2
    # the memory prior reads the same pool
    assert scratch.inter_op_threads() == conftest.INTER_OP_THREADS == 2


def test_each_test_starts_with_an_empty_plan_cache_of_its_own():
    folder = os.environ["JACOBKIT_CACHE_DIR"]
    assert folder != conftest._CACHE
    assert not os.path.exists(folder) or not os.listdir(folder)


def _notebook(path: pathlib.Path) -> None:
    """A notebook that fails unless its plan cache is empty, then learns."""
    nbformat = pytest.importorskip("nbformat")
    cell = (
        "import os, pathlib\n"
        "folder = pathlib.Path(os.environ['JACOBKIT_CACHE_DIR'])\n"
        "assert not folder.exists() or not any(folder.iterdir()), folder\n"
        "folder.mkdir(parents=True, exist_ok=True)\n"
        "(folder / 'learned.json').write_text('{}')\n"
    )
    notebook = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(cell)])
    notebook.metadata["kernelspec"] = {
        "name": "python3",
        "display_name": "Python 3",
        "language": "python",
    }
    nbformat.write(notebook, path)


def test_each_notebook_starts_with_an_empty_plan_cache_of_its_own(tmp_path):
    """Notebooks take no fixtures: their kernels inherited one directory for
    the whole run, and so what an earlier notebook's calls learned."""
    pytest.importorskip("nbmake")
    for name in ("first.ipynb", "second.ipynb"):
        _notebook(tmp_path / name)
    env = {k: v for k, v in os.environ.items() if k != "PYTEST_CURRENT_TEST"}
    done = subprocess.run(
        [
            *(sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider"),
            *("-p", "conftest", "--nbmake", "first.ipynb", "second.ipynb"),
        ],
        capture_output=True,
        text=True,
        env={**env, "PYTHONPATH": str(ROOT)},
        cwd=tmp_path,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
    assert "2 passed" in done.stdout, done.stdout[-3000:]
