"""The resolved problem: model + inputs + targets + rows, built once per call.

Everything that depends on the Keras flavour (Keras 3, ``tf_keras``, a plain
``tf.Module`` or function) lives in this module. Strategies only see a
:class:`Problem`: ``problem.rows(inputs)`` gives the flat vector of rows, and
``problem.targets`` the ``tf.Variable`` objects to differentiate.
"""

from __future__ import annotations

import copy
import functools
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, NoReturn

import numpy as np
import tensorflow as tf

from jacobkit import linear, model_layers, model_outputs, norms, taps
from jacobkit import targets as tensor_targets

OUTPUT_MODES = ("features", "per_example", "full")
UNCONNECTED_MODES = ("error", "zero")
_SUPPORTED_LINEAR = {"Dense": "dense", "Conv1D": "conv1d", "Conv2D": "conv2d"}


def _keras3():
    try:
        import keras

        return keras if keras.__version__.startswith("3") else None
    except ImportError:  # pragma: no cover - keras ships with tensorflow
        return None


def _needs_autograph(model: Any) -> bool:
    """False for a Keras 3 layer or model, whose code AutoGraph never
    converts; True otherwise.

    NOTE (why AutoGraph is off for Keras 3 models). AutoGraph rewrites the
    Python source of every function a traced computation calls that is not on
    its do-not-convert list, jacobkit's own included: measured on the MLP of
    the auto benchmark (2-core CPU, TensorFlow 2.21), converting jacobkit's
    functions took 1.2 s of a 2.4-3.3 s first call, while tracing the model
    itself took 0.04 s. jacobkit's computations need none of it: their loops
    and conditions are TensorFlow ops (``tf.while_loop``, ``tf.map_fn``,
    ``tf.vectorized_map``) or Python over static values. What the model
    computes does not change either for a Keras 3 model: the ``keras``
    package is on AutoGraph's do-not-convert list and Keras 3 does not convert
    layers itself, so a Keras 3 model's code runs as written with AutoGraph on
    or off (checked: a subclassed layer with a Python ``if`` on a tensor fails
    the same way under both). A ``tf_keras`` model converts its subclassed
    layers' ``call`` only while AutoGraph is on, and a plain callable ``f(x)``
    is converted by it: those keep AutoGraph, and their first call keeps its
    cost.
    """
    keras = _keras3()
    return keras is None or not isinstance(model, keras.layers.Layer)


def _tf_keras():
    try:
        import tf_keras

        return tf_keras
    except ImportError:
        return None


def _is_keras_layer(obj: Any) -> bool:
    """True for a Keras 3 or ``tf_keras`` layer (models are layers too)."""
    return any(
        module is not None and isinstance(obj, module.layers.Layer)
        for module in (_keras3(), _tf_keras())
    )


def _is_layer(obj: Any) -> bool:
    """True for a Keras layer or any other ``tf.Module``."""
    return _is_keras_layer(obj) or isinstance(obj, tf.Module)


def as_tf_variable(variable: Any) -> tf.Variable:
    """The ``tf.Variable`` behind ``variable``.

    Keras 3 variables are not ``tf.Variable`` objects: ``tape.watch`` and
    ``tf.autodiff.ForwardAccumulator`` reject them. With the TensorFlow
    backend each one wraps a ``tf.Variable`` that every read goes through, so
    watching that one is watching the Keras variable. This is the one place
    jacobkit unwraps them.
    """
    if isinstance(variable, tf.Variable):
        return variable
    inner = getattr(variable, "_value", None)
    if isinstance(inner, tf.Variable):
        return inner
    raise TypeError(
        "jacobian(layer=...): expected a tf.Variable or keras.Variable in the "
        f"list of targets, got {type(variable).__name__}: {variable!r}. Pass a "
        "layer, a layer name, or a list of the model's variables."
    )


def _variable_name(variable: Any) -> str:
    name = getattr(variable, "path", None) or variable.name
    return name[:-2] if name.endswith(":0") else name


def _flat_layers(model: Any) -> list[Any]:
    """Every layer (or sub-module) of ``model``, nested ones included."""
    if hasattr(model, "_flatten_layers"):
        return list(model._flatten_layers(include_self=False, recursive=True))
    if isinstance(model, tf.Module):
        return list(model.submodules)
    return []


