"""The fixed random maps of ``reduce=jk.Project(dim, seed)``.

Each target variable ``v`` gets its own map ``M_v`` from ``R^size(v)`` to
``R^dim``; a row's projection is ``sum_v M_v g_v``, so ``M = [M_1 ... M_n]``
maps the row's whole gradient. ``M_v`` is drawn from ``seed`` and the
target's key (``"dense/kernel"``) by NumPy's ``default_rng`` (the same
numbers on every machine), so it depends on nothing else: not the batching,
the order, the strategy or the process.

Two kinds, chosen by size alone (:data:`DENSE_ELEMENTS`):

- **small** (``inputs * units * dim <= DENSE_ELEMENTS``): by default a
  CountSketch: coordinate ``i`` of the target's flattened gradient is added,
  times a sign ``s(i) = ±1``, to one bucket ``b(i)`` of ``[0, dim)``, both
  drawn uniformly and independently. ``M_v`` is then ``n x dim`` with one
  ``±1`` per row (no ``1/sqrt(dim)``: ``E<Mg, Mh> = <g, h>``, the scale of
  the other kinds, whose parts are summed with it), applied in
  ``O(rows x n)`` by one segment sum. Its variance,
  ``<Mg, Mh> - <g, h> = Σ_{i<j} s_i s_j [b_i = b_j] (g_i h_j + g_j h_i)``
  (pairs uncorrelated, ``P(b_i = b_j) = 1/dim``)::

      Var<Mg, Mh> = Σ_{i≠j} (g_i² h_j² + g_i h_i g_j h_j) / dim
                  = (<g, h>² + |g|² |h|² - 2 Σ_i g_i² h_i²) / dim

  is at most the Gaussian map's. With ``jk.Project(dim, small="gaussian")``
  ``M_v`` is instead Gaussian, ``N(0, 1/dim)`` entries (jacobkit 0.2.0's
  map, applied as a dense matmul: ``n x dim`` multiply-adds per row):
  ``E<Mg, Mh> = <g, h>`` and ``Var<Mg, Mh> = (<g, h>^2 + |g|^2 |h|^2) / dim``.
- **Kronecker** (LoGra's): ``v`` seen as an ``I x O`` matrix (its last axis
  ``O``, the rest ``I``: a Dense or convolution kernel as it multiplies the
  layer's unfolded input), ``M_v vec(G) = vec(Lᵀ G R)[:dim] / sqrt(dim)``
  with ``L`` (``I x s``) and ``R`` (``O x s``) Gaussian, ``s = ceil(sqrt(dim))``.
  Unbiased as well; its variance is larger than the small maps' (the
  coordinates share rows of ``L`` and ``R``). For rank-1 gradients
  ``g = a δᵀ`` (a Dense layer, one position per example) and ``dim = s²``
  it is that of a product ``X Y`` of two independent dense sketches of size
  ``s``, of ``<a, a'>`` and ``<δ, δ'>``:
  ``Var X Var Y + Var X (E Y)² + Var Y (E X)²``, up to about ``2 sqrt(dim)``
  times the Gaussian map's (measured over 400 seeds on a Dense kernel's loss
  gradients: 0.81-1.01 of this formula; the Gaussian map 0.86-1.02 of its
  own, the CountSketch 0.90-1.06 of its own;
  ``tests/test_projection.py``). Gradients summed over many positions
  (convolutions, sequences) are of higher rank, and their variance lies
  nearer the Gaussian map's. Where a layer's rule gives its unfolded input ``U`` and
  output cotangents ``Δ``, ``G = Σ_p U_pᵀ Δ_p`` is never formed:
  ``Lᵀ G R = Σ_p (U_p L)ᵀ (Δ_p R)``, ``P (I + O) s + P s²`` multiply-adds per
  row instead of ``P I O``.
"""

from __future__ import annotations

import math
import zlib
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import tensorflow as tf

from jacobkit.problem.cache import PerModel

#: a map of at most this many numbers is dense (16 MiB of float32); a larger
#: one is a Kronecker product (a GPT-2 FFN kernel of 768 x 3072 to 2048
#: numbers would be 4.8 G numbers dense, 0.2 M as factors)
DENSE_ELEMENTS = 2**22


#: a dense (Gaussian) map of at least this many rows (a target's size) is applied as
#: ``(Mᵀ gᵀ)ᵀ`` with ``Mᵀ`` held: oneDNN's matmul of few rows by a large map
#: is slower than the transposed product (one core, TF 2.21, 32 rows into
#: 2048 numbers: a 2048-row map 3.0 -> 2.1 ms, 4096 rows 4.2 -> 2.7 ms, 1024
#: rows 1.8 -> 1.5 ms; at 64-256 rows neither is faster beyond noise)
TRANSPOSED_ELEMENTS = 1024


