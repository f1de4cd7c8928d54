"""A tied table's per-example rows formed (``jk.gram``'s formed rows of a
language model's token table, looked up at the input and called in reverse
for the logits): a reverse call's tables, and a lookup's cotangents added
into tables at its ids."""

from __future__ import annotations

import tensorflow as tf


def reverse_tables(inputs: tf.Tensor, g: tf.Tensor) -> tf.Tensor:
    """A reverse call's per-example rows' tables, formed: ``Σ_p g[b, k, p]
    ⊗ inputs[b, p]`` from the inputs ``(B, P, D)`` and the logits'
    cotangents ``g`` (``(B, K, P, V)``) -> ``(B * K, V, D)``, row-major: one
    batched matmul over the positions, the cotangents read transposed (a
    row's ``V`` logits side by side, ``(B, P, K V)``; no copy for one row
    per example), never broadcasting the inputs over the rows (which oneDNN
    miscomputes in TF 2.21: :mod:`jacobkit.strategies.vectorize`).

    NOTE (measured, one loaded core, oneDNN on). The reductions benchmark's
    GPT-2 (32 examples of 32 tokens, vocabulary 1,000, width 64, one loss
    row): ``einsum("bpd,bkpv->bkvd")`` took 5.0 ms of a 30 ms ``jk.gram``
    call (a quarter of its plain step's), this matmul 1.1-2.1 ms."""
    rows, positions, vocabulary = (int(n) for n in g.shape[1:])
    dim = int(inputs.shape[-1])
    if rows == 1:
        by_position = tf.reshape(g, (-1, positions, vocabulary))
    else:
        by_position = tf.reshape(
            tf.transpose(g, (0, 2, 1, 3)), (-1, positions, rows * vocabulary)
        )
    tables = tf.matmul(by_position, inputs, adjoint_a=True)  # (B, K V, D)
    return tf.reshape(tables, (-1, vocabulary, dim))


def lookups_added(tables: tf.Tensor, ids: tf.Tensor, dz: tf.Tensor) -> tf.Tensor:
    """Per-example rows' tables ``(B * K, V, D)`` (row-major) with a
    lookup's rows added: its ids ``(B, P)`` and cotangents ``dz`` (``(B, K,
    ..., D)``), each row's cotangent at a position added to its own table's
    row of that position's id; one ``tensor_scatter_nd_add``.

    NOTE (measured, one loaded core, oneDNN on). GPT-2's table of the
    reductions benchmark (32 examples of 32 tokens, vocabulary 1,000, width
    64): the reverse call's tables, the lookup's and their product took
    0.92x the time with this scatter as with the lookup's own tables (a
    segment sum into zeros) added, and the whole ``jk.gram`` call 0.96-0.98x
    (paired in one process). The scatter itself costs about a copy of the
    tables (1.1 ms over their matmul, where adding a number to them cost
    0.4 ms): TensorFlow does not write into them in place there."""
    vocabulary, dim = int(tables.shape[1]), int(tables.shape[2])
    batch, rows = dz.shape[0], dz.shape[1]
    # row (b, k)'s table starts at (b K + k) V
    starts = vocabulary * tf.reshape(tf.range(batch * rows), (batch, rows, 1))
    at = tf.reshape(starts + ids[:, None, :], (-1, 1))  # (B K P, 1)
    updates = tf.reshape(tf.cast(dz, tables.dtype), (-1, dim))  # (B K P, D)
    flat = tf.reshape(tables, (-1, dim))
    return tf.reshape(
        tf.tensor_scatter_nd_add(flat, at, updates), (-1, vocabulary, dim)
    )
