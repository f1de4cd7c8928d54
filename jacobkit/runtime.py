"""Settings of the process TensorFlow runs in, in one place.

- the machine: the CPU's instruction sets and whether TensorFlow runs its
  oneDNN kernels (:class:`CpuKind`, :func:`cpu_kind`);
- the CPU allocator: TensorFlow's pooled (BFC) CPU allocator is the only one
  that keeps memory statistics, and it is chosen by environment variables
  read once, when TensorFlow's runtime starts
  (:func:`enable_bfc_cpu_allocator`, :func:`bfc_environment`);
- quiet: TensorFlow's internal warnings and start-up logs kept out of what
  jacobkit prints (:func:`tensorflow_warnings`, :func:`hide_startup_logs`,
  :func:`start_tensorflow_quietly`).

This module imports nothing from jacobkit, and TensorFlow only where a
function needs it (never to find out whether its runtime has started).
"""

from __future__ import annotations

import contextlib
import logging
import os
import platform
import sys
import threading
import types
from collections.abc import Callable, Hashable, Iterator, MutableMapping
from dataclasses import dataclass, field
from typing import Any, TypeVar

T = TypeVar("T")

# --------------------------------------------------------------------------
# the machine

_CPUINFO = "/proc/cpuinfo"
#: the instruction-set flags that decide which CPU kernels TensorFlow runs
#: (oneDNN is on by default only with VNNI, BF16 or AMX)
ISA_FLAGS = (
    "avx2",
    "fma",
    "avx512f",
    "avx512_vnni",
    "avx_vnni",
    "avx512_bf16",
    "amx_tile",
    "amx_bf16",
)


@dataclass(frozen=True)
class CpuKind:
    """The CPU TensorFlow runs on, as far as its kernels are concerned.

    Attributes:
        model: the model name, e.g. ``"AMD EPYC 7B13"``.
        flags: which of :data:`ISA_FLAGS` the CPU has, in that order.
        onednn: whether TensorFlow runs its oneDNN kernels in this process.
    """

    model: str
    flags: tuple[str, ...]
    onednn: bool

    def describe(self) -> str:
        """One line, e.g. ``"AMD EPYC (avx2 fma avx512f; oneDNN on)"``."""
        flags = " ".join(self.flags) or "no AVX2"
        return f"{self.model} ({flags}; oneDNN {'on' if self.onednn else 'off'})"


def cpu_kind(path: str = _CPUINFO) -> CpuKind:
    """This machine's :class:`CpuKind` (read once per process)."""
    return measured_once(("cpu kind", path), lambda: _read_cpu_kind(path))


def _read_cpu_kind(path: str) -> CpuKind:
    model, flags = platform.processor() or "unknown CPU", set()
    try:
        with open(path) as info:
            for line in info:
                key, _, value = line.partition(":")
                if key.strip() == "model name":
                    model = value.strip()
                elif key.strip() == "flags":
                    flags = set(value.split())
                    break
    except OSError:
        pass
    return CpuKind(model, tuple(f for f in ISA_FLAGS if f in flags), _onednn())


def _onednn() -> bool:
    try:
        from tensorflow.python.util import _pywrap_util_port
    except ImportError:  # pragma: no cover - layout of TF changed
        return False
    return bool(_pywrap_util_port.IsMklEnabled())


# --------------------------------------------------------------------------
# the CPU allocator

#: Set to ``true`` before TensorFlow's runtime starts, TensorFlow allocates CPU
#: memory from its BFC pool, the only CPU allocator that keeps statistics
#: (``tf.config.experimental.get_memory_info("CPU:0")``).
BFC_ENV = "TF_CPU_ALLOCATOR_USE_BFC"
#: The BFC pool's cap in MiB (TensorFlow's default: 64 GiB).
BFC_LIMIT_ENV = "TF_CPU_BFC_MEM_LIMIT_IN_MB"
_BFC_DEFAULT_LIMIT_MIB = 1 << 16


def total_physical_bytes() -> int:
    """The machine's physical memory in bytes."""
    return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def bfc_environment(limit_mib: int | None = None) -> dict[str, str]:
    """The environment variables that select the BFC CPU allocator, for a
    process about to start (a child), with its pool capped at ``limit_mib``
    when given."""
    env = {BFC_ENV: "true"}
    if limit_mib is not None:
        env[BFC_LIMIT_ENV] = str(limit_mib)
    return env


