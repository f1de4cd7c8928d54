"""``grouped``: the targets closed forms serve on ``batch``, the others on a
generic strategy, in one compiled call (issue 49).

Where one layer of a model has no closed form (an LSTM, a user's layer with
weights), ``batch`` refuses a list of variables that holds it: before this
strategy, every target then ran on a generic strategy. Here the targets are
split into two groups: those shared out among layers with rules
(:func:`jacobkit.problem.forms.served`, from the layers' types alone), run
by ``batch`` on the problem restricted to them (``Problem.restricted``), and
the others, run by ``rest``. Each reduction kind says how its groups'
outputs combine (:meth:`~jacobkit.problem.reduction.base.Reduction.grouped`):
per-target values side by side; a clipped sum's norms combined before its
one weighted backward pass.

Every group runs its own forward pass: with ``training=True`` they draw the
same randomness where a seed state pins it (each pass in a
``keras.StatelessScope``, :mod:`jacobkit.keras.state`); where no seed state
pins it, more than one group is refused (:meth:`Grouped.check_draws`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple, final

from jacobkit.keras import state
from jacobkit.problem import Problem, forms
from jacobkit.problem.reduction import Computation, Rows
from jacobkit.strategies.base import Strategy, check_wrapped
from jacobkit.strategies.registry import get as get_strategy

#: the target names a label shows of the generic group (then "+ N more")
SHOWN = 3


class Group(NamedTuple):
    """One group of targets: their positions among the problem's, and the
    strategy that runs them."""

    indices: tuple[int, ...]
    strategy: Strategy


@final
@dataclass(frozen=True)
class Grouped(Strategy):
    """The targets a closed form serves on ``batch``, the others on ``rest``
    (see the module docstring).

    Attributes:
        rest: the strategy of the targets without a closed form: a configured
            strategy or a registered name (default ``"chunked"``, 16 rows at
            once).
        uncovered: the names of the targets ``rest`` runs
            (``problem.target_names``), as ``auto`` proposes them; ``None``:
            those no layer's rule covers, found per problem (and every
            target where ``batch`` refuses those a rule covers: a grouped
            plan of its own then runs ``batch`` where it runs).
    """

    name = "grouped"
    rest: Strategy | str = "chunked"
    uncovered: tuple[str, ...] | None = None

    #: batch's and the generic strategy's tracing, both in one call
    trace_weight = 5.0

    def __post_init__(self) -> None:
        check_wrapped(
            Grouped,
            "rest",
            self.rest,
            "the rest runs the targets without a closed form; use 'chunked', "
            "'while', ...",
        )
        if self.uncovered is not None:
            names = tuple(self.uncovered)
            if not names or not all(isinstance(n, str) for n in names):
                raise ValueError(
                    f"strategies.Grouped(uncovered={self.uncovered!r}): expected "
                    "target names (result keys), or None to find them."
                )
            object.__setattr__(self, "uncovered", names)
        # the rest's rows at once: what plans show (not an option of its own)
        object.__setattr__(self, "chunk_size", self.resolved_rest().chunk_size)

    @classmethod
    def proposed(cls, problem: Problem, rest: Strategy) -> Grouped | None:
        """The grouped plan ``auto`` proposes for ``problem``, with ``rest``
        for the targets without a closed form: where closed forms serve some
        of its variables and ``batch`` runs them, and not all (``None``
        elsewhere)."""
        split = _split(problem)
        if split is None:
            return None
        return cls(rest, tuple(problem.target_names[i] for i in split[1]))

    @classmethod
    def for_reduced(cls, problem: Problem) -> tuple[Strategy, ...]:
        """Where closed forms serve some targets and not all: ``chunked``
        with fewer and fewer rows at once for the others (16 to 1, as
        ``chunked``'s own)."""
        split = _split(problem)
        if split is None:
            return ()
        names = tuple(problem.target_names[i] for i in split[1])
        found: list[Strategy] = []
        rest: Strategy | None = get_strategy("chunked")
        while rest is not None:
            found.append(cls(rest, names))
            rest = rest.smaller()
        return tuple(found)

    #: after ``batch`` (which serves every target where it runs), before a
    #: generic strategy on all of them
    reduced_preference = 1

    @property
    def label(self) -> str:
        rest = self.resolved_rest().label
        if self.uncovered is None:
            return f"{self.name}(batch | {rest})"
        shown = ", ".join(self.uncovered[:SHOWN])
        more = len(self.uncovered) - SHOWN
        if more > 0:
            shown += f" + {more} more"
        return f"{self.name}(batch | {rest}: {shown})"

    def resolved_rest(self) -> Strategy:
        """``rest`` as a configured strategy."""
        return self.rest if isinstance(self.rest, Strategy) else get_strategy(self.rest)

    def groups(self, problem: Problem) -> tuple[Group, ...]:
        """The groups of ``problem``'s targets (one where a closed form
        serves all of them, or none)."""
        names = problem.target_names
        every = tuple(range(len(names)))
        if self.uncovered is None:
            split = _split(problem)
            served = split[0] if split is not None else ()
            if split is None and _closed_forms_may_serve(problem):
                served = every
            if served and _refused(_batch(), problem.restricted(served)):
                served = ()  # batch where it runs: elsewhere the rest on all
            others = tuple(i for i in every if i not in set(served))
        else:
            missing = sorted(set(self.uncovered) - set(names))
            if missing:
                raise ValueError(
                    f"jacobian(strategy={self.label}): no target named "
                    f"{', '.join(repr(m) for m in missing)} in this problem "
                    f"(its targets: {', '.join(names)})."
                )
            others = tuple(i for i, n in enumerate(names) if n in self.uncovered)
            served = tuple(i for i, n in enumerate(names) if n not in self.uncovered)
        found = (Group(served, _batch()), Group(others, self.resolved_rest()))
        return tuple(g for g in found if g.indices)

    def check(self, problem: Problem) -> None:
        """Each group's strategy's checks, on the problem restricted to it
        (a refusal in this strategy's words, with the group's)."""
        for group in self.groups(problem):
            try:
                group.strategy.check(problem.restricted(group.indices))
            except ValueError as err:
                names = ", ".join(problem.target_names[i] for i in group.indices)
                raise ValueError(
                    f"jacobian(strategy={self.name!r}): its group of {names} on "
                    f"strategy={group.strategy.label!r} is refused: {err}"
                ) from None

    def check_draws(self, problem: Problem, why: str | None = None) -> None:
        """One group: its strategy's check. Several run a forward pass each:
        refused where no seed state pins the model's randomness."""
        groups = self.groups(problem)
        if len(groups) == 1:
            groups[0].strategy.check_draws(problem, why)
            return
        if problem.unpinned:
            raise ValueError(
                "jacobian(training=True): the model draws random numbers that "
                "jacobkit cannot hold fixed across forward passes, at "
                f"{state.where(problem.unpinned, problem.model)}; "
                f"strategy={self.label} runs a forward pass per group of "
                "targets, so they would see different draws. Use a strategy "
                "of one pass on every target, or draw through keras.random "
                "with a keras.random.SeedGenerator (keras.layers.Dropout does)."
            )

    def cannot_run(self, problem: Problem) -> str | None:
        return self.resolved_rest().cannot_run(problem)

    def computation(self, problem: Problem) -> Computation:
        """Each group's computation of ``problem``'s reduction on its
        targets, combined by the kind (:meth:`~jacobkit.problem.reduction.
        base.Reduction.grouped`), in one call."""
        groups = self.groups(problem)
        if len(groups) == 1:
            return groups[0].strategy.computation(problem)
        return problem.reduction.grouped(
            problem, [(g.indices, g.strategy.computation) for g in groups]
        )

    def build(self, problem: Problem) -> Callable[[Any], Any]:
        computed = self.computation(problem.with_reduction(Rows()))
        return lambda inputs: computed(inputs).values

    def smaller(self) -> Grouped | None:
        """The same groups, the rest holding less at once."""
        smaller = self.resolved_rest().smaller()
        return None if smaller is None else Grouped(smaller, self.uncovered)

    # memory: the generic group's (``batch`` holds a few rows' cotangents)
    def passes(self, problem: Problem) -> int:
        return self.resolved_rest().passes(problem)

    def rows_at_once(self, num_rows: int) -> int:
        return self.resolved_rest().rows_at_once(num_rows)

    def sequential_rows(self) -> bool:
        return self.resolved_rest().sequential_rows()

    def vectorized_rows(self) -> bool:
        return self.resolved_rest().vectorized_rows()

    def passes_in_flight(self, num_rows: int) -> int:
        return self.resolved_rest().passes_in_flight(num_rows)

    def rows_formed(self, num_rows: int) -> int:
        return self.resolved_rest().rows_formed(num_rows)

    def parts(self, problem: Problem) -> tuple[tuple[Strategy, Problem], ...]:
        """Each group's strategy, on the problem restricted to its targets."""
        return tuple(
            (g.strategy, problem.restricted(g.indices)) for g in self.groups(problem)
        )

    def formed_bytes(self, problem: Problem) -> int:
        """Each group's, on its targets."""
        return sum(s.formed_bytes(p) for s, p in self.parts(problem))


def _split(problem: Problem) -> tuple[tuple[int, ...], tuple[int, ...]] | None:
    """The positions ``batch`` runs and the others, where both are
    non-empty (a list of variables, rows that decompose per example); else
    ``None``, and ``None`` where the model draws randomness no seed state
    pins (``training=True``: the groups' passes would draw apart). Which
    targets a rule covers is read from the layers' types
    (nothing traced); ``batch``'s checks then run on all of them at once
    (one pass on two examples, kept per model), and only where they refuse,
    on halves of the layers, down to the layers they refuse (a layer a rule
    covers that ``batch`` cannot tap, as a causal LM's tied token
    embedding): about ``2 log2(layers)`` checks for one such layer."""
    if problem.tensor_targets is not None or problem.layer is not None:
        return None
    if not problem.rows_spec.decomposes_per_example or problem.unpinned:
        return None  # (unpinned randomness: one pass on every target)
    layers = forms.served(problem.model, problem.targets)
    if not layers:
        return None
    accepted = _accepted(problem, layers)
    served = tuple(sorted(i for layer in accepted for i in layer))
    if not served or len(served) == len(problem.targets):
        return None
    others = tuple(i for i in range(len(problem.targets)) if i not in set(served))
    return served, others


def _accepted(
    problem: Problem, layers: tuple[tuple[int, ...], ...]
) -> tuple[tuple[int, ...], ...]:
    """The layers (their targets' positions) ``batch``'s checks accept,
    bisected where they refuse some."""
    every = tuple(sorted(i for layer in layers for i in layer))
    if not _refused(_batch(), problem.restricted(every)):
        return layers
    if len(layers) == 1:
        return ()
    half = len(layers) // 2
    return _accepted(problem, layers[:half]) + _accepted(problem, layers[half:])


def _closed_forms_may_serve(problem: Problem) -> bool:
    """Whether closed forms may serve every target (``batch``'s checks
    decide)."""
    return (
        problem.tensor_targets is None
        and problem.rows_spec.decomposes_per_example
        and problem.forms is not None
    )


def _refused(strategy: Strategy, problem: Problem) -> bool:
    """Whether ``strategy``'s checks refuse ``problem`` (``batch``'s
    numeric checks are kept per model: one pass on two examples)."""
    try:
        strategy.check(problem)
    except ValueError:
        return True
    return False


def _batch() -> Strategy:
    return get_strategy("batch")
