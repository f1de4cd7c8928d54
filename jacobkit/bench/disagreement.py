"""When a strategy disagrees with the reference: one rule, used by
``jacobkit compare`` and the benchmark suite."""

from __future__ import annotations

from collections.abc import Sequence

from jacobkit.testing.close import BASELINE_FACTOR

__all__ = [
    "DISAGREEMENT_FLOOR",
    "disagreement_limit",
    "disagreement_line",
    "disagrees",
]

#: the largest max. relative difference from the reference that always agrees
DISAGREEMENT_FLOOR = 1e-4


def disagreement_limit(loop_diff: float = 0.0) -> float:
    """The max. relative difference from the reference above which a strategy
    disagrees: :data:`DISAGREEMENT_FLOOR`, or
    ``jacobkit.testing.BASELINE_FACTOR`` × the loop's own difference ``loop_diff``
    where that is larger (mixed precision, deep models: the float32 loop
    itself is far from a float64 reference).

    ``jacobkit compare`` passes its loop row's difference: it runs on any
    model. The benchmark suite passes none, on purpose: its problems are fixed
    float32 models on which the floor holds, and a limit that grew with the
    loop's error would let a regression of the loop hide the others'.
    """
    return max(DISAGREEMENT_FLOOR, BASELINE_FACTOR * loop_diff)


def disagrees(max_rel_diff: float | None, limit: float = DISAGREEMENT_FLOOR) -> bool:
    """Whether a difference from the reference (``None``: not measured) is
    above ``limit`` (:func:`disagreement_limit`)."""
    return max_rel_diff is not None and max_rel_diff > limit


def disagreement_line(labels: Sequence[str], limit: float) -> str:
    """The line naming the strategies that disagree."""
    return f"DISAGREE (max rel. diff > {limit:.1e}): " + ", ".join(labels)
