"""keras_hub ViT's ``ViTPatchingAndEmbedding``: the patches' convolution, a
class token before them, and a position embedding added to every example,
``z = concat(class_token, conv(images)) + table[ids]``.

NOTE (why the layer is one rule). Its position embedding is an ``Embedding``
called on the same ids for every example, and its class token a weight
tiled over the batch: at the call, neither has an example axis, so a row's
gradient cannot be separated per example there (a backward pass sums it over
the batch). The rule computes the layer beside it with the ids and the token
given an example axis (the same values for every example), so each example's
cotangent reaches its own copy; the patches' convolution is an ordinary
``Conv2D`` part. Target the layer itself: its three parts' weights together.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, ClassVar

import tensorflow as tf

from jacobkit.layers.base import LayerRule, MaterializedNorms, Tapped, Weights
from jacobkit.layers.conv import Conv2DRule
from jacobkit.layers.embedding import EmbeddingRule


class _ClassToken(MaterializedNorms):
    """The class token, ``(1, 1, D)``, tiled over the batch: a row's gradient
    is its cotangent at its example's copy."""

    kind = "class_token"
    kernel_attrs: ClassVar[tuple[str, ...]] = ("class_token",)
    bias_attrs: ClassVar[tuple[str, ...]] = ()

    def pre_activation(
        self, x: tf.Tensor, kernel: tf.Variable, bias: tf.Variable | None
    ) -> tf.Tensor:
        return tf.tile(tf.convert_to_tensor(kernel), [tf.shape(x)[0], 1, 1])

    def gradients(
        self,
        x: tf.Tensor,
        dz: tf.Tensor,
        kernel_shape: tuple[int, ...],
        *,
        summed: bool,
    ) -> tuple[tf.Tensor, tf.Tensor]:
        batch, rows = dz.shape[0], dz.shape[1]
        if summed:
            kernel = tf.reshape(tf.reduce_sum(dz, axis=0), (rows, *kernel_shape))
        else:
            kernel = tf.reshape(dz, (batch * rows, *kernel_shape))
        return kernel, tf.zeros((kernel.shape[0], 0), dz.dtype)


class ViTPatchingAndEmbeddingRule(LayerRule):
    """Closed forms of the class token, the patches' ``Conv2D`` and the
    position ``Embedding`` of keras_hub ViT's patching layer (see the NOTE)."""

    kind = "vit_patching_and_embedding"
    covers = "its class token, patch convolution and position embedding"

    def parts(self) -> tuple[LayerRule, ...]:
        layer = self.layer
        found: list[LayerRule] = []
        if getattr(layer, "use_class_token", False):
            found.append(_ClassToken(layer))
        found.append(Conv2DRule(layer.patch_embedding))
        found.append(EmbeddingRule(layer.position_embedding))
        return tuple(found)

    def weight(self, role: str) -> Any:
        """The layer has no kernel of its own (see :meth:`parts`)."""
        return None

    def unsupported(self) -> str | None:
        why = super().unsupported()
        if why is not None:
            return why
        if getattr(self.layer, "data_format", "channels_last") != "channels_last":
            return "data_format='channels_first'"
        for part in self.parts():
            why = part.unsupported()
            if why is not None:
                return f"its part {part.kind!r}: {why}"
        return None

    def tapped_call(
        self,
        args: tuple,
        kwargs: dict,
        weights: Weights,
        watch: Callable[[tf.Tensor], tf.Tensor],
    ) -> tuple[Any, list[Tapped]]:
        images = args[0]
        parts = self.parts()
        taps: list[Tapped] = []
        pieces = []
        for part, (kernel, bias) in zip(parts[:-2], weights[:-2]):
            tap = part.tapped(images, kernel, bias, watch)  # the class token
            taps.append(tap)
            pieces.append(tap.z)
        conv = parts[-2].tapped(images, *weights[-2], watch)
        taps.append(conv)
        pieces.append(tf.reshape(conv.z, (tf.shape(conv.z)[0], -1, conv.z.shape[-1])))
        # the layer's own ids are arange(num_positions) (not read: a layer
        # built in a traced graph keeps that graph's tensor)
        positions = tf.range(self.layer.num_positions)[None]
        ids = tf.tile(positions, [tf.shape(images)[0], 1])
        position = parts[-1].tapped(ids, *weights[-1], watch)
        taps.append(position)
        embedded = tf.concat(pieces, axis=1) if len(pieces) > 1 else pieces[0]
        return embedded + position.z, taps
