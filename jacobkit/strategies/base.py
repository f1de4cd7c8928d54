"""The one interface every strategy implements (:class:`Strategy`), what a
call returns (:class:`Solution`), and the compile cache."""

from __future__ import annotations

import abc
import dataclasses
import numbers
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np
import tensorflow as tf

from jacobkit.problem import PerModel, Problem
from jacobkit.problem.reduce import ClippedSum, Project
from jacobkit.result import Stats
from jacobkit.strategies import precision, reductions

if TYPE_CHECKING:  # auto's plan ranks above the strategies: for types only
    from jacobkit.planner.plan import Plan


ZERO = tf.UnconnectedGradients.ZERO

_COMPILED = PerModel("each strategy's compiled computation per problem")


@dataclass(frozen=True)
class Solution:
    """One call's answer, as a strategy (or ``auto``) computed it: what
    :mod:`jacobkit.engine` wraps into a :class:`~jacobkit.result.JacobianResult`.

    Attributes:
        jacobians: per target, the flat ``(R, *v.shape)`` Jacobians (with
            ``reduce="norm"``: the norms, ``(R,)``).
        stats: what the call cost.
        strategy: what computed them (for ``auto``: what later calls run).
        plan: ``auto``'s :class:`~jacobkit.planner.Plan`; ``None`` for a
            configured strategy.
        norms: with ``reduce=jk.ClippedSum``, every row's gradient norm over
            all targets, ``(R,)`` (``jacobians`` then holds each target's
            clipped sum).
    """

    jacobians: tuple[tf.Tensor, ...]
    stats: Stats
    strategy: Strategy
    plan: Plan | None = None
    norms: tf.Tensor | None = None


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
    #: True where :meth:`build` honours ``problem.reduce == "norm"`` (returns
    #: each row's norm, ``(R,)``, holding one chunk of rows' Jacobians)
    supports_norm: ClassVar[bool] = False
    #: True where :meth:`build` computes ``reduce=jk.ClippedSum`` itself
    #: (each target's clipped sum, then the rows' norms); elsewhere
    #: :meth:`solve` does it from the strategy's norms or Jacobians
    #: (:mod:`jacobkit.strategies.reductions`)
    clips: ClassVar[bool] = False
    #: True where :meth:`build` computes ``reduce=jk.Project`` itself (each
    #: target's ``(R, dim)``); elsewhere :meth:`solve` maps the Jacobians
    projects: ClassVar[bool] = False
    #: tracing cost relative to ``while`` (1.0), before it was measured. On
    #: CPU, TF 2.21, pfor-based strategies traced 1.4-4x slower than while.
    trace_weight: ClassVar[float] = 2.0
    #: copies of the result a run holds at its peak: 2 where the rows'
    #: Jacobians are stacked into it, 1 where :func:`map_chunks` writes each
    #: chunk into it in place
    result_copies: ClassVar[int] = 2

    @classmethod
    def for_auto(cls, num_rows: int) -> Strategy | None:
        """The configuration ``auto`` tries on calls of ``num_rows`` rows
        (it calls :meth:`smaller` until the predicted peak fits), or ``None``:
        ``auto`` never runs this strategy. A new strategy joins ``auto`` by
        returning an instance here."""
        return None

    def rows_at_once(self, num_rows: int) -> int:
        """Rows whose backward passes are alive at once on ``num_rows`` rows
        (``auto``'s memory prior: each holds about one forward pass's
        activations in a vectorized pass, its own cotangents where rows run
        one after another, :meth:`sequential_rows`)."""
        return num_rows

    def sequential_rows(self) -> bool:
        """Whether rows run one after another, each its own backward pass
        over the one forward pass the tape kept (``loop``, ``while``): a row
        alive then holds its cotangents, not a forward pass's activations
        (``auto``'s memory prior)."""
        return False

    def passes_in_flight(self, num_rows: int) -> int:
        """Separate backward passes running at once on ``num_rows`` rows, each
        with its own kernels' scratch space (``auto``'s memory prior, see
        :mod:`jacobkit.planner.scratch`): one where the rows' passes are
        vectorized into one (pfor) or run one after another."""
        return 1

    @abc.abstractmethod
    def build(self, problem: Problem) -> Callable[[Any], list[tf.Tensor]]:
        """The computation: ``inputs -> [jacobian (R, *v.shape) per target]``."""

    def check(self, problem: Problem) -> None:  # noqa: B027 - optional hook
        """Raise a clear error if this strategy cannot solve ``problem``."""

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
            reduce = problem.reduce
            if reduce == "norm" and not self.supports_norm:
                raise ValueError(
                    f"jacobian(reduce={problem.reduce!r}, strategy="
                    f"{self.name!r}): this strategy materializes every row's "
                    "Jacobian at once. Norms are computed chunk by chunk by "
                    "strategy='chunked' (any target), row by row by 'while' "
                    "(where pfor cannot run), or by 'batch' (layers with a "
                    "closed form), or strategy='auto'."
                )
            self.check(problem)
            precision.warn_if_bfloat16_far_off(problem, compiled=self.compiled)
            # the cached computation takes the inputs as its argument: closing
            # over this call's would keep them alive for the life of the model
            fn = self.build(problem.detached())
            compiled[key] = _Compiled(problem.function(fn) if self.compiled else fn)
        entry: _Compiled = compiled[key]
        return entry

    def run(self, problem: Problem) -> tuple[list[tf.Tensor], Stats]:
        """Run on ``problem.inputs``: the ``(R, *v.shape)`` Jacobians per
        target, and what the call cost (:class:`~jacobkit.result.Stats`)."""
        return self.compiled_for(problem)(problem.inputs)

    def solve(self, problem: Problem) -> Solution:
        """:meth:`run` as a :class:`Solution` (how :mod:`jacobkit.engine`
        runs every strategy, ``auto`` included); ``reduce=jk.ClippedSum``
        by the strategy itself where it :attr:`clips`, else from its norms
        or Jacobians and one weighted backward pass."""
        if isinstance(problem.reduce, ClippedSum):
            if not self.clips:
                sums, norms, stats = reductions.clipped_sum(
                    self.run, problem, norms=self.supports_norm
                )
                return Solution(tuple(sums), stats, self, norms=norms)
            found, stats = self.run(problem)
            return Solution(tuple(found[:-1]), stats, self, norms=found[-1])
        if isinstance(problem.reduce, Project) and not self.projects:
            jacobians, stats = reductions.projected(self.run, problem)
        else:
            jacobians, stats = self.run(problem)
        return Solution(tuple(jacobians), stats, self)


