"""One draw of the model's randomness and state per call.

Every forward pass jacobkit makes of a Keras 3 model runs inside a fresh
``keras.StatelessScope`` (:func:`drawn`, from ``Problem.call_model``): a
``variable.assign`` there is recorded in the scope, not applied. A dropout
layer draws its mask from its ``SeedGenerator``, whose ``next()`` reads the
state variable and assigns it one step on (Keras 3's dropout on TensorFlow is
``tf.nn.experimental.stateless_dropout`` given that seed); BatchNormalization
assigns its moving statistics. Inside the scope neither assignment reaches
the variable, so every pass of a call starts from the same seed state, draws
the same masks and sees the same batch statistics, and the user's model,
layers and variables are never changed, not even for a moment (no snapshot
and restore: other threads may run the same model).

With ``training=True`` the call then moves the state once, as one
``model(x, training=True)`` would. Each scope hands what its pass assigned to
the innermost collector of this context (:func:`offer`):

- inside a computation compiled by :func:`function` (``Problem.function``,
  the one place jacobkit wraps a computation in ``tf.function``), to that
  computation (:class:`Compiled`), which returns the values as extra outputs
  and offers them to its caller: an enclosing computation's trace, or
- eagerly, the call's :class:`Draw` (opened by :func:`jacobkit.engine.run`
  around the whole call), which :meth:`Draw.apply` assigns once at the end;
  inside a call that makes several (an explain function's
  :func:`jacobkit.jacobian` calls and its own passes, :func:`one_call`),
  each hands its values to that call's draw instead, which assigns once;
- inside a ``jk.function`` (:mod:`jacobkit.compiled`), traced into the
  caller's own ``tf.function``, its :class:`Moves`, which assigns them in
  the trace, once per call.

Every pass of a call starts from the same state, so the passes on the call's
batch record the same values; the pass that computes the result comes last
(planner probes, ``batch``'s checks on two examples run before it), and the
last value of each variable is kept. Passes outside ``engine.run`` (building
a model, the checks of a ``Problem``, the traced pass that only inspects) hand
theirs to no one: nothing moves. With ``training=False`` nothing is collected
and computations are plain ``tf.function`` objects: no cost, nothing moves.

Why not the alternatives: a snapshot of the seed states restored before each
pass changes the user's variables while other threads may read them; an extra
forward pass at the end to move the state costs a forward pass per call; a
scope around the whole call cannot see inside compiled computations, whose
assignments are graph tensors that only their outputs can carry out.

Measured (TF 2.21, Keras 3.15, ``tests/test_one_draw.py``; the commit before
this one): a ``ClippedSum(C)`` with sample weights one-hot at example i, on
``loop``, ``jacobian``, ``while``, ``chunked`` and ``auto``, gave a sum of norm
up to 1.81x C on an MLP with ``Dropout(0.5)``, 1.34x on a GRU with dropout,
1.08x on a small ``GPT2CausalLM`` (dropout 0.1); ``forward`` 1.03x. Now
``min(norm_i, C)`` within 2.2e-7. BatchNormalization's moving statistics
after one call equal one ``model(x, training=True)`` on a copy exactly (they
moved up to 3 times before). The steady cost of the extra outputs was within
this shared machine's noise (a clipped sum on a 64-256-256-10 MLP, 40-60 ms
per call either way).

Not pinned: random ops that do not go through a Keras ``SeedGenerator`` (a
``tf_keras`` Dropout, ``tf.random.uniform`` in a custom layer) draw anew on
every pass; :func:`unpinned` finds them in the traced pass, and the planner
refuses what would mix their draws
(:meth:`jacobkit.strategies.Strategy.check_draws`).
Models whose state is not Keras 3 variables (``tf_keras``, ``tf.Module``)
assign it on every pass, as before.
"""

from __future__ import annotations

import contextlib
import contextvars
import re
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import tensorflow as tf

from jacobkit.keras import compat

#: (variable, value) pairs one pass assigned, in the order first assigned
Updates = tuple[tuple[Any, tf.Tensor], ...]

#: op types of TensorFlow's stateful random ops: their draws are not a
#: function of a Keras seed generator's state
STATEFUL_RANDOM = frozenset(
    {
        "RandomUniform",
        "RandomUniformInt",
        "RandomStandardNormal",
        "TruncatedNormal",
        "ParameterizedTruncatedNormal",
        "RandomShuffle",
        "RandomGamma",
        "RandomPoisson",
        "RandomPoissonV2",
        "Multinomial",
        "RngReadAndSkip",
        "RngSkip",
        "StatefulUniform",
        "StatefulUniformInt",
        "StatefulUniformFullInt",
        "StatefulStandardNormal",
        "StatefulStandardNormalV2",
        "StatefulTruncatedNormal",
        "StatefulRandomBinomial",
    }
)

