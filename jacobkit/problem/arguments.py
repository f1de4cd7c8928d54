"""Checks of ``jacobian()``'s arguments that need no model call, the inputs
as tensors (and the warning for NaN/Inf in them), and jacobkit's message for
a model that fails on its inputs."""

from __future__ import annotations

import warnings
from collections.abc import Iterable
from typing import Any, NoReturn

import numpy as np
import tensorflow as tf

from jacobkit import runtime
from jacobkit.keras import layer_tree
from jacobkit.problem.reduction import Norms, Reduction, Rows

UNCONNECTED_MODES = ("error", "zero")
#: ``reduce=``: ``None`` (the Jacobians) or ``"norm"`` (each row's L2 norm);
#: the other kinds are objects (``jk.ClippedSum(C)``)
REDUCE_MODES = (None, "norm")
#: each kind ``jacobian(reduce=...)`` takes by its spelling there
_SPELLED = {None: Rows(), "norm": Norms()}


def check_model(model: Any) -> None:
    if not callable(model):
        raise TypeError(
            "jacobian(model=...): expected a Keras model or a callable "
            f"f(inputs) -> tf.Tensor, got {type(model).__name__}."
        )


def check_eager() -> None:
    """Refuse a call traced in a ``tf.function`` (``model.fit`` compiles its
    train step into one): jacobkit plans, compiles and runs eagerly, and
    TensorFlow's own error there (``TypeError ... SymbolicTensor``) says
    neither."""
    if not tf.executing_eagerly():
        raise TypeError(
            "jacobian(...): called while TensorFlow traces a tf.function (a "
            "@tf.function, or model.fit/train_step without run_eagerly=True). "
            "jk.jacobian, jk.gram and jk.verify run eagerly: they plan and "
            "compile their own computation on every call. Inside a traced "
            "function use jk.function: plan it once, eagerly, on an example "
            "batch (fn = jk.function(model, layer, example=batch, ...)), then "
            "call fn(batch) inside. Or compile the model with run_eagerly=True, "
            "or call jacobkit outside the traced function (between steps)."
        )


def check_steps(steps: Any) -> None:
    """``steps=``: ``None`` or a positive int (checked with one batch of
    arrays too, where it has nothing to count)."""
    if steps is not None and (
        isinstance(steps, bool) or not isinstance(steps, (int, np.integer))
    ):
        raise TypeError(f"jacobian(steps={steps!r}): expected a positive int or None.")
    if steps is not None and steps < 1:
        raise ValueError(
            f"jacobian(steps={steps}): must be >= 1 (the number of batches to "
            "take from the dataset), or None for all of them."
        )


def check_unconnected(unconnected: Any) -> None:
    if unconnected not in UNCONNECTED_MODES:
        raise ValueError(
            f"jacobian(unconnected={unconnected!r}): expected 'error' (raise "
            "when a target does not influence the outputs) or 'zero' (return "
            "zeros for it)."
        )


def check_training(training: Any) -> bool:
    if not isinstance(training, (bool, np.bool_)):
        raise TypeError(
            f"jacobian(training={training!r}): expected True (training "
            "behaviour: dropout, batch statistics) or False (inference), got "
            f"{type(training).__name__}."
        )
    return bool(training)


def check_output(output: Any) -> int | str | None:
    """``output`` as given, if it is ``None``, an int or a str."""
    if output is None or isinstance(output, str):
        return output
    if isinstance(output, int) and not isinstance(output, bool):
        return output
    if hasattr(output, "__index__") and not isinstance(output, bool):
        return int(output.__index__())
    raise TypeError(
        f"jacobian(output={output!r}): expected the index (0, 1, ...) or the "
        f"name of one of the model's outputs, got {type(output).__name__}."
    )


def check_reduce(reduce: Any) -> Any:
    """``reduce=`` checked: ``None``, ``"norm"``, or a reduction object
    (:mod:`jacobkit.problem.reduction`); returned as given."""
    reduction_of(reduce)
    return reduce


def reduction_of(reduce: Any) -> Reduction:
    """``reduce=`` as its kind: ``None`` and ``"norm"`` by their spelling, a
    public reduction object as itself; a clear error for anything else."""
    if isinstance(reduce, Reduction) and reduce.public:
        return reduce
    if isinstance(reduce, (str, type(None))) and reduce in _SPELLED:
        return _SPELLED[reduce]
    raise ValueError(
        f"jacobian(reduce={reduce!r}): expected None (the Jacobians), 'norm' "
        "(the L2 norm of each row's Jacobian per target, shape rows_shape), "
        "jk.ClippedSum(clip_norm) (the sum of every row's gradient clipped to "
        "clip_norm) or jk.Project(dim, seed) (each row's gradient mapped to dim "
        "numbers by a fixed random map)."
    )


def is_batches(inputs: Any) -> bool:
    """Whether ``inputs`` is a dataset or iterable of batches (not the arrays
    of one batch: a list, tuple or dict is a multi-input model's inputs)."""
    if isinstance(inputs, tf.data.Dataset):
        return True
    # a tf.Variable is iterable too, but it is one batch (USERS.md case 4)
    return isinstance(inputs, Iterable) and not isinstance(
        inputs, (list, tuple, dict, np.ndarray, tf.Tensor, tf.Variable, str, bytes)
    )


