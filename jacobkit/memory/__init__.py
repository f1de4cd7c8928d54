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

One concern per module:

- :mod:`~jacobkit.memory.devices`: device names (:func:`normalize_device`);
- :mod:`~jacobkit.memory.free`: free memory (:func:`free_bytes`), read from
  ``/proc/meminfo``, cgroups, TensorFlow or ``nvidia-smi``;
- :mod:`~jacobkit.memory.peak`: peak measurement (:class:`PeakMemory`,
  :func:`measure_peak`, :func:`enable_cpu_memory_stats`);
- :mod:`~jacobkit.memory.budget`: ``memory_budget`` arguments
  (:func:`parse_budget`) and :func:`format_bytes`.

This package only re-exports; the modules import each other directly.
"""

from __future__ import annotations

from jacobkit.memory.budget import DEFAULT_BUDGET_FRACTION, format_bytes, parse_budget
from jacobkit.memory.devices import normalize_device
from jacobkit.memory.free import free_bytes
from jacobkit.memory.peak import PeakMemory, enable_cpu_memory_stats, measure_peak

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