def request_bfc_cpu_allocator(
    environ: MutableMapping[str, str] | None = None,
    *,
    physical_bytes: int | None = None,
) -> bool:
    """Ask, through ``environ`` (``os.environ`` by default), for the BFC CPU
    allocator, unless ``TF_CPU_ALLOCATOR_USE_BFC`` is already set (``false``
    opts out). When this sets it, it also raises the pool's cap
    (``TF_CPU_BFC_MEM_LIMIT_IN_MB``, if unset) to the machine's physical
    memory (``physical_bytes``, measured by default) where that is above
    TensorFlow's 64 GiB default, so that the cap does not bind.

    Returns:
        Whether the environment asks for the BFC allocator.
    """
    env = os.environ if environ is None else environ
    if BFC_ENV not in env:
        env[BFC_ENV] = "true"
        if physical_bytes is None:
            physical_bytes = total_physical_bytes()
        physical_mib = physical_bytes // 1024**2
        if physical_mib > _BFC_DEFAULT_LIMIT_MIB:
            env.setdefault(BFC_LIMIT_ENV, str(physical_mib))
    return env[BFC_ENV].strip().lower() in ("1", "true")


def tensorflow_started() -> bool:
    """Whether TensorFlow's runtime (its eager context, and so its allocators)
    exists. ``False`` while TensorFlow is not even imported; this never
    imports it."""
    if "tensorflow" not in sys.modules:
        return False
    try:
        from tensorflow.python.eager import context
    except ImportError:  # pragma: no cover - layout of TF changed
        return True
    return bool(getattr(context.context(), "_initialized", True))


def cpu_memory_stats_available() -> bool:
    """Whether the running TensorFlow reports CPU memory statistics."""
    import tensorflow as tf

    try:
        tf.config.experimental.get_memory_info("CPU:0")
    except ValueError:
        return False
    return True


def enable_bfc_cpu_allocator() -> bool:
    """The one switch to TensorFlow's BFC CPU allocator, for this process.

    Before TensorFlow's runtime starts: :func:`request_bfc_cpu_allocator` on
    ``os.environ``. After: too late to change; reports what the runtime
    does. Side effect of the allocator: CPU memory TensorFlow frees stays in
    its pool for reuse rather than going back to the operating system.

    Returns:
        Whether CPU memory statistics are (or, once TensorFlow's runtime
        starts, will be) available.
    """
    if tensorflow_started():
        return cpu_memory_stats_available()
    return request_bfc_cpu_allocator()


# --------------------------------------------------------------------------
# quiet
#: the Python loggers TensorFlow and Keras write their warnings to
LOGGERS = ("tensorflow", "absl")

#: TensorFlow's C++ log level: 3 hides INFO, WARNING and ERROR start-up lines
#: (``failed call to cuInit`` on a machine without a GPU is an ERROR line)
_CPP_LOG_LEVEL = "TF_CPP_MIN_LOG_LEVEL"


class _BelowError(logging.Filter):
    """Drops records below ERROR, from one thread (or from every thread)."""

    def __init__(self, thread: int | None) -> None:
        super().__init__()
        self.thread = thread

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno >= logging.ERROR:
            return True
        return self.thread is not None and record.thread != self.thread


@contextlib.contextmanager
def tensorflow_warnings(*, all_threads: bool = False) -> Iterator[None]:
    """While active, TensorFlow's and Keras' Python warnings (log records below
    ERROR on the ``tensorflow`` and ``absl`` loggers) are dropped: those this
    thread logs, or every thread's with ``all_threads=True``. Other threads'
    records and every error still show.

    Inside one already active for this thread, it adds nothing (the outer
    one drops the same records; a steady ``jacobian`` call nests three)."""
    thread = None if all_threads else threading.get_ident()
    loggers = [logging.getLogger(name) for name in LOGGERS]
    if thread is not None and all(_drops(logger, thread) for logger in loggers):
        yield
        return
    dropper = _BelowError(thread)
    for logger in loggers:
        logger.addFilter(dropper)
    try:
        yield
    finally:
        for logger in loggers:
            logger.removeFilter(dropper)


def _drops(logger: logging.Logger, thread: int) -> bool:
    """Whether a :func:`tensorflow_warnings` of ``thread`` is active on
    ``logger``."""
    return any(
        isinstance(f, _BelowError) and f.thread == thread for f in logger.filters
    )


def hide_startup_logs() -> None:
    """Hide TensorFlow's C++ start-up logs (``TF_CPP_MIN_LOG_LEVEL=3``) unless
    the user set the level. Only effective before TensorFlow loads."""
    os.environ.setdefault(_CPP_LOG_LEVEL, "3")


@contextlib.contextmanager
def native_stderr_hidden() -> Iterator[None]:
    """Send the process's stderr (file descriptor 2) to ``os.devnull``."""
    sys.stderr.flush()
    saved = os.dup(2)
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, 2)
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(devnull)


