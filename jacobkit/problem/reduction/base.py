"""What every reduction kind is: :class:`Reduction`, and what a computation
gives back, :class:`Output`.

A reduction says what each row's gradient is reduced to (``reduce=``). Each
kind is one final frozen class in its own module of this package, and owns
everything that depends on it:

- its argument checks (:meth:`Reduction.check`, :meth:`Reduction.check_batches`);
- its result: each target's shape (:meth:`Reduction.shaped`,
  :meth:`Reduction.row_shape`) and bytes (:meth:`Reduction.result_bytes`,
  what ``auto`` plans with; where only a closed form's trace tells them,
  :attr:`Reduction.traced_result` and :meth:`Reduction.traced_bytes`), and
  what computing it holds beside (:meth:`Reduction.working_bytes`);
- how batches combine (:attr:`Reduction.sums_batches`) and how replicas'
  pieces join (:meth:`Reduction.joined`);
- its generic computation from a strategy's rows or norms
  (:meth:`Reduction.generic`), for a strategy that does not compute it
  natively (a strategy lists the kinds it does in ``Strategy.native``).

Every computation returns one :class:`Output`: the per-target values and,
for a kind that has them, every row's norm. It is a ``NamedTuple`` because it
crosses ``tf.function`` and ``tf.distribute`` boundaries, which rebuild
named tuples (and not dataclasses) from their flat tensors: nothing is
decoded by position or by rank.
"""

from __future__ import annotations

import abc
from collections.abc import Callable, Sequence
from typing import Any, ClassVar, NamedTuple, Protocol

import tensorflow as tf


class Output(NamedTuple):
    """What one computation of a reduction gives.

    Attributes:
        values: per target, in the order of ``problem.targets``: the flat
            ``(R, *v.shape)`` Jacobians (rows), each row's norm ``(R,)``, the
            clipped sum in the target's shape, the target's part of every
            row's projection ``(R, dim)``, or the Gram's per-target features.
        norms: every row's norm over all targets, ``(R,)``, where the kind
            has them (the clipped sum); else ``None``.
        rows: the rows themselves, ``(B, K)``, where the computation's own
            forward pass gives them for free (``batch``'s clipped sum: a
            DP step's training loss without another pass); else ``None``.
            Not part of the reduction's result.
    """

    values: tuple[Any, ...]
    norms: Any = None
    rows: Any = None


#: ``inputs -> Output``: one computation of a reduction on a batch
Computation = Callable[[Any], Output]
#: ``problem -> Computation``: a strategy's computation of any problem (with
#: another reduction: ``problem.with_reduction(kind)``)
Computations = Callable[[Any], Computation]
#: one group of a grouped plan: the positions of its targets among the
#: problem's, and the computations of the strategy that runs them
Group = tuple[tuple[int, ...], Computations]


class RowsSpec(Protocol):
    """What a reduction reads of how the rows are formed (``outputs=``:
    :class:`jacobkit.problem.rows.Rows` is one)."""

    @property
    def mode(self) -> Any: ...

    @property
    def loss(self) -> Any: ...


class Problem(Protocol):
    """What a reduction reads of the problem it reduces
    (:class:`jacobkit.problem.Problem` is one; this package ranks below it,
    which builds its reduction from ``reduce=``)."""

    model: Any
    targets: tuple[Any, ...]
    target_names: tuple[str, ...]
    tensor_targets: Any
    rows_shape: tuple[int, ...]
    num_rows: int
    output_dtype: Any

    @property
    def rows_spec(self) -> RowsSpec: ...

    @property
    def blocked(self) -> bool: ...

    def rows(self, inputs: Any) -> Any: ...

    def with_reduction(self, kind: Reduction) -> Any: ...

    def restricted(self, indices: Sequence[int]) -> Any: ...


class Call(Protocol):
    """What a reduction reads of a call over many batches
    (:class:`jacobkit.problem.Call` is one)."""

    @property
    def outputs(self) -> Any: ...

    @property
    def out(self) -> Any: ...

    @property
    def summed(self) -> bool: ...


