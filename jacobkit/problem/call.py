"""One ``jacobian()`` call's arguments but its inputs: :class:`Call`.

:mod:`jacobkit.api` builds it once from the user's arguments; every batch of a
dataset, :func:`jacobkit.verify`, the command line and the benchmarks build
their :class:`~jacobkit.problem.Problem` from it with :meth:`Call.problem`,
the one place that hands the arguments on.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import tensorflow as tf

from jacobkit import layers
from jacobkit.problem import arguments, padding, rows, targets, tensor_targets
from jacobkit.problem.cache import PerModel, signature
from jacobkit.problem.key import CallKey, hashable
from jacobkit.problem.loss import Loss
from jacobkit.problem.problem import Problem
from jacobkit.problem.reduction import ClippedSum, Project, Reduction
from jacobkit.problem.solution import Solver

_STEADY = PerModel("each call's problem per input signature: a steady call's")


@dataclass(frozen=True)
class Call:
    """What a :func:`jacobkit.jacobian` call differentiates and how (its
    arguments but ``inputs``; see there for each). The cheap checks run when
    it is made, before anything is traced or allocated.

    Attributes:
        model: the model (a Keras model or any callable).
        layer: the target: a layer, a name or path, variables, or a tensor
            target (``Inputs()``, ``Output("layer")``).
        outputs: what a row is (``"features"``, ``"per_example"``,
            ``"full"`` or a callable).
        features: the kept indices of the output's last axis, or ``None``.
        training: the model's ``training`` flag.
        unconnected: ``"error"`` or ``"zero"`` for targets that do not
            influence the rows.
        output: which output of a multi-output model, or ``None``.
        reduce: ``None`` (Jacobians), ``"norm"``, ``jk.ClippedSum`` or
            ``jk.Project``.
        strategy: what computes the rows (a
            :class:`~jacobkit.problem.solution.Solver`): a configured
            strategy, or :class:`jacobkit.planner.Auto` (``None``:
            ``Auto()``). Both rank above the problem: the strategies'
            type is left open here (``Solver[Any]``).
        device: the device the call runs on (``None``: TensorFlow's
            placement).
        steps: at most this many batches of a dataset.
        out: a directory the Jacobians are written to, or ``None``.
        overwrite: with ``out``, discard what it holds.
        progress: show a progress bar over batches.
        distribute: a ``tf.distribute.Strategy`` the batches are spread over.
    """

    model: Any
    layer: Any
    outputs: str | Callable[[Any], tf.Tensor] | Loss = "features"
    features: Sequence[int] | None = None
    training: bool = False
    unconnected: str = "error"
    output: int | str | None = None
    reduce: str | ClippedSum | Project | None = None
    strategy: Solver[Any] | None = None
    device: str | None = None
    steps: int | None = None
    out: str | os.PathLike[str] | None = None
    overwrite: bool = False
    progress: bool = True
    distribute: tf.distribute.Strategy | None = None

    def __post_init__(self) -> None:
        arguments.check_eager()
        arguments.check_model(self.model)
        rows.check_mode(self.outputs)
        rows.check_features(self.features)
        arguments.check_unconnected(self.unconnected)
        arguments.check_steps(self.steps)
        arguments.check_training(self.training)
        arguments.check_reduce(self.reduce)
        if self.pads_batches:
            padding.check(self.outputs)
        arguments.check_output(self.output)

    @functools.cached_property
    def key(self) -> CallKey:
        """What this call's problems depend on besides the model and the
        inputs (:class:`~jacobkit.problem.key.CallKey`), for what is kept per
        model without building a problem: the arguments that make the
        targets and the rows."""
        return CallKey(
            hashable(self.layer),
            hashable(self.outputs),
            hashable(self.features),
            self.training,
            self.output,
        )

    @property
    def summed(self) -> bool:
        """Whether rows are summed over the batches of a dataset (not
        ``"per_example"`` or ``"full"``, whose rows follow each other)."""
        outputs = self.outputs
        if isinstance(outputs, Loss):
            return False
        return not (isinstance(outputs, str) and outputs in ("per_example", "full"))

    @property
    def reduction(self) -> Reduction:
        """``reduce=``'s kind (:mod:`jacobkit.problem.reduction`)."""
        return arguments.reduction_of(self.reduce)

    @property
    def pads_batches(self) -> bool:
        """Whether each batch is padded with examples of weight 0
        (``jk.ClippedSum(..., pad_batches=True)``)."""
        return self.reduction.pads_batches

    def padded(self, inputs: Any) -> tuple[Any, int | None]:
        """One batch ``inputs`` padded to its :func:`~jacobkit.problem.
        padding.bucket` size where the clipped sum asks for it, with the
        number of examples it had (``None``: not padded; an empty batch
        is not)."""
        if not self.pads_batches:
            return inputs, None
        return padding.padded(inputs)

    def problem(self, inputs: Any, reduced: bool = False) -> Problem:
        """The :class:`~jacobkit.problem.Problem` of one batch ``inputs``
        (arrays ``(B, ...)``, or the structure a multi-input model takes);
        ``reduced``: reduced whatever ``reduce=`` (``jk.gram``'s factors),
        so inspected as a reduced call is (:class:`~jacobkit.problem.Problem`).

        A steady call's is the last one built for the same arguments and
        input signature (kept per model, without input values), on these
        inputs, where its targets resolve to the same variables again (a
        layer made non-trainable, or given new variables, builds anew): its
        checks, inspection and keys are not made again (0.1-0.2 ms of a
        steady call on the reductions benchmark's conv net)."""
        tensors = arguments.to_tensors(inputs)
        key = self._steady_key(tensors, reduced)
        kept = {} if key is None else _STEADY.of(self.model)
        found = kept.get(key)
        if found is not None and self._same_targets(found):
            return found.with_inputs(tensors)
        problem = Problem(
            self.model,
            tensors,
            self.layer,
            outputs=self.outputs,
            features=self.features,
            training=self.training,
            unconnected=self.unconnected,
            output=self.output,
            reduce=self.reduce,
            reduced=reduced,
        )
        if key is not None:
            kept[key] = problem.detached()
        return problem

    def _steady_key(self, tensors: Any, reduced: bool) -> Any:
        """What a kept problem of these arguments and inputs is kept under
        (``None``: not kept: in a trace, tensor targets, inputs that are
        not all tensors)."""
        if not tf.executing_eagerly() or tensor_targets.is_tensor_target(self.layer):
            return None
        found = signature(tensors)
        if found is None:
            return None
        version = layers.REGISTRY.current_version()
        return (self.key, self.unconnected, self.reduction, reduced, version, found)

    def _same_targets(self, kept: Problem) -> bool:
        """Whether ``layer=`` resolves to ``kept``'s layer and variables
        still (the model is built: it was when ``kept`` was made)."""
        try:
            now = targets.resolve(
                self.layer,
                self.model,
                ensure_built=lambda: None,
                tensor_targets=_no_tensor_targets,
            )
        except (ValueError, TypeError):
            return False  # built anew: the problem raises its own error
        return now.layer is kept.layer and _same(now.variables, kept.targets)


def _same(a: tuple[Any, ...], b: tuple[Any, ...]) -> bool:
    return len(a) == len(b) and all(x is y for x, y in zip(a, b, strict=True))


def _no_tensor_targets(spec: Any) -> Any:
    raise TypeError(f"{spec!r}: a tensor target's problem is not kept")
