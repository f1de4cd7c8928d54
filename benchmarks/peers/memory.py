"""Peak resident-memory growth of this process, the same way for every peer.

``PeakRss()`` resets the kernel's high-water mark (``VmHWM``, Linux) to the
current resident size; ``growth()`` is then the MiB the process's peak grew
by since. A framework that keeps freed memory in a pool of its own reads low
here, so the jacobkit side of the benchmark runs with TensorFlow's default
CPU allocator, which returns large blocks to the system as the others do.
"""

from __future__ import annotations


def _status(field: str) -> float:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


class PeakRss:
    def __init__(self) -> None:
        with open("/proc/self/clear_refs", "w") as refs:
            refs.write("5")  # reset VmHWM to the current resident size
        self.start = _status("VmRSS")

    def growth(self) -> float:
        return _status("VmHWM") - self.start
