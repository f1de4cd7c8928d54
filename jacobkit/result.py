"""JacobianResult: the single statement of the shapes jacobkit returns.

It ranks above the strategies: it holds the configured
:class:`~jacobkit.strategies.Strategy` that ran and ``auto``'s
:class:`~jacobkit.planner.Plan` of them. What a call cost,
:class:`~jacobkit.problem.solution.Stats`, is a strategy's answer too and
lives below them, beside :class:`~jacobkit.problem.solution.Solution`.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import tensorflow as tf

from jacobkit.problem.plan import Plan
from jacobkit.problem.reduction import ClippedSum, Project
from jacobkit.problem.solution import Stats
from jacobkit.strategies.base import Strategy


@dataclass(frozen=True)
class JacobianResult(Mapping[str, Any]):
    """Per-row Jacobians of one model output with respect to target variables.

    For each target variable ``v`` the Jacobian has shape
    ``rows_shape + v.shape``: ``result[name][r]`` is the gradient of row ``r``
    with respect to ``v``. With the default ``outputs="features"`` and a layer
    target, ``kernel`` has shape ``(F, *layer.kernel.shape)`` and ``bias``
    shape ``(F, *layer.bias.shape)``.

    ``strategy`` is the name of the strategy that ran (for ``auto``: the one
    later calls run), ``strategy_config`` the configured instance
    (``Chunked(chunk_size=8)``, ``While(parallel_iterations=2)``) and
    ``chunk_size`` its chunk size, if it has one.

    Index by the variable's key (``result["head/kernel"]``), by its role
    (``result["kernel"]``) or by position (``result[0]``). A key is the path
    of the layer that holds the variable inside the model, then the
    variable's name: ``"head/kernel"`` for a ``Sequential`` and a functional
    model alike (the model's own name is never part of it), with the names
    of nested sub-models and wrapped layers in front where there are some
    (``"backbone/conv1/kernel"``, ``"lstm/lstm_cell/recurrent_kernel"``).
    Variables outside the model's layers (and those of a ``tf.Module``) are
    keyed by their own name.

    Tensor targets are named ``"inputs"`` (``"inputs/<name>"`` for one of
    several inputs) and ``"<layer>/output"``; their per-example rows keep only
    each example's own block, shape ``rows_shape + target.shape[1:]``
    (:mod:`jacobkit.problem.tensor_targets`).

    With ``reduce="norm"`` each entry is instead the L2 norm of every row's
    Jacobian, shape ``rows_shape``. With ``reduce=jk.ClippedSum(C)`` each
    entry is the sum over rows of the rows' gradients clipped to norm ``C``
    (over all targets together), in the target's own shape, and ``norms``
    holds every row's norm before clipping, shape ``rows_shape``. With
    ``reduce=jk.Project(dim)`` each entry is the target's part of every
    row's projection, shape ``rows_shape + (dim,)``, and :attr:`projection`
    their sum: the projection of each row's whole gradient.

    The Jacobians are ``tf.Tensor`` objects, except after
    ``jacobian(..., out=DIR)``: then they are read-only ``numpy.memmap``
    arrays of the ``.npy`` files in ``DIR`` (read from disk when indexed).
    """

    jacobians: dict[str, tf.Tensor | np.ndarray]
    rows_shape: tuple[int, ...]
    strategy: str
    chunk_size: int | None
    stats: Stats
    roles: dict[str, str] = field(default_factory=dict)
    plan: Plan[Strategy] | None = None
    strategy_config: Strategy | None = None
    reduce: str | ClippedSum | Project | None = None
    norms: tf.Tensor | np.ndarray | None = None

    @property
    def kernel(self) -> tf.Tensor:
        """Jacobian of the rows with respect to the layer's kernel,
        shape ``rows_shape + kernel.shape``."""
        return self["kernel"]

    @property
    def bias(self) -> tf.Tensor:
        """Jacobian of the rows with respect to the layer's bias,
        shape ``rows_shape + bias.shape``."""
        return self["bias"]

    @property
    def projection(self) -> Any:
        """With ``reduce=jk.Project(dim)``: each row's gradient, over every
        target, mapped to ``dim`` numbers, shape ``rows_shape + (dim,)``
        (the sum of the targets' parts)."""
        if not isinstance(self.reduce, Project):
            raise AttributeError(
                "JacobianResult.projection: only with reduce=jk.Project(dim); "
                f"this result has reduce={self.reduce!r}."
            )
        parts = list(self.jacobians.values())
        if len(parts) > 1 and all(isinstance(p, tf.Tensor) for p in parts):
            # one AddN, not an eager add per target (BERT tiny's 41 parts:
            # 40 ops of (32, 2048) each, a new result held after each)
            return tf.add_n(parts)
        total = parts[0]  # the memmaps of out=DIR summed by NumPy
        for part in parts[1:]:
            total = total + part
        return total

    def __getitem__(self, key: str | int) -> tf.Tensor:
        if isinstance(key, int) and not isinstance(key, bool):
            values = list(self.jacobians.values())
            if -len(values) <= key < len(values):
                return values[key]
            raise KeyError(
                f"JacobianResult[{key}]: index out of range for "
                f"{len(values)} target(s): "
                f"{', '.join(map(repr, self.jacobians))}"
            )
        if key in self.jacobians:
            return self.jacobians[key]
        if key in self.roles:
            return self.jacobians[self.roles[key]]
        raise KeyError(
            f"JacobianResult[{key!r}]: no such target. Targets: "
            f"{', '.join(map(repr, self.jacobians))}"
            + (f"; roles: {', '.join(map(repr, self.roles))}" if self.roles else "")
        )

    def __iter__(self) -> Iterator[str]:
        return iter(self.jacobians)

    def __len__(self) -> int:
        return len(self.jacobians)

    def numpy(self) -> dict[str, np.ndarray]:
        """Every Jacobian as a NumPy array, keyed by variable name."""
        return {name: np.asarray(value) for name, value in self.jacobians.items()}

    def __repr__(self) -> str:
        shapes = ", ".join(
            f"{name}: {tuple(value.shape)}" for name, value in self.jacobians.items()
        )
        chunk = f", chunk_size={self.chunk_size}" if self.chunk_size else ""
        return (
            f"JacobianResult(strategy={self.strategy!r}{chunk}, "
            f"rows_shape={self.rows_shape}, {shapes}, "
            f"wall_time_s={self.stats.wall_time_s:.4f})"
        )
