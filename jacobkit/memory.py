"""Device memory: free memory, peak measurement, budget parsing.

All sizes are in bytes (``int``). Device names are normalized to TensorFlow's
short form, ``"CPU:0"`` or ``"GPU:0"``.

>>> from jacobkit.memory import format_bytes, parse_budget
>>> parse_budget("512 MiB")
536870912
>>> parse_budget(0.5, free=1000)
500
>>> format_bytes(1536 * 1024**2)
'1.5 GiB'

CPU memory statistics
---------------------
TensorFlow only tracks CPU allocations (``tf.config.experimental.
get_memory_info("CPU:0")``, used by :class:`PeakMemory`) when its CPU
allocator is the BFC allocator, which it uses only if the environment variable
``TF_CPU_ALLOCATOR_USE_BFC=true`` is set before the TensorFlow runtime
initializes (the first tensor or op; ``import tensorflow`` alone is fine).
Without it both ``get_memory_info`` and ``reset_memory_stats`` raise
``ValueError`` for the CPU (checked with TensorFlow 2.21). The BFC pool is
capped by ``TF_CPU_BFC_MEM_LIMIT_IN_MB`` (default 64 GiB) and keeps freed memory
for reuse instead of returning it to the operating system.
:func:`enable_cpu_memory_stats` sets it while that
is still possible, and :class:`PeakMemory` calls it for you.
"""

from __future__ import annotations

import math
import os
import re
import shutil
import subprocess
from collections.abc import Callable
from decimal import Decimal, InvalidOperation
from numbers import Integral, Real
from typing import Any, TypeVar

import tensorflow as tf

__all__ = [
    "DEFAULT_BUDGET_FRACTION",
    "PeakMemory",
    "enable_cpu_memory_stats",
    "format_bytes",
    "free_bytes",
    "measure_peak",
    "normalize_device",
    "parse_budget",
]

DEFAULT_BUDGET_FRACTION: float = 0.8
"""Fraction of free device memory used when no ``memory_budget`` is given.

Not 1.0: the allocator fragments its pool (a request can fail while the sum of
free blocks would be enough), and the framework needs memory of its own beyond
the tensors we plan for (kernel workspaces such as cuDNN/cuBLAS scratch,
compiled-function buffers, host staging copies). 20% headroom absorbs those.
"""

_T = TypeVar("_T")

_BFC_ENV = "TF_CPU_ALLOCATOR_USE_BFC"
_BFC_LIMIT_ENV = "TF_CPU_BFC_MEM_LIMIT_IN_MB"
_BFC_DEFAULT_LIMIT_MIB = 1 << 16  # TensorFlow's default cap for the CPU BFC pool

_DEVICE_RE = re.compile(
    r"^(?:/job:[^/]+/replica:\d+/task:\d+)?/?(?:device:)?(cpu|gpu)(?::(\d+))?$",
    re.IGNORECASE,
)
_ACCEPTED_DEVICES = (
    "'CPU:0', 'GPU:0', '/GPU:0', '/device:GPU:0', "
    "'/job:localhost/replica:0/task:0/device:GPU:0' (any index), or None"
)

# Multipliers for size units, keyed by lower-cased unit.
_UNITS: dict[str, int] = {
    "": 1,
    "b": 1,
    "byte": 1,
    "bytes": 1,
    # bare letters and IEC names: binary
    "k": 1024,
    "m": 1024**2,
    "g": 1024**3,
    "t": 1024**4,
    "ki": 1024,
    "mi": 1024**2,
    "gi": 1024**3,
    "ti": 1024**4,
    "kib": 1024,
    "mib": 1024**2,
    "gib": 1024**3,
    "tib": 1024**4,
    # SI names: decimal
    "kb": 1000,
    "mb": 1000**2,
    "gb": 1000**3,
    "tb": 1000**4,
}
_SIZE_RE = re.compile(
    r"^([+-]?(?:\d+(?:\.\d*)?|\.\d+)(?:e[+-]?\d+)?)\s*(%|[a-z]*)$", re.IGNORECASE
)
_BUDGET_EXAMPLES = (
    "Valid examples: 2147483648 (bytes), '2GiB', '512 MB', '1.5G', '100k', "
    "0.5 (fraction of free memory), '50%', None (default fraction)"
)

