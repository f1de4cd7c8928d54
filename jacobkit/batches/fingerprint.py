"""What identifies a call writing into ``out=``: model, targets, rows, inputs.

A resumed call must be the same call as the one that wrote the directory;
:func:`fingerprint` describes the call (every weight hashed) as a
:class:`~jacobkit.batches.manifest.Fingerprint` that the store compares with
the one in its manifest.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from typing import Any

import numpy as np
import tensorflow as tf

from jacobkit import strategies
from jacobkit.batches.manifest import Fingerprint
from jacobkit.keras import compat
from jacobkit.problem import Problem
from jacobkit.problem.loss import Loss
from jacobkit.problem.solution import Solver


def model_fingerprint(model: Any) -> str:
    """sha256 over the model's class and every weight (name, shape, values)."""
    h = hashlib.sha256(type(model).__qualname__.encode())
    for w in compat.weights_or_variables(model):
        name = compat.variable_path(w)
        value = np.ascontiguousarray(np.asarray(w))
        h.update(f"{name}{value.dtype.str}{value.shape}".encode())
        h.update(value.tobytes())
    return h.hexdigest()[:32]


def fingerprint(
    problem: Problem,
    *,
    outputs: str | Callable[[Any], tf.Tensor] | Loss,
    strategy: Solver[strategies.Strategy],
    first: Any,
    steps: int | None,
) -> Fingerprint:
    """The call computing ``problem`` (built for the ``first`` batch, arrays
    ``(B, ...)``) over at most ``steps`` batches with ``strategy``."""
    if isinstance(outputs, str):
        mode = outputs
    elif isinstance(outputs, Loss):
        name = getattr(outputs.fn, "__qualname__", type(outputs.fn).__name__)
        mode = f"Loss({name}{', each=True' if outputs.each else ''})"
    else:
        mode = getattr(outputs, "__qualname__", type(outputs).__name__)
    features = problem.rows_spec.features
    return Fingerprint(
        model=model_fingerprint(problem.model),
        targets=[
            [name, list(t.shape), t.dtype.name]
            for name, t in zip(problem.target_names, problem.targets, strict=True)
        ],
        rows={
            "outputs": mode,
            "features": list(features) if features is not None else None,
            "training": problem.training,
            "unconnected": problem.unconnected,
            # only where set: directories written before reduce= resume
            **({"reduce": repr(problem.reduce)} if problem.reduction.reduces else {}),
        },
        strategy=_strategy_name(strategy),
        inputs={
            "structure": json.loads(
                json.dumps(
                    tf.nest.map_structure(
                        lambda a: [list(a.shape[1:]), a.dtype.name], first
                    ),
                    default=str,
                )
            ),
            "batch_size": int(tf.nest.flatten(first)[0].shape[0]),
            "steps": steps,
        },
    )


def _strategy_name(strategy: Solver[strategies.Strategy]) -> str:
    """How the manifest names the strategy: a registered name where the
    strategy is that name's default configuration (what ``strategy="while"``
    gives), else its label (``"chunked(8)"``). ``auto`` is ``"auto"`` either
    way (its label is its name)."""
    try:
        default = type(strategy)()
    except TypeError:  # a strategy with a required option
        return strategy.label
    return strategy.name if default == strategy else strategy.label
