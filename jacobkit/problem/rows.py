"""``outputs=`` and ``features=``: how rows are formed from the model output.

The model output ``Y`` has shape ``(B, ..., F)``. ``features=`` keeps a
subset of its last axis; ``outputs=`` then makes rows of it:
``"features"`` sums over every axis but the last (``F`` rows),
``"per_example"`` over the middle axes (``B × F`` rows), ``"full"`` keeps
every element, a callable ``g(Y)`` makes each of its elements a row, and
``jk.Loss(loss_fn)`` makes each example's loss a row (``B`` rows; the
labels come with the inputs, :mod:`jacobkit.problem.loss`).
"""

from __future__ import annotations

import difflib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import tensorflow as tf

from jacobkit.problem.loss import Loss

OUTPUT_MODES = ("features", "per_example", "full")


@dataclass(frozen=True)
class Rows:
    """How rows are formed from the model output ``Y`` of shape ``(B, ..., F)``.

    ``mode`` is ``"features"``, ``"per_example"``, ``"full"`` or a callable
    ``g(Y)``; ``features`` keeps a subset of the last axis of ``Y`` first.
    """

    mode: str | Callable[[Any], tf.Tensor] | Loss
    features: tuple[int, ...] | None

    @property
    def loss(self) -> Loss | None:
        """The per-example loss making the rows, or ``None``."""
        return self.mode if isinstance(self.mode, Loss) else None

    def select(self, outputs: Any) -> Any:
        """``Y[..., features]``: shape ``(B, ..., len(features))``."""
        if self.features is None:
            return outputs
        # Negative indices count from the end. They are made non-negative
        # here: tf.gather's gradient silently drops negative indices, which
        # made features=[-1] return an all-zero Jacobian.
        width = outputs.shape[-1]
        if width is None:
            indices = tf.math.floormod(
                tf.constant(self.features), tf.shape(outputs)[-1]
            )
        else:
            indices = [f % width for f in self.features]
        return tf.gather(outputs, indices, axis=-1)

    def of(self, outputs: Any, labels: tuple[Any, ...] = ()) -> tf.Tensor:
        """The rows, shaped ``rows_shape`` (``labels``: the ``(y,)`` or ``(y,
        sample_weight)`` of loss rows)."""
        selected = self.select(outputs)
        if isinstance(self.mode, Loss):
            return self.mode.rows(selected, labels)
        if callable(self.mode):
            return tf.convert_to_tensor(self.mode(selected))
        if self.mode == "features":
            axes = list(range(selected.shape.rank - 1))
            return tf.reduce_sum(selected, axis=axes) if axes else selected
        if self.mode == "per_example":
            return self.per_example(selected)
        return selected

    def per_example(
        self, selected: tf.Tensor, labels: tuple[Any, ...] = ()
    ) -> tf.Tensor:
        """Per-example rows ``P`` of shape ``(B, K)``; each depends on one example.

        ``"features"`` rows are ``P.sum(axis=0)``; ``"per_example"``,
        ``"full"`` and loss rows are ``P`` itself (reshaped; ``K = 1`` for
        losses).
        """
        if isinstance(self.mode, Loss):
            losses = self.mode.rows(selected, labels)
            # ExpandDims, not a strided slice: its begin, end and strides
            # constants, and its gradient's five more (a StridedSliceGrad)
            return losses if losses.shape.rank == 2 else tf.expand_dims(losses, 1)
        if self.mode == "full":
            return tf.reshape(selected, (selected.shape[0], -1))
        middle = list(range(1, selected.shape.rank - 1))
        return tf.reduce_sum(selected, axis=middle) if middle else selected

    @property
    def decomposes_per_example(self) -> bool:
        return isinstance(self.mode, Loss) or not callable(self.mode)

    @property
    def summed_over_batch(self) -> bool:
        return self.mode == "features"

    @property
    def of_one_example(self) -> bool:
        """Each row depends on one example (``"per_example"``, ``"full"``,
        loss rows); a callable's rows may mix them."""
        return isinstance(self.mode, Loss) or self.mode in ("per_example", "full")

    def check(self, outputs: Any) -> None:
        """Raise ``ValueError`` where these rows cannot be formed from
        ``outputs`` (a ``features=`` index out of range, per-example rows of
        an output without a batch axis)."""
        if not isinstance(outputs, tf.Tensor):
            return
        if self.features is not None:
            width = outputs.shape[-1]
            bad = [f for f in self.features if not -width <= f < width]
            if bad:
                raise ValueError(
                    f"jacobian(features={list(self.features)!r}): index(es) {bad} "
                    f"are out of range for an output with {width} features (shape "
                    f"{tuple(outputs.shape)}). Valid indices are 0..{width - 1}."
                )
        if self.mode == "per_example" and outputs.shape.rank < 2:
            raise ValueError(
                f"jacobian(outputs='per_example'): needs an output of shape "
                f"(batch, ..., features), got shape {tuple(outputs.shape)}. Use "
                "outputs='full' for one row per output element."
            )


def check_mode(outputs: Any) -> None:
    """Raise ``ValueError`` unless ``outputs=`` is a mode, a callable or a
    :class:`~jacobkit.problem.loss.Loss`."""
    if isinstance(outputs, Loss):
        return
    if not (callable(outputs) or outputs in OUTPUT_MODES):
        raise ValueError(
            f"jacobian(outputs={outputs!r}): expected one of "
            f"{', '.join(repr(m) for m in OUTPUT_MODES)} or a callable "
            f"g(Y) -> tf.Tensor whose every element is a row.{_mode_hint(outputs)}"
        )


def _mode_hint(outputs: Any) -> str:
    """A misspelt mode's correction; else, for a name or an index (what
    ``output=``, singular, takes), the other argument."""
    if isinstance(outputs, str):
        close = difflib.get_close_matches(outputs.lower(), OUTPUT_MODES, n=1)
        if close:
            return f" Did you mean {close[0]!r}?"
    if isinstance(outputs, (str, int)) and not isinstance(outputs, bool):
        return (
            " To pick one output of a multi-output model by name or index, pass "
            f"output={outputs!r} (singular); outputs= says what a row is."
        )
    return ""


def check_features(features: Sequence[int] | None) -> tuple[int, ...] | None:
    """``features=`` as a tuple of ints (``None`` for all); raises for
    anything but a non-empty list of integer indices."""
    if features is None:
        return None
    not_indices = TypeError(
        f"jacobian(features={features!r}): expected a list of integer "
        "indices into the output's last axis, such as features=[0, 5, 7]."
    )
    try:
        indices = np.asarray(features)
    except (TypeError, ValueError) as err:
        raise not_indices from err
    if indices.size == 0 and indices.dtype != object:
        raise ValueError(
            f"jacobian(features={features!r}): choose at least one feature, "
            "such as features=[0, 5, 7], or pass features=None for all of them."
        )
    if indices.dtype.kind not in "iu":
        raise not_indices
    return tuple(int(f) for f in indices.reshape(-1))


def at_least_float32(value: Any) -> Any:
    """``value`` cast to float32 if it is a float16 or bfloat16 tensor."""
    if isinstance(value, tf.Tensor) and value.dtype in (tf.float16, tf.bfloat16):
        return tf.cast(value, tf.float32)
    return value
