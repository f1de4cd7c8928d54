"""Free memory of a device: what a computation there could still allocate.

CPU: ``/proc/meminfo`` and this process's cgroups (v1 and v2). GPU:
TensorFlow's device details or ``nvidia-smi``, minus what TensorFlow holds.
Where these are read from is a :class:`MemorySources`, so that other files
(or a fake ``nvidia-smi``) can stand in for them.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Callable
from dataclasses import dataclass
from numbers import Integral
from typing import Any

import tensorflow as tf

from jacobkit.memory.devices import device_index, normalize_device

__all__ = [
    "MemorySources",
    "cgroup_free",
    "free_bytes",
    "meminfo_available",
    "nvidia_smi_total_bytes",
    "parse_nvidia_smi",
]

_UNLIMITED = 1 << 60  # cgroup v1 reports "no limit" as a huge page-rounded number


@dataclass(frozen=True)
class MemorySources:
    """Where free memory is read from.

    Attributes:
        meminfo: the kernel's memory summary (``MemAvailable``).
        cgroup_root: where the cgroup file systems are mounted.
        proc_cgroup: which cgroups this process belongs to.
        which: finds an executable on ``PATH`` (``shutil.which``).
        run: runs a command (``subprocess.run``), for ``nvidia-smi``.
    """

    meminfo: str = "/proc/meminfo"
    cgroup_root: str = "/sys/fs/cgroup"
    proc_cgroup: str = "/proc/self/cgroup"
    which: Callable[[str], str | None] = shutil.which
    run: Callable[..., subprocess.CompletedProcess] = subprocess.run


#: this machine's own files and commands
SYSTEM = MemorySources()


def free_bytes(device: str | None = "CPU:0", *, sources: MemorySources = SYSTEM) -> int:
    """Free memory, in bytes, of the device a computation runs on.

    GPU: the GPU's total memory minus what TensorFlow currently has allocated
    on it (``get_memory_info(device)["current"]``), i.e. what TensorFlow could
    still allocate if its pool may grow to the whole GPU. The total comes from
    ``tf.config.experimental.get_device_details`` when it reports one,
    otherwise from ``nvidia-smi`` (``GPU:i`` is mapped through
    ``CUDA_VISIBLE_DEVICES`` when that is set). Memory used by other processes
    is not subtracted.

    CPU: the system's available memory (``MemAvailable`` in ``/proc/meminfo``,
    else available physical pages), lowered to ``limit - usage`` of this
    process's cgroup and its ancestors when one has a memory limit. Usage
    excludes the inactive file cache, which the kernel reclaims before it
    would kill the process. Memory TensorFlow's own pool holds but does not
    currently use is not counted, so the figure errs low.

    Args:
        device: any form :func:`normalize_device` accepts; ``None`` picks the
            GPU if there is one.
        sources: where to read from (this machine's files by default).

    Raises:
        ValueError: unknown device string.
        RuntimeError: the GPU is not visible to TensorFlow, or its total memory
            cannot be determined.

    Example:
        >>> free_bytes("CPU:0") > 0
        True
    """
    name = normalize_device(device)
    if name.startswith("GPU"):
        return _gpu_free_bytes(name, sources)
    return _cpu_free_bytes(sources)


def _cpu_free_bytes(sources: MemorySources) -> int:
    available = meminfo_available(sources.meminfo)
    if available is None:
        available = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    limited = cgroup_free(sources.cgroup_root, sources.proc_cgroup)
    if limited is not None:
        available = min(available, limited)
    return max(int(available), 0)


def meminfo_available(path: str = SYSTEM.meminfo) -> int | None:
    """``MemAvailable`` in bytes, or ``None`` when it cannot be read."""
    try:
        with open(path) as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    fields = line.split()
                    factor = 1024 if fields[-1].lower() == "kb" else 1
                    return int(fields[1]) * factor
    except (OSError, ValueError, IndexError):
        return None
    return None


def _read_text(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return None


def _read_int(path: str) -> int | None:
    text = _read_text(path)
    if text is None or text == "max":
        return None
    try:
        return int(text)
    except ValueError:
        return None


def _stat_value(path: str, key: str) -> int:
    text = _read_text(path) or ""
    for line in text.splitlines():
        fields = line.split()
        if len(fields) == 2 and fields[0] == key:
            try:
                return int(fields[1])
            except ValueError:
                return 0
    return 0


def _cgroup_dirs(base: str, rel: str | None) -> list[str]:
    """``base`` joined with ``rel`` and each of its ancestors, innermost first.

    Inside a container ``rel`` usually does not exist under ``base`` (the
    container sees its own cgroup as the root), so only ``base`` remains.
    """
    dirs = []
    if rel:
        parts = [p for p in rel.strip("/").split("/") if p]
        for i in range(len(parts), 0, -1):
            path = os.path.join(base, *parts[:i])
            if os.path.isdir(path):
                dirs.append(path)
    dirs.append(base)
    return dirs


def _own_cgroups(proc_cgroup: str) -> tuple[str | None, str | None]:
    """This process's (cgroup v2 path, cgroup v1 memory path)."""
    v2 = v1 = None
    for line in (_read_text(proc_cgroup) or "").splitlines():
        fields = line.split(":", 2)
        if len(fields) != 3:
            continue
        hierarchy, controllers, path = fields
        if hierarchy == "0" and controllers == "":
            v2 = path
        elif "memory" in controllers.split(","):
            v1 = path
    return v2, v1


def cgroup_free(
    root: str = SYSTEM.cgroup_root, proc_cgroup: str = SYSTEM.proc_cgroup
) -> int | None:
    """Smallest ``limit - usage`` over this process's cgroups with a limit.

    Reads cgroup v2 (``memory.max``, ``memory.current``) and v1
    (``memory/memory.limit_in_bytes``, ``memory/memory.usage_in_bytes``).
    Returns ``None`` when no memory limit applies.
    """
    v2_rel, v1_rel = _own_cgroups(proc_cgroup)
    candidates: list[int] = []
    if os.path.exists(os.path.join(root, "memory.max")) or v2_rel:
        for d in _cgroup_dirs(root, v2_rel):
            limit = _read_int(os.path.join(d, "memory.max"))
            usage = _read_int(os.path.join(d, "memory.current"))
            if limit is None or usage is None or limit >= _UNLIMITED:
                continue
            usage -= _stat_value(os.path.join(d, "memory.stat"), "inactive_file")
            candidates.append(limit - max(usage, 0))
    v1_root = os.path.join(root, "memory")
    if os.path.isdir(v1_root):
        for d in _cgroup_dirs(v1_root, v1_rel):
            limit = _read_int(os.path.join(d, "memory.limit_in_bytes"))
            usage = _read_int(os.path.join(d, "memory.usage_in_bytes"))
            if limit is None or usage is None or limit >= _UNLIMITED:
                continue
            stat = os.path.join(d, "memory.stat")
            usage -= _stat_value(stat, "total_inactive_file") or _stat_value(
                stat, "inactive_file"
            )
            candidates.append(limit - max(usage, 0))
    if not candidates:
        return None
    return max(min(candidates), 0)


def _gpu_free_bytes(device: str, sources: MemorySources) -> int:
    index = device_index(device)
    gpus = tf.config.list_physical_devices("GPU")
    if index >= len(gpus):
        raise RuntimeError(
            f"cannot report free memory of {device}: TensorFlow sees "
            f"{len(gpus)} GPU(s)"
            + ("" if gpus else "; use device='CPU:0' on a machine without a GPU")
        )
    total = _tf_gpu_total_bytes(gpus[index])
    if total is None:
        total = nvidia_smi_total_bytes(index, sources=sources)
    used = tf.config.experimental.get_memory_info(device)["current"]
    return max(total - used, 0)


def _tf_gpu_total_bytes(physical_device: Any) -> int | None:
    """Total memory reported by TensorFlow's device details, if any.

    TensorFlow 2.21 reports only ``device_name`` and ``compute_capability``;
    this looks for a memory entry in case a version adds one.
    """
    try:
        details = tf.config.experimental.get_device_details(physical_device)
    except (ValueError, RuntimeError):
        return None
    for key in ("memory_limit", "total_memory", "memory_total", "memory_size"):
        value = details.get(key)
        if isinstance(value, Integral) and int(value) > 0:
            return int(value)
    return None


def nvidia_smi_total_bytes(index: int, *, sources: MemorySources = SYSTEM) -> int:
    """Total memory of TensorFlow's GPU ``index`` according to ``nvidia-smi``
    (``GPU:i`` mapped through ``CUDA_VISIBLE_DEVICES`` when that is set)."""
    exe = sources.which("nvidia-smi")
    if exe is None:
        raise RuntimeError(
            f"cannot determine the total memory of GPU:{index}: TensorFlow's "
            "device details do not report it and `nvidia-smi` is not on PATH; "
            "pass an explicit memory_budget (e.g. '8GiB') instead"
        )
    gpu_id = str(index)
    visible = os.environ.get("CUDA_VISIBLE_DEVICES", "").strip()
    if visible:
        entries = [e.strip() for e in visible.split(",") if e.strip()]
        if index < len(entries):
            gpu_id = entries[index]
    cmd = [
        exe,
        "--query-gpu=memory.total,memory.used",
        "--format=csv,noheader,nounits",
        "-i",
        gpu_id,
    ]
    try:
        proc = sources.run(cmd, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise RuntimeError(
            f"cannot determine the total memory of GPU:{index}: running "
            f"`{' '.join(cmd)}` failed: {exc}"
        ) from exc
    if proc.returncode != 0:
        raise RuntimeError(
            f"cannot determine the total memory of GPU:{index}: `{' '.join(cmd)}` "
            f"exited with {proc.returncode}: {(proc.stderr or proc.stdout).strip()}"
        )
    return parse_nvidia_smi(proc.stdout, index)


def parse_nvidia_smi(output: str, index: int) -> int:
    """Bytes of ``memory.total`` from the first line of ``nvidia-smi`` CSV (MiB)."""
    for line in output.splitlines():
        fields = [f.strip() for f in line.split(",")]
        if fields and fields[0]:
            try:
                return int(float(fields[0])) * 1024**2
            except ValueError:
                break
    raise RuntimeError(
        f"cannot determine the total memory of GPU:{index}: unexpected "
        f"`nvidia-smi` output {output!r}"
    )
