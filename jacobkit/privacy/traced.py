"""The clipped sums inside ``fit``'s compiled ``train_step``
(:class:`TracedSums`), on :func:`jacobkit.function`.

A batch whose size the trace knows (``fit``'s own train function traces
each batch size apart: :mod:`jacobkit.privacy.sized`; ``train_on_batch``)
is padded to the smallest padded size of the sampler
(:attr:`jacobkit.privacy.PoissonSampler.sizes`) that holds it (a sampler's
batch is of one already) and computed by that size's signature of each
:class:`~jacobkit.Function`: a trace costs one size.

Of unknown size (``None``: a step traced from a ``tf.data`` iterator, as
Keras's own train function does under a ``tf.distribute`` strategy), the
step switches on the size (``tf.switch_case``) to one branch per padded
size, where the batch, padded to that size with weight-0 examples, has a
known shape: each branch is one signature, and only the branch of the
batch's size runs. A step then costs the clipped sum of its own padded
size, but its trace traces every size (TensorFlow traces every branch of a
switch): 10 to 14 of them for a sampler's default sizes.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import tensorflow as tf

from jacobkit.compiled import Function, function
from jacobkit.privacy import step
from jacobkit.privacy.step import Clipping
from jacobkit.problem.loss import Loss


def _padded(t: Any, size: int, zeros: bool) -> tf.Tensor:
    """``t`` (``(n, ...)``, ``n <= size``) to ``(size, ...)``: its last
    example repeated, or zeros (the weights), with the static shape set."""
    t = tf.convert_to_tensor(t)
    extra = tf.maximum(size - tf.shape(t)[0], 0)
    fill = (
        tf.zeros(tf.concat([[extra], tf.shape(t)[1:]], 0), t.dtype)
        if zeros
        else tf.repeat(t[-1:], extra, axis=0)
    )
    return tf.ensure_shape(tf.concat([t, fill], 0), [size, *t.shape[1:]])


class TracedSums:
    """The clipped sums of a batch ``(x, y, w)`` of unknown size, traceable
    (see the module's docstring): one :class:`~jacobkit.Function` for
    every clipping group (``jk.ClippedSum(groups=...)``), planned eagerly on
    ``example``.

    Args:
        model: the user's model.
        variables: the trained variables.
        clipping: the groups and their clip norms.
        loss: the per-example loss rows.
        training: the model's flag.
        example: one batch ``(x, y, w)`` (the sampler's first), planned on.
        sizes: the padded sizes, smallest to largest.
    """

    def __init__(
        self,
        model: Any,
        variables: Sequence[Any],
        clipping: Clipping,
        loss: Loss,
        training: bool,
        example: tuple[Any, Any, Any],
        sizes: Sequence[int],
    ) -> None:
        self.sizes = tuple(sizes)
        self.count = len(variables)
        # one function for every clipping group: one forward pass, one draw
        # of the model's randomness, every group's sums from the same reads
        # (:func:`jacobkit.privacy.step.reduction`)
        self.function: Function = function(
            model,
            list(variables),
            example=example,
            outputs=loss,
            reduce=step.reduction(clipping),
            training=training,
        )
        # the targets' keys, in the order the variables were given
        self.keys = tuple(self.function.variables)
        if len(self.keys) != self.count:
            raise ValueError(
                f"jacobkit.privacy: {self.count} trained variables, but "
                f"{len(self.keys)} distinct targets (a variable listed twice?)."
            )

    def __call__(
        self, data: tuple[Any, Any, Any]
    ) -> tuple[list[Any], tf.Tensor, tf.Tensor | None]:
        """The clipped sums, one per variable, the ``n`` examples' norms
        before clipping (``(n,)``), and their weighted loss rows from the
        clipped sum's forward pass (``(n,)``; ``None`` where its strategy
        gives none), for a batch of ``n <= max(sizes)``."""
        x, y, w = data
        n = tf.shape(w)[0]
        largest = self.sizes[-1]
        known = w.shape[0]
        if known is not None:  # a batch of known size (train_on_batch): one size
            fits = [size for size in self.sizes if size >= known]
            if not fits:
                raise ValueError(
                    f"jacobkit.privacy: a batch of {known} examples, above the "
                    f"sampler's largest padded size ({largest})."
                )
            return self.split(self.at_size(data, fits[0]), n)
        tf.debugging.assert_less_equal(
            n,
            largest,
            message=(
                "jacobkit.privacy: a batch larger than the sampler's largest "
                f"padded size ({largest})"
            ),
        )
        sizes = tf.constant(self.sizes, tf.int32)
        branch = tf.searchsorted(sizes, tf.reshape(n, [1]), side="left")[0]
        branches = [lambda size=size: self.at_size(data, size) for size in self.sizes]
        return self.split(tf.switch_case(branch, branches), n)

    def split(
        self, found: Any, n: Any
    ) -> tuple[list[Any], tf.Tensor, tf.Tensor | None]:
        """:meth:`at_size`'s flat output as ``(sums, norms, rows)``, the
        padding's norms and rows cut."""
        sums, norms = list(found[: self.count]), found[self.count][:n]
        rows = found[self.count + 1][:n] if len(found) > self.count + 1 else None
        return sums, norms, rows

    def at_size(self, data: tuple[Any, Any, Any], size: int) -> tuple[Any, ...]:
        """The sums, the padded norms ``(size,)`` and, where the
        computation gives them, its padded loss rows ``(size,)``, of
        ``data`` padded to ``size`` examples (flat: one structure for every
        branch of the switch; one strategy computes them all)."""
        x, y, w = data
        fed = (
            tf.nest.map_structure(lambda t: _padded(t, size, False), x),
            tf.nest.map_structure(lambda t: _padded(t, size, False), y),
            _padded(w, size, True),
        )
        out = self.function(fed)
        sums = [out.values[key] for key in self.keys]
        norms = tf.cast(out.norms, tf.float32)
        given = [] if out.rows is None else [tf.cast(out.rows, tf.float32)]
        return (*sums, norms, *given)
