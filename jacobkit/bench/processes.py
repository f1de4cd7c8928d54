"""Fresh child processes with a time limit: where ``jacobkit compare`` and
the benchmark suite (``benchmarks/suite``) run each strategy.

A task is a plain dict that :func:`jacobkit.bench.child.main` (or the
benchmark suite's own ``main``, which adds kinds of task) runs in a new
process; its JSON answer comes back, or a failure row if the child passed
its time limit (it is killed: a TensorFlow op cannot be interrupted inside a
process) or died without answering. Peak memory starts clean in each child,
and one strategy's crash cannot take the parent down.

On the CPU the children are forked from a server process that has already
imported TensorFlow (``multiprocessing``'s ``forkserver``; the TensorFlow
runtime itself starts in each child), which saves seconds of imports per
child; the server starts as soon as the pool opens, so that its imports
overlap with whatever the parent does next. On a GPU the children are
spawned from scratch, so that no CUDA state crosses a fork.
"""

from __future__ import annotations

import contextlib
import json
import multiprocessing
import multiprocessing.forkserver
import os
import signal
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from jacobkit import runtime
from jacobkit.bench import child
from jacobkit.memory.free import meminfo_available

#: modules the CPU fork server imports once for every child
PRELOAD = [
    "tensorflow",
    "keras",
    "jacobkit.bench.measure",
    "jacobkit.testing.examples",
]


#: what a child process runs: ``(task, result_path, log_path)``
Target = Callable[[dict[str, Any], str, str], None]


def time_limit_row(timeout_s: float) -> dict[str, Any]:
    """The row of a child that gave no answer within ``timeout_s`` seconds."""
    return {
        "error": f"TimeLimit: no result within {timeout_s:g} s",
        "failure": "time_limit",
    }


class ChildPool:
    """Starts one fresh process per task, with a time limit.

    Attributes:
        scratch: a folder for the tasks' files (results, logs, references),
            removed when the pool closes.
        target: what each process runs: ``target(task, result_path,
            log_path)`` (:func:`jacobkit.bench.child.main` by default).
    """

    def __init__(
        self,
        context: Any,
        scratch: Path,
        *,
        quiet: bool = False,
        target: Target = child.main,
    ) -> None:
        self.context = context
        self.scratch = scratch
        self.quiet = quiet
        self.target = target
        self._count = 0

    def run(self, task: dict[str, Any], timeout_s: float | None) -> dict[str, Any]:
        """The child's JSON answer, or a failure row if it gave none within
        ``timeout_s`` seconds (``None``: no limit). The limit counts from the
        child's start (the fork server's own imports are not in it); the
        child is killed if the parent is interrupted meanwhile."""
        self._count += 1
        result_path = str(self.scratch / f"task{self._count}.json")
        log_path = str(self.scratch / f"task{self._count}.log")
        process = self.context.Process(
            target=self.target, args=(task, result_path, log_path)
        )
        start = time.perf_counter()
        with _stderr_hidden(self.quiet):  # what a child prints before its log
            process.start()
        try:
            process.join(timeout_s)
            timed_out = process.is_alive()
        finally:  # past the limit, or the parent interrupted (Ctrl-C)
            if process.is_alive():
                process.kill()
                process.join()
        wall = time.perf_counter() - start
        answer: dict[str, Any]
        if timed_out:
            answer = time_limit_row(timeout_s or 0.0)
        elif os.path.exists(result_path):
            with open(result_path) as saved:
                answer = json.load(saved)
        else:
            answer = crash_row(process.exitcode, log_path)
        answer["child_wall_s"] = wall
        return answer


def crash_row(exitcode: int | None, log_path: str) -> dict[str, Any]:
    """A row for a child that died without answering."""
    tail = ""
    with contextlib.suppress(OSError), open(log_path, errors="replace") as log:
        lines = [line.strip() for line in log if line.strip()]
        tail = lines[-1][:200] if lines else ""
    if exitcode is not None and exitcode < 0:
        name = signal.Signals(-exitcode).name
        # SIGKILL from outside is the operating system's out-of-memory killer.
        failure = "out_of_memory" if exitcode == -signal.SIGKILL else "error"
        return {
            "error": f"Crashed: killed by {name}. {tail}".strip(),
            "failure": failure,
        }
    return {
        "error": f"Crashed: exit code {exitcode}. {tail}".strip(),
        "failure": "error",
    }


@contextlib.contextmanager
def open_pool(
    device: str,
    *,
    memory_fraction: float = 0.7,
    quiet: bool = False,
    target: Target = child.main,
) -> Iterator[ChildPool]:
    """A :class:`ChildPool` with the environment every child needs.

    Args:
        device: ``"CPU:0"`` or ``"GPU:0"``: forked from the server on the
            CPU, spawned on a GPU.
        memory_fraction: on the CPU, TensorFlow's allocator in each child is
            capped at this fraction of the memory available now, so that a
            strategy that needs too much fails with an out-of-memory error
            instead of meeting the operating system's out-of-memory killer.
        quiet: what the children (and the fork server) print before their
            output goes to their logs (TensorFlow's start-up lines) is hidden.
        target: what each child runs (a function of an importable module,
            which the fork server imports too).
    """
    on_cpu = device.upper().startswith("CPU")
    available = meminfo_available()
    limit_mib = None
    if on_cpu and available:
        limit_mib = int(available * memory_fraction / 1024**2)
    env = {**runtime.bfc_environment(limit_mib), "TF_CPP_MIN_LOG_LEVEL": "2"}
    methods = multiprocessing.get_all_start_methods()
    method = "forkserver" if on_cpu and "forkserver" in methods else "spawn"
    context = multiprocessing.get_context(method)
    saved = {key: os.environ.get(key) for key in env}
    os.environ.update(env)
    try:
        if method == "forkserver":
            context.set_forkserver_preload([target.__module__, *PRELOAD])
            with _stderr_hidden(quiet):  # its imports run while the parent works
                multiprocessing.forkserver.ensure_running()
        with tempfile.TemporaryDirectory(prefix="jacobkit-") as scratch:
            yield ChildPool(context, Path(scratch), quiet=quiet, target=target)
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def _stderr_hidden(hidden: bool) -> contextlib.AbstractContextManager[None]:
    """The process's stderr sent to ``os.devnull`` while a child process
    starts (and inherits it), if ``hidden``."""
    return runtime.native_stderr_hidden() if hidden else contextlib.nullcontext()
