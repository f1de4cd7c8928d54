"""``reduce="norm"``: the L2 norm of every row's Jacobian, without holding more
than one chunk of rows' Jacobians.

Two ways, used by the strategies that support norms:

- **chunked materialization**: compute a chunk of rows' Jacobians, reduce each
  to its norm, drop the chunk (``chunked``, any target; ``batch`` for Dense
  and Conv layers, from the closed form of :mod:`jacobkit.layers.contract`).
- **the Gram ("ghost norm") form**, for a per-example row of a Dense or Conv
  layer: with ``U = unfold(x[b])`` (``P × I``) and ``G`` the row's cotangent at
  ``z[b]`` (``P × O``), ``dW = Uᵀ G`` and
  ``||dW||² = sum_{p,q} (U Uᵀ)[p, q] (G Gᵀ)[p, q]``: ``B P² (I + K O)``
  multiply-adds instead of ``B K P I O``, never forming ``dW``. It is cheaper
  only when ``P²`` is small against ``I O K / (I + K O)`` (about ``I``: the
  kernel's inputs per position), so for a Dense layer on vectors (``P = 1``)
  and not for a Conv1D over a long sequence (``P = T``); :func:`use_gram`
  decides by that predicted count, weighted by the measured
  :data:`GRAM_WEIGHT` (crossover measured between P = 16 and 32 for a
  Conv1D(32, 5) on 8 channels: ``benchmarks/results/cpu/norms_crossover.md``).
"""

from __future__ import annotations

from collections.abc import Callable

import tensorflow as tf

from jacobkit.layers import contract

#: rows' Jacobians held at once by the chunked materialization in ``batch``
#: (elements); 2**22 float32 = 16 MiB
CHUNK_ELEMENTS = 2**22


#: the Gram form's multiply-adds cost this many times a materializing one
#: (its einsums run slower than the plain matmuls of the chunks). Measured
#: with ``benchmarks/norms_crossover.py`` (Conv1D(32, 5) on 8 channels,
#: 144 rows per example, CPU): Gram faster up to P = 16, chunks from P = 32;
#: 2 puts the predicted crossover between the two (at P = 32 the two forms
#: were within 10% of each other in a second run).
GRAM_WEIGHT = 2.0


def use_gram(positions: int, inputs: int, units: int, rows: int) -> bool:
    """True where the Gram form's predicted cost per example,
    ``GRAM_WEIGHT × P² (I + K O)`` multiply-adds, is below materializing's
    ``K P I O``."""
    gram = GRAM_WEIGHT * positions * positions * (inputs + rows * units)
    return gram < rows * positions * inputs * units


