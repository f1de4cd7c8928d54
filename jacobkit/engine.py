"""Run a strategy, ``auto`` included, on one resolved Problem and wrap the
result.

:func:`jacobkit.jacobian` (one batch) and the batch loop
(:mod:`jacobkit.batches`) both come here once they hold a
:class:`~jacobkit.problem.Problem`: :func:`run` runs what was chosen (a
configured strategy or a :class:`~jacobkit.planner.Auto`) by the one path
every strategy takes, ``solve(problem)`` -> :class:`~jacobkit.strategies.Solution`,
and wraps the flat ``(R, *v.shape)`` Jacobians into a
:class:`~jacobkit.result.JacobianResult`.
"""

from __future__ import annotations

import contextlib

import tensorflow as tf

from jacobkit import memory, planner, runtime, strategies
from jacobkit.keras import state
from jacobkit.problem import Call, Problem, tensor_targets
from jacobkit.problem.reduce import ClippedSum, Project
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


def run(problem: Problem, chosen: strategies.Strategy | planner.Auto) -> JacobianResult:
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
    planner.check_one_draw(problem, chosen)
    if not problem.training:  # nothing assigned, nothing to keep
        with runtime.tensorflow_warnings():
            return wrap(problem, chosen.solve(problem))
    draw = state.Draw()
    with runtime.tensorflow_warnings(), draw:
        solution = chosen.solve(problem)
    draw.apply()
    return wrap(problem, solution)


def chosen(call: Call) -> strategies.Strategy | planner.Auto:
    """What computes ``call``'s rows: its strategy, or ``auto`` with the
    defaults where it names none."""
    if call.strategy is not None:
        return call.strategy
    return planner.Auto(device=call.device)


def planned(
    chosen: strategies.Strategy | planner.Auto, problem: Problem
) -> strategies.Strategy:
    """The strategy that computes ``problem``: ``chosen``, or the one
    ``auto`` plans for it (every replica of ``distribute=`` runs it)."""
    found = (
        chosen.plan(problem).strategy if isinstance(chosen, planner.Auto) else chosen
    )
    planner.check_one_draw(problem, found)
    return found


def wrap(problem: Problem, solution: strategies.Solution) -> JacobianResult:
    """The strategy's flat ``(R, *v.shape)`` Jacobians, shaped and named."""
    jacobians = {
        name: _shaped(problem, jac, target)
        for name, jac, target in zip(
            problem.target_names, solution.jacobians, problem.targets
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
        norms=(
            None
            if solution.norms is None
            else tf.reshape(solution.norms, problem.rows_shape)
        ),
    )


def target_roles(problem: Problem) -> dict[str, str]:
    """Each role (``"kernel"``, ``"bias"``) -> the name of its target."""
    return {
        role: problem.target_names[i] for role, i in problem.roles.by_name().items()
    }


def _shaped(problem: Problem, jacobian: tf.Tensor, target: tf.Variable) -> tf.Tensor:
    """A strategy's ``(num_rows, *target.shape)`` Jacobian of ``target`` in
    the result's shape: ``rows_shape + target.shape``, or the own-example
    blocks ``rows_shape + target.shape[1:]`` when ``problem.blocked``. With
    ``reduce="norm"``: the norms ``(num_rows,)`` (``(K, B)`` blocked) as
    ``rows_shape``; with :class:`ClippedSum`, the sum in the target's shape;
    with :class:`Project`, ``rows_shape + (dim,)``. A tensor already in
    its shape is returned as it is (an eager reshape per target took 0.1 ms,
    0.6 ms of a 6.8 ms clipped-sum call on a 3-layer MLP)."""
    if isinstance(problem.reduce, ClippedSum):
        shape: tuple[int, ...] = tuple(target.shape)
    elif isinstance(problem.reduce, Project):
        shape = (*problem.rows_shape, problem.reduce.dim)
    elif problem.reduce is not None:
        if problem.blocked:
            jacobian = tf.transpose(jacobian)
        shape = problem.rows_shape
    elif problem.blocked:
        return tensor_targets.own_example_blocks(jacobian, problem.rows_shape)
    else:
        shape = problem.rows_shape + tuple(target.shape)
    if tuple(jacobian.shape) == shape:
        return jacobian
    return tf.reshape(jacobian, shape)