def start_tensorflow_quietly(*, runtime: bool = True) -> None:
    """Import TensorFlow and start its runtime without its C++ start-up lines.

    The native libraries log while they load and while the runtime looks for
    devices (absl's ``All log messages before absl::InitializeLog() is called
    are written to STDERR``, oneDNN and CUDA notices, ``failed call to
    cuInit``), partly whatever ``TF_CPP_MIN_LOG_LEVEL`` says; so the
    process's stderr is sent to ``os.devnull`` meanwhile. For the command
    line: a program's own stderr output in that window is lost too. With
    ``runtime=False`` only the import (a parent that runs TensorFlow in
    child processes).
    """
    hide_startup_logs()
    if "tensorflow" in sys.modules:
        return
    with native_stderr_hidden():
        import tensorflow as tf

        if runtime:
            tf.config.list_logical_devices()


def caller_stacklevel() -> int:
    """The ``stacklevel`` that points a warning at the user's call: the first
    frame outside jacobkit, counted from the caller of :func:`warnings.warn`
    (the function that calls this)."""
    package = os.path.dirname(os.path.abspath(__file__)) + os.sep
    frame: types.FrameType | None = sys._getframe(1)
    level = 1
    while frame is not None and frame.f_code.co_filename.startswith(package):
        frame, level = frame.f_back, level + 1
    return level


# --------------------------------------------------------------------------
# what this process learned and said: the one process-wide state


@dataclass
class ProcessState:
    """Process-wide state, in one place (facts of this machine do not change
    while the process runs; TensorFlow's memory counters are per process).

    Attributes:
        facts: what was measured or made once per process, by key (this
            CPU's kind, its bfloat16 kernels' accuracy, its convolution
            kernels' scratch space per kind, dtype and device; the compiled
            functions no model owns: the Gram matrix's products).
        notices: the one-time warnings already given, by key.
        meters: the peak-memory blocks open now
            (:class:`jacobkit.memory.PeakMemory`), innermost last.
        pfor_rules: TensorFlow's own pfor rules while jacobkit's replace
            them, by op type, with how many vectorized passes are being
            converted now (:mod:`jacobkit.strategies.vectorize`).
        gradient_rules: TensorFlow's own gradient entries while jacobkit's
            replace them, by op type, with how many computations are being
            traced now (:mod:`jacobkit.strategies.gradients`).
    """

    facts: dict[Hashable, Any] = field(default_factory=dict)
    notices: set[Hashable] = field(default_factory=set)
    meters: list[Any] = field(default_factory=list)
    pfor_rules: dict[str, tuple[Any, int]] = field(default_factory=dict)
    gradient_rules: dict[str, tuple[Any, int]] = field(default_factory=dict)


#: the one module-level mutable state of this kind (see :class:`ProcessState`)
PROCESS = ProcessState()
_PROCESS_LOCK = threading.Lock()
_RULES_LOCK = threading.Lock()


@contextlib.contextmanager
def rule_replaced(
    registry: MutableMapping[str, Any],
    key: str,
    held: dict[str, tuple[Any, int]],
    replacement: Callable[[Any], Any],
) -> Iterator[None]:
    """``registry[key]`` replaced by ``replacement(own)`` for the block, then
    TensorFlow's ``own`` entry put back; nested and concurrent blocks share
    one replacement (``held`` keeps ``own`` and how many blocks are open: one
    of :class:`ProcessState`'s ``*_rules``)."""
    with _RULES_LOCK:
        own, depth = held.get(key, (registry[key], 0))
        if depth == 0:
            registry[key] = replacement(own)
        held[key] = (own, depth + 1)
    try:
        yield
    finally:
        with _RULES_LOCK:
            own, depth = held.pop(key)
            if depth > 1:
                held[key] = (own, depth - 1)
            else:
                registry[key] = own


def measured_once(key: Hashable, measure: Callable[[], T]) -> T:
    """``measure()``'s value for ``key``, measured the first time it is asked
    for in this process (see :attr:`ProcessState.facts`)."""
    with _PROCESS_LOCK:
        if key in PROCESS.facts:
            value: T = PROCESS.facts[key]
            return value
    value = measure()  # outside the lock: a measurement may take a while
    with _PROCESS_LOCK:
        found: T = PROCESS.facts.setdefault(key, value)
    return found


def first_notice(key: Hashable) -> bool:
    """Whether the one-time notice ``key`` is given now (``True`` once per
    process, then ``False``)."""
    with _PROCESS_LOCK:
        if key in PROCESS.notices:
            return False
        PROCESS.notices.add(key)
        return True
