"""Peak memory TensorFlow allocates on a device during a block of code.

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

from collections.abc import Callable
from typing import Any, TypeVar

import tensorflow as tf

from jacobkit import runtime
from jacobkit.memory.budget import format_bytes
from jacobkit.memory.devices import normalize_device

__all__ = ["PeakMemory", "enable_cpu_memory_stats", "measure_peak"]

_T = TypeVar("_T")


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
    return runtime.enable_bfc_cpu_allocator()


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
        return [
            m
            for m in runtime.PROCESS.meters
            if m.device == self.device and m is not self
        ]

    def __enter__(self) -> PeakMemory:
        if any(m is self for m in runtime.PROCESS.meters):
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
        runtime.PROCESS.meters.append(self)
        return self

    def __exit__(self, *exc_info: object) -> None:
        for i, m in enumerate(runtime.PROCESS.meters):
            if m is self:
                del runtime.PROCESS.meters[i]
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
                f"memory statistics need {runtime.BFC_ENV}=true in the environment "
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
