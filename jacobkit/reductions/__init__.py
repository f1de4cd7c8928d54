"""Reductions of per-example gradients across many examples, beyond one
``jacobian()`` call: :func:`~jacobkit.reductions.grams.gram`, the exact inner
products between two sets' per-example gradients.

(``reduce=jk.ClippedSum`` and ``reduce=jk.Project`` reduce within one call:
:mod:`jacobkit.problem.reduction`.)
"""

from __future__ import annotations

from jacobkit.reductions.grams import GramResult, gram

__all__ = ["GramResult", "gram"]
