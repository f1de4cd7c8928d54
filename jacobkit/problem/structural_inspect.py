"""A reduced call's inspection read from the model's structure, where it
tells for sure what the eager passes (:mod:`.eager_inspect`) would measure,
and whether ``batch``'s numeric checks are what the test suite already
proves (:func:`trusted`).

NOTE (why). In a fresh process an op's first eager dispatch costs about
its trace: the eager inspecting passes (two, on 2 and 3 examples) and the
checks' pass were ~0.15 s of the conv net's 0.35 s first clipped sum and
~0.45 s of BERT tiny's 1.67 s. Skipping one only moved TensorFlow's one-time
costs into the next, so both are skipped together, or neither.

NOTE (what is read, and why it is exact). Only a Keras functional or
sequential model (nested ones walked) every operation of which is one of
:mod:`jacobkit.keras.per_example`'s listed classes, exactly, in inference
mode (``training=False``), with a single output whose sizes beyond the
batch are known or the inputs' one open size (a causal LM's logits ``(B,
T, V)``: every node with an unknown size keeps or sets its input's,
:func:`~jacobkit.keras.per_example.lengths_kept`), no tensor targets,
``output=None`` and rows of a mode (not a callable):

- ``outputs_shape``: the output's symbolic shape, the batch substituted;
  ``rows``: the mode's shape of it (a loss: ``(B,)``), in its dtype.
- ``connected``: every target is a weight of a layer with a built-in rule
  whose node reaches the output (:func:`~jacobkit.keras.per_example.
  upstream_layers`); the rule's closed form reads every weight it covers.
  Any other case: ``None`` (the traced or eager pass tells it exactly).
- ``has_loops``: ``False`` (no listed class runs a loop);
  ``convolutions``: the kinds of the listed convolution layers upstream of
  the output (a superset of the backward pass's where a convolution runs
  before every target: more scratch space counted, never less).
- ``activation_bytes``, ``forward_bytes``: :data:`ACTIVATION_FACTOR` and
  :data:`FORWARD_FACTOR` times the layers' figure
  (:func:`~jacobkit.keras.per_example.layer_output_bound`: their outputs,
  the inputs of the layers a block calls, the attention scores), upper
  bounds measured against the eager passes' counts (the tests assert them
  on each model); ``sequential_memory``: ``None`` (the
  planner then bounds rows by the activations, as for a loop);
  ``layer_outputs``: :func:`jacobkit.keras.layer_tree.output_bytes`, the
  same figure the passes give; ``unpinned``: ``()`` (inference mode).
- ``transposed``: ``()`` where oneDNN runs (the ``MatMul`` rule replaces
  nothing there, :func:`jacobkit.strategies.gradients.hoisted_bytes` is
  0); with oneDNN off: read from the layers
  (:func:`jacobkit.keras.matmuls.transposed`: each ``Dense``'s product, the
  records :func:`~jacobkit.problem.operands.of_eager` makes, in the same
  order), ``None`` where they do not tell it.

Measured (eager passes' count / the layers' figure
:func:`~jacobkit.keras.per_example.layer_output_bound`, activations and
forward alike; loss rows, every trainable variable): conv net (batch 32)
2.8, convnet_medium 2.9, MLP 2.4, BERT tiny 4.0, BERT small 6.0, a keras_hub
BERT (hidden 32, batch 8) 4.5, MobileNetV2 (alpha 0.35, 32 px, batch 8) 1.3.
The excess is each layer's temporaries (a bias added apart from its
product, an activation's own tensors: the approximate GELU makes five of
its input's size), which grow with the feed-forward width, not the batch.
:data:`ACTIVATION_FACTOR` keeps a third over the largest. The factor is an
upper bound for prediction only: where a memory budget is given and
``batch``'s predicted peak does not fit it with room, the planner measures
the inspection by the eager passes as before
(:func:`jacobkit.planner.reduced`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import tensorflow as tf

from jacobkit import layers, runtime
from jacobkit.keras import compat, layer_tree, matmuls, nodes, per_example
from jacobkit.layers import convolutions as convolution_kinds
from jacobkit.layers import stock
from jacobkit.problem import eager_inspect, loss, operands
from jacobkit.problem.cache import PerModel
from jacobkit.problem.inspect import Inspection, Traceable
from jacobkit.problem.loss import Loss

_VERDICTS = PerModel("trusted: whether batch's numeric checks are proven, per targets")

#: the activations' bytes (what a row's backward pass keeps) at most this
#: many times the layers' figure (measured up to 6.0x: the module's NOTE)
ACTIVATION_FACTOR = 8
#: every floating tensor of the forward pass at most this many times the
#: layers' figure (measured up to 6.0x)
FORWARD_FACTOR = 8


def inspection(problem: Traceable) -> Inspection | None:
    """The :class:`~jacobkit.problem.inspect.Inspection` of ``problem`` read
    from its model's structure (the module's NOTE), ``None`` where that
    cannot tell it for sure (the eager or traced pass then runs)."""
    if getattr(problem, "output", None) is not None or not trusted(problem):
        return None
    mode = problem.rows_spec.mode
    if callable(mode) and not isinstance(mode, Loss):
        return None
    batch = eager_inspect.batch_of(problem)
    model = problem.model
    outputs = list(getattr(model, "outputs", None) or ())
    if batch is None or len(outputs) != 1:
        return None
    if str(outputs[0].dtype) != "float32":
        return None
    given = problem.inputs
    if problem.rows_spec.loss is not None:
        given = loss.split(given)[0]  # x of (x, y[, w])
    length = _length(model, given)
    if length is False:
        return None
    dims = tuple(outputs[0].shape)[1:]
    if None in dims and (length is None or not per_example.lengths_kept(model)):
        return None
    fill = int(length or 0)  # an open size: the inputs' length
    shape = (batch, *(int(fill if d is None else d) for d in dims))
    rows = _rows(problem, shape)
    bound = per_example.layer_output_bound(model, batch, length or None)
    if rows is None or bound is None:
        return None
    copied = _transposed(problem, batch, length or None)
    upstream = per_example.upstream_layers(model) or set()
    if copied is None:
        return None
    kinds: set[str] = set()
    gradients: list[convolution_kinds.Gradient] = []
    for layer in compat.flatten_layers(model):
        if id(layer) in upstream:
            kind = layers.stock_kind(layer)
            kinds.update(() if kind is None else kind.convolutions)
            gradients += _gradients(layer, () if kind is None else kind.convolutions)
    return Inspection(
        outputs_shape=tf.TensorShape(shape),
        rows=tf.TensorSpec(rows, tf.float32),
        connected=(True,) * len(problem.targets),
        has_loops=False,
        activation_bytes=ACTIVATION_FACTOR * bound,
        convolutions=frozenset(convolution_kinds.convolution(k).kind for k in kinds),
        forward_bytes=FORWARD_FACTOR * bound,
        sequential_memory=None,
        unpinned=(),
        layer_outputs=layer_tree.output_bytes(model, batch),
        transposed=copied,
        convolution_gradients=tuple(gradients),
        measured=False,
    )


def _gradients(layer: Any, kinds: tuple[str, ...]) -> list[convolution_kinds.Gradient]:
    """The gradient ops a listed convolution layer's backward pass may run
    (its input's and kernel's, a superset), read from its configuration:
    stride 1 only for a plain ``Conv1D``/``Conv2D`` of stride and dilation
    1, no groups, channels last, ``same``/``valid`` padding; patches unknown."""
    ones = all(
        all(int(v) == 1 for v in tuple(getattr(layer, name, None) or (0,)))
        for name in ("strides", "dilation_rate")
    )
    plain = type(layer).__name__ in ("Conv1D", "Conv2D") and ones
    plain = plain and getattr(layer, "groups", 1) == 1
    plain = plain and getattr(layer, "data_format", None) == "channels_last"
    plain = plain and getattr(layer, "padding", None) in ("same", "valid")
    return [
        convolution_kinds.Gradient(k, wrt, plain and k == "conv2d")
        for k in kinds
        for wrt in ("input", "kernel")
    ]


def _transposed(
    problem: Traceable, batch: int, length: int | None
) -> tuple[operands.Transposed, ...] | None:
    """The operands the forward pass's products' gradients take transposed:
    ``()`` where the ``MatMul`` rule replaces nothing (oneDNN on, a GPU),
    else read from the layers (:mod:`jacobkit.keras.matmuls`)."""
    if runtime.cpu_kind().onednn or tf.config.list_logical_devices("GPU"):
        return ()
    targets = {id(compat.unwrap(t)) for t in problem.targets}
    found = matmuls.transposed(problem.model, targets, batch, length)
    if found is None:
        return None
    return tuple(operands.Transposed(rows, size) for rows, size in found)


def _rows(problem: Traceable, shape: tuple[int, ...]) -> tuple[int, ...] | None:
    """The rows' shape for outputs of ``shape`` (``None``: not read here)."""
    spec = problem.rows_spec
    if isinstance(spec.mode, Loss):
        return None if spec.features is not None else (shape[0],)
    width = shape[-1] if spec.features is None else len(spec.features)
    selected = (*shape[:-1], width)
    if spec.mode == "features":
        return (width,) if len(selected) > 1 else None
    if spec.mode == "per_example" and len(selected) >= 2:
        return (selected[0], width)
    if spec.mode == "full":
        return selected
    return None


