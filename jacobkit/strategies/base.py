"""The one interface every strategy implements (:class:`Strategy`, a
:class:`~jacobkit.problem.solution.Solver`), and the compile cache. What a
call returns, :class:`~jacobkit.problem.solution.Solution`, ranks below."""

from __future__ import annotations

import abc
import dataclasses
import time
from collections.abc import Callable, Mapping
from typing import Any, ClassVar

import tensorflow as tf

from jacobkit.keras import state
from jacobkit.problem import PerModel, Problem
from jacobkit.problem.plan import Plan
from jacobkit.problem.reduction import Computation, Flat, Ghost, Lookup, Output, Rows
from jacobkit.problem.solution import Solution, Stats
from jacobkit.strategies import gradients, precision

ZERO = tf.UnconnectedGradients.ZERO

_COMPILED = PerModel("each strategy's compiled computation per problem")
_FLAT = PerModel("a strategy's computation with its output flattened, for replicas")


class Strategy(abc.ABC):
    """A way to compute every row's gradient with respect to the targets.

    Subclasses implement :meth:`build`, a function of the inputs that returns,
    for each target ``v`` in ``problem.targets``, a tensor of shape
    ``(R, *v.shape)`` (``R = problem.num_rows``). The base class compiles it
    with ``tf.function`` once per (model, targets, rows, strategy) and reuses
    it; a new input signature retraces as ``tf.function`` does.

    Options are the fields of a frozen dataclass subclass (``Chunked``'s
    ``chunk_size``, ``While``'s ``parallel_iterations``): :attr:`key`,
    :attr:`label`, equality, hashing and ``repr`` all derive from them, so a
    new option needs no code beyond its field (and its validation in
    ``__post_init__``). A field may set ``metadata={"label": "short"}`` for a
    shorter name in the label. :meth:`smaller` is the out-of-memory back-off.
    """

    name: ClassVar[str]
    #: False for strategies that must run eagerly (the users' baseline loop).
    compiled: ClassVar[bool] = True
    #: rows (or tangents) per vectorized pass; a field where a strategy has one
    chunk_size: int | None = None
    #: whether a call's result comes from one forward pass (``forward`` runs
    #: one per chunk of tangents): with randomness no seed state pins, only
    #: such a strategy runs (:meth:`check_draws`)
    one_pass: ClassVar[bool] = True
    #: tracing cost relative to ``while`` (1.0), before it was measured. On
    #: CPU, TF 2.21, pfor-based strategies traced 1.4-4x slower than while.
    trace_weight: ClassVar[float] = 2.0
    #: copies of the result a run holds at its peak: 2 where the rows'
    #: Jacobians are stacked into it, 1 where :func:`map_chunks` writes each
    #: chunk into it in place
    result_copies: ClassVar[int] = 2
    #: how its convolution gradients run (``auto``'s memory prior,
    #: :func:`jacobkit.planner.scratch.runs_kernel`): ``"tape"``, by the
    #: tape (TensorFlow's ops, or jacobkit's ``Conv2D`` rule where it
    #: applies) or a layer's closed form (which may run TensorFlow's filter
    #: gradient per example: :func:`jacobkit.layers.conv.example_filters`);
    #: ``"loop"``, the tape's in a compiled loop over rows (a kernel's
    #: gradient from its input's patches formed once before it)
    convolution_gradients: ClassVar[str] = "tape"

    @classmethod
    def for_auto(cls, num_rows: int) -> Strategy | None:
        """The configuration ``auto`` tries on calls of ``num_rows`` rows
        (it calls :meth:`smaller` until the predicted peak fits), or ``None``:
        ``auto`` never runs this strategy. A new strategy joins ``auto`` by
        returning an instance here."""
        return None

    @classmethod
    def for_reduced(cls, problem: Problem) -> tuple[Strategy, ...]:
        """The configurations ``auto`` tries, in order, on a reduced call
        (``reduce=`` other than the rows: :mod:`jacobkit.planner.reduced`),
        each holding less than the one before; ``()``: none. Strategies are
        tried in the order of :attr:`reduced_preference`."""
        return ()

    #: where this strategy's :meth:`for_reduced` configurations come among
    #: the registered strategies' (lower first)
    reduced_preference: ClassVar[int] = 100

    def passes(self, problem: Problem) -> int:
        """Backward passes a call makes (``auto``'s memory prior for a reduced
        call): one per row."""
        return problem.num_rows

    def rows_at_once(self, num_rows: int) -> int:
        """Rows whose backward passes are alive at once on ``num_rows`` rows
        (``auto``'s memory prior: each holds its own cotangents where rows
        run one after another, :meth:`sequential_rows`, or are batched by
        pfor, :meth:`vectorized_rows`; else about one forward pass's
        activations)."""
        return num_rows

    def sequential_rows(self) -> bool:
        """Whether rows run one after another, each its own backward pass
        over the one forward pass the tape kept (``loop``, ``while``): a row
        alive then holds its cotangents, not a forward pass's activations
        (``auto``'s memory prior)."""
        return False

    def vectorized_rows(self) -> bool:
        """Whether rows are vectorized into one backward pass by pfor
        (``chunked``, ``jacobian``): the forward pass is kept once and each
        row in flight holds its own cotangents, batched (``auto``'s memory
        prior, :meth:`jacobkit.planner.scratch.MemoryPrior.vectorized_peak`)."""
        return False

    def passes_in_flight(self, num_rows: int) -> int:
        """Separate backward passes running at once on ``num_rows`` rows, each
        with its own kernels' scratch space (``auto``'s memory prior, see
        :mod:`jacobkit.planner.scratch`): one where the rows' passes are
        vectorized into one (pfor) or run one after another."""
        return 1

    def rows_formed(self, num_rows: int) -> int:
        """Rows held formed at once (a reduction's, pfor's in flight): all."""
        return num_rows

    def parts(self, problem: Problem) -> tuple[tuple[Strategy, Problem], ...]:
        """Each strategy computing ``problem``'s targets, on its own: here one."""
        return ((self, problem),)

    def formed_bytes(self, problem: Problem) -> int:
        """Bytes of rows formed that computing ``problem``'s reduction holds
        (:meth:`~jacobkit.problem.reduction.Reduction.formed_bytes`)."""
        at_once = self.rows_formed(problem.num_rows)
        return problem.reduction.formed_bytes(problem, at_once, self.native)

    @abc.abstractmethod
    def build(self, problem: Problem) -> Callable[[Any], Any]:
        """The computation of a reduction this strategy computes natively
        (:attr:`native`): ``inputs -> [jacobian (R, *v.shape) per target]``
        for rows, or the reduction's per-target values, or its
        :class:`~jacobkit.problem.reduction.Output`."""

    def builds(self) -> Mapping[str, Callable[[Problem], Callable[[Any], Any]]]:
        """Each reduction kind this strategy computes itself, by the kind's
        name (:mod:`jacobkit.problem.reduction`), and how: a builder like
        :meth:`build`. Every strategy computes the rows; any other kind is
        computed by the kind's generic computation from these."""
        return {Rows.name: self.build}

    @property
    def native(self) -> frozenset[str]:
        """The kinds this strategy computes itself (:meth:`builds`)."""
        return frozenset(self.builds())

    def builder(
        self, problem: Problem
    ) -> Callable[[Problem], Callable[[Any], Any]] | None:
        """How this strategy computes ``problem``'s reduction itself, or
        ``None`` where the kind's generic computation does (the one place a
        strategy looks the kind up)."""
        return self.builds().get(problem.reduction.name)

    def computes(self, problem: Problem) -> bool:
        """Whether this strategy computes ``problem``'s reduction itself."""
        return self.builder(problem) is not None

    def computation(self, problem: Problem) -> Computation:
        """``inputs -> Output`` for ``problem``'s reduction: this strategy's
        own where it :meth:`computes` it, else the kind's generic computation
        composed from this strategy's (its rows or its norms), in one call."""
        builder = self.builder(problem)
        if builder is None:
            return problem.reduction.generic(problem, self.computation, self.native)
        built = builder(problem)

        def computed(inputs: Any) -> Output:
            found = built(inputs)
            return found if isinstance(found, Output) else Output(tuple(found))

        return computed

    def check(self, problem: Problem) -> None:  # noqa: B027 - optional hook
        """Raise a clear error if this strategy cannot solve ``problem``."""

    def check_draws(self, problem: Problem, why: str | None = None) -> None:
        """Refuse what would mix draws of randomness that no seed state pins
        (``problem.unpinned``, with ``training=True``): a computation of more
        than one forward pass (a kind's generic computation that needs two,
        :attr:`~jacobkit.problem.reduction.Reduction.generic_passes`, as a
        clipped sum's norms and weighted sum; or a strategy that runs a pass
        per chunk, :attr:`one_pass`). ``why``: why ``batch`` cannot run."""
        if not problem.unpinned:
            return
        generic = not self.computes(problem)
        if self.one_pass and not (generic and problem.reduction.generic_passes > 1):
            return
        where = state.where(problem.unpinned, problem.model)
        what = (
            f"strategy={self.name!r} runs a forward pass per chunk"
            if not self.one_pass
            else f"reduce={problem.reduce!r} on strategy={self.name!r} takes each "
            "row's norm from one forward pass and the clipped sum from another"
        )
        batch = "" if why is None else f" (strategy='batch' cannot run here: {why})"
        raise ValueError(
            "jacobian(training=True): the model draws random numbers that "
            f"jacobkit cannot hold fixed across forward passes, at {where}: "
            "stateful random ops, not drawn from a Keras SeedGenerator, so every "
            f"pass draws anew. {what}, so they would see different draws (for a "
            "clipped sum: an example's contribution is no longer bounded by C). "
            "Use strategy='batch', whose result comes from one pass"
            f"{batch}; or draw through keras.random with a "
            "keras.random.SeedGenerator (Keras 3's keras.layers.Dropout does), "
            "which jacobkit pins."
        )

    def cannot_run(self, problem: Problem) -> str | None:
        """Why this strategy cannot run through ``problem``'s layers, known
        from their types alone (nothing is traced): ``auto`` leaves such a
        candidate out before trying it. ``None`` where nothing is known."""
        return None

    def smaller(self) -> Strategy | None:
        """The same computation holding less at once (half the chunk, half the
        rows in flight), or ``None`` where nothing smaller exists. The
        planner calls it after an out-of-memory error."""
        return None

    def planned(self, problem: Problem) -> Strategy:
        """Itself: a configured strategy computes every problem (``auto``
        answers with the strategy its plan runs)."""
        return self

    def plan(self, problem: Problem) -> Plan[Strategy] | None:
        """``None``: a configured strategy decides nothing (``auto``'s
        :meth:`~jacobkit.planner.Auto.plan` returns what it decided)."""
        return None

    # -- identity, derived from the dataclass fields -------------------------
    @property
    def options(self) -> dict[str, Any]:
        """The configured options, ``{field name: value}`` (empty if none)."""
        if not dataclasses.is_dataclass(self):
            return {}
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}

    @property
    def key(self) -> tuple[Any, ...]:
        """What distinguishes two configurations of this strategy."""
        return (self.name, tuple(self.options.items()))

    @property
    def label(self) -> str:
        """Short display name: ``chunked(16)``, ``while(parallel=5)``, ``batch``."""
        parts = []
        fields: tuple[dataclasses.Field[Any], ...] = (
            dataclasses.fields(self) if dataclasses.is_dataclass(self) else ()
        )
        for f in fields:
            value = getattr(self, f.name)
            if value is None:
                continue
            if f.name == "chunk_size":
                parts.append(str(value))
            else:
                parts.append(f"{f.metadata.get('label', f.name)}={value}")
        return f"{self.name}({', '.join(parts)})" if parts else self.name

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Strategy) and other.key == self.key

    def __hash__(self) -> int:
        return hash(self.key)

    # -- running -------------------------------------------------------------
    def compiled_for(self, problem: Problem) -> _Compiled:
        """The cached compiled computation for ``problem`` (built if new)."""
        compiled = _COMPILED.of(problem.model)
        key = (problem.key, self.key)
        if key not in compiled:
            problem.reduction.check(problem)
            self.check(problem)
            self.check_draws(problem)
            precision.warn_if_bfloat16_far_off(problem, compiled=self.compiled)
            # the cached computation takes the inputs as its argument: closing
            # over this call's would keep them alive for the life of the model
            # traced under jacobkit's convolution gradients (oneDNN off)
            fn = gradients.within(self.computation(problem.detached()))
            compiled[key] = _Compiled(problem.function(fn) if self.compiled else fn)
        entry: _Compiled = compiled[key]
        return entry

    def run(self, problem: Problem) -> tuple[Output, Stats]:
        """Run on ``problem.inputs``: the reduction's
        :class:`~jacobkit.problem.reduction.Output` (for rows: the ``(R,
        *v.shape)`` Jacobians per target), and what the call cost
        (:class:`~jacobkit.problem.solution.Stats`)."""
        return self.compiled_for(problem)(problem.inputs)

    def flat_computation(self, problem: Problem) -> Callable[[Any], Any]:
        """``inputs -> the computation's output as a flat list``: the
        per-target values (a feature's tensors in its order), then every
        row's norm where the reduction has them, compiled once per model,
        problem and strategy. What ``tf.distribute`` replicas run: their
        results are taken back tensor by tensor, and put back together by
        the caller (:meth:`~jacobkit.problem.reduction.Reduction.joined`)."""
        kept = _FLAT.of(problem.model)
        key = (problem.key, self.key)
        if key not in kept:
            fn = self.compiled_for(problem).fn

            def flat(inputs: Any) -> list[tf.Tensor]:
                out = fn(inputs)  # the rows, a by-product, stay behind
                flat = tf.nest.flatten((out.values, out.norms))
                return [t for t in flat if t is not None]

            kept[key] = problem.function(flat)
        found: Callable[[Any], Any] = kept[key]
        return found

    def solve(self, problem: Problem) -> Solution[Strategy]:
        """:meth:`run` as a :class:`Solution` (how :mod:`jacobkit.engine`
        runs every strategy, ``auto`` included)."""
        output, stats = self.run(problem)
        return Solution(output, stats, self)


