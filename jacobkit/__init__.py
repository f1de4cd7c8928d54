"""jacobkit: per-output Jacobians of TensorFlow/Keras models.

>>> import jacobkit as jk
>>> res = jk.jacobian(model, inputs, "dense")   # doctest: +SKIP
>>> res.kernel.shape                            # (F, *kernel.shape)  # doctest: +SKIP

The public names are imported on first use, so that ``import jacobkit`` (and
``jacobkit --help``) does not load TensorFlow.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from jacobkit import runtime

#: the package version, its one source (``pyproject.toml`` reads it)
__version__ = "0.2.0"

#: what ``import tensorflow`` failing means for a jacobkit user
NO_TENSORFLOW = (
    "jacobkit needs TensorFlow, and none is installed: install one variant, e.g. "
    "pip install 'jacobkit[tensorflow]' (or 'jacobkit[tensorflow-cpu]'), or "
    "your own tensorflow / tensorflow-cpu / tf-nightly build"
)

#: public name -> the module that defines it
_PUBLIC = {
    "ClippedSum": "jacobkit.problem.reduction",
    "Project": "jacobkit.problem.reduction",
    "Inputs": "jacobkit.problem.tensor_targets",
    "JacobianResult": "jacobkit.result",
    "Loss": "jacobkit.problem.loss",
    "CompiledOutput": "jacobkit.compiled",
    "Function": "jacobkit.compiled",
    "function": "jacobkit.compiled",
    "Output": "jacobkit.problem.tensor_targets",
    "Plan": "jacobkit.planner",
    "PrecisionWarning": "jacobkit.strategies.precision",
    "Stats": "jacobkit.problem.solution",
    "VerificationError": "jacobkit.verification",
    "GramResult": "jacobkit.reductions.grams",
    "coverage": "jacobkit.reach",
    "gram": "jacobkit.reductions.grams",
    "jacobian": "jacobkit.api",
    "plan": "jacobkit.api",
    "verify": "jacobkit.verification",
}
#: public name -> the module that is it (``jk.data`` is :mod:`jacobkit.batches`)
_MODULES = {
    "data": "jacobkit.batches",
    "explain": "jacobkit.explain",
    "layers": "jacobkit.layers",
    "memory": "jacobkit.memory",
    "planner": "jacobkit.planner",
    "privacy": "jacobkit.privacy",
    "strategies": "jacobkit.strategies",
    "testing": "jacobkit.testing",
}

__all__ = [
    "ClippedSum",
    "CompiledOutput",
    "Function",
    "GramResult",
    "Inputs",
    "JacobianResult",
    "Loss",
    "Output",
    "Plan",
    "PrecisionWarning",
    "Project",
    "Stats",
    "VerificationError",
    "__version__",
    "coverage",
    "data",
    "explain",
    "function",
    "gram",
    "jacobian",
    "layers",
    "memory",
    "plan",
    "planner",
    "privacy",
    "strategies",
    "testing",
    "verify",
]

if TYPE_CHECKING:  # pragma: no cover - for type checkers and IDEs
    from jacobkit import batches as data
    from jacobkit import (
        explain,
        layers,
        memory,
        planner,
        privacy,
        strategies,
        testing,
    )
    from jacobkit.api import jacobian, plan
    from jacobkit.compiled import CompiledOutput, Function, function
    from jacobkit.planner import Plan
    from jacobkit.problem.loss import Loss
    from jacobkit.problem.reduction import ClippedSum, Project
    from jacobkit.problem.solution import Stats
    from jacobkit.problem.tensor_targets import Inputs, Output
    from jacobkit.reach import coverage
    from jacobkit.reductions.grams import GramResult, gram
    from jacobkit.result import JacobianResult
    from jacobkit.strategies.precision import PrecisionWarning
    from jacobkit.verification import VerificationError, verify


def __getattr__(name: str) -> Any:
    if name not in _MODULES and name not in _PUBLIC:
        raise AttributeError(f"module 'jacobkit' has no attribute {name!r}")
    try:
        if name in _MODULES:
            value = importlib.import_module(_MODULES[name])
        else:
            value = getattr(importlib.import_module(_PUBLIC[name]), name)
    except ModuleNotFoundError as err:
        if err.name != "tensorflow":
            raise
        raise ModuleNotFoundError(NO_TENSORFLOW, name="tensorflow") from err
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_PUBLIC, *_MODULES})


# Before TensorFlow's runtime starts, switch its CPU allocator to the one that
# keeps statistics, so that peak memory can be measured and budgets planned on
# CPU (``TF_CPU_ALLOCATOR_USE_BFC=false`` opts out). This loads no TensorFlow.
runtime.enable_bfc_cpu_allocator()
