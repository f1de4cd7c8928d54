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
    """

    clip_norm: float

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

    def scales(self, norms: Any) -> Any:
        """``min(1, clip_norm / norm)`` per row (1 for a zero gradient)."""
        norms = tf.convert_to_tensor(norms)
        clip = tf.cast(self.clip_norm, norms.dtype)
        return tf.minimum(tf.ones_like(norms), clip / tf.maximum(norms, 1e-30))
