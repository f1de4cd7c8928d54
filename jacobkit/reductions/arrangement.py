"""Which arrangement of a chunk's rows ``jk.gram`` runs, chosen by
measurement, among three:

- :data:`RULE`: the factors' cost rule's (a kernel's pairs from its
  unfolded input and cotangents where :func:`jacobkit.layers.norms.
  ghost_pairs` predicts them cheaper, an embedding's from its ids);
- :data:`FORMED`: every target's rows formed by the same strategy
  (:class:`~jacobkit.problem.reduction.Factors` ``formed=True``), their
  products in the same compiled call;
- :data:`MATERIALIZED`: the per-example gradients as ``jacobian()``
  computes them (the strategy ``auto`` plans for the unreduced problem),
  flattened, then ``J Jᵀ``: what a user would otherwise write.

The calls of one problem (the same call, strategy, chunk shapes and chunk
size) time them in turn (:class:`Arrangements`): the rule's against the
next that applies (:mod:`jacobkit.planner.paired`: the first call runs the
rule's, as before, the third traces the other; the faster is kept from the
seventh call on), then the one kept against the next. :data:`FORMED` is
timed where it differs from the rule's (:func:`differs`), each formed one
where two chunks of its rows, ``num_rows x`` every target's size, fit half
of the chunks' budget (:func:`rows_fit`); where neither applies the rule's
runs from the start.

NOTE (why measured, not a rule). The rule's weight
(:data:`jacobkit.layers.norms.GRAM_WEIGHT`) was measured on one CPU and
one kernel library: on the reductions benchmark's conv net (AMD EPYC,
oneDNN off, one thread) ``jk.gram`` took 23.4 ms against 19.8 ms
materializing the per-example gradients and multiplying them, and nothing
noticed. With oneDNN on, the rule's forms (the head's kernel ghosted, the
rest formed, so :data:`FORMED` is not timed) measured 1.45x the plain step
against materializing's 1.39x in one quiet run: hence :data:`MATERIALIZED`
among those timed. Timing on the problem itself holds wherever it runs,
for one more trace per arrangement and at most three calls of a slower one.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from jacobkit.planner import paired
from jacobkit.problem import PerModel
from jacobkit.reductions import features as feats

#: the factors' cost rule's forms
RULE = "rule"
#: every target's rows formed by the features' strategy, products fused
FORMED = "formed"
#: the per-example gradients as ``jacobian()`` computes them, then ``J Jᵀ``
MATERIALIZED = "materialized"

_TRIALS = PerModel(
    "jk.gram: the arrangements timed and the one chosen, per call, strategy, "
    "chunk shapes and chunk size"
)


@dataclass(frozen=True)
class Arranged:
    """How one ``jk.gram`` call arranged its rows (:attr:`jacobkit.
    reductions.grams.GramResult.arrangement`).

    Attributes:
        ran: this call's: :data:`RULE`, :data:`FORMED` or :data:`MATERIALIZED`.
        kept: the one later calls run, or ``None`` while they are timed.
        pending: the arrangements still to be timed, in order.
        best_s: each arrangement timed so far, its best timed call (seconds).
    """

    ran: str
    kept: str | None
    pending: tuple[str, ...] = ()
    best_s: dict[str, float] = field(default_factory=dict)


@dataclass
class Arrangements:
    """One problem's arrangements timed in turn: :attr:`prior` (first the
    rule's) against the first of :attr:`others` by a
    :class:`~jacobkit.planner.paired.Trial`; the faster becomes the prior
    against the next. ``others`` is ``None`` until the first call, which
    runs the rule's and tells which others apply."""

    prior: str = RULE
    others: list[str] | None = None
    trial: paired.Trial = field(default_factory=paired.Trial)
    best: dict[str, float] = field(default_factory=dict)

    @property
    def kept(self) -> str | None:
        return self.prior if self.others == [] else None

    def next(self) -> str:
        """The arrangement the next call runs."""
        if self.others and self.trial.next() == paired.OTHER:
            return self.others[0]
        return self.prior

    def record(
        self, way: str, seconds: float, applying: Callable[[], list[str]]
    ) -> None:
        """A call the way :meth:`next` said took ``seconds``; on the first,
        ``applying()`` lists the other arrangements to time."""
        if self.others is None:
            self.others = [w for w in applying() if w != self.prior]
        if not self.others:
            return
        self.trial.record(paired.PRIOR if way == self.prior else paired.OTHER, seconds)
        if self.trial.kept is None:
            return
        for side, name in ((paired.PRIOR, self.prior), (paired.OTHER, self.others[0])):
            if self.trial.times[side]:
                best = min(self.trial.times[side])
                self.best[name] = min(self.best.get(name, best), best)
        if self.trial.kept == paired.OTHER:
            self.prior = self.others[0]
        self.others = self.others[1:]
        self.trial = paired.Trial()

    def arranged(self, ran: str) -> Arranged:
        return Arranged(ran, self.kept, tuple(self.others or ()), dict(self.best))


def trial(model: Any, key: Any) -> Arrangements:
    """``model``'s trial of one problem's arrangements (kept per model)."""
    kept = _TRIALS.of(model)
    if key not in kept:
        kept[key] = Arrangements()
    found: Arrangements = kept[key]
    return found


#: the formed arrangement is timed only where the targets the rule keeps
#: as factors hold at least this share of every target's numbers: below it
#: their form cannot move a call by much, and timing it costs a trace.
#: NOTE (measured, one core, Intel Xeon, loaded). The reductions
#: benchmark's conv net ghosts its head's kernel alone (640 of 20,042
#: numbers, 3%): its formed twin traced for 1.8 s on the third call, for
#: calls within noise of each other.
MIN_SHARE = 0.1


def applying(chunk: feats.ChunkFeatures, targets: Any, allowed: int) -> list[str]:
    """The arrangements to time against the rule's, from a first chunk's
    features as the rule arranges them: :data:`FORMED` where it
    :func:`differs`, :data:`MATERIALIZED` where its rows fit
    (:func:`rows_fit`)."""
    found = [FORMED] if differs(chunk, targets, allowed) else []
    return found + ([MATERIALIZED] if rows_fit(chunk, targets, allowed) else [])


def differs(chunk: feats.ChunkFeatures, targets: Any, allowed: int) -> bool:
    """Whether a chunk's features as the rule arranges them hold factors
    (a :class:`~jacobkit.problem.reduction.Ghost` or ``Lookup``, in the
    order of ``targets``) of at least :data:`MIN_SHARE` of the targets'
    numbers, whose rows formed fit (:func:`rows_fit`)."""
    sizes = [int(t.shape.num_elements() or 0) for t in targets]
    factored = sum(
        n
        for n, f in zip(sizes, chunk.features, strict=True)
        if not isinstance(f, feats.Flat)
    )
    if factored == 0 or factored < MIN_SHARE * sum(sizes):
        return False
    return rows_fit(chunk, targets, allowed)


def rows_fit(chunk: feats.ChunkFeatures, targets: Any, allowed: int) -> bool:
    """Whether a chunk's rows formed, two chunks of them (``num_rows x``
    every target's size: ``B x P`` numbers for loss rows), fit half of
    ``allowed`` bytes (as :func:`jacobkit.reductions.grams.gram`'s chunks
    are sized)."""
    sizes = [int(t.shape.num_elements() or 0) for t in targets]
    formed = chunk.num_rows * sum(n * t.dtype.size for n, t in zip(sizes, targets))
    return 2 * formed <= allowed / 2
