"""Integrated gradients over token embeddings
(``token_attribution(method="integrated_gradients")``): the model run with
the embeddings' layer output shifted along the path from a baseline, every
point of the path in one :func:`jacobkit.jacobian` call; each row's value at
both ends (its completeness gap: :mod:`jacobkit.explain.completeness`).

NOTE (the default baseline, measured). A zero embedding is a degenerate
start for a model whose first operation on the embeddings is an RMS
normalization, ``x / sqrt(mean(x^2) + eps)`` (Gemma, Llama: no position
embedding is added before it): its gradient at 0 is ``1 / sqrt(eps)``
(1000 for Gemma's ``eps = 1e-6``), so the path's first point carries a
gradient about a thousand times the others' and the Riemann mean misses
``f(x) - f(x0)`` by that point's weight. On the tiny random-init keras_hub
Gemma of ``tests/test_tokens.py`` (vocabulary 50, hidden 16, one layer; 3
sequences of 8 tokens), the largest gap over the rows, relative to the
largest ``|f(x) - f(x0)|``, at 8, 16, 32, 64, 128 steps: zeros 3.3e4,
1.7e4, 8.3e3, 4.2e3, 2.1e3 (finite, but the attributions are the first
point's alone); the pad token's embedding 1.4e-1, 6.7e-2, 3.3e-2, 1.7e-2,
8.3e-3; the same scaled to each position's RMS 1.3e-1, 6.4e-2, 3.2e-2,
1.6e-2, 7.9e-3 (about 1 / steps, the Riemann mean's error; with
``rule="trapezoid"`` 7.3e-2, 2.9e-3, 5.5e-4, 1.3e-4, 3.3e-5); no NaN or Inf
in any, and the same time per call (2.2 to 4 s on a loaded 2-core
machine: each call traces its path's computation). So ``baseline="auto"``
takes, on a model with an RMS normalization, the pad token's embedding
scaled at each position to that position's embedding's RMS (``"pad"``): it
carries no token's information (the pad token's direction) and, RMS
normalization being blind to scale, the path's start is as well
conditioned as the tokens themselves, whatever the pad row's own size in a
trained table; on other models (GPT-2, BERT: a position embedding is
added, so the normalization never sees 0) it keeps zeros. (Measured with
the Riemann mean, the default rule then; the default is now Gauss-Legendre,
whose points exclude the path's ends.)
"""

from __future__ import annotations

from typing import Any

import numpy as np
import tensorflow as tf

from jacobkit import api, layers
from jacobkit.keras import compat, graph
from jacobkit.keras.embeddings import pad_token_id
from jacobkit.problem.loss import Loss
from jacobkit.problem.tensor_targets import Inputs

#: the wrapping function's extra input (integrated gradients' shift)
OFFSET = "jacobkit_embedding_offset"
#: the token ids' key where the model takes an array
TOKENS = "token_ids"
#: ``token_attribution(baseline=...)``'s names (else a token id)
BASELINES = ("auto", "zeros", "pad")


def path_gradients(
    model: Any,
    tapped: Any,
    inputs: Any,
    labels: tuple[Any, Any, Any],
    path: tuple[np.ndarray, np.ndarray, tuple[list[float], list[float]]],
    kwargs: Any,
) -> np.ndarray:
    """The weighted sum over the path's points ``e0 + a (e - e0)`` (``a``
    in ``[0, 1]``; ``path``: ``(e, e0, (alphas, weights))``, one weight per
    point, :func:`jacobkit.explain.input_maps.path_points`) of every row's
    gradient there, ``(B, rows, T, D)``: all points in one call, the batch
    repeated per point. The model runs with ``tapped``'s output shifted by
    ``-(1 - a)(e - e0)``, an input of a wrapping function and the target
    (its gradient is the embedding's)."""
    embedded, start, (alphas, weights) = path
    steps = len(weights)
    offsets = np.concatenate([-(1 - a) * (embedded - start) for a in alphas])
    data = _repeated(inputs, steps, offsets)
    wanted, marks, fn = labels
    rows: Any = "per_example"
    call_inputs: Any = data
    if wanted is not None:
        rows = Loss(fn, each=True)
        repeated = [np.concatenate([a] * steps) for a in (wanted, marks)]
        call_inputs = (data, *repeated)
    shifted = _shifted(model, tapped, plain=not isinstance(inputs, dict))
    result = api.jacobian(shifted, call_inputs, Inputs(OFFSET), outputs=rows, **kwargs)
    (found,) = result.jacobians.values()
    grads = np.asarray(tf.convert_to_tensor(found))
    batch = embedded.shape[0]
    per_point = grads.reshape(steps, batch, *grads.shape[1:])
    summed: np.ndarray = np.tensordot(np.asarray(weights), per_point, axes=1)
    return summed