#: this context's collectors, innermost last (a context variable: each
#: thread, and each task, has its own)
_COLLECTORS: contextvars.ContextVar[tuple[Any, ...]] = contextvars.ContextVar(
    "jacobkit_collectors", default=()
)


def _recording() -> Any:
    """A ``keras.StatelessScope`` that also keeps the variables it records
    (the scope keys their values by ``id``), or ``None`` without Keras 3.
    Inside a caller's own scope, that scope's values are the state."""
    try:
        from keras.src.backend.common import stateless_scope
    except ImportError:  # pragma: no cover - keras ships with tensorflow
        return None

    class Recording(stateless_scope.StatelessScope):
        def __init__(self) -> None:
            super().__init__()
            self.assigned: dict[int, Any] = {}
            outer = stateless_scope.get_stateless_scope()
            if outer is not None:
                self.state_mapping.update(outer.state_mapping)

        def add_update(self, update: Any) -> None:
            super().add_update(update)
            self.assigned[id(update[0])] = update[0]

        def updates(self) -> Updates:
            return tuple((v, self.state_mapping[k]) for k, v in self.assigned.items())

    return Recording()


@contextlib.contextmanager
def drawn() -> Iterator[None]:
    """Run one forward pass of a model inside: the variables it assigns keep
    their values (every pass starts from the same seed state and sees the
    same statistics); what it assigned is offered (:func:`offer`) once it
    returns."""
    scope = _recording()
    if scope is None:  # pragma: no cover
        yield
        return
    with scope:
        yield
    offer(scope.updates())


def offer(updates: Updates) -> None:
    """``updates`` of one pass to this thread's innermost collector: those
    whose tensors belong to it (an assignment inside a loop body or a
    ``vectorized_map`` cannot leave it: its value stays there)."""
    collectors = _COLLECTORS.get()
    if updates and collectors:
        collectors[-1].take(updates)


class _Collector:
    """The values the passes offered last, per variable, of one graph (or
    eager). A later pass's value replaces an earlier one's: every pass of a
    call starts from the same state, and the pass computing the result (on
    the call's whole batch) comes after the checks that run on a few
    examples; a pass of part of the model (``structured``'s head) leaves
    the other variables' values as the whole model's pass left them."""

    def __init__(self) -> None:
        self.graph = tf.compat.v1.get_default_graph() if tf.inside_function() else None
        self._found: dict[int, tuple[Any, tf.Tensor]] = {}

    @property
    def updates(self) -> Updates:
        return tuple(self._found.values())

    def take(self, updates: Updates) -> None:
        for variable, value in updates:
            if self._mine(value):
                self._found[id(variable)] = (variable, value)

    def _mine(self, value: Any) -> bool:
        if self.graph is None:
            return not tf.is_symbolic_tensor(value)
        return getattr(value, "graph", None) is self.graph

    def __enter__(self) -> _Collector:
        self._token = _COLLECTORS.set((*_COLLECTORS.get(), self))
        return self

    def __exit__(self, *exc: object) -> None:
        _COLLECTORS.reset(self._token)


class Draw(_Collector):
    """One call's draw: collects the last pass's updates (eager values);
    :meth:`apply` assigns them to the model's variables, once."""

    def __init__(self) -> None:
        super().__init__()
        self.graph = None

    def apply(self) -> None:
        """Assign the last pass's values: the state moves as one call of the
        model moves it. Nothing where no pass assigned anything. Inside an
        enclosing call's draw (:func:`one_call`), hand them to it instead:
        it assigns, once, what its last pass assigned."""
        collectors = _COLLECTORS.get()
        if collectors and isinstance(collectors[-1], Draw):
            collectors[-1].take(self.updates)
            return
        for variable, value in self.updates:
            variable.assign(value)


@contextlib.contextmanager
def one_call(training: bool) -> Iterator[None]:
    """Everything inside is one call: one draw of the model's randomness
    and one set of moves (an explain function's :func:`jacobkit.jacobian`
    calls and its own passes, each in :func:`drawn`). Every pass inside
    starts from the state as it was on entry (the calls inside hand their
    values here, :meth:`Draw.apply`, instead of assigning them); on a
    normal exit, the values of the last pass to assign each variable are
    assigned, once. The caller orders its passes so that the last is
    ``model(x, training=True)``'s own. With ``training=False``, nothing:
    nothing is assigned."""
    if not training:
        yield
        return
    draw = Draw()
    with draw:
        yield
    draw.apply()


