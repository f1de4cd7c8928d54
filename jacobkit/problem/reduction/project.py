"""``reduce=jk.Project(dim, seed)``: each row's gradient mapped to ``dim``
numbers by a fixed random map."""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass
from typing import Any, final

from jacobkit.problem import sketch
from jacobkit.problem.reduction.base import (
    Computation,
    Computations,
    Output,
    Problem,
    Reduction,
    refuse_tensor_targets,
)
from jacobkit.problem.reduction.rows import Rows

#: ``jk.Project(small=...)``'s choices
SMALL_MAPS = ("countsketch", "gaussian")


@final
@dataclass(frozen=True)
class Project(Reduction):
    """``reduce=jk.Project(dim, seed=0)``: each row's gradient, over every
    target together, mapped by a fixed random linear map ``M`` to ``dim``
    numbers: ``result.projection`` of shape ``rows_shape + (dim,)``, each
    target's own part ``M_v g_v`` in ``result[v]`` (they sum to it).

    ``M`` depends on ``seed``, ``dim`` and each target's key and shape only
    (:mod:`jacobkit.problem.sketch`): the same rows give the same numbers in
    any batching, order, strategy or process, so a dataset can be projected
    in pieces, on several workers, and resumed with ``out=``. Inner products
    are kept in expectation: ``E[<M g, M h>] = <g, h>``.

    A small target's map is a CountSketch (each coordinate, times a random
    sign, added to one random bucket) unless ``small="gaussian"`` (a dense
    Gaussian map, jacobkit 0.2.0's). Where a layer's rule gives its input and
    output cotangents, a row's gradient is never formed: a large kernel's
    map is a Kronecker product (LoGra's factors), applied to each factor.
    See :mod:`~jacobkit.problem.sketch` for the maps and their variance.
    """

    dim: int
    seed: int = 0
    #: the map of a small target (``size * dim <= sketch.DENSE_ELEMENTS``):
    #: ``"countsketch"`` (one ``±1`` per coordinate, ``n`` multiply-adds per
    #: row, variance at most the Gaussian's) or ``"gaussian"`` (a dense
    #: ``N(0, 1/dim)`` map, ``n x dim`` multiply-adds per row: the numbers
    #: of earlier versions)
    small: str = "countsketch"

    name = "project"
    #: a projection is linear: rows summed over batches project to the sum
    linear = True

    def __post_init__(self) -> None:
        for name, value, least in (("dim", self.dim, 1), ("seed", self.seed, 0)):
            if (
                isinstance(value, bool)
                or not isinstance(value, numbers.Integral)
                or value < least
            ):
                raise ValueError(
                    f"jk.Project({name}={value!r}): expected an integer >= {least}"
                    + (
                        " (the numbers each row is mapped to)."
                        if name == "dim"
                        else "."
                    )
                )
        if self.small not in SMALL_MAPS:
            raise ValueError(
                f"jk.Project(small={self.small!r}): expected one of "
                + ", ".join(repr(k) for k in SMALL_MAPS)
                + " (the map of a target of at most "
                f"{sketch.DENSE_ELEMENTS:,} / dim numbers)."
            )

    def __repr__(self) -> str:
        """``jk.Project(dim=..., seed=...)`` as before ``small=`` existed
        where the maps are those of then (``"gaussian"``): ``out=``
        directories key on this repr, so a store of Gaussian projections
        resumes with ``small="gaussian"`` and is told apart from a store of
        CountSketch ones."""
        small = "" if self.small == "gaussian" else f", small={self.small!r}"
        return f"Project(dim={self.dim!r}, seed={self.seed!r}{small})"

    def check(self, problem: Problem) -> None:
        refuse_tensor_targets(problem, self, "maps")

    def row_shape(self, target: Any) -> tuple[int, ...]:
        return (self.dim,)

    #: the rows, their transposed copy and its signed product (which a
    #: CountSketch sums)
    formed_copies = 3

    def working_bytes(self, problem: Problem) -> int:
        """Every target's map (made on the first call, held since:
        :func:`~jacobkit.problem.sketch.map_bytes`)."""
        return sum(
            sketch.map_bytes(self, tuple(int(n) for n in t.shape))
            for t in problem.targets
        )

    def formed_bytes(
        self, problem: Problem, at_once: int, native: frozenset[str]
    ) -> int:
        """The rows mapped formed, :attr:`formed_copies` times: where the
        strategy computes the projection itself (``batch``'s closed forms),
        a small map's target's rows (:func:`~jacobkit.problem.sketch.small`;
        a Kronecker map's factored kernel's rows never are); else every
        target's (:meth:`generic` maps the strategy's rows, every one).

        NOTE (measured, why). Uncounted, the projection's prediction was
        under its measured peak: ``jk.Project(64)`` of an MLP 256 -> 256 ->
        256 -> 3 (two kernels of 65,536 numbers, small maps; 32 loss rows,
        16 MiB of them formed; oneDNN on) predicted 1.9 MiB, measured
        24-34 MiB (2.05 times the rows at most: both kernels' rows and a
        copy each at once); counted twice, 34.9 MiB, 1.04x the first call."""
        generic = self.name not in native
        size = sum(
            math.prod(int(n) for n in t.shape)
            for t in problem.targets
            if generic or sketch.small(self, tuple(int(n) for n in t.shape))
        )
        return self.formed_copies * problem.num_rows * size * problem.output_dtype.size

    def generic(
        self, problem: Problem, computation: Computations, native: frozenset[str]
    ) -> Computation:
        """Each target's part of every row's projection ``(R, dim)`` from the
        rows' Jacobians that the strategy computes (one chunk of rows where
        it chunks; a dataset's batches one by one)."""
        self.check(problem)
        rows = computation(problem.with_reduction(Rows()))
        maps = sketch.maps(problem, self)

        def projected(inputs: Any) -> Output:
            found = rows(inputs).values
            return Output(tuple(m.of_flat(j) for m, j in zip(maps, found, strict=True)))

        return projected
