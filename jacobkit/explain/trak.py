"""TRAK (Park et al., 2023): training-data attribution from randomly
projected gradients of the model's output, as the TRAK paper and its
reference code define it.

For each checkpoint ``m`` (an ensemble of models, or checkpoints of one):

- the model output function is the margin ``f(z) = log(p / (1 - p))`` of
  the correct class's softmax probability ``p`` (from logits:
  ``logit_y - logsumexp(other logits)``);
- features: ``Φ_m = P_m ∇f(train)``, ``(N_train, dim)``, and ``φ_m =
  P_m ∇f(test)``, by ``reduce=jk.Project(dim, seed + m)`` (never forming a
  per-example gradient where the layers have closed forms);
- scores ``τ_m = φ_m (Φ_mᵀ Φ_m + λ I)⁻¹ Φ_mᵀ``, ``λ = 0`` where ``Φ_mᵀ
  Φ_m`` is invertible; where it is singular (``dim`` not below the number of
  training examples, or fewer independent gradients than ``dim``), a small
  ridge and a warning (:data:`RIDGE`);
- the out-to-loss reweighting ``Q_m = 1 - p`` per training example.

TRAK's scores are ``mean_m(τ_m) * mean_m(Q_m)``, here ``(N_test,
N_train)`` (the reference code stores their transpose). Two steps of the
reference code (TRAK 0.3.2) are left out, as the paper has neither: it
divides the gradients by ``sqrt(parameters)`` (the scores do not change by
it with ``λ = 0``; here ``ΦᵀΦ`` is formed and inverted in float64), and it
divides each model's ``(ΦᵀΦ)⁻¹`` by its mean magnitude, a float16 safeguard
that weighs the ensemble's models unequally and scales the scores (on
notebook 07's ensemble by 0.41-0.57 per model; with the same maps, the
reference code's scores then differ from the paper's formula by 1.07
relative, Spearman 0.992; ``benchmarks/peers/influence_torch.py``).

With ``out=DIR`` each checkpoint's training features and ``Q`` are written
once (``DIR/checkpoint-<m>``, by ``jacobian(out=...)``, resumable) and read
back by later calls: many test sets against one featurized training set.
"""

from __future__ import annotations

import os
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import scipy.linalg
import tensorflow as tf

from jacobkit import api, runtime
from jacobkit.explain.influence import InfluenceResult, checkpoints
from jacobkit.problem.loss import Loss
from jacobkit.problem.reduction import Project


def margin(y_true: Any, logits: Any) -> tf.Tensor:
    """TRAK's classification output function, per example: ``logit_y -
    logsumexp(logits of the other classes)`` ``= log(p / (1 - p))``."""
    logits = tf.convert_to_tensor(logits)
    labels = tf.cast(tf.reshape(y_true, (-1,)), tf.int32)
    correct = tf.gather(logits, labels, batch_dims=1)
    others = tf.where(
        tf.one_hot(labels, tf.shape(logits)[-1], on_value=True, off_value=False),
        tf.constant(-np.inf, logits.dtype),
        logits,
    )
    return correct - tf.reduce_logsumexp(others, axis=-1)


MARGIN = Loss(margin)

#: ``λ`` where ``ΦᵀΦ`` is singular and ``lambda_reg`` is not given, as a
#: fraction of the mean of ``ΦᵀΦ``'s diagonal. Its inverse is rounding noise
#: there: on scikit-learn's digits (1,200 training examples, an MLP 64-64-10
#: of 4,810 weights), ``dim=2048`` gave a top-10 same-label rate of 0.12
#: (chance: 0.10) against 0.39 at ``dim=512`` (invertible, no ridge); with
#: this ridge 0.46 (1e-8 of the diagonal: 0.24; 1e-4: 0.35; 1e-2: 0.55).
RIDGE = 1e-3


@dataclass(frozen=True)
class Features:
    """One checkpoint's featurized training set.

    Attributes:
        projected: ``Φ`` ``(N_train, dim)``.
        out_to_loss: ``Q = 1 - p`` ``(N_train,)``.
    """

    projected: np.ndarray
    out_to_loss: np.ndarray


