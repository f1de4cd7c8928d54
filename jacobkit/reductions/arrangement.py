"""Which arrangement of a chunk's rows ``jk.gram`` runs, chosen by
measurement: the factors' cost rule's (a kernel's pairs from its unfolded
input and cotangents where :func:`jacobkit.layers.norms.ghost_pairs`
predicts them cheaper, an embedding's from its ids) or every target's rows
formed (:class:`~jacobkit.problem.reduction.Factors` ``formed=True``: what
materializing the per-example gradients and multiplying them computes).

The calls of one problem (the same call, strategy, chunk shapes and chunk
size) follow :data:`SCHEDULE`: the first call runs the rule's arrangement
(as before: nothing more traced on a first call), the third traces the
formed one, and the steady calls in between and after are timed, alternating;
from the seventh call on, the faster (by median) runs, the rule's on a tie.
Where the two are the same (every target already formed), or the formed
rows would not fit the chunks' memory, the rule's runs from the start.

NOTE (why measured, not a rule). The rule's weight
(:data:`jacobkit.layers.norms.GRAM_WEIGHT`) was measured on one CPU and
one kernel library: on the reductions benchmark's conv net (AMD EPYC,
oneDNN off, one thread) ``jk.gram`` took 23.4 ms against 19.8 ms
materializing the per-example gradients and multiplying them, and nothing
noticed. Timing both arrangements on the problem itself holds wherever it
runs, for the cost of one more trace (on the third call) and at most three
calls of the slower one.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from jacobkit.problem import PerModel
from jacobkit.reductions import features as feats

_TRIALS = PerModel(
    "jk.gram: the arrangements timed and the one chosen, per call, strategy, "
    "chunk shapes and chunk size"
)

RULE = False
FORMED = True
#: the arrangement each call runs until one is chosen (``False``: the cost
#: rule's, ``True``: every row formed)
SCHEDULE = (RULE, RULE, FORMED, FORMED, RULE, FORMED)
#: the calls of :data:`SCHEDULE` whose time counts (the others trace)
TIMED = frozenset({1, 3, 4, 5})


def choose(times: dict[bool, list[float]]) -> bool:
    """The arrangement to keep from each one's timed calls (seconds): the
    formed rows where their median is below the rule's, else the rule's."""
    if not times.get(FORMED) or not times.get(RULE):
        return RULE
    return bool(np.median(times[FORMED]) < np.median(times[RULE]))


@dataclass
class Trial:
    """One problem's arrangements: what each timed call took, and the one
    chosen (``None`` while timing)."""

    calls: int = 0
    times: dict[bool, list[float]] = field(
        default_factory=lambda: {RULE: [], FORMED: []}
    )
    chosen: bool | None = None

    def next(self) -> bool:
        """The arrangement the next call runs (``True``: every row formed)."""
        if self.chosen is not None:
            return self.chosen
        return SCHEDULE[self.calls]

    def record(self, formed: bool, seconds: float, *, differs: bool) -> None:
        """A call of ``formed``'s arrangement took ``seconds``; ``differs``:
        whether the formed arrangement is another (read on the first call)."""
        if self.chosen is not None:
            return
        if self.calls == 0 and not differs:
            self.chosen = RULE
            return
        if self.calls in TIMED:
            self.times[formed].append(seconds)
        self.calls += 1
        if self.calls == len(SCHEDULE):
            self.chosen = choose(self.times)


def trial(model: Any, key: Any) -> Trial:
    """``model``'s trial of one problem's arrangements (kept per model)."""
    kept = _TRIALS.of(model)
    if key not in kept:
        kept[key] = Trial()
    found: Trial = kept[key]
    return found


def differs(chunk: feats.ChunkFeatures, targets: Any, allowed: int) -> bool:
    """Whether a chunk's features as the rule arranges them hold factors
    (a :class:`~jacobkit.problem.reduction.Ghost` or ``Lookup``) whose rows
    formed, two chunks of them (``num_rows x`` each target's size), fit
    half of ``allowed`` bytes (as :func:`jacobkit.reductions.grams.
    gram`'s chunks are sized)."""
    if all(isinstance(f, feats.Flat) for f in chunk.features):
        return False
    formed = chunk.num_rows * sum(
        int(t.shape.num_elements() or 0) * t.dtype.size for t in targets
    )
    return 2 * formed <= allowed / 2