def to_tensors(inputs: Any) -> Any:
    """``inputs`` (an array, or a tuple, list or dict of them for a
    multi-input model) as ``tf.Tensor`` of the same structure."""

    def convert(value):
        if isinstance(
            value, (tf.Tensor, tf.Variable, np.ndarray, np.generic, list, float, int)
        ):
            dtype = getattr(value, "dtype", None)
            if getattr(dtype, "kind", None) in ("U", "S", "O") or dtype == tf.string:
                raise TypeError(
                    f"jacobian(inputs=...): an array of {dtype} values; "
                    "the model takes numbers (float features, or integer "
                    "token ids). Preprocess (tokenize, encode) them first."
                )
            # a tf.Variable input is read: its value is the input tensor
            return tf.convert_to_tensor(value)
        raise TypeError(
            "jacobian(inputs=...): expected NumPy arrays or tf.Tensors (in a "
            f"tuple, list or dict for a multi-input model), got "
            f"{type(value).__name__}."
        )

    # A list of arrays is the inputs of a multi-input model; a list of
    # numbers or of lists (x.tolist(), labels as [0, 2, 1]) is one array,
    # at any depth: (x, [0, 2, 1]) is x and one array of labels.
    def structure(value):
        if isinstance(value, tuple):
            return tuple(structure(v) for v in value)
        if isinstance(value, dict):
            return {k: structure(v) for k, v in value.items()}
        if (
            isinstance(value, list)
            and value
            and all(
                isinstance(v, (tf.Tensor, tf.Variable, np.ndarray, tuple, dict))
                for v in value
            )
        ):
            return [structure(v) for v in value]
        return convert(value)

    return structure(inputs)


def check_examples(inputs: Any, batch: int | None = None) -> None:
    """Refuse a batch of 0 examples (an input whose first axis is 0) before
    anything is traced: there are no rows, and TensorFlow's kernels fail on
    it with their own errors (a convolution's closed form: "Incompatible
    shapes: [0,8,4] vs. [6]")."""
    shapes = [tuple(getattr(a, "shape", None) or ()) for a in tf.nest.flatten(inputs)]
    empty = [shape for shape in shapes if shape and shape[0] == 0]
    if empty:
        where = "the batch holds" if batch is None else f"batch {batch} holds"
        raise ValueError(
            f"jacobian(inputs=...): {where} 0 examples (an input of shape "
            f"{empty[0]}), so there are no rows to differentiate. Pass at least "
            "one example: inputs of shape (B, ...) with B >= 1"
            + ("." if batch is None else "; drop empty batches from the dataset.")
        )


def raise_call_error(
    model: Any, inputs: Any, err: Exception, model_inputs: Any = None
) -> NoReturn:
    """Raise jacobkit's message for ``model`` failing on ``inputs`` with
    ``err``; ``model_inputs(inputs)``: what the model takes of them (``x``
    of loss rows' ``(x, y[, w])``)."""
    x = inputs if model_inputs is None else model_inputs(inputs)
    flat = tf.nest.flatten(x)
    mismatch = layer_tree.input_mismatch(model, x, flat)
    if mismatch is not None:
        # the shapes say it all; the model's traced error would bury them
        if x is not inputs:  # loss rows: name x, not the (x, y) around it
            mismatch = f"x of (x, y) does not fit the model: {mismatch}"
        raise ValueError(f"jacobian(inputs=...): {mismatch}") from None
    shapes = ", ".join(str(tuple(t.shape)) for t in flat)
    hint = "Check that the inputs are what the model takes (batch axis first)."
    if "is not a valid root scope name" in str(err):
        # Keras names a model after its class: `class _Net` gives "__net",
        # which TensorFlow refuses as a graph's root name scope
        hint = (
            f"TensorFlow cannot trace a model named {model.name!r} (a name "
            "must start with a letter, digit or '.'); pass name=... to the "
            "model's constructor, or rename its class."
        )
    raise ValueError(
        f"jacobian(model=...): calling the model on inputs of shape {shapes} "
        f"failed: {layer_tree.error_summary(err)} {hint}"
    ) from err


def _non_finite(x: Any) -> int:
    """How many NaN/Inf values the float arrays or tensors of ``x`` hold."""
    count = 0
    for a in tf.nest.flatten(x):
        if (
            isinstance(a, tf.Tensor)
            and a.dtype in (tf.float16, tf.float32, tf.float64)
            and ":CPU:" in getattr(a, "device", "")
        ):
            a = a.numpy()  # shares the CPU buffer; NumPy counts ~10x faster
        if isinstance(a, tf.Tensor):
            if a.dtype.is_floating:
                finite = tf.math.count_nonzero(tf.math.is_finite(a))
                count += int(tf.size(a, out_type=tf.int64) - finite)
        elif np.asarray(a).dtype.kind == "f":
            count += int(np.size(a) - np.count_nonzero(np.isfinite(a)))
    return count


def warn_non_finite(inputs: Any, batch: int | None = None) -> bool:
    """Warn if ``inputs`` hold NaN or Inf (they reach the rows: with
    ``outputs="features"`` every row would be NaN), at the user's call;
    whether it warned."""
    bad = _non_finite(inputs)
    if bad:
        where = "the inputs hold" if batch is None else f"batch {batch} holds"
        later = "" if batch is None else " Later batches are not reported."
        warnings.warn(
            f"jacobian(inputs=...): {where} {bad} NaN/Inf value(s); the "
            "Jacobians of every row they reach are NaN (with "
            f"outputs='features', every row).{later}",
            RuntimeWarning,
            stacklevel=runtime.caller_stacklevel(),
        )
    return bool(bad)
