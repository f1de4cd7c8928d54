"""Settings for every test run (tests/ and the notebooks), before TF starts."""

import atexit
import os
import shutil
import tempfile

import pytest

from jacobkit import runtime

# Quiet TensorFlow's logs, and use its pooled CPU allocator, the only one that
# reports peak memory on CPU (see jacobkit.runtime).
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
runtime.enable_bfc_cpu_allocator()
# The plan cache of every test run (and of the notebooks' kernels, which
# inherit it) is an empty directory of its own: never the user's
# ~/.cache/jacobkit, never what an earlier run learned.
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


def pytest_addoption(parser):
    parser.addoption(
        "--slow",
        action="store_true",
        help="also run the tests marked slow (larger problems, real models)",
    )


def pytest_collection_modifyitems(config, items):
    if config.getoption("--slow"):
        return
    skip = pytest.mark.skip(reason="slow: run with pytest --slow")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _cold_plan_cache(tmp_path, monkeypatch):
    """Each test starts with an empty plan cache: what one test's ``auto``
    calls learned does not change another's."""
    monkeypatch.setenv("JACOBKIT_CACHE_DIR", str(tmp_path / "jacobkit-cache"))
