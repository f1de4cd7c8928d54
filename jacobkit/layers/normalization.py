"""``LayerNormalization``, inference-mode ``BatchNormalization`` and the RMS
normalizations (Keras's ``RMSNormalization``, keras_hub Gemma's, and those of
keras_hub's Llama, Mistral, Qwen and Phi-3):
``z = gamma * xhat + beta``, elementwise in the normalized input ``xhat``
(Gemma's scales by ``1 + scale``, whose gradient is the same)."""

from __future__ import annotations

from typing import ClassVar

import tensorflow as tf

from jacobkit.keras import compat
from jacobkit.layers.base import LayerRule, MaterializedNorms


class _Normalization(MaterializedNorms):
    """``z[b, ..., c] = gamma[c] * xhat[b, ..., c] + beta[c]`` over the last
    axis: a row's ``dr/dgamma[c] = sum_p G[b, p, c] xhat[b, p, c]`` and
    ``dr/dbeta[c] = sum_p G[b, p, c]`` (BackPACK's BatchNorm rule, in
    evaluation mode)."""

    kernel_attrs: ClassVar[tuple[str, ...]] = ("gamma",)
    bias_attrs: ClassVar[tuple[str, ...]] = ("beta",)

    def unsupported(self) -> str | None:
        why = super().unsupported()
        if why is not None:
            return why
        axis = self.layer.axis
        axes = list(axis) if isinstance(axis, (list, tuple)) else [axis]
        if axes != [-1] and axes != [self._last_axis()]:
            return f"axis={axis!r} (only the last axis)"
        return None

    def _last_axis(self) -> int | None:
        """The last axis of the layer's input (as built), or ``None`` where
        it is not known."""
        shape = compat.built_input_shape(self.layer)
        if shape is None:
            try:
                shape = (
                    getattr(self.layer, "input_shape", None) or self.layer.input.shape
                )
            except (AttributeError, ValueError):
                return None
        return len(shape) - 1

    def normalized(self, x: tf.Tensor) -> tf.Tensor:
        """``xhat``, ``x``'s shape."""
        raise NotImplementedError

    def pre_activation(
        self, x: tf.Tensor, kernel: tf.Variable, bias: tf.Variable | None
    ) -> tf.Tensor:
        xhat = self.normalized(x)
        z = xhat if kernel is None else xhat * kernel
        return z if bias is None else z + bias

    def activation(self, z: tf.Tensor) -> tf.Tensor:
        return z

    def output_is_z(self) -> bool:
        return True

    def gradients(
        self,
        x: tf.Tensor,
        dz: tf.Tensor,
        kernel_shape: tuple[int, ...],
        *,
        summed: bool,
    ) -> tuple[tf.Tensor, tf.Tensor]:
        channels = kernel_shape[-1]
        batch, rows = dz.shape[0], dz.shape[1]
        xhat = tf.reshape(tf.cast(self.normalized(x), dz.dtype), (batch, -1, channels))
        g = tf.reshape(dz, (batch, rows, -1, channels))  # (B, K, P, C)
        # NOTE (measured, one core): a product and a sum, not
        # tf.einsum("bpc,bkpc->bkc"), which transposes into a batched matmul:
        # BERT's LayerNorm at 32 examples of 32 tokens, 64 channels, one row
        # each, 0.12 against 0.42 ms; 144 rows of 8 examples of 196 positions,
        # 32 channels, 6.2 against 28.5 ms (summed over the batch: the same)
        products = tf.expand_dims(xhat, 1) * g  # no strided slice
        if summed:
            gamma = tf.reduce_sum(products, axis=(0, 2))
            beta = tf.reduce_sum(g, axis=(0, 2))
        else:
            gamma = tf.reshape(tf.reduce_sum(products, axis=2), (-1, channels))
            beta = tf.reshape(tf.reduce_sum(g, axis=2), (-1, channels))
        return gamma, beta


