"""The ``batch`` strategy's contractions: each linear part's kernel and bias
Jacobians (or their norms) from its cotangents at ``z`` and its tapped
input, by its rule's closed form (see the NOTE in
:func:`jacobkit.layers.contract.kernel_and_bias_gradients`), summed over the
part's calls where the layer runs several times, placed in the order of the
targets."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any, TypeVar, cast

import tensorflow as tf

from jacobkit.problem import Problem
from jacobkit.problem.targets import Projection
from jacobkit.strategies.batch.forward import projections
from jacobkit.strategies.chunks import map_chunks

_F = TypeVar("_F", bound=Callable[..., Any])


def no_autograph(fn: _F) -> _F:
    """``fn`` left as written by AutoGraph (kept for tf_keras models): the
    helpers below have no data-dependent control flow, and AutoGraph
    miscalled a helper from inside a comprehension over ``zip``."""
    return cast(_F, tf.autograph.experimental.do_not_convert(fn))


@no_autograph
def placed(
    problem: Problem, parts: list[tuple[Any, Any]], *, norms: bool = False
) -> list[tf.Tensor]:
    """Each part's ``(kernel, bias)`` results (or norms) at its targets'
    positions, each in its target's dtype (bias rows reshaped to the
    variable's shape: a rule gives ``(R, units)``, ``EinsumDense``'s bias is
    ``(heads, dim)``)."""
    targets = problem.targets
    out: list[Any] = [None] * len(targets)
    for projection, (kernel, bias) in zip(projections(problem), parts):
        out[projection.kernel] = tf.cast(kernel, targets[projection.kernel].dtype)
        if projection.bias is not None:
            target = targets[projection.bias]
            if not norms:
                bias = tf.reshape(bias, (-1, *target.shape))
            out[projection.bias] = tf.cast(bias, target.dtype)
    return out


@no_autograph
def each_part(
    problem: Problem,
    taps: Taps,
    dzs: list[Any],
    contract: Callable[[Projection, Any, Any, tuple[int, ...]], tuple[Any, Any]],
    *,
    norms: bool = False,
) -> list[tf.Tensor]:
    """``contract(part, x, dz, kernel_shape)`` of each tap, summed over the
    taps of each part (its calls), placed in the order of the targets
    (:func:`placed`)."""
    targets = problem.targets
    xs, parts = taps
    done: list[Any] = []
    for i, p in enumerate(projections(problem)):
        shape = tuple(targets[p.kernel].shape)
        each = [contract(p, x, dz, shape) for x, dz, j in zip(xs, dzs, parts) if j == i]
        kernel = tf.add_n([k for k, _ in each]) if len(each) > 1 else each[0][0]
        bias = each[0][1]
        if bias is not None and len(each) > 1:
            bias = tf.add_n([b for _, b in each])
        done.append((kernel, bias))
    return placed(problem, done, norms=norms)


#: each tap's input (cast to its ``z``'s dtype) and the index of its part
Taps = tuple[list[Any], list[int]]


def summed_rows(problem: Problem, taps: Taps, dzs: list[Any]) -> list[tf.Tensor]:
    """One chunk of rows summed over the batch from its row-major cotangents
    (each ``(count, B, *z.shape[1:])``), in the order of the targets."""
    return each_part(
        problem,
        taps,
        dzs,
        lambda p, x, dz, shape: p.rule.summed_gradients(x, dz, shape),
    )


def gradients(
    problem: Problem, taps: Taps, dzs: list[Any], *, summed: bool
) -> list[tf.Tensor]:
    """The kernel/bias Jacobians from the ``dzs`` in closed form (see the NOTE
    in :func:`jacobkit.layers.contract.kernel_and_bias_gradients`): one einsum
    per part, no per-row ``vectorized_map`` and no while-loop fallback."""
    # under mixed precision the layer input is float16 and ``dz`` float32
    # (``z`` is computed in the kernel's dtype): contract in float32, as the
    # loop's gradient accumulates (``xs`` are cast to ``z``'s dtype)
    return each_part(
        problem,
        taps,
        dzs,
        lambda p, x, dz, shape: p.rule.gradients(x, dz, shape, summed=summed),
    )


def by_position(patches: Any, dz: Any, *, summed: bool) -> tuple[Any, Any]:
    """``patches`` (``(B, P, I)``, or a lookup's ids ``(B, P)``) with the
    cotangents ``(B, K, P, O)``; summed rows: one example of ``B * P``
    positions."""
    batch, positions = patches.shape[0], patches.shape[1]
    cotangents = tf.reshape(dz, (batch, dz.shape[1], positions, dz.shape[-1]))
    if summed:
        patches = tf.reshape(patches, (1, batch * positions, *patches.shape[2:]))
        cotangents = tf.transpose(cotangents, (1, 0, 2, 3))
        cotangents = tf.reshape(cotangents, (1, dz.shape[1], batch * positions, -1))
    return patches, cotangents


def added(found: list[Any]) -> Any:
    return tf.add_n(found) if len(found) > 1 else found[0]


@dataclass(frozen=True)
class Cotangents:
    """Every row's cotangents at the taps' ``z``, computed in chunks of
    ``size`` rows by ``of(start, count)`` (each ``(count, B, *z.shape[1:])``):
    a form contracts them chunk by chunk (:meth:`each_chunk`) or all at once
    (:meth:`every_row`)."""

    of: Callable[[Any, Any], list[Any]]
    rows: int
    size: int
    #: one row only: its cotangents ``(B, *z.shape[1:])`` each, which
    #: :meth:`every_row` gives an axis of one row (no transpose of ``of``'s
    #: row-major layout)
    one: Callable[[], list[Any]] | None = None

    def at_most(self, most: int) -> Cotangents:
        """The same rows in chunks of at most ``most`` rows (at least one):
        the largest divisor of :attr:`rows` from ``most`` down to half of
        it (no smaller last chunk, which traces the chunk's computation once
        more), else chunks of equal size."""
        most = max(int(most), 1)
        if self.size <= most:
            return self
        for size in range(most, (most + 1) // 2 - 1, -1):
            if self.rows % size == 0:
                return replace(self, size=size)
        return replace(self, size=-(-self.rows // -(-self.rows // most)))

    def each_chunk(self, contract: Callable[[list[Any]], list[Any]]) -> list[Any]:
        """``contract`` of each chunk's cotangents, written into the result
        as it comes (the peak is the result plus one chunk)."""
        return map_chunks(
            lambda start, count: contract(self.of(start, count)), self.rows, self.size
        )

    def every_row(self) -> list[Any]:
        """Every row's cotangents, ``(B, R, *z.shape[1:])`` each (example-major,
        so that one contraction writes the result once)."""
        if self.one is not None:
            # one ExpandDims each, where the row-major chunk and its
            # transpose traced four graph ops a tap
            return [tf.expand_dims(dz, 1) for dz in self.one()]
        found = map_chunks(self.of, self.rows, self.size)
        # one Transpose each (NumPy's moveaxis built its permutation from
        # shape ops)
        return [
            tf.experimental.numpy.moveaxis(dz, 0, 1)
            if dz.shape.rank is None
            else tf.transpose(dz, (1, 0, *range(2, dz.shape.rank)))
            for dz in found
        ]