def split(shape: tuple[int, ...]) -> tuple[int, int]:
    """``(I, O)``: a variable of ``shape`` as a matrix, its last axis the
    columns (``(1, 1)`` for a scalar)."""
    if not shape:
        return 1, 1
    return math.prod(shape[:-1]), int(shape[-1])


def small(project: Any, shape: tuple[int, ...]) -> bool:
    """Whether the target of ``shape`` has a small map (a CountSketch or a
    Gaussian one, applied to its rows formed), else a Kronecker one."""
    inputs, units = split(shape)
    return inputs * units * project.dim <= DENSE_ELEMENTS


def map_bytes(project: Any, shape: tuple[int, ...]) -> int:
    """Bytes of the target's map as held (:meth:`TargetMap.held`): a
    CountSketch's buckets and signs, a Gaussian map, or a Kronecker map's
    two factors."""
    inputs, units = split(shape)
    if not small(project, shape):
        return (inputs + units) * (math.isqrt(project.dim - 1) + 1) * 4
    if project.small == "countsketch":
        return inputs * units * 8
    return inputs * units * project.dim * 4


@dataclass(frozen=True)
class TargetMap:
    """One target's map ``M_v`` (see the module docstring).

    Attributes:
        dim: the numbers each row is mapped to.
        inputs, units: the target as an ``inputs x units`` matrix.
        dense: a Gaussian map ``(inputs * units, dim)``, else ``None``.
        left, right: ``(inputs, s)`` and ``(units, s)`` of a Kronecker map.
        buckets, signs: a CountSketch's ``(inputs * units,)`` buckets (int32
            in ``[0, dim)``) and signs (float32 ``±1``).
    """

    dim: int
    inputs: int
    units: int
    dense: np.ndarray | None
    left: np.ndarray | None
    right: np.ndarray | None
    buckets: np.ndarray | None = None
    signs: np.ndarray | None = None
    #: each array as a tensor made once, eagerly (:meth:`held`)
    _held: dict[str, tf.Tensor] = field(default_factory=dict, compare=False, repr=False)

    @property
    def kronecker(self) -> bool:
        return self.left is not None

    @property
    def sparse(self) -> bool:
        """A CountSketch."""
        return self.buckets is not None

    def matrix(self) -> np.ndarray:
        """A small target's map as a dense float32 ``(inputs * units, dim)``
        matrix (a CountSketch's one ``±1`` per row materialized): the
        reference and export form, ``g @ matrix()``; not for a Kronecker map."""
        if self.dense is not None:
            return self.dense
        assert self.buckets is not None and self.signs is not None, "a small map"
        found = np.zeros((len(self.buckets), self.dim), np.float32)
        found[np.arange(len(self.buckets)), self.buckets] = self.signs
        return found

    def held(self, name: str) -> tf.Tensor:
        """The array ``name`` (``"dense"``, ``"left"``, ``"right"``,
        ``"buckets"`` or ``"signs"``; or
        ``"dense_t"``, the dense map transposed and laid out so, or
        ``"signs_column"``, the signs ``(n, 1)``) as a
        tensor made once, eagerly even while a function is traced, so that
        a compiled call captures it as an input instead of embedding it as a
        constant.

        NOTE (measured, one core). ``reduce=jk.Project(2048)``'s first call
        on the reductions benchmark's models, with the maps embedded as
        constants against captured: ``bert_small`` 9.4 -> 6.2 s and 2,234 ->
        636 MiB of process growth; the conv net 0.85 -> 0.56 s, 235 -> 85
        MiB; steady calls the same."""
        if name not in self._held:
            transposed = name.endswith("_t")  # "dense_t": Mᵀ, laid out so
            column = name.endswith("_column")  # "signs_column": (n, 1)
            array = getattr(
                self,
                name[:-2] if transposed else name.removesuffix("_column"),
            )
            assert array is not None, f"the map has {name}"
            if transposed:
                array = np.ascontiguousarray(array.T)
            if column:
                array = array[:, None]
            with tf.init_scope():
                self._held[name] = tf.constant(array)
        return self._held[name]

    def of_flat(self, gradients: tf.Tensor) -> tf.Tensor:
        """``(R, size)`` gradients (or ``(R, *shape)``) -> ``(R, dim)``.

        A Kronecker map's ``Lᵀ G R`` by 2-D matmuls only, its smaller factor
        side first (``(I, R * O)`` gradients transposed, then ``(s, R, O)``
        times ``R``, where ``O < I``).

        NOTE (measured, one core, loaded machine). BERT tiny's attention
        query/key/value kernels ``(64, 4, 16)`` are mapped as ``256 x 16``
        matrices from their formed gradients; the former
        ``einsum("ia,rib->rab")`` after ``G R`` took 1-1.8 ms each of a 50 ms
        call, and ``jk.Project(2048)`` went from 2.55 to 2.1 x the plain
        step with this order (paired in one process)."""
        # a static row count where it is known: tf.shape's strided slice
        # and the Pack of a reshape's shape traced eight graph ops a target
        rows = gradients.shape[0]
        if rows is None:
            rows = tf.shape(gradients)[0]
        if self.buckets is not None:
            return self._counted(tf.reshape(gradients, (rows, -1)))
        if self.dense is not None:
            size = self.inputs * self.units
            flat = tf.reshape(gradients, (rows, size))
            if size < TRANSPOSED_ELEMENTS:
                return tf.matmul(flat, tf.cast(self.held("dense"), flat.dtype))
            # (Mᵀ gᵀ)ᵀ: the same products, Mᵀ held laid out as it is read
            mapped = tf.matmul(
                tf.cast(self.held("dense_t"), flat.dtype), flat, transpose_b=True
            )
            return tf.transpose(mapped)
        left = tf.cast(self.held("left"), gradients.dtype)  # (I, s)
        right = tf.cast(self.held("right"), gradients.dtype)  # (O, s)
        side = int(right.shape[1])
        if self.units < self.inputs:  # Lᵀ first: it shrinks the larger side
            matrix = tf.reshape(gradients, (rows, self.inputs, self.units))
            matrix = tf.reshape(tf.transpose(matrix, (1, 0, 2)), (self.inputs, -1))
            found = tf.matmul(left, matrix, transpose_a=True)  # (s, R * O)
            found = tf.matmul(tf.reshape(found, (-1, self.units)), right)
            both = tf.transpose(tf.reshape(found, (side, rows, side)), (1, 0, 2))
        else:  # R first
            matrix = tf.reshape(gradients, (rows * self.inputs, self.units))
            found = tf.matmul(matrix, right)  # (R * I, s)
            found = tf.reshape(found, (rows, self.inputs, side))
            found = tf.reshape(tf.transpose(found, (1, 0, 2)), (self.inputs, -1))
            found = tf.matmul(left, found, transpose_a=True)  # (s, R * s)
            both = tf.transpose(tf.reshape(found, (side, rows, side)), (1, 0, 2))
        return self._kept(tf.reshape(both, (rows, -1)))

    def _counted(self, flat: tf.Tensor) -> tf.Tensor:
        """A CountSketch of ``(R, n)`` rows: ``(R, dim)``, each coordinate
        times its sign added to its bucket, one segment sum over the rows
        transposed (``n`` multiply-adds per row).

        NOTE (measured, one core, loaded machine, 32 rows into 2,048, one
        compiled call each): n = 128 / 1,024 / 4,036 coordinates, the dense
        map's matmul 387 / 1,576 / 11,607 µs; this 309 / 382 / 694 µs; a
        ``tf.sparse.sparse_dense_matmul`` by the held map 283 / 386 / 690 µs
        (the same beyond noise, and it needs a SparseTensor held);
        ``scatter_nd`` 308 / 413 / 772 µs; the segment sum of the rows
        untransposed 380 / 447 / 840 µs (most of the small sizes is the
        call's own overhead)."""
        # the signs held as a column (``signs[:, None]`` traced a strided
        # slice and its three constants per target)
        signs = tf.cast(self.held("signs_column"), flat.dtype)
        summed = tf.math.unsorted_segment_sum(
            tf.transpose(flat) * signs, self.held("buckets"), self.dim
        )
        return tf.transpose(summed)

    def of_mapped(self, left: tf.Tensor, cotangents: tf.Tensor) -> tf.Tensor:
        """A Kronecker map of ``G[b, k] = patches[b]ᵀ cotangents[b, k]``
        without forming it, from the patches' product with the left factor,
        ``left = patches @ self.left`` (``(B, P, s)``, as the layer's rule
        computes it: :meth:`jacobkit.layers.base.LayerRule.unfold_times`),
        and the cotangents ``(B, K, P, O)`` -> ``(B * K, dim)``."""
        assert self.left is not None and self.right is not None, "a Kronecker map"
        left = tf.cast(left, cotangents.dtype)
        right = _times(cotangents, self.held("right"))  # (B, K, P, s)
        both = tf.matmul(tf.transpose(left, (0, 2, 1))[:, None], right)  # (B,K,s,s)
        batch, rows = cotangents.shape[0], cotangents.shape[1]
        return self._kept(tf.reshape(both, (batch * rows, -1)))

    def of_lookup(self, ids: tf.Tensor, cotangents: tf.Tensor) -> tf.Tensor:
        """:meth:`of_mapped` of an embedding lookup, whose patches are the
        one-hot rows of its ids ``(B, P)``: their product with the left
        factor is the factor's rows at the ids, gathered."""
        assert self.left is not None and self.right is not None, "a Kronecker map"
        return self.of_mapped(tf.gather(self.held("left"), ids), cotangents)

    def of_reversed(self, inputs: tf.Tensor, cotangents: tf.Tensor) -> tf.Tensor:
        """A Kronecker map of ``G[b, k] = Σ_p cotangents[b, k, p]ᵀ
        inputs[b, p]`` (:meth:`of_mapped`'s factors with their roles
        swapped: a tied embedding's reverse call, whose gradient's rows are
        the logits' features) without forming it: ``Lᵀ G R = Σ_p
        (cotangents[p] L)ᵀ (inputs[p] R)``. ``inputs`` ``(B, P, D)`` and
        ``cotangents`` ``(B, K, P, V)`` -> ``(B * K, dim)``, ``P V s + P D s
        + P s²`` multiply-adds per row instead of ``P V D``."""
        assert self.left is not None and self.right is not None, "a Kronecker map"
        inputs = tf.cast(inputs, cotangents.dtype)
        left = _times(cotangents, self.held("left"))  # (B, K, P, s)
        right = _times(inputs, self.held("right"))  # (B, P, s)
        both = tf.einsum("bkps,bpt->bkst", left, right)
        batch, rows = cotangents.shape[0], cotangents.shape[1]
        return self._kept(tf.reshape(both, (batch * rows, -1)))

    def _kept(self, both: tf.Tensor) -> tf.Tensor:
        # the scale in the rows' own dtype (tf.cast of a Python float went
        # through float32: float64 rows were 1.7e-8 off at dim=2048)
        # no slice where the map gives ``dim`` columns (its begin, end and
        # strides constants)
        kept = both if both.shape[1] == self.dim else both[:, : self.dim]
        return kept / tf.constant(math.sqrt(self.dim), both.dtype)


