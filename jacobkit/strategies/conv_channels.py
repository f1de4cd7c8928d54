"""The rows of a linear head's input when they are one channel each at a
convolution's output (:mod:`jacobkit.problem.conv_channels`, where the NOTE
says why it is exact): every row's cotangent at the convolution's input from
a small convolution of its one channel, then the rest of the backward pass
to the targets as the inner strategy runs rows: in a ``tf.while_loop``
(``while``: its rows in flight) or vectorized in chunks (``chunked``,
``jacobian``: its rows at once).

NOTE (measured, one core, TF 2.21, Intel Xeon with AVX-512, under load:
paired in one process, median of the rounds' ratios;
``benchmarks/results/cpu/conv_gradients.md``). On the users' wide generator
(B=64, T=128, 128 rows of ``conv3``'s output, 128 -> 128 by 3) this skips
``conv3``'s dense input gradient for every row: 97.4 GFLOP of exact work
instead of 199.7. The default call (``structured(while)``) took 0.58x its
time without the step with oneDNN off (0.29-0.66 over 9 rounds; 65% of the
GEMM rate on the work left, 79% before on all of it) and 0.54x with oneDNN
on (0.49-0.55; 85% and 91%). A row's one-channel cotangent (a depthwise
convolution, multiplier ``I``) costs 0.1-0.3 ms over filling its
``(B, T, I)`` output (0.57-0.69 ms a row in all); a ``conv2d`` of one input
channel cost the same with oneDNN on and 1.8x with it off, ``k`` broadcast
products 4-5x. With oneDNN off the ``k`` shifted windows times the kernel
column as one product beat the depthwise convolution (the whole call 0.973x
its CPU time): :meth:`ConvChannels.cotangents` takes it there.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import tensorflow as tf

from jacobkit.problem import Problem
from jacobkit.problem.conv_channels import ConvChannels
from jacobkit.strategies import vectorize
from jacobkit.strategies.base import ZERO, Strategy
from jacobkit.strategies.chunks import map_chunks

#: the inner strategies whose way of running rows this reproduces
SUPPORTED = ("while", "chunked", "jacobian")


def supports(inner: Strategy) -> bool:
    """Whether ``inner`` runs rows in a way :func:`rows_fn` reproduces."""
    return inner.name in SUPPORTED


def rows_fn(
    problem: Problem, found: ConvChannels, inner: Strategy
) -> Callable[[Any], list[tf.Tensor]]:
    """``inputs -> each target's (R, *v.shape)``: the Jacobians of
    ``problem``'s rows (one channel each of ``found.conv``'s output), with
    ``inner``'s rows in flight (sequential) or at once (vectorized)."""
    targets = problem.targets
    x_problem = found.input_problem
    num_rows = len(found.channels)
    sequential = inner.sequential_rows()
    at_once = inner.rows_at_once(num_rows)
    signature = [tf.TensorSpec(t.shape, t.dtype) for t in targets]

    def compute(inputs: Any) -> list[tf.Tensor]:
        with tf.GradientTape(persistent=True, watch_accessed_variables=False) as tape:
            tape.watch(targets)
            x = x_problem.call_model(inputs)  # (B, *S, I)
        slopes = found.slopes(x)  # (R, B, H, W): act' at the rows' channels
        columns = found.columns(slopes.dtype)  # (R, kh, kw, I)

        def gradients(seed: tf.Tensor) -> list[tf.Tensor]:
            found_ = tape.gradient(
                x, targets, output_gradients=seed, unconnected_gradients=ZERO
            )
            return [tf.convert_to_tensor(g) for g in found_]

        if sequential:
            return list(
                tf.map_fn(
                    lambda r: gradients(found.cotangents(slopes, columns, r[None])[0]),
                    tf.range(num_rows),
                    parallel_iterations=at_once,
                    fn_output_signature=signature,
                )
            )

        def chunk(start: Any, size: int) -> list[tf.Tensor]:
            seeds = found.cotangents(slopes, columns, tf.range(start, start + size))
            return list(
                vectorize.vectorized_map(gradients, seeds, fallback_to_while_loop=False)
            )

        return map_chunks(chunk, num_rows, at_once)

    return compute