class Reduction(abc.ABC):
    """A kind of ``reduce=``: abstract; every kind is a final frozen
    dataclass in its own module of :mod:`jacobkit.problem.reduction`."""

    #: the kind's name: its module's, and what strategies and tests call it
    name: ClassVar[str]
    #: whether ``jacobian(reduce=...)`` takes it (``jk.gram``'s factors: no)
    public: ClassVar[bool] = True
    #: the forward passes the kind's generic computation makes (a clipped
    #: sum: the norms' and the weighted sum's; they see the same draw of the
    #: model's randomness only where a seed state pins it)
    generic_passes: ClassVar[int] = 1
    #: over a dataset, the batches' results are added up (a clipped sum);
    #: else each batch's rows follow the last's
    sums_batches: ClassVar[bool] = False
    #: whether each row's gradient is reduced (every kind but the rows):
    #: ``auto`` plans such a call by its result's bytes
    #: (:mod:`jacobkit.planner.reduced`), the rows by measuring
    reduces: ClassVar[bool] = True
    #: whether rows summed over a dataset's batches may be reduced (a norm of
    #: a sum over batches is not a sum of the batches' norms)
    linear: ClassVar[bool] = False

    @property
    def argument(self) -> Any:
        """How the user spells this kind in ``reduce=`` (``None``,
        ``"norm"``, or the object itself), as results and errors show it."""
        return self

    #: whether a strategy that computes this kind itself gives a result
    #: whose bytes only its traced computation tells (``jk.gram``'s
    #: factors: which target ``batch`` keeps as factors, and their
    #: positions): ``auto`` then counts the traced outputs
    #: (:meth:`traced_bytes`) in place of :meth:`result_bytes`
    traced_result: ClassVar[bool] = False

    #: whether each batch is padded with examples of weight 0
    #: (``jk.ClippedSum(..., pad_batches=True)``)
    pads_batches: ClassVar[bool] = False

    # -- checks --------------------------------------------------------------
    def check(self, problem: Problem) -> None:  # noqa: B027 - optional hook
        """Refuse, in words, a problem this kind cannot reduce."""

    def check_batches(self, call: Call, *, multi_worker: bool) -> None:  # noqa: B027 - optional hook
        """Refuse, in words, a dataset call this kind cannot reduce
        (``multi_worker``: ``distribute=`` spans several workers)."""
        if call.summed and not self.linear:
            raise ValueError(
                f"jacobian(reduce={self.argument!r}, outputs={call.outputs!r}): "
                "over a dataset these rows are summed over the batches, and the "
                "norm of a sum over batches is not the sum of their norms. Use "
                "rows of single examples (outputs='per_example', or "
                "jk.Loss(...)), or pass one batch of arrays."
            )

    # -- the result ----------------------------------------------------------
    @abc.abstractmethod
    def row_shape(self, target: Any) -> tuple[int, ...] | None:
        """What the result holds per row of ``target``: its Jacobian
        (``target.shape``), its norm (``()``), its part of the row's
        projection (``(dim,)``); ``None`` where the result is not per row
        (a sum)."""

    def shaped(self, problem: Problem, value: Any, target: Any) -> Any:
        """A computation's flat value for ``target`` in the result's shape:
        ``rows_shape + row_shape``, or the target's own shape where the
        result is not per row. A tensor already in its shape is returned as
        it is (an eager reshape per target took 0.1 ms, 0.6 ms of a 6.8 ms
        clipped-sum call on a 3-layer MLP)."""
        per_row = self.row_shape(target)
        shape = tuple(target.shape) if per_row is None else problem.rows_shape + per_row
        if tuple(value.shape) == shape:
            return value
        return tf.reshape(value, shape)

    def result_bytes(self, problem: Problem) -> int:
        """Bytes of the result of one batch as the kind's generic
        computation gives it (``auto`` plans with it)."""
        size = problem.output_dtype.size
        total = 0
        for target in problem.targets:
            per_row = self.row_shape(target)
            if per_row is None:
                total += int(target.shape.num_elements())
            else:
                count = 1
                for n in per_row:
                    count *= int(n)
                total += problem.num_rows * count
        return total * size

    def working_bytes(self, problem: Problem) -> int:
        """Bytes the kind's computation holds beside its result and the
        strategy's own tensors (a projection's maps and the rows it maps
        formed); ``auto`` adds them once to a prediction."""
        return 0

    #: copies of the rows formed that computing the kind holds at once (a
    #: norm's: the rows, their squares, and pfor's copy of a chunk's rows:
    #: ``grouped``'s norms of a user layer's 256 x 256 kernel measured 16.1
    #: MiB on ``chunked(16)``, its two chunks' rows and squares 16.0)
    formed_copies: ClassVar[int] = 3

    def formed_bytes(
        self, problem: Problem, at_once: int, native: frozenset[str]
    ) -> int:
        """Bytes of rows' gradients formed that computing this kind holds at
        its peak on a strategy whose own computation of a kind holds
        ``at_once`` rows formed and that computes the kinds ``native``
        itself: ``at_once`` rows where it computes this kind, else every row
        (the generic computation reduces the strategy's rows, all of them
        formed), :attr:`formed_copies` times; ``auto`` adds them to a
        prediction.

        NOTE (measured, why). Uncounted, ``reduce="norm"`` on ``chunked(16)``
        of an MLP with a user layer (256 -> 256 -> 256 -> 3, 32 loss rows,
        0.5 MiB a row formed) predicted 2.7 MiB and measured 12.6."""
        rows = at_once if self.name in native else problem.num_rows
        return self.formed_copies * rows * row_bytes(problem)

    def traced_bytes(self, values: Sequence[Any]) -> int:
        """Bytes of a traced computation's per-target ``values`` (specs or
        symbolic tensors), where :attr:`traced_result`: every tensor they
        hold."""
        return sum(
            int(t.shape.num_elements() or 0) * t.dtype.size
            for t in tf.nest.flatten(tuple(values))
            if t is not None
        )

    def joined(self, parts: list[Any], *, summed: bool) -> Any:
        """One value from the pieces the replicas of ``distribute=`` computed,
        in order: concatenated along the rows (each piece's own examples), or
        added up where the rows are summed over the batch."""
        return tf.add_n(parts) if summed else tf.concat(parts, axis=0)

    # -- computing -----------------------------------------------------------
    def grouped(self, problem: Problem, groups: Sequence[Group]) -> Computation:
        """This kind over disjoint groups of the targets, each computed by its
        own strategy on the problem restricted to them
        (``problem.restricted``), in one computation. Here each target's
        value is its group's, in the targets' order (the rows, their norms,
        a projection's or a Gram's per-target parts: sums over the targets
        are taken of these later), and every row's norm over all targets,
        where the groups give them, is ``sqrt(sum of the groups' norms²)``.
        A kind whose values need every target before they are formed (a
        clipped sum: the rows' total norms before the weights) overrides it."""
        built = [
            (indices, computation(problem.restricted(indices)))
            for indices, computation in groups
        ]
        count = len(problem.targets)

        def combined(inputs: Any) -> Output:
            values: list[Any] = [None] * count
            squares = []
            for indices, computation in built:
                found = computation(inputs)
                for i, value in zip(indices, found.values, strict=True):
                    values[i] = value
                if found.norms is not None:
                    squares.append(tf.square(found.norms))
            norms = tf.sqrt(tf.add_n(squares)) if squares else None
            return Output(tuple(values), norms)

        return combined

    @abc.abstractmethod
    def generic(
        self, problem: Problem, computation: Computations, native: frozenset[str]
    ) -> Computation:
        """This kind computed from what any strategy computes: ``computation``
        gives the strategy's computation of ``problem`` with another kind
        (``problem.with_reduction(...)``), ``native`` names the kinds it
        computes itself. One computation: what it composes runs in one
        compiled call."""


def row_bytes(problem: Problem) -> int:
    """Bytes of one row's gradient formed, over every target."""
    size = sum(int(t.shape.num_elements()) for t in problem.targets)
    return size * problem.output_dtype.size


def refuse_tensor_targets(problem: Problem, kind: Reduction, verb: str) -> None:
    """Refuse ``Inputs()``/``Output()`` targets: a reduction over every
    target together is of the variables' gradients."""
    if problem.tensor_targets is not None:
        raise ValueError(
            f"jacobian(reduce={kind.argument!r}): {verb} the gradients of "
            f"variables, got the tensor target(s) {', '.join(problem.target_names)}."
        )
