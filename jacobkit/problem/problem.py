"""The resolved problem: model + inputs + targets + rows, built once per call.

Strategies only see a :class:`Problem`: ``problem.rows(inputs)`` gives the
flat vector of rows, and ``problem.targets`` the ``tf.Variable`` objects to
differentiate. What it is made of is resolved by the modules beside it:
:mod:`~jacobkit.problem.rows` (``outputs=``, ``features=``),
:mod:`~jacobkit.problem.outputs` (``output=``),
:mod:`~jacobkit.problem.targets` (``layer=``) and
:mod:`~jacobkit.problem.inspect` (the one traced pass).
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import math
from collections.abc import Callable, Sequence
from typing import Any, NoReturn

import tensorflow as tf

from jacobkit import layers
from jacobkit.keras import compat, state
from jacobkit.keras import graph as taps
from jacobkit.problem import (
    arguments,
    cache,
    eager_inspect,
    forms,
    inspect,
    loss,
    rows,
    structural_inspect,
    targets,
)
from jacobkit.problem import outputs as model_outputs
from jacobkit.problem import tensor_targets as tensors
from jacobkit.problem.key import Differentiated, ProblemKey
from jacobkit.problem.loss import Loss
from jacobkit.problem.reduction import ClippedSum, Project, Reduction


class Problem:
    """Model, inputs, target variables and rows, resolved and checked once.

    Attributes:
        model: the callable being differentiated.
        inputs: the inputs as (nested) ``tf.Tensor``.
        targets: the ``tf.Variable`` objects to differentiate, in order.
        target_names: a unique name per target (``"dense/kernel"``).
        roles: which targets are the layer's kernel and bias
            (:class:`~jacobkit.problem.targets.Roles`).
        layer: the target layer, or ``None`` when variables were given.
        rows_shape: shape of the rows; each Jacobian is
            ``rows_shape + target.shape``.
        num_rows: ``prod(rows_shape)``, written ``R`` in the docs.
        batch_size: the leading dimension of the output ``Y``.
        output_width: the size of ``Y``'s last (feature) axis.
        output_dtype: dtype of the rows.
        has_loops: whether the model's computation runs a ``tf.while_loop``
            (a recurrent layer over time steps).
        output: the output picked by ``output=`` (index or name), or ``None``.
        reduction: what each row's gradient is reduced to
            (:mod:`jacobkit.problem.reduction`); ``reduce``, as the user
            spells it: ``None``, ``"norm"``, ``jk.ClippedSum`` or
            ``jk.Project``.
        activation_bytes: bytes of every floating tensor the forward pass
            makes: an upper bound on what one row's backward pass keeps.
        sequential_memory: what a row's backward pass holds where rows run
            one after another (:class:`~jacobkit.problem.liveness.SequentialMemory`;
            ``None`` where a ``tf.while_loop`` hides the tensors).
        forward_bytes: what an eager forward pass holds at its peak: the
            outputs of the layers of the model's functional graph
            (:func:`jacobkit.keras.layer_tree.output_bytes`), else every
            floating tensor of the traced pass.
        transposed: the operands of the forward pass's matrix products
            that their gradients take transposed
            (:class:`~jacobkit.problem.operands.Transposed`).
        convolutions: its backward pass's convolution kinds (``"conv2d"``,
            ...), ``convolution_gradients`` their ops (``None``: not read;
            :class:`jacobkit.layers.convolutions.Gradient`).
        key: what identifies it in the state kept per model
            (:class:`~jacobkit.problem.key.ProblemKey`, built once here).
    """

    def __init__(
        self,
        model: Any,
        inputs: Any,
        layer: Any,
        *,
        outputs: str | Callable[[Any], tf.Tensor] | Loss = "features",
        features: Sequence[int] | None = None,
        training: bool = False,
        unconnected: str = "error",
        output: int | str | None = None,
        reduce: str | ClippedSum | Project | None = None,
        reduced: bool = False,
    ) -> None:
        arguments.check_model(model)
        rows.check_mode(outputs)
        arguments.check_unconnected(unconnected)
        self.training = arguments.check_training(training)
        self.model = model
        #: what each row's gradient is reduced to (``reduce=``'s kind)
        self.reduction: Reduction = arguments.reduction_of(reduce)
        self.unconnected = unconnected
        self.output = arguments.check_output(output)
        self.inputs = arguments.to_tensors(inputs)
        arguments.check_examples(self.inputs)
        self._is_keras = compat.is_keras_layer(model)
        self.rows_spec = rows.Rows(outputs, rows.check_features(features))
        #: ``Inputs``/``Output`` targets (:mod:`.tensor_targets`), or None
        self.tensor_targets: tensors.TensorTargets | None = None
        resolved = targets.resolve(
            layer,
            model,
            ensure_built=self._ensure_built,
            tensor_targets=self._tensor_targets,
        )
        self.layer = resolved.layer
        self.targets: tuple[tf.Variable, ...] = resolved.variables
        self.target_names = resolved.names
        self.roles = resolved.roles
        self.tensor_targets = resolved.tensors
        ids = tuple(id(t) for t in self.targets)
        differentiated = Differentiated(ids, self.rows_spec, self.training, self.output)
        # a reduced call's (jk.gram's: reduced=True) inspection untraced
        reduced = reduced or self.reduction.reduces
        self.kept_pass = eager_inspect.Kept() if reduced else None
        eager = None if self.kept_pass is None else untraced
        inspection = inspect.inspect(self, differentiated, eager)
        self._take(inspection)
        self.key = ProblemKey(
            differentiated, id(self.layer), self.rows_shape, self.reduction
        )
        if self.unconnected == "error":
            targets.refuse_unconnected(model, resolved, inspection.connected)
        if self.blocked:
            tensors.check_independent(self)

    # -- resolution ---------------------------------------------------------
    def _tensor_targets(self, spec: Any) -> tensors.TensorTargets:
        return tensors.TensorTargets(
            spec,
            self.model,
            self.model_inputs(self.inputs),
            self._call,
            self.function,
            self.training,
            lambda name: targets.find_layer(self.model, name, with_variables=False),
        )

    def _ensure_built(self) -> None:
        if compat.unbuilt(self.model):
            try:
                self.call_model(tf.nest.map_structure(lambda t: t[:1], self.inputs))
            except (ValueError, TypeError, tf.errors.OpError) as err:
                self.raise_call_error(err)

    def raise_call_error(self, err: Exception) -> NoReturn:
        """jacobkit's message for a model that failed on these inputs."""
        arguments.raise_call_error(self.model, self.inputs, err, self.model_inputs)

    def _take(self, inspection: inspect.Inspection) -> None:
        """The shapes and facts of the traced pass (:mod:`.inspect`)."""
        outputs_shape, spec = inspection.outputs_shape, inspection.rows
        self.has_loops = inspection.has_loops
        self.activation_bytes = inspection.activation_bytes
        self.sequential_memory = inspection.sequential_memory
        # an eager Keras call holds its layers' outputs, else every floating
        # tensor traced (2x more on EfficientNetB0, 8x on a keras_hub BERT)
        self.forward_bytes = inspection.layer_outputs or inspection.forward_bytes
        self.convolutions = inspection.convolutions
        self.convolution_gradients = inspection.convolution_gradients
        self.transposed = inspection.transposed
        self.inspection_measured = inspection.measured  # else upper bounds
        #: with training=True, the random ops no Keras seed state pins
        self.unpinned = inspection.unpinned if self.training else ()
        self.rows_shape: tuple[int, ...] = tuple(spec.shape.as_list())
        # math.prod: np.prod took 5 us a call (a steady call's Python side)
        self.num_rows = math.prod(self.rows_shape)
        if self.blocked:  # K batch-summed rows, see :attr:`blocked`
            self.num_rows = math.prod(self.rows_shape[1:])
        self.output_dtype = spec.dtype
        self.batch_size = outputs_shape[0] if outputs_shape is not None else None
        self.output_width = outputs_shape[-1] if outputs_shape is not None else None

    # -- the target layer ---------------------------------------------------
    @functools.cached_property
    def layer_rule(self) -> layers.LayerRule | None:
        """The closed forms of the target layer (:mod:`jacobkit.layers`), or
        ``None`` for variables, tensor targets and unregistered layers."""
        return None if self.layer is None else layers.rule_for(self.layer)

    @functools.cached_property
    def projections(self) -> tuple[targets.Projection, ...] | None:
        """The linear parts of the target layer with the positions of their
        kernels and biases among the targets (:func:`targets.projections`),
        or ``None`` where the layer has no rule or the targets are not
        exactly those kernels and biases."""
        rule = self.layer_rule
        return None if rule is None else targets.projections(rule, self.targets)

    @functools.cached_property
    def forms(self) -> tuple[forms.LayerForm, ...] | None:
        """The closed forms serving the targets, one per layer
        (:mod:`.forms`): the target layer's, or the layers' among which a
        list of variables is shared out; ``None`` where no closed form
        serves some target (tensor targets, unregistered layers)."""
        if self.tensor_targets is not None:
            return None
        if self.layer is not None:
            rule, found = self.layer_rule, self.projections
            if rule is None or found is None:
                return None
            return (forms.LayerForm(self.layer, rule, found),)
        return forms.share_out(self.model, self.targets)

    @functools.cached_property
    def layer_tap(self) -> taps.LayerTap:
        """Runs the model with the target layer's node handed to a hook,
        without touching the model (raises ``TapError`` if it cannot)."""
        return taps.LayerTap(self.model, self.layer)

    # -- the computation strategies differentiate ---------------------------
    def call_model(self, inputs: Any, hook: taps.Hook | None = None) -> Any:
        """``Y = model(inputs)``, with ``training=`` for Keras models (the
        output picked by ``output=`` of a multi-output model); with a
        ``hook``, the target layer's node is computed by it (:attr:`layer_tap`).

        A float16 or bfloat16 output (mixed precision) is cast to float32
        first, so rows are summed, and cotangents seeded, in float32: each
        row's gradient then reaches the target variables as the loop's
        gradient of a float32 scalar does. Each pass draws alike (:func:`.state.drawn`).
        """
        inputs = self.model_inputs(inputs)
        with state.drawn():
            if hook is not None:
                outputs = self.layer_tap(inputs, self.training, hook)
            elif self.tensor_targets is not None:
                outputs = self.tensor_targets.call(inputs)
            else:
                outputs = self._call(inputs)
        if self.output is not None:
            outputs = model_outputs.pick(outputs, self.output, self.model)
        return tf.nest.map_structure(rows.at_least_float32, outputs)

    def _call(self, inputs: Any) -> Any:
        """The model's own call, every output (the taps run the same graph)."""
        if self._is_keras:
            return self.model(inputs, training=self.training)
        return self.model(inputs)

    def rows(self, inputs: Any) -> tf.Tensor:
        """The rows as a flat vector of length ``num_rows``.

        For :attr:`blocked` problems these are the per-example rows summed over
        the batch (``num_rows = K``), whose Jacobian holds every example's own
        block (see :mod:`jacobkit.problem.tensor_targets`)."""
        if self.blocked:
            return tf.reshape(tf.reduce_sum(self.per_example_rows(inputs), 0), (-1,))
        outputs = self.call_model(inputs)
        return tf.reshape(self.rows_spec.of(outputs, self.labels(inputs)), (-1,))

    def model_inputs(self, inputs: Any) -> Any:
        """What the model takes of ``inputs``: ``x`` of the ``(x, y[, w])``
        that loss rows take (:mod:`.loss`), else all of them."""
        if self.rows_spec.loss is None:
            return inputs
        return loss.split(inputs)[0]

    def labels(self, inputs: Any) -> tuple[Any, ...]:
        """``(y,)`` or ``(y, sample_weight)`` of loss rows' inputs; ``()``
        for other rows."""
        if self.rows_spec.loss is None:
            return ()
        return loss.split(inputs)[1]

    def per_example_rows(self, inputs: Any, hook: taps.Hook | None = None) -> tf.Tensor:
        """Rows before any sum over the batch: shape ``(B, K)``.

        Only for the built-in ``outputs`` modes. ``rows`` equals
        ``per_example_rows(...).sum(0)`` for ``"features"`` and the flattened
        ``per_example_rows(...)`` otherwise. ``hook`` as in :meth:`call_model`.
        """
        selected = self.rows_spec.select(self.call_model(inputs, hook))
        return self.rows_spec.per_example(selected, self.labels(inputs))

    @property
    def blocked(self) -> bool:
        """True for tensor targets with per-example rows (``"per_example"``,
        ``"full"``, loss rows): strategies compute ``K`` batch-summed rows and
        each result keeps only each example's own block, shape
        ``rows_shape + target.shape[1:]`` (:mod:`.tensor_targets`)."""
        return self.tensor_targets is not None and self.rows_spec.of_one_example

    def function(self, fn: Callable[..., Any]) -> Any:
        """``tf.function(fn)`` calling this problem's model: :func:`.state.function`'s
        (AutoGraph where needed), :func:`.cache.dispatched`, run light (all of it)."""
        compiled = state.function(fn, compat.needs_autograph(self.model), self.training)
        return compat.LightOptimized(cache.dispatched(compiled))

    @property
    def reduce(self) -> Any:
        """``reduce=`` as the user spells it (``None``, ``"norm"``, or the
        reduction object)."""
        return self.reduction.argument

    def with_reduction(self, kind: Reduction) -> Problem:
        """This problem reduced by ``kind`` in place of its own (a shallow
        copy: nothing is traced or checked again)."""
        other = copy.copy(self)
        other.reduction = kind
        other.key = dataclasses.replace(self.key, reduce=kind)
        return other

    def restricted(self, indices: Sequence[int]) -> Problem:
        """This problem on the targets at ``indices`` alone, as a list of
        variables (:func:`restricted`)."""
        return restricted(self, indices)

    def with_inputs(self, inputs: Any) -> Problem:
        """This problem on ``inputs`` of the same structure, shapes and dtypes
        (a shallow copy: nothing is traced or checked again)."""
        other = copy.copy(self)
        other.inputs = inputs
        return other

    def detached(self) -> Problem:
        """This problem without its input values, for what outlives the call.

        Compiled computations and found structures are cached per model and
        take the inputs as an argument; the problem they close over holds
        ``tf.TensorSpec``s in place of the inputs, so that the first call's
        inputs are not kept alive for the life of the model."""
        other = copy.copy(self)
        other.inputs = tf.nest.map_structure(
            lambda t: tf.TensorSpec(t.shape, t.dtype), self.inputs
        )
        other.kept_pass = None  # nor the first call's eager pass
        return other