def _length(model: Any, inputs: Any) -> int | bool | None:
    """The inputs' one size beyond the batch where the model's inputs leave
    it open (a sequence length), ``None`` where none is open, ``False``
    where the inputs do not match the model's (the passes say how)."""
    specs = list(getattr(model, "inputs", None) or ())
    if isinstance(inputs, dict):
        names = compat.input_names(model)
        if sorted(inputs) != sorted(n for n in names if n is not None):
            return False
        given = [inputs[n] for n in names]
    else:
        given = tf.nest.flatten(inputs)
    if len(given) != len(specs):
        return False
    open_sizes: set[int] = set()
    for spec, tensor in zip(specs, given, strict=True):
        want = tuple(spec.shape)
        have = tuple(int(d) for d in tensor.shape)
        if len(want) != len(have) or tf.as_dtype(tensor.dtype).name != str(spec.dtype):
            return False
        for w, h in zip(want[1:], have[1:], strict=True):
            if w is None:
                open_sizes.add(h)
            elif w != h:
                return False
    if len(open_sizes) > 1:
        return False
    return open_sizes.pop() if open_sizes else None


@dataclass(frozen=True)
class Trust:
    """The verdict of :func:`trusted` on a problem's targets, reached once
    per model and kept: the structural inspection and ``batch``'s checks
    (:mod:`jacobkit.strategies.batch.checks`) both read it.

    Attributes:
        trusted: the checks are what the test suite proves (need not run).
        reason: the first condition not met, in words (``""`` where
            trusted).
    """

    trusted: bool
    reason: str = ""


