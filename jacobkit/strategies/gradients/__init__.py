"""TensorFlow's gradients as the strategies trace them: under TensorFlow's
own CPU kernels (oneDNN off), some ops' gradients by other kernels that
compute the same products faster, one module per op:

- :mod:`~jacobkit.strategies.gradients.convolution`: a stride-1 ``Conv2D``'s
  input gradient as the forward convolution of the flipped kernel, and in a
  loop over rows its kernel gradient from the input's patches formed once;
- :mod:`~jacobkit.strategies.gradients.dilated`: a dilated ``Conv2D``'s
  gradient where TensorFlow's own CPU kernels refuse it (the convolution
  rule's, by their undilated kernels on the kernel spread out);
- :mod:`~jacobkit.strategies.gradients.matmul`: a ``MatMul``'s gradients as
  products of transposed copies, not by the kernel's transpose flags;
- :mod:`~jacobkit.strategies.gradients.unneeded`: the inputs whose
  gradients a pass leaves out (the variables' reads where ``batch``'s pass
  goes towards its taps alone), and a ``BiasAdd``'s gradient that leaves its
  bias's out there;
- :mod:`~jacobkit.strategies.gradients.rules`: what they share (whether
  they replace anything here, TensorFlow's registry, a loop's enclosing
  graph).

:func:`within` runs a strategy's computation under all of them.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from jacobkit.strategies.gradients.convolution import (
    SHARED_PATCHES_BYTES,
    convolution_rules,
    flipped_kernel,
    flipped_padding,
    input_gradient,
    patches_in_pass,
    shared_patches,
)
from jacobkit.strategies.gradients.matmul import (
    MATMUL_COPY_BYTES,
    MATMUL_ROWS,
    hoisted_bytes,
    matmul_rules,
    transposed_copy,
)
from jacobkit.strategies.gradients.rules import enclosing_graph, replaces
from jacobkit.strategies.gradients.unneeded import bias_rules, towards

__all__ = [
    "hoisted_bytes",
    "MATMUL_COPY_BYTES",
    "MATMUL_ROWS",
    "SHARED_PATCHES_BYTES",
    "convolution_rules",
    "enclosing_graph",
    "flipped_kernel",
    "flipped_padding",
    "input_gradient",
    "matmul_rules",
    "patches_in_pass",
    "replaces",
    "shared_patches",
    "towards",
    "transposed_copy",
    "within",
]


def within(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` run under :func:`convolution_rules` and :func:`matmul_rules` (a
    strategy's computation: its Python runs when it is traced)."""

    @functools.wraps(fn)
    def ruled(*args: Any, **kwargs: Any) -> Any:
        with convolution_rules(), matmul_rules(), bias_rules():
            return fn(*args, **kwargs)

    return ruled
