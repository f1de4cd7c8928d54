"""Integrated gradients over token embeddings
(``token_attribution(method="integrated_gradients")``): the model run with
the embeddings' layer output shifted along the path from a baseline, every
point of the path in one :func:`jacobkit.jacobian` call."""

from __future__ import annotations

from typing import Any

import numpy as np
import tensorflow as tf

from jacobkit import api
from jacobkit.keras import graph
from jacobkit.problem.loss import Loss
from jacobkit.problem.tensor_targets import Inputs

#: the wrapping function's extra input (integrated gradients' shift)
OFFSET = "jacobkit_embedding_offset"
#: the token ids' key where the model takes an array
TOKENS = "token_ids"


def path_gradients(
    model: Any,
    tapped: Any,
    inputs: Any,
    labels: tuple[Any, Any, Any],
    embedded: np.ndarray,
    start: np.ndarray,
    steps: int,
    kwargs: Any,
) -> np.ndarray:
    """The mean over ``steps`` points ``e0 + a (e - e0)`` (``a`` from 0 to
    1) of every row's gradient there, ``(B, rows, T, D)``: all points in one
    call, the batch repeated per point. The model runs with ``tapped``'s
    output shifted by ``-(1 - a)(e - e0)``, an input of a wrapping function
    and the target (its gradient is the embedding's)."""
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 2:
        raise ValueError(f"token_attribution(steps={steps!r}): need an int >= 2.")
    tap = graph.LayerTap(model, tapped, lookup=True)

    def shifted(data: dict[str, Any]) -> Any:
        given = {k: v for k, v in data.items() if k != OFFSET}
        model_inputs = given if not plain else given[TOKENS]

        def hook(call: Any, args: Any, kwargs: Any) -> Any:
            outputs = call(*args, **kwargs)
            return outputs + tf.cast(data[OFFSET], outputs.dtype)

        return tap(model_inputs, False, hook)

    plain = not isinstance(inputs, dict)
    alphas = np.linspace(0.0, 1.0, steps)
    offsets = np.concatenate([-(1 - a) * (embedded - start) for a in alphas])
    given = {TOKENS: inputs} if plain else inputs
    data = {k: np.concatenate([np.asarray(v)] * steps) for k, v in given.items()}
    data[OFFSET] = offsets.astype("float32")
    wanted, weights, fn = labels
    rows: Any = "per_example"
    call_inputs: Any = data
    if wanted is not None:
        rows = Loss(fn, each=True)
        repeated = [np.concatenate([a] * steps) for a in (wanted, weights)]
        call_inputs = (data, *repeated)
    result = api.jacobian(shifted, call_inputs, Inputs(OFFSET), outputs=rows, **kwargs)
    (found,) = result.jacobians.values()
    grads = np.asarray(tf.convert_to_tensor(found))
    batch = embedded.shape[0]
    mean: np.ndarray = grads.reshape(steps, batch, *grads.shape[1:]).mean(axis=0)
    return mean


def baseline_embeddings(
    layer: Any, embedded: np.ndarray, baseline: int | None
) -> np.ndarray:
    """Integrated gradients' start: zeros, or token ``baseline``'s embedding
    at every position."""
    if baseline is None:
        return np.zeros_like(embedded)
    if isinstance(baseline, bool) or not isinstance(baseline, (int, np.integer)):
        raise ValueError(
            f"token_attribution(baseline={baseline!r}): expected None (zeros) "
            "or a token id."
        )
    row = np.asarray(layer(tf.constant([[int(baseline)]], tf.int32)))[0, 0]
    return np.broadcast_to(row, embedded.shape).astype(embedded.dtype)