def trusted(problem: Any) -> bool:
    """Whether ``batch``'s numeric checks on ``problem`` (the layer computes
    its rule's closed form, the rule's gradients are autodiff's, examples do
    not mix) are what the test suite proves (``tests/test_conformance.py``,
    the rule tests), so need not run: :func:`verdict`'s."""
    return verdict(problem).trusted


def verdict(problem: Any) -> Trust:
    """The :class:`Trust` of ``problem``, judged once per model, targets,
    target layer, ``training`` and the layer registry's version (what it
    reads besides the model's graph): every target layer (``problem.forms``)
    exactly a stock class with a built-in rule, LoRA off, not quantized,
    float32, called at most once in its graph, its weights held by no other
    layer, and every operation of the model per-example in inference mode
    (:func:`jacobkit.keras.per_example.per_example_graph`). A user's rule,
    a subclass, a tied weight, ``training=True``: not trusted (numeric)."""
    key = (
        tuple(id(t) for t in problem.targets),
        id(getattr(problem, "layer", None)),
        bool(problem.training),
        getattr(problem, "tensor_targets", None) is not None,
        layers.REGISTRY.current_version(),
    )
    kept = _VERDICTS.of(problem.model)
    if key not in kept:
        kept[key] = _judged(problem)
    found: Trust = kept[key]
    return found


def _judged(problem: Any) -> Trust:
    """:func:`verdict`'s conditions, each in turn."""
    if problem.training:
        return Trust(False, "training=True")
    if getattr(problem, "tensor_targets", None) is not None:
        return Trust(False, "tensor targets")
    model = problem.model
    if not per_example.per_example_graph(model):
        return Trust(False, "an operation not listed per-example")
    found = problem.forms
    upstream = per_example.upstream_layers(model)
    if not found or upstream is None:
        return Trust(False, "no closed form serves every target")
    # a target weight held by two layers is tied (a language model's head)
    mine = {id(compat.unwrap(t)) for t in problem.targets}
    held: dict[int, int] = {}
    for layer in compat.flatten_layers(model):
        for weight in layer_tree.own_trainable_weights(layer):
            key = id(compat.unwrap(weight))
            if key in mine:
                held[key] = held.get(key, 0) + 1
    if any(count > 1 for count in held.values()):
        return Trust(False, "a target weight held by two layers")
    for form in found:
        layer = form.layer
        kind = layers.stock_kind(layer)
        if (
            kind is None
            or not any(kind is k for k in stock.KINDS)
            or kind.rule is None
            or layers.kind_of(layer) is not kind
            or compat.lora_enabled(layer)
            or compat.quantization_mode(layer) is not None
            or compat.dtype_policy_name(layer) != "float32"
            or not nodes.called_once(layer)
            or id(layer) not in upstream
        ):
            return Trust(False, f"layer {layer.name!r} not proven by the tests")
    return Trust(True)
