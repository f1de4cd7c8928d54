"""Grad-CAM for every class: ``relu(sum_c mean_hw(dY_k/dA_c) A_c)``.

Where ``A`` reaches the output only through a pooled linear head
(:mod:`jacobkit.problem.pooled_head`: ``GlobalAveragePooling2D ->
(Dropout) -> Dense(C)``, with or without a softmax), every class's gradient
is a closed form in the head's kernel, and the maps of all classes are one
matmul of ``A`` by the kernel (the head shortcut); elsewhere the gradients
come from one :func:`jacobkit.jacobian` call.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import tensorflow as tf

from jacobkit.api import jacobian
from jacobkit.explain._gradients import as_batch
from jacobkit.keras import compat, layer_tree, state
from jacobkit.keras.graph import LayerTap, TapError
from jacobkit.problem import pooled_head
from jacobkit.problem.cache import PerModel
from jacobkit.problem.pooled_head import PooledHead
from jacobkit.problem.targets import find_layer
from jacobkit.problem.tensor_targets import Output

_FORWARD = PerModel(
    "grad_cam: the compiled forward pass (or pass and head maps) per layer, "
    "training and kind"
)

#: the keywords of :func:`jacobkit.jacobian` that leave the head shortcut
#: free to run (any other, ``strategy=`` first, takes the generic path)
_SHORTCUT_KEEPS = frozenset({"memory_budget", "cache", "progress"})


def grad_cam(
    model: Any,
    x: Any,
    layer: Any,
    *,
    classes: Sequence[int] | None = None,
    resize: bool = True,
    training: bool = False,
    shortcut: bool = True,
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
        shortcut: where ``layer``'s output reaches the output only through a
            pooled linear head (``GlobalAveragePooling2D``, ``Dropout``s,
            ``Dense(C)``, linear or with a softmax or a stock elementwise
            activation such as a sigmoid; ``training=False``), take
            the maps of every class as one matmul of ``A`` by the head's
            kernel, exact, with no backward pass
            (:mod:`jacobkit.problem.pooled_head`). ``False``, or any keyword
            for :func:`jacobkit.jacobian` but ``memory_budget``, ``cache``
            and ``progress``, always takes the generic path.
        **kwargs: passed to :func:`jacobkit.jacobian`.

    Returns:
        ``(B, K, H, W)`` with ``resize=True``, else ``(B, K, h, w)``.

    The maps are of the model's output as it is: with a softmax head, of
    the probabilities (``d p_k / d A = p_k (W[:, k] - W p) / hw``, not the
    usual ``W[:, k] / hw`` of the logits); for the logits' maps, build the
    model without it (``classifier_activation=None`` in
    ``keras.applications``).

    Otherwise the gradients come from one :func:`jacobkit.jacobian` call with an
    :class:`jacobkit.Output` target (per-example rows, every class), the
    activations from one forward pass. With ``training=True`` both passes
    are one draw (:func:`jacobkit.keras.state.one_call`): the same dropout
    masks and batch statistics, and the call moves the model's state
    (BatchNormalization's moving statistics, the dropout seeds) once, as
    one ``model(x, training=True)`` would. With ``resize=False``: the same
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
    mismatch = layer_tree.input_mismatch(model, x, [x])
    if mismatch is not None:
        # before either path: the compiled forward pass would bury it
        raise ValueError(f"grad_cam(x=...): {mismatch}")
    head = _head(model, found, training, kwargs) if shortcut else None
    if head is not None:
        cam = _head_maps(model, found, x, head, classes)
    else:
        with state.one_call(training):
            cam = _generic(model, found, x, classes, training, kwargs)
    if not resize:
        return cam
    height, width = int(x.shape[1]), int(x.shape[2])
    batch, count = int(cam.shape[0]), int(cam.shape[1])
    flat = tf.reshape(cam, (batch * count, *cam.shape[2:], 1))
    up = tf.image.resize(flat, (height, width), method="bilinear")
    return tf.reshape(up, (batch, count, height, width))


def _generic(
    model: Any,
    found: Any,
    x: tf.Tensor,
    classes: Sequence[int] | None,
    training: bool,
    kwargs: dict[str, Any],
) -> tf.Tensor:
    """``(B, K, h, w)`` maps from per-example gradients of every class."""
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
    cam: tf.Tensor = tf.nn.relu(tf.einsum("bkc,bhwc->bkhw", weights, activations))
    return cam


def _head(
    model: Any, layer: Any, training: bool, kwargs: dict[str, Any]
) -> PooledHead | None:
    """The pooled linear head after ``layer``, where the shortcut may run."""
    if set(kwargs) - _SHORTCUT_KEEPS:
        return None
    try:
        return pooled_head.find(model, layer, training)
    except pooled_head.NotApplicable:
        return None


def _head_maps(
    model: Any,
    layer: Any,
    x: tf.Tensor,
    head: PooledHead,
    classes: Sequence[int] | None,
) -> tf.Tensor:
    """Every chosen class's map through the pooled head, ``(B, K, h, w)``:
    ``relu(A @ W[:, k] / hw)``, with a softmax ``relu(p_k (A @ W[:, k] -
    A @ W p) / hw)``, with an elementwise ``f`` ``relu(f'(z_k) A @ W[:, k] /
    hw)`` (:mod:`jacobkit.problem.pooled_head`'s NOTE), in one compiled call
    with the forward pass."""
    width = int(head.head.kernel.shape[-1])
    columns = None if classes is None else _columns(classes, width)
    compiled = _FORWARD.of(model)
    key = (id(layer), False, "head", head, columns is None)
    if key not in compiled:
        forward = _forward(model, layer, False)

        def maps(x: tf.Tensor, columns: tf.Tensor | None) -> tf.Tensor:
            a = forward(x)  # (B, h, w, C): a GlobalAveragePooling2D's input
            # mixed precision: the maps in the kernel's dtype, as the
            # generic path's gradients
            a = tf.cast(a, head.head.kernel.dtype)
            kernel = head.kernel(a.dtype)  # (C, classes)
            chosen = kernel if columns is None else tf.gather(kernel, columns, axis=1)
            scale = tf.cast(1.0 / (a.shape[1] * a.shape[2]), a.dtype)
            # the one matmul: (B h w, C) @ (C, K), then (B, K, h, w)
            flat = tf.matmul(tf.reshape(a, (-1, a.shape[-1])), chosen) * scale
            shape = (-1, a.shape[1], a.shape[2], chosen.shape[-1])
            scores = tf.transpose(tf.reshape(flat, shape), (0, 3, 1, 2))
            if head.softmax:
                pooled = tf.reduce_mean(a, axis=(1, 2))  # (B, C)
                logits = tf.matmul(pooled, kernel)
                bias = head.bias(a.dtype)
                p = tf.nn.softmax(logits if bias is None else logits + bias)
                mixed = tf.matmul(p, kernel, transpose_b=True)  # (B, C): W p
                mean = tf.einsum("bhwc,bc->bhw", a, mixed) * scale
                if columns is not None:
                    p = tf.gather(p, columns, axis=1)
                scores = p[:, :, None, None] * (scores - mean[:, None])
            elif head.elementwise is not None:
                z = tf.matmul(tf.reduce_mean(a, axis=(1, 2)), chosen)
                bias = head.bias(a.dtype)
                if bias is not None:
                    z += bias if columns is None else tf.gather(bias, columns)
                with tf.GradientTape() as tape:  # f'(z): f acts elementwise
                    tape.watch(z)
                    y = head.elementwise(z)
                slope = tape.gradient(y, z)
                scores = slope[:, :, None, None] * scores
            return tf.nn.relu(scores)

        compiled[key] = tf.function(maps, reduce_retracing=True)
    cam: tf.Tensor = compiled[key](
        x, None if columns is None else tf.constant(columns, tf.int32)
    )
    return cam


def _columns(classes: Sequence[int], width: int) -> list[int]:
    """``classes`` as column indices of the head's ``width`` outputs."""
    chosen = []
    for k in classes:
        if isinstance(k, bool) or not isinstance(k, (int, np.integer)):
            raise TypeError(
                f"grad_cam(classes=...): expected integer class indices, got {k!r}."
            )
        if not -width <= int(k) < width:
            raise ValueError(
                f"grad_cam(classes=...): class {int(k)} is out of range for the "
                f"model's {width} classes."
            )
        chosen.append(int(k) % width)
    return chosen


def _activation(model: Any, layer: Any, x: tf.Tensor, training: bool) -> tf.Tensor:
    """``layer``'s output on ``x``, from one compiled forward pass of
    ``model`` with the layer's node tapped (the model is not changed; the
    function is traced once per model, layer and input signature). With
    ``training=True``, what the pass assigns goes to the call's draw
    (:func:`jacobkit.keras.state.function`), not to the model."""
    compiled = _FORWARD.of(model)
    key = (id(layer), training)
    if key not in compiled:
        compiled[key] = compat.LightOptimized(
            state.function(
                _forward(model, layer, training), True, training, reduce_retracing=True
            )
        )
    activation: tf.Tensor = compiled[key](x)
    return activation


def _forward(model: Any, layer: Any, training: bool) -> Any:
    """``x -> layer's output``: ``model`` run with the layer's node tapped,
    one pass of the call's draw (:func:`jacobkit.keras.state.drawn`)."""
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

        with state.drawn():
            tap(x, training, hook)
        return found[0]

    return forward
