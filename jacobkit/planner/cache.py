"""The plan cache on disk, like cuDNN's or XLA's autotuning caches: the
second run of a script plans nothing.

One JSON file per problem, named by a fingerprint of what the measurements
depend on: the model's architecture (every layer's class, name and
activation, every variable's name, shape and dtype; not the weights'
values), the targets, the rows, the
input signature, the device kind and the TensorFlow version. It holds what
``auto`` measured (time per row, tracing time and peak of each strategy it
ran), the strategy it runs, the candidates still to try and the time spent
so far, so that a later process continues where this one stopped
(:class:`~jacobkit.planner.entry.CacheEntry`).

Where: ``$JACOBKIT_CACHE_DIR``, else ``$XDG_CACHE_HOME/jacobkit``, else
``~/.cache/jacobkit``; ``JACOBKIT_CACHE_DIR=""`` (or ``jacobian(...,
cache=False)``) turns it off. Writes go to a temporary file renamed over the
entry (``os.replace``), so a reader never sees half a file and concurrent
writers leave one whole entry. An entry that cannot be read, parsed or
used is ignored with one :class:`CacheWarning` and rewritten; an entry is
never trusted blindly: a strategy whose measured peak no longer fits the
budget is not run from it.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import re
import tempfile
import warnings
from typing import Any

import tensorflow as tf

from jacobkit import layers, runtime
from jacobkit.keras import compat, layer_tree
from jacobkit.planner.entry import CacheEntry
from jacobkit.problem import Problem

#: bumped when an entry's meaning changes; older entries are stale (4: auto
#: offers pfor again on models with batched matmuls under oneDNN, where
#: format 3 left it out: see jacobkit.strategies.vectorize)
FORMAT = 4


class CacheWarning(UserWarning):
    """A plan cache entry or directory could not be used (once per path)."""


def directory() -> str | None:
    """The cache directory, or ``None`` when caching is off."""
    configured = os.environ.get("JACOBKIT_CACHE_DIR")
    if configured is not None:
        return configured or None
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(
        os.path.expanduser("~"), ".cache"
    )
    return os.path.join(base, "jacobkit")


def fingerprint(problem: Problem, device: str) -> str | None:
    """The entry's name for ``problem`` on ``device`` (a hex digest), or
    ``None`` where rows are given by a callable (its code is not
    fingerprinted, so nothing is cached)."""
    mode = problem.rows_spec.mode
    if callable(mode):
        return None
    model = problem.model
    variables = [
        (_stable(json.dumps(_name(v))), list(v.shape), tf.as_dtype(v.dtype).name)
        for v in compat.variables(model)
    ]
    key = {
        "format": FORMAT,
        "model": [type(model).__module__, type(model).__qualname__],
        "layers": _stable(json.dumps(_layers(model))),
        "variables": variables,
        "targets": [
            [name, list(t.shape), t.dtype.name]
            for name, t in zip(problem.target_names, problem.targets)
        ],
        "rows": [mode, problem.rows_spec.features, list(problem.rows_shape)],
        "output": problem.output,
        "reduce": problem.reduce,
        "training": problem.training,
        "inputs": [
            [list(t.shape), t.dtype.name] for t in tf.nest.flatten(problem.inputs)
        ],
        "device": [device, _device_kind(device)],
        "tensorflow": tf.__version__,
    }
    text = json.dumps(key, sort_keys=True, default=repr)
    return hashlib.sha256(text.encode()).hexdigest()[:32]


def _layers(model: Any) -> list[list[Any]]:
    """The model's architecture as the cache keys it: every layer (nested
    ones included, depth first) by class, name, activation and the rule
    jacobkit serves it with (``jk.layers.register`` may add one later: a
    plan made without it had no closed form there). Not
    ``get_config()``: serializing a backbone took 0.1-0.3 s of a 0.6 s first
    call (frozen MobileNetV2 at 96 px); a cached plan is a starting point
    that every strategy checks and ``auto`` measures again, so two models
    alike in these and in their variables may share one."""
    found = []
    for layer, path in layer_tree.walk(model):
        activation = compat.activation_name(compat.activation(layer))
        rule = layers.rule_for(layer)  # a LoRA layer's own (its kind's lora=)
        found.append(
            [
                type(layer).__module__,
                type(layer).__qualname__,
                list(path),
                activation,
                ""
                if rule is None
                else f"{type(rule).__module__}.{type(rule).__qualname__}",
            ]
        )
    return found


def _name(variable: Any) -> str:
    return str(compat.variable_path(variable))


def _stable(text: str) -> str:
    """``text`` without object addresses (``<... at 0x7f...>``) and without
    Keras's numbering of generated names (``input_layer_3``: the same
    architecture built twice in one process numbers its layers anew)."""
    text = re.sub(r"0x[0-9a-fA-F]+", "0x", text)
    return re.sub(
        r'"([A-Za-z][A-Za-z0-9]*(?:_[A-Za-z][A-Za-z0-9]*)*)_\d+"', r'"\1"', text
    )


def _device_kind(device: str) -> str:
    if device.startswith("GPU"):
        gpus = tf.config.list_physical_devices("GPU")
        index = int(device.split(":")[1])
        if index < len(gpus):
            details = tf.config.experimental.get_device_details(gpus[index])
            return str(details.get("device_name", "GPU"))
    return f"{platform.machine()} {platform.processor()} x{os.cpu_count()}"


def load(name: str) -> CacheEntry | None:
    """The entry ``name``, or ``None`` (missing, off, or unusable: warned)."""
    folder = directory()
    if folder is None or not os.path.isdir(folder):
        return None  # (a folder that cannot be made is warned about on writing)
    path = os.path.join(folder, f"{name}.json")
    try:
        with open(path, encoding="utf-8") as f:
            entry = json.load(f)
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as err:
        _warn_once(
            path,
            f"cannot read the plan cache entry {path} ({err}); "
            "planning again and rewriting it.",
        )
        return None
    if not isinstance(entry, dict) or entry.get("format") != FORMAT:
        _warn_once(
            path,
            f"the plan cache entry {path} is stale or not jacobkit's; "
            "planning again and rewriting it.",
        )
        return None
    try:
        return CacheEntry.from_json(entry)
    except (KeyError, TypeError, ValueError) as err:
        _warn_once(
            f"{name}-content",
            f"the plan cache entry {name}.json is unusable ({err}); planning "
            "again and rewriting it.",
        )
        return None


def save(name: str, entry: CacheEntry) -> bool:
    """Write ``entry`` atomically; ``False`` (warned once) if it cannot."""
    folder = directory()
    if folder is None:
        return False
    path = os.path.join(folder, f"{name}.json")
    tmp = None
    try:
        os.makedirs(folder, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=folder, prefix=f".{name}.", suffix=".tmp")
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump(
                {**entry.to_json(), "format": FORMAT}, f, indent=1, sort_keys=True
            )
        os.replace(tmp, path)
    except OSError as err:
        if tmp is not None and os.path.exists(tmp):
            os.remove(tmp)
        _warn_once(
            folder,
            f"cannot write the plan cache in {folder} ({err}); "
            "plans are kept in memory only. Set JACOBKIT_CACHE_DIR to a "
            "writable directory, or to '' to turn the cache off.",
        )
        return False
    return True


def _warn_once(path: str, message: str) -> None:
    if runtime.first_notice(("plan cache", path)):
        warnings.warn(
            f"jacobkit: {message}",
            CacheWarning,
            stacklevel=runtime.caller_stacklevel(),
        )
