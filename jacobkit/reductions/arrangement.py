"""Which arrangement of a chunk's rows ``jk.gram`` runs, chosen by
measurement: the factors' cost rule's (a kernel's pairs from its unfolded
input and cotangents where :func:`jacobkit.layers.norms.ghost_pairs`
predicts them cheaper, an embedding's from its ids) or every target's rows
formed (:class:`~jacobkit.problem.reduction.Factors` ``formed=True``: what
materializing the per-example gradients and multiplying them computes).

The calls of one problem (the same call, strategy, chunk shapes and chunk
size) time the two (:mod:`jacobkit.planner.paired`: the first call runs the
rule's, as before, the third traces the formed one; the faster is kept
from the seventh call on). Where the two are the same (every target
already formed, or the factored ones a small share: :data:`MIN_SHARE`), or
the formed rows would not fit the chunks' memory, the rule's runs from the
start.

NOTE (why measured, not a rule). The rule's weight
(:data:`jacobkit.layers.norms.GRAM_WEIGHT`) was measured on one CPU and
one kernel library: on the reductions benchmark's conv net (AMD EPYC,
oneDNN off, one thread) ``jk.gram`` took 23.4 ms against 19.8 ms
materializing the per-example gradients and multiplying them, and nothing
noticed. Timing both arrangements on the problem itself holds wherever it
runs, for the cost of one more trace (on the third call) and at most three
calls of the slower one (one where it is over twice as slow).
"""

from __future__ import annotations

from typing import Any

from jacobkit.planner import paired
from jacobkit.problem import PerModel
from jacobkit.reductions import features as feats

_TRIALS = PerModel(
    "jk.gram: the arrangements timed and the one chosen, per call, strategy, "
    "chunk shapes and chunk size"
)


def trial(model: Any, key: Any) -> paired.Trial:
    """``model``'s trial of one problem's arrangements (kept per model):
    :data:`~jacobkit.planner.paired.PRIOR` the rule's,
    :data:`~jacobkit.planner.paired.OTHER` every row formed."""
    kept = _TRIALS.of(model)
    if key not in kept:
        kept[key] = paired.Trial()
    found: paired.Trial = kept[key]
    return found


#: the formed arrangement is timed only where the targets the rule keeps
#: as factors hold at least this share of every target's numbers: below it
#: their form cannot move a call by much, and timing it costs a trace.
#: NOTE (measured, one core, Intel Xeon, loaded). The reductions
#: benchmark's conv net ghosts its head's kernel alone (640 of 20,042
#: numbers, 3%): its formed twin traced for 1.8 s on the third call, for
#: calls within noise of each other.
MIN_SHARE = 0.1


def differs(chunk: feats.ChunkFeatures, targets: Any, allowed: int) -> bool:
    """Whether a chunk's features as the rule arranges them hold factors
    (a :class:`~jacobkit.problem.reduction.Ghost` or ``Lookup``, in the
    order of ``targets``) of at least :data:`MIN_SHARE` of the targets'
    numbers, whose rows formed, two chunks of them (``num_rows x`` each
    target's size), fit half of ``allowed`` bytes (as :func:`jacobkit.
    reductions.grams.gram`'s chunks are sized)."""
    sizes = [int(t.shape.num_elements() or 0) for t in targets]
    factored = sum(
        n
        for n, f in zip(sizes, chunk.features, strict=True)
        if not isinstance(f, feats.Flat)
    )
    if factored == 0 or factored < MIN_SHARE * sum(sizes):
        return False
    formed = chunk.num_rows * sum(n * t.dtype.size for n, t in zip(sizes, targets))
    return 2 * formed <= allowed / 2
