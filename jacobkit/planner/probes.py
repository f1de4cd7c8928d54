"""Measuring: run a strategy on a real call, and the sizes ``auto``'s memory
prior needs."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import tensorflow as tf

from jacobkit import memory
from jacobkit.problem import Problem
from jacobkit.problem.plan import Probe
from jacobkit.strategies import Strategy


@dataclass(frozen=True)
class Ran:
    """One run: every row's ``(R, *v.shape)`` Jacobians per target, and what
    the run measured."""

    jacobians: tuple[tf.Tensor, ...]
    probe: Probe


def run(strategy: Strategy, problem: Problem, call: int, device: str | None) -> Ran:
    """Compute every row of ``problem`` with ``strategy``: the Jacobians and
    the :class:`Probe`.

    Peak memory is measured on ``device`` (``None``: not measured; see
    :func:`peak_measurable`). Raises what the strategy raises (out-of-memory
    included).
    """
    begin = time.perf_counter()
    peak = None
    if device is not None:
        with memory.PeakMemory(device) as measured:
            output, stats = strategy.run(problem)
        peak = measured.extra_bytes
    else:
        output, stats = strategy.run(problem)
    seconds = time.perf_counter() - begin
    probe = Probe(
        strategy=strategy,
        call=call,
        start=0,
        rows=problem.num_rows,
        seconds=seconds,
        traced=stats.traced,
        peak_bytes=peak,
        # compiled before this plan ran it: its trace was measured then
        first_call_s=(
            stats.trace_time_s if not stats.traced and stats.trace_time_s else None
        ),
    )
    return Ran(tuple(output.values), probe)


def peak_measurable(device: str) -> bool:
    """Whether ``device`` reports peak memory (the CPU only with TensorFlow's
    BFC allocator, see :func:`jacobkit.memory.enable_cpu_memory_stats`)."""
    try:
        with memory.PeakMemory(device):
            pass
    except RuntimeError:
        return False
    return True


def result_bytes(problem: Problem) -> int:
    """Bytes of the Jacobians of every row."""
    rows = problem.num_rows
    params = sum(t.shape.num_elements() for t in problem.targets)
    return rows * params * problem.output_dtype.size


def input_shapes(problem: Problem) -> tuple[Any, ...]:
    """The inputs' shapes and dtypes (plans depend on them, not only on rows)."""
    return tuple(
        (tuple(t.shape), t.dtype.name) for t in tf.nest.flatten(problem.inputs)
    )
