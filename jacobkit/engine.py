"""Run a strategy, ``auto`` included, on one resolved Problem and wrap the
result.

:func:`jacobkit.jacobian` (one batch) and the batch loop
(:mod:`jacobkit.batches`) both come here once they hold a
:class:`~jacobkit.problem.Problem`: :func:`run` runs what was chosen (a
:class:`~jacobkit.problem.solution.Solver`: a configured strategy or a
:class:`~jacobkit.planner.Auto`) by the one path every solver takes,
``solve(problem)`` -> :class:`~jacobkit.problem.solution.Solution`, and wraps
the flat ``(R, *v.shape)`` Jacobians into a
:class:`~jacobkit.result.JacobianResult`.
"""

from __future__ import annotations

import contextlib
from dataclasses import replace

import tensorflow as tf

from jacobkit import memory, planner, runtime, strategies
from jacobkit.keras import state
from jacobkit.problem import Call, Problem
from jacobkit.problem.solution import Solution, Solver
from jacobkit.result import JacobianResult


def device_scope(device: str | None) -> contextlib.AbstractContextManager:
    """``tf.device(device)`` for a device TensorFlow has; a clear error if not."""
    name = checked_device(device)
    return contextlib.nullcontext() if name is None else tf.device(name)


def checked_device(device: str | None) -> str | None:
    """``device`` as TensorFlow names it (``"GPU:0"``), or ``None``; a clear
    error where it is not a device name or not a device TensorFlow has."""
    if device is None:
        return None
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
    return name


def run(problem: Problem, chosen: Solver[strategies.Strategy]) -> JacobianResult:
    """One call's Jacobians: ``chosen`` solves ``problem`` (TensorFlow's
    warnings about its own internals, such as pfor's "uses a while_loop" or
    the retracing of ``auto``'s candidates, are not for the user: hidden
    while jacobkit works, see :mod:`jacobkit.runtime`), then the result is
    shaped and named.

    The call is one draw of the model's randomness and state
    (:mod:`jacobkit.keras.state`): its passes leave the model's variables
    as they were; with ``training=True``, what the last one assigned
    (dropout's seed state, batch normalization's moving statistics) is
    assigned once, here, as one ``model(x, training=True)`` would."""
    if not problem.training:  # nothing assigned, nothing to keep
        with runtime.tensorflow_warnings():
            return wrap(problem, chosen.solve(problem))
    draw = state.Draw()
    with runtime.tensorflow_warnings(), draw:
        solution = chosen.solve(problem)
    draw.apply()
    return wrap(problem, solution)


def chosen(call: Call) -> Solver[strategies.Strategy]:
    """What computes ``call``'s rows: its strategy, or ``auto`` with the
    defaults where it names none."""
    if call.strategy is not None:
        return call.strategy
    return planner.Auto(device=call.device)


def wrap(problem: Problem, solution: Solution[strategies.Strategy]) -> JacobianResult:
    """The strategy's flat ``(R, *v.shape)`` Jacobians, shaped and named."""
    kind = problem.reduction
    jacobians = {
        name: kind.shaped(problem, value, target)
        for name, value, target in zip(
            problem.target_names, solution.output.values, problem.targets
        )
    }
    strategy = solution.strategy
    return JacobianResult(
        jacobians=jacobians,
        rows_shape=problem.rows_shape,
        strategy=strategy.name,
        chunk_size=strategy.chunk_size,
        stats=solution.stats,
        roles=target_roles(problem),
        plan=solution.plan,
        strategy_config=strategy,
        reduce=problem.reduce,
        norms=_shaped_norms(solution.output.norms, problem.rows_shape),
    )


def _shaped_norms(
    norms: tf.Tensor | None, rows_shape: tuple[int, ...]
) -> tf.Tensor | None:
    """Each row's gradient norm in the rows' shape, ``rows_shape``: the
    tensor itself where it already has it (an eager reshape per call was
    0.1-0.5 ms of a steady clipped-sum call's Python side)."""
    if norms is None or tuple(norms.shape) == tuple(rows_shape):
        return norms
    return tf.reshape(norms, rows_shape)


def trimmed(result: JacobianResult, size: int) -> JacobianResult:
    """A padded batch's result (:mod:`jacobkit.problem.padding`) with the
    rows of its first ``size`` examples only: the norms and the rows' shape
    (the clipped sum has none of the padding's)."""
    if result.rows_shape[0] == size:
        return result
    norms = None if result.norms is None else result.norms[:size]
    return replace(result, norms=norms, rows_shape=(size, *result.rows_shape[1:]))


def target_roles(problem: Problem) -> dict[str, str]:
    """Each role (``"kernel"``, ``"bias"``) -> the name of its target."""
    return {
        role: problem.target_names[i] for role, i in problem.roles.by_name().items()
    }