class _Compiled:
    """A built computation that remembers how long its first call took."""

    def __init__(self, fn: Callable[[Any], Output]) -> None:
        self.fn = fn
        self.trace_time_s = 0.0

    @property
    def tracing_count(self) -> int:
        get = getattr(self.fn, "experimental_get_tracing_count", None)
        return get() if get else 0

    def __call__(self, inputs: Any) -> tuple[Output, Stats]:
        before = self.tracing_count
        start = time.perf_counter()
        output = self.fn(inputs)
        _block(tf.nest.flatten(output))
        wall = time.perf_counter() - start
        traced = self.tracing_count > before
        if traced:
            self.trace_time_s = wall
        stats = Stats(
            wall_time_s=wall,
            trace_time_s=self.trace_time_s,
            traced=traced,
            num_rows=_rows_of(output),
        )
        return output, stats


def _rows_of(output: Output) -> int:
    """The rows a computation's output covers: its norms', else its first
    value's: a Gram's feature counts its own (a :class:`Ghost`'s or
    :class:`Lookup`'s ``B * K``, where its patches or ids lead with ``B``
    alone), a tensor by its leading axis."""
    first = output.norms
    if first is None:
        value = next(iter(output.values), None)
        if isinstance(value, (Ghost, Lookup, Flat)):
            return value.num_rows
        first = next(iter(tf.nest.flatten(value)), None)
    return int(first.shape[0]) if first is not None and first.shape.rank else 0


