"""What ``jacobkit compare`` compares on: the problem (a saved Keras model
with ``.npy`` inputs and a target layer, or the built-in generator at its
sizes) with its float64 copy, and the reference every strategy is checked
against (the float64 loop, or the loop on the model itself where Keras cannot
build a float64 copy).

Imports no TensorFlow (the parser reads :data:`DEFAULT_SIZES`); its functions
run in the parent process once the command runs. A strategy's child rebuilds
the problem itself (:mod:`jacobkit.bench.child`).
"""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass
from typing import Any

from jacobkit.cli._common import UsageError, custom_objects, load_model

#: the built-in problem: the users' generator at a size that runs in seconds
DEFAULT_SIZES = {
    "batch": 16,
    "sequence": 64,
    "channels": 8,
    "filters": 32,
    "features": 144,
}


@dataclass(frozen=True)
class Loaded:
    """The problem to compare on: ``model`` and ``inputs``, their float64
    copies (``model64`` ``None`` where Keras cannot build one), the target
    ``layer``, the problem ``described`` in words and, for the built-in
    generator, its ``sizes`` (with which a child builds it again)."""

    model: Any
    inputs: Any
    layer: Any
    model64: Any
    inputs64: Any
    described: str
    sizes: dict[str, int] | None = None


def _load_inputs(path: str) -> Any:
    import numpy as np

    if not os.path.exists(path):
        raise UsageError(f"--inputs {path}: no such file.")
    try:
        return np.load(path)
    except (OSError, ValueError) as err:
        raise UsageError(f"--inputs {path}: not a .npy array ({err}).") from err


def load_problem(args: argparse.Namespace) -> Loaded:
    from jacobkit.testing import examples

    if args.model:
        from jacobkit import testing
        from jacobkit.keras import saved

        model = load_model(args.model, args.custom_objects)
        inputs = _load_inputs(args.inputs)
        try:
            # a custom layer is rebuilt in float64 from its config as Keras
            # loaded it: with the classes --custom-objects names
            with saved.object_scope(custom_objects(args.custom_objects)):
                model64 = testing.float64_copy(model)
        except TypeError:
            model64 = None
        return Loaded(model, inputs, args.layer, model64, inputs, args.model)
    sizes: dict[str, int] = {
        name: int(getattr(args, f"size_{name}") or value)
        for name, value in DEFAULT_SIZES.items()
    }
    ex = examples.build("generator", "float32", **sizes)
    ex64 = examples.build("generator", "float64", **sizes)
    text = ", ".join(f"{k}={v}" for k, v in sizes.items())
    described = f"built-in generator ({text})"
    return Loaded(
        ex.model, ex.inputs, ex.layer, ex64.model, ex64.inputs, described, sizes
    )


def reference(
    problem: Any, loaded: Loaded, args: argparse.Namespace
) -> tuple[list[Any], str]:
    """The reference Jacobians and what they are, in words: the float64 loop
    on the float64 copy, or the float32 loop without one."""
    from jacobkit import engine, strategies, testing
    from jacobkit.keras import compat
    from jacobkit.problem import Call

    if loaded.model64 is None:
        result = engine.run(problem, strategies.Loop())
        policy = compat.dtype_policy_name(problem.model)
        return list(result.jacobians.values()), (
            f"{policy or 'float32'} loop on the model itself (no float64 copy: "
            "Keras cannot rebuild this model from its config)"
        )
    call = Call(
        loaded.model64, loaded.layer, outputs=args.outputs, features=args.features
    )
    ref_problem = call.problem(loaded.inputs64)
    reference = testing.reference_jacobian(
        loaded.model64,
        loaded.inputs64,
        list(ref_problem.targets),
        outputs=args.outputs,
        features=args.features,
        call_kwargs={"training": False},
    )
    built = "a float64 copy of the model" if args.model else "the float64 build"
    return reference, f"float64 loop on {built} (every variable float64)"
