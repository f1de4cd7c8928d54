"""LoRA-enabled ``Dense``, ``EinsumDense`` and ``Embedding`` (Keras 3's
``layer.enable_lora(rank)``; keras_hub's ``backbone.enable_lora(rank)``
calls it on the attention's query and value projections and freezes the
rest).

Keras computes such a layer with the kernel ``W + s A B`` (``s =
lora_alpha / lora_rank``): ``W`` frozen, the factors ``A``
(``kernel.shape[:-1] + (r,)``) and ``B`` (``(r, units)``) and the bias
trainable. The layer's map ``f(x; K)`` being linear in ``K``, its output is

    z = f(x; W) + (s f(x; A)) @ B + c

two linear parts, each with a closed form of its own
(:meth:`LoraRule.parts`):

- down: ``u = f(x; A)``, the layer's own map with ``A`` as its kernel
  (``x @ A``, the layer's einsum equation, the table ``A`` looked up):
  the layer's own rule reading ``A``;
- up: ``z_B = (s u) @ B + c``, a Dense layer over ``s u``'s last axis, with
  the layer's bias (an ``EinsumDense`` bias on several output axes is
  summed over the others).

A row's gradients are ``dA = Σ_p x_pᵀ du_p`` with ``du = s dz_B Bᵀ`` (the
cotangent at ``u``: the backward pass carries it from ``z_B``) and ``dB =
Σ_p (s u_p)ᵀ dz_p``: each part's input with the cotangent at its own ``z``,
so norms, clipped sums, Gram matrices and projections are the parts' closed
forms. The frozen ``W`` is no target: it only adds ``f(x; W)`` to ``z``.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, ClassVar

import tensorflow as tf

from jacobkit.keras import compat
from jacobkit.layers.base import LayerRule, Tapped, Weights, row_norms
from jacobkit.layers.dense import DenseRule
from jacobkit.layers.einsum import EinsumDenseRule, _parse, _parse_general
from jacobkit.layers.embedding import EmbeddingRule


class LoraUpRule(DenseRule):
    """The up part ``z_B = (s u) @ B + c`` over the last axis, ``B`` ``(r,
    units)``; the bias on the output's trailing axes (``EinsumDense``'s
    ``bias_axes="de"``: shape ``(d, e)``; a ``1`` where an output axis
    between is not one of them), as Keras broadcasts it."""

    kind = "lora_b"
    kernel_attrs: ClassVar[tuple[str, ...]] = ("lora_kernel_b",)
    bias_attrs: ClassVar[tuple[str, ...]] = ("bias",)

    def weight(self, role: str) -> Any:
        """The factor ``B``; the bias where it is trainable (a frozen one
        is no target: :meth:`LoraRule.tapped_call` adds it as it is)."""
        found = super().weight(role)
        if role == "bias" and found is not None and not compat.trainable(found):
            return None
        return found

    def _bias_shape(self) -> tuple[int, ...] | None:
        bias = self.weight("bias")
        return None if bias is None else tuple(int(n) for n in bias.shape)

    def _wide(self) -> bool:
        """Whether the bias spans more than the last axis."""
        shape = self._bias_shape()
        return shape is not None and len(shape) > 1

    def bias_rows(self, dz: tf.Tensor, *, summed: bool) -> tf.Tensor:
        """A wide bias's per-row gradients from ``dz`` (``(B, K,
        *z.shape[1:])``): the cotangents summed over the axes the bias does
        not span, ``(R, bias.size)``."""
        shape = self._bias_shape()
        assert shape is not None, "only for a bias"
        batch, rows = dz.shape[0], dz.shape[1]
        trailing = [int(n) for n in dz.shape[dz.shape.rank - len(shape) :]]
        found = tf.reduce_sum(
            tf.reshape(dz, (batch, rows, -1, *trailing)),
            axis=[0, 2] if summed else [2],
        )  # (K, *trailing) or (B, K, *trailing)
        lead = found.shape.rank - len(shape)
        spread = [lead + i for i, n in enumerate(shape) if n == 1 and trailing[i] != 1]
        if spread:
            found = tf.reduce_sum(found, axis=spread, keepdims=True)
        return tf.reshape(found, (-1, math.prod(shape)))

    def gradients(
        self,
        x: tf.Tensor,
        dz: tf.Tensor,
        kernel_shape: tuple[int, ...],
        *,
        summed: bool,
    ) -> tuple[tf.Tensor, tf.Tensor]:
        kernel, bias = super().gradients(x, dz, kernel_shape, summed=summed)
        if self._wide():
            bias = self.bias_rows(dz, summed=summed)
        return kernel, bias

    def summed_gradients(
        self, x: tf.Tensor, dz: tf.Tensor, kernel_shape: tuple[int, ...]
    ) -> tuple[tf.Tensor, tf.Tensor]:
        if self._wide():  # through gradients(): the bias summed as above
            return LayerRule.summed_gradients(self, x, dz, kernel_shape)
        return super().summed_gradients(x, dz, kernel_shape)

    def norms(
        self,
        x: tf.Tensor,
        dz: tf.Tensor,
        *,
        summed: bool,
        map_chunks: Callable[..., list[tf.Tensor]],
        form: str | None = None,
    ) -> tuple[tf.Tensor, tf.Tensor]:
        kernel, bias = super().norms(
            x, dz, summed=summed, map_chunks=map_chunks, form=form
        )
        if self._wide():  # the bias's rows are small: formed, then reduced
            bias = row_norms(self.bias_rows(dz, summed=summed))
        return kernel, bias

    def factored(self) -> bool:
        """Factored where the bias, if any, is on the last axis alone (the
        Gram and projection forms take a bias's rows as the cotangents
        summed over positions)."""
        return not self._wide()


class DenseDownRule(DenseRule):
    """A LoRA ``Dense``'s down part: ``u = x @ A``."""

    kind = "dense_lora_a"
    kernel_attrs = ("lora_kernel_a",)
    bias_attrs = ()

    def activation(self, z: tf.Tensor) -> tf.Tensor:
        return z


