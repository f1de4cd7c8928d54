"""What identifies a problem in the state kept per model: one record each.

- :class:`ProblemKey`: a :class:`~jacobkit.problem.Problem`'s identity,
  built once by the problem; every per-model cache keys by it (plus what its
  owner's values also depend on: a strategy's key, the inputs' shapes, the
  budget).
- :class:`Differentiated`: the part known before the one traced pass (which
  finds the rows' shape), so the traced pass is kept under it.
- :class:`CallKey`: a :class:`~jacobkit.problem.Call`'s arguments that
  shape its problems, for what is kept without building a problem
  (``jk.gram``'s chunk size).

Variables and layers count by identity (``id``): every cache is per model,
and the model holds its variables and layers (a tensor target's variables are
kept per model too), so an id is not reused while the cache lives. What
outlives the process uses names and hashes instead: the plan cache's files
(:func:`jacobkit.planner.cache.fingerprint`) and ``out=`` directories
(:mod:`jacobkit.batches.fingerprint`).
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass, field
from typing import Any

from jacobkit import layers
from jacobkit.problem.reduction import Reduction
from jacobkit.problem.rows import Rows


@dataclass(frozen=True)
class Differentiated:
    """What is differentiated, into which rows: all the traced pass depends
    on besides the inputs' signature.

    Attributes:
        targets: the target variables, by identity.
        rows: ``outputs=`` and ``features=``.
        training: the model's ``training`` flag.
        output: ``output=`` of a multi-output model, or ``None``.
        rules: the layer registry's version when the problem was made
            (``jk.layers.register`` adds closed forms: a plan that refused
            ``batch`` before it, or a traced pass without them, is not
            this problem's).
    """

    targets: tuple[int, ...]
    rows: Rows
    training: bool
    output: int | str | None
    rules: int = field(default_factory=layers.REGISTRY.current_version)


@dataclass(frozen=True)
class ProblemKey:
    """What a problem's compiled computations, found shortcuts, checks and
    plans depend on besides the model (built once by the problem).

    Attributes:
        differentiated: the targets and rows (:class:`Differentiated`).
        layer: the target layer, by identity (``id(None)`` for variables).
        rows_shape: the rows' shape: strategies build their computation for
            ``num_rows`` rows, and with ``outputs="per_example"`` or
            ``"full"`` a new batch size changes it.
        reduce: what each row's gradient is reduced to (``reduce=``'s kind,
            :mod:`jacobkit.problem.reduction`; ``Factors()`` for ``jk.gram``).
    """

    differentiated: Differentiated
    layer: int
    rows_shape: tuple[int, ...]
    reduce: Reduction


@dataclass(frozen=True)
class CallKey:
    """What a call's problems depend on besides the model and the inputs:
    its arguments, each hashable (a list of variables by identity).

    Attributes:
        layer: ``layer=``: a name, a layer or tensor target, or variables.
        outputs: ``outputs=`` (a ``jk.Loss`` made afresh per call is equal
            to the last one: a frozen record).
        features: ``features=``.
        training: the model's ``training`` flag.
        output: ``output=``.
    """

    layer: Hashable
    outputs: Hashable
    features: Hashable
    training: bool
    output: int | str | None


def hashable(value: Any) -> Hashable:
    """``value`` itself where it hashes; a list or tuple item by item; else
    by identity (variables do not hash)."""
    if isinstance(value, (list, tuple)):
        return tuple(hashable(v) for v in value)
    if type(value).__hash__ is None:  # a Keras variable: no exception raised
        return ("id", id(value))
    try:
        hash(value)
    except TypeError:
        return ("id", id(value))
    found: Hashable = value
    return found
