"""A generic description of the machine the suite ran on (no host names)."""

from __future__ import annotations

import os
import platform
from importlib import metadata
from typing import Any

_CPUINFO = "/proc/cpuinfo"
_MEMINFO = "/proc/meminfo"


def cpu_model(path: str = _CPUINFO) -> str:
    """The CPU's model name from ``/proc/cpuinfo`` (``platform.processor()``
    elsewhere, or ``"unknown CPU"``)."""
    try:
        with open(path) as info:
            for line in info:
                if line.lower().startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def memory_bytes(field: str = "MemTotal", path: str = _MEMINFO) -> int | None:
    """A ``/proc/meminfo`` field in bytes (``None`` where there is none)."""
    try:
        with open(path) as info:
            for line in info:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def _version(package: str) -> str | None:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


def describe() -> dict[str, Any]:
    """CPU model, cores, memory, OS kind and package versions."""
    return {
        "cpu_model": cpu_model(),
        "cpu_cores": os.cpu_count(),
        "memory_bytes": memory_bytes(),
        "machine": platform.machine(),
        "system": platform.system(),
        "python": platform.python_version(),
        "tensorflow": _version("tensorflow"),
        "keras": _version("keras"),
        "jacobkit": _version("jacobkit"),
    }


def summary(machine: dict[str, Any]) -> str:
    """One line: ``"2-core x86_64 Linux VM-or-host, AMD EPYC, 24 GiB"``."""
    memory = machine.get("memory_bytes")
    gib = f", {memory / 1024**3:.0f} GiB memory" if memory else ""
    return (
        f"{machine['cpu_cores']}-core {machine['machine']} {machine['system']}"
        f" ({machine['cpu_model']}){gib}"
    )