def kernel_and_bias_norms(
    patches: tf.Tensor,
    dz: tf.Tensor,
    *,
    summed: bool,
    map_chunks: Callable[..., list[tf.Tensor]],
    form: str | None = None,
) -> tuple[tf.Tensor, tf.Tensor]:
    """Per-row norms of a Dense/Conv layer's kernel and bias Jacobians from
    its unfolded input ``patches`` (``(B, P, I)``) and the cotangents ``dz``
    (``(B, K, *z.shape[1:])``) at its output.

    Returns ``(kernel, bias)`` norms of shape ``(R,)``, ``R = K`` if
    ``summed`` else ``B * K`` (row-major), by the Gram form for per-example
    rows where :func:`use_gram` says so, else by materializing chunks of rows
    (``map_chunks(fn, total, chunk_size)``). ``form`` forces
    ``"gram"`` or ``"chunks"`` (the crossover benchmark measures both).
    """
    batch, rows, units = dz.shape[0], dz.shape[1], dz.shape[-1]
    positions, inputs = patches.shape[1], patches.shape[2]
    gram = use_gram(positions, inputs, units, rows) if form is None else form == "gram"
    if not summed and gram and positions == 1:
        # one position (a Dense layer on vectors): a row's gradient is x δᵀ,
        # whose norm is ||x|| ||δ||, and ||δ|| is the bias's. NOTE
        # (measured, as :func:`jacobkit.layers.base.squared_rows`): the conv
        # net's head, two small one-pass norms instead of three Einsums
        # (0.10 ms of its clipped sum)
        # reshaped only where the shapes differ (the conv net's head's
        # cotangents are (B, K, O) already: three reshapes traced six graph
        # ops)
        flat = contract.reshaped(dz, (batch, rows, units))
        bias = tf.math.reduce_euclidean_norm(flat, axis=-1)  # (B, K)
        # (B, 1, 1) -> (B, 1): no strided slice for a new axis
        inputs_norm = tf.math.reduce_euclidean_norm(patches, axis=2)
        kernel = tf.cast(contract.reshaped(inputs_norm, (batch, 1)), bias.dtype) * bias
        return tf.reshape(kernel, (-1,)), tf.reshape(bias, (-1,))
    cotangents = contract.reshaped(dz, (batch, rows, positions, units))  # (B, K, P, O)
    if not summed and gram:
        gram_inputs = tf.einsum("bpi,bqi->bpq", patches, patches)
        kernel = tf.sqrt(tf.maximum(ghost_squared(gram_inputs, cotangents), 0.0))
        bias = tf.norm(tf.reduce_sum(cotangents, axis=2), axis=-1)
        return tf.reshape(kernel, (-1,)), tf.reshape(bias, (-1,))
    per_row = (1 if summed else batch) * inputs * units
    size = max(1, min(rows, CHUNK_ELEMENTS // max(per_row, 1)))

    def chunk(start, count):
        part = cotangents[:, start : start + count]
        if summed:
            kernel = contract.summed_matmul(patches, part)
            bias = tf.reduce_sum(part, axis=(0, 2))
        else:  # (B, c, I, O) -> norms (B, c) -> (c, B)
            kernel = contract.per_example_matmul(patches, part)
            bias = tf.reduce_sum(part, axis=2)
        kernel = tf.math.reduce_euclidean_norm(kernel, axis=(-2, -1))
        bias = tf.math.reduce_euclidean_norm(bias, axis=-1)
        if not summed:
            kernel, bias = tf.transpose(kernel), tf.transpose(bias)
        return [kernel, bias]

    kernel, bias = map_chunks(chunk, rows, size)
    if summed:
        return kernel, bias
    # (K, B) -> (B, K), row-major (b, k)
    return (
        tf.reshape(tf.transpose(kernel), (-1,)),
        tf.reshape(tf.transpose(bias), (-1,)),
    )


def ghost_squared(positions: tf.Tensor, cotangents: tf.Tensor) -> tf.Tensor:
    """Each per-example row's squared kernel-gradient norm in the Gram form,
    ``||Uᵀ G||² = sum_{p,q} (U Uᵀ)[p, q] (G Gᵀ)[p, q]``, from the Gram of
    the layer's inputs at its positions, ``U Uᵀ`` (``(B, P, P)``; for a
    lookup, whether two positions' ids are equal), and the cotangents ``G``
    (``(B, K, P, O)``): ``(B, K)``."""
    rows = tf.einsum("bkpo,bkqo->bkpq", cotangents, cotangents)
    return tf.einsum("bpq,bkpq->bk", positions, rows)


def forms_rows(
    batch: int, positions: int, inputs: int, units: int, rows: int, *, summed: bool
) -> bool:
    """Whether :func:`kernel_and_bias_norms` forms the rows' gradients (no
    Gram form) in one chunk: ``(1 if summed else B) × K × I × O`` elements
    within :data:`CHUNK_ELEMENTS`, or one row (``K = 1``), which its chunks
    of rows cannot split.

    NOTE (why one row). The conv net ``convnet_medium`` of
    ``benchmarks/reductions.py``: conv4's 32 loss rows (128 -> 128, 4.7 M
    elements) were formed for their norms all the same, then contracted a
    second time for the clipped sum (9 ms each, of a 103 ms call)."""
    gram = not summed and use_gram(positions, inputs, units, rows)
    size = (1 if summed else batch) * rows * inputs * units
    return not gram and (size <= CHUNK_ELEMENTS or rows == 1)


def ghost_pairs(positions: int, inputs: int, units: int, rows: int) -> bool:
    """True where the exact Gram between two sets' rows of a Dense/Conv
    kernel is cheaper from the layer's unfolded inputs and cotangents than
    from the materialized gradients (mixed ghost clipping's rule, per pair
    of examples): ``GRAM_WEIGHT × P² (I + K² O)`` multiply-adds for the
    ``K²`` row pairs of two examples against ``K² I O`` for theirs formed
    (:func:`jacobkit.strategies.batch.contract.factors`)."""
    return _pairs_cheaper(positions, inputs, inputs, units, rows)


def _pairs_cheaper(
    positions: int, per_position: int, inputs: int, units: int, rows: int
) -> bool:
    """Whether two examples' row pairs cost less from their positions
    (``GRAM_WEIGHT × P² (per_position + K² O)``, ``per_position`` the cost
    of one pair of positions' inputs) than from their formed gradients
    (``K² I O``)."""
    ghost = GRAM_WEIGHT * positions * positions * (per_position + rows * rows * units)
    return ghost < rows * rows * inputs * units
