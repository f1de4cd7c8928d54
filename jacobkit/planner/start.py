"""Where a session starts: its candidates (the first one runs first), the
registered strategies it leaves out and why, and the refusal where not even
one row at a time fits the budget."""

from __future__ import annotations

from dataclasses import dataclass, replace

from jacobkit import memory, strategies
from jacobkit.keras import compat
from jacobkit.planner import estimates as est
from jacobkit.planner import probes, selection, shortcuts
from jacobkit.planner.footprint import Footprint
from jacobkit.planner.policy import Policy
from jacobkit.planner.scratch import MemoryPrior
from jacobkit.problem import Problem
from jacobkit.problem.plan import Rejection
from jacobkit.strategies import Strategy, precision

#: where few rows start: the eager loop traces nothing (Policy.eager_rows)
EAGER: Strategy = strategies.Loop()


@dataclass(frozen=True)
class Start:
    """A session's starting point.

    Attributes:
        footprint: its memory accounting.
        candidates: the strategies it may run, the first one first.
        rejected: the strategies it does not consider, with the reason.
        structure: what the exact structural shortcut found, where it is a
            candidate (``None``: it is not).
    """

    footprint: Footprint
    candidates: tuple[Strategy, ...]
    rejected: tuple[Rejection, ...]
    structure: str | None


def start(
    problem: Problem,
    budget_bytes: int,
    allowed_bytes: float,
    prior: MemoryPrior,
    shortcut: Strategy | None,
    structure: str,
    policy: Policy,
) -> Start:
    """The :class:`Start` of a session (see
    :class:`~jacobkit.planner.session.Session` for the arguments); raises
    ``ValueError`` where no candidate fits ``allowed_bytes``."""
    num_rows = problem.num_rows
    result_bytes = probes.result_bytes(problem)
    # the shortcut with as few rows of its inner strategy at once as the
    # budget needs (``None``: none fits)
    fitting = shortcut
    while fitting is not None and (
        est.predicted_peak(fitting, num_rows, prior, result_bytes) > allowed_bytes
    ):
        fitting = fitting.smaller()
    closed_form = _per_example_fast_path(problem)
    footprint = Footprint(
        num_rows=num_rows,
        result_bytes=result_bytes,
        allowed_bytes=allowed_bytes,
        prior=prior,
    )
    found, rejected = selection.candidates(
        num_rows, footprint.fits, lambda s: s.cannot_run(problem)
    )
    every = list(found)
    # which strategy starts is a property of the problem (what vectorizing
    # its rows costs), not of this CPU's kernels: compared without scratch
    activations = replace(prior, scratch_bytes=0, ways=(), patches_bytes=0)
    found = selection.starting_first(
        found,
        num_rows,
        lambda s: est.predicted_peak(s, num_rows, activations, result_bytes),
        policy,
    )
    found, rejected = _with_grouped(problem, found, rejected, footprint)
    if closed_form or _summed_closed_form(problem):
        # the closed form computes B x K per-example rows for about the
        # price of K summed ones, and summed rows of a Dense layer with
        # no pass per row before it and one GEMM for the contraction (MLP
        # 512-1024-1024-144, B=256, one core: first call 2.1 s against
        # chunked(144)'s 2.3 s, steady 1.3 s against 1.4 s): a prior strong
        # enough to start on it. The others are tried cheapest to trace
        # first, as the candidates are ranked: left behind a vectorized
        # start, chunked(144) came before while on that MLP, and its try
        # (2.6x batch's time, earned back 5 times over before the next)
        # put while's at call 42 (oneDNN off, loaded)
        found.sort(key=lambda s: (s.name != "batch", s.trace_weight))
    found, rejected, shown = _with_shortcut(
        problem, footprint, found, rejected, shortcut, fitting, structure, closed_form
    )
    if (
        found
        and num_rows <= policy.eager_rows
        and footprint.fits(EAGER)
        and not _half_precision(problem)
    ):
        # few rows: the first answer with no tracing, then the traced
        # candidates, cheapest to trace first (Policy.eager_rows, eager_calls)
        found = sorted({*every, *found}, key=lambda s: (s.trace_weight, s.label))
        rejected = [r for r in rejected if r.label != EAGER.name]
        rejected = [r for r in rejected if r.strategy not in found]
        found = [EAGER, *found]
    if not found:
        raise _refusal(footprint, budget_bytes)
    return Start(footprint, tuple(found), tuple(rejected), shown)


def _with_shortcut(
    problem: Problem,
    footprint: Footprint,
    found: list[Strategy],
    rejected: list[Rejection],
    shortcut: Strategy | None,
    fitting: Strategy | None,
    structure: str,
    closed_form: bool,
) -> tuple[list[Strategy], list[Rejection], str | None]:
    """The candidates and rejections when an exact shortcut applies
    (``fitting``: made small enough for the budget; ``None`` if nothing
    fits; beside ``batch``'s closed form where ``closed_form``,
    :func:`_per_example_fast_path`, see :mod:`jacobkit.planner.shortcuts`),
    and the structure line of the plan. The registry's own "not offered"
    rejection of the shortcut's name becomes the reason where none applies
    (``structure``: why not)."""
    named = shortcuts.NAME
    rejected = [r for r in rejected if r.label != named]
    if shortcut is None:
        if structure:
            rejected.append(Rejection(named, structure))
        return found, rejected, None
    if fitting is None:
        reason = _too_big(shortcut, footprint)
        rejected.append(Rejection(shortcut, reason, memory=True))
        return found, rejected, None
    kept, more = shortcuts.candidates(
        problem, found, fitting, footprint.fits, closed_form=closed_form
    )
    return kept, rejected + more, structure


