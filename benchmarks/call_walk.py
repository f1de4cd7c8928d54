"""The modules one steady default call runs through: every jacobkit module
with a Python frame entered during the call (a profiler hook on function
calls), and the deepest chain of modules on the stack (consecutive frames of
one module counted once). ``docs/architecture.md`` gives the figure.

    python benchmarks/call_walk.py    # the generator example, 4th call

Under a second on 2 cores.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from types import FrameType
from typing import Any

import jacobkit as jk

ROOT = os.path.dirname(os.path.abspath(jk.__file__)) + os.sep


@dataclass(frozen=True)
class Walk:
    """The jacobkit modules a call entered, and the deepest chain of them."""

    modules: frozenset[str]
    depth: int


def _module(filename: str) -> str:
    relative = filename[len(ROOT) : -len(".py")].replace(os.sep, ".")
    if relative == "__init__":
        return "jacobkit"
    return "jacobkit." + relative.removesuffix(".__init__")


def walk(call: Callable[[], Any]) -> Walk:
    """Run ``call`` once under a profiler hook and return its :class:`Walk`."""
    seen: set[str] = set()
    deepest = 0

    def profile(frame: FrameType, event: str, arg: Any) -> None:
        nonlocal deepest
        if event != "call" or not frame.f_code.co_filename.startswith(ROOT):
            return
        chain: list[str] = []
        current: FrameType | None = frame
        while current is not None:
            if current.f_code.co_filename.startswith(ROOT):
                module = _module(current.f_code.co_filename)
                if not chain or chain[-1] != module:
                    chain.append(module)
            current = current.f_back
        seen.add(chain[0])
        deepest = max(deepest, len(chain))

    sys.setprofile(profile)
    try:
        call()
    finally:
        sys.setprofile(None)
    return Walk(frozenset(seen), deepest)


def steady_default_call() -> Walk:
    """The walk of the 4th default call on the generator example (the plan
    cache off: the same walk on every machine)."""
    from jacobkit.testing import examples

    ex = examples.build("generator")
    for _ in range(3):
        jk.jacobian(ex.model, ex.inputs, ex.layer, cache=False)
    return walk(lambda: jk.jacobian(ex.model, ex.inputs, ex.layer, cache=False))


if __name__ == "__main__":
    found = steady_default_call()
    print(f"{len(found.modules)} modules, at most {found.depth} deep")
    for name in sorted(found.modules):
        print(f"  {name}")
