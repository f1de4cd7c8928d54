"""This process's resident memory (RSS), for ``jacobkit compare``'s process
growth: from ``psutil`` where it is installed (any system it supports; the
``bench`` extra), else from ``/proc/self/statm`` (Linux), else unknown.
Never raises: a figure that cannot be read is ``None``, and the table says
``n/a``."""

from __future__ import annotations

import os

__all__ = ["resident_bytes"]

#: Linux: the process's memory in pages; the second field is the resident set
STATM = "/proc/self/statm"


def resident_bytes(statm: str = STATM) -> int | None:
    """This process's resident set size in bytes: ``psutil``'s, else
    ``statm``'s resident pages times the page size, else ``None``."""
    found = _from_psutil()
    return found if found is not None else _from_statm(statm)


def _from_psutil() -> int | None:
    try:
        import psutil
    except ImportError:  # optional: the bench extra
        return None
    try:
        return int(psutil.Process().memory_info().rss)
    except (psutil.Error, OSError):
        return None


def _from_statm(path: str) -> int | None:
    try:
        with open(path) as statm:
            pages = int(statm.read().split()[1])
        return pages * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError, AttributeError):
        # no such file (not Linux), an unexpected format, or no os.sysconf
        return None