class _Compiled:
    """A built computation that remembers how long its first call took."""

    def __init__(self, fn: Callable[[Any], list[tf.Tensor]]) -> None:
        self.fn = fn
        self.trace_time_s = 0.0

    @property
    def tracing_count(self) -> int:
        get = getattr(self.fn, "experimental_get_tracing_count", None)
        return get() if get else 0

    def __call__(self, inputs: Any) -> tuple[list[tf.Tensor], Stats]:
        before = self.tracing_count
        start = time.perf_counter()
        jacobians = self.fn(inputs)
        _block(jacobians)
        wall = time.perf_counter() - start
        traced = self.tracing_count > before
        if traced:
            self.trace_time_s = wall
        jacobians = list(jacobians)
        stats = Stats(
            wall_time_s=wall,
            trace_time_s=self.trace_time_s,
            traced=traced,
            num_rows=int(jacobians[0].shape[0]) if jacobians else 0,
        )
        return jacobians, stats


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


def one_hot_rows(start: Any, count: int, num_rows: int, dtype: tf.DType) -> tf.Tensor:
    """Cotangents selecting rows ``start .. start+count-1``: shape (count, R)."""
    return tf.one_hot(tf.range(start, start + count), num_rows, dtype=dtype)


#: ``(tape, rows, cotangents (c, R)) -> each target's (c, *v.shape)``
ChunkGradients = Callable[[tf.GradientTape, tf.Tensor, tf.Tensor], list[tf.Tensor]]


def rows_in_chunks(
    problem: Problem, chunk_size: int, gradients: ChunkGradients
) -> Callable[[Any], list[tf.Tensor]]:
    """``inputs -> each target's (R, *v.shape)``, or the rows' norms
    (``reduce="norm"``): one tape, then ``chunk_size`` rows at a time
    (:func:`map_chunks`), by ``gradients`` (``chunked``: vectorized)."""
    targets = problem.targets
    num_rows = problem.num_rows
    norms = problem.reduce == "norm"
    blocked = problem.blocked

    def compute(inputs: Any) -> list[tf.Tensor]:
        with tf.GradientTape(persistent=True, watch_accessed_variables=False) as tape:
            tape.watch(targets)
            rows = problem.rows(inputs)

        def chunk(start: Any, size: int) -> list[tf.Tensor]:
            cotangents = one_hot_rows(start, size, num_rows, rows.dtype)
            jacobians = gradients(tape, rows, cotangents)
            return [chunk_norms(j, blocked) for j in jacobians] if norms else jacobians

        return map_chunks(chunk, num_rows, chunk_size)

    return compute


