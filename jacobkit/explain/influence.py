"""Which training examples explain a prediction: TracIn, Grad-Cos and
self-influence, from the exact inner products of per-example loss gradients
(:func:`jacobkit.gram`) and their norms (``reduce="norm"``).

Every method takes a model or its checkpoints (a list of models, or of
``.keras`` files, loaded without touching the caller's models), a training
and a test set (arrays ``(x, y)``, or datasets of such batches), the target
layers (default: every trainable variable) and a per-example loss, and sums
over the checkpoints, each weighted by its learning rate where given
(TracInCP: Pruthi et al., 2020).

Scores are ``(N_test, N_train)``: ``scores[i, j] > 0`` where a gradient step
on training example ``j`` would lower test example ``i``'s loss (a
proponent), ``< 0`` where it would raise it (an opponent). With ``top_k=``
only each test example's ``k`` strongest of each kind are kept, streaming
the training set in chunks, for training sets too large for the full matrix.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import tensorflow as tf

from jacobkit import api
from jacobkit.batches import passes
from jacobkit.explain import top
from jacobkit.explain.top import TopK
from jacobkit.problem.loss import Loss
from jacobkit.reductions import gram


@dataclass(frozen=True)
class InfluenceResult:
    """Training-data attribution scores.

    Attributes:
        method: ``"tracin"``, ``"grad_cos"`` or ``"trak"``.
        scores: ``(N_test, N_train)`` float64, or ``None`` with ``top_k=``.
        top: the ``top_k`` strongest per test example (``None`` without).
        checkpoints: how many checkpoints were summed (or ensembled).
        wall_time_s: the whole call.
    """

    method: str
    scores: np.ndarray | None
    top: TopK | None
    checkpoints: int
    wall_time_s: float

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        if self.scores is None:
            raise ValueError(
                f"{self.method}(top_k=...): only the strongest scores were kept; "
                "read .top, or call without top_k= for the full matrix."
            )
        return self.scores if dtype is None else self.scores.astype(dtype)


def tracin(
    model_or_checkpoints: Any,
    train: Any,
    test: Any,
    layer: Any = None,
    *,
    loss: Any,
    learning_rates: Sequence[float] | None = None,
    top_k: int | None = None,
    memory_budget: int | float | str | None = None,
    chunk_examples: int | None = None,
    progress: bool | None = None,
    distribute: tf.distribute.Strategy | None = None,
) -> InfluenceResult:
    """TracInCP: ``scores[i, j] = sum_c lr_c <∇L(test_i; θ_c), ∇L(train_j; θ_c)>``
    over the checkpoints ``θ_c``, exact (:func:`jacobkit.gram`).

    Args:
        model_or_checkpoints: a Keras model, or a list of models or of
            ``.keras`` files (the checkpoints).
        train: ``(x, y)`` (or ``(x, y, sample_weight)``) arrays, or a
            dataset of such batches: the training examples.
        test: the test examples, as ``train``.
        layer: the targets, as :func:`jacobkit.jacobian` takes them (default:
            every trainable variable).
        loss: the per-example loss: a :class:`jacobkit.Loss`, a Keras loss
            with ``reduction=None``, or ``fn(y_true, y_pred) -> (B,)``.
        learning_rates: one per checkpoint (default: 1 each).
        top_k: keep each test example's ``k`` strongest proponents and
            opponents only (:attr:`InfluenceResult.top`).
        memory_budget: bytes (or ``"2GiB"``) for each Gram call's chunks.
        chunk_examples: examples per chunk (default: sized by the budget).
        progress: progress bars of the Gram calls over their chunks (shown
            after a second, where stderr is a terminal).
        distribute: a ``tf.distribute.MirroredStrategy``: each chunk's
            examples split across its replicas (:func:`jacobkit.gram`).

    Returns:
        :class:`InfluenceResult`, scores ``(N_test, N_train)``.
    """
    return _scored(
        "tracin",
        model_or_checkpoints,
        train,
        test,
        layer,
        loss,
        learning_rates,
        top_k,
        _GramOptions(memory_budget, chunk_examples, distribute),
        progress,
        normalized=False,
    )


def grad_cos(
    model_or_checkpoints: Any,
    train: Any,
    test: Any,
    layer: Any = None,
    *,
    loss: Any,
    learning_rates: Sequence[float] | None = None,
    top_k: int | None = None,
    memory_budget: int | float | str | None = None,
    chunk_examples: int | None = None,
    progress: bool | None = None,
    distribute: tf.distribute.Strategy | None = None,
) -> InfluenceResult:
    """Grad-Cos: TracIn of unit gradients, ``sum_c lr_c cos(∇L(test_i),
    ∇L(train_j))`` at each checkpoint (the norms from the Gram's own features,
    ``jk.gram(norms=True)``: no second pass over either set).
    Arguments as :func:`tracin`; a zero gradient's cosines are 0."""
    return _scored(
        "grad_cos",
        model_or_checkpoints,
        train,
        test,
        layer,
        loss,
        learning_rates,
        top_k,
        _GramOptions(memory_budget, chunk_examples, distribute),
        progress,
        normalized=True,
    )


