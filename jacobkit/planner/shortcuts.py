"""``auto``'s candidates where an exact structural shortcut applies
(:mod:`jacobkit.problem.structure`), beside the ``batch`` strategy's closed form.

Measured (2-core CPU, steady calls, after the combine became one matmul):

| problem | rows | batch | structured(while) | structured(batch) |
|---|---|---:|---:|---:|
| MLP 32-64-64-144 B=16, ``hidden1`` | per-example | **3.8 ms** | 27 ms | 7.8 ms |
| MLP 32-64-64-144 B=64, ``hidden1`` | per-example | **9.7 ms** | 97 ms | 23 ms |
| generator B=16 T=64, ``conv1`` | per-example | 49 ms | 202 ms | **11 ms** |
| MLP 32-64-64-144 B=64, ``hidden1`` | features | 7.0 ms | 4.7 ms | **3.6 ms** |
| generator B=16 T=64, ``conv1`` | features | 48 ms | 16 ms | **9.3 ms** |
| generator B=64 T=128, ``conv1`` | features | 966 ms | **73 ms** | 163 ms |

(the last row from ``benchmarks/results/cpu/structure.md``). So:

- Per-example rows of a Dense/Conv layer: ``batch`` and the shortcut with
  ``batch`` inside are the candidates, started in the order
  :func:`shortcut_first` predicts; ``auto`` tries the other later.
- Other rows: the shortcut (``while`` inside) first, and with ``batch``
  inside as the next candidate where ``batch`` applies.
"""

from __future__ import annotations

import math
from collections.abc import Callable

from jacobkit import strategies
from jacobkit.problem import Problem, structure
from jacobkit.problem.plan import Rejection
from jacobkit.strategies import Strategy

#: the name the shortcut's rejections are filed under
NAME = "structured"


def candidates(
    problem: Problem,
    found: list[Strategy],
    fitting: Strategy,
    fits: Callable[[Strategy], bool],
    *,
    closed_form: bool,
) -> tuple[list[Strategy], list[Rejection]]:
    """The candidates where the shortcut ``fitting`` (made small enough for the
    budget) applies, first to run first, and the rejections of the rest of
    ``found``.

    Args:
        found: the registry's candidates that fit, ``batch`` among them
            where its closed form may apply.
        fits: whether a strategy fits the budget.
        closed_form: per-example rows of a Dense/Conv layer's own variables.
    """
    batch = next((s for s in found if s.name == "batch"), None)
    with_batch = None
    if batch is not None and _batch_inside_applies(problem, closed_form):
        with_batch = strategies.Structured(batch)
        if not fits(with_batch):
            with_batch = None
    if closed_form and batch is not None:
        if with_batch is None:
            kept = [batch, fitting]
        elif shortcut_first(problem):
            kept = [with_batch, batch]
        else:
            kept = [batch, with_batch]
    elif with_batch is not None and with_batch != fitting:
        kept = [fitting, with_batch]
    else:
        kept = [fitting]
    why = " and ".join(s.label for s in kept)
    verb = "apply" if len(kept) > 1 else "is exact"
    rejected = [
        Rejection(s, f"not needed: {why} {verb} here") for s in found if s not in kept
    ]
    if fitting not in kept:
        rejected.append(
            Rejection(fitting, f"per-example rows: {why} compute them faster")
        )
    return kept, rejected


def shortcut_first(problem: Problem) -> bool:
    """Whether the shortcut (``batch`` inside) is predicted to compute
    per-example rows of a Dense/Conv layer faster than ``batch`` alone.

    Separable channels: yes (one backward pass). A linear head on ``D``
    channels: per example, ``batch`` contracts ``F`` rows at ``c``
    multiply-adds each (``c`` = output positions x kernel size); the
    shortcut contracts ``D`` rows and combines them into ``F`` (``F x D x
    P`` for ``P`` parameters). Dense layers (one position: ``c < P``) never
    gain. A convolution does, by its backward passes (they shrink from F
    rows to D too): the generator's ``conv1`` (64 positions, kernel 5x8x32,
    D=32 of F=144) is predicted 1.5x faster by the count and measured 4.4x,
    so every convolution under a linear head (which is found only where
    D < F) starts on the shortcut."""
    found = structure.find(problem)
    if isinstance(found, structure.SeparableChannels):
        return True
    if problem.roles.kernel is None:
        return False
    if _positions(problem) > 1:
        # a convolution's rows each take a backward pass over every position
        # of the layers after it: D rows instead of F save more than the
        # contraction's count says (Conv1D T=64, 32 -> 32 -> 48 channels, a
        # linear head to F=64, per-example rows at B=64: the shortcut 85 ms,
        # batch 102 ms, though the count predicts batch faster)
        return True
    kernel = problem.targets[problem.roles.kernel]
    params = sum(t.shape.num_elements() for t in problem.targets)
    per_row = _positions(problem) * kernel.shape.num_elements()
    rows, width = problem.rows_shape[-1], found.width
    return per_row * (rows - width) > rows * width * params


def _batch_inside_applies(problem: Problem, closed_form: bool) -> bool:
    """Whether the shortcut with ``batch`` inside differs from it with
    ``while`` and may run: a Dense/Conv layer's own variables under a linear
    head (separable channels take one backward pass whatever is inside;
    per-example rows take it as the closed form's rival)."""
    if problem.tensor_targets is not None or problem.layer_rule is None:
        return False
    return closed_form or isinstance(structure.find(problem), structure.LinearHead)


def _positions(problem: Problem) -> int:
    """Output positions of the target layer per example (1 where unknown)."""
    try:
        shape = problem.layer.output.shape
    except (AttributeError, ValueError):
        return 1
    inner = shape[1:-1]
    if any(d is None for d in inner):
        return 1
    return math.prod(int(d) for d in inner)
