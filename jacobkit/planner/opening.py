"""A new :class:`~jacobkit.planner.session.Session`: the budget checked
against the result itself, the exact shortcut where one applies, the memory
prior, and the disk cache's entry continued where it applies."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from jacobkit import memory, strategies
from jacobkit.planner import cache as disk
from jacobkit.planner import keeping, probes, scratch
from jacobkit.planner.policy import Policy
from jacobkit.planner.scratch import MemoryPrior
from jacobkit.planner.session import Session
from jacobkit.problem import Problem
from jacobkit.strategies import Strategy, gradients, precision
from jacobkit.strategies.structured import NoShortcut

#: a way's scratch a pass from the kinds whose kernels run that way
PerPass = Callable[[str, frozenset[str]], int]


def open_session(
    problem: Problem,
    memory_budget: int | float | str | None,
    device: str,
    policy: Policy,
    cache: bool,
) -> Session:
    """The session that plans ``problem`` under ``memory_budget`` on
    ``device`` (normalized, ``"CPU:0"``): continued from the disk cache
    where ``cache`` and an entry apply.

    Raises:
        ValueError: the result alone does not fit the budget, or nothing fits
            (the session's start says what one row at a time needs).
    """
    name = disk.fingerprint(problem, device) if cache and disk.directory() else None
    budget = memory.parse_budget(memory_budget, device=device)
    result_bytes = probes.result_bytes(problem)
    if result_bytes > budget * policy.safety:
        raise ValueError(
            f"jacobian(memory_budget={memory.format_bytes(budget)}): the result "
            f"alone needs {memory.format_bytes(result_bytes)} ({result_bytes} "
            f"bytes: {problem.num_rows} rows × "
            f"{sum(t.shape.num_elements() for t in problem.targets)} parameters × "
            f"{problem.output_dtype.size} bytes), more than the "
            f"{memory.format_bytes(int(budget * policy.safety))} "
            f"({policy.safety:.0%} of the budget) a plan may use. Raise "
            "memory_budget, keep fewer rows with features=[...], or use a "
            "smaller batch."
        )
    shortcut, structure = structured(problem)
    entry = disk.load(name) if name is not None else None
    if entry is not None and not keeping.measured_here(entry):
        entry = None  # measured on another kind of CPU: planned afresh, rewritten
    row_bytes = entry.row_bytes if entry is not None else None
    if row_bytes is None:
        # the forward pass's activations, from the trace the problem made:
        # an upper bound on what one row's backward pass keeps per row
        row_bytes = problem.activation_bytes
    measured_on = device if probes.peak_measurable(device) else None

    session = Session(
        problem,
        budget,
        budget * policy.safety,
        measured_on,
        memory_prior(problem, row_bytes, measured_on, allowed=budget * policy.safety),
        shortcut=shortcut,
        structure=structure,
        policy=policy,
        cache_name=name,
    )
    # an entry that does not apply is planned afresh and rewritten. Where a
    # shortcut applies it is not the one candidate when few rows start on the
    # eager loop: skipping the entry there started a warm process on the
    # loop again (frozen MobileNetV2 and BERT heads: the shortcut tried at
    # calls 8-12 of every process)
    if entry is not None:
        session.restore(entry)
    return session


def structured(problem: Problem) -> tuple[Strategy | None, str]:
    """``(Structured(), what it found)`` where an exact structural shortcut
    applies to ``problem`` (:mod:`jacobkit.problem.structure`), else
    ``(None, why not)``: the refusal's
    :attr:`~jacobkit.strategies.structured.NoShortcut.reason`, or the inner
    strategy's own refusal."""
    shortcut = strategies.Structured()
    try:
        shortcut.check(problem)
    except NoShortcut as err:
        return None, err.reason
    except ValueError as err:  # the inner strategy refuses the head's input
        return None, str(err)
    return shortcut, shortcut.describe(problem)


def memory_prior(
    problem: Problem,
    row_bytes: int,
    device: str | None,
    per_pass: PerPass | None = None,
    allowed: float | None = None,
) -> MemoryPrior:
    """The memory prior of ``problem``: ``row_bytes`` per row alive at once
    in a vectorized pass, its sequential rows' figures, and the scratch space
    its convolution gradients' kernels take on this machine, per way they
    run (:data:`~jacobkit.planner.scratch.WAYS`: only the kinds whose
    TensorFlow kernels run that way, :func:`~jacobkit.planner.scratch.
    kinds_run`), measured where ``device`` reports its peak (else none), or
    ``per_pass(way, kinds)`` where given (nothing measured). Where this
    CPU kind's prior for the kinds is over ``allowed`` (what a plan may
    use), the prior is counted, not measured: the probe's own peak is the
    kernel's scratch, which would break the budget by itself (measured,
    oneDNN off: 32.3 MiB in a 4 MiB call on the Conv1D generator)."""
    dtype = precision.gradient_dtype(problem) if problem.convolutions else None
    found: dict[frozenset[str], int] = {}

    def scratch_of(way: str, kinds: frozenset[str]) -> int:
        if per_pass is not None:
            return per_pass(way, kinds)
        if kinds not in found:  # each set of kinds asked once
            found[kinds] = _measured(kinds, dtype, device, allowed)
        return found[kinds]

    replaced = gradients.replaces() if problem.convolutions else False
    ways = tuple(
        (way, scratch_of(way, scratch.kinds_run(problem, way, replaced)))
        for way in scratch.WAYS
    )
    return MemoryPrior(
        row_bytes,
        problem.sequential_memory,
        ways[0][1],  # "tape": every kind the others run, and more
        scratch.inter_op_threads(),
        eager_bytes=problem.forward_bytes,
        hoisted_bytes=gradients.hoisted_bytes(problem.transposed),
        ways=ways[1:],
        patches_bytes=scratch.patches_held(problem, replaced),
        shortcut_runs_inner=strategies.Structured.runs_inner(problem),
    )


def _measured(
    kinds: frozenset[str], dtype: Any, device: str | None, allowed: float | None
) -> int:
    """The scratch of ``kinds`` measured on ``device`` (0: nothing to
    measure), or this CPU kind's prior where it is over ``allowed``."""
    if device is None or not kinds or dtype is None:
        return 0
    return _probed(kinds, dtype, device, allowed)


def _probed(
    kinds: frozenset[str], dtype: Any, device: str, allowed: float | None
) -> int:
    """The scratch of ``kinds`` measured on ``device``, or this CPU kind's
    prior where it is over ``allowed``: the probe's own peak is the
    kernel's scratch, which would break the budget by itself."""
    prior = scratch.prior_bytes(kinds, dtype, device)
    if allowed is not None and prior > allowed:
        return prior
    return scratch.scratch_bytes(kinds, dtype, device)


def deciding_scratch(
    problem: Problem,
    device: str | None,
    allowed: float,
    predict: Callable[[PerPass | None], Sequence[Any]],
) -> PerPass | None:
    """How a reduced call's candidates count the kernels' scratch a pass
    (``predict(per_pass)``: the candidates, each with its ``strategy`` and
    ``predicted_bytes``): measured (:func:`~jacobkit.planner.scratch.
    scratch_bytes`) only for a way whose candidate fits without scratch but
    not with :data:`~jacobkit.planner.scratch.SCRATCH_BOUND` and where this
    CPU kind's prior fits ``allowed`` (the probe's own peak is the
    kernel's), else that prior; ``None``: nothing to measure."""
    if not scratch.bound(problem.convolutions, device):
        return None
    dtype = precision.gradient_dtype(problem)
    low = predict(lambda way, kinds: 0)
    high = predict(lambda way, kinds: scratch.bound(kinds, device))
    # the ways whose scratch decides whether one of their candidates fits
    deciding = {
        without.strategy.convolution_gradients
        for without, bounded in zip(low, high, strict=True)
        if without.predicted_bytes <= allowed < bounded.predicted_bytes
    }

    def per_pass(way: str, kinds: frozenset[str]) -> int:
        if way in deciding and kinds and device is not None:
            return _probed(kinds, dtype, device, allowed)
        return scratch.prior_bytes(kinds, dtype, device)  # cannot change the plan

    return per_pass