def _find_layer(model: Any, name: str) -> Any:
    layers = _flat_layers(model)
    for layer in layers:
        if layer.name == name:
            return layer
    names = [layer.name for layer in layers]
    close = model_layers.close_names(name, names)
    if close:
        hint = f"Did you mean {' or '.join(repr(n) for n in close)}?"
    elif names:
        shown = ", ".join(repr(n) for n in names[:10])
        more = f" and {len(names) - 10} more" if len(names) > 10 else ""
        hint = f"The model's layers are: {shown}{more}."
    else:
        hint = "The model has no named layers; pass a list of variables instead."
    raise ValueError(
        f"jacobian(layer={name!r}): the model has no layer named {name!r}. {hint}"
    )


def _layer_variables(layer: Any) -> list[Any]:
    kernel = getattr(layer, "kernel", None)
    if kernel is not None and not callable(kernel):
        bias = getattr(layer, "bias", None)
        return [kernel] + ([bias] if bias is not None else [])
    # Every weight that is trainable by nature, whether or not the layer is
    # frozen now: layer.trainable=False empties trainable_weights, but the
    # tf.Variable keeps the trainable flag it was created with (moving
    # statistics and other state are created non-trainable).
    weights = getattr(layer, "weights", None)
    if weights is None:
        weights = layer.variables
    return [
        w
        for w in weights
        if as_tf_variable(w).trainable and as_tf_variable(w).dtype.is_floating
    ]


@dataclass(frozen=True)
class Rows:
    """How rows are formed from the model output ``Y`` of shape ``(B, ..., F)``.

    ``mode`` is ``"features"``, ``"per_example"``, ``"full"`` or a callable
    ``g(Y)``; ``features`` keeps a subset of the last axis of ``Y`` first.
    """

    mode: str | Callable[[Any], tf.Tensor]
    features: tuple[int, ...] | None

    def select(self, outputs: Any) -> Any:
        if self.features is None:
            return outputs
        # Negative indices count from the end. They are made non-negative
        # here: tf.gather's gradient silently drops negative indices, which
        # made features=[-1] return an all-zero Jacobian.
        width = outputs.shape[-1]
        if width is None:
            indices = tf.math.floormod(
                tf.constant(self.features), tf.shape(outputs)[-1]
            )
        else:
            indices = [f % width for f in self.features]
        return tf.gather(outputs, indices, axis=-1)

    def of(self, outputs: Any) -> tf.Tensor:
        """The rows, shaped ``rows_shape``."""
        selected = self.select(outputs)
        if callable(self.mode):
            return tf.convert_to_tensor(self.mode(selected))
        if self.mode == "features":
            axes = list(range(selected.shape.rank - 1))
            return tf.reduce_sum(selected, axis=axes) if axes else selected
        if self.mode == "per_example":
            return self.per_example(selected)
        return selected

    def per_example(self, selected: tf.Tensor) -> tf.Tensor:
        """Per-example rows ``P`` of shape ``(B, K)``; each depends on one example.

        ``"features"`` rows are ``P.sum(axis=0)``; ``"per_example"`` and
        ``"full"`` rows are ``P`` itself (reshaped).
        """
        if self.mode == "full":
            return tf.reshape(selected, (selected.shape[0], -1))
        middle = list(range(1, selected.shape.rank - 1))
        return tf.reduce_sum(selected, axis=middle) if middle else selected

    @property
    def decomposes_per_example(self) -> bool:
        return not callable(self.mode)

    @property
    def summed_over_batch(self) -> bool:
        return self.mode == "features"


@dataclass(frozen=True)
class Inspection:
    """What one traced forward and backward pass of a problem shows (nothing
    runs).

    Attributes:
        outputs_shape: the model output's shape, ``None`` for several outputs.
        rows: the rows' shape and dtype.
        connected: per target, whether it reaches the rows.
        has_loops: whether the computation runs a ``tf.while_loop``.
        activation_bytes: bytes of every floating tensor the forward pass
            makes: an upper bound on what one row's backward pass keeps.
        gradient_op_types: the op types of the backward pass.
    """

    outputs_shape: tf.TensorShape | None
    rows: tf.TensorSpec
    connected: tuple[bool, ...]
    has_loops: bool
    activation_bytes: int
    gradient_op_types: frozenset[str]