def _with_grouped(
    problem: Problem,
    found: list[Strategy],
    rejected: list[Rejection],
    footprint: Footprint,
) -> tuple[list[Strategy], list[Rejection]]:
    """Where closed forms serve some of the targets and not all, ``batch`` on
    those and the generic candidate (``chunked``, else ``while``, as large
    as fits) on the others first (:class:`~jacobkit.strategies.Grouped`):
    a layer without a rule no longer sends every target to the generic
    path. The registry's "not offered" of it goes where it is proposed."""
    rest = next((s for s in found if s.name == "chunked"), None)
    rest = rest or next((s for s in found if s.name == "while"), None)
    grouped = None if rest is None else strategies.Grouped.proposed(problem, rest)
    if grouped is None or not footprint.fits(grouped):
        return found, rejected
    return [grouped, *found], [r for r in rejected if r.label != grouped.name]


def _too_big(shortcut: Strategy, footprint: Footprint) -> str:
    """Why the shortcut, at its smallest, does not fit: its first call's
    check (:func:`~jacobkit.planner.estimates.check_peak`), where that alone
    is over what the budget allows."""
    check = est.check_peak(shortcut, footprint.prior, footprint.result_bytes)
    if check > footprint.allowed_bytes:
        return (
            f"its first call's check (jk.verify: an eager forward pass, which "
            f"holds every layer's output: {_fmt(footprint.prior.eager_bytes)}) "
            f"is predicted at {_fmt(check)}, over the "
            f"{_fmt(footprint.allowed_bytes)} the budget allows"
        )
    return "predicted peak over the budget"


def _refusal(footprint: Footprint, budget_bytes: int) -> ValueError:
    """Not even one row at a time fits: the error, with what it would need."""
    prior = footprint.prior
    smallest, least = min(
        (
            (est.predicted_peak(s, 1, prior, footprint.result_bytes), s)
            for s in _smallest_configurations()
        ),
        key=lambda pair: pair[0],
    )
    # the kernels' scratch that one (its way: jacobkit.planner.scratch)
    scratch = prior.kernel_scratch(1, prior.way(least))
    source = "from the traced pass's tensors"
    if scratch:
        source += (
            f" and {_fmt(scratch)} of work space that this "
            "CPU's convolution gradient kernels take, measured"
        )
    return ValueError(
        f"jacobian(memory_budget={_fmt(budget_bytes)}): even one row at a "
        f"time needs about {_fmt(smallest)} (estimated "
        f"{source}), more than the {_fmt(footprint.allowed_bytes)} "
        f"({footprint.allowed_bytes / budget_bytes:.0%} of the budget) a plan "
        "may use. Raise memory_budget, keep fewer rows with features=[...], "
        "or use a smaller batch."
    )


def _smallest_configurations() -> list[Strategy]:
    """Each auto candidate at its smallest (for the refusal message)."""
    found = []
    for cls in strategies.REGISTRY.values():
        strategy = cls.for_auto(1)
        while strategy is not None and strategy.smaller() is not None:
            strategy = strategy.smaller()
        if strategy is not None:
            found.append(strategy)
    return found


def _per_example_fast_path(problem: Problem) -> bool:
    """Rows of single examples of a Dense/Conv layer's own variables: where
    the ``batch`` strategy's closed form may apply."""
    return _closed_form_rows(problem) and not problem.rows_spec.summed_over_batch


def _summed_closed_form(problem: Problem) -> bool:
    """Rows summed over the batch of a layer's own variables whose rule
    starts them on ``batch`` (``LayerRule.summed_starts_on_batch``: Dense)."""
    rule = problem.layer_rule
    return (
        _closed_form_rows(problem)
        and problem.rows_spec.summed_over_batch
        and rule is not None
        and rule.summed_starts_on_batch
    )


def _closed_form_rows(problem: Problem) -> bool:
    """Rows that each belong to one example or sum over examples, of targets
    that closed forms serve (a layer with a rule, or variables shared out
    among such layers: ``batch``'s closed form may apply)."""
    return (
        problem.rows_spec.decomposes_per_example
        and problem.tensor_targets is None
        and problem.forms is not None
    )


def _half_precision(problem: Problem) -> bool:
    """Whether a layer of the model computes in float16 or bfloat16: there,
    eager kernels may be far less accurate than compiled ones (this CPU's
    eager bfloat16 convolutions put the loop 0.3-0.4 from float64 on the
    cnn2d example, where compiled ones stay within 0.02), so no eager
    start."""
    if precision.gradient_dtype(problem).size < 4:
        return True
    return any(
        compat.compute_dtype(layer) in ("float16", "bfloat16")
        for layer in compat.flatten_layers(problem.model)
    )


def _fmt(n: float) -> str:
    return memory.format_bytes(int(n))
