"""What a per-layer rule computes beside its layer, for the ``batch``
strategy: the pre-activation output ``z`` from the layer's input, the
activation, and the per-row kernel and bias gradients (or their norms) from
the cotangents at ``z``, in closed form over the unfolded input.

A rule reads its layer's configuration and never calls or changes the layer.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

import tensorflow as tf

from jacobkit.keras import compat
from jacobkit.layers import contract, norms


@dataclass(frozen=True)
class Tapped:
    """One linear map computed beside its layer: its input ``x`` and its
    pre-activation output ``z`` (watched by the caller's tape)."""

    inputs: tf.Tensor
    z: tf.Tensor


#: ``(kernel, bias)`` of each of a rule's :meth:`LayerRule.parts`, the bias
#: ``None`` where the part has none
Weights = list[tuple[tf.Variable, "tf.Variable | None"]]


@dataclass(frozen=True)
class LayerRule:
    """The closed forms of one layer whose pre-activation output ``z`` is
    linear in its kernel and bias: ``z[b, p] = unfold(x)[b, p] @ W + c``.

    Attributes:
        layer: the Keras layer (its configuration is read).
        kind: ``"dense"``, ``"conv1d"``, ... (for messages).
    """

    layer: Any
    kind: ClassVar[str] = ""
    #: what of the layer the closed forms cover where it is not all of it
    #: (for messages: ``"inference mode"``), else empty
    covers: ClassVar[str] = ""
    #: the attributes holding the weights in the kernel and bias roles (the
    #: first present one counts: Keras 3 and tf_keras name some differently)
    kernel_attrs: ClassVar[tuple[str, ...]] = ("kernel",)
    bias_attrs: ClassVar[tuple[str, ...]] = ("bias",)
    #: the layer reads only its input's shape, not its values (a position
    #: embedding): where a call takes no tensor in, its output's shape serves
    shape_only_input: ClassVar[bool] = False
    #: ``auto`` starts rows summed over the batch on ``batch``: its
    #: closed form is the least work for them and traces about as fast as
    #: the generic strategies (measured on Dense; a Conv1D target traces
    #: about 6x slower than ``while``, so a convolution starts generic)
    summed_starts_on_batch: ClassVar[bool] = False

    def weight(self, role: str) -> Any:
        """The layer's weight in ``role`` (``"kernel"``, ``"bias"``), or
        ``None``."""
        attrs = self.kernel_attrs if role == "kernel" else self.bias_attrs
        for attr in attrs:
            found = getattr(self.layer, attr, None)
            if found is not None:
                return found
        return None

    def parts(self) -> tuple[LayerRule, ...]:
        """The linear maps whose kernels and biases the rule differentiates:
        the layer itself, or (``MultiHeadAttention``) its projections, each
        with a rule of its own."""
        return (self,)

    def tapped_call(
        self,
        args: tuple,
        kwargs: dict,
        weights: Weights,
        watch: Callable[[tf.Tensor], tf.Tensor],
    ) -> tuple[Any, list[Tapped]]:
        """The layer's output from its node's arguments, computed beside the
        layer with ``weights`` (one pair per part), each part's ``z`` passed
        through ``watch`` before anything uses it; and every part's input and
        ``z``. The layer itself is never called or changed.

        Outside ``layer.__call__`` Keras does not autocast: under mixed
        precision the kernel is float32 and the input float16. ``z`` is
        computed in the kernel's dtype, so the contraction with the
        cotangents accumulates in float32, as the loop's gradient does."""
        ((kernel, bias),) = weights
        tapped = self.tapped(args[0], kernel, bias, watch)
        return self.activation(tapped.z), [tapped]

    def tapped(
        self,
        x: tf.Tensor,
        kernel: tf.Variable,
        bias: tf.Variable | None,
        watch: Callable[[tf.Tensor], tf.Tensor],
    ) -> Tapped:
        """This part's ``z`` for input ``x`` in the kernel's dtype, passed
        through ``watch`` (see :meth:`tapped_call`)."""
        return Tapped(
            x, watch(self.pre_activation(tf.cast(x, kernel.dtype), kernel, bias))
        )

    def unsupported(self) -> str | None:
        """Why the layer's call is not ``activation(pre_activation(x))``, or
        ``None``."""
        if compat.lora_enabled(self.layer):
            return "it has LoRA enabled"
        if compat.quantization_mode(self.layer):
            return f"it is quantized ({self.layer.quantization_mode})"
        return None

    def pre_activation(
        self, x: tf.Tensor, kernel: tf.Variable, bias: tf.Variable | None
    ) -> tf.Tensor:
        """``z = linear(x; kernel, bias)``: ``x`` of shape ``(B, ..., C)`` ->
        the layer's output before its activation."""
        raise NotImplementedError

    def unfold(self, x: tf.Tensor) -> tf.Tensor:
        """The input seen by each output position, shape ``(B, P, I)``:
        ``z[b, p] = unfold(x)[b, p] @ kernel.reshape(I, -1) + bias``."""
        raise NotImplementedError

    def unfold_times(self, x: tf.Tensor, matrix: tf.Tensor) -> tf.Tensor:
        """``unfold(x) @ matrix`` (``matrix`` ``(I, s)``), shape ``(B, P,
        s)``: a Kronecker projection's left factor applied to the patches
        (:meth:`jacobkit.problem.sketch.TargetMap.of_mapped`). Here one 2-D
        matmul over :meth:`unfold` (2-D: a rank-3 or rank-4 by rank-2
        ``tf.matmul`` gave wrong numbers, then std::bad_alloc, on CPU: TF
        2.21, oneDNN); a convolution convolves ``x`` with ``matrix`` as its
        kernel instead, never unfolding."""
        patches = self.unfold(x)
        flat = tf.reshape(patches, (-1, patches.shape[-1]))
        found = tf.matmul(flat, tf.cast(matrix, patches.dtype))
        return tf.reshape(found, (*patches.shape[:-1], matrix.shape[1]))

    def activation(self, z: tf.Tensor) -> tf.Tensor:
        """The layer's activation applied to ``z``."""
        activation = compat.activation(self.layer)
        return z if activation is None else activation(z)

    def output_is_z(self) -> bool:
        """Whether the layer's output is ``z`` itself (no activation, one
        part): a cotangent at the output is one at ``z``."""
        if len(self.parts()) != 1:
            return False
        name = compat.activation_name(compat.activation(self.layer))
        return name in (None, "linear")

    def gradients(
        self,
        x: tf.Tensor,
        dz: tf.Tensor,
        kernel_shape: tuple[int, ...],
        *,
        summed: bool,
    ) -> tuple[tf.Tensor, tf.Tensor]:
        """Per-row kernel and bias gradients from the cotangents ``dz``
        (``(B, K, *z.shape[1:])``): ``(R, *kernel_shape)`` and ``(R, units)``,
        ``R = K`` if ``summed`` else ``B * K``
        (:func:`jacobkit.layers.contract.kernel_and_bias_gradients`)."""
        return contract.kernel_and_bias_gradients(
            self.unfold(x), dz, kernel_shape, summed=summed
        )

    def summed_gradients(
        self, x: tf.Tensor, dz: tf.Tensor, kernel_shape: tuple[int, ...]
    ) -> tuple[tf.Tensor, tf.Tensor]:
        """Gradients of rows summed over the batch from row-major cotangents
        ``dz`` (``(K, B, *z.shape[1:])``, one chunk of rows): ``(K,
        *kernel_shape)`` and ``(K, units)``. The rules whose gradients are one
        matmul over :meth:`unfold` contract ``dz`` in its own layout
        (:class:`UnfoldedMatmul`); the others go through :meth:`gradients`."""
        by_example = tf.experimental.numpy.moveaxis(dz, 0, 1)
        return self.gradients(x, by_example, kernel_shape, summed=True)

    def factored(self) -> bool:
        """Whether a row's kernel gradient is ``Σ_p unfold(x)[p]ᵀ dz[p]`` with
        the kernel seen as ``(prod(shape[:-1]), shape[-1])``, so that Gram
        matrices and projections can be taken from the two factors without
        forming it (:mod:`jacobkit.problem.sketch`)."""
        return False

    def lookup_ids(self, x: tf.Tensor) -> tf.Tensor | None:
        """For a table lookup (an embedding called on ids): the ids ``(B,
        P)``, the positions of the one-hot rows that :meth:`factored`'s
        patches would be, so Gram matrices and projections take the table's
        rows at them instead of a ``(B, vocabulary, D)`` gradient. ``None``
        for every other call."""
        return None

    def reverse_inputs(self, x: tf.Tensor) -> tf.Tensor | None:
        """For a call whose kernel gradient is ``Σ_p dz[p]ᵀ x[p]``, the
        factors of :meth:`factored` with their roles swapped (the kernel's
        rows indexed by ``z``'s features: a tied embedding's reverse call,
        ``z = x Wᵀ``): its inputs ``(B, P, D)``, so projections take the
        cotangents' product with the left factor. ``None`` for every other
        call."""
        return None

    def shared_gradients(
        self,
        calls: list[tuple[tf.Tensor, tf.Tensor]],
        kernel_shape: tuple[int, ...],
        *,
        summed: bool,
    ) -> tuple[tf.Tensor, tf.Tensor] | None:
        """Per-row kernel and bias gradients summed over the layer's several
        ``calls`` (each its tapped input and cotangents, as
        :meth:`gradients` takes them), ``(R, *kernel_shape)`` and ``(R,
        units)``, where the rule sums them cheaper than forming each call's
        and adding them; ``None`` (the default) where it has no such form."""
        return None

    def shared_norms(
        self,
        calls: list[tuple[tf.Tensor, tf.Tensor]],
        *,
        summed: bool,
        form: str | None = None,
    ) -> tuple[tf.Tensor, tf.Tensor] | None:
        """Per-row norms ``(R,)`` of the kernel and bias gradients summed
        over the layer's several ``calls`` (each its tapped input and
        cotangents, as :meth:`norms` takes them), without forming the rows;
        ``None`` where the rule has no such form: the rows are then formed,
        summed and reduced (the norm of a sum is not a sum of norms).
        ``form`` forces ``"gram"`` or ``"chunks"`` (``None``: see
        :meth:`norms`)."""
        return None

    def norms(
        self,
        x: tf.Tensor,
        dz: tf.Tensor,
        *,
        summed: bool,
        map_chunks: Callable[..., list[tf.Tensor]],
        form: str | None = None,
    ) -> tuple[tf.Tensor, tf.Tensor]:
        """Per-row norms of the kernel and bias Jacobians, each ``(R,)``
        (:func:`jacobkit.layers.norms.kernel_and_bias_norms`)."""
        return norms.kernel_and_bias_norms(
            self.unfold(x), dz, summed=summed, map_chunks=map_chunks, form=form
        )

    def forms_rows(self, x: tf.Tensor, dz: tf.Tensor, *, summed: bool) -> bool:
        """Whether :meth:`norms` forms every row's gradient, all at once, for
        the tapped input ``x`` and cotangents ``dz`` (``(B, K, *z.shape[1:])``):
        then a clipped sum weights those gradients (:meth:`gradients`) instead
        of contracting the scaled cotangents a second time. Rules that do not
        say: ``False``."""
        return False


class UnfoldedMatmul(LayerRule):
    """A rule whose gradients are :meth:`LayerRule.gradients`' one matmul
    over :meth:`unfold` (Dense, Conv1D, Conv2D): summed rows contract
    straight from the row-major cotangents
    (:func:`jacobkit.layers.contract.summed_gradients_by_row`)."""

    def summed_gradients(
        self, x: tf.Tensor, dz: tf.Tensor, kernel_shape: tuple[int, ...]
    ) -> tuple[tf.Tensor, tf.Tensor]:
        return contract.summed_gradients_by_row(self.unfold(x), dz, kernel_shape)

    def factored(self) -> bool:
        return True

    def forms_rows(self, x: tf.Tensor, dz: tf.Tensor, *, summed: bool) -> bool:
        """Where :func:`jacobkit.layers.norms.kernel_and_bias_norms` forms the
        rows' gradients (not the Gram form) in one chunk."""
        kernel = [int(size) for size in self.weight("kernel").shape]
        return norms.forms_rows(
            int(dz.shape[0]),
            math.prod(int(size) for size in dz.shape[2:-1]),
            math.prod(kernel[:-1]),
            kernel[-1],
            int(dz.shape[1]),
            summed=summed,
        )


class MaterializedNorms(LayerRule):
    """Norms from the closed-form gradients themselves, for rules whose
    gradients are not one matmul over an unfolded input (elementwise and
    per-channel forms): every row's gradient is formed once, then reduced.
    Their gradients are the size of the layer's weights per row, which for
    these layers (normalizations, embeddings of small vocabularies, depthwise
    kernels) is small against the activations."""

    def norms(
        self,
        x: tf.Tensor,
        dz: tf.Tensor,
        *,
        summed: bool,
        map_chunks: Callable[..., list[tf.Tensor]],
        form: str | None = None,
    ) -> tuple[tf.Tensor, tf.Tensor]:
        kernel, bias = self.gradients(
            x, dz, tuple(self.weight("kernel").shape), summed=summed
        )
        return row_norms(kernel), row_norms(bias)

    def forms_rows(self, x: tf.Tensor, dz: tf.Tensor, *, summed: bool) -> bool:
        return True


def row_norms(jacobians: tf.Tensor) -> tf.Tensor:
    """``(R, ...)`` -> ``(R,)``: each row's L2 norm, one pass over the rows
    (:func:`squared_rows`)."""
    flat = tf.reshape(jacobians, (jacobians.shape[0], -1))
    return tf.math.reduce_euclidean_norm(flat, axis=-1)


def squared_rows(jacobians: tf.Tensor) -> tf.Tensor:
    """``(R, ...)`` -> ``(R,)`` float32: each row's squared L2 norm (summed
    over targets, the square of a row's norm over all of them).

    NOTE (measured, one core, oneDNN on, loaded; the least time of 30 calls
    of each). One ``EuclideanNorm`` reads the rows once; ``Square`` then
    ``Sum`` wrote and read them again: the conv net's conv2 rows (32 x
    18,432) 0.15 ms against 0.26 + 0.10 ms in its clipped sum
    (``benchmarks/conv_reductions_profile.py``). The square of the norm
    differs from the sum of squares by float32 rounding (2.6e-7 of the
    clipped sum there)."""
    flat = jacobians
    if jacobians.shape.rank != 2:  # rows already flat keep an unknown count
        flat = tf.reshape(jacobians, (jacobians.shape[0], -1))
    return tf.square(tf.math.reduce_euclidean_norm(tf.cast(flat, tf.float32), -1))
