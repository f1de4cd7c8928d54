"""Which input tokens explain each output of a language model: every target
position (or class) against every input token, in one
:func:`jacobkit.jacobian` call.

- A causal LM (keras_hub ``*CausalLM``, or any model whose output is ``(B,
  T, vocabulary)`` logits): row ``[b, t]`` is the log-probability that
  position ``t`` gives its target token, by default the next input token
  (teacher forcing), ``targets[b, t]`` where given. Rows are per-token losses
  (``jk.Loss(..., each=True)``), so a padded target's row is weighted 0.
- A text classifier (``(B, classes)`` logits): row ``[b, k]`` is class
  ``k``'s logit.

Each row is differentiated at the token embedding layer's output
(``jk.Output``), each example against its own tokens only: ``(B, rows, T,
D)``, reduced over the embedding axis ``D`` as the method defines.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import tensorflow as tf

from jacobkit import api
from jacobkit.explain import completeness
from jacobkit.explain.input_maps import RULES, path_points
from jacobkit.explain.token_paths import baseline_embeddings, end_values, path_gradients
from jacobkit.keras.embeddings import embedding_layer
from jacobkit.keras.lm_head import LinearHead, linear_head
from jacobkit.problem.loss import Loss
from jacobkit.problem.tensor_targets import Output

METHODS = ("gradient", "gradient_x_input", "integrated_gradients")


@dataclass(frozen=True)
class TokenAttribution:
    """Attributions of a language model's outputs to its input tokens.

    Attributes:
        scores: ``(B, rows, T)``: row ``[b, t]``'s attribution to input token
            ``s``: the L2 norm over the embedding of the gradient
            (``"gradient"``), or the sum of gradient x embedding
            (``"gradient_x_input"``). A causal LM's row ``t`` is its target at
            position ``t`` (``T - 1`` rows by default: position ``t``
            predicts token ``t + 1``); a classifier's rows are its classes.
            Zero above the causal diagonal (``s > t``) and at padding.
        gradients: ``(B, rows, T, D)`` the per-dimension gradients, when asked
            for (``per_dimension=True``), else ``None``.
        kind: ``"causal_lm"`` or ``"classifier"``.
        method: the method.
        embedding: the embedding layer's name.
        targets: a causal LM's target token per row, ``(B, rows)``.
        gap: integrated gradients' completeness gap, ``(B, rows)``, one per
            row: ``scores[b, r].sum() - (f_r(e) - f_r(e0))``, how far the
            row's attributions miss its change from the baseline (captum's
            convergence delta; float64; :mod:`jacobkit.explain.completeness`);
            ``None`` for the other methods.
        baseline: integrated gradients' ``e0`` as chosen (``"zeros"``, ``"token
            7"``, ``"pad token 0, scaled to each position's RMS"``), else
            ``None``.
    """

    scores: np.ndarray
    gradients: np.ndarray | None
    kind: str
    method: str
    embedding: str
    targets: np.ndarray | None
    gap: np.ndarray | None = None
    baseline: str | None = None


def token_attribution(
    model: Any,
    inputs: Any,
    *,
    method: str = "gradient",
    targets: Any = None,
    embedding: str | None = None,
    per_dimension: bool = False,
    positions: tuple[int, int] | None = None,
    steps: int = 16,
    baseline: int | str | None = "auto",
    rule: str = "gauss_legendre",
    memory_budget: int | float | str | None = None,
    strategy: Any = "auto",
) -> TokenAttribution:
    """Every target position (or class) of each example against every input
    token, in one call (see the module docstring).

    Args:
        model: a keras_hub causal LM or text classifier (``preprocessor=None``:
            token ids in), or any Keras model of integer tokens whose output
            is ``(B, T, vocabulary)`` or ``(B, classes)`` logits.
        inputs: what the model takes: a dict with ``"token_ids"`` (and
            ``"padding_mask"``, ``"segment_ids"``), or ``(B, T)`` token ids.
        method: ``"gradient"`` (the gradient's L2 norm over the embedding),
            ``"gradient_x_input"`` (the sum of gradient x embedding) or
            ``"integrated_gradients"`` (the sum over the embedding of ``(e -
            e0) x`` the weighted mean gradient on ``steps`` points from the
            baseline ``e0`` to the embedding ``e``, placed by ``rule``).
        targets: a causal LM's target token per position ``(B, T)`` (each
            position's log-probability of ``targets[b, t]``); default: the
            next input token, rows ``0 .. T - 2``.
        embedding: the token embedding layer's name (found for keras_hub
            models, and where the model has one ``Embedding``).
        positions: a causal LM's target positions ``(start, stop)`` to
            attribute (rows ``start .. stop - 1`` only; default: all).
        per_dimension: keep the gradients ``(B, rows, T, D)`` too (integrated
            gradients: the path's mean gradient).
        steps: integrated gradients' points on the path (>= 2).
        baseline: integrated gradients' ``e0``: ``"auto"`` (the default:
            ``"pad"`` on a model with an RMS normalization, Gemma's or
            Llama's, where a zero start is degenerate; else zeros),
            ``"zeros"`` (or ``None``), ``"pad"`` (the pad token's embedding
            scaled at each position to that position's embedding's RMS), or
            a token id whose embedding every position starts from. See
            :mod:`jacobkit.explain.token_paths` for the measurements.
        rule: integrated gradients' points and average of their gradients,
            as :func:`jacobkit.explain.integrated_gradients`'s (default
            ``"gauss_legendre"``; ``"riemann"`` up to 0.2.0).
        memory_budget: as :func:`jacobkit.jacobian`.
        strategy: as :func:`jacobkit.jacobian`.

    Returns:
        :class:`TokenAttribution`; integrated gradients with each row's
        completeness gap (one more forward pass, at both ends), and a
        :class:`~jacobkit.explain.completeness.CompletenessWarning` where a
        row's gap is above 5% of its ``|f(e) - f(e0)|``.
    """
    if method not in METHODS:
        raise ValueError(
            f"token_attribution(method={method!r}): expected one of "
            f"{', '.join(map(repr, METHODS))}."
        )
    if method == "integrated_gradients":
        _check_path(steps, rule)
    layer = embedding_layer(model, embedding)
    ids, mask = tokens_of(inputs)
    _check_vocabulary(ids, layer)
    width = _output_rank(model, inputs)
    kwargs: dict[str, Any] = dict(memory_budget=memory_budget, strategy=strategy)
    kind = "causal_lm" if width == 3 else "classifier"
    wanted = weights = None
    rows_fn = _log_likelihood
    if kind == "causal_lm":
        wanted, weights = _targets(ids, mask, targets)
        if wanted.shape[1] == 0:
            raise ValueError(
                f"token_attribution(inputs=...): token ids of shape {ids.shape}: "
                "a prompt of one token has no next token to attribute. Pass at "
                "least two tokens, or targets= (one target token per position)."
            )
        if positions is not None:
            start, stop = _positions(positions, wanted.shape[1])
            wanted, weights = wanted[:, start:stop], weights[:, start:stop]
            rows_fn = LogLikelihood(start)
    embedded = np.asarray(layer(tf.convert_to_tensor(ids)))
    labels = (wanted, weights, rows_fn)
    if method != "integrated_gradients":
        gradients = _gradients(model, layer, inputs, labels, kwargs)
        gradients = gradients * mask[:, None, :, None]  # padding: exactly 0
        if method == "gradient":
            scores = np.sqrt(np.sum(np.square(gradients), axis=-1))
        else:
            scores = np.einsum("bktd,btd->bkt", gradients, embedded)
        return TokenAttribution(
            scores, gradients if per_dimension else None, kind, method, layer.name,
            None if wanted is None else np.asarray(wanted),
        )  # fmt: skip
    origin, described = baseline_embeddings(model, layer, embedded, baseline)
    path = (embedded, origin, path_points(steps, rule))
    gradients = path_gradients(model, layer, inputs, labels, path, kwargs)
    gradients = gradients * mask[:, None, :, None]  # padding: exactly 0
    scores = np.einsum("bktd,btd->bkt", gradients, embedded - origin)
    at_end, at_start = end_values(model, layer, inputs, labels, embedded, origin)
    gap = completeness.gap_of(scores.sum(-1), at_end - at_start)
    completeness.warn_if_large(
        "token_attribution(method='integrated_gradients')",
        gap,
        at_end - at_start,
        steps=steps,
        hint=f"the baseline is {described}; try baseline='pad' (safe for RMS "
        "normalizations) or a neutral token's id.",
    )
    return TokenAttribution(
        scores, gradients if per_dimension else None, kind, method, layer.name,
        None if wanted is None else np.asarray(wanted), gap, described,
    )  # fmt: skip


def _check_path(steps: Any, rule: Any) -> None:
    """Refuse integrated gradients' ``steps`` and ``rule`` before any work."""
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 2:
        raise ValueError(f"token_attribution(steps={steps!r}): need an int >= 2.")
    if rule not in RULES:
        raise ValueError(
            f"token_attribution(rule={rule!r}): expected 'gauss_legendre' "
            "(Gauss-Legendre quadrature), 'trapezoid' (the trapezoid rule) or "
            "'riemann' (the mean of the path's gradients)."
        )