def trak(
    model_or_checkpoints: Any,
    train: Any,
    test: Any,
    layer: Any = None,
    *,
    dim: int = 2048,
    seed: int = 0,
    lambda_reg: float | None = None,
    out: str | os.PathLike[str] | None = None,
    memory_budget: int | float | str | None = None,
    progress: bool | None = None,
    distribute: tf.distribute.Strategy | None = None,
    overwrite: bool = False,
) -> InfluenceResult:
    """TRAK scores ``(N_test, N_train)`` (see the module docstring).

    Args:
        model_or_checkpoints: a Keras classifier returning logits ``(B,
            classes)``, or a list of them (or of ``.keras`` files): the
            ensemble.
        train: ``(x, y)`` arrays with integer labels, or a dataset of such
            batches: the training examples.
        test: the test examples, as ``train``.
        layer: the targets (default: every trainable variable).
        dim: the projection's size per checkpoint (TRAK's default 2,048).
        seed: checkpoint ``m``'s map is ``jk.Project(dim, seed + m)``.
        lambda_reg: ``λ`` added to ``ΦᵀΦ``'s diagonal. ``None`` (default):
            0 where ``ΦᵀΦ`` is invertible (TRAK's formula), else
            :data:`RIDGE` times the mean of its diagonal, with a
            ``UserWarning``: ``ΦᵀΦ`` is singular where ``dim`` is not below
            the number of training examples (its rank is at most that
            number) or the gradients span fewer than ``dim`` directions.
            An explicit ``λ`` is used as given (warned where the matrix is
            still singular).
        out: a directory for the training features (written once, reused).
        memory_budget: for each featurizing call.
        progress: progress bars of the featurizing calls (default: a
            terminal).
        distribute: a ``tf.distribute.Strategy`` for each featurizing call,
            as :func:`jacobkit.jacobian` takes it.
        overwrite: with ``out=``, discard the training features written
            there and compute them afresh.

    Returns:
        :class:`~jacobkit.explain.influence.InfluenceResult` ``"trak"``.
    """
    start = time.perf_counter()
    models = checkpoints(model_or_checkpoints, "trak")
    _check_labels("train", train)
    _check_labels("test", test)
    scores = None
    out_to_loss = None
    singular: list[str] = []
    for m, model in enumerate(models):
        _check_classes(model, m)
        project = Project(dim, seed + m)
        where = None if out is None else Path(out) / f"checkpoint-{m}"
        train_features = featurize(
            model,
            train,
            layer,
            project,
            where,
            memory_budget,
            progress,
            distribute,
            overwrite,
        )
        test_projected = _projected(
            model, test, layer, project, None, memory_budget, progress, distribute
        )
        phi = train_features.projected
        solved, ridge = _solved(phi, lambda_reg)
        if ridge is not None:
            singular.append(f"{m} (λ = {ridge:.2g})")
        tau = test_projected @ solved
        scores = tau if scores is None else scores + tau
        q = train_features.out_to_loss
        out_to_loss = q if out_to_loss is None else out_to_loss + q
    assert scores is not None and out_to_loss is not None, "at least one model"
    if singular:
        _warn_singular(singular, dim, len(out_to_loss), lambda_reg)
    count = len(models)
    final = (scores / count) * (out_to_loss / count)[None, :]
    return InfluenceResult("trak", final, None, count, time.perf_counter() - start)


def _solved(phi: np.ndarray, lambda_reg: float | None) -> tuple[np.ndarray, Any]:
    """``(ΦᵀΦ + λ I)⁻¹ Φᵀ`` in float64, and the ``λ`` where ``ΦᵀΦ + λ I`` was
    singular (``None`` where it was not): :data:`RIDGE` of its mean diagonal
    where ``lambda_reg`` is ``None``, else ``lambda_reg``, solved as given
    (warned by the caller)."""
    kernel = phi.T @ phi
    identity = np.eye(kernel.shape[0])
    given = 0.0 if lambda_reg is None else lambda_reg
    factor = _cholesky(kernel + given * identity)
    if factor is not None:
        return scipy.linalg.cho_solve(factor, phi.T, check_finite=False), None
    if lambda_reg is not None:
        regularized = kernel + lambda_reg * identity
        try:
            return np.linalg.solve(regularized, phi.T), lambda_reg
        except np.linalg.LinAlgError:
            # exactly singular (a zero column of Φ: a CountSketch's bucket
            # that no coordinate of a small target falls in, where dim
            # exceeds its size): the least-norm solution, warned as noise
            found = np.linalg.lstsq(regularized, phi.T, rcond=None)[0]
            return found, lambda_reg
    ridge = RIDGE * (float(np.mean(np.diag(kernel))) or 1.0)
    factor = _cholesky(kernel + ridge * identity)
    assert factor is not None, "a ridge of 1e-3 of the diagonal is invertible"
    return scipy.linalg.cho_solve(factor, phi.T, check_finite=False), ridge


def _cholesky(kernel: np.ndarray) -> Any:
    """``kernel``'s Cholesky factor (``scipy.linalg.cho_factor``), or ``None``
    where it is singular in float64: a pivot at rounding level (``dim`` ε of
    the largest diagonal entry), or none at all."""
    try:
        factor = scipy.linalg.cho_factor(kernel, lower=True, check_finite=False)
    except np.linalg.LinAlgError:
        return None
    pivots = np.diag(factor[0]) ** 2
    rounding = kernel.shape[0] * np.finfo(np.float64).eps * np.max(np.diag(kernel))
    return None if np.min(pivots) <= rounding else factor


