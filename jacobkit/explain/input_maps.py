"""Attributions on the inputs: saliency, gradient x input, integrated
gradients, SmoothGrad. Each returns ``(B, K, ...)`` for every class at once.

The definitions are xplique's and tf-keras-vis's (read in their source), so
their numbers match class by class with their normalization off; each
docstring names the settings under which they do (integrated gradients:
``rule="trapezoid"`` for xplique's; the default ``"gauss_legendre"`` places
its points as captum's default does).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import tensorflow as tf

from jacobkit.explain import completeness
from jacobkit.explain._gradients import (
    as_batch,
    input_gradients,
    mean_gradients,
    row_values,
)
from jacobkit.keras import state


def saliency(
    model: Any,
    x: Any,
    *,
    classes: Sequence[int] | None = None,
    channel_axis: int | None = -1,
    **kwargs: Any,
) -> tf.Tensor:
    """Saliency maps for every class: ``max_c |d Y[b, k] / d x[b]|``.

    Args:
        model: a Keras 3 or ``tf_keras`` model, or a callable ``f(x)`` whose
            output is ``(B, ..., K)`` (rows are summed over middle axes).
        x: the inputs, ``(B, H, W, C)`` for images (any ``(B, ...)``).
        classes: these indices of the output's last axis (default: all).
        channel_axis: the axis of ``x`` reduced by the max (default the
            last); ``None`` keeps every channel (``|gradient|``).
        **kwargs: passed to :func:`jacobkit.jacobian` (``strategy``,
            ``memory_budget``, ``device``, ``training``, ``output``).

    Returns:
        ``(B, K, H, W)`` for images (``(B, K, *x.shape[1:])`` without the
        channel axis).

    Same numbers as xplique's ``Saliency`` (one class per call, its targets
    one-hot) and tf-keras-vis's ``Saliency`` with ``normalize_map=False`` and
    ``keepdims=False`` (one ``CategoricalScore`` per class).
    """
    x = as_batch(x, "saliency")
    if channel_axis is not None and not -x.shape.rank < channel_axis < x.shape.rank:
        raise ValueError(
            f"explain.saliency(channel_axis={channel_axis}): x has shape "
            f"{tuple(x.shape)}, axes 1 .. {x.shape.rank - 1} (or negative); pass "
            "the channel axis (-1 for channels last), or None to keep every channel."
        )
    grads = tf.abs(input_gradients(model, x, classes, **kwargs))
    if channel_axis is None:
        return grads
    axis = channel_axis % x.shape.rank + 1  # x's axis, after the class axis
    return tf.reduce_max(grads, axis=axis)


def gradient_x_input(
    model: Any, x: Any, *, classes: Sequence[int] | None = None, **kwargs: Any
) -> tf.Tensor:
    """``x[b] * d Y[b, k] / d x[b]`` for every class: ``(B, K, *x.shape[1:])``.

    Same numbers as xplique's ``GradientInput``.
    """
    x = as_batch(x, "gradient_x_input")
    grads = input_gradients(model, x, classes, **kwargs)
    return grads * tf.cast(x[:, None], grads.dtype)


#: ``integrated_gradients(rule=...)``: where the path's points are and how
#: their gradients are averaged (:func:`path_points`)
RULES = ("riemann", "trapezoid", "gauss_legendre")


@dataclass(frozen=True)
class IntegratedGradients:
    """Integrated gradients of every row (example ``b``, class ``k``), with
    their completeness gap.

    Attributes:
        maps: ``(B, K, *x.shape[1:])``: ``(x - x0) *`` the path's mean
            gradient.
        gap: ``(B, K)``, one per row: ``maps[b, k].sum() - (outputs[b, k] -
            baseline_outputs[b, k])``, how far the attributions miss their
            row's change (captum's convergence delta, signed; float64). It
            shrinks as ``steps`` grows (:mod:`jacobkit.explain.completeness`).
        outputs: ``(B, K)``: each row at ``x``, ``f(x)``.
        baseline_outputs: ``(B, K)``: each row at the baseline, ``f(x0)``.
        steps: the points on the path.
        rule: how their gradients were averaged (:data:`RULES`).
    """

    maps: tf.Tensor
    gap: np.ndarray
    outputs: np.ndarray
    baseline_outputs: np.ndarray
    steps: int
    rule: str

    @property
    def relative_gap(self) -> np.ndarray:
        """``(B, K)``: ``|gap|`` over ``|f(x) - f(x0)|`` (rows of a change
        below 1% of the largest: over that 1%), what the warning judges."""
        change = self.outputs - self.baseline_outputs
        return completeness.relative_gaps(self.gap, change)


def integrated_gradients(
    model: Any,
    x: Any,
    *,
    steps: int = 32,
    baseline: Any = None,
    rule: str = "gauss_legendre",
    classes: Sequence[int] | None = None,
    memory_budget: Any = None,
    **kwargs: Any,
) -> IntegratedGradients:
    """Integrated gradients for every class: ``(x - x0) *`` a weighted
    average of ``grad(x0 + a (x - x0))`` over ``steps`` points ``a`` in
    ``[0, 1]`` (the quadrature ``rule``), and each row's completeness gap.

    Args:
        steps: the number of points on the path (>= 2): the gradients the
            call takes, whatever the rule.
        baseline: ``x0``, broadcast to ``x`` (default zeros).
        rule: where the points are and how their gradients are averaged
            (:func:`path_points`). ``"gauss_legendre"`` (the default): the
            Gauss-Legendre nodes of ``[0, 1]`` and their weights, no end
            point; captum's default (``method="gausslegendre"``).
            ``"trapezoid"``: ``a = linspace(0, 1, steps)``, the mean over
            the ``steps - 1`` intervals of the mean of their two ends (the
            ends weighted ``1 / (2 (steps - 1))``, the others ``1 / (steps -
            1)``): xplique's ``IntegratedGradients(steps=steps,
            baseline_value=0)`` (its ``_average_gradients``).
            ``"riemann"`` (the default up to 0.2.0): the
            plain mean over ``linspace(0, 1, steps)``, every point weighted
            ``1 / steps``. All tend to the integral as ``steps`` grows; at
            the default 32 steps the largest relative gap measured
            (``benchmarks/results/cpu/ig_rules.md``, random-init models,
            zero baseline) was 3.1e-6 to 8.4e-5 with Gauss-Legendre, 5.6e-4
            to 1.6e-2 with the trapezoid rule, 3.1e-2 to 2.0e-1 with
            riemann (an MLP, a conv net, MobileNetV2), at the same cost.
        memory_budget: the ``steps x B`` interpolated inputs run in chunks
            whose gradients take at most a quarter of it (default: all steps
            in one call); passed on to :func:`jacobkit.jacobian`.

    Returns:
        :class:`IntegratedGradients`: the maps ``(B, K, *x.shape[1:])`` and
        the gap ``(B, K)``, from one more forward pass at ``x0`` and one at
        ``x``. A
        :class:`~jacobkit.explain.completeness.CompletenessWarning` where a
        row's gap is above 5% of its ``|f(x) - f(x0)|``.

    With ``training=True`` the call is one draw of the model's randomness
    and state (:func:`jacobkit.keras.state.one_call`): every pass starts
    from the state as it was, and the call moves it once, as one ``model(x,
    training=True)`` would (the pass at ``x`` comes last). The path's
    points run batched together (as captum and xplique batch them), so in
    training mode they share one chunk's batch statistics and draw that
    chunk's dropout masks; ``f(x)`` and ``f(x0)`` see their own batch's.
    The gap includes those differences.

    With ``rule="trapezoid"``, the same maps as xplique's
    ``IntegratedGradients(steps=steps, baseline_value=0)`` for a zero
    baseline; the default does not match xplique. tf-keras-vis has no
    integrated gradients.
    """
    x = as_batch(x, "integrated_gradients")
    if int(steps) < 2:
        raise ValueError(f"integrated_gradients(steps={steps}): need >= 2 steps")
    if rule not in RULES:
        raise ValueError(
            f"integrated_gradients(rule={rule!r}): expected 'gauss_legendre' "
            "(Gauss-Legendre quadrature, captum's), 'trapezoid' (the trapezoid "
            "rule, xplique's) or 'riemann' (the mean of the path's gradients)."
        )
    count = int(steps)
    x0 = tf.zeros_like(x) if baseline is None else _baseline(baseline, x)
    alphas, weights = path_points(count, rule)
    path = [x0 + tf.cast(a, x.dtype) * (x - x0) for a in alphas]
    with state.one_call(bool(kwargs.get("training", False))):
        mean = mean_gradients(model, path, classes, memory_budget, weights, **kwargs)
        # x's pass last: the state moves as model(x, training=True) moves it
        start, outputs = row_values(model, [x0, x], classes, **kwargs)
    maps = mean * tf.cast((x - x0)[:, None], mean.dtype)
    summed = tf.reduce_sum(tf.reshape(maps, (*maps.shape[:2], -1)), axis=-1)
    gap = completeness.gap_of(np.asarray(summed), outputs - start)
    completeness.warn_if_large(
        "explain.integrated_gradients",
        gap,
        outputs - start,
        steps=count,
        hint="try a baseline where the model is smooth between it and x "
        "(a blurred or mean input rather than zeros).",
    )
    return IntegratedGradients(maps, gap, outputs, start, count, rule)


def path_points(count: int, rule: str) -> tuple[list[float], list[float]]:
    """``count`` points ``a`` on the path ``x0 + a (x - x0)`` and their
    weights (summing to 1) under ``rule``: ``a = linspace(0, 1, count)``
    weighted ``1 / count`` each (``"riemann"``) or by the trapezoid rule;
    or the Gauss-Legendre nodes and weights of ``[0, 1]`` (``(1 + t) / 2``
    and ``w / 2`` for ``numpy.polynomial.legendre.leggauss(count)``'s ``t``
    and ``w``: captum's ``method="gausslegendre"``; no end point)."""
    if rule == "gauss_legendre":
        nodes, weights = np.polynomial.legendre.leggauss(count)
        return [float(t) for t in (1.0 + nodes) / 2], [float(w) / 2 for w in weights]
    alphas = [float(a) for a in np.linspace(0.0, 1.0, count)]
    if rule == "riemann":
        return alphas, [1.0 / count] * count
    trapezoid = [1.0 / (count - 1)] * count
    trapezoid[0] = trapezoid[-1] = 0.5 / (count - 1)
    return alphas, trapezoid


def smoothgrad(
    model: Any,
    x: Any,
    *,
    samples: int = 16,
    noise: float = 0.2,
    seed: int = 0,
    classes: Sequence[int] | None = None,
    memory_budget: Any = None,
    **kwargs: Any,
) -> tf.Tensor:
    """SmoothGrad for every class: the mean of the input gradients at
    ``samples`` noisy copies ``x + N(0, noise^2)``: ``(B, K, *x.shape[1:])``.

    ``noise`` is the standard deviation in the inputs' units; ``seed`` makes
    the copies reproducible. The copies run in chunks as in
    :func:`integrated_gradients`.

    xplique's ``SmoothGrad(nb_samples=samples, noise=noise)`` and
    tf-keras-vis's ``Saliency(smooth_samples=samples,
    smooth_noise=noise)`` draw other noise (and tf-keras-vis scales it by
    the input's range, then takes ``|.|`` and the channel max): their means
    agree with this one in distribution, not to the last digit.

    With ``training=True`` the call is one draw, as
    :func:`integrated_gradients`'s: it moves the model's state once, as one
    ``model(x, training=True)`` would, from one more forward pass at ``x``
    (the noisy copies' passes move nothing).
    """
    x = as_batch(x, "smoothgrad")
    if int(samples) < 1:
        raise ValueError(f"smoothgrad(samples={samples}): need >= 1 sample")
    if not float(noise) >= 0:
        raise ValueError(
            f"smoothgrad(noise={noise}): the noise's standard deviation must be "
            ">= 0 (in the inputs' units)."
        )
    noisy = [
        x + tf.random.stateless_normal(x.shape, (seed, i), stddev=noise, dtype=x.dtype)
        for i in range(int(samples))
    ]
    training = bool(kwargs.get("training", False))
    with state.one_call(training):
        maps = mean_gradients(model, noisy, classes, memory_budget, **kwargs)
        if training:  # the pass whose moves the call keeps: model(x)'s
            row_values(model, [x], classes, **kwargs)
    return maps


def _baseline(baseline: Any, x: tf.Tensor) -> tf.Tensor:
    """``baseline`` broadcast to ``x``'s shape, or jacobkit's refusal."""
    value = tf.cast(baseline, x.dtype)
    try:
        return tf.broadcast_to(value, x.shape)
    except (ValueError, tf.errors.InvalidArgumentError) as err:
        raise ValueError(
            f"integrated_gradients(baseline=...): shape {tuple(value.shape)} does "
            f"not broadcast to x's {tuple(x.shape)}. Pass one input's shape "
            f"{tuple(x.shape[1:])}, x's, or a number."
        ) from err