def _gradients(
    model: Any, tapped: Any, inputs: Any, labels: tuple[Any, Any, Any], kwargs: Any
) -> np.ndarray:
    """Every row's gradient at ``tapped``'s output, ``(B, rows, T, D)``."""
    target = Output(tapped)
    wanted, weights, fn = labels
    if wanted is None:
        result = api.jacobian(model, inputs, target, outputs="per_example", **kwargs)
    elif isinstance(fn, LogLikelihood) and (split := linear_head(model)) is not None:
        # the rows <g, h> of the body alone, each row's cotangent g at the
        # hidden states from the head in the same pass (jacobkit.keras.lm_head)
        rows = Loss(HiddenRows(fn.start, split), each=True)
        data = (inputs, wanted, weights)
        result = api.jacobian(split.body, data, target, outputs=rows, **kwargs)
    else:
        rows = Loss(fn, each=True)
        data = (inputs, wanted, weights)
        result = api.jacobian(model, data, target, outputs=rows, **kwargs)
    (found,) = result.jacobians.values()
    return np.asarray(tf.convert_to_tensor(found))


@dataclass(frozen=True)
class LogLikelihood:
    """Rows of a causal LM: position ``start + k``'s log-probability of its
    target token ``y_true[:, k]``, ``(B, rows)`` (a value, so equal rows
    share one compiled computation)."""

    start: int = 0

    def __call__(self, y_true: Any, logits: Any) -> tf.Tensor:
        y_true = tf.cast(y_true, tf.int32)
        rows = y_true.shape[1]
        chosen = tf.convert_to_tensor(logits)[:, self.start : self.start + rows]
        log_p = tf.nn.log_softmax(chosen, axis=-1)
        return tf.gather(log_p, y_true, batch_dims=2)


