"""Facts of the process's machine that change what TensorFlow computes: the
CPU's instruction sets and whether TensorFlow runs its oneDNN kernels."""

from __future__ import annotations

import functools
import platform
from dataclasses import dataclass

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


@functools.cache
def cpu_kind(path: str = _CPUINFO) -> CpuKind:
    """This machine's :class:`CpuKind` (read once per process)."""
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