_CGROUP_ROOT = "/sys/fs/cgroup"
_PROC_CGROUP = "/proc/self/cgroup"
_PROC_MEMINFO = "/proc/meminfo"
_UNLIMITED = 1 << 60  # cgroup v1 reports "no limit" as a huge page-rounded number


# --------------------------------------------------------------------------
# devices


def normalize_device(device: str | None) -> str:
    """Return the short TensorFlow name (``"CPU:0"``, ``"GPU:1"``) of a device.

    Args:
        device: ``"CPU:0"``, ``"gpu:1"``, ``"/GPU:0"``, ``"/device:GPU:0"``, a
            full name such as ``"/job:localhost/replica:0/task:0/device:CPU:0"``
            (a tensor's ``.device``), or a bare ``"CPU"``/``"GPU"`` (index 0).
            ``None`` picks ``"GPU:0"`` if TensorFlow sees a GPU, else
            ``"CPU:0"``.

    Raises:
        ValueError: the string is not a CPU or GPU device name.
        TypeError: ``device`` is neither a string nor ``None``.

    Example:
        >>> normalize_device("/device:gpu:1")
        'GPU:1'
    """
    if device is None:
        return "GPU:0" if tf.config.list_physical_devices("GPU") else "CPU:0"
    if not isinstance(device, str):
        raise TypeError(
            f"device must be a string such as 'CPU:0' or 'GPU:0', or None; "
            f"got {type(device).__name__}: {device!r}"
        )
    match = _DEVICE_RE.match(device.strip())
    if match is None:
        raise ValueError(
            f"device {device!r} is not a known device; accepted forms: "
            f"{_ACCEPTED_DEVICES}"
        )
    kind, index = match.groups()
    return f"{kind.upper()}:{int(index or 0)}"


def _device_index(device: str) -> int:
    return int(device.split(":")[1])


# --------------------------------------------------------------------------
# free memory


def free_bytes(device: str | None = "CPU:0") -> int:
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
        return _gpu_free_bytes(name)
    return _cpu_free_bytes()


def _cpu_free_bytes() -> int:
    available = _meminfo_available()
    if available is None:
        available = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    cgroup_free = _cgroup_free()
    if cgroup_free is not None:
        available = min(available, cgroup_free)
    return max(int(available), 0)


def _total_physical_bytes() -> int:
    return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def _meminfo_available(path: str = _PROC_MEMINFO) -> int | None:
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


def _cgroup_free(
    root: str = _CGROUP_ROOT, proc_cgroup: str = _PROC_CGROUP
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


def _gpu_free_bytes(device: str) -> int:
    index = _device_index(device)
    gpus = tf.config.list_physical_devices("GPU")
    if index >= len(gpus):
        raise RuntimeError(
            f"cannot report free memory of {device}: TensorFlow sees "
            f"{len(gpus)} GPU(s)"
            + ("" if gpus else "; use device='CPU:0' on a machine without a GPU")
        )
    total = _tf_gpu_total_bytes(gpus[index])
    if total is None:
        total = _nvidia_smi_total_bytes(index)
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
        if isinstance(value, Integral) and value > 0:
            return int(value)
    return None


def _nvidia_smi_total_bytes(index: int) -> int:
    """Total memory of TensorFlow's GPU ``index`` according to ``nvidia-smi``."""
    exe = shutil.which("nvidia-smi")
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
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=30)
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
    return _parse_nvidia_smi(proc.stdout, index)


def _parse_nvidia_smi(output: str, index: int) -> int:
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


# --------------------------------------------------------------------------
# peak measurement


def _tf_runtime_initialized() -> bool:
    """Whether TensorFlow's eager context (and so its allocators) exists."""
    try:
        from tensorflow.python.eager import context
    except ImportError:  # pragma: no cover - layout of TF changed
        return True
    ctx = context.context()
    return bool(getattr(ctx, "_initialized", True))


