"""``jacobian()`` and ``plan()``: the arguments become one
:class:`~jacobkit.problem.Call` (checked), then one batch goes to
:mod:`jacobkit.engine` and many to :mod:`jacobkit.batches`."""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any

import tensorflow as tf

from jacobkit import engine, planner, runtime, strategies
from jacobkit.batches import collect
from jacobkit.problem import Call, arguments, padding
from jacobkit.problem.loss import Loss
from jacobkit.problem.reduction import ClippedSum, Project
from jacobkit.result import JacobianResult


def jacobian(
    model: Any,
    inputs: Any,
    layer: Any,
    *,
    strategy: str | strategies.Strategy | planner.Auto = "auto",
    outputs: str | Callable[[Any], tf.Tensor] | Loss = "features",
    features: Sequence[int] | None = None,
    training: bool = False,
    unconnected: str = "error",
    memory_budget: int | float | str | None = None,
    device: str | None = None,
    output: int | str | None = None,
    reduce: str | ClippedSum | Project | None = None,
    steps: int | None = None,
    out: str | os.PathLike[str] | None = None,
    overwrite: bool = False,
    progress: bool = True,
    distribute: tf.distribute.Strategy | None = None,
    cache: bool = True,
) -> JacobianResult:
    """Per-row Jacobians of a model's output with respect to a layer's variables.

    Args:
        model: a Keras 3 or ``tf_keras`` model, or any callable
            ``f(inputs) -> tf.Tensor`` that reads ``tf.Variable`` objects (a
            ``tf.Module``).
        inputs: a NumPy array or ``tf.Tensor``, or the tuple/dict a
            multi-input model takes. The output ``Y`` has shape ``(B, ..., F)``.
            Or many batches: a ``tf.data.Dataset`` of batches (of ``(x, y)``
            or ``(x, y, w)`` tuples: ``x`` is used) or any other iterable of
            batches (a generator, ``jacobkit.data.batches(x, 64)``; a list
            or tuple is one batch of a multi-input model: pass
            ``iter(list_of_batches)``); then
            ``"features"`` rows are summed over the dataset and
            ``"per_example"`` rows follow in dataset order (:mod:`jacobkit.batches`).
        layer: a layer object, a layer name, or a list of variables
            (``tf.Variable`` or ``keras.Variable``).
        strategy: ``"auto"``, a registered name (``"loop"``, ``"jacobian"``,
            ``"while"``, ``"batch"``, ``"chunked"``, ``"forward"``) or a
            configured instance (``jacobkit.strategies.Chunked(chunk_size=8)``,
            ``jacobkit.planner.Auto(memory_budget="1GiB")``).
        outputs: what a row is: ``"features"`` (row ``f`` = sum of
            ``Y[..., f]``, rows shape ``(F,)``), ``"per_example"`` (rows
            ``(B, F)``), ``"full"`` (rows ``Y.shape``) or a callable ``g(Y)``
            whose every element is a row.
        features: keep only these indices of ``Y``'s last axis.
        training: passed to Keras models (``False``: inference behaviour).
        unconnected: ``"error"`` raises if a target does not influence the
            rows; ``"zero"`` returns zeros for it.
        memory_budget: for ``strategy="auto"``: bytes, a string like
            ``"2GiB"``, or a fraction of free device memory. Default: see
            :func:`jacobkit.plan`.
        device: run on this device (``"CPU:0"``, ``"GPU:0"``); default: TF's
            placement.
        output: for a model with several outputs (a list, tuple or dict),
            the index or name of the one to differentiate
            (``output="logits"``); rows are formed from it as from a
            single-output model.
        reduce: ``"norm"`` returns, per target, the L2 norm of every row's
            Jacobian (shape ``rows_shape``) without holding more than one
            chunk of rows' Jacobians (strategies ``chunked`` and ``batch``;
            ``auto`` picks batch where it applies). Default: the Jacobians.
        steps: take at most this many batches of a dataset (needed for an
            infinite one).
        out: a directory: write the Jacobians there as ``.npy`` files with a
            manifest, batch by batch (:mod:`jacobkit.batches.store`); the result then
            holds read-only ``numpy.memmap`` arrays. The same call after an
            interruption continues where it stopped.
        overwrite: with ``out=``, discard what the directory holds.
        progress: show a progress bar over the batches (quiet anyway when
            the output is not a terminal, or under pytest).
        distribute: a ``tf.distribute.Strategy`` (``MirroredStrategy``,
            ``MultiWorkerMirroredStrategy``): the batches are split across
            its replicas (:mod:`jacobkit.batches.distribute`).
        cache: for ``strategy="auto"``: read and write the plan cache on disk
            (``$JACOBKIT_CACHE_DIR``, default ``~/.cache/jacobkit``; see
            :mod:`jacobkit.planner.cache`). ``False`` plans in memory only.

    Returns:
        A :class:`JacobianResult`; for a layer target ``result.kernel`` has
        shape ``rows_shape + kernel.shape`` (``(F, *kernel.shape)`` by
        default) and ``result.bias`` shape ``rows_shape + bias.shape``.

    Example:
        >>> import keras, numpy as np, jacobkit as jk
        >>> model = keras.Sequential([keras.Input((4,)),
        ...                           keras.layers.Dense(3, name="head")])
        >>> res = jk.jacobian(model, np.ones((2, 4), "float32"), "head")
        >>> tuple(res.kernel.shape), tuple(res.bias.shape)
        ((3, 4, 3), (3, 3))
    """
    start = time.perf_counter()
    engine.checked_device(device)
    call = Call(
        model,
        layer,
        outputs=outputs,
        features=features,
        training=training,
        unconnected=unconnected,
        output=output,
        reduce=reduce,
        strategy=planner.solver(strategy, memory_budget, device, cache),
        device=device,
        steps=steps,
        out=out,
        overwrite=overwrite,
        progress=progress,
        distribute=distribute,
    )
    return _run(call, inputs, start)


