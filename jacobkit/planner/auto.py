"""``strategy="auto"`` as one object: :class:`Auto`.

``Auto`` is configured like any strategy (a frozen record of its options:
the memory budget, the device, the plan cache) and run like one
(:meth:`Auto.solve`, by :mod:`jacobkit.engine`'s one path). It owns its
state: the planning sessions it keeps per model (in
:class:`~jacobkit.problem.cache.Slot` ``SESSIONS``, keyed by the problem, the
input shapes, its own options and the policy), and the plans of reduced
calls (:mod:`jacobkit.planner.reduced`). Two equal ``Auto`` objects share
their sessions, so ``strategy="auto"`` on every call plans once, as a named
strategy traces once.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace
from typing import Any, ClassVar, final

from jacobkit import memory, strategies
from jacobkit.keras import state
from jacobkit.planner import calls, probes, reduced
from jacobkit.planner.opening import open_session
from jacobkit.planner.plan import Plan
from jacobkit.planner.policy import current_policy
from jacobkit.planner.session import Session
from jacobkit.problem import Problem, inspect
from jacobkit.problem.cache import Slot, model_state
from jacobkit.problem.reduce import ClippedSum
from jacobkit.strategies import Solution, Strategy


@final
@dataclass(frozen=True)
class Auto:
    """The first answer as fast as the best single strategy, then the fastest
    strategy that fits the memory budget (see :mod:`jacobkit.planner`).

    ``jacobian(..., strategy=Auto(memory_budget="1GiB"))`` is
    ``jacobian(..., strategy="auto", memory_budget="1GiB")``.

    Attributes:
        memory_budget: bytes, a string like ``"2GiB"``, a fraction of free
            device memory, or ``None`` (the default fraction, see
            :data:`jacobkit.memory.DEFAULT_BUDGET_FRACTION`).
        device: whose memory the budget is of, and where peaks are measured
            (``None``: the CPU, or the device the call runs on).
        cache: read and write the plan cache on disk
            (:mod:`jacobkit.planner.cache`); ``False``: plan in memory only.
    """

    name: ClassVar[str] = "auto"
    memory_budget: int | float | str | None = None
    device: str | None = None
    cache: bool = True

    def __post_init__(self) -> None:
        # a bad budget or device is refused now, before any model is traced
        if self.memory_budget is not None:
            memory.parse_budget(self.memory_budget, free=1 << 40)
        if self.device is not None:
            try:
                memory.normalize_device(self.device)
            except (TypeError, ValueError) as err:
                raise ValueError(
                    f"Auto(device={self.device!r}): not a device name; use "
                    "'CPU:0' or 'GPU:0' (or None: the CPU, or the call's device)."
                ) from err
        if not isinstance(self.cache, bool):
            raise TypeError(
                f"Auto(cache={self.cache!r}): expected True (use the plan cache "
                "on disk) or False (plan in memory only)."
            )

    @property
    def label(self) -> str:
        return self.name

    def solve(self, problem: Problem) -> Solution:
        """One call: every row of ``problem`` by the strategy the session
        picks; the solution names what later calls run and the plan.
        ``stats.planning_time_s`` is the time spent outside the run that
        computed the rows (the budget check, the memory prior, the cache).
        Where the model draws randomness no seed state pins (:func:`unpinned`),
        one strategy whose result comes from one pass, and nothing probed."""
        if unpinned(problem):
            return one_pass(problem).solve(problem)
        if problem.reduce is not None:
            return self.reduced(problem).solve(problem)
        start = time.perf_counter()
        session = self._session(problem)
        solved = calls.run_call(session, problem)
        session.persist()
        stats = solved.stats
        planning = max(time.perf_counter() - start - stats.wall_time_s, 0.0)
        return replace(solved, stats=replace(stats, planning_time_s=planning))

    def plan(self, problem: Problem) -> Plan:
        """What the next call on ``problem`` runs and what is known (nothing
        is run: before the first call, the strategy it starts on and its
        predicted peak, or what the disk cache holds)."""
        if problem.reduce is not None:
            return self.reduced(problem).plan()
        return self._session(problem).plan()

    def reduced(self, problem: Problem) -> reduced.Reduced:
        """For a reduced call (``reduce="norm"``, ``jk.ClippedSum``,
        ``jk.Project``): ``batch``'s closed forms where they apply, else
        ``chunked`` with the most rows at once that fit the budget, kept
        per problem and configuration (:mod:`jacobkit.planner.reduced`)."""
        device = memory.normalize_device(self.device)
        kept = model_state(problem.model, Slot.SESSIONS)
        key = ("reduced", problem.key, probes.input_shapes(problem), self, device)
        if key not in kept:
            kept[key] = reduced.Reduced(
                problem, self.memory_budget, device, current_policy()
            )
        found: reduced.Reduced = kept[key]
        return found

    def _session(self, problem: Problem) -> Session:
        """This process's session for ``problem`` under this configuration
        and the current policy: made (or continued from the disk cache) on
        the first call, the same one on every later call."""
        device = memory.normalize_device(self.device)
        policy = current_policy()
        key = (problem.key, probes.input_shapes(problem), self, device, policy)
        sessions: dict[Any, Session] = model_state(problem.model, Slot.SESSIONS)
        if key not in sessions:  # a repeated call plans (and fingerprints) nothing
            sessions[key] = open_session(
                problem, self.memory_budget, device, policy, self.cache
            )
        return sessions[key]


def unpinned(problem: Problem) -> tuple[str, ...]:
    """With ``training=True``, the model's random ops that no Keras seed
    generator's state pins (:func:`jacobkit.keras.state.unpinned`): each
    forward pass draws them anew. Empty otherwise."""
    if not problem.training:
        return ()
    return inspect.inspect(problem).unpinned


def one_pass(problem: Problem) -> Strategy:
    """``auto``'s pick where the model's randomness cannot be pinned: ``batch``
    where it serves, its result (a clipped sum's too) from one forward
    pass; else ``chunked``, whose rows come from one pass, except for a
    clipped sum (two passes there: refused, :func:`check_one_draw`)."""
    try:
        strategies.Batch().check(problem)
    except ValueError as err:
        chunked = strategies.Chunked()
        check_one_draw(problem, chunked, why=str(err))
        return chunked
    return strategies.Batch()


def check_one_draw(problem: Problem, chosen: Any, why: str | None = None) -> None:
    """Refuse what would mix draws of randomness no seed state pins: a
    clipped sum from two passes (the rows' norms from one, the weighted sum
    from another: an example's contribution is then not clipped to C), or
    ``forward``'s pass per chunk of tangents (rows from different masks)."""
    found = unpinned(problem)
    if not found or isinstance(chosen, Auto):
        return
    two_pass = isinstance(problem.reduce, ClippedSum) and not chosen.clips
    if not (two_pass or chosen.name == "forward"):
        return
    where = state.where(found, problem.model)
    what = (
        f"reduce={problem.reduce!r} on strategy={chosen.name!r} takes each "
        "row's norm from one forward pass and the clipped sum from another"
        if two_pass
        else "strategy='forward' runs a forward pass per chunk of tangents"
    )
    batch = "" if why is None else f" (strategy='batch' cannot run here: {why})"
    raise ValueError(
        f"jacobian(training=True): the model draws random numbers that jacobkit "
        f"cannot hold fixed across forward passes, at {where}: stateful random "
        "ops, not drawn from a Keras SeedGenerator, so every pass draws anew. "
        f"{what}, so they would see different draws (for a clipped sum: an "
        "example's contribution is no longer bounded by C). Use strategy="
        f"'batch', whose result comes from one pass{batch}; or draw through "
        "keras.random with a keras.random.SeedGenerator (Keras 3's "
        "keras.layers.Dropout does), which jacobkit pins."
    )