def restricted(problem: Problem, indices: Sequence[int]) -> Problem:
    """``problem`` on the targets at ``indices`` alone (in that order),
    as a list of variables: what one group of a grouped plan computes
    (a shallow copy: nothing is traced again; its key names only those
    targets, so nothing kept for the whole problem is taken for it)."""
    chosen = tuple(indices)
    if chosen == tuple(range(len(problem.targets))):
        return problem
    if problem.tensor_targets is not None or not chosen:
        raise ValueError(
            "a problem is restricted to a non-empty subset of its variables"
        )
    other = copy.copy(problem)
    for cached in ("layer_rule", "projections", "forms", "layer_tap"):
        other.__dict__.pop(cached, None)
    other.layer = None
    other.targets = tuple(problem.targets[i] for i in chosen)
    other.target_names = tuple(problem.target_names[i] for i in chosen)
    other.roles = targets.Roles()
    differentiated = dataclasses.replace(
        problem.key.differentiated, targets=tuple(id(t) for t in other.targets)
    )
    other.key = dataclasses.replace(
        problem.key, differentiated=differentiated, layer=id(None)
    )
    return other


def untraced(problem: Any) -> inspect.Inspection | None:
    """A reduced call's inspection untraced: read from the model's structure
    where it tells for sure (:mod:`.structural_inspect`: no pass runs), else
    from eager passes (:mod:`.eager_inspect`, one kept in the problem's
    ``kept_pass`` for ``batch``'s checks), else ``None`` (the traced pass
    runs)."""
    found = structural_inspect.inspection(problem)
    return problem.kept_pass.inspection(problem) if found is None else found


def measure_inspection(problem: Problem) -> None:
    """Measure ``problem``'s memory facts by a pass (eager where it can tell,
    else traced) in place of the structure's upper bounds: what a plan under
    a tight memory budget reads (:mod:`jacobkit.planner.reduced`). Not kept
    per model: the plan is."""
    if problem.inspection_measured:
        return
    found = eager_inspect.inspection(problem)
    problem._take(inspect.trace(problem) if found is None else found)