def _truthy(value: str) -> bool:
    return value.strip().lower() in ("1", "true")


def _cpu_stats_available() -> bool:
    try:
        tf.config.experimental.get_memory_info("CPU:0")
    except ValueError:
        return False
    return True


def enable_cpu_memory_stats() -> bool:
    """Make TensorFlow track CPU allocations, if it is not too late.

    Sets ``TF_CPU_ALLOCATOR_USE_BFC=true`` (unless the variable is already
    set) and, if unset, ``TF_CPU_BFC_MEM_LIMIT_IN_MB`` to the machine's
    physical memory so that TensorFlow's default 64 GiB cap on that pool does
    not bind. Both only take effect before TensorFlow's runtime initializes
    (its first tensor or op); call this at the start of a program. Side
    effect: CPU memory TensorFlow frees stays in its pool for reuse rather
    than going back to the operating system.

    Returns:
        Whether CPU memory statistics are (or, once TensorFlow initializes,
        will be) available.

    Example:
        >>> enable_cpu_memory_stats()  # doctest: +SKIP
        True
    """
    if _tf_runtime_initialized():
        return _cpu_stats_available()
    if _BFC_ENV not in os.environ:
        os.environ[_BFC_ENV] = "true"
        physical_mib = _total_physical_bytes() // 1024**2
        if physical_mib > _BFC_DEFAULT_LIMIT_MIB:
            os.environ.setdefault(_BFC_LIMIT_ENV, str(physical_mib))
    return _truthy(os.environ[_BFC_ENV])


_ACTIVE: list[PeakMemory] = []


def _memory_info(device: str) -> dict[str, int]:
    return tf.config.experimental.get_memory_info(device)


class PeakMemory:
    """Context manager: peak bytes TensorFlow allocated on a device in a block.

    On entry it resets the device's peak statistic
    (``tf.config.experimental.reset_memory_stats``) and records the bytes in
    use as the baseline; on exit it reads the peak
    (``get_memory_info(device)["peak"]``).

    Attributes:
        device: the normalized device name, e.g. ``"CPU:0"``.
        peak_bytes: highest bytes in use on the device during the block,
            including what was already allocated before it (``None`` until
            the block exits).
        baseline_bytes: bytes in use when the block started (set on entry).
        extra_bytes: ``peak_bytes - baseline_bytes``, what the block added
            (``None`` until the block exits).

    On the CPU this needs ``TF_CPU_ALLOCATOR_USE_BFC=true`` set before
    TensorFlow initializes (see :func:`enable_cpu_memory_stats`, which entering
    the block calls); if TensorFlow is already running without it, entering
    raises ``RuntimeError``. Nested blocks on one device give correct results
    (an inner reset does not hide the outer block's earlier peak); blocks
    running concurrently in several threads do not. Only memory TensorFlow
    allocates is counted, not NumPy arrays or Python objects.

    Args:
        device: any form :func:`normalize_device` accepts; ``None`` picks the
            GPU if there is one.

    Example:
        >>> with PeakMemory("CPU:0") as m:  # doctest: +SKIP
        ...     x = tf.ones((16, 1024, 1024))
        >>> m.extra_bytes >= 64 * 1024**2  # doctest: +SKIP
        True
    """

    def __init__(self, device: str | None = "CPU:0") -> None:
        self.device: str = normalize_device(device)
        self.peak_bytes: int | None = None
        self.baseline_bytes: int | None = None
        self.extra_bytes: int | None = None
        self._seen_peak = 0

    def _enclosing(self) -> list[PeakMemory]:
        return [m for m in _ACTIVE if m.device == self.device and m is not self]

    def __enter__(self) -> PeakMemory:
        if any(m is self for m in _ACTIVE):
            raise RuntimeError("this PeakMemory block is already active")
        if self.device.startswith("CPU"):
            enable_cpu_memory_stats()
        try:
            enclosing = self._enclosing()
            if enclosing:
                # Keep the enclosing blocks' peak so far before resetting it.
                peak = _memory_info(self.device)["peak"]
                for m in enclosing:
                    m._seen_peak = max(m._seen_peak, peak)
            tf.config.experimental.reset_memory_stats(self.device)
            info = _memory_info(self.device)
        except ValueError as exc:
            raise RuntimeError(self._unavailable_message()) from exc
        self.peak_bytes = self.extra_bytes = None
        self.baseline_bytes = int(info["current"])
        self._seen_peak = int(info["peak"])
        _ACTIVE.append(self)
        return self

    def __exit__(self, *exc_info: object) -> None:
        for i, m in enumerate(_ACTIVE):
            if m is self:
                del _ACTIVE[i]
                break
        peak = int(_memory_info(self.device)["peak"])
        for m in self._enclosing():
            m._seen_peak = max(m._seen_peak, peak)
        self.peak_bytes = max(peak, self._seen_peak)
        self.extra_bytes = max(self.peak_bytes - (self.baseline_bytes or 0), 0)

    def _unavailable_message(self) -> str:
        if self.device.startswith("CPU"):
            return (
                f"TensorFlow does not track allocations on {self.device}: CPU "
                f"memory statistics need {_BFC_ENV}=true in the environment "
                "before TensorFlow's runtime initializes (before the first "
                "tensor or op). Set it when starting the program, or call "
                "jacobkit.memory.enable_cpu_memory_stats() before creating "
                "any tensor."
            )
        return (
            f"TensorFlow reports no memory statistics for {self.device} "
            "(is the device visible, and is TensorFlow's default GPU "
            "allocator in use?)"
        )

    def __repr__(self) -> str:
        if self.peak_bytes is None:
            return f"PeakMemory({self.device!r})"
        return (
            f"PeakMemory({self.device!r}, peak={format_bytes(self.peak_bytes)}, "
            f"extra={format_bytes(self.extra_bytes or 0)})"
        )