def _times(tensor: tf.Tensor, matrix: tf.Tensor) -> tf.Tensor:
    """``tensor @ matrix`` over the last axis, as one 2-D matmul (a rank-4 by
    rank-2 ``tf.matmul`` gave wrong numbers, then std::bad_alloc, on CPU:
    TF 2.21, oneDNN)."""
    flat = tf.reshape(tensor, (-1, tensor.shape[-1]))
    found = tf.matmul(flat, tf.cast(matrix, tensor.dtype))
    return tf.reshape(found, (*tensor.shape[:-1], matrix.shape[1]))


_MAPS = PerModel("jk.Project's maps, drawn once per projection and targets")


def maps(problem: Any, project: Any) -> tuple[TargetMap, ...]:
    """Each target's map under ``project`` (a ``jk.Project``), drawn once per
    model and kept in its state."""
    shapes = tuple(tuple(int(s) for s in t.shape) for t in problem.targets)
    kept = _MAPS.of(problem.model)
    key = (project, problem.target_names, shapes)
    if key not in kept:
        kept[key] = tuple(
            target_map(project, name, shape)
            for name, shape in zip(problem.target_names, shapes, strict=True)
        )
    found: tuple[TargetMap, ...] = kept[key]
    return found


def target_map(project: Any, name: str, shape: tuple[int, ...]) -> TargetMap:
    """The map of the target ``name`` of ``shape`` under ``project``."""
    dim, seed = project.dim, project.seed
    inputs, units = split(shape)
    rng = np.random.default_rng([seed, zlib.crc32(name.encode()), dim])
    if small(project, shape) and project.small == "countsketch":
        size = inputs * units
        buckets = rng.integers(0, dim, size, dtype=np.int32)
        signs = (2 * rng.integers(0, 2, size) - 1).astype(np.float32)
        return TargetMap(dim, inputs, units, None, None, None, buckets, signs)
    if small(project, shape):
        dense = rng.standard_normal((inputs * units, dim), dtype=np.float32)
        dense /= np.float32(math.sqrt(dim))
        return TargetMap(dim, inputs, units, dense, None, None)
    side = math.isqrt(dim - 1) + 1
    left = rng.standard_normal((inputs, side), dtype=np.float32)
    right = rng.standard_normal((units, side), dtype=np.float32)
    return TargetMap(dim, inputs, units, None, left, right)