class Problem:
    """Model, inputs, target variables and rows, resolved and checked once.

    Attributes:
        model: the callable being differentiated.
        inputs: the inputs as (nested) ``tf.Tensor``.
        targets: the ``tf.Variable`` objects to differentiate, in order.
        target_names: a unique name per target (``"dense/kernel"``).
        roles: ``{"kernel": i, "bias": j}`` for a layer's own variables.
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
    """

    def __init__(
        self,
        model: Any,
        inputs: Any,
        layer: Any,
        *,
        outputs: str | Callable[[Any], tf.Tensor] = "features",
        features: Sequence[int] | None = None,
        training: bool = False,
        unconnected: str = "error",
        output: int | str | None = None,
        reduce: str | None = None,
    ) -> None:
        if not callable(model):
            raise TypeError(
                "jacobian(model=...): expected a Keras model or a callable "
                f"f(inputs) -> tf.Tensor, got {type(model).__name__}."
            )
        if not (callable(outputs) or outputs in OUTPUT_MODES):
            raise ValueError(
                f"jacobian(outputs={outputs!r}): expected one of "
                f"{', '.join(repr(m) for m in OUTPUT_MODES)} or a callable "
                "g(Y) -> tf.Tensor whose every element is a row."
            )
        if unconnected not in UNCONNECTED_MODES:
            raise ValueError(
                f"jacobian(unconnected={unconnected!r}): expected 'error' (raise "
                "when a target does not influence the outputs) or 'zero' (return "
                "zeros for it)."
            )
        if not isinstance(training, (bool, np.bool_)):
            raise TypeError(
                f"jacobian(training={training!r}): expected True (training "
                "behaviour: dropout, batch statistics) or False (inference), got "
                f"{type(training).__name__}."
            )
        self.model = model
        #: ``None`` (Jacobians) or ``"norm"`` (each row's L2 norm, norms.py)
        self.reduce = norms.check_reduce(reduce)
        self.training = bool(training)
        self.unconnected = unconnected
        self.output = model_outputs.check_output_type(output)
        self.inputs = _to_tensors(inputs)
        self._is_keras = _is_keras_layer(model)
        self.rows_spec = Rows(outputs, _check_features_type(features))
        #: ``Inputs``/``Output`` targets (``jacobkit.targets``), or None
        self.tensor_targets: tensor_targets.TensorTargets | None = None
        self.layer, variables = self._resolve_targets(layer)
        self.targets: tuple[tf.Variable, ...] = tuple(
            as_tf_variable(v) for v in variables
        )
        self.target_names = (
            self.tensor_targets.names
            if self.tensor_targets is not None
            else _unique_names(variables, self._target_keys(variables))
        )
        self.roles = self._roles(variables)
        self._inspect()
        if self.blocked:
            tensor_targets.check_independent(self)

    # -- resolution ---------------------------------------------------------
    def _resolve_targets(self, layer: Any) -> tuple[Any, list[Any]]:
        if tensor_targets.is_tensor_target(layer):
            if isinstance(layer, tensor_targets.Output):
                self._ensure_built()
            self.tensor_targets = tensor_targets.TensorTargets(
                layer,
                self.model,
                self.inputs,
                self._call,
                self.function,
                self.training,
                lambda name: _find_layer(self.model, name),
            )
            return None, list(self.tensor_targets.variables)
        if isinstance(layer, str):
            self._ensure_built()
            layer = _find_layer(self.model, layer)
        if _is_layer(layer):
            self._ensure_built()
            variables = _layer_variables(layer)
            if not variables:
                raise ValueError(
                    f"jacobian(layer={layer.name!r}): layer {layer.name!r} "
                    f"({type(layer).__name__}) has no trainable variables, so it "
                    "has no Jacobian. Choose a layer with a kernel or bias "
                    "(Dense, Conv1D, Conv2D, ...), or pass a list of variables."
                )
            return layer, variables
        if isinstance(layer, (list, tuple)) and layer:
            for v in layer:
                as_tf_variable(v)
            return None, list(layer)
        raise TypeError(
            "jacobian(layer=...): expected a layer, a layer name or a non-empty "
            f"list of variables, got {type(layer).__name__}: {layer!r}."
        )

    def _ensure_built(self) -> None:
        if getattr(self.model, "built", True) is False:
            try:
                self.call_model(tf.nest.map_structure(lambda t: t[:1], self.inputs))
            except (ValueError, TypeError, tf.errors.OpError) as err:
                self._raise_call_error(err)

    def _target_keys(self, variables: list[Any]) -> list[str | None]:
        """Result keys: the layer path inside the model (``"head/kernel"``)."""
        if not self._is_keras:
            return [None] * len(variables)
        return model_layers.target_keys(self.model, variables, as_tf_variable)

    def _raise_call_error(self, err: Exception) -> NoReturn:
        """jacobkit's message for a model that failed on these inputs."""
        flat = tf.nest.flatten(self.inputs)
        mismatch = model_layers.input_mismatch(self.model, self.inputs, flat)
        if mismatch is not None:
            # the shapes say it all; the model's traced error would bury them
            raise ValueError(f"jacobian(inputs=...): {mismatch}") from None
        shapes = ", ".join(str(tuple(t.shape)) for t in flat)
        raise ValueError(
            f"jacobian(model=...): calling the model on inputs of shape {shapes} "
            f"failed: {model_layers.error_summary(err)} Check that the inputs "
            "are what the model takes (batch axis first)."
        ) from err

    def recurrent_layers(self) -> str | None:
        """``"layer 'lstm' (LSTM)"``: the recurrent layers (a ``tf.while_loop``
        over time) the targets' values flow through, or ``None``."""
        found = model_layers.recurrent_layers(self.model, self.layer)
        return model_layers.describe(found) if found else None

    def _roles(self, variables: list[Any]) -> dict[str, int]:
        roles = {}
        if self.layer is not None:
            for role in ("kernel", "bias"):
                variable = getattr(self.layer, role, None)
                for i, v in enumerate(variables):
                    if variable is not None and v is variable:
                        roles[role] = i
        return roles

    # -- the computation strategies differentiate ---------------------------
    def call_model(self, inputs: Any, hook: taps.Hook | None = None) -> Any:
        """``Y = model(inputs)``, with ``training=`` for Keras models (the
        output picked by ``output=`` of a multi-output model); with a
        ``hook``, the target layer's node is computed by it (:attr:`layer_tap`).

        A float16 or bfloat16 output (mixed precision) is cast to float32
        first, so rows are summed, and cotangents seeded, in float32: each
        row's gradient then reaches the target variables as the loop's
        gradient of a float32 scalar does.
        """
        if hook is not None:
            outputs = self.layer_tap(inputs, self.training, hook)
        elif self.tensor_targets is not None:
            outputs = self.tensor_targets.call(inputs)
        else:
            outputs = self._call(inputs)
        if self.output is not None:
            outputs = model_outputs.pick(outputs, self.output, self.model)
        return tf.nest.map_structure(_at_least_float32, outputs)

    def _call(self, inputs: Any) -> Any:
        """The model's own call, every output (the taps run the same graph)."""
        if self._is_keras:
            outputs = self.model(inputs, training=self.training)
        else:
            outputs = self.model(inputs)
        return outputs

    def rows(self, inputs: Any) -> tf.Tensor:
        """The rows as a flat vector of length ``num_rows``.

        For :attr:`blocked` problems these are the per-example rows summed over
        the batch (``num_rows = K``), whose Jacobian holds every example's own
        block (see :mod:`jacobkit.targets`)."""
        if self.blocked:
            return tf.reshape(tf.reduce_sum(self.per_example_rows(inputs), 0), (-1,))
        return tf.reshape(self.rows_spec.of(self.call_model(inputs)), (-1,))

    def per_example_rows(self, inputs: Any, hook: taps.Hook | None = None) -> tf.Tensor:
        """Rows before any sum over the batch: shape ``(B, K)``.

        Only for the built-in ``outputs`` modes. ``rows`` equals
        ``per_example_rows(...).sum(0)`` for ``"features"`` and the flattened
        ``per_example_rows(...)`` otherwise. ``hook`` as in :meth:`call_model`.
        """
        selected = self.rows_spec.select(self.call_model(inputs, hook))
        return self.rows_spec.per_example(selected)

    @property
    def blocked(self) -> bool:
        """True for tensor targets with per-example rows (``"per_example"``,
        ``"full"``): strategies compute ``K`` batch-summed rows and each
        result keeps only each example's own block, shape
        ``rows_shape + target.shape[1:]`` (:mod:`jacobkit.targets`)."""
        return self.tensor_targets is not None and self.rows_spec.mode in (
            "per_example",
            "full",
        )

    def shaped(self, jacobian: tf.Tensor, target: tf.Variable) -> tf.Tensor:
        """A strategy's ``(num_rows, *target.shape)`` Jacobian in the result's
        shape: ``rows_shape + target.shape``, or the own-example blocks
        ``rows_shape + target.shape[1:]`` when :attr:`blocked`. With
        ``reduce="norm"``: the norms ``(num_rows,)`` (``(K, B)`` blocked) as
        ``rows_shape``."""
        if self.reduce is not None:
            if self.blocked:
                jacobian = tf.transpose(jacobian)
            return tf.reshape(jacobian, self.rows_shape)
        if self.blocked:
            return tensor_targets.own_example_blocks(jacobian, self.rows_shape)
        return tf.reshape(jacobian, self.rows_shape + tuple(target.shape))

    # -- the target layer's linear part (for the batch strategy) ------------
    @property
    def linear_layer_kind(self) -> str | None:
        """``"dense"``, ``"conv1d"`` or ``"conv2d"`` when the target layer is one
        whose pre-activation output ``z`` is linear in its kernel and bias."""
        if self.layer is None:
            return None
        for cls in type(self.layer).__mro__:
            if cls.__name__ in _SUPPORTED_LINEAR and cls.__module__.startswith(
                ("keras", "tf_keras")
            ):
                return _SUPPORTED_LINEAR[cls.__name__]
        return None

    @functools.cached_property
    def layer_tap(self) -> taps.LayerTap:
        """Runs the model with the target layer's node handed to a hook,
        without touching the model (raises ``taps.TapError`` if it cannot)."""
        return taps.LayerTap(self.model, self.layer)

    def layer_linear(self, layer_inputs: tf.Tensor) -> tf.Tensor:
        """The target layer's pre-activation output for ``layer_inputs``,
        computed beside the layer with its own variables.

        Outside ``layer.__call__`` Keras does not autocast: under mixed
        precision the kernel is float32 and ``layer_inputs`` float16. ``z`` is
        computed in the kernel's dtype, so the contraction with the cotangents
        accumulates in float32, as the loop's gradient does."""
        kernel = self.targets[self.roles["kernel"]]
        bias = self.targets[self.roles["bias"]] if "bias" in self.roles else None
        return linear.pre_activation(
            self.layer,
            self.linear_layer_kind,
            tf.cast(layer_inputs, kernel.dtype),
            kernel,
            bias,
        )

    def layer_activation(self, z: tf.Tensor) -> tf.Tensor:
        """The target layer's activation applied to ``z``."""
        activation = getattr(self.layer, "activation", None)
        return z if activation is None else activation(z)

    # -- checks -------------------------------------------------------------
    def _inspect(self) -> None:
        """Trace one forward and backward pass (nothing runs): output shape and
        dtype, the ``features`` range and which targets reach the rows.

        What it finds is kept per model, targets, rows and input signature:
        tracing a model takes long (0.2 s for a small Conv1D stack), which a
        loop of ``jacobian()`` calls on the same model would pay every time.
        """
        signature = tuple(
            (tuple(t.shape), t.dtype.name) for t in tf.nest.flatten(self.inputs)
        )
        key = (
            tuple(id(t) for t in self.targets),
            self.rows_spec,
            self.training,
            self.output,
            signature,
            repr(tf.nest.map_structure(lambda _: 0, self.inputs)),
        )
        inspected = per_model(_INSPECTED, self.model)
        if key not in inspected:
            inspected[key] = self._trace()
        inspection: Inspection = inspected[key]
        outputs_shape, rows = inspection.outputs_shape, inspection.rows
        connected, self.has_loops = inspection.connected, inspection.has_loops
        #: bytes of every floating tensor the forward pass makes (from the
        #: same trace): an upper bound on what one row's backward pass keeps
        self.activation_bytes = inspection.activation_bytes
        #: the convolution kinds its backward pass runs (``"conv2d"``, ...;
        #: their CPU kernels' scratch space and accuracy depend on the CPU)
        self.convolutions = frozenset(
            CONVOLUTION_GRADIENTS[t]
            for t in inspection.gradient_op_types
            if t in CONVOLUTION_GRADIENTS
        )
        self.rows_shape: tuple[int, ...] = tuple(rows.shape.as_list())
        self.num_rows = int(np.prod(self.rows_shape, dtype=np.int64))
        if self.blocked:  # K batch-summed rows, see :attr:`blocked`
            self.num_rows = int(np.prod(self.rows_shape[1:], dtype=np.int64))
        self.output_dtype = rows.dtype
        self.batch_size = outputs_shape[0] if outputs_shape is not None else None
        self.output_width = outputs_shape[-1] if outputs_shape is not None else None
        unconnected = [n for n, ok in zip(self.target_names, connected) if not ok]
        if unconnected and self.unconnected == "error":
            self._check_layer_is_part_of_the_model()
            self._check_variables_are_the_models(unconnected)
            raise ValueError(
                f"jacobian(layer=...): target(s) {', '.join(unconnected)} do not "
                "influence the model's outputs, so their Jacobian is zero (a "
                "tape would return None). Pick a layer on the path to the "
                "outputs, or pass unconnected='zero' to get zeros."
            )

    def _check_layer_is_part_of_the_model(self) -> None:
        layer = self.layer
        if layer is None or not self._is_keras:
            return
        if model_layers.contains_layer(self.model, layer):
            return
        own = [n for n in _flat_layers(self.model) if n.name == layer.name]
        fix = (
            f"Pass its name ({layer.name!r}) or model.get_layer({layer.name!r}) "
            "to use this model's own layer of that name."
            if own
            else "Pass one of this model's layers (by name or object)."
        )
        raise ValueError(
            f"jacobian(layer=...): layer {layer.name!r} ({type(layer).__name__}) is "
            f"not part of the model {self.model.name!r}: it belongs to another "
            f"model, or was never called in this one, so it cannot influence the "
            f"outputs. {fix}"
        )

    def _check_variables_are_the_models(self, unconnected: list[str]) -> None:
        if self.layer is not None or not self._is_keras:
            return
        own = {id(as_tf_variable(w)) for w in getattr(self.model, "weights", ())}
        foreign = [
            name
            for name, target in zip(self.target_names, self.targets)
            if id(target) not in own
        ]
        if foreign and set(unconnected) <= set(foreign):
            one = len(foreign) == 1
            what = "is not a variable" if one else "are not variables"
            whose = "it belongs" if one else "they belong"
            raise ValueError(
                f"jacobian(layer=[...]): {', '.join(foreign)} {what} of the model "
                f"{self.model.name!r}: {whose} to another model, or to none, so "
                f"{'it' if one else 'they'} cannot influence the outputs. Pass "
                "this model's variables (model.get_layer(name).kernel, ...)."
            )

    def _trace(self) -> Inspection:
        """One forward and backward pass of the problem, traced."""
        found: dict[str, Any] = {}

        def probe(inputs):
            with tf.GradientTape(watch_accessed_variables=False) as tape:
                tape.watch(self.targets)
                try:
                    outputs = self.call_model(inputs)
                except model_outputs.OutputError as err:
                    found["invalid"] = err
                    return tf.constant(0.0)
                except (ValueError, TypeError, tf.errors.OpError) as err:
                    # raised below as jacobkit's own message, outside tf.function
                    found["call_failed"] = err
                    return tf.constant(0.0)
                found["outputs"] = outputs
                if not isinstance(outputs, tf.Tensor):
                    if not callable(self.rows_spec.mode):
                        return tf.constant(0.0)
                    rows = tf.convert_to_tensor(self.rows_spec.mode(outputs))
                else:
                    try:
                        _check_output(outputs, self.rows_spec)
                    except ValueError as err:
                        # Raised below, outside tf.function, which would
                        # otherwise prepend its "in user code:" traceback.
                        found["invalid"] = err
                        return tf.constant(0.0)
                    rows = self.rows_spec.of(outputs)
                found["rows"] = rows
                # the forward pass's ops come before the gradient's
                found["forward_ops"] = len(rows.graph.get_operations())
            if not rows.dtype.is_floating:
                return tf.constant(0.0)
            grads = tape.gradient(
                rows, self.targets, output_gradients=tf.ones_like(rows)
            )
            found["connected"] = [g is not None for g in grads]
            return tf.constant(0.0)

        graph = self.function(probe).get_concrete_function(self.inputs).graph
        if "call_failed" in found:
            self._raise_call_error(found["call_failed"])
        if "invalid" in found:
            raise found["invalid"]
        outputs = found["outputs"]
        if "rows" not in found:
            raise TypeError(
                "jacobian(model=...): the model returned "
                f"{type(outputs).__name__}, not a single tensor. Pick one with "
                f"output= ({model_outputs.choices(outputs, self.model)}), or "
                "pass outputs=callable that maps them to rows."
            )
        rows = found["rows"]
        if not rows.dtype.is_floating:
            raise TypeError(
                f"jacobian(model=...): the rows have dtype {rows.dtype.name}; "
                "Jacobians need a floating output (float16/32/64). Cast the "
                "output to float, or pick a floating output with outputs=callable."
            )
        outputs_shape = outputs.shape if isinstance(outputs, tf.Tensor) else None
        spec = tf.TensorSpec(rows.shape, rows.dtype)
        operations = graph.get_operations()
        loops = any(op.type in _LOOPS for op in operations)
        forward = operations[: found.get("forward_ops", 0)]
        backward = operations[found.get("forward_ops", 0) :]
        return Inspection(
            outputs_shape=outputs_shape,
            rows=spec,
            connected=tuple(found["connected"]),
            has_loops=loops,
            activation_bytes=_float_bytes(forward),
            gradient_op_types=frozenset(op.type for op in backward),
        )

    def function(self, fn: Callable[..., Any]) -> Any:
        """``tf.function(fn)`` for a computation that calls this problem's
        model, with AutoGraph only where the model's code needs it (see
        :func:`_needs_autograph`)."""
        return tf.function(fn, autograph=_needs_autograph(self.model))

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
        return self.with_inputs(
            tf.nest.map_structure(
                lambda t: tf.TensorSpec(t.shape, t.dtype), self.inputs
            )
        )

    @property
    def key(self) -> tuple:
        """Identifies what a compiled strategy depends on (besides the model).

        ``rows_shape`` is part of it: strategies build their computation for
        ``num_rows`` rows, and with ``outputs="per_example"`` or ``"full"``
        a new batch size changes it (the cached computation of the old size
        then failed on the new one).
        """
        return (
            tuple(id(t) for t in self.targets),
            self.rows_spec,
            self.rows_shape,
            self.training,
            id(self.layer),
            self.output,
            self.reduce,
        )


