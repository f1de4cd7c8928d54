"""What ``auto`` measured and chose: typed records, and the :class:`Plan`.

They name the strategies they are about by a type parameter, ``StrategyT``:
:mod:`jacobkit.planner` fills them with :class:`jacobkit.strategies.Strategy`
(its plans are ``Plan[Strategy]``), which ranks above this module. A record
reads of a strategy only what :class:`Configured` states: its label and its
chunk size.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Generic, Protocol, TypeVar

from jacobkit import memory


class Configured(Protocol):
    """A configured strategy as a record shows it (every
    :class:`~jacobkit.strategies.Strategy` is one)."""

    @property
    def label(self) -> str: ...

    @property
    def chunk_size(self) -> int | None: ...


#: the strategies' type a record names (``Strategy``, for ``auto``'s plans)
StrategyT = TypeVar("StrategyT", bound=Configured)


@dataclass(frozen=True)
class Probe(Generic[StrategyT]):
    """One run of a strategy over the rows of a real call.

    Every probe is part of an answer: ``auto`` times a strategy while it
    computes rows ``[start, start + rows)`` of a call, and keeps them.

    Attributes:
        strategy: what computed the rows.
        call: which ``jacobian`` call of this process (1 for the first).
        start: the first row (0: a run computes every row).
        rows: rows computed.
        seconds: wall time, tracing included if ``traced``.
        traced: whether the strategy was traced (compiled) for this run.
        peak_bytes: peak device memory during the run, when measured.
        first_call_s: where the run did not trace because its computation
            was compiled before this plan ran it (a fixed strategy's call,
            or another plan's, in this process): that computation's traced
            first call, in seconds (``None``: it traced here, or runs
            eagerly).
    """

    strategy: StrategyT
    call: int
    start: int
    rows: int
    seconds: float
    traced: bool
    peak_bytes: int | None = None
    first_call_s: float | None = None


@dataclass(frozen=True)
class Estimate(Generic[StrategyT]):
    """What ``auto`` knows of one strategy on this problem.

    Attributes:
        strategy: the configured strategy.
        seconds_per_row: steady time per row, from runs that did not
            trace (``None`` until one ran).
        trace_s: measured tracing time: the traced run's time minus its
            rows at the steady rate (``None`` until traced and timed).
        peak_bytes: highest peak of its runs (``None``: not measured).
        predicted_peak_bytes: the peak predicted before it ran (from the
            forward pass's activations and the rows it holds at once).
    """

    strategy: StrategyT
    seconds_per_row: float | None = None
    trace_s: float | None = None
    peak_bytes: int | None = None
    predicted_peak_bytes: int | None = None

    def seconds(self, num_rows: int) -> float | None:
        """Predicted steady time for ``num_rows`` rows."""
        if self.seconds_per_row is None:
            return None
        return self.seconds_per_row * num_rows

    @property
    def peak(self) -> int | None:
        """The measured peak, else the predicted one."""
        return (
            self.peak_bytes
            if self.peak_bytes is not None
            else (self.predicted_peak_bytes)
        )


@dataclass(frozen=True)
class Rejection(Generic[StrategyT]):
    """A strategy ``auto`` does not run, and why.

    Attributes:
        strategy: the configuration, or a registered name.
        reason: why, in words.
        memory: the reason is memory (predicted or measured over what the
            budget allows, out of memory): a larger budget reconsiders it,
            in this process or from the plan cache.
    """

    strategy: StrategyT | str
    reason: str
    memory: bool = False

    @property
    def label(self) -> str:
        return self.strategy if isinstance(self.strategy, str) else self.strategy.label


@dataclass(frozen=True)
class Switch(Generic[StrategyT]):
    """``auto`` changed strategy between two runs.

    Attributes:
        call: the call in which it switched (1 for the first call).
        row: the first row the new strategy computed in that call (0: it
            computed every row).
        old: the strategy before.
        new: the strategy after.
        reason: why (a measured rate, a back-off, a race).
    """

    call: int
    row: int
    old: StrategyT
    new: StrategyT
    reason: str


@dataclass(frozen=True)
class Plan(Generic[StrategyT]):
    """What ``auto`` runs, what it measured, and why.

    Attributes:
        strategy: what the next call runs (once :attr:`settled`, every call).
        budget_bytes: the memory budget planned for.
        result_bytes: size of the Jacobians themselves.
        num_rows: rows of the problem (``R``); every call computes them all
            in one run.
        predicted_time_s: predicted steady time of a call with
            :attr:`strategy` (``None`` until it ran).
        predicted_peak_bytes: its measured (or, before it ran, predicted)
            peak memory above the baseline, result included.
        estimates: what is known of each strategy that ran.
        pending: candidates not measured yet, next first; ``auto`` tries one
            on a later call (configured for every row) once the time spent
            running the current strategy exceeds
            :attr:`~jacobkit.planner.policy.Policy.rent` times the
            candidate's predicted tracing time.
        rejected: strategies not run (or raced and lost), with the reason.
        switches: every change of strategy so far, with the reason.
        last_call: the runs of the most recent call (the last one computed
            its rows; those before it failed and were backed off from).
        source: ``"not run yet"``, ``"measured"`` (this process measured
            it) or ``"disk cache"`` (loaded, nothing re-measured to choose).
        calls: ``jacobian`` calls this process made with this plan.
        structure: the exact structural shortcut :attr:`strategy` uses (see
            :mod:`jacobkit.problem.structure`), or ``None``.
    """

    strategy: StrategyT
    budget_bytes: int
    result_bytes: int
    num_rows: int
    predicted_time_s: float | None = None
    predicted_peak_bytes: int | None = None
    estimates: tuple[Estimate[StrategyT], ...] = ()
    pending: tuple[StrategyT, ...] = ()
    rejected: tuple[Rejection[StrategyT], ...] = ()
    switches: tuple[Switch[StrategyT], ...] = ()
    last_call: tuple[Probe[StrategyT], ...] = ()
    source: str = "not run yet"
    calls: int = 0
    structure: str | None = None

    @property
    def segment_rows(self) -> int:
        """Rows per run: every row (calls are no longer split into
        segments; kept for code that reads it)."""
        return self.num_rows

    @property
    def chunk_size(self) -> int | None:
        return self.strategy.chunk_size

    @property
    def settled(self) -> bool:
        """Nothing left to try: every call runs :attr:`strategy`."""
        return not self.pending

    def estimate(self, strategy: StrategyT) -> Estimate[StrategyT] | None:
        """What is known of ``strategy``, if it ran."""
        return next((e for e in self.estimates if e.strategy == strategy), None)

    def summary(self) -> str:
        """A few lines: the choice, the measurements, switches, rejections."""
        lines = [
            f"auto -> {self.strategy.label}: predicted peak "
            f"{_bytes(self.predicted_peak_bytes)} of a "
            f"{memory.format_bytes(self.budget_bytes)} budget, predicted time "
            f"{_ms(self.predicted_time_s)} (result "
            f"{memory.format_bytes(self.result_bytes)}; {self.num_rows} rows, "
            f"all at once; {self.source})"
        ]
        if self.structure:
            lines.append(
                f"  structure: {self.structure} (exact; checked with jk.verify "
                "on the first call)"
            )
        for e in self.estimates:
            per_call = e.seconds(self.num_rows)
            lines.append(
                f"  measured {e.strategy.label}: {_ms(per_call)} per call, "
                f"trace {_ms(e.trace_s)}, peak {_bytes(e.peak_bytes)}"
            )
        for s in self.switches:
            lines.append(
                f"  call {s.call}, row {s.row}: switched {s.old.label} -> "
                f"{s.new.label}: {s.reason}"
            )
        if self.pending:
            lines.append(
                "  still to try on later calls: "
                + ", ".join(s.label for s in self.pending)
            )
        lines += [f"  rejected {r.label}: {r.reason}" for r in self.rejected]
        return "\n".join(lines)

    __str__ = summary


def _ms(seconds: float | None) -> str:
    return "unknown" if seconds is None else f"{seconds * 1e3:.1f} ms"


def _bytes(n: int | None) -> str:
    return "unknown" if n is None else memory.format_bytes(n)