@dataclass(frozen=True)
class HiddenRows:
    """A causal LM's rows from its body's hidden states ``h`` (``(B, T, D)``,
    :mod:`jacobkit.keras.lm_head`): row ``k`` is ``<g_k, h[:, start + k]>``
    with ``g_k`` the gradient of position ``start + k``'s log-probability of
    its target token (``y_true[:, k]``) at that position, computed by the
    head from ``h`` with no gradient flowing back through it: the same
    gradient as :class:`LogLikelihood`'s at everything before ``h``, without
    the head's backward pass per row. (A value, so equal rows share one
    compiled computation.)

    NOTE (measured, one core, the tiny GPT-2 of
    ``benchmarks/token_attribution.py``). ``g`` was a compiled pass of its
    own before the rows' call, the body's forward pass twice per call: its
    trace took 0.36 s of the first call, its run 2.4 ms of each later one.
    """

    start: int
    split: LinearHead

    def __call__(self, y_true: Any, hidden: Any) -> tf.Tensor:
        targets = tf.cast(y_true, tf.int32)
        at = tf.convert_to_tensor(hidden)[:, self.start : self.start + targets.shape[1]]
        # from h held fixed: nothing differentiates (or, forward mode,
        # pushes tangents) through the head's own gradient
        g = self.split.cotangents(tf.stop_gradient(at), targets)
        return tf.reduce_sum(tf.cast(at, g.dtype) * g, axis=-1)


