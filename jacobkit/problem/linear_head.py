"""The linear-head structure: the model ends in a stock ``Dense`` with
linear activation, and ``D`` rows of its input stand for its ``F`` rows.

NOTE (why the shortcut is exact). The model ends in ``Y = h @ W + c``: a
stock ``Dense(F)`` with linear activation on ``h`` of shape ``(B, ..., D)``,
and the targets sit before it. Every row of ``Y`` (``"features"``:
``sum_{b,...} Y[..., f]``; ``"per_example"``: ``sum_{...} Y[b, ..., f]``;
``"full"``: ``Y[b, ..., f]``) is then ``sum_c W[c, f] * s_c + const``, where
``s_c`` is the same kind of row of ``h``. ``W`` and ``c`` are not targets, so
by linearity ``J(row_f) = sum_c W[c, f] * J(s_c)``: the Jacobians of the D
rows of ``h`` combined with the head's kernel (``features=`` picks columns of
``W``). D rows are computed instead of F.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import tensorflow as tf

from jacobkit.keras import compat
from jacobkit.keras import graph as keras_graph
from jacobkit.problem import functional
from jacobkit.problem.call import Call
from jacobkit.problem.functional import Graph, NotApplicable
from jacobkit.problem.problem import Problem


@dataclass(frozen=True)
class LinearHead:
    """The model ends in a linear ``Dense`` head on ``D`` channels.

    Attributes:
        head: the ``Dense`` layer.
        width: ``D``, the size of the head's input's last axis.
        sub_problem: the same rows of the head's input ``h`` (a sub-model
            built from the functional graph), same targets; its Jacobians
            have shape ``rows_shape[:-1] + (D,) + v.shape``. It takes the
            model's inputs and holds none (:meth:`Problem.detached`): run it
            on ``sub_problem.with_inputs(problem.inputs)``.
        columns: the columns of the head's kernel the rows select (the
            ``features=`` indices, made non-negative), or ``None`` for all.
    """

    head: Any
    width: int
    sub_problem: Problem
    columns: tuple[int, ...] | None

    def kernel(self) -> tf.Tensor:
        """The head's kernel restricted to the rows' columns: ``(D, K)``."""
        kernel = tf.convert_to_tensor(self.head.kernel)
        if self.columns is None:
            return kernel
        return tf.gather(kernel, list(self.columns), axis=1)

    def describe(self) -> str:
        return (
            f"linear head {self.head.name!r}: {self.width} rows of its input "
            "combined with its kernel"
        )


def find(
    problem: Problem,
    graph: Graph,
    *,
    narrower: bool = True,
    known: LinearHead | None = None,
) -> LinearHead:
    """The model's linear head: ``narrower`` than the rows (``D < F``), or
    of any width. ``known``: the head already found for ``problem`` (the
    same head and sub-model), returned once the checks pass, so that its
    sub-problem, a traced pass of the sub-model, is built once.

    Raises:
        NotApplicable: the model does not end in such a head, or not
            certainly.
    """
    keras = graph.keras
    head, node = keras_graph.producer(graph.output)
    if functional.linear_kind(head) != "matmul":
        raise NotApplicable(
            f"linear head: the output layer {head.name!r} "
            f"({type(head).__name__}) is not a stock Dense layer"
        )
    if compat.stock_activation(keras, head.activation) != "linear":
        raise NotApplicable(
            f"linear head: {head.name!r} has activation "
            f"{compat.activation_name(head.activation) or head.activation!r}, "
            "not linear"
        )
    if functional.lora_or_quantized(head):
        raise NotApplicable(f"linear head: {head.name!r} is LoRA/quantized")
    keras_graph.used_once(head)
    functional.refuse_own_variables(problem, head, "linear head")
    h = keras_graph.single_input(head, node)
    width = int(head.kernel.shape[0])
    rows_width = len(functional.channels(problem))
    if narrower and width >= rows_width:
        raise NotApplicable(
            f"linear head: {head.name!r} has {width} inputs for {rows_width} "
            "features, no fewer"
        )
    if known is not None:
        return known
    sub_model = keras_graph.input_model(keras, problem.model, h)
    sub_problem = Call(
        sub_model,
        problem.layer if problem.layer is not None else list(problem.targets),
        outputs=problem.rows_spec.mode,
        training=problem.training,
        unconnected="zero",
    ).problem(problem.inputs)
    columns = (
        None if problem.rows_spec.features is None else functional.channels(problem)
    )
    return LinearHead(head, width, sub_problem, columns)