class Moves(_Collector):
    """One call's draw inside a traced function (``jk.function``,
    :mod:`jacobkit.compiled`): collects what the computations called in it
    offer (graph tensors of the trace); :meth:`apply` assigns them there,
    once per call of the traced function, after the computation read the
    state (the trace's automatic control dependencies order them), as one
    ``model(x, training=True)`` would."""

    def __enter__(self) -> Moves:
        super().__enter__()
        return self

    def apply(self) -> None:
        """Assign the last pass's values, in the trace."""
        for variable, value in self.updates:
            variable.assign(value)


def function(
    fn: Callable[..., Any], autograph: bool, training: bool, **options: Any
) -> Any:
    """``tf.function(fn, autograph=autograph, **options)``; with
    ``training=True``, a :class:`Compiled` one (with ``training=False``
    nothing is assigned: the plain function, at no cost). Its callers run
    it as :class:`.compat.LightOptimized`."""
    if not training:
        return tf.function(fn, autograph=autograph, **options)
    return Compiled(lambda f: tf.function(f, autograph=autograph, **options), fn)


class Compiled:
    """A compiled computation whose forward passes' updates come out as extra
    outputs (a dict keyed per variable, empty where nothing is assigned) and
    are offered to the collector of its caller. Called, and traced, as the
    ``tf.function`` it wraps (:meth:`get_concrete_function` gives the traced
    graph; its ``outputs`` are the computation's own)."""

    def __init__(
        self, function: Callable[[Callable[..., Any]], Any], fn: Callable[..., Any]
    ) -> None:
        self._variables: dict[str, Any] = {}
        self.python_function = fn

        def traced(*args: Any, **kwargs: Any) -> Any:
            with _Collector() as found:
                out = fn(*args, **kwargs)
            updates = {}
            for variable, value in found.updates:
                key = f"v{id(variable)}"
                self._variables[key] = variable
                updates[key] = value
            return out, updates

        self._fn = function(traced)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        out, updates = self._fn(*args, **kwargs)
        if updates:
            offer(tuple((self._variables[k], v) for k, v in sorted(updates.items())))
        return out

    def get_concrete_function(self, *args: Any, **kwargs: Any) -> Any:
        return _Concrete(self._fn.get_concrete_function(*args, **kwargs))

    def experimental_get_tracing_count(self) -> int:
        count: int = self._fn.experimental_get_tracing_count()
        return count


class _Concrete:
    """A traced :class:`Compiled`: the concrete function, its ``outputs``
    and ``structured_outputs`` without the updates."""

    def __init__(self, concrete: Any) -> None:
        self._concrete = concrete

    @property
    def structured_outputs(self) -> Any:
        # the computation's own (jk.gram(training=True) read the pair
        # (output, updates) here and failed)
        return self._concrete.structured_outputs[0]

    @property
    def outputs(self) -> list[tf.Tensor]:
        extra = len(self._concrete.structured_outputs[1])
        found: list[tf.Tensor] = self._concrete.outputs
        return found[: len(found) - extra] if extra else found

    def __getattr__(self, name: str) -> Any:
        return getattr(self._concrete, name)


def unpinned(operations: Sequence[Any], graph_def: Any = None) -> tuple[str, ...]:
    """The names of the stateful random ops among ``operations`` and in the
    functions of ``graph_def`` (loop bodies): draws no seed state pins."""
    found = [op.name for op in operations if op.type in STATEFUL_RANDOM]
    if graph_def is not None:
        for function in graph_def.library.function:
            found += [
                f"{function.signature.name}/{node.name}"
                for node in function.node_def
                if node.op in STATEFUL_RANDOM
            ]
    return tuple(found)


def where(op_names: Sequence[str], model: Any) -> str:
    """Where ops ``op_names`` are, for a message: each with the deepest of
    ``model``'s layers among its name scopes (the first three; a scope is a
    layer's name, or with the ``_N`` TensorFlow adds to a repeated one)."""
    names = {getattr(layer, "name", None) for layer in compat.flatten_layers(model)}
    found = []
    for op in op_names[:3]:
        scopes = [re.sub(r"_\d+$", "", s) for s in op.split("/")[:-1]]
        layer = next((s for s in reversed(scopes) if s in names), None)
        found.append(f"layer {layer!r} (op {op})" if layer else f"op {op}")
    return ", ".join(found)
