"""``reduce=``: what each row's gradient is reduced to, without the
Jacobians being held.

- ``"norm"``: each row's L2 norm per target, shape ``rows_shape``.
- :class:`ClippedSum`: DP-SGD's clipped sum: each row's gradient (over every
  target together) scaled to norm at most ``clip_norm``, summed over the
  rows; the targets' own shapes, with every row's norm beside.
- :class:`Project`: each row's gradient (over every target) mapped by a
  fixed random linear map to ``dim`` numbers (:mod:`jacobkit.project`).
"""

from __future__ import annotations

import numbers
from dataclasses import dataclass
from typing import Any

import tensorflow as tf


@dataclass(frozen=True)
class ClippedSum:
    """``reduce=jk.ClippedSum(clip_norm)``: the sum over rows of each row's
    gradient scaled to an L2 norm of at most ``clip_norm`` (over all targets
    together): ``sum_r g_r * min(1, clip_norm / |g_r|)``, DP-SGD's clipped
    sum (the noise is the caller's to add). The result holds it in each
    target's shape, and ``result.norms`` every row's norm before clipping.

    Rows are usually per-example losses (``outputs=jk.Loss(loss_fn)``).
    Where closed forms serve the targets it is one forward and one backward
    pass: the norms from each layer's input and output cotangents (ghost
    norms), the clipped sum contracted from the same cotangents scaled per
    row; elsewhere the norms chunk by chunk, then one backward pass
    weighted by the scales. No row's gradient is held beside another's.

    Args:
        clip_norm: the largest L2 norm a row's gradient keeps.
        pad_batches: pad each batch with examples of sample weight 0 up to
            one of a few sizes (four per doubling: 32, 40, 48, 56, 64, 80,
            ...; :mod:`jacobkit.problem.padding`), so that batches of
            varying size, as DP-SGD's Poisson samples are, trace a few
            times instead of once per size. Exact: a row of weight 0 has a
            zero gradient; its norm is left out of ``result.norms``. Needs
            ``outputs=jk.Loss(...)``.
    """

    clip_norm: float
    pad_batches: bool = False

    def __post_init__(self) -> None:
        value = self.clip_norm
        if (
            isinstance(value, bool)
            or not isinstance(value, numbers.Real)
            or not value > 0
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

    def scales(self, norms: Any) -> Any:
        """``min(1, clip_norm / norm)`` per row (1 for a zero gradient)."""
        norms = tf.convert_to_tensor(norms)
        clip = tf.cast(self.clip_norm, norms.dtype)
        return tf.minimum(tf.ones_like(norms), clip / tf.maximum(norms, 1e-30))


@dataclass(frozen=True)
class Project:
    """``reduce=jk.Project(dim, seed=0)``: each row's gradient, over every
    target together, mapped by a fixed random linear map ``M`` to ``dim``
    numbers: ``result.projection`` of shape ``rows_shape + (dim,)``, each
    target's own part ``M_v g_v`` in ``result[v]`` (they sum to it).

    ``M`` depends on ``seed``, ``dim`` and each target's key and shape only
    (:mod:`jacobkit.problem.sketch`): the same rows give the same numbers in
    any batching, order, strategy or process, so a dataset can be projected
    in pieces, on several workers, and resumed with ``out=``. Inner products
    are kept in expectation: ``E[<M g, M h>] = <g, h>``.

    Where a layer's rule gives its input and output cotangents, a row's
    gradient is never formed: a large kernel's map is a Kronecker product
    (LoGra's factors), applied to each factor. See :mod:`~jacobkit.problem.sketch`
    for the maps and their variance.
    """

    dim: int
    seed: int = 0

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


@dataclass(frozen=True)
class Factors:
    """Internal (``jk.gram``): each row's gradient per target as the
    ``batch`` strategy holds it before contracting: a layer's input and
    output cotangents where the exact Gram is cheaper from them, else the
    gradient flattened (:mod:`jacobkit.strategies.batch.contract`)."""


#: the reductions jacobian() takes besides None and "norm"
REDUCTIONS = (ClippedSum, Project)
