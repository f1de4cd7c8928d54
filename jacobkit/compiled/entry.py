"""``jk.function``: the compiled entry point (:class:`Function`).

``jk.jacobian`` plans, compiles and runs eagerly on every call; it cannot be
called while TensorFlow traces. ``jk.function`` plans once, eagerly, on an
example batch, and returns a traceable function of the inputs: called
eagerly, inside a ``tf.function``, in a Keras ``train_step`` under
``model.fit`` (no ``run_eagerly``) or in a ``tf.distribute`` replica
(``strategy.run``). It is itself a ``tf.function``: it traces once per
input signature.

What a new signature does (:mod:`.signatures`): a problem is built for its
shapes eagerly, inside the trace (``tf.init_scope``), from the example
resized to its batch (zeros where the example has other shapes), and the
strategy planned on the example computes it: ``auto`` is not run again
(planning measures, and a trace is no place to measure). Its compiled
computation is the one ``jk.jacobian`` keeps for that problem
(``Strategy.compiled_for``), called from the trace. A batch of unknown size
(``model.fit``'s) is padded to the example's, and the padding's rows cut.

With ``training=True`` the call is one draw, as ``jk.jacobian``'s
(:mod:`jacobkit.keras.state`): its passes record what they assign, and the
trace assigns it once per call (:class:`~jacobkit.keras.state.Moves`), as
one ``model(x, training=True)`` would.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import tensorflow as tf

from jacobkit import engine, planner, runtime, strategies
from jacobkit.compiled import signatures
from jacobkit.keras import state
from jacobkit.problem import Call, Problem, arguments, padding
from jacobkit.problem.loss import Loss
from jacobkit.problem.reduction import ClippedSum, Output, Project


class CompiledOutput(NamedTuple):
    """What one call of a :class:`Function` gives (a ``NamedTuple``: it
    crosses ``tf.function`` and ``tf.distribute`` boundaries).

    Attributes:
        values: per target, keyed like ``jk.jacobian``'s result
            (``"dense/kernel"``), shaped like it: the Jacobians
            ``rows_shape + v.shape``, each row's norm ``rows_shape``, the
            clipped sum ``v.shape``, the projection ``rows_shape + (dim,)``.
        norms: every row's norm over all targets (``rows_shape``) where the
            kind has them (the clipped sum), else ``None``.
        rows: the rows themselves (``rows_shape``; a :class:`~jacobkit.Loss`'s:
            each example's weighted loss) where the computation's forward
            pass gives them (``batch``'s clipped sum), else ``None``: a
            by-product, no gradient flows through it.
    """

    values: dict[str, Any]
    norms: Any = None
    rows: Any = None


@dataclass(frozen=True)
class _Planned:
    """One traced signature's problem (without its inputs) and computation."""

    problem: Problem
    computation: Callable[[Any], Output]
    feeding: signatures.Feeding


class Function:
    """A planned, traceable ``inputs -> CompiledOutput`` (see
    :func:`function`).

    Attributes:
        strategy: the strategy planned on the example (its ``label``:
            ``"batch"``, ``"chunked(16)"``); it computes every signature.
        plan: ``auto``'s :class:`~jacobkit.planner.Plan` on the example, or
            ``None`` for a configured strategy.
        variables: the targets by the result's keys, for
            ``optimizer.apply(grads, variables)``.
    """

    # no instance dict: tf.function(fn) copies a callable's dict onto itself,
    # where a private name of ours would replace its own (its _call)
    __slots__ = (
        "_call",
        "_ceiling",
        "_example",
        "_function",
        "_lock",
        "_planned",
        "plan",
        "strategy",
        "variables",
        "__weakref__",
    )

    def __init__(self, call: Call, example: Any) -> None:
        self._call = call
        self._example = arguments.to_tensors(example)
        self._ceiling = int(tf.nest.flatten(self._example)[0].shape[0])
        self._lock = threading.Lock()
        self._planned: dict[tuple[Any, ...], _Planned] = {}
        chosen = engine.chosen(call)
        with engine.device_scope(call.device), runtime.tensorflow_warnings():
            problem = call.problem(call.padded(self._example)[0])
            arguments.warn_non_finite(problem.inputs)
            self.strategy: strategies.Strategy = chosen.planned(problem)
            self.plan: planner.Plan[strategies.Strategy] | None = chosen.plan(problem)
            # the kind's and the strategy's checks, now rather than in a trace
            compiled = self.strategy.compiled_for(problem)
        if not call.pads_batches:
            feeding = signatures.Feeding(None, self._ceiling)
            self._planned[signatures.signature(self._example)] = _Planned(
                problem.detached(), compiled.fn, feeding
            )
        self.variables: dict[str, Any] = dict(
            zip(problem.target_names, problem.targets)
        )
        self._function = tf.function(self._traced, autograph=False)

    @tf.autograph.experimental.do_not_convert  # tf.function(fn): nothing to convert
    def __call__(self, inputs: Any) -> CompiledOutput:
        """The reduction of ``inputs`` (one batch, as the example:
        ``x``, or ``(x, y[, w])`` for a :class:`~jacobkit.Loss`)."""
        if arguments.is_batches(inputs):
            raise TypeError(
                "jk.function(...)(inputs): expected one batch of arrays or "
                f"tensors, got {type(inputs).__name__}; iterate over the "
                "dataset and call it on each batch."
            )
        inputs = arguments.to_tensors(inputs)
        # the batch size as the caller's trace knows it, a Python value of the
        # call: a known size never runs a trace of unknown size (which
        # TensorFlow would pick for it, padded to the example's)
        found: CompiledOutput = self._function(inputs, _known_batch(inputs))
        return found

    def experimental_get_tracing_count(self) -> int:
        """How many signatures it has been traced for."""
        count: int = self._function.experimental_get_tracing_count()
        return count

    @property
    def tracing_count(self) -> int:
        """The same, as a property."""
        return self.experimental_get_tracing_count()

    def _traced(self, inputs: Any, batch: int | None) -> CompiledOutput:
        with engine.device_scope(self._call.device), runtime.tensorflow_warnings():
            planned = self._planned_for(inputs)
            feeding = planned.feeding
            count: Any = feeding.count
            fed = inputs
            if feeding.padded is not None:
                if count is None:
                    count = signatures.checked_count(inputs, feeding.padded)
                loss = isinstance(self._call.outputs, Loss)
                fed = padding.padded_to(inputs, feeding.padded, loss=loss)
            if not self._call.training:
                output = planned.computation(fed)
            else:
                with state.Moves() as moves:
                    output = planned.computation(fed)
                moves.apply()
            return _shaped(planned, output, count)

    def _planned_for(self, inputs: Any) -> _Planned:
        """This signature's problem and computation, planned eagerly the
        first time it is traced (under a lock: replicas trace at once).

        It is planned in a thread of its own, eager from the start:
        ``tf.init_scope`` would lift it out of the trace but pauses every
        gradient tape while it is open, so the problem's inspecting pass
        found no target connected. A new thread holds none of the trace's
        state (TensorFlow's context, Keras's scopes, a replica context,
        this context's collectors of assignments)."""
        key = signatures.signature(inputs)
        with self._lock:
            if key not in self._planned:
                specs = tf.nest.map_structure(
                    lambda t: tf.TensorSpec(t.shape, t.dtype), inputs
                )
                self._planned[key] = signatures.in_own_thread(self._plan, specs)
            return self._planned[key]

    def _plan(self, inputs: Any) -> _Planned:
        """A signature's plan (``inputs``: its ``tf.TensorSpec``s)."""
        with engine.device_scope(self._call.device), runtime.tensorflow_warnings():
            return self._planned_as(inputs)

    def _planned_as(self, inputs: Any) -> _Planned:
        count = signatures.batch_size(inputs)
        feeding = signatures.feeding(self._call, count, self._ceiling)
        if feeding.padded is None:
            assert count is not None
            problem = self._call.problem(
                signatures.sample(self._example, inputs, count)
            )
        else:
            # the real examples, one fewer than the padded size where the
            # trace does not know it: the loss is checked on a padded batch
            real = count if count is not None else max(1, feeding.padded - 1)
            loss = isinstance(self._call.outputs, Loss)
            sample = signatures.sample(self._example, inputs, real)
            problem = self._call.problem(
                padding.padded_to(sample, feeding.padded, loss=loss)
            )
            if loss:
                padding.check_batch_size(problem, real)
        compiled = self.strategy.compiled_for(problem)
        return _Planned(problem.detached(), compiled.fn, feeding)


def _known_batch(inputs: Any) -> int | None:
    """The batch size of ``inputs`` where their static shape has it."""
    flat = tf.nest.flatten(inputs)
    first = flat[0].shape if flat else None
    return None if not first or first.rank == 0 or first[0] is None else int(first[0])


def _shaped(planned: _Planned, output: Output, count: Any) -> CompiledOutput:
    """A computation's output shaped and named as ``jk.jacobian``'s result;
    a padded batch's rows cut to its first ``count`` examples."""
    problem = planned.problem
    kind = problem.reduction
    cut = planned.feeding.padded is not None
    values = {}
    for name, value, target in zip(
        problem.target_names, output.values, problem.targets
    ):
        shaped = kind.shaped(problem, value, target)
        per_row = kind.row_shape(target) is not None
        values[name] = shaped[:count] if cut and per_row else shaped
    norms = output.norms
    if norms is not None:
        norms = tf.reshape(norms, problem.rows_shape)
        norms = norms[:count] if cut else norms
    rows = output.rows
    if rows is not None:
        rows = tf.reshape(rows, problem.rows_shape)
        rows = rows[:count] if cut else rows
    return CompiledOutput(values, norms, rows)


def function(
    model: Any,
    layer: Any,
    *,
    example: Any,
    outputs: str | Callable[[Any], tf.Tensor] | Loss = "features",
    features: Sequence[int] | None = None,
    training: bool = False,
    output: int | str | None = None,
    reduce: str | ClippedSum | Project | None = None,
    strategy: str | strategies.Strategy | planner.Auto = "auto",
    memory_budget: int | float | str | None = None,
    device: str | None = None,
    unconnected: str = "error",
    cache: bool = True,
) -> Function:
    """``jk.jacobian`` planned once, as a function that runs inside
    ``tf.function``, a Keras ``train_step`` under ``model.fit`` and
    ``tf.distribute`` replicas.

    ``model``, ``layer``, ``outputs``, ``features``, ``training``,
    ``output``, ``reduce``, ``strategy``, ``memory_budget``, ``device``,
    ``unconnected`` and ``cache`` are those of :func:`jacobkit.jacobian`.

    Args:
        example: one batch as ``jk.jacobian`` takes it (``x``, or ``(x, y[,
            w])`` for a :class:`~jacobkit.Loss`), planned on eagerly; the
            strategy planned on it computes every batch. A batch whose size
            the trace does not know (``model.fit``'s) is padded to the
            example's, which must then be the largest.

    Returns:
        A :class:`Function`: ``fn(inputs)`` gives a :class:`CompiledOutput`
        (``.values`` keyed and shaped like ``jk.jacobian``'s result,
        ``.norms``); ``fn.variables`` the targets by the same keys,
        ``fn.strategy`` and ``fn.plan`` what was planned.

    Example:
        >>> import keras, numpy as np, tensorflow as tf, jacobkit as jk
        >>> model = keras.Sequential([keras.Input((4,)),
        ...                           keras.layers.Dense(3, name="head")])
        >>> x = np.ones((2, 4), "float32")
        >>> fn = jk.function(model, "head", example=x, reduce="norm")
        >>> step = tf.function(fn)  # or fn called in your own tf.function
        >>> tuple(step(x).values["head/kernel"].shape)
        (3,)
    """
    if not tf.executing_eagerly():
        raise TypeError(
            "jk.function(...): called while TensorFlow traces a tf.function. "
            "It plans eagerly, once: build it outside the traced function (next "
            "to the model), then call the function it returns inside."
        )
    engine.checked_device(device)
    if arguments.is_batches(example):
        raise TypeError(
            "jk.function(example=...): expected one batch of arrays (x, or "
            f"(x, y[, w]) for a jk.Loss), got {type(example).__name__}."
        )
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
    )
    return Function(call, example)
