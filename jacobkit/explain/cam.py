"""Grad-CAM for every class: ``relu(sum_c mean_hw(dY_k/dA_c) A_c)``."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import tensorflow as tf

from jacobkit.api import jacobian
from jacobkit.explain._gradients import as_batch
from jacobkit.keras.graph import LayerTap, TapError
from jacobkit.problem.cache import PerModel
from jacobkit.problem.targets import find_layer
from jacobkit.problem.tensor_targets import Output

_FORWARD = PerModel("grad_cam: the compiled forward pass per layer and training")


def grad_cam(
    model: Any,
    x: Any,
    layer: Any,
    *,
    classes: Sequence[int] | None = None,
    resize: bool = True,
    training: bool = False,
    **kwargs: Any,
) -> tf.Tensor:
    """Grad-CAM maps for every class from a convolution's activation ``A``
    (``(B, h, w, C)``): ``relu(sum_c mean_hw(d Y[b, k] / d A[b]) * A[b])``.

    Args:
        model: a functional or Sequential Keras model (3 or ``tf_keras``);
            ``layer`` may sit inside a nested backbone.
        x: the inputs, ``(B, H, W, C)``.
        layer: the layer whose output is ``A``: a layer, a name or a path
            (``"mobilenetv2/Conv_1"``).
        classes: these indices of the output's last axis (default: all).
        resize: upsample the maps to ``(H, W)`` with
            ``tf.image.resize(..., "bilinear")`` (half-pixel centres);
            ``False`` keeps the activation's ``(h, w)``.
        training: passed to the model.
        **kwargs: passed to :func:`jacobkit.jacobian`.

    Returns:
        ``(B, K, H, W)`` with ``resize=True``, else ``(B, K, h, w)``.

    The gradients come from one :func:`jacobkit.jacobian` call with an
    :class:`jacobkit.Output` target (per-example rows, every class), the
    activations from one forward pass. With ``resize=False``: the same
    numbers as tf-keras-vis's ``Gradcam(...)(score, x,
    penultimate_layer=layer, normalize_cam=False, expand_cam=False)``, one
    class per call (measured within 2e-7), when ``layer`` is a Keras
    ``Conv1D``, ``Conv2D`` or ``Conv3D``, or with
    ``seek_penultimate_conv_layer=False`` there; on any other layer its
    default seeks back to the last such convolution before ``layer`` and
    maps that one (different maps). Its ``expand_cam=True`` upsamples with
    ``scipy.ndimage.zoom(order=1)`` (corner-aligned), which differs from
    ``tf.image.resize`` by up to ~20% of the map's peak.
    """
    x = as_batch(x, "grad_cam")
    found = (
        find_layer(model, layer, with_variables=False)
        if isinstance(layer, str)
        else layer
    )
    res = jacobian(
        model,
        x,
        Output(found),
        outputs="per_example",
        features=None if classes is None else list(classes),
        training=training,
        **kwargs,
    )
    grads = tf.convert_to_tensor(res[0])  # (B, K, h, w, C)
    if grads.shape.rank != 5:
        raise ValueError(
            f"grad_cam(layer={found.name!r}): expected an image activation "
            f"(B, h, w, C), got shape {(grads.shape[0], *grads.shape[2:])}."
        )
    activations = tf.cast(_activation(model, found, x, training), grads.dtype)
    weights = tf.reduce_mean(grads, axis=(2, 3))  # (B, K, C)
    cam = tf.nn.relu(tf.einsum("bkc,bhwc->bkhw", weights, activations))
    if not resize:
        return cam
    height, width = int(x.shape[1]), int(x.shape[2])
    batch, count = int(cam.shape[0]), int(cam.shape[1])
    flat = tf.reshape(cam, (batch * count, *cam.shape[2:], 1))
    up = tf.image.resize(flat, (height, width), method="bilinear")
    return tf.reshape(up, (batch, count, height, width))


def _activation(model: Any, layer: Any, x: tf.Tensor, training: bool) -> tf.Tensor:
    """``layer``'s output on ``x``, from one compiled forward pass of
    ``model`` with the layer's node tapped (the model is not changed; the
    function is traced once per model, layer and input signature)."""
    compiled = _FORWARD.of(model)
    key = (id(layer), training)
    if key not in compiled:
        try:
            tap = LayerTap(model, layer)
        except TapError as err:
            raise ValueError(f"grad_cam(layer={layer.name!r}): {err}.") from err

        def forward(x: tf.Tensor) -> tf.Tensor:
            found: list[tf.Tensor] = []

            def hook(call: Any, args: Any, kwargs: Any) -> Any:
                outputs = call(*args, **kwargs)
                found.append(outputs)
                return outputs

            tap(x, training, hook)
            return found[0]

        compiled[key] = tf.function(forward, reduce_retracing=True)
    activation: tf.Tensor = compiled[key](x)
    return activation