#: every position's log-probability of its target (the last has none)
_log_likelihood = LogLikelihood(0)


def _targets(
    ids: np.ndarray, mask: np.ndarray, targets: Any
) -> tuple[np.ndarray, np.ndarray]:
    """The target tokens ``(B, rows)`` and their weights (0 where the target
    or its position is padding)."""
    if targets is None:
        wanted = ids[:, 1:]
        weights = mask[:, 1:] * mask[:, :-1]
    else:
        wanted = np.asarray(targets)
        if wanted.shape != ids.shape:
            raise ValueError(
                f"token_attribution(targets=...): shape {wanted.shape}, expected "
                f"the token ids' {ids.shape} (one target token per position)."
            )
        weights = mask.copy()
    return wanted.astype("int32"), weights.astype("float32")


def _positions(positions: Any, count: int) -> tuple[int, int]:
    try:
        start, stop = (int(p) for p in positions)
    except (TypeError, ValueError):
        start = stop = -1
    if not 0 <= start < stop <= count:
        raise ValueError(
            f"token_attribution(positions={positions!r}): expected (start, stop) "
            f"with 0 <= start < stop <= {count}, the target positions."
        )
    return start, stop


def tokens_of(inputs: Any) -> tuple[np.ndarray, np.ndarray]:
    """The token ids ``(B, T)`` and the padding mask (1 for real tokens)."""
    if isinstance(inputs, dict):
        if "token_ids" not in inputs:
            raise ValueError(
                "token_attribution(inputs=...): a dict of inputs needs "
                f"'token_ids'; got {sorted(inputs)}."
            )
        ids = np.asarray(inputs["token_ids"])
        mask = np.asarray(inputs.get("padding_mask", np.ones_like(ids)))
    else:
        ids = np.asarray(inputs)
        mask = np.ones_like(ids)
    if ids.ndim != 2 or not np.issubdtype(ids.dtype, np.integer):
        raise ValueError(
            "token_attribution(inputs=...): expected integer token ids of shape "
            f"(B, T), got {ids.dtype} of shape {ids.shape}."
        )
    return ids, mask.astype("float32")


def _check_vocabulary(ids: np.ndarray, layer: Any) -> None:
    """Refuse token ids outside the embedding's table (the lookup would fail
    inside TensorFlow, or on GPU read zeros)."""
    size = getattr(layer, "input_dim", None)
    if not isinstance(size, int) or ids.size == 0:
        return
    low, high = int(ids.min()), int(ids.max())
    if low < 0 or high >= size:
        raise ValueError(
            f"token_attribution(inputs=...): token ids from {low} to {high}, "
            f"but the embedding {layer.name!r} holds {size} tokens (ids 0 .. "
            f"{size - 1}). Tokenize with the model's own tokenizer."
        )


def _output_rank(model: Any, inputs: Any) -> int:
    shape = getattr(model, "output_shape", None)
    if not isinstance(shape, tuple) or not shape:
        first = (
            {k: v[:1] for k, v in inputs.items()}
            if isinstance(inputs, dict)
            else inputs[:1]
        )
        shape = tuple(model(first).shape)
    if len(shape) not in (2, 3):
        raise ValueError(
            f"token_attribution(model=...): the output has shape {shape}; "
            "expected (B, T, vocabulary) logits (a causal LM) or (B, classes) "
            "(a classifier)."
        )
    return len(shape)
