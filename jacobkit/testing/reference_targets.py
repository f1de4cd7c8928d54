"""What :func:`~jacobkit.testing.float64_reference` differentiates: every
``layer=`` that :func:`jacobkit.jacobian` takes, resolved once on the model,
then found again in its float64 copy.

- a layer, its name or path, or a list of variables: those variables (a
  layer's kernel and bias, or its trainable variables), found in the copy by
  their position in ``model.weights`` (a copy keeps the order);
- ``Inputs()``, ``Inputs("name")``, ``Inputs(1)``: input tensors, by their
  position among the flattened inputs;
- ``Output("layer")`` (a name, a path or the layer): the layer's output
  activation, found in the copy by the layer's path.

A name names what it names for :func:`jacobkit.jacobian` (the same resolver
reads it); the rows and every gradient are then taken by plain tapes in
:mod:`jacobkit.testing.reference`, one per row.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import tensorflow as tf

from jacobkit.keras import compat, graph, layer_tree
from jacobkit.problem import targets as layer_targets
from jacobkit.problem import tensor_targets as tensors


@dataclass(frozen=True)
class ReferenceTarget:
    """One ``layer=`` resolved for the reference: exactly one of
    ``variables``, ``inputs`` and ``layer`` says what is differentiated.

    Attributes:
        names: the result name of each source, as :func:`jacobkit.jacobian`
            names them (``"head/kernel"``, ``"inputs/b"``, ``"conv2/output"``).
        variables: the model's variables.
        inputs: positions of the differentiated tensors among the flattened
            inputs, or ``None``.
        layer: the layer whose output is differentiated, or ``None``.
    """

    names: tuple[str, ...]
    variables: tuple[Any, ...] = ()
    inputs: tuple[int, ...] | None = None
    layer: Any = None

    @property
    def is_tensor(self) -> bool:
        """Whether the sources are tensors (``Inputs``/``Output``), whose
        per-example rows keep each example's own block only."""
        return self.inputs is not None or self.layer is not None

    def on_copy(self, model: Any, copy: Any) -> ReferenceTarget:
        """The same target in ``copy``, a float64 copy of ``model``."""
        if self.layer is not None:
            path = _path_of(model, self.layer)
            found = [layer for layer, p in layer_tree.named_layers(copy) if p == path]
            if len(found) != 1:  # a subclassed copy's layers get names anew
                index = [p for _, p in layer_tree.named_layers(model)].index(path)
                found = [layer_tree.named_layers(copy)[index][0]]
            return ReferenceTarget(self.names, layer=found[0])
        if self.inputs is not None:
            return self
        weights = compat.weights(copy)
        return ReferenceTarget(
            self.names,
            variables=tuple(weights[_position(model, v)] for v in self.variables),
        )

    def sources(
        self,
        model: Any,
        inputs: Any,
        call_kwargs: Mapping[str, Any],
        tape: tf.GradientTape,
    ) -> tuple[Any, list[Any]]:
        """``model(inputs)`` inside ``tape``, and the tensors or variables to
        differentiate, watched."""
        if self.inputs is not None:
            flat = [tf.convert_to_tensor(t) for t in tf.nest.flatten(inputs)]
            watched = [flat[i] for i in self.inputs]
            tape.watch(watched)
            packed = tf.nest.pack_sequence_as(inputs, flat)
            return model(packed, **call_kwargs), watched
        if self.layer is not None:
            tap = graph.LayerTap(model, self.layer, lookup=True)
            training = bool(call_kwargs.get("training", False))
            outputs, activation = watched_output(tap, tape, inputs, training)
            return outputs, [activation]
        watched = [compat.as_tf_variable(v) for v in self.variables]
        tape.watch(watched)
        return model(inputs, **call_kwargs), watched


def watched_output(
    tap: graph.LayerTap, tape: tf.GradientTape, inputs: Any, training: bool
) -> tuple[Any, Any]:
    """``tap``'s model run on ``inputs`` with the tapped layer's output
    watched by ``tape`` (call it inside the tape's block, eager or traced):
    the model's outputs, and that layer output, as the layer gave it."""
    found: list[Any] = []

    def hook(call: Any, args: Any, kwargs: Any) -> Any:
        activation = call(*args, **kwargs)
        tape.watch(activation)
        found.append(activation)
        return activation

    outputs = tap(inputs, training, hook)
    return outputs, found[0]


def resolve(layer: Any, model: Any, inputs: Any) -> ReferenceTarget:
    """``layer=`` (anything :func:`jacobkit.jacobian` takes) on ``model``."""
    if isinstance(layer, tensors.Inputs):
        indices, names = tensors.select_inputs(layer, model, inputs)
        flat = tf.nest.flatten(inputs)
        bad = [n for i, n in zip(indices, names) if not _floating(flat[i])]
        if bad:
            raise TypeError(
                f"float64_reference(layer=Inputs({layer.name!r})): input(s) {bad} "
                "are not floating (integer tokens or ids have no gradient). "
                "Differentiate a floating input, or the output of the layer "
                "that embeds them: Output('embedding')."
            )
        result = tuple("inputs" if len(flat) == 1 else f"inputs/{n}" for n in names)
        return ReferenceTarget(result, inputs=tuple(indices))
    if isinstance(layer, tensors.Output):
        found = layer.layer
        if isinstance(found, str):
            _build(model, inputs)
            found = layer_targets.find_layer(model, found, with_variables=False)
        try:
            graph.LayerTap(model, found, lookup=True)
        except graph.TapError as err:
            raise ValueError(
                f"float64_reference(layer=Output({found.name!r})): {err}. Choose "
                "a layer that runs once in a functional or Sequential model (as "
                "jacobian() does)."
            ) from err
        return ReferenceTarget((f"{found.name}/output",), layer=found)
    resolved = layer_targets.resolve(
        layer,
        model,
        ensure_built=lambda: _build(model, inputs),
        tensor_targets=_no_tensor_targets,
    )
    return ReferenceTarget(resolved.names, variables=resolved.variables)


def _floating(value: Any) -> bool:
    return bool(tf.as_dtype(getattr(value, "dtype", tf.float32)).is_floating)


def _build(model: Any, inputs: Any) -> None:
    """Call an unbuilt model on its first example (a layer is then found)."""
    if compat.unbuilt(model):
        model(tf.nest.map_structure(lambda t: t[:1], inputs))


def _no_tensor_targets(spec: Any) -> Any:
    raise AssertionError(f"tensor targets are resolved above: {spec!r}")


def _path_of(model: Any, layer: Any) -> str:
    for candidate, path in layer_tree.named_layers(model):
        if candidate is layer:
            return path
    raise ValueError(
        f"float64_reference(layer=Output({layer.name!r})): the layer is not part "
        "of the model; pass one of the model's own layers or its name."
    )


def _position(model: Any, variable: Any) -> int:
    """Where ``variable`` is in ``model.weights`` (a copy keeps the order)."""
    handle = compat.as_tf_variable(variable)
    for i, weight in enumerate(compat.weights(model)):
        if compat.as_tf_variable(weight) is handle:
            return i
    raise ValueError(
        f"float64_reference(layer=...): {compat.variable_path(variable)} is not "
        "a variable of the model; pass the model's own variables."
    )
