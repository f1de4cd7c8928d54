"""What the plan cache keeps of a session (:class:`CacheEntry`), as JSON
(a session writes one with ``Session.cache_entry`` and continues from one
with ``Session.restore``).

The JSON object's keys: ``current`` and ``pending`` (strategies as
:func:`~jacobkit.strategies.to_spec` writes them), ``segment_rows``,
``row_bytes``, ``spent_s``, ``estimates``, ``rejected``,
``allowed_bytes`` and ``cpu``; :mod:`jacobkit.planner.cache` adds ``format`` on
writing. ``allowed_bytes`` and a rejection's ``memory`` came later: an entry
without them reads as written under an unknown budget, its rejections for
memory known by their reasons (:func:`rejection_from_json`), so a newer
reader loses nothing and an older one ignores them.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from jacobkit import strategies
from jacobkit.problem.plan import Estimate, Rejection
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
        spent_s: time spent running ``current`` since the last try, less
            ``rent`` times what that try cost beyond its prediction
            (negative until that is earned back).
        estimates: what was measured of each strategy run.
        rejected: the strategies left out, with the reason.
        allowed_bytes: what the budget allowed the plan (``None``: not
            known, an entry written before it was kept).
        cpu: the CPU's kind it was measured on
            (:meth:`jacobkit.runtime.CpuKind.describe`; ``None``: not known).
            The file's name holds the kind already; kept in the entry too,
            so that an entry copied to another machine's cache (or read
            under another kind) is not continued from
            (:meth:`measured_on`).
    """

    current: Strategy
    pending: tuple[Strategy, ...]
    segment_rows: int
    row_bytes: int | None
    spent_s: float
    estimates: tuple[Estimate, ...]
    rejected: tuple[Rejection, ...]
    allowed_bytes: float | None = None
    cpu: str | None = None

    def measured_on(self, cpu: str) -> bool:
        """Whether this entry may have been measured on a CPU of kind
        ``cpu`` (an entry that does not say is taken at its name's word)."""
        return self.cpu is None or self.cpu == cpu

    def left_out(
        self, fresh: Sequence[Strategy], allowed_bytes: float
    ) -> tuple[Strategy, ...]:
        """Of ``fresh``, the candidates a session starts with under a budget
        allowing ``allowed_bytes``, those this entry left out for memory
        (by configuration, or by name where none of its size fitted), where
        that budget allows more than the entry's did (or the entry does not
        say)."""
        if self.allowed_bytes is not None and allowed_bytes <= self.allowed_bytes:
            return ()
        memory = {r.strategy for r in self.rejected if r.memory}
        return tuple(s for s in fresh if s in memory or s.name in memory)

    def resume(
        self,
        fresh: Sequence[Strategy],
        allowed_bytes: float,
        fits: Callable[[Strategy], bool],
    ) -> Resumed | None:
        """How a session whose fresh start is ``fresh`` (the first runs
        first) under a budget allowing ``allowed_bytes`` continues from this
        entry, given whether a strategy ``fits`` it (what the entry measured
        known; the entry's own strategy does); ``None``: it starts afresh,
        where the fresh start's first candidate is one the entry left out
        for memory (:meth:`left_out`): a plan made under a tight budget is not
        kept under a larger one. Otherwise what it left out for memory and
        fits now is tried first."""
        freed = self.left_out(fresh, allowed_bytes)
        if fresh and fresh[0] in freed:
            return None
        kept = [s for s in self.pending if fits(s) and s not in freed]
        pending = [s for s in freed if s != self.current] + kept
        names = {s for f in freed for s in (f, f.name)}
        rejected = [r for r in self.rejected if r.strategy not in names]
        return Resumed(tuple(pending), tuple(rejected), changed=bool(freed))

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
            "allowed_bytes": self.allowed_bytes,
            "cpu": self.cpu,
        }

    @classmethod
    def from_json(cls, data: Any) -> CacheEntry:
        """The entry :meth:`to_json` wrote; ``ValueError``, ``KeyError`` or
        ``TypeError`` where ``data`` is not one (a ``row_bytes`` that is not
        a count of bytes reads as ``None``)."""
        if not isinstance(data, dict):
            raise TypeError(f"not a JSON object: {type(data).__name__}")
        row_bytes = data.get("row_bytes")
        allowed = data.get("allowed_bytes")
        cpu = data.get("cpu")
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
            allowed_bytes=None if allowed is None else _number(allowed),
            cpu=None if cpu is None else str(cpu),
        )


@dataclass(frozen=True)
class Resumed:
    """How a session continues from a :class:`CacheEntry` (its ``current``
    runs).

    Attributes:
        pending: the candidates to try, next first.
        rejected: the strategies left out, with the reason.
        changed: the entry no longer says this (it is rewritten).
    """

    pending: tuple[Strategy, ...]
    rejected: tuple[Rejection, ...]
    changed: bool


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
        "memory": rejection.memory,
    }


def rejection_from_json(data: dict[str, Any]) -> Rejection:
    """The rejection :func:`rejection_to_json` wrote (without ``memory``,
    as written before it was kept: known by the reasons the planner gives
    for memory)."""
    what = data["strategy"]
    reason = str(data["reason"])
    memory = data.get("memory")
    if memory is None:
        memory = any(words in reason for words in _MEMORY_REASONS)
    return Rejection(
        what if isinstance(what, str) else strategy_from_json(what),
        reason,
        bool(memory),
    )


#: the words of the planner's reasons for memory, in entries written before
#: ``Rejection.memory`` was kept (peaks predicted over the budget or a try's
#: room; back-offs)
_MEMORY_REASONS = ("predicted peak", "over the budget", "out of memory")


def _number(value: Any) -> float | None:
    if value is None:
        return None
    if not isinstance(value, (int, float)) or value < 0:
        raise ValueError(f"not a non-negative number: {value!r}")
    return float(value)