#: gradient op types -> the kind of convolution they differentiate
CONVOLUTION_GRADIENTS = {
    "Conv2DBackpropInput": "conv2d",
    "Conv2DBackpropFilter": "conv2d",
    "Conv3DBackpropInputV2": "conv3d",
    "Conv3DBackpropFilterV2": "conv3d",
    "DepthwiseConv2dNativeBackpropInput": "depthwise",
    "DepthwiseConv2dNativeBackpropFilter": "depthwise",
}
#: op types of a ``tf.while_loop`` (recurrent layers run one over time)
_LOOPS = ("While", "StatelessWhile")
#: op types whose outputs are not activations
_NOT_ACTIVATIONS = {"Const", "Placeholder", "ReadVariableOp", "Identity", "NoOp"}


def _float_bytes(operations: Sequence[Any]) -> int:
    """Bytes of the fully-shaped floating outputs of ``operations`` (less
    constants, inputs, variable reads and identities)."""
    total = 0
    for op in operations:
        if op.type in _NOT_ACTIVATIONS:
            continue
        for out in op.outputs:
            if out.dtype.is_floating and out.shape.is_fully_defined():
                total += out.shape.num_elements() * out.dtype.size
    return total


#: model -> {inspection key: what :meth:`Problem._inspect` found}
_INSPECTED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def per_model(cache: weakref.WeakKeyDictionary, model: Any) -> dict:
    """``model``'s entry in a cache that lives as long as the model does.

    A model that cannot be weakly referenced gets a fresh, unkept dict (no
    caching): keying it by ``id()`` instead could hand a later object that
    reuses the id a computation built for the old one.
    """
    try:
        return cache.setdefault(model, {})
    except TypeError:
        return {}


