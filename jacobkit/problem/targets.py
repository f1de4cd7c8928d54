"""``layer=``: what is differentiated, resolved once.

A layer (object or name), a list of variables, or a tensor target
(``Inputs()``, ``Output("layer")``, :mod:`jacobkit.problem.tensor_targets`)
becomes a :class:`Targets`: the ``tf.Variable`` objects, a unique result name
for each and which of them are the layer's kernel and bias.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import tensorflow as tf

from jacobkit import layers
from jacobkit.keras import compat, layer_tree
from jacobkit.problem import tensor_targets as tensors
from jacobkit.problem.cache import PerModel

_TARGET_KEYS = PerModel("the result keys of each set of target variables")


@dataclass(frozen=True)
class Roles:
    """Which targets are the target layer's own kernel and bias (positions
    in :attr:`Targets.variables`, ``None`` where absent)."""

    kernel: int | None = None
    bias: int | None = None

    def by_name(self) -> dict[str, int]:
        """``{"kernel": i, "bias": j}`` for the roles present."""
        found = {"kernel": self.kernel, "bias": self.bias}
        return {role: i for role, i in found.items() if i is not None}

    def cover(self, count: int) -> bool:
        """Whether every one of ``count`` targets is the kernel or the bias."""
        return set(self.by_name().values()) == set(range(count))


@dataclass(frozen=True)
class Targets:
    """The resolved targets of one problem.

    Attributes:
        layer: the target layer, or ``None`` for variables or tensor targets.
        variables: the ``tf.Variable`` objects to differentiate, in order.
        names: a unique result name per variable (``"dense/kernel"``).
        roles: which variables are the layer's kernel and bias.
        tensors: the ``Inputs``/``Output`` targets, or ``None``.
    """

    layer: Any
    variables: tuple[tf.Variable, ...]
    names: tuple[str, ...]
    roles: Roles
    tensors: tensors.TensorTargets | None


def resolve(
    spec: Any,
    model: Any,
    *,
    ensure_built: Callable[[], None],
    tensor_targets: Callable[[Any], tensors.TensorTargets],
) -> Targets:
    """The :class:`Targets` of ``layer=spec`` in ``model``.

    ``ensure_built()`` builds the model where a layer is looked up in it;
    ``tensor_targets(spec)`` resolves an ``Inputs``/``Output`` target.
    """
    if tensors.is_tensor_target(spec):
        if isinstance(spec, tensors.Output):
            ensure_built()
        resolved = tensor_targets(spec)
        variables = resolved.variables
        return Targets(None, variables, resolved.names, Roles(), resolved)
    layer, given = _layer_and_variables(spec, model, ensure_built)
    # each unwrapped once per call (three times took 15 us of a steady call)
    variables = tuple(compat.as_tf_variable(v) for v in given)
    keys: Sequence[str | None] = [None] * len(given)
    if compat.is_keras_layer(model):
        keys = _target_keys(model, given, variables)
    return Targets(
        layer,
        variables,
        _unique_names(given, keys),
        _roles(layer, given),
        None,
    )


def _target_keys(
    model: Any, given: Sequence[Any], variables: tuple[tf.Variable, ...]
) -> Sequence[str | None]:
    """:func:`~jacobkit.keras.layer_tree.target_keys`, kept per model for
    each set of variables (``variables``: ``given`` as ``tf.Variable``;
    checked by identity, so a reused ``id`` is never taken for the variable
    it once named).

    NOTE (measured). The walk over the layer tree took about 1 ms of each
    call on the tiny BERT of ``benchmarks/reductions.py`` (every trainable
    variable: 42 targets, 2,000 weight reads), against a clipped sum of
    about 15 ms."""
    kept = _TARGET_KEYS.of(model)
    key = tuple(id(v) for v in variables)
    found = kept.get(key)
    if found is not None and all(
        ref() is v for ref, v in zip(found[0], variables, strict=True)
    ):
        return found[1]
    keys = layer_tree.target_keys(model, given, compat.as_tf_variable)
    kept[key] = (tuple(weakref.ref(v) for v in variables), keys)
    return keys


def _layer_and_variables(
    spec: Any, model: Any, ensure_built: Callable[[], None]
) -> tuple[Any, list[Any]]:
    if isinstance(spec, str):
        ensure_built()
        spec = find_layer(model, spec)
    if compat.is_layer(spec):
        ensure_built()
        variables = _layer_variables(spec)
        if not variables:
            raise ValueError(
                f"jacobian(layer={spec.name!r}): layer {spec.name!r} "
                f"({type(spec).__name__}) has no trainable variables, so it "
                "has no Jacobian. Choose a layer with a kernel or bias "
                "(Dense, Conv1D, Conv2D, ...), or pass a list of variables."
            )
        return spec, variables
    if isinstance(spec, (list, tuple)) and spec:
        return None, list(spec)  # each checked by resolve's as_tf_variable
    raise TypeError(
        "jacobian(layer=...): expected a layer, a layer name or a non-empty "
        f"list of variables, got {type(spec).__name__}: {spec!r}."
    )


def find_layer(model: Any, name: str, *, with_variables: bool = True) -> Any:
    """The layer of ``model`` that ``name`` names: its name, any suffix of its
    path that no other layer's path ends with (``"block_0/query"``), or the
    full path its result keys start with.

    Raises ``ValueError`` where ``name`` names several layers (every one
    listed by path) or none (with close names). ``with_variables``: only
    layers with trainable variables are suggested (``layer=``); else any
    layer (``Output(name)``).
    """
    layers = layer_tree.named_layers(model)
    found = layer_tree.layers_named(layers, name)
    if len(found) == 1:
        return found[0][0]
    if found:
        listed = ", ".join(repr(path) for _, path in found)
        raise ValueError(
            f"jacobian(layer={name!r}): {len(found)} layers of the model match "
            f"{name!r}: {listed}. Pass one of these paths to choose one."
        )
    every = [path for _, path in layers]
    paths = [
        path for layer, path in layers if not with_variables or _layer_variables(layer)
    ]
    raise ValueError(
        f"jacobian(layer={name!r}): the model has no layer named {name!r}. "
        f"{_hint(name, paths, every, with_variables)}"
    )


def _hint(name: str, paths: list[str], every: list[str], with_variables: bool) -> str:
    close = layer_tree.close_paths(name, paths, every)
    if close:
        return f"Did you mean {' or '.join(repr(n) for n in close)}?"
    if not paths:
        if every:
            return (
                "None of its layers has trainable variables; pass a list of "
                "variables instead."
            )
        return "The model has no named layers; pass a list of variables instead."
    shown = ", ".join(repr(layer_tree.short_path(p, every)) for p in paths[:10])
    more = f" and {len(paths) - 10} more" if len(paths) > 10 else ""
    which = "layers with trainable variables" if with_variables else "layers"
    return f"The model's {which} are: {shown}{more}."


def _layer_variables(layer: Any) -> list[Any]:
    if compat.lora_enabled(layer):
        # its kernel is computed (frozen + s A B): the targets are what is
        # trained, the factors and the bias, as its rule's parts hold them
        rule = layers.rule_for(layer)
        if rule is not None and rule.unsupported() is None:
            return [
                w
                for part in rule.parts()
                for w in (part.weight("kernel"), part.weight("bias"))
                if w is not None
            ]
        return _trainable_by_nature(layer)
    kernel = compat.named_weight(layer, "kernel")
    if kernel is not None and not callable(kernel):
        bias = compat.named_weight(layer, "bias")
        return [kernel] + ([bias] if bias is not None else [])
    return _trainable_by_nature(layer)


def _trainable_by_nature(layer: Any) -> list[Any]:
    # Every weight that is trainable by nature, whether or not the layer is
    # frozen now: layer.trainable=False empties trainable_weights, but the
    # tf.Variable keeps the trainable flag it was created with (moving
    # statistics and other state are created non-trainable; a LoRA layer's
    # frozen kernel is made non-trainable by enable_lora).
    return [
        w
        for w in compat.weights_or_variables(layer)
        if compat.as_tf_variable(w).trainable
        and compat.as_tf_variable(w).dtype.is_floating
    ]


@dataclass(frozen=True)
class Projection:
    """One linear part of the target layer (:meth:`jacobkit.layers.LayerRule.parts`:
    the layer itself, or one of an attention layer's projections): its rule
    and the positions of its kernel and bias among the targets (``bias``:
    ``None`` where it has none)."""

    rule: layers.LayerRule
    kernel: int
    bias: int | None


def projections(
    rule: layers.LayerRule, variables: Sequence[Any]
) -> tuple[Projection, ...] | None:
    """Each of ``rule``'s parts with the positions of its kernel and bias in
    ``variables``; ``None`` unless each part's kernel and bias are targets
    and every target is one of them."""
    found = []
    for part in rule.parts():
        kernel = _position(variables, part.weight("kernel"))
        bias = part.weight("bias")
        at = _position(variables, bias)
        if kernel is None or (bias is not None and at is None):
            return None
        found.append(Projection(part, kernel, at))
    covered = {i for p in found for i in (p.kernel, p.bias) if i is not None}
    return tuple(found) if covered == set(range(len(variables))) else None


def _position(variables: Sequence[Any], variable: Any) -> int | None:
    """Where ``variable`` is in ``variables`` (Keras or ``tf.Variable``
    objects alike), or ``None``."""
    if variable is None:
        return None
    inner = compat.unwrap(variable)
    return next((i for i, v in enumerate(variables) if compat.unwrap(v) is inner), None)


def _roles(layer: Any, variables: list[Any]) -> Roles:
    found: dict[str, int] = {}
    if layer is not None:
        rule = layers.rule_for(layer)
        for role in ("kernel", "bias"):
            variable = (
                rule.weight(role)
                if rule is not None
                else compat.named_weight(layer, role)
            )
            at = _position(variables, variable)
            if at is not None:
                found[role] = at
    return Roles(**found)


def _variable_name(variable: Any) -> str:
    name = compat.variable_path(variable)
    return name[:-2] if name.endswith(":0") else name


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


def refuse_unconnected(
    model: Any, resolved: Targets, connected: tuple[bool, ...]
) -> None:
    """Refuse targets that do not influence the outputs (``connected`` says
    which do, from the traced pass), naming them and what they miss."""
    unconnected = [n for n, ok in zip(resolved.names, connected) if not ok]
    if unconnected:
        explain_unconnected(model, resolved, unconnected)
        raise ValueError(
            f"jacobian(layer=...): target(s) {', '.join(unconnected)} do not "
            "influence the model's outputs, so their Jacobian is zero (a "
            "tape would return None). Pick a layer on the path to the "
            "outputs, or pass unconnected='zero' to get zeros."
        )


def explain_unconnected(model: Any, targets: Targets, unconnected: list[str]) -> None:
    """Raise the precise reason where targets that do not reach the rows are
    not the model's at all: a layer of another model, or variables of none."""
    if not compat.is_keras_layer(model):
        return
    if targets.layer is not None:
        _check_layer_is_part_of_the_model(model, targets.layer)
    else:
        _check_variables_are_the_models(model, targets, unconnected)


def _check_layer_is_part_of_the_model(model: Any, layer: Any) -> None:
    if layer_tree.contains_layer(model, layer):
        return
    own = [n for n in compat.flatten_layers(model) if n.name == layer.name]
    fix = (
        f"Pass its name ({layer.name!r}) or model.get_layer({layer.name!r}) "
        "to use this model's own layer of that name."
        if own
        else "Pass one of this model's layers (by name or object)."
    )
    raise ValueError(
        f"jacobian(layer=...): layer {layer.name!r} ({type(layer).__name__}) is "
        f"not part of the model {model.name!r}: it belongs to another "
        f"model, or was never called in this one, so it cannot influence the "
        f"outputs. {fix}"
    )


def _check_variables_are_the_models(
    model: Any, targets: Targets, unconnected: list[str]
) -> None:
    own = {id(compat.as_tf_variable(w)) for w in compat.weights(model)}
    foreign = [
        name
        for name, target in zip(targets.names, targets.variables)
        if id(target) not in own
    ]
    if foreign and set(unconnected) <= set(foreign):
        one = len(foreign) == 1
        what = "is not a variable" if one else "are not variables"
        whose = "it belongs" if one else "they belong"
        raise ValueError(
            f"jacobian(layer=[...]): {', '.join(foreign)} {what} of the model "
            f"{model.name!r}: {whose} to another model, or to none, so "
            f"{'it' if one else 'they'} cannot influence the outputs. Pass "
            "this model's variables (model.get_layer(name).kernel, ...)."
        )
