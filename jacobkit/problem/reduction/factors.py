"""``jk.gram``'s reduction: each row's gradient per target in the form the
Gram's inner products are cheapest from (:mod:`jacobkit.problem.reduction.products`).

- :class:`Ghost`: a factored kernel's unfolded input and cotangents;
- :class:`Lookup`: an embedding's ids and cotangents;
- :class:`Flat`: the rows' gradients formed.

Each is a ``NamedTuple``: a computation returns them through ``tf.function``,
which rebuilds them, so a form is known by its type, never by a tensor's
rank or dtype.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple, final

import tensorflow as tf

from jacobkit.problem.reduction.base import (
    Computation,
    Computations,
    Output,
    Problem,
    Reduction,
    refuse_tensor_targets,
    row_bytes,
)
from jacobkit.problem.reduction.rows import Rows


def _nbytes(tensor: Any) -> int:
    return int(tensor.shape.num_elements() or 0) * tensor.dtype.size


def _rows_of_cotangents(cotangents: Any) -> int:
    """Rows of factors whose cotangents are ``(B, K, P, O)``: ``B * K``."""
    return int(cotangents.shape[0]) * int(cotangents.shape[1])


class Ghost(NamedTuple):
    """A factored kernel's rows: ``patches`` ``(B, P, I)`` and
    ``cotangents`` ``(B, K, P, O)``, ``B * K`` rows."""

    patches: Any
    cotangents: Any

    @property
    def nbytes(self) -> int:
        return _nbytes(self.patches) + _nbytes(self.cotangents)

    @property
    def num_rows(self) -> int:
        """``B * K``: the cotangents' two leading axes (the patches' one
        leading axis is the examples', ``B``)."""
        return _rows_of_cotangents(self.cotangents)


class Lookup(NamedTuple):
    """An embedding's per-example lookup rows: ``ids`` ``(B, P)`` and
    ``cotangents`` ``(B, K, P, O)``; row ``(b, k)``'s gradient is the table
    ``Σ_p onehot(ids[b, p]) cotangents[b, k, p]ᵀ``, never formed."""

    ids: Any
    cotangents: Any

    @property
    def nbytes(self) -> int:
        return _nbytes(self.ids) + _nbytes(self.cotangents)

    @property
    def num_rows(self) -> int:
        """``B * K``: the cotangents' two leading axes."""
        return _rows_of_cotangents(self.cotangents)


class Flat(NamedTuple):
    """Rows' gradients ``(R, size)``."""

    rows: Any

    @property
    def nbytes(self) -> int:
        return _nbytes(self.rows)

    @property
    def num_rows(self) -> int:
        """``R``: the leading axis."""
        return int(self.rows.shape[0])


Feature = Ghost | Lookup | Flat


@final
@dataclass(frozen=True)
class Factors(Reduction):
    """Internal (``jk.gram``): every row's gradient per target as a
    :data:`Feature`. The ``batch`` strategy keeps a layer's factors where the
    exact Gram is cheaper from them; any other strategy gives its rows
    flattened (:class:`Flat`).

    Attributes:
        formed: every target's rows formed (:class:`Flat`), the factors'
            cost rule set aside: the arrangement ``jk.gram`` times against
            the rule's (:mod:`jacobkit.reductions.arrangement`).
    """

    name = "factors"
    public = False
    formed: bool = False
    #: ``batch`` keeps a factored kernel's or a lookup's rows as factors
    #: where its rule says (from the taps' shapes): bert_small's 32 loss
    #: rows are 388 MiB so, 1.3 GiB formed (its token table alone 953 MiB
    #: formed, 1 MiB as ids and cotangents)
    traced_result = True

    def check(self, problem: Problem) -> None:
        refuse_tensor_targets(problem, self, "pairs")

    def row_shape(self, target: Any) -> tuple[int, ...]:
        """Every row formed: the generic computation's result, and the
        most a closed form's factors take (:meth:`traced_bytes`)."""
        return tuple(target.shape)

    def traced_bytes(self, values: Sequence[Any]) -> int:
        """Each target's :data:`Feature` as traced: a :class:`Ghost`'s
        patches and cotangents, a :class:`Lookup`'s ids and cotangents, a
        :class:`Flat`'s formed rows."""
        return sum(f.nbytes for f in values)

    def formed_bytes(
        self, problem: Problem, at_once: int, native: frozenset[str]
    ) -> int:
        """None beside the result where the strategy computes the factors
        (its traced outputs are counted: :attr:`traced_result`); else the
        strategy's rows, stacked once before they are flattened into it."""
        return 0 if self.name in native else problem.num_rows * row_bytes(problem)

    def generic(
        self, problem: Problem, computation: Computations, native: frozenset[str]
    ) -> Computation:
        rows = computation(problem.with_reduction(Rows()))

        def flat(inputs: Any) -> Output:
            found = rows(inputs).values
            return Output(
                tuple(Flat(tf.reshape(j, (tf.shape(j)[0], -1))) for j in found)
            )

        return flat

    def joined(self, parts: list[Any], *, summed: bool) -> Any:
        """One feature from the replicas' pieces: concatenated along the
        examples; rows summed over the batch have one leading row, the
        factors of their positions concatenated along the positions and
        formed rows added."""
        first = parts[0]
        if not summed:
            return type(first)(*(tf.concat(p, axis=0) for p in zip(*parts)))
        if isinstance(first, Flat):
            return Flat(tf.add_n([p.rows for p in parts]))
        return type(first)(
            tf.concat([p[0] for p in parts], axis=1),
            tf.concat([p[1] for p in parts], axis=2),
        )