def measure_peak(
    fn: Callable[..., _T], *args: Any, device: str | None = "CPU:0", **kwargs: Any
) -> tuple[_T, int]:
    """Call ``fn(*args, **kwargs)`` and measure its peak memory on ``device``.

    Returns:
        ``(result, extra_bytes)``: the function's result and the bytes it added
        at its peak above what was in use when it started (``PeakMemory``'s
        ``extra_bytes``; the result's own tensors count, as they are alive at
        the end). ``fn`` cannot receive a keyword named ``device`` this way;
        wrap it with ``functools.partial``.

    Example:
        >>> _, extra = measure_peak(tf.ones, (16, 1024, 1024))  # doctest: +SKIP
        >>> extra >= 64 * 1024**2  # doctest: +SKIP
        True
    """
    with PeakMemory(device) as m:
        result = fn(*args, **kwargs)
    return result, m.extra_bytes or 0


# --------------------------------------------------------------------------
# budgets and formatting


def _budget_error(problem: str, value: Any) -> ValueError:
    return ValueError(f"memory_budget {problem}; got {value!r}. {_BUDGET_EXAMPLES}")


def _fraction_of(
    fraction: float | Decimal, device: str | None, free: int | None
) -> int:
    if free is None:
        free = free_bytes(device)
    elif isinstance(free, bool) or not isinstance(free, Integral) or free < 0:
        raise ValueError(f"free must be a non-negative number of bytes; got {free!r}")
    if not isinstance(fraction, Decimal):
        # repr() is the shortest exact spelling: 0.29 * 100 gives 29, not 28.
        fraction = Decimal(repr(float(fraction)))
    return int(fraction * int(free))


