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
        groups: clip each group of the targets to its own norm instead
            (per-layer DP-SGD): the targets' positions (in the order
            ``layer=`` gives them) in groups that cover each target once,
            e.g. ``((0, 1), (2, 3))``; ``clip_norm`` is then one norm per
            group (or one for all). Row ``r``'s gradient of group ``g``,
            ``g_{r,g}``, is scaled by ``min(1, C_g / |g_{r,g}|)`` (its norm
            over the group's targets); every group's from the same forward
            pass in one computation (one draw of the model's randomness,
            and every group's sums depend on one read of each variable).
            ``result.norms`` stays every row's norm over all targets.
    """

    clip_norm: float | tuple[float, ...]
    pad_batches: bool = False
    groups: tuple[tuple[int, ...], ...] | None = None

    name = "clipped_sum"
    sums_batches = True
    generic_passes = 2

    def __post_init__(self) -> None:
        if self.groups is not None:
            object.__setattr__(self, "groups", _groups(self.groups))
        value = self.clip_norm
        if self.groups is not None and isinstance(value, (list, tuple)):
            value = tuple(_scalar(v) for v in value)
            if len(value) != len(self.groups):
                raise ValueError(
                    f"jk.ClippedSum(clip_norm={value!r}, groups=...): expected "
                    f"one clip norm per group ({len(self.groups)}), or one for all."
                )
        else:
            value = _scalar(value)
        object.__setattr__(self, "clip_norm", value)
        several = isinstance(value, tuple) and self.groups is not None
        for one in value if several else (value,):
            if (
                isinstance(one, bool)
                or not isinstance(one, numbers.Real)
                or not float(one) > 0
            ):
                raise ValueError(
                    f"jk.ClippedSum(clip_norm={value!r}): expected a positive "
                    "number (the largest L2 norm a row's gradient keeps)"
                    + (", one per group or one for all." if self.groups else ".")
                )
        if not isinstance(self.pad_batches, bool):
            raise ValueError(
                f"jk.ClippedSum(pad_batches={self.pad_batches!r}): expected True "
                "or False."
            )

    @property
    def pads_batches(self) -> bool:  # type: ignore[override]  # others: False
        return self.pad_batches

    def clips(self, count: int) -> tuple[tuple[tuple[int, ...], float], ...]:
        """Each group of ``count`` targets with its clip norm: one group of
        every target where no ``groups`` were given."""
        groups = self.groups or (tuple(range(count)),)
        value = self.clip_norm
        norms = value if isinstance(value, tuple) else (value,) * len(groups)
        return tuple((g, float(c)) for g, c in zip(groups, norms, strict=True))

    def scales(self, norms: Any, clip: float | None = None) -> Any:
        """``min(1, clip / norm)`` per row (1 for a zero gradient);
        ``clip``: ``clip_norm`` where not given (one group)."""
        norms = tf.convert_to_tensor(norms)
        if clip is None:
            assert not isinstance(self.clip_norm, tuple), "one clip norm per group"
        clip = tf.cast(self.clip_norm if clip is None else clip, norms.dtype)
        return tf.minimum(tf.ones_like(norms), clip / tf.maximum(norms, 1e-30))

    def target_scales(self, squares: Sequence[Any]) -> tuple[list[Any], Any]:
        """From each target's squared row norms ``(R,)`` (float32, in the
        targets' order): each target's row scales ``(R,)``, its group's
        ``min(1, C_g / norm_g)`` (the same tensor for a group's targets), and
        every row's norm over all targets ``(R,)``."""
        total = tf.sqrt(tf.add_n(list(squares)))
        found: list[Any] = [None] * len(squares)
        for group, clip in self.clips(len(squares)):
            if len(group) == len(squares):
                norms = total  # one group: its norm is the total
            else:
                norms = tf.sqrt(tf.add_n([squares[i] for i in group]))
            scale = self.scales(norms, clip)
            for i in group:
                found[i] = scale
        return found, total

    def check(self, problem: Problem) -> None:
        """Refuse tensor targets, and rows that are not one per example:
        clipping bounds each example's contribution only where each row is
        one example's (its loss). Rows of ``"features"`` are sums over the
        batch, rows of ``"per_example"``, ``"full"``, a callable or
        ``jk.Loss(..., each=True)`` several per example: clipping those
        bounds no example's gradient (for DP-SGD, no privacy)."""
        refuse_tensor_targets(problem, self, "clips")
        count = len(problem.targets)
        if self.groups is not None and sorted(
            i for g in self.groups for i in g
        ) != list(range(count)):
            raise ValueError(
                f"jacobian(reduce=jk.ClippedSum(..., groups={self.groups!r})): "
                f"the groups must hold each of the {count} targets' positions "
                f"(0 to {count - 1}, in the order of layer=: "
                f"{', '.join(problem.target_names)}) exactly once."
            )
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

    def formed_bytes(
        self, problem: Problem, at_once: int, native: frozenset[str]
    ) -> int:
        """What its norms form (:meth:`generic` computes them as
        :class:`Norms`); the weighted pass forms none."""
        return Norms().formed_bytes(problem, at_once, native)

    def generic(
        self, problem: Problem, computation: Computations, native: frozenset[str]
    ) -> Computation:
        """Each row's norm (over every target, and over each group's) by the
        strategy, natively where it computes norms, else from its rows; then
        one backward pass of the rows weighted by ``min(1, C / norm)``. That
        pass gives ``sum_r s_r g_r`` at once: the gradient of ``sum_r s_r
        row_r`` is the scaled rows' gradients summed, and no row's gradient
        is formed. With ``groups``, one backward pass per group over the same
        forward pass (the tape kept), each weighted by its group's scales
        and asking for its group's targets only. All run in one computation,
        over one draw of the model's randomness (every forward pass of a
        call sees the same state: :mod:`jacobkit.keras.state`).

        NOTE (measured, loaded machine, batch 32, paired). The weighted
        backward passes per group took 1.6x one plain backward pass on the
        benchmarks' conv net (3 groups) and 4.5x on BERT tiny (22 groups);
        the groups' weighted losses stacked ``(G,)`` and one vectorized
        ``tape.jacobian`` instead, 5.0x and 12.6x (each group's pass asks
        only its own targets, so the passes of the upper layers are short).
        """
        self.check(problem)
        by_norms = Norms.name in native
        first = computation(problem.with_reduction(Norms() if by_norms else Rows()))
        targets = list(problem.targets)
        clips = self.clips(len(targets))

        def clipped(inputs: Any) -> Output:
            found = first(inputs).values
            squares = [
                tf.square(tf.reshape(tf.cast(f, tf.float32), (-1,)))
                if by_norms
                else squared_rows(f)
                for f in found
            ]
            scales, total = self.target_scales(squares)
            with tf.GradientTape(
                watch_accessed_variables=False, persistent=len(clips) > 1
            ) as tape:
                tape.watch(targets)
                rows = problem.rows(inputs)
            sums: list[Any] = [None] * len(targets)
            for group, _ in clips:
                weights = tf.reshape(
                    tf.cast(scales[group[0]], rows.dtype), tf.shape(rows)
                )
                found_sums = tape.gradient(
                    rows,
                    [targets[i] for i in group],
                    output_gradients=weights,
                    unconnected_gradients=ZERO,
                )
                for i, g in zip(group, found_sums, strict=True):
                    sums[i] = tf.convert_to_tensor(g)
            del tape
            return Output(tuple(sums), total)

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


def _groups(groups: Any) -> Any:
    """``groups`` as a tuple of tuples of ints (anything else kept, refused
    in words)."""
    try:
        found = tuple(tuple(int(i) for i in g) for g in groups)
    except (TypeError, ValueError):
        found = None
    if not found or any(not g for g in found):
        raise ValueError(
            f"jk.ClippedSum(groups={groups!r}): expected groups of target "
            "positions, e.g. ((0, 1), (2, 3)), each group not empty."
        )
    return found


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