def _to_tensors(inputs: Any) -> Any:
    def convert(value):
        if isinstance(
            value, (tf.Tensor, tf.Variable, np.ndarray, np.generic, list, float, int)
        ):
            # a tf.Variable input is read: its value is the input tensor
            return tf.convert_to_tensor(value)
        raise TypeError(
            "jacobian(inputs=...): expected NumPy arrays or tf.Tensors (in a "
            f"tuple, list or dict for a multi-input model), got "
            f"{type(value).__name__}."
        )

    # A list of arrays is the inputs of a multi-input model; a list of
    # numbers or of lists (x.tolist()) is one array.
    if isinstance(inputs, (tuple, dict)) or (
        isinstance(inputs, list)
        and inputs
        and all(
            isinstance(v, (tf.Tensor, tf.Variable, np.ndarray, tuple, dict))
            for v in inputs
        )
    ):
        return tf.nest.map_structure(convert, inputs)
    return convert(inputs)


def _at_least_float32(value: Any) -> Any:
    """``value`` cast to float32 if it is a float16 or bfloat16 tensor."""
    if isinstance(value, tf.Tensor) and value.dtype in (tf.float16, tf.bfloat16):
        return tf.cast(value, tf.float32)
    return value


def _check_features_type(features: Sequence[int] | None) -> tuple[int, ...] | None:
    if features is None:
        return None
    not_indices = TypeError(
        f"jacobian(features={features!r}): expected a list of integer "
        "indices into the output's last axis, such as features=[0, 5, 7]."
    )
    try:
        indices = np.asarray(features)
    except (TypeError, ValueError) as err:
        raise not_indices from err
    if indices.size == 0 and indices.dtype != object:
        raise ValueError(
            f"jacobian(features={features!r}): choose at least one feature, "
            "such as features=[0, 5, 7], or pass features=None for all of them."
        )
    if indices.dtype.kind not in "iu":
        raise not_indices
    return tuple(int(f) for f in indices.reshape(-1))


def _check_output(outputs: Any, rows: Rows) -> None:
    if not isinstance(outputs, tf.Tensor):
        return
    if rows.features is not None:
        width = outputs.shape[-1]
        bad = [f for f in rows.features if not -width <= f < width]
        if bad:
            raise ValueError(
                f"jacobian(features={list(rows.features)!r}): index(es) {bad} "
                f"are out of range for an output with {width} features (shape "
                f"{tuple(outputs.shape)}). Valid indices are 0..{width - 1}."
            )
    if rows.mode == "per_example" and outputs.shape.rank < 2:
        raise ValueError(
            f"jacobian(outputs='per_example'): needs an output of shape "
            f"(batch, ..., features), got shape {tuple(outputs.shape)}. Use "
            "outputs='full' for one row per output element."
        )


def _unique_names(variables: list[Any], keys: Sequence[str | None]) -> tuple[str, ...]:
    names: list[str] = []
    for v, key in zip(variables, keys):
        name = key or _variable_name(v)
        base, n = name, 1
        while name in names:
            n += 1
            name = f"{base}_{n}"
        names.append(name)
    return tuple(names)
