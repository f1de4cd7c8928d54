"""Budgets and sizes: ``memory_budget`` arguments to bytes, bytes to text.

>>> parse_budget("512 MiB")
536870912
>>> parse_budget(0.5, free=1000)
500
>>> format_bytes(1536 * 1024**2)
'1.5 GiB'
"""

from __future__ import annotations

import math
import re
from decimal import Decimal, InvalidOperation
from numbers import Integral, Real
from typing import Any

from jacobkit.memory.free import free_bytes

__all__ = ["DEFAULT_BUDGET_FRACTION", "format_bytes", "parse_budget"]

DEFAULT_BUDGET_FRACTION: float = 0.8
"""Fraction of free device memory used when no ``memory_budget`` is given.

Not 1.0: the allocator fragments its pool (a request can fail while the sum of
free blocks would be enough), and the framework needs memory of its own beyond
the tensors we plan for (kernel workspaces such as cuDNN/cuBLAS scratch,
compiled-function buffers, host staging copies). 20% headroom absorbs those.
"""

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

        device: whose free memory fractions refer to
            (:func:`jacobkit.memory.free.free_bytes`).
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
