"""``EinsumDense`` (and so ``MultiHeadAttention``'s projections).

The equations that are a Dense layer over grouped axes,
``free + contracted, contracted + out -> free + out``, are contracted as a
Dense layer is (unfolded, one matmul; Gram-form norms). Any other equation
whose input and output both start with the batch axis (Gemma's
``btd,ndh->btnh``: the kernel's output axes first) by its own transposed
einsum: a row's gradient is ``einsum("<x>,<z>-><kernel>")`` of the input and
the row's cotangent at ``z``, per example with the batch axis kept.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import tensorflow as tf

from jacobkit.layers import contract, norms
from jacobkit.layers.base import LayerRule, row_norms


@dataclass(frozen=True)
class _Equation:
    """The letters of a Dense-like einsum equation."""

    free: str  # input axes kept (the batch axis first), as in the output
    contracted: str  # input axes summed with the kernel's leading axes
    out: str  # the kernel's trailing axes, the output's last ones


@dataclass(frozen=True)
class _General:
    """The letters of any einsum equation ``x,kernel->z`` whose input and
    output start with the batch axis (which the kernel does not have)."""

    x: str
    kernel: str
    z: str

    def gradient(self, summed: bool) -> str:
        """``x, dz (b, k, *z[1:]) -> (b, k, *kernel)`` (``(k, *kernel)``
        summed over the batch)."""
        row = next(
            c for c in "klmnopqrsuvwxyz" if c not in self.x + self.kernel + self.z
        )
        b = self.x[0]
        out = (row if summed else b + row) + self.kernel
        return f"{self.x},{b}{row}{self.z[1:]}->{out}"


def _parse_general(equation: str) -> _General | None:
    """``"btd,ndh->btnh"`` -> its parts; ``None`` without a shared batch
    axis first, or with an ellipsis."""
    try:
        inputs, output = equation.replace(" ", "").split("->")
        x, kernel = inputs.split(",")
    except ValueError:
        return None
    if "..." in equation or not x or not output or x[0] != output[0]:
        return None
    if x[0] in kernel or any(c not in x + output for c in kernel):
        return None
    return _General(x, kernel, output)


def _parse(equation: str) -> _Equation | None:
    """``"abc,cde->abde"`` -> free ``ab``, contracted ``c``, out ``de``; or
    ``None`` where the equation is not of that Dense-like form."""
    try:
        inputs, output = equation.replace(" ", "").split("->")
        x, kernel = inputs.split(",")
    except ValueError:
        return None
    if "..." in equation:
        x, kernel, output = (s.replace("...", "") for s in (x, kernel, output))
    contracted = "".join(c for c in x if c in kernel and c not in output)
    out = "".join(c for c in kernel if c not in x)
    free = x[: len(x) - len(contracted)]
    if x != free + contracted or kernel != contracted + out:
        return None
    if output != free + out:
        return None
    return _Equation(free, contracted, out)


class EinsumDenseRule(LayerRule):
    """Closed forms of an ``EinsumDense`` layer whose equation is a Dense
    layer over grouped axes (every projection of ``MultiHeadAttention``:
    ``abc,cde->abde`` for query/key/value, ``abcd,cde->abe`` for the output),
    with its bias, if any, on all of the kernel's output axes."""

    kind = "einsum_dense"

    @functools.cached_property
    def _equation(self) -> _Equation | None:
        return _parse(self.layer.equation)

    @functools.cached_property
    def _general(self) -> _General | None:
        return _parse_general(self.layer.equation)

    def unsupported(self) -> str | None:
        why = super().unsupported()
        if why is not None:
            return why
        eq = self._equation
        bias_axes = getattr(self.layer, "bias_axes", None)
        if eq is None:
            if self._general is None:
                return (
                    f"equation {self.layer.equation!r} has no batch axis first in "
                    "its input and output"
                )
            if bias_axes:
                return f"bias_axes={bias_axes!r} with equation {self.layer.equation!r}"
            return None
        if bias_axes and bias_axes != eq.out:
            return f"bias_axes={bias_axes!r} (only all of the output axes, {eq.out!r})"
        return None

    def _sizes(self, kernel_shape: tuple[int, ...]) -> tuple[int, int]:
        eq = self._equation
        assert eq is not None, "checked by unsupported()"
        inputs = int(np.prod(kernel_shape[: len(eq.contracted)]))
        return inputs, int(np.prod(kernel_shape[len(eq.contracted) :]))

    def pre_activation(
        self, x: tf.Tensor, kernel: tf.Variable, bias: tf.Variable | None
    ) -> tf.Tensor:
        z = tf.einsum(self.layer.equation, x, kernel)
        return z if bias is None else z + bias

    def unfold(self, x: tf.Tensor) -> tf.Tensor:
        eq = self._equation
        assert eq is not None, "checked by unsupported()"
        inputs = int(np.prod(x.shape[x.shape.rank - len(eq.contracted) :]))
        return tf.reshape(x, (x.shape[0], -1, inputs))

    def _grouped(self, dz: tf.Tensor, kernel_shape: tuple[int, ...]) -> tf.Tensor:
        """``(B, K, *z.shape[1:])`` -> ``(B, K, P, O)``: the output axes grouped
        as the kernel's are."""
        _, units = self._sizes(kernel_shape)
        return tf.reshape(dz, (dz.shape[0], dz.shape[1], -1, units))

    def gradients(
        self,
        x: tf.Tensor,
        dz: tf.Tensor,
        kernel_shape: tuple[int, ...],
        *,
        summed: bool,
    ) -> tuple[tf.Tensor, tf.Tensor]:
        general = self._general if self._equation is None else None
        if general is not None:  # no bias (unsupported() refuses one)
            kernel = tf.einsum(general.gradient(summed), tf.cast(x, dz.dtype), dz)
            count = dz.shape[1] if summed else dz.shape[0] * dz.shape[1]
            kernel = tf.reshape(kernel, (count, *kernel_shape))
            return kernel, tf.zeros((count, 0), dz.dtype)
        return contract.kernel_and_bias_gradients(
            self.unfold(x), self._grouped(dz, kernel_shape), kernel_shape, summed=summed
        )

    def norms(
        self,
        x: tf.Tensor,
        dz: tf.Tensor,
        *,
        summed: bool,
        map_chunks: Callable[..., list[tf.Tensor]],
        form: str | None = None,
    ) -> tuple[tf.Tensor, tf.Tensor]:
        kernel_shape = tuple(self.weight("kernel").shape)
        if self._equation is None:  # formed per row, then reduced
            kernel, _ = self.gradients(x, dz, kernel_shape, summed=summed)
            return row_norms(kernel), tf.zeros((kernel.shape[0],), kernel.dtype)
        return norms.kernel_and_bias_norms(
            self.unfold(x),
            self._grouped(dz, kernel_shape),
            summed=summed,
            map_chunks=map_chunks,
            form=form,
        )

    def forms_rows(self, x: tf.Tensor, dz: tf.Tensor, *, summed: bool) -> bool:
        """As a Dense layer's (:func:`jacobkit.layers.norms.forms_rows`) for
        a Dense-like equation; any other equation's norms form every row."""
        if self._equation is None:
            return True
        inputs, units = self._sizes(tuple(self.weight("kernel").shape))
        return norms.forms_rows(
            int(dz.shape[0]),
            int(np.prod(dz.shape[2:])) // units,
            inputs,
            units,
            int(dz.shape[1]),
            summed=summed,
        )
