"""Settings for every test run (tests/ and the notebooks), before TF starts.

A test's verdict must not depend on the machine's core count, on the user's
plan cache, or on the user's environment:

- **The plan cache.** Every item (each test, each notebook) runs with an
  empty plan cache of its own (``JACOBKIT_CACHE_DIR``, which comes before
  ``XDG_CACHE_HOME`` and ``~/.cache``): never the user's, never what an
  earlier item learned. The variable is set in ``os.environ``, so what an item
  starts inherits it: notebook kernels, ``python -c`` children. (``jacobkit
  compare``'s children are forked from one server that keeps the environment
  it started with; compare hands them the parent's cache directory.)
- **TensorFlow's environment.** The variables in :data:`_BEHAVIOUR` change
  what TensorFlow does and are dropped for the run and what it starts.
  ``TF_ENABLE_ONEDNN_OPTS`` is kept on purpose: ``=0`` emulates a CPU kind
  without oneDNN, which the tests know (they expect its failures by name).
- **The inter-op threads.** ``auto``'s memory prior holds at most 2 rows per
  inter-op thread at once (``jacobkit.planner.scratch``), and TensorFlow's
  inter-op pool has one thread per core the process may use: the tests'
  budgets are sized for 2. The pool is pinned at :data:`INTER_OP_THREADS`
  here, so TensorFlow and the prior (which reads the same setting) see 2
  threads on 1, 2 or 16 cores alike. Children (notebook kernels, ``jacobkit
  compare``'s) follow their machine, where the prior and TensorFlow agree.
"""

import atexit
import os
import shutil
import tempfile

import pytest

from jacobkit import runtime

#: the user's environment variables that change what TensorFlow does, and
#: with it a test's verdict; dropped before TensorFlow starts
_BEHAVIOUR = (
    "TF_CONFIG",  # a tf.distribute cluster, which multi-worker tests would join
    "TF_NUM_INTEROP_THREADS",  # pinned below instead
    "TF_NUM_INTRAOP_THREADS",
    "TF_XLA_FLAGS",  # auto-clustering compiles what jacobkit traces
    "TF_DETERMINISTIC_OPS",  # some gradient kernels then refuse to run
    "TF_CPU_BFC_MEM_LIMIT_IN_MB",  # a cap on the allocator the tests measure
    "TF_GPU_ALLOCATOR",
    "TF_FORCE_GPU_ALLOW_GROWTH",
)
#: TensorFlow's inter-op threads in the test process (see the docstring)
INTER_OP_THREADS = 2

for _name in _BEHAVIOUR:
    os.environ.pop(_name, None)
# Quiet TensorFlow's logs, and use its pooled CPU allocator, the only one that
# reports peak memory on CPU (see jacobkit.runtime).
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
runtime.enable_bfc_cpu_allocator()
# The plan cache of whatever runs outside an item (collection, and children
# started then): an empty directory of its own, never the user's ~/.cache.
_CACHE = tempfile.mkdtemp(prefix="jacobkit-test-cache-")
os.environ["JACOBKIT_CACHE_DIR"] = _CACHE
atexit.register(shutil.rmtree, _CACHE, ignore_errors=True)
# Notebook kernels start in notebooks/: make them import this checkout's
# jacobkit, not whichever one is installed.
_ROOT = os.path.dirname(os.path.abspath(__file__))
os.environ["PYTHONPATH"] = os.pathsep.join(
    [_ROOT, *filter(None, [os.environ.get("PYTHONPATH")])]
)
# Notebooks run at their small size under pytest (the kernels inherit this).
os.environ.setdefault("JACOBKIT_NOTEBOOK_SIZE", "small")

import tensorflow as tf  # noqa: E402 - after the environment it reads

tf.config.threading.set_inter_op_parallelism_threads(INTER_OP_THREADS)


#: test worker processes at most (``pytest -n auto``): each holds a
#: TensorFlow of up to 3 GiB resident, and TensorFlow uses every core anyway
MAX_WORKERS = 4


def pytest_xdist_auto_num_workers(config):
    """``-n auto``: one worker per core this process may use, at most
    :data:`MAX_WORKERS` (the same tests on 2 cores took 10:34 in 2 workers
    against 21:20 in one process)."""
    cores = (
        len(os.sched_getaffinity(0))
        if hasattr(os, "sched_getaffinity")
        else os.cpu_count() or 1
    )
    return max(1, min(cores, MAX_WORKERS))


def pytest_addoption(parser):
    parser.addoption(
        "--slow",
        action="store_true",
        help="also run the tests marked slow (larger problems, real models)",
    )


#: the files that check the ``grouped`` strategy in the default run: its own,
#: and those whose models mix covered and uncovered targets. Elsewhere the
#: registry-wide files' models are covered by ``batch`` wholly or not at
#: all, where ``grouped`` runs ``batch``'s or its generic strategy's own
#: computation, which those files check under their own names: there its
#: cases (about 180) run with ``--slow``
GROUPED_FILES = (
    "test_grouped.py",
    "test_reduction_conformance.py",
    "test_reduction_kinds.py",
    "test_architecture.py",
    "test_one_draw.py",
    "test_reduced_peaks.py",
)


#: the files whose ``chunked(k)`` cases skip without ``--slow`` where an
#: earlier case runs the same chunks (``tests.cases.skip_same_chunks``)
CHUNK_TWIN_FILES = (
    "test_conformance.py",
    "test_reductions.py",
    "test_mixed_precision.py",
)


def pytest_collection_modifyitems(config, items):
    for item in items:
        callspec = getattr(item, "callspec", None)
        if (
            callspec is not None
            and "grouped" in callspec.id.split("-")
            and item.path.name not in GROUPED_FILES
        ):
            item.add_marker(pytest.mark.slow)
    if config.getoption("--slow"):
        # chunked's twins decide at run time (tests.cases.skip_same_chunks):
        # marked here so that ``--slow -m slow`` selects them; the chunked
        # cases that are not twins skip there, having run in the plain run
        for item in items:
            case = getattr(item, "callspec", None) and item.callspec.params.get("case")
            if item.path.name in CHUNK_TWIN_FILES and getattr(
                case, "id", ""
            ).startswith("chunked("):
                item.add_marker(pytest.mark.slow)
        return
    skip = pytest.mark.skip(reason="slow: run with pytest --slow")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """Each item, a test or a notebook (which takes no fixtures), starts with
    an empty plan cache of its own: what one item's ``auto`` calls learned
    does not change another's."""
    folder = tempfile.mkdtemp(prefix="jacobkit-test-cache-")
    outer = os.environ.get("JACOBKIT_CACHE_DIR")
    os.environ["JACOBKIT_CACHE_DIR"] = folder
    try:
        return (yield)
    finally:
        if outer is None:
            os.environ.pop("JACOBKIT_CACHE_DIR", None)
        else:
            os.environ["JACOBKIT_CACHE_DIR"] = outer
        shutil.rmtree(folder, ignore_errors=True)
