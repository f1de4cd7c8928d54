"""One DP-SGD step's parts: the clipped sums (over all trained variables
together, or layer by layer), and the seeded noise.

:func:`clipped_sums` is the one place the eager step asks jacobkit for the
clipped sum (``fit`` with ``run_eagerly=True``: :mod:`jacobkit.privacy.model`;
the compiled step: :mod:`jacobkit.privacy.traced`); both ask for the one
:func:`reduction` of every group.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import tensorflow as tf

from jacobkit.api import jacobian
from jacobkit.keras import layer_tree
from jacobkit.problem.loss import Loss
from jacobkit.problem.reduction import ClippedSum


@dataclass(frozen=True)
class Clipping:
    """How a step clips: the trained variables in groups, each group's
    gradient clipped to its own L2 norm (one group: all variables together).

    Attributes:
        groups: each group's variable indices (into the trained variables).
        clips: each group's clip norm.
        names: each group's name (its layer's path; ``"all"`` for one group).
    """

    groups: tuple[tuple[int, ...], ...]
    clips: tuple[float, ...]
    names: tuple[str, ...]

    @property
    def total(self) -> float:
        """The bound on one example's whole clipped gradient, ``sqrt(sum
        C_l^2)``: the noise's scale (the sensitivity)."""
        return math.sqrt(sum(c * c for c in self.clips))


def _positive(value: Any, what: str) -> float:
    if (
        isinstance(value, bool)
        or not isinstance(value, numbers.Real)
        or not float(value) > 0
    ):
        raise ValueError(f"jacobkit.privacy: {what}={value!r}; expected a number > 0.")
    return float(value)


def layer_groups(model: Any, variables: Sequence[Any]) -> dict[str, tuple[int, ...]]:
    """The trained variables grouped by the layer that holds them,
    ``{layer path: indices}`` in the model's order (a layer's path: the
    names from below the model, joined by ``/``)."""
    index = {id(v): i for i, v in enumerate(variables)}
    groups: dict[str, tuple[int, ...]] = {}
    seen: set[int] = set()
    for layer, path in layer_tree.walk(model):
        own = [
            index[id(w)]
            for w in layer_tree.own_trainable_weights(layer)
            if id(w) in index and id(w) not in seen
        ]
        if own:
            seen.update(id(variables[i]) for i in own)
            groups["/".join(path) or model.name] = tuple(own)
    for i, v in enumerate(variables):  # held by no layer found: its own group
        if id(v) not in seen:
            groups[str(getattr(v, "path", v.name))] = (i,)
    return groups


def clipping_for(
    model: Any,
    variables: Sequence[Any],
    l2_norm_clip: float,
    per_layer: bool | Mapping[str, float],
) -> Clipping:
    """The :class:`Clipping` of ``make_private``'s arguments: one group
    clipped to ``l2_norm_clip``; with ``per_layer=True``, each of the ``L``
    layers to ``l2_norm_clip / sqrt(L)`` (one example's whole gradient then
    stays within ``l2_norm_clip``); with a dict ``{layer path: C_l}``, each
    layer to its own (every layer with trained variables named)."""
    clip = _positive(l2_norm_clip, "l2_norm_clip")
    if per_layer is False:
        return Clipping((tuple(range(len(variables))),), (clip,), ("all",))
    groups = layer_groups(model, variables)
    if per_layer is True:
        each = clip / math.sqrt(len(groups))
        return Clipping(tuple(groups.values()), (each,) * len(groups), tuple(groups))
    if not isinstance(per_layer, Mapping):
        raise ValueError(
            f"jacobkit.privacy: per_layer={per_layer!r}; expected True, False or "
            "a dict {layer path: clip norm}."
        )
    unknown = sorted(set(per_layer) - set(groups))
    missing = sorted(set(groups) - set(per_layer))
    if unknown or missing:
        raise ValueError(
            "jacobkit.privacy: per_layer names every layer with trained variables "
            f"by its path, and only those: {', '.join(groups)}"
            + (f"; unknown: {', '.join(map(str, unknown))}" if unknown else "")
            + (f"; missing: {', '.join(missing)}" if missing else "")
            + "."
        )
    clips = tuple(_positive(per_layer[name], f"per_layer[{name!r}]") for name in groups)
    return Clipping(tuple(groups.values()), clips, tuple(groups))


def clipped_sums(
    model: Any,
    data: tuple[Any, Any, Any],
    variables: Sequence[Any],
    clipping: Clipping,
    loss: Loss,
    training: bool,
) -> tuple[list[tf.Tensor], tf.Tensor]:
    """The clipped sums of ``data``'s per-example loss gradients, one per
    variable, each group clipped to its norm; and every example's gradient
    norm before clipping (over all variables), shape ``(B,)``.

    One :func:`jacobkit.jacobian` call for every group (one forward pass,
    one draw of the model's randomness: :func:`reduction`)."""
    result = jacobian(
        model,
        data,
        list(variables),
        outputs=loss,
        reduce=reduction(clipping),
        training=training,
    )
    sums = [
        tf.cast(value, v.dtype)
        for v, value in zip(variables, result.jacobians.values(), strict=True)
    ]
    return sums, tf.convert_to_tensor(result.norms)


def reduction(clipping: Clipping) -> ClippedSum:
    """The one ``jk.ClippedSum`` of a step: over all trained variables, or
    with ``groups=`` (per layer), each group clipped to its own norm in the
    same computation.

    NOTE (a bug this removes). The compiled step once called one
    ``jk.function`` per group: a group's forward pass read every group's
    variables but only its own sums fed their update, and in about 1 model
    in 10 (machine loaded) a variable of another group was read after this
    step's update of it, although the graph had the control edges. One
    computation makes every update depend on the same reads, and draws the
    model's randomness (dropout) once for all groups."""
    if len(clipping.groups) == 1:
        return ClippedSum(clipping.clips[0])
    return ClippedSum(clipping.clips, groups=clipping.groups)


def noise(
    variables: Sequence[Any], seed: int, step: Any, std: float
) -> list[tf.Tensor]:
    """Gaussian noise of standard deviation ``std``, one tensor per
    variable: variable ``i``'s at step ``t`` is ``tf.random.stateless_normal(
    shape, seed=stateless_fold_in((seed, t), i))`` times ``std``, drawn in
    float32 and cast to the variable's dtype. A function of ``(seed, t)``:
    the same step draws the same noise, eagerly or compiled."""
    key = tf.stack([tf.constant(seed, tf.int64), tf.cast(step, tf.int64)])
    found = []
    for i, variable in enumerate(variables):
        draw = tf.random.stateless_normal(
            tf.shape(variable),
            seed=tf.random.experimental.stateless_fold_in(key, i),
            dtype=tf.float32,
        )
        found.append(tf.cast(draw * std, variable.dtype))
    return found