class EinsumDownRule(EinsumDenseRule):
    """A LoRA ``EinsumDense``'s down part: ``u = einsum(equation, x, A)``."""

    kind = "einsum_dense_lora_a"
    kernel_attrs = ("lora_kernel_a",)
    bias_attrs = ()

    def activation(self, z: tf.Tensor) -> tf.Tensor:
        return z


class EmbeddingDownRule(EmbeddingRule):
    """A LoRA ``Embedding``'s down part: ``u = A[ids]``."""

    kind = "embedding_lora_a"
    kernel_attrs = ("lora_embeddings_a",)


class EmbeddingUpRule(LoraUpRule):
    """A LoRA ``Embedding``'s up part: ``(s u) @ B``, no bias."""

    kind = "embedding_lora_b"
    kernel_attrs = ("lora_embeddings_b",)
    bias_attrs = ()


class LoraRule(LayerRule):
    """Closed forms of a LoRA-enabled layer's trainable weights: its two
    factors (and its bias), as two linear parts (see the module docstring).

    Subclasses name the layer's own rule reading ``A`` (:attr:`down`), the
    up part (:attr:`up`) and the frozen weight's attribute
    (:attr:`frozen`)."""

    kind = "lora"
    covers = "its LoRA factors and bias (the kernel frozen)"
    #: the down part ``u = f(x; A)``: the layer's own rule, reading ``A``
    down: ClassVar[type[LayerRule]]
    #: the up part ``(s u) @ B + c``
    up: ClassVar[type[LayerRule]] = LoraUpRule
    #: the public attribute whose frozen variable Keras adds ``s A B`` to
    frozen: ClassVar[str] = "kernel"

    def parts(self) -> tuple[LayerRule, ...]:
        return (self.down(self.layer), self.up(self.layer))

    def weight(self, role: str) -> Any:
        """A LoRA layer's weights are its parts' (see :meth:`parts`)."""
        return None

    def unsupported(self) -> str | None:
        if not compat.lora_enabled(self.layer):
            return "it has no LoRA enabled"
        if compat.quantization_mode(self.layer):
            return f"it is quantized ({self.layer.quantization_mode})"
        return None

    def tapped_call(
        self,
        args: tuple,
        kwargs: dict,
        weights: Weights,
        watch: Callable[[tf.Tensor], tf.Tensor],
    ) -> tuple[Any, list[Tapped]]:
        """``activation(f(x; W) + (s u) @ B + c)``, ``u = f(x; A)``: the two
        parts' ``z`` watched, the frozen map computed beside them in ``W``'s
        dtype (the factors are float32 whatever the layer's dtype)."""
        (factor_a, _), (factor_b, bias) = weights
        down, up = self.parts()
        if bias is None:  # a frozen bias (or none): no target, still added
            bias = compat.named_weight(self.layer, "bias")
        x = args[0]
        u = down.tapped(x, factor_a, None, watch)
        scaled = u.z * tf.constant(compat.lora_scale(self.layer), u.z.dtype)
        lifted = up.tapped(scaled, factor_b, bias, watch)
        frozen = compat.lora_frozen(self.layer, self.frozen)
        inputs = x if x.dtype.is_integer else tf.cast(x, frozen.dtype)
        base = down.pre_activation(inputs, frozen, None)
        z = base + tf.cast(lifted.z, base.dtype)
        return self.activation(z), [u, lifted]


class DenseLoraRule(LoraRule):
    """A LoRA-enabled ``Dense``: ``act(x @ W + (s x A) @ B + c)``."""

    kind = "dense_lora"
    down = DenseDownRule


class EinsumDenseLoraRule(LoraRule):
    """A LoRA-enabled ``EinsumDense``: ``act(einsum(x, W) + (s einsum(x,
    A)) @ B + c)``. Keras computes it with the merged kernel ``W + s A B``;
    the two agree where the kernel's last axis is the output's last, which
    :meth:`unsupported` checks."""

    kind = "einsum_dense_lora"
    down = EinsumDownRule

    def unsupported(self) -> str | None:
        why = super().unsupported()
        if why is not None:
            return why
        equation = self.layer.equation
        dense_like = _parse(equation)  # kernel = contracted + out, z = free + out
        if dense_like is not None and dense_like.out:
            return None
        found = _parse_general(equation)
        if found is None:
            return (
                f"equation {equation!r} has no batch axis first in its input and output"
            )
        if found.kernel[-1] != found.z[-1]:
            return (
                f"equation {equation!r}: its kernel's last axis is not its "
                "output's last"
            )
        return None


class EmbeddingLoraRule(LoraRule):
    """A LoRA-enabled ``Embedding``: ``W[ids] + (s A[ids]) @ B``."""

    kind = "embedding_lora"
    down = EmbeddingDownRule
    up = EmbeddingUpRule
    frozen = "embeddings"

    def unsupported(self) -> str | None:
        why = super().unsupported()
        if why is not None:
            return why
        if getattr(self.layer, "sparse", False):
            return "it returns sparse tensors"
        return None

    def activation(self, z: tf.Tensor) -> tf.Tensor:
        return z


def part_rules(rule: type[LayerRule]) -> tuple[type[LayerRule], ...]:
    """The part rules of a LoRA rule (its down and up parts); none for any
    other rule."""
    if isinstance(rule, type) and issubclass(rule, LoraRule):
        return (rule.down, rule.up)
    return ()
