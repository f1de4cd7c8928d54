"""Tensor targets: the model's inputs (``Inputs``) and a layer's output
activation (``Output``), beside the layer and variable targets.

>>> import keras, numpy as np, jacobkit as jk
>>> model = keras.Sequential([keras.Input((4,)),
...                           keras.layers.Dense(3, name="head")])
>>> x = np.ones((2, 4), "float32")
>>> res = jk.jacobian(model, x, jk.Inputs(), outputs="per_example")
>>> list(res), tuple(res["inputs"].shape)     # (B, F, *x.shape[1:])
(['inputs'], (2, 3, 4))

How they are differentiated. A tensor ``a`` made inside the forward pass
cannot be watched before the strategy runs, so the forward pass adds a zero
``tf.Variable`` ``d`` of ``a``'s shape to it (``a + d``; ``d`` is private to
jacobkit, never assigned) and the strategies differentiate with respect to
``d`` exactly as with respect to a layer's kernel: ``dr/dd = dr/da``. Every
strategy that takes variables takes these.

Per-example rows store only their own example's block. A per-example row
``P[b, k]`` depends on example ``b`` only, so its gradient with respect to
``a`` (shape ``(B, ...)``) is zero outside ``a[b]``, and
``d(sum_b P[b, k]) / d a[b] = d P[b, k] / d a[b]``: the ``K`` batch-summed
rows give every block at the price of ``K`` rows instead of ``B × K``. The
result is reshaped to ``(B, K, *a.shape[1:])``. This holds only when examples
do not mix (no batch statistics in training mode); that is checked once,
numerically, and refused otherwise.

Result names: ``"inputs"`` for a single-input model (``"inputs/<name>"`` for
each input of several, the Keras input name or the dict key), and
``"<layer>/output"`` for ``Output("<layer>")``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import tensorflow as tf

from jacobkit.keras import compat, layer_tree
from jacobkit.keras import graph as taps
from jacobkit.problem.cache import PerModel

_DELTAS = PerModel("each tensor target's zero variables, added where it is tapped")
_OUTPUT_SPECS = PerModel("an Output() target's shape and dtype per input signature")
_INDEPENDENT = PerModel("the problems whose examples were checked independent")


@dataclass(frozen=True)
class Inputs:
    """Target: the model's input tensors.

    ``Inputs()`` differentiates every input (one result per input);
    ``Inputs("name")`` one input of a multi-input model, by its Keras input
    name, its dict key or its position. Each result has shape
    ``rows_shape + x.shape``, or ``(B, K, *x.shape[1:])`` for per-example rows
    (own-example blocks only; see the module docstring).
    """

    name: str | int | None = None


@dataclass(frozen=True, eq=False)
class Output:
    """Target: the output activation of one layer of a functional Keras model.

    ``Output("conv3")`` (a layer name or the layer object). The result is
    named ``"conv3/output"`` and has shape ``rows_shape + a.shape``, or
    ``(B, K, *a.shape[1:])`` for per-example rows. The layer must run once per
    forward pass, in a functional or Sequential model (subclassed models have
    no graph to tap without changing the layer). A tied embedding (called
    once on token ids, and again for the logits, as keras_hub's causal LMs
    call it) is the one exception: its output is its lookup's.
    """

    layer: Any

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Output):
            return False
        if isinstance(self.layer, str):
            return other.layer == self.layer
        return other.layer is self.layer

    def __hash__(self) -> int:
        layer = self.layer if isinstance(self.layer, str) else id(self.layer)
        return hash(("Output", layer))


def is_tensor_target(target: Any) -> bool:
    return isinstance(target, (Inputs, Output))


def _input_names(model: Any, inputs: Any) -> list[str]:
    """One name per flattened input: dict keys, Keras input names, or indices."""
    flat = tf.nest.flatten(inputs)
    if isinstance(inputs, dict):
        return [str(k) for k in sorted(inputs)]
    names = compat.input_names(model)
    if len(names) == len(flat) and all(isinstance(n, str) for n in names):
        return [str(n).split(":")[0] for n in names]
    return [str(i) for i in range(len(flat))]


def select_inputs(spec: Inputs, model: Any, inputs: Any) -> tuple[list[int], list[str]]:
    """The positions among the flattened ``inputs`` that ``spec`` names, and
    their names (every input for ``Inputs()``)."""
    names = _input_names(model, inputs)
    if spec.name is None:
        return list(range(len(names))), names
    if isinstance(spec.name, int) and -len(names) <= spec.name < len(names):
        index = spec.name % len(names)
        return [index], [names[index]]
    if spec.name in names:
        return [names.index(spec.name)], [spec.name]
    raise ValueError(
        f"jacobian(layer=Inputs({spec.name!r})): the model has no input "
        f"{spec.name!r}; its inputs are {names}. Pass one of those names, a "
        "position, or Inputs() for all of them."
    )


class TensorTargets:
    """Resolved ``Inputs``/``Output`` targets of one problem.

    Attributes:
        names: result names, in order.
        variables: the private zero variables added to the target tensors,
            one per name, each of the tensor's full shape ``(B, ...)``.
    """

    def __init__(
        self,
        spec: Inputs | Output,
        model: Any,
        inputs: Any,
        call: Callable[[Any], Any],
        function: Callable[[Callable[..., Any]], Any],
        training: bool,
        find_layer: Callable[[str], Any],
    ) -> None:
        self.spec = spec
        self._call = call
        self._function = function
        self._training = training
        self._tap: Any = None
        if isinstance(spec, Inputs):
            self._indices, names = select_inputs(spec, model, inputs)
            flat = tf.nest.flatten(inputs)
            tensors = [flat[i] for i in self._indices]
            bad = [n for n, t in zip(names, tensors) if not t.dtype.is_floating]
            if bad:
                raise TypeError(
                    f"jacobian(layer=Inputs({spec.name!r})): input(s) {bad} are "
                    "not floating (integer tokens or ids have no gradient). "
                    "Differentiate a floating input, or the output of the layer "
                    "that embeds them: Output('embedding')."
                )
            self.names = tuple(
                "inputs" if len(flat) == 1 else f"inputs/{n}" for n in names
            )
            specs = [tf.TensorSpec(t.shape, t.dtype) for t in tensors]
        else:
            layer = spec.layer
            if isinstance(layer, str):
                layer = find_layer(layer)
            try:
                self._tap = taps.LayerTap(model, layer, lookup=True)
            except taps.TapError as err:
                raise ValueError(
                    f"jacobian(layer=Output({layer.name!r})): {err}. Choose a "
                    "layer that runs once in a functional or Sequential model."
                ) from err
            self.names = (f"{layer.name}/output",)
            specs = [self._output_spec(inputs, layer.name)]
        key = (spec, tuple(specs), training)
        cache = _DELTAS.of(model)
        if key not in cache:
            # float16/bfloat16 activations (mixed precision) get a float32
            # variable, cast where it is added: their Jacobians come back in
            # float32, like a layer's float32 variables under the same policy
            cache[key] = tuple(
                tf.Variable(
                    tf.zeros(s.shape, _result_dtype(s.dtype)),
                    trainable=False,
                    name=f"jacobkit_target_{i}",
                )
                for i, s in enumerate(specs)
            )
        self.variables: tuple[tf.Variable, ...] = cache[key]

    def _output_spec(self, inputs: Any, name: str) -> tf.TensorSpec:
        """The layer's output shape and dtype for inputs like ``inputs``,
        traced once per (model, layer, input signature, training): a trace of
        the whole model costs more than a small call (0.65 s per call on
        MobileNetV2 before this was kept)."""
        layer_tap = self._tap
        assert layer_tap is not None, "an Output target has its tap"
        signature = (
            name,
            id(layer_tap.layer),
            self._training,
            tf.nest.map_structure(lambda t: (tuple(t.shape), t.dtype.name), inputs),
        )
        specs = _OUTPUT_SPECS.of(layer_tap.model)
        key = repr(signature)
        if key not in specs:
            specs[key] = self._trace_output_spec(inputs, name)
        spec: tf.TensorSpec = specs[key]
        return spec

    def _trace_output_spec(self, inputs: Any, name: str) -> tf.TensorSpec:
        found: list[Any] = []

        def hook(call, args, kwargs):
            outputs = call(*args, **kwargs)
            found.append(outputs)
            return outputs

        layer_tap = self._tap
        assert layer_tap is not None, "an Output target has its tap"
        tap = self._function(lambda x: layer_tap(x, self._training, hook))
        try:
            tap.get_concrete_function(inputs)
        except (ValueError, TypeError) as err:  # the model refuses the inputs
            flat = tf.nest.flatten(inputs)
            mismatch = layer_tree.input_mismatch(layer_tap.model, inputs, flat)
            if mismatch is None:
                raise
            raise ValueError(f"jacobian(inputs=...): {mismatch}") from err
        outputs = found[0]
        if not isinstance(outputs, tf.Tensor) or not outputs.dtype.is_floating:
            raise TypeError(
                f"jacobian(layer=Output({name!r})): the layer returns "
                f"{type(outputs).__name__}, not one floating tensor; choose a "
                "layer with a single floating output."
            )
        return tf.TensorSpec(outputs.shape, outputs.dtype)

    @property
    def layer(self) -> Any:
        """The layer of an ``Output`` target; ``None`` for ``Inputs``."""
        return None if self._tap is None else self._tap.layer

    # -- the forward pass, with the zero variables added ---------------------
    def call(self, inputs: Any) -> Any:
        """The model's outputs, each target tensor ``a`` replaced by ``a + d``."""
        if self._tap is None:
            flat = list(tf.nest.flatten(inputs))
            for index, delta in zip(self._indices, self.variables):
                flat[index] = flat[index] + tf.cast(delta, flat[index].dtype)
            return self._call(tf.nest.pack_sequence_as(inputs, flat))
        (delta,) = self.variables

        def hook(call, args, kwargs):
            outputs = call(*args, **kwargs)
            return outputs + tf.cast(delta, outputs.dtype)

        return self._tap(inputs, self._training, hook)


