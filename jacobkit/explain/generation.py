"""Generation, then attribution: greedy decoding, and every generated
token attributed to the prompt and the earlier generated tokens in one
:func:`~jacobkit.explain.tokens.token_attribution` call."""

from __future__ import annotations

from typing import Any

import numpy as np
import tensorflow as tf

from jacobkit.explain.token_paths import TOKENS
from jacobkit.explain.tokens import TokenAttribution, token_attribution, tokens_of


def generate_and_attribute(
    model: Any,
    prompt: Any,
    *,
    new_tokens: int,
    method: str = "gradient",
    **kwargs: Any,
) -> tuple[np.ndarray, TokenAttribution]:
    """Greedy decoding of ``new_tokens`` tokens after ``prompt`` (token ids
    ``(B, P)``, or a dict with ``"token_ids"``: every prompt the same length),
    then every generated token attributed to the prompt and the earlier
    generated tokens in one :func:`token_attribution` call.

    Returns:
        ``(tokens, attribution)``: the ``(B, P + new_tokens)`` token ids, and
        the attribution of its rows ``P - 1 ..`` (each the position that
        generated the next token) against every token, ``(B, new_tokens, P +
        new_tokens)``.
    """
    if (
        isinstance(new_tokens, bool)
        or not isinstance(new_tokens, int)
        or new_tokens < 1
    ):
        raise ValueError(
            f"generate_and_attribute(new_tokens={new_tokens!r}): need an int >= 1."
        )
    ids, mask = tokens_of(prompt)
    if np.any(mask == 0):
        raise ValueError(
            "generate_and_attribute(prompt=...): prompts must be unpadded (one "
            "length for the batch)."
        )
    tokens = ids.astype("int32")
    for _ in range(new_tokens):
        logits = model(_model_inputs(prompt, tokens), training=False)
        following = np.asarray(tf.argmax(logits[:, -1], axis=-1), "int32")
        tokens = np.concatenate([tokens, following[:, None]], axis=1)
    inputs = _model_inputs(prompt, tokens)
    targets = np.concatenate([tokens[:, 1:], tokens[:, -1:]], axis=1)
    start = ids.shape[1] - 1
    found = token_attribution(
        model,
        inputs,
        method=method,
        targets=targets,
        positions=(start, start + new_tokens),
        **kwargs,
    )
    return tokens, found


def _model_inputs(prompt: Any, tokens: np.ndarray) -> Any:
    """What the model takes for ``tokens``: the prompt's dict (its masks
    and segments extended) or the ids."""
    if not isinstance(prompt, dict):
        return tokens
    found = {}
    for key, value in prompt.items():
        value = np.asarray(value)
        if key == TOKENS:
            found[key] = tokens
        elif key == "padding_mask":
            found[key] = np.ones_like(tokens, value.dtype)
        else:  # segment ids and the like: the last one continued
            width = tokens.shape[1] - value.shape[1]
            found[key] = np.concatenate([value, np.repeat(value[:, -1:], width, 1)], 1)
    return found
