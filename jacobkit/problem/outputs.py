"""``output=``: pick one output of a multi-output model.

A model that returns a list, tuple or dict of tensors has several outputs;
``jacobian(..., output=1)`` or ``output="logits"`` keeps one of them, and rows
are formed from it as from a single-output model (``outputs="features"``:
one row per feature of that output).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import tensorflow as tf

from jacobkit.keras import compat, layer_tree
from jacobkit.problem.rows import OUTPUT_MODES


class OutputError(ValueError):
    """``output=`` names no output of the model."""


def _output_names(outputs: Any, model: Any) -> list[str] | None:
    """The outputs' names: a dict's keys, else a Keras model's output names."""
    if isinstance(outputs, dict):
        return [str(key) for key in outputs]
    names = compat.output_names(model)
    if names is None:
        return None
    count = len(outputs) if isinstance(outputs, (list, tuple)) else 1
    return [str(n) for n in names] if len(names) == count else None


def _listed(outputs: Sequence[Any], names: list[str] | None) -> str:
    parts = []
    for i, tensor in enumerate(outputs):
        shape = tuple(getattr(tensor, "shape", ()) or ())
        name = f" {names[i]!r}" if names else ""
        parts.append(f"{i}{name} (shape {shape})")
    return ", ".join(parts)


def choices(outputs: Any, model: Any) -> str:
    """``"output=0 .. 1 or output='logits' / 'aux'"`` for a message."""
    values = list(outputs.values()) if isinstance(outputs, dict) else outputs
    if not isinstance(values, (list, tuple)) or not values:
        return "the model has no list of outputs"
    names = _output_names(outputs, model)
    by_index = f"output=0 .. {len(values) - 1}"
    if names:
        return by_index + " or output=" + " / ".join(repr(n) for n in names)
    return by_index


def pick(outputs: Any, output: int | str, model: Any) -> tf.Tensor:
    """The output ``output`` (index or name) of ``outputs``, the model's
    return value. Raises :class:`OutputError` listing the outputs."""
    if isinstance(outputs, tf.Tensor):
        values = [outputs]
    elif isinstance(outputs, dict):
        values = list(outputs.values())
    elif isinstance(outputs, (list, tuple)):
        values = list(outputs)
    else:
        raise OutputError(
            f"jacobian(output={output!r}): the model returned "
            f"{type(outputs).__name__}, not a tensor or a list, tuple or dict of "
            "tensors. Drop output= and pass outputs=callable instead."
        )
    names = _output_names(outputs, model)
    index = None
    if isinstance(output, int):
        if -len(values) <= output < len(values):
            index = output % len(values)
    elif names is not None and output in names:
        index = names.index(output)
    if index is not None:
        return values[index]
    # output="per_example" is what outputs= (plural) takes
    rows = (
        f" outputs={output!r} (plural) says what a row is; output= picks one "
        "output of a multi-output model."
        if output in OUTPUT_MODES
        else ""
    )
    if len(values) == 1:
        raise OutputError(
            f"jacobian(output={output!r}): the model has a single output (shape "
            f"{tuple(values[0].shape)}). Drop output=, or pass output=0.{rows}"
        )
    count = f"{len(values)} outputs"
    hint = ""
    if isinstance(output, str) and names:
        close = layer_tree.close_names(output, names)
        if close:
            hint = f" Did you mean {' or '.join(repr(n) for n in close)}?"
    raise OutputError(
        f"jacobian(output={output!r}): the model has {count}: "
        f"{_listed(values, names)}. Pass output= one of "
        f"{'these indices or names' if names else 'these indices'}.{hint}{rows}"
    )
