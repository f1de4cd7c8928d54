"""Peak resident-memory growth of this process, the same way for every peer.

``PeakRss()`` gives the heap's free memory back to the system
(``malloc_trim``), then resets the kernel's high-water mark (``VmHWM``,
Linux) to the current resident size; ``growth()`` is then the MiB the
process's peak grew by since. Without the trim, memory an earlier call freed
is reused without showing. A framework that keeps freed memory in a pool of
its own would still read low, so the jacobkit side of the benchmark runs with
TensorFlow's default CPU allocator (plain ``malloc``), as PyTorch and JAX do
on the CPU.
"""

from __future__ import annotations

import ctypes


def _status(field: str) -> float:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


class PeakRss:
    def __init__(self) -> None:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
        with open("/proc/self/clear_refs", "w") as refs:
            refs.write("5")  # reset VmHWM to the current resident size
        self.start = _status("VmRSS")

    def growth(self) -> float:
        return _status("VmHWM") - self.start
