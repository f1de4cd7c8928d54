"""``jacobian()``: validate, build the Problem, plan, run the strategy, wrap."""

from __future__ import annotations

import contextlib
import os
import time
import weakref
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any

import tensorflow as tf

from jacobkit import data, memory, planner, quiet, strategies
from jacobkit.problem import Problem, per_model
from jacobkit.result import JacobianResult


def jacobian(
    model: Any,
    inputs: Any,
    layer: Any,
    *,
    strategy: str | strategies.Strategy = "auto",
    outputs: str | Callable[[Any], tf.Tensor] = "features",
    features: Sequence[int] | None = None,
    training: bool = False,
    unconnected: str = "error",
    memory_budget: int | float | str | None = None,
    device: str | None = None,
    output: int | str | None = None,
    reduce: str | None = None,
    steps: int | None = None,
    out: str | os.PathLike | None = None,
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
            ``"per_example"`` rows follow in dataset order (:mod:`jacobkit.data`).
        layer: a layer object, a layer name, or a list of variables
            (``tf.Variable`` or ``keras.Variable``).
        strategy: ``"auto"``, a registered name (``"loop"``, ``"jacobian"``,
            ``"while"``, ``"batch"``, ``"chunked"``, ``"forward"``) or a
            configured instance (``jacobkit.strategies.Chunked(chunk_size=8)``).
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
            manifest, batch by batch (:mod:`jacobkit.store`); the result then
            holds read-only ``numpy.memmap`` arrays. The same call after an
            interruption continues where it stopped.
        overwrite: with ``out=``, discard what the directory holds.
        progress: show a progress bar over the batches (quiet anyway when
            the output is not a terminal, or under pytest).
        distribute: a ``tf.distribute.Strategy`` (``MirroredStrategy``,
            ``MultiWorkerMirroredStrategy``): the batches are split across
            its replicas (:mod:`jacobkit.distribute`).
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
    chosen = None if strategy == "auto" else strategies.get(strategy)
    if chosen is not None and memory_budget is not None:
        raise ValueError(
            f"jacobian(memory_budget={memory_budget!r}, strategy={strategy!r}): "
            "a memory budget is planned for by strategy='auto' only. Drop "
            "strategy= to let auto fit the budget, or drop memory_budget= and "
            "size the strategy yourself (e.g. Chunked(chunk_size=8))."
        )
    if out is not None or distribute is not None or data.is_batches(inputs):
        with quiet.tensorflow_warnings():
            return data.jacobian_batches(
                model,
                inputs,
                layer,
                strategy=strategy,
                outputs=outputs,
                features=features,
                training=training,
                unconnected=unconnected,
                memory_budget=memory_budget,
                device=device,
                steps=steps,
                out=out,
                overwrite=overwrite,
                progress=progress,
                distribute=distribute,
                cache=cache,
                output=output,
                reduce=reduce,
            )
    with _device_scope(device), quiet.tensorflow_warnings():
        problem = Problem(
            model,
            inputs,
            layer,
            outputs=outputs,
            features=features,
            training=training,
            unconnected=unconnected,
            output=output,
            reduce=reduce,
        )
        data.warn_non_finite(problem.inputs)
        if chosen is None and problem.reduce is not None:
            chosen = _norm_strategy(problem, memory_budget)
        if chosen is not None:
            result = run_strategy(problem, chosen)
        else:
            result = run_auto(
                problem, memory_budget=memory_budget, device=device, cache=cache
            )
    stats = replace(result.stats, total_time_s=time.perf_counter() - start)
    return replace(result, stats=stats)


def plan(
    model: Any,
    inputs: Any,
    layer: Any,
    *,
    memory_budget: int | float | str | None = None,
    outputs: str | Callable[[Any], tf.Tensor] = "features",
    features: Sequence[int] | None = None,
    training: bool = False,
    unconnected: str = "error",
    device: str | None = None,
    output: int | str | None = None,
    cache: bool = True,
) -> planner.Plan:
    """What ``jacobian(..., strategy="auto")`` runs next, without running it.

    Nothing is computed: before the first call the :class:`Plan` names the
    strategy ``auto`` starts on (the one cheapest to trace that is predicted
    to fit) and its predicted peak; after calls (in this process, or in an
    earlier one through the disk cache) it gives what they measured: time
    per call, tracing time and peak of each strategy that ran, the switches
    and why, the candidates still to try, and each rejected one with the
    reason. Arguments are those of :func:`jacobian`.
    """
    with _device_scope(device), quiet.tensorflow_warnings():
        problem = Problem(
            model,
            inputs,
            layer,
            outputs=outputs,
            features=features,
            training=training,
            unconnected=unconnected,
            output=output,
        )
        return planner.plan_problem(
            problem, memory_budget=memory_budget, device=device, cache=cache
        )


#: model -> {problem key: the strategy auto runs for reduce="norm"}
_NORM_STRATEGY: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _norm_strategy(problem: Problem, memory_budget: Any) -> strategies.Strategy:
    """``auto`` for ``reduce="norm"``: the batch strategy's closed forms where
    it applies (Dense/Conv layer targets), else ``chunked`` (16 rows held)."""
    if memory_budget is not None:
        raise ValueError(
            f"jacobian(reduce={problem.reduce!r}, memory_budget="
            f"{memory_budget!r}): norms hold one chunk of rows' Jacobians and "
            "are not planned under a budget. Drop memory_budget=, or pass "
            "strategy=Chunked(chunk_size=...) to size the chunk."
        )
    chosen = per_model(_NORM_STRATEGY, problem.model)
    if problem.key not in chosen:
        try:
            strategies.Batch().check(problem)
            chosen[problem.key] = strategies.Batch()
        except ValueError:
            chosen[problem.key] = strategies.Chunked(16)
    return chosen[problem.key]


def _device_scope(device: str | None) -> contextlib.AbstractContextManager:
    """``tf.device(device)`` for a device TensorFlow has; a clear error if not."""
    if device is None:
        return contextlib.nullcontext()
    try:
        name = memory.normalize_device(device)
    except (TypeError, ValueError) as err:
        raise ValueError(
            f"jacobian(device={device!r}): not a device name; use 'CPU:0' or "
            "'GPU:0' (or None for TensorFlow's placement)."
        ) from err
    kind, index = name.split(":")
    visible = tf.config.list_logical_devices(kind)
    if int(index) >= len(visible):
        names = [d.name.split("device:")[-1] for d in tf.config.list_logical_devices()]
        raise ValueError(
            f"jacobian(device={device!r}): TensorFlow sees no {name} here; "
            f"visible devices: {', '.join(names)}. Pass one of those, or None."
        )
    return tf.device(name)


def run_strategy(problem: Problem, strategy: strategies.Strategy) -> JacobianResult:
    """Run one configured strategy on a resolved problem and wrap the result."""
    with quiet.tensorflow_warnings():
        output = strategy.run(problem)
    return _wrap(problem, strategy, output, None)


def run_auto(
    problem: Problem,
    *,
    memory_budget: int | float | str | None = None,
    device: str | None = None,
    cache: bool = True,
) -> JacobianResult:
    """``strategy="auto"`` on a resolved problem: run it (see
    :mod:`jacobkit.planner`) and wrap; ``result.strategy`` is what later
    calls run. ``stats.planning_time_s`` is the time spent outside the
    runs that compute rows (the budget check, the activation estimate,
    the plan cache)."""
    start = time.perf_counter()
    # TensorFlow's warnings about its own internals (pfor's "Conv2DBackprop
    # Filter uses a while_loop", retracing of the candidates' functions) are
    # not for the user: hidden while jacobkit works (see jacobkit.quiet)
    with quiet.tensorflow_warnings():
        strategy, flat, stats, plan = planner.run(
            problem, memory_budget=memory_budget, device=device, cache=cache
        )
    planning = max(time.perf_counter() - start - stats.wall_time_s, 0.0)
    result = _wrap(problem, strategy, (flat, stats), plan)
    return replace(result, stats=replace(result.stats, planning_time_s=planning))


def _wrap(
    problem: Problem, strategy: strategies.Strategy, output: Any, plan: Any
) -> JacobianResult:
    """The strategy's flat ``(R, *v.shape)`` Jacobians, shaped and named."""
    flat, stats = output
    jacobians = {
        name: problem.shaped(jac, target)
        for name, jac, target in zip(problem.target_names, flat, problem.targets)
    }
    roles = {role: problem.target_names[i] for role, i in problem.roles.items()}
    return JacobianResult(
        jacobians=jacobians,
        rows_shape=problem.rows_shape,
        strategy=strategy.name,
        chunk_size=strategy.chunk_size,
        stats=stats,
        roles=roles,
        plan=plan,
        strategy_config=strategy,
        reduce=problem.reduce,
    )
