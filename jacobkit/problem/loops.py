"""What a ``tf.while_loop`` of the forward pass keeps for its gradient: the
tensors each step pushes onto its accumulators, which the traced pass's ops
do not show (a recurrent layer's are in its loop's body; the loop's outputs
are the lists, of no float bytes).

NOTE (measured, why). Uncounted, an LSTM(64) over 12 steps of 6 features
(32 examples, a Dense(3) head, 32 loss rows; oneDNN on, the machine loaded)
was predicted at 0.28 MiB of activations a row: ``reduce="norm"`` on
``chunked(16)`` predicted 9.2 MiB and measured 68-71 MiB, ``while(1)``
0.7 against 3.1-3.9. Its loop keeps 1.49 MiB (127 KiB a step); vectorized
by pfor, each row in flight held 4.2 MiB (2.8 times that: the backward
loop's tensors batched per row besides), one row of ``while(1)`` 1.3 times
that. Hence :data:`LOOP_MARGIN`.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import tensorflow as tf

from jacobkit.problem.liveness import tensor_bytes

#: op types of a ``tf.while_loop`` (recurrent layers run one over time)
LOOPS = ("While", "StatelessWhile")
#: what a row holds of a loop's gradient over its accumulators' bytes
#: (measured up to 2.8x: the module's NOTE)
LOOP_MARGIN = 3.5


def kept_bytes(operations: Iterable[Any]) -> int:
    """Bytes the forward pass's loops among ``operations`` keep for their
    gradient (each step's pushed tensors times its steps), times
    :data:`LOOP_MARGIN`; 0 for a loop whose steps or body are not known."""
    total = sum(_loop_bytes(op) for op in operations if op.type in LOOPS)
    return int(LOOP_MARGIN * total)


def _loop_bytes(op: Any) -> int:
    """What one loop keeps for its gradient: each step's pushed tensors and
    what the loops in its body keep (a nested loop's accumulators, per step
    of the outer one: its own pushes of them are lists, of no float bytes),
    times its steps; 0 where its steps or body are not known."""
    steps = _steps(op)
    body = _body(op)
    if steps is None or body is None:
        return 0
    step = 0
    for o in body.get_operations():
        if o.type == "TensorListPushBack":
            step += tensor_bytes(o.inputs[1])
        elif o.type in LOOPS:
            step += _loop_bytes(o)
    return steps * step


def _body(op: Any) -> Any:
    """The loop's body graph (its function in the graph's library)."""
    try:
        found = op.graph._get_function(op.get_attr("body").name)
    except (AttributeError, ValueError):
        return None
    return getattr(found, "graph", None)


def _steps(op: Any) -> int | None:
    """The loop's steps where its inputs tell them: its
    ``maximum_iterations`` (``while_v2``'s second input) where static, else
    the longest sequence it reads as a list (a recurrent layer's inputs
    over time, unstacked: ``TensorListFromTensor``)."""
    if len(op.inputs) > 1:
        most = tf.get_static_value(op.inputs[1])
        if most is not None and int(most) >= 0:
            return int(most)
    lengths = [
        int(t.op.inputs[0].shape[0])
        for t in op.inputs
        if t.op.type == "TensorListFromTensor"
        and t.op.inputs[0].shape.rank
        and t.op.inputs[0].shape[0] is not None
    ]
    return max(lengths, default=None)
