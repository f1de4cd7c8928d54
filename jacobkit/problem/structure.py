"""Exact shortcuts that a model's structure allows, found from its functional graph.

Two structures are recognised, each only where it is certain (a Keras 3
functional or ``Sequential`` model with one output, every layer on the path
a stock Keras class used once); anywhere else :func:`find` says why not:

- a linear head (:mod:`.linear_head`: the model ends in a linear ``Dense``,
  whose ``D`` input rows stand for its ``F`` rows);
- separable channels (:mod:`.separable_channels`: the target's output
  channel ``f`` reaches only output feature ``f``; one backward pass).

Within a linear head's rows, one more step (:mod:`.conv_channels`): the
head's input is a convolution's output, each row one channel of it, so the
rows' cotangents at the convolution's input come from one small convolution
each (:func:`find_conv_channels`).

Each module's NOTE says why its shortcut is exact. This one finds them and
keeps what it found per model and problem.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import tensorflow as tf

from jacobkit.problem import conv_channels, functional, linear_head, separable_channels
from jacobkit.problem.cache import PerModel
from jacobkit.problem.conv_channels import ConvChannels
from jacobkit.problem.functional import NotApplicable
from jacobkit.problem.linear_head import LinearHead
from jacobkit.problem.problem import Problem
from jacobkit.problem.separable_channels import SeparableChannels

__all__ = [
    "ConvChannels",
    "LinearHead",
    "NotApplicable",
    "SeparableChannels",
    "Structure",
    "find",
    "find_conv_channels",
    "find_head",
    "find_separable",
]

Structure = LinearHead | SeparableChannels

_FOUND = PerModel("find: the exact shortcut found per problem, or why none")
_HEADS = PerModel("find_head: the linear head found at any width per problem")
_CONVS = PerModel("find_conv_channels: the one-channel rows found per problem")


def find(problem: Problem) -> Structure:
    """The exact shortcut ``problem`` allows (cached per model and problem).

    Separable channels are tried first (the target is then the last layer
    with variables, so no linear head lies after it), then a linear head.

    Raises:
        NotApplicable: neither applies, or it is not certain; the message
            gives each reason.
    """
    return _cached(_FOUND.of(problem.model), problem, _find)


def _cached(
    cache: dict[Any, Any],
    problem: Problem,
    finder: Callable[[Problem], Any],
) -> Any:
    """``finder(problem)`` kept in ``cache`` (the model's entry of one of
    this module's slots) per problem, or the reason it raised
    :class:`NotApplicable` (raised again)."""
    key = problem.key
    if key not in cache:
        try:
            found = finder(problem)
            if isinstance(found, LinearHead):
                # the cache outlives the call: no input values in it (use
                # ``found.sub_problem.with_inputs(problem.inputs)``)
                found = replace(found, sub_problem=found.sub_problem.detached())
            cache[key] = found
        except NotApplicable as err:
            # the reason only: a kept exception keeps its traceback, whose
            # frames keep their callers' locals (auto's whole first result)
            cache[key] = _Reason(str(err))
    found = cache[key]
    if isinstance(found, _Reason):
        raise NotApplicable(found.text)
    return found


@dataclass(frozen=True)
class _Reason:
    """Why no shortcut applies to a problem (cached)."""

    text: str


def find_separable(problem: Problem) -> SeparableChannels:
    """Only the separable-channels structure (for a linear head's sub-problem)."""
    return separable_channels.find(problem, functional.graph(problem))


def _find(problem: Problem) -> Structure:
    graph = functional.graph(problem)
    reasons = []
    finders: tuple[Callable[[], Structure], ...] = (
        lambda: separable_channels.find(problem, graph),
        lambda: linear_head.find(problem, graph, known=_known_head(problem)),
    )
    for finder in finders:
        try:
            return finder()
        except NotApplicable as err:
            reasons.append(str(err))
    raise NotApplicable("; ".join(reasons))


def find_conv_channels(problem: Problem) -> ConvChannels:
    """The rows of ``problem`` (a linear head's sub-problem) as one channel
    each at a convolution's output (cached per model and problem; a
    detached problem is traced on zeros of its inputs' shapes).

    Raises:
        NotApplicable: they are not, or not certainly.
    """
    found = _cached(
        _CONVS.of(problem.model),
        problem,
        lambda p: conv_channels.find(_on_values(p), functional.graph(p)),
    )
    assert isinstance(found, ConvChannels)
    return found


def _on_values(problem: Problem) -> Problem:
    """``problem`` on zeros where it holds ``tf.TensorSpec``s (a detached
    problem: what is found from it keeps no values)."""
    return problem.with_inputs(
        tf.nest.map_structure(
            lambda t: tf.zeros(t.shape, t.dtype) if isinstance(t, tf.TensorSpec) else t,
            problem.inputs,
        )
    )


def find_head(problem: Problem) -> LinearHead:
    """The model's linear head whatever its width (cached per model and
    problem): ``batch`` seeds its backward pass at the head's input with the
    head's kernel columns, which skips the head's own backward from one-hot
    rows, also where the head is wider than the rows (where :func:`find`
    refuses it: combining ``D > F`` rows would cost more, not less).

    Raises:
        NotApplicable: the model does not end in a linear head, or not
            certainly.
    """
    found = _cached(_HEADS.of(problem.model), problem, _any_head)
    assert isinstance(found, LinearHead)
    return found


def _any_head(problem: Problem) -> LinearHead:
    """The linear head of any width (:func:`find_head`). A detached problem
    (a strategy's build) holds specs: zeros of their shapes serve (the
    head's sub-problem keeps no values)."""
    problem = _on_values(problem)
    return linear_head.find(
        problem,
        functional.graph(problem),
        narrower=False,
        known=_known_head(problem),
    )


def _known_head(problem: Problem) -> LinearHead | None:
    """The linear head :func:`find` or :func:`find_head` already found for
    ``problem`` (the same head and sub-model, whichever asked first), so
    that its sub-problem, a traced pass of the sub-model, is built once."""
    for known in (
        _FOUND.of(problem.model).get(problem.key),
        _HEADS.of(problem.model).get(problem.key),
    ):
        if isinstance(known, LinearHead):
            return known
    return None