def _result_dtype(dtype: tf.DType) -> tf.DType:
    """float32 for a half-precision tensor target, else its own dtype."""
    return tf.float32 if dtype in (tf.float16, tf.bfloat16) else dtype


def check_independent(problem: Any) -> None:
    """Refuse per-example blocks when the model mixes examples (checked once
    per model and problem): example 0's rows, weighted at random, must have a
    zero gradient on every other example of each target tensor."""
    checked = _INDEPENDENT.of(problem.model)
    if problem.key in checked or (problem.batch_size or 0) < 2:
        return
    variables = list(problem.targets)
    with tf.GradientTape(watch_accessed_variables=False) as tape:
        tape.watch(variables)
        per_example = problem.per_example_rows(problem.inputs)
    weights = tf.random.stateless_normal(
        per_example.shape[1:], seed=(0, 1), dtype=per_example.dtype
    )
    first = tf.one_hot(0, per_example.shape[0], dtype=per_example.dtype)
    grads = tape.gradient(
        per_example,
        variables,
        output_gradients=first[:, None] * weights[None, :],
        unconnected_gradients=tf.UnconnectedGradients.ZERO,
    )
    for name, grad in zip(problem.target_names, grads):
        # float64: a float16 gradient (mixed precision) would overflow or
        # divide by zero in float16 (a NumPy RuntimeWarning), 1e-30 being 0
        grad = np.asarray(grad, dtype="float64")
        total = np.max(np.abs(grad)) + 1e-30
        leak = np.max(np.abs(grad[1:])) / total
        if leak > 1e-6:
            raise ValueError(
                f"jacobian(outputs={problem.rows_spec.mode!r}): example 0's rows "
                f"depend on other examples' {name!r} (relative size {leak:.1e}); "
                "the model mixes examples across the batch (as "
                "BatchNormalization with training=True does), so per-example "
                "rows have no own-example blocks. Pass outputs=callable (such "
                "as outputs=lambda y: y) for the full Jacobian over the batch."
            )
    checked[problem.key] = True


def own_example_blocks(jacobian: tf.Tensor, rows_shape: tuple[int, ...]) -> tf.Tensor:
    """``(K, B, *block)`` Jacobians of batch-summed rows -> ``rows_shape + block``
    with ``rows_shape = (B, ...)``: example ``b``'s rows, its own block only."""
    perm = [1, 0, *range(2, jacobian.shape.rank)]
    blocks = tf.transpose(jacobian, perm)
    return tf.reshape(blocks, (*rows_shape, *jacobian.shape[2:]))
