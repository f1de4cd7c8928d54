"""Checks shared by the tests of jacobkit's gradient rules
(:mod:`jacobkit.strategies.gradients`: ``Conv2D``'s in
``test_conv_gradients.py``, ``MatMul``'s in ``test_matmul_gradients.py``)."""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any

from tensorflow.python.framework import ops

import jacobkit as jk
from jacobkit import runtime, testing


def strategies(chunk: int) -> list[Any]:
    """The strategies each rule is checked under: every computation that
    takes a backward pass (``chunked`` by ``chunk`` rows), ``loop`` (eager:
    the rule in place during each call) and ``forward`` (the rule
    differentiated)."""
    return [
        jk.strategies.While(),
        jk.strategies.Chunked(chunk),
        jk.strategies.Batch(),
        jk.strategies.Jacobian(),
        jk.strategies.Loop(),
        jk.strategies.Forward(),
    ]


def assert_in_place_only_inside(
    op: str, rules: Callable[[], AbstractContextManager[None]]
) -> None:
    """``op``'s registered gradient is replaced inside ``rules()`` (nested
    blocks: one replacement) and TensorFlow's own again after it, with no
    replacement left in the process's record."""
    registry = ops._gradient_registry._registry
    own = registry[op]
    with rules():
        assert registry[op] is not own
        with rules():  # nested: one replacement
            assert registry[op] is not own
        assert registry[op] is not own
    assert registry[op] is own
    assert not runtime.PROCESS.gradient_rules


def assert_agrees_with_float64(
    model: Any, inputs: Any, layer: Any, strategy: Any, taken: list[Any]
) -> None:
    """``jk.jacobian(model, inputs, layer, strategy=strategy)`` through the
    rule (``taken``: what the forced rule recorded; some entry truthy where
    it took a gradient) against the float64 reference, the tolerance
    derived from the obvious loop's own error
    (:func:`jacobkit.testing.assert_close`).

    Forward mode is not asked to have taken the rule: TensorFlow's
    forwardprop traces each op's JVP (through its registered gradient) once
    per op, attributes and shapes for the whole process, so whether the rule
    was in place depends on what ran before in the process (a CI worker had
    traced the generator's Conv2D JVP without it); the values agree either
    way."""
    result = jk.jacobian(model, inputs, layer, strategy=strategy)
    if strategy.name != "forward":
        assert any(taken)  # the backward pass's gradients were the rule's
    target = model.get_layer(layer) if isinstance(layer, str) else layer
    expected = testing.float64_reference(model, inputs, target)
    testing.assert_close(result, expected)
