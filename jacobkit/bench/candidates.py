"""What ``jacobkit compare`` and the benchmarks run: :func:`configurations`,
and :func:`default_strategies`, those of them not predicted hopeless on a
problem (:func:`hopeless`), with the others and why."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from jacobkit import strategies
from jacobkit.problem import Problem
from jacobkit.strategies import forward

__all__ = ["Skipped", "configurations", "default_strategies", "hopeless"]


def configurations(
    num_rows: int, chunk_sizes: Iterable[int] = (1, 8, 32)
) -> list[strategies.Strategy]:
    """The one list of strategy configurations that ``jacobkit compare``, the
    benchmark suite and the other benchmarks measure: every registered
    strategy with its defaults, and ``chunked`` at ``chunk_sizes`` and at
    every row."""
    chosen = [cls() for name, cls in strategies.REGISTRY.items() if name != "chunked"]
    sizes = sorted({min(c, num_rows) for c in (*chunk_sizes, num_rows)})
    return chosen + [strategies.Chunked(c) for c in sizes]


@dataclass(frozen=True)
class Skipped:
    """A configuration left out of the default set, and why, in words."""

    strategy: strategies.Strategy
    reason: str


def default_strategies(
    problem: Problem,
) -> tuple[list[strategies.Strategy], list[Skipped]]:
    """:func:`configurations` with the default chunk sizes, but those
    predicted hopeless on ``problem`` (:func:`hopeless`), which are returned
    apart, each with its reason; ask for them by name to run them."""
    chosen, skipped = [], []
    for strategy in configurations(problem.num_rows):
        reason = hopeless(strategy, problem)
        if reason is None:
            chosen.append(strategy)
        else:
            skipped.append(Skipped(strategy, reason))
    return chosen, skipped


def hopeless(strategy: strategies.Strategy, problem: Problem) -> str | None:
    """Why ``strategy`` is predicted hopeless on ``problem``, or ``None``.

    ``forward`` makes a forward pass per chunk of parameter elements (per
    element of a Conv kernel), where the loop makes a backward pass per row:
    hopeless with more parameters than rows (auto never picks it then), or
    where its predicted passes exceed ``max_slowdown`` times the loop's (a
    DenseNet head's 1.0M parameters for 1,000 rows: 55 of 128 s of a compare
    run, at 0.1x the loop).
    """
    if not isinstance(strategy, strategies.Forward):
        return None
    parameters = sum(int(t.shape.num_elements()) for t in problem.targets)
    if parameters > problem.num_rows:
        return (
            f"{parameters:,} parameters > {problem.num_rows:,} rows (a forward "
            "pass per chunk of parameters, the loop a backward pass per row)"
        )
    slowdown = forward.predicted_slowdown(strategy, problem)
    if strategy.max_slowdown is not None and slowdown > strategy.max_slowdown:
        return (
            f"predicted {slowdown:,.0f}x the loop's passes, over its "
            f"max_slowdown={strategy.max_slowdown:g}"
        )
    return None
