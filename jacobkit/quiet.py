"""Keep TensorFlow's internal warnings out of what jacobkit's own work prints.

``auto``'s probes trace several small computations in a row, which makes
TensorFlow log warnings meant for its own developers or for user code that
retraces by mistake (``Conv2DBackpropFilter uses a while_loop. Fix that!``,
``5 out of the last 9 calls to ... triggered tf.function retracing``).
:func:`tensorflow_warnings` drops those while jacobkit works; errors still
show. :func:`hide_startup_logs` is for the command line, before TensorFlow
loads.

This module imports nothing from TensorFlow.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import threading
from collections.abc import Iterator

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
    records and every error still show."""
    dropper = _BelowError(None if all_threads else threading.get_ident())
    loggers = [logging.getLogger(name) for name in LOGGERS]
    for logger in loggers:
        logger.addFilter(dropper)
    try:
        yield
    finally:
        for logger in loggers:
            logger.removeFilter(dropper)


def hide_startup_logs() -> None:
    """Hide TensorFlow's C++ start-up logs (``TF_CPP_MIN_LOG_LEVEL=3``) unless
    the user set the level. Only effective before TensorFlow loads."""
    os.environ.setdefault(_CPP_LOG_LEVEL, "3")


@contextlib.contextmanager
def _native_stderr_hidden() -> Iterator[None]:
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
    with _native_stderr_hidden():
        import tensorflow as tf

        if runtime:
            tf.config.list_logical_devices()