def _warn_singular(
    checkpoints: list[str], dim: int, examples: int, lambda_reg: float | None
) -> None:
    why = (
        f"dim={dim} is not below the {examples} training examples (its rank is "
        f"at most {examples})"
        if dim >= examples
        else f"the training gradients span fewer than dim={dim} directions"
    )
    if lambda_reg is None:
        done = (
            f"A ridge of {RIDGE:g} of its mean diagonal was added; pass a dim "
            "below the number of training examples for TRAK's formula "
            "without one, or lambda_reg= to choose it."
        )
    else:
        done = (
            f"lambda_reg={lambda_reg} leaves it singular: the scores may be "
            "noise. Pass lambda_reg=None (a ridge of "
            f"{RIDGE:g} of the mean diagonal) or a larger one."
        )
    warnings.warn(
        f"explain.trak: ΦᵀΦ is singular at checkpoint(s) {', '.join(checkpoints)}: "
        f"{why}, so its inverse would be rounding noise. {done}",
        UserWarning,
        stacklevel=runtime.caller_stacklevel(),
    )


def featurize(
    model: Any,
    train: Any,
    layer: Any,
    project: Project,
    out: Path | None,
    memory_budget: Any = None,
    progress: bool | None = None,
    distribute: Any = None,
    overwrite: bool = False,
) -> Features:
    """One checkpoint's training features (read from ``out`` where they
    were written, else computed, and written there; ``overwrite``: computed
    afresh)."""
    projected = _projected(
        model,
        train,
        layer,
        project,
        out,
        memory_budget,
        progress,
        distribute,
        overwrite,
    )
    stored = None if out is None else out / "out_to_loss.npy"
    if stored is not None and stored.exists() and not overwrite:
        q = np.load(stored)
    else:
        q = _out_to_loss(model, train)
        if stored is not None:
            np.save(stored, q)
    return Features(projected, q)


def _projected(
    model: Any,
    data: Any,
    layer: Any,
    project: Project,
    out: Path | None,
    memory_budget: Any,
    progress: bool | None,
    distribute: Any = None,
    overwrite: bool = False,
) -> np.ndarray:
    targets = model.trainable_variables if layer is None else layer
    result = api.jacobian(
        model,
        data,
        targets,
        outputs=MARGIN,
        reduce=project,
        memory_budget=memory_budget,
        out=out,
        progress=bool(progress),
        distribute=distribute,
        overwrite=overwrite,
    )
    return np.asarray(result.projection, np.float64)


def _out_to_loss(model: Any, data: Any) -> np.ndarray:
    """``1 - p`` of each example's label, in data order."""
    batches = data if isinstance(data, tf.data.Dataset) else [tuple(data)]
    found = []
    for batch in batches:
        x, y = batch[0], batch[1]
        probabilities = tf.nn.softmax(tf.cast(model(x, training=False), tf.float64))
        labels = tf.cast(tf.reshape(y, (-1,)), tf.int32)
        found.append(1.0 - tf.gather(probabilities, labels, batch_dims=1).numpy())
    return np.concatenate(found)


def _check_labels(name: str, data: Any) -> None:
    """Refuse labels that are not one class index per example (one-hot
    labels, ``(B, classes)``): TRAK's margin reads the correct class's logit."""
    if isinstance(data, tf.data.Dataset):
        spec = data.element_spec
        if not isinstance(spec, tuple) or len(spec) < 2:
            raise ValueError(
                f"explain.trak({name}=...): expected a dataset of (x, y) batches, "
                f"got elements {spec}."
            )
        shape, dtype = tuple(spec[1].shape), spec[1].dtype
    elif isinstance(data, (tuple, list)) and len(data) in (2, 3):
        labels = np.asarray(data[1])
        shape, dtype = labels.shape, tf.as_dtype(labels.dtype)
    else:
        raise ValueError(
            f"explain.trak({name}=...): expected (x, y) arrays with integer "
            f"labels, or a dataset of such batches; got {type(data).__name__}."
        )
    if (
        len(shape) > 1
        and shape[-1] not in (1, None)
        or not (dtype.is_integer or dtype.is_floating)
    ):
        raise ValueError(
            f"explain.trak({name}=...): labels of shape {shape} ({dtype.name}); "
            "expected one integer class index per example, shape (B,). For "
            "one-hot labels pass (x, np.argmax(y, axis=-1))."
        )


def _check_classes(model: Any, index: int) -> None:
    """Refuse a model of fewer than two outputs: the margin ``log(p / (1 -
    p))`` of a single logit's softmax is infinite."""
    shape = getattr(model, "output_shape", None)
    if isinstance(shape, tuple) and shape and shape[-1] is not None and shape[-1] < 2:
        raise ValueError(
            f"explain.trak(model_or_checkpoints=...): checkpoint {index}'s output "
            f"has shape {shape}; TRAK's margin needs logits over two or more "
            "classes, (B, classes). For a binary classifier with one logit z, "
            "output the logits [0, z]."
        )