def parse_budget(
    budget: int | float | str | None,
    *,
    device: str | None = "CPU:0",
    free: int | None = None,
) -> int:
    """Turn a ``memory_budget`` argument into a number of bytes.

    Args:
        budget: one of

            * ``int``: bytes, > 0.
            * ``str``: a size with an optional unit, case-insensitive,
              whitespace allowed: ``"4096"``, ``"512 MiB"``, ``"2GiB"``,
              ``"1.5G"``, ``"100k"``. ``KiB MiB GiB TiB`` (and ``Ki Mi Gi
              Ti``) are binary (1024**n); ``KB MB GB TB`` are decimal
              (1000**n); the bare letters ``K M G T`` are treated as binary
              (``"1G"`` is 1 GiB). ``B``/``bytes`` or no unit: bytes.
              ``"50%"`` is a fraction of free memory. Fractional bytes are
              rounded down.
            * ``float`` in (0, 1]: that fraction of free memory.
            * ``None``: :data:`DEFAULT_BUDGET_FRACTION` (0.8) of free memory.

        device: whose free memory fractions refer to (:func:`free_bytes`).
        free: use this many bytes as the free memory instead of asking the
            device.

    Returns:
        The budget in bytes.

    Raises:
        ValueError: zero or negative sizes, a float or percentage outside
            (0, 1], an unparseable string, an unknown unit, or a bool.
        TypeError: any other type.

    Example:
        >>> parse_budget("1.5G")
        1610612736
        >>> parse_budget("2 GB")
        2000000000
        >>> parse_budget(None, free=1000)
        800
    """
    if budget is None:
        return _fraction_of(DEFAULT_BUDGET_FRACTION, device, free)
    if isinstance(budget, bool):
        raise _budget_error("must be a size or a fraction, not a bool", budget)
    if isinstance(budget, Integral):
        if budget <= 0:
            raise _budget_error("must be a positive number of bytes", budget)
        return int(budget)
    if isinstance(budget, Real):
        value = float(budget)
        if not (math.isfinite(value) and 0.0 < value <= 1.0):
            raise _budget_error(
                "as a float is a fraction of free memory and must be in (0, 1] "
                "(for an absolute size pass an int or a string such as '1.5GiB')",
                budget,
            )
        return _fraction_of(value, device, free)
    if isinstance(budget, str):
        return _parse_size_string(budget, device, free)
    raise TypeError(
        "memory_budget must be an int (bytes), a float (fraction of free "
        "memory), a str (size with unit) or None; got "
        f"{type(budget).__name__}: {budget!r}"
    )


def _parse_size_string(budget: str, device: str | None, free: int | None) -> int:
    match = _SIZE_RE.match(budget.strip())
    if match is None:
        raise _budget_error("is not a size such as '2GiB' or '512 MB'", budget)
    number_text, unit_text = match.groups()
    unit = unit_text.lower()
    try:
        number = Decimal(number_text)
    except InvalidOperation:  # pragma: no cover - the regex admits only numbers
        raise _budget_error(
            "is not a size such as '2GiB' or '512 MB'", budget
        ) from None
    if unit == "%":
        if not (0 < number <= 100):
            raise _budget_error("as a percentage must be in (0%, 100%]", budget)
        return _fraction_of(number / 100, device, free)
    if unit not in _UNITS:
        raise _budget_error(
            f"has unknown unit {unit_text!r} (known: B, K, M, G, T, "
            "KiB, MiB, GiB, TiB, KB, MB, GB, TB)",
            budget,
        )
    if number <= 0:
        raise _budget_error("must be a positive size", budget)
    size = int(number * _UNITS[unit])
    if size <= 0:
        raise _budget_error("must be at least 1 byte", budget)
    return size


def format_bytes(n: int) -> str:
    """Human-readable size with binary units and one decimal.

    Below 1 KiB the exact count is shown (``"12 B"``); above, the largest
    unit that keeps the number under 1024 (``"1.5 GiB"``, ``"512.0 MiB"``).

    Example:
        >>> format_bytes(12), format_bytes(512 * 1024**2), format_bytes(-2048)
        ('12 B', '512.0 MiB', '-2.0 KiB')
    """
    n = int(n)
    sign = "-" if n < 0 else ""
    size = abs(n)
    if size < 1024:
        return f"{sign}{size} B"
    units = ("KiB", "MiB", "GiB", "TiB", "PiB", "EiB")
    value = float(size)
    for unit in units:
        value /= 1024
        if round(value, 1) < 1024 or unit == units[-1]:
            return f"{sign}{value:.1f} {unit}"
    raise AssertionError("unreachable")  # pragma: no cover
