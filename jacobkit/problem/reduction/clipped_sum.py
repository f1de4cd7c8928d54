"""``reduce=jk.ClippedSum(C)``: DP-SGD's clipped sum of the rows' gradients."""

from __future__ import annotations

import numbers
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, final

import tensorflow as tf

from jacobkit.layers.base import squared_rows
from jacobkit.problem.reduction.base import (
    Call,
    Computation,
    Computations,
    Group,
    Output,
    Problem,
    Reduction,
    refuse_tensor_targets,
)
from jacobkit.problem.reduction.norms import Norms
from jacobkit.problem.reduction.rows import Rows

ZERO = tf.UnconnectedGradients.ZERO


@final
@dataclass(frozen=True)
class ClippedSum(Reduction):
    """``reduce=jk.ClippedSum(clip_norm)``: the sum over rows of each row's
    gradient scaled to an L2 norm of at most ``clip_norm`` (over all targets
    together): ``sum_r g_r * min(1, clip_norm / |g_r|)``, DP-SGD's clipped
    sum (the noise is the caller's to add). The result holds it in each
    target's shape, and ``result.norms`` every row's norm before clipping.

    Rows are per-example losses (``outputs=jk.Loss(loss_fn)`` with ``(x,
    y)`` inputs), one per example: other rows (``"features"``, summed over
    the batch; several per example) are refused, since clipping them bounds
    no example's contribution.
    Where closed forms serve the targets it is one forward and one backward
    pass: the norms from each layer's input and output cotangents (ghost
    norms), the clipped sum contracted from the same cotangents scaled per
    row; elsewhere the norms chunk by chunk, then one backward pass
    weighted by the scales, in the same compiled call. No row's gradient is
    held beside another's.

    Args:
        clip_norm: the largest L2 norm a row's gradient keeps.
        pad_batches: pad each batch with examples of sample weight 0 up to
            one of a few sizes (four per doubling: 32, 40, 48, 56, 64, 80,
            ...; :mod:`jacobkit.problem.padding`), so that batches of
            varying size, as DP-SGD's Poisson samples are, trace a few
            times instead of once per size. Exact: a row of weight 0 has a
            zero gradient; its norm is left out of ``result.norms``. Needs
            ``outputs=jk.Loss(...)`` with a loss of one value per example
            that does not depend on the others: a mean over the batch
            inside the loss would scale every gradient by ``n / padded``,
            and is refused (checked on the first padded call per model and
            loss, by one forward pass: :func:`jacobkit.problem.padding.
            check_batch_size`).
    """

    clip_norm: float
    pad_batches: bool = False

    name = "clipped_sum"
    sums_batches = True
    generic_passes = 2

    def __post_init__(self) -> None:
        value = _scalar(self.clip_norm)
        object.__setattr__(self, "clip_norm", value)
        if (
            isinstance(value, bool)
            or not isinstance(value, numbers.Real)
            or not float(value) > 0
        ):
            raise ValueError(
                f"jk.ClippedSum(clip_norm={value!r}): expected a positive number "
                "(the largest L2 norm a row's gradient keeps)."
            )
        if not isinstance(self.pad_batches, bool):
            raise ValueError(
                f"jk.ClippedSum(pad_batches={self.pad_batches!r}): expected True "
                "or False."
            )

    @property
    def pads_batches(self) -> bool:  # type: ignore[override]  # others: False
        return self.pad_batches

    def scales(self, norms: Any) -> Any:
        """``min(1, clip_norm / norm)`` per row (1 for a zero gradient)."""
        norms = tf.convert_to_tensor(norms)
        clip = tf.cast(self.clip_norm, norms.dtype)
        return tf.minimum(tf.ones_like(norms), clip / tf.maximum(norms, 1e-30))

    def check(self, problem: Problem) -> None:
        """Refuse tensor targets, and rows that are not one per example:
        clipping bounds each example's contribution only where each row is
        one example's (its loss). Rows of ``"features"`` are sums over the
        batch, rows of ``"per_example"``, ``"full"``, a callable or
        ``jk.Loss(..., each=True)`` several per example: clipping those
        bounds no example's gradient (for DP-SGD, no privacy)."""
        refuse_tensor_targets(problem, self, "clips")
        loss = problem.rows_spec.loss
        if loss is None or loss.each:
            mode = problem.rows_spec.mode
            raise ValueError(
                f"jacobian(reduce={self!r}, outputs={mode!r}): a clipped sum "
                "clips one row per example, each example's loss gradient; these "
                "rows are "
                + (
                    "summed over the batch"
                    if mode == "features"
                    else "not one per example"
                )
                + ", so clipping them bounds no example's contribution. Pass "
                "outputs=jk.Loss(loss_fn) (without each=True) with (x, y) inputs: "
                "jk.jacobian(model, (x, y), variables, outputs=jk.Loss(loss_fn), "
                "reduce=jk.ClippedSum(...))."
            )

    def check_batches(self, call: Call, *, multi_worker: bool) -> None:
        super().check_batches(call, multi_worker=multi_worker)
        if call.out is not None:
            raise ValueError(
                "jacobian(reduce=jk.ClippedSum(...), out=...): a clipped sum is "
                "one sum in each target's shape, kept in memory; drop out=."
            )
        if multi_worker:
            raise ValueError(
                "jacobian(reduce=jk.ClippedSum(...), distribute=...): a clipped "
                "sum runs on the replicas of one host (MirroredStrategy); with "
                "several workers, call it on each worker's share of the data "
                "and add the sums."
            )

    def row_shape(self, target: Any) -> None:
        return None

    def result_bytes(self, problem: Problem) -> int:
        return super().result_bytes(problem) + problem.num_rows * (
            problem.output_dtype.size
        )

    def generic(
        self, problem: Problem, computation: Computations, native: frozenset[str]
    ) -> Computation:
        """Each row's norm (over every target) by the strategy, natively where
        it computes norms, else from its rows; then one backward pass of the
        rows weighted by ``min(1, C / norm)``. That pass gives ``sum_r s_r
        g_r`` at once: the gradient of ``sum_r s_r row_r`` is the scaled
        rows' gradients summed, and no row's gradient is formed. Both run in
        one computation, over one draw of the model's randomness (every
        forward pass of a call sees the same state: :mod:`jacobkit.keras.state`)."""
        self.check(problem)
        by_norms = Norms.name in native
        first = computation(problem.with_reduction(Norms() if by_norms else Rows()))
        targets = list(problem.targets)

        def clipped(inputs: Any) -> Output:
            found = first(inputs).values
            squares = [
                tf.square(tf.reshape(tf.cast(f, tf.float32), (-1,)))
                if by_norms
                else squared_rows(f)
                for f in found
            ]
            total = tf.sqrt(tf.add_n(squares))
            scales = self.scales(total)
            with tf.GradientTape(watch_accessed_variables=False) as tape:
                tape.watch(targets)
                rows = problem.rows(inputs)
            sums = tape.gradient(
                rows,
                targets,
                output_gradients=tf.reshape(
                    tf.cast(scales, rows.dtype), tf.shape(rows)
                ),
                unconnected_gradients=ZERO,
            )
            return Output(tuple(tf.convert_to_tensor(g) for g in sums), total)

        return clipped

    def grouped(self, problem: Problem, groups: Sequence[Group]) -> Computation:
        """Over groups of the targets: each group's per-target norms by its
        strategy (natively where it computes norms), every row's total norm
        ``sqrt(sum over the groups' targets of norm²)``, then the one
        weighted backward pass of :meth:`generic` over every target at once
        (the weights need every group's norms first)."""
        norms = Norms()

        def by_groups(norms_problem: Any) -> Computation:
            return norms.grouped(norms_problem, groups)

        return self.generic(problem, by_groups, frozenset({Norms.name}))

    def joined(self, parts: list[Any], *, summed: bool) -> Any:
        """The replicas' sums added up (their norms: :meth:`joined_norms`)."""
        return tf.add_n(parts)


def _scalar(value: Any) -> Any:
    """A scalar tensor or NumPy scalar as a Python float (a bool, a tensor of
    another shape or a non-number kept, for the check to refuse in words)."""
    if isinstance(value, (bool, numbers.Real)) and not hasattr(value, "dtype"):
        return value
    shape = getattr(value, "shape", None)
    dtype = getattr(value, "dtype", None)
    if shape is None or tuple(shape) != () or dtype is None:
        return value
    dtype = tf.as_dtype(dtype)
    if dtype.is_bool or not (dtype.is_floating or dtype.is_integer):
        return value
    try:
        return float(value)
    except (TypeError, ValueError):  # a symbolic tensor: left to the check
        return value