def end_values(
    model: Any,
    tapped: Any,
    inputs: Any,
    labels: tuple[Any, Any, Any],
    embedded: np.ndarray,
    start: np.ndarray,
) -> tuple[np.ndarray, np.ndarray]:
    """Every row at the path's two ends, ``f(e)`` and ``f(e0)``, each ``(B,
    rows)`` (float64): one forward pass of the batch twice, the second with
    the embeddings shifted to the baseline."""
    offsets = np.concatenate([np.zeros_like(embedded), start - embedded])
    data = _repeated(inputs, 2, offsets)
    outputs = _shifted(model, tapped, plain=not isinstance(inputs, dict))(data)
    outputs = tf.cast(tf.convert_to_tensor(outputs), tf.float64)
    wanted, marks, fn = labels
    if wanted is not None:
        doubled = tuple(np.concatenate([a] * 2) for a in (wanted, marks))
        outputs = Loss(fn, each=True).rows(outputs, doubled)
    values = np.asarray(outputs, np.float64)
    batch = embedded.shape[0]
    return values[:batch], values[batch:]


def _repeated(inputs: Any, count: int, offsets: np.ndarray) -> dict[str, Any]:
    """The wrapping function's inputs: the model's, ``count`` times, with
    the embeddings' shifts."""
    given = {TOKENS: inputs} if not isinstance(inputs, dict) else inputs
    data = {k: np.concatenate([np.asarray(v)] * count) for k, v in given.items()}
    data[OFFSET] = offsets.astype("float32")
    return data


def _shifted(model: Any, tapped: Any, *, plain: bool) -> Any:
    """``data -> model output`` with ``tapped``'s output shifted by
    ``data[OFFSET]`` (``plain``: the model takes the token ids alone)."""
    tap = graph.LayerTap(model, tapped, lookup=True)

    def shifted(data: dict[str, Any]) -> Any:
        given = {k: v for k, v in data.items() if k != OFFSET}
        model_inputs = given if not plain else given[TOKENS]

        def hook(call: Any, args: Any, kwargs: Any) -> Any:
            outputs = call(*args, **kwargs)
            return outputs + tf.cast(data[OFFSET], outputs.dtype)

        return tap(model_inputs, False, hook)

    return shifted


def baseline_embeddings(
    model: Any, layer: Any, embedded: np.ndarray, baseline: Any
) -> tuple[np.ndarray, str]:
    """Integrated gradients' start ``(B, T, D)`` and what it is: zeros,
    token ``baseline``'s embedding at every position, or the pad token's
    scaled to each position's RMS (``"pad"``; ``"auto"``: that on a model
    with an RMS normalization, else zeros; see the module's NOTE)."""
    if baseline is None or baseline == "zeros":
        return np.zeros_like(embedded), "zeros"
    if isinstance(baseline, (int, np.integer)) and not isinstance(baseline, bool):
        return _token_row(layer, int(baseline), embedded), f"token {int(baseline)}"
    if baseline not in BASELINES:
        raise ValueError(
            f"token_attribution(baseline={baseline!r}): expected 'auto' (the "
            "pad token's embedding, scaled, on a model with an RMS "
            "normalization; else zeros), 'zeros' (or None), 'pad', or a token id."
        )
    if baseline == "auto" and not any(
        layers.divides_by_rms(found) for found in compat.flatten_layers(model)
    ):
        return np.zeros_like(embedded), "zeros"
    pad = pad_token_id(model)
    row = _token_row(layer, pad, embedded)
    size = _rms(row)
    direction = row / size if np.all(size > 0) else np.ones_like(row)
    start = (direction * _rms(embedded)).astype(embedded.dtype)
    return start, f"pad token {pad}, scaled to each position's RMS"


def _token_row(layer: Any, token: int, embedded: np.ndarray) -> np.ndarray:
    """Token ``token``'s embedding at every position of ``embedded``."""
    row = np.asarray(layer(tf.constant([[token]], tf.int32)))[0, 0]
    return np.broadcast_to(row, embedded.shape).astype(embedded.dtype)


def _rms(values: np.ndarray) -> np.ndarray:
    """The root mean square over the last axis, kept."""
    squares = np.square(np.asarray(values, np.float64))
    return np.asarray(np.sqrt(np.mean(squares, axis=-1, keepdims=True)))