def _run(call: Call, inputs: Any, start: float) -> JacobianResult:
    """``call`` on ``inputs``: many batches (a dataset, ``out=``,
    ``distribute=``) by :mod:`jacobkit.batches`; one batch of arrays here,
    its ``stats.total_time_s`` counted from ``start`` (when
    :func:`jacobian` was called)."""
    many = call.out is not None or call.distribute is not None
    if many or arguments.is_batches(inputs):
        with runtime.tensorflow_warnings():
            return collect.jacobian_batches(call, inputs)
    with engine.device_scope(call.device), runtime.tensorflow_warnings():
        result = _one_batch(call, inputs)
    total = time.perf_counter() - start
    return replace(result, stats=replace(result.stats, total_time_s=total))


def _one_batch(call: Call, inputs: Any) -> JacobianResult:
    """``call`` on one batch of arrays (padded where the clipped sum asks,
    :meth:`Call.padded`)."""
    batch, examples = call.padded(inputs)
    problem = call.problem(batch)
    if examples is not None:  # padded: the loss must not see the batch size
        padding.check_batch_size(problem, examples)
    arguments.warn_non_finite(problem.inputs)
    result = engine.run(problem, engine.chosen(call))
    return result if examples is None else engine.trimmed(result, examples)


def plan(
    model: Any,
    inputs: Any,
    layer: Any,
    *,
    memory_budget: int | float | str | None = None,
    outputs: str | Callable[[Any], tf.Tensor] | Loss = "features",
    features: Sequence[int] | None = None,
    training: bool = False,
    unconnected: str = "error",
    device: str | None = None,
    output: int | str | None = None,
    cache: bool = True,
) -> planner.Plan[strategies.Strategy]:
    """What ``jacobian(..., strategy="auto")`` runs next, without running it.

    Nothing is computed: before the first call the :class:`Plan` names the
    strategy ``auto`` starts on (the one cheapest to trace that is predicted
    to fit) and its predicted peak; after calls (in this process, or in an
    earlier one through the disk cache) it gives what they measured: time
    per call, tracing time and peak of each strategy that ran, the switches
    and why, the candidates still to try, and each rejected one with the
    reason. Arguments are those of :func:`jacobian`.
    """
    call = Call(
        model,
        layer,
        outputs=outputs,
        features=features,
        training=training,
        unconnected=unconnected,
        output=output,
    )
    engine.checked_device(device)
    auto = planner.Auto(memory_budget, device, cache)
    with engine.device_scope(device), runtime.tensorflow_warnings():
        return auto.plan(call.problem(inputs))