def _block(tensors: Any) -> None:
    """Wait until ``tensors`` are computed (GPU kernels run asynchronously; a
    CPU tensor of synchronous eager execution is computed when returned).
    Synchronous execution is read once: per tensor, it cost 0.3 ms of a
    call with 42 targets."""
    synchronous = tf.config.experimental.get_synchronous_execution()
    for tensor in tensors:
        if not isinstance(tensor, tf.Tensor) or not hasattr(tensor, "numpy"):
            continue
        if synchronous and ":CPU:" in tensor.device:
            continue
        if tensor.shape.num_elements():
            tf.reshape(tensor, (-1,))[:1].numpy()


def check_wrapped(owner: type[Strategy], field: str, value: Any, why: str) -> None:
    """A strategy that runs another (``Structured(inner=...)``,
    ``Grouped(rest=...)``): ``value`` is a configured strategy or a registered
    name, neither ``owner`` nor ``"auto"``; ``why`` says what it computes."""
    spelled = f"strategies.{owner.__name__}({field}={value!r})"
    if not isinstance(value, (Strategy, str)):
        raise TypeError(
            f"{spelled}: expected a configured strategy such as "
            "Chunked(chunk_size=8) or a registered name such as 'while'."
        )
    if isinstance(value, owner) or value in (owner.name, "auto"):
        raise ValueError(f"{spelled}: {why}")
