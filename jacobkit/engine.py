"""Run a strategy, or ``auto``, on one resolved Problem and wrap the result.

:func:`jacobkit.jacobian` (one batch) and the batch loop
(:mod:`jacobkit.batches`) both come here once they hold a
:class:`~jacobkit.problem.Problem`: :func:`run` picks what runs (a configured
strategy, ``auto`` for norms, or ``auto``'s planning session) and
:func:`run_strategy` / :func:`run_auto` run it and wrap the strategy's flat
``(R, *v.shape)`` Jacobians into a :class:`~jacobkit.result.JacobianResult`.
"""

from __future__ import annotations

import contextlib
import time
import weakref
from dataclasses import replace
from typing import Any

import tensorflow as tf

from jacobkit import memory, planner, runtime, strategies
from jacobkit.problem import Problem, per_model
from jacobkit.result import JacobianResult


def device_scope(device: str | None) -> contextlib.AbstractContextManager:
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


def run(
    problem: Problem,
    chosen: strategies.Strategy | None,
    *,
    memory_budget: int | float | str | None = None,
    device: str | None = None,
    cache: bool = True,
) -> JacobianResult:
    """One call's Jacobians: the ``chosen`` strategy, or (``None``) ``auto``:
    for ``reduce="norm"`` the strategy :func:`norm_strategy` picks, else
    :func:`run_auto`'s planning session."""
    if chosen is None and problem.reduce is not None:
        chosen = norm_strategy(problem, memory_budget)
    if chosen is not None:
        return run_strategy(problem, chosen)
    return run_auto(problem, memory_budget=memory_budget, device=device, cache=cache)


#: model -> {problem key: the strategy auto runs for reduce="norm"}
_NORM_STRATEGY: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def norm_strategy(problem: Problem, memory_budget: Any) -> strategies.Strategy:
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


def run_strategy(problem: Problem, strategy: strategies.Strategy) -> JacobianResult:
    """Run one configured strategy on a resolved problem and wrap the result."""
    with runtime.tensorflow_warnings():
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
    # not for the user: hidden while jacobkit works (see jacobkit.runtime)
    with runtime.tensorflow_warnings():
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
    return JacobianResult(
        jacobians=jacobians,
        rows_shape=problem.rows_shape,
        strategy=strategy.name,
        chunk_size=strategy.chunk_size,
        stats=stats,
        roles=target_roles(problem),
        plan=plan,
        strategy_config=strategy,
        reduce=problem.reduce,
    )


def target_roles(problem: Problem) -> dict[str, str]:
    """Each role (``"kernel"``, ``"bias"``) -> the name of its target."""
    return {
        role: problem.target_names[i] for role, i in problem.roles.by_name().items()
    }
