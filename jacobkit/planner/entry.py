"""What the plan cache keeps of a session (:class:`CacheEntry`), as JSON
(a session writes one with ``Session.cache_entry`` and continues from one
with ``Session.restore``).

The JSON object's keys: ``current`` and ``pending`` (strategies as
:func:`~jacobkit.strategies.to_spec` writes them), ``segment_rows``,
``row_bytes``, ``spent_s``, ``estimates`` and ``rejected``;
:mod:`jacobkit.planner.cache` adds ``format`` on writing.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from jacobkit import strategies
from jacobkit.planner.plan import Estimate, Rejection
from jacobkit.strategies import Strategy


@dataclass(frozen=True)
class CacheEntry:
    """One problem's plan, as the disk cache keeps it.

    Attributes:
        current: the strategy calls run.
        pending: the candidates still to try, next first.
        segment_rows: rows per run it was planned for: every row (an entry
            written for segments of rows, by an earlier version, is planned
            again).
        row_bytes: the measured memory prior per row (``None``: unknown or
            unusable, the forward pass's activations are used instead).
        spent_s: time spent running ``current`` since the last try.
        estimates: what was measured of each strategy run.
        rejected: the strategies left out, with the reason.
    """

    current: Strategy
    pending: tuple[Strategy, ...]
    segment_rows: int
    row_bytes: int | None
    spent_s: float
    estimates: tuple[Estimate, ...]
    rejected: tuple[Rejection, ...]

    def to_json(self) -> dict[str, Any]:
        """The entry as a JSON-friendly dict."""
        return {
            "current": strategy_to_json(self.current),
            "pending": [strategy_to_json(s) for s in self.pending],
            "segment_rows": self.segment_rows,
            "row_bytes": self.row_bytes,
            "spent_s": self.spent_s,
            "estimates": [estimate_to_json(e) for e in self.estimates],
            "rejected": [rejection_to_json(r) for r in self.rejected],
        }

    @classmethod
    def from_json(cls, data: Any) -> CacheEntry:
        """The entry :meth:`to_json` wrote; ``ValueError``, ``KeyError`` or
        ``TypeError`` where ``data`` is not one (a ``row_bytes`` that is not
        a count of bytes reads as ``None``)."""
        if not isinstance(data, dict):
            raise TypeError(f"not a JSON object: {type(data).__name__}")
        row_bytes = data.get("row_bytes")
        return cls(
            current=strategy_from_json(data["current"]),
            pending=tuple(strategy_from_json(s) for s in data["pending"]),
            segment_rows=int(data["segment_rows"]),
            row_bytes=(
                int(row_bytes)
                if isinstance(row_bytes, int) and row_bytes >= 0
                else None
            ),
            spent_s=float(data["spent_s"]),
            estimates=tuple(estimate_from_json(e) for e in data["estimates"]),
            rejected=tuple(rejection_from_json(r) for r in data["rejected"]),
        )


# -- (de)serializing strategies, estimates and rejections ------------------------
def strategy_to_json(strategy: Strategy) -> dict[str, Any]:
    """A configured strategy as JSON-friendly data."""
    return strategies.to_spec(strategy)


def strategy_from_json(data: Any) -> Strategy:
    """A configured strategy; ``ValueError`` if ``data`` does not name one."""
    return strategies.from_spec(data)


def estimate_to_json(estimate: Estimate) -> dict[str, Any]:
    """What was measured of a strategy (its predicted peak is not kept)."""
    return {
        "strategy": strategy_to_json(estimate.strategy),
        "seconds_per_row": estimate.seconds_per_row,
        "trace_s": estimate.trace_s,
        "peak_bytes": estimate.peak_bytes,
    }


def estimate_from_json(data: dict[str, Any]) -> Estimate:
    """The estimate :func:`estimate_to_json` wrote."""
    return Estimate(
        strategy=strategy_from_json(data["strategy"]),
        seconds_per_row=_number(data.get("seconds_per_row")),
        trace_s=_number(data.get("trace_s")),
        peak_bytes=None if data.get("peak_bytes") is None else int(data["peak_bytes"]),
    )


def rejection_to_json(rejection: Rejection) -> dict[str, Any]:
    """A rejection (of a strategy or of a registered name)."""
    what = rejection.strategy
    return {
        "strategy": what if isinstance(what, str) else strategy_to_json(what),
        "reason": rejection.reason,
    }


def rejection_from_json(data: dict[str, Any]) -> Rejection:
    """The rejection :func:`rejection_to_json` wrote."""
    what = data["strategy"]
    return Rejection(
        what if isinstance(what, str) else strategy_from_json(what),
        str(data["reason"]),
    )


def _number(value: Any) -> float | None:
    if value is None:
        return None
    if not isinstance(value, (int, float)) or value < 0:
        raise ValueError(f"not a non-negative number: {value!r}")
    return float(value)
