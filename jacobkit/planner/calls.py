"""Running one ``auto`` call: the session's strategy on every row, the run
both the answer and a measurement.

An out-of-memory error (or a run over the budget) makes the strategy
:meth:`~jacobkit.strategies.Strategy.smaller` for this call's retry and
every later call; a run over the budget keeps its rows (they were computed
whole). A candidate that refuses or fails is dropped; so is a starting
strategy that refuses before computing anything (the next candidate starts
instead). Every change goes through :class:`~jacobkit.planner.session.Session`'s
methods.
"""

from __future__ import annotations

import time

import tensorflow as tf

from jacobkit.planner import probes
from jacobkit.planner.session import Session
from jacobkit.problem import Problem
from jacobkit.problem.plan import Probe
from jacobkit.problem.reduction import Output
from jacobkit.problem.solution import Solution, Stats
from jacobkit.strategies import Strategy


def run_call(session: Session, problem: Problem) -> Solution[Strategy]:
    """One call of ``session`` on ``problem``: the Jacobians, their Stats, the
    strategy later calls run and the plan."""
    call = session.begin_call()
    begin = time.perf_counter()
    runs: list[Probe] = []
    while True:
        strategy = session.choose()
        try:
            ran = probes.run(strategy, problem, call, session.device)
        except tf.errors.ResourceExhaustedError:
            session.back_off(strategy, "ran out of memory")
            continue
        except Exception as err:
            if not session.drop(strategy, err):
                raise
            continue
        session.record(ran.probe)
        runs.append(ran.probe)
        if session.over_budget(ran.probe):
            session.back_off(strategy, "went over the budget", ran.probe.peak_bytes)
        break
    session.end_call(tuple(runs))
    probe = ran.probe
    known = session.estimate(probe.strategy) if probe.traced else None
    stats = Stats(
        wall_time_s=time.perf_counter() - begin,
        trace_time_s=(known.trace_s if known is not None else None) or 0.0,
        traced=probe.traced,
        peak_bytes=probe.peak_bytes,
        num_rows=probe.rows,
    )
    return Solution(Output(ran.jacobians), stats, session.current, session.plan())