def chunk_norms(jacobians: tf.Tensor, blocked: bool) -> tf.Tensor:
    """L2 norms over a chunk's parameter axes: ``(c, *v.shape) -> (c,)``, or
    ``(c, B, *block) -> (c, B)`` for own-example blocks (``blocked``), in at
    least float32 (a float16 row's squares overflow from 256 on)."""
    if jacobians.dtype.size < 4:
        jacobians = tf.cast(jacobians, tf.float32)
    first = 2 if blocked else 1
    axes = list(range(first, jacobians.shape.rank))
    squares = tf.square(jacobians)
    return tf.sqrt(tf.reduce_sum(squares, axis=axes) if axes else squares)


def check_chunk_size(name: str, chunk_size: Any) -> int:
    """``chunk_size`` as an ``int`` >= 1 (NumPy integers accepted)."""
    if isinstance(chunk_size, (bool, np.bool_)) or not isinstance(
        chunk_size, numbers.Integral
    ):
        raise TypeError(
            f"strategies.{name}(chunk_size={chunk_size!r}): expected a positive "
            f"int, got {type(chunk_size).__name__}."
        )
    size = int(chunk_size)
    if size < 1:
        raise ValueError(
            f"strategies.{name}(chunk_size={size}): chunk_size must be >= 1 "
            "(the number of rows computed together). Use 1 for the least memory."
        )
    return size


def map_chunks(
    fn: Callable[[tf.Tensor, int], list[tf.Tensor]],
    total: int,
    chunk_size: int,
) -> list[tf.Tensor]:
    """Run ``fn(start, size)`` over ``range(0, total, chunk_size)``, one chunk
    at a time, and concatenate its outputs along axis 0.

    ``fn`` returns a list of tensors with leading dimension ``size``. Each
    chunk's outputs are written into result buffers allocated once, so the
    peak is the result plus one chunk (a ``tf.map_fn`` stacks its chunks into
    a new tensor while they are all alive: twice the result). The chunks run
    in a ``tf.while_loop`` with ``parallel_iterations=1``, so only one chunk's
    intermediates are alive at a time; a last, smaller chunk runs once after
    the loop, so nothing is padded.

    NOTE (the buffers). ``InplaceUpdate`` writes rows of its input's buffer
    and returns that buffer (no copy). The buffers are made here by ``Empty``
    and reach nothing else until the last write, so nothing can see them
    change. Measured on the MLP's 288 MiB result in chunks of 16 rows: peak
    337 MiB against 576 MiB for ``tf.map_fn``, same time (2-core CPU).
    """
    size = min(chunk_size, total)
    n_full, rest = divmod(total, size)
    first = list(fn(tf.constant(0), size))
    if n_full == 1 and not rest:
        return first
    buffers = [
        _write(tf.raw_ops.Empty(shape=(total, *t.shape[1:]), dtype=t.dtype), 0, t)
        for t in first
    ]
    del first

    def body(index: Any, *buffers: tf.Tensor) -> tuple[Any, ...]:
        start = index * size
        parts = fn(start, size)
        return (index + 1, *(_write(b, start, t) for b, t in zip(buffers, parts)))

    if n_full > 1:
        _, *buffers = tf.while_loop(
            lambda index, *_: index < n_full,
            body,
            (tf.constant(1), *buffers),
            parallel_iterations=1,
        )
    if rest:
        start = n_full * size
        parts = fn(tf.constant(start), rest)
        buffers = [_write(b, start, t) for b, t in zip(buffers, parts)]
    return list(buffers)


def _write(buffer: tf.Tensor, start: Any, rows: tf.Tensor) -> tf.Tensor:
    """``buffer`` with rows ``start .. start + len(rows) - 1`` set to ``rows``,
    written in place (see the NOTE in :func:`map_chunks`)."""
    index = tf.range(start, start + tf.shape(rows)[0])
    return tf.raw_ops.InplaceUpdate(x=buffer, i=index, v=rows)