def self_influence(
    model_or_checkpoints: Any,
    train: Any,
    layer: Any = None,
    *,
    loss: Any,
    learning_rates: Sequence[float] | None = None,
    memory_budget: int | float | str | None = None,
    distribute: tf.distribute.Strategy | None = None,
) -> np.ndarray:
    """Each training example's ``sum_c lr_c |∇L(train_j; θ_c)|²``, ``(N,)``:
    large for examples the model finds hard, mislabelled ones first. From
    per-layer ghost norms where the layers have closed forms (nothing the
    size of a gradient is formed). ``distribute=``: a
    ``tf.distribute.Strategy``, as :func:`jacobkit.jacobian` takes it."""
    models = checkpoints(model_or_checkpoints, "self_influence")
    rates = _rates(learning_rates, len(models), "self_influence")
    # read once per checkpoint: each pass must give the same examples
    train = passes.checked(train, "self_influence(train=...)")
    total = None
    for model, rate in zip(models, rates, strict=True):
        found = rate * squared_norms(
            model,
            train,
            layer,
            as_loss(loss, "self_influence"),
            memory_budget,
            distribute,
        )
        total = found if total is None else total + found
    assert total is not None, "at least one checkpoint"
    return total


def squared_norms(
    model: Any,
    data: Any,
    layer: Any,
    loss: Loss,
    memory_budget: Any,
    distribute: Any = None,
) -> np.ndarray:
    """Each example's squared gradient norm over every target, ``(N,)``."""
    result = api.jacobian(
        model,
        data,
        _layer(model, layer),
        outputs=loss,
        reduce="norm",
        memory_budget=memory_budget,
        distribute=distribute,
        progress=False,
    )
    norms = [np.asarray(v, np.float64) for v in result.jacobians.values()]
    found: np.ndarray = np.sum(np.square(norms), axis=0)
    return found


def checkpoints(model_or_checkpoints: Any, call: str = "tracin") -> list[Any]:
    """The models to sum over: one model, or each of a list (``.keras``
    files loaded with ``keras.saving.load_model``); ``call``: the explain
    function, for its messages."""
    items = (
        list(model_or_checkpoints)
        if isinstance(model_or_checkpoints, (list, tuple))
        else [model_or_checkpoints]
    )
    if not items:
        raise ValueError(
            f"explain.{call}(model_or_checkpoints=[]): pass a model or checkpoints."
        )
    found = []
    for item in items:
        if isinstance(item, (str, bytes)) or hasattr(item, "__fspath__"):
            import keras

            found.append(keras.saving.load_model(item, compile=False))
        elif callable(item):
            found.append(item)
        else:
            raise TypeError(
                f"explain.{call}(model_or_checkpoints=...): "
                f"{type(item).__name__} is neither a model "
                "nor a path to a saved .keras model."
            )
    return found


def as_loss(loss: Any, call: str = "tracin") -> Loss:
    """``loss=`` as a :class:`jacobkit.Loss` (a Loss, a Keras loss or a
    function ``(y_true, y_pred) -> (B,)``)."""
    if isinstance(loss, Loss):
        return loss
    if loss is None or not callable(loss):
        raise TypeError(
            f"explain.{call}(loss={loss!r}): pass the per-example loss, e.g. "
            "keras.losses."
            "SparseCategoricalCrossentropy(from_logits=True, reduction=None)."
        )
    return Loss(loss)


def _rates(
    learning_rates: Sequence[float] | None, count: int, call: str
) -> list[float]:
    if learning_rates is None:
        return [1.0] * count
    rates = [float(r) for r in learning_rates]
    if len(rates) != count:
        raise ValueError(
            f"explain.{call}(learning_rates=...): {len(rates)} rates for {count} "
            "checkpoints; pass "
            "one per checkpoint."
        )
    return rates


def _layer(model: Any, layer: Any) -> Any:
    return model.trainable_variables if layer is None else layer


@dataclass(frozen=True)
class _GramOptions:
    """What :func:`tracin` and :func:`grad_cos` pass on to each
    :func:`jacobkit.gram` call."""

    memory_budget: int | float | str | None
    chunk_examples: int | None
    distribute: tf.distribute.Strategy | None


def _scored(
    method: str,
    model_or_checkpoints: Any,
    train: Any,
    test: Any,
    layer: Any,
    loss: Any,
    learning_rates: Sequence[float] | None,
    top_k: int | None,
    options: _GramOptions,
    progress: bool | None,
    *,
    normalized: bool,
) -> InfluenceResult:
    start = time.perf_counter()
    loss = as_loss(loss, method)
    models = checkpoints(model_or_checkpoints, method)
    rates = _rates(learning_rates, len(models), method)
    k = top.check_top_k(top_k, method)
    merged = top.Merged(k)
    # both sets are read once per checkpoint (and test once per part of
    # train): every pass must give the same examples in the same order
    train = top.streamed(passes.checked(train, f"{method}(train=...)"), k)
    test = passes.checked(test, f"{method}(test=...)")
    for model, rate in zip(models, rates, strict=True):
        targets = _layer(model, layer)
        offset = 0
        for part in top.parts(train, k):
            result = gram(
                model,
                test,
                part,
                targets,
                outputs=loss,
                progress=progress is not False,
                memory_budget=options.memory_budget,
                chunk_examples=options.chunk_examples,
                distribute=options.distribute,
                norms=normalized,
            )
            found = result.matrix
            if normalized:
                # the cosines, from the norms of the Gram's own features
                assert result.norms_a is not None and result.norms_b is not None
                found = (
                    found
                    * _inverse(result.norms_a)[:, None]
                    * _inverse(result.norms_b)[None, :]
                )
            merged.add(offset, found if rate == 1.0 else rate * found)
            offset += found.shape[1]
    return InfluenceResult(
        method,
        merged.scores(),
        merged.top(),
        len(models),
        time.perf_counter() - start,
    )


def _inverse(norms: np.ndarray) -> np.ndarray:
    found: np.ndarray = np.divide(1.0, norms, out=np.zeros_like(norms), where=norms > 0)
    return found