class LayerNormalizationRule(_Normalization):
    """``xhat = (x - mean) / sqrt(var + epsilon)`` over the last axis of each
    example's positions (its own statistics: examples never mix)."""

    kind = "layer_normalization"

    def unsupported(self) -> str | None:
        if getattr(self.layer, "rms_scaling", False):
            return "rms_scaling=True"
        return super().unsupported()

    def normalized(self, x: tf.Tensor) -> tf.Tensor:
        x = tf.cast(x, tf.float32) if x.dtype.size < 4 else x
        mean, variance = tf.nn.moments(x, axes=[-1], keepdims=True)
        return (x - mean) * tf.math.rsqrt(variance + self.layer.epsilon)


class BatchNormalizationRule(_Normalization):
    """Inference mode only: ``xhat = (x - moving_mean) / sqrt(moving_var +
    epsilon)``. In training mode the batch statistics mix the examples, and
    the closed form's check refuses it."""

    kind = "batch_normalization"
    covers = "inference mode"

    def normalized(self, x: tf.Tensor) -> tf.Tensor:
        layer = self.layer
        x = tf.cast(x, tf.float32) if x.dtype.size < 4 else x
        mean = tf.cast(tf.convert_to_tensor(layer.moving_mean), x.dtype)
        variance = tf.cast(tf.convert_to_tensor(layer.moving_variance), x.dtype)
        return (x - mean) * tf.math.rsqrt(variance + layer.epsilon)


class _RMS(_Normalization):
    """``xhat = x / sqrt(mean(x^2) + epsilon)`` over the last axis, computed
    in float32 (each example's positions have their own statistics); a scale,
    no offset."""

    kernel_attrs = ("scale",)
    bias_attrs = ()

    def unsupported(self) -> str | None:
        return LayerRule.unsupported(self)

    def normalized(self, x: tf.Tensor) -> tf.Tensor:
        x = tf.cast(x, tf.float32) if x.dtype.size < 4 else x
        mean_square = tf.reduce_mean(tf.square(x), axis=-1, keepdims=True)
        return x * tf.math.rsqrt(mean_square + self.layer.epsilon)


class RMSNormalizationRule(_RMS):
    """Keras's ``RMSNormalization``: ``z = xhat * scale`` over the last axis."""

    kind = "rms_normalization"

    def unsupported(self) -> str | None:
        why = super().unsupported()
        if why is not None:
            return why
        if list(self.layer.axis) not in ([-1], [self._last_axis()]):
            return f"axis={self.layer.axis!r} (only the last axis)"
        return None


class GemmaRMSNormalizationRule(_RMS):
    """keras_hub Gemma's ``RMSNormalization``: ``z = xhat * (1 + scale)``, the
    output cast to the layer's compute dtype; ``dz/dscale = xhat`` as for a
    plain scale."""

    kind = "gemma_rms_normalization"

    def pre_activation(
        self, x: tf.Tensor, kernel: tf.Variable, bias: tf.Variable | None
    ) -> tf.Tensor:
        xhat = self.normalized(x)
        return xhat * (1 + tf.cast(kernel, xhat.dtype))


class ScaledRMSRule(_RMS):
    """The RMS norms of keras_hub's Llama, Mistral, Qwen (Qwen-MoE, Qwen3)
    and Phi-3 (``LlamaLayerNorm`` and its copies): ``z = xhat * scale`` over
    the last axis, in float32, the output cast to the layer's compute dtype
    (Qwen3's: its input's). They ran generically before (no closed form)."""

    kind = "scaled_rms_normalization"


#: the RMS normalizations' common rule (``jacobkit.layers.divides_by_rms``)
RMSBase = _RMS


class LayerScaleRule(_Normalization):
    """keras.applications ConvNeXt's ``LayerScale``: ``z = x * gamma`` over the
    last axis (``xhat`` is ``x`` itself)."""

    kind = "layer_scale"
    bias_attrs = ()

    def unsupported(self) -> str | None:
        return LayerRule.unsupported(self)

    def normalized(self, x: tf.Tensor) -> tf.Tensor:
        return x
