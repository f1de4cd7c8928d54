"""What a sequential row holds: the traced pass's tensors, alive from the op
that makes them to the last op that reads them.

``loop`` and ``while`` run one row's backward pass after another over the
one forward pass the tape kept. Their peak is read off the traced forward
and one-row backward pass by walking its ops in order (the order they were
traced in is one TensorFlow may run them in) and adding up the floating
tensors alive at each op: the forward tensors the backward pass reads stay
alive until it reads them, the others until their last forward reader.

NOTE (why, and the margins). Counting a whole forward pass's activations per
row in flight put the 144-feature generator (B=64, T=128, Conv1D
64/128/128) at 131 MiB for ``while(1)``, whose call measures 17 MiB beyond
its result: a row's backward pass holds its cotangents, a layer or two at a
time, over what the tape kept once. What the walk does not see: a copy a
kernel makes of its input (oneDNN reorders a 3-channel image into a
16-channel block: 1 MiB beside a 0.2 MiB input), and ops of two branches or
two rows run at once. Measured (TF 2.21, CPU, oneDNN on; the second call of
``while(1)`` and ``while(2)``, less the result twice) against the walked
peak plus the largest tensor, and a second row against its walked tensors:

======================================  =============  ============  ===========
problem                                 walked peak +  measured /    a 2nd row:
                                        largest        that          measured /
                                                                     walked
======================================  =============  ============  ===========
4 frozen Conv2D (16 x 32 x 32 x 16)     3.0 MiB        0.99          --
frozen MobileNetV2 head (16 x 96 px)    41.6 MiB       0.69          --
frozen EfficientNetB0 head              54.6 MiB       0.59-0.63     --
frozen ResNet50 head                    36.8 MiB       0.66-0.69     --
keras_hub BERT head (16 x 64, 128)      10.5 MiB       0.62-0.68     --
cnn2d (16 x 64 x 32, 16 filters)        8.6 MiB        0.89          1.75
generator (B=64, T=128, 64/128/128)     30.4 MiB       0.54-0.58     1.2-1.9
======================================  =============  ============  ===========

hence :data:`FIRST_ROW_MARGIN` and :data:`ROW_MARGIN`.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Collection, Hashable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

#: op types whose outputs are not activations (an identity is its input)
NOT_ACTIVATIONS = {"Const", "Placeholder", "ReadVariableOp", "Identity", "NoOp"}
#: the walked peak of the forward and first row plus the largest tensor,
#: times this (measured up to 0.99x that: the module's NOTE)
FIRST_ROW_MARGIN = 1.25
#: one more row in flight: the walked peak of a row's own backward tensors,
#: times this (measured up to 1.9x the walk: the module's NOTE)
ROW_MARGIN = 2.0


@dataclass(frozen=True)
class SequentialMemory:
    """What rows run one after another (``loop``, ``while``) hold, from the
    traced pass's shapes (:func:`walk`).

    Attributes:
        first_row: the forward pass and one row's backward pass, at their
            peak: the walked peak plus the largest tensor (a kernel's copy),
            times :data:`FIRST_ROW_MARGIN`.
        per_row: each further row in flight: the walked peak of a row's
            own backward tensors times :data:`ROW_MARGIN`.
    """

    first_row: int
    per_row: int

    def peak(self, rows_in_flight: int) -> int:
        """With ``rows_in_flight`` rows' backward passes alive at once."""
        return self.first_row + max(rows_in_flight - 1, 0) * self.per_row


@dataclass(frozen=True)
class Node:
    """One op of a pass as :func:`walk_nodes` reads it: its type, the keys
    of the tensors it reads (an identity chain's source), and the key and
    bytes (:func:`tensor_bytes`) of each tensor it makes."""

    type: str
    reads: tuple[Hashable, ...]
    made: tuple[tuple[Hashable, int], ...]


def graph_nodes(operations: Sequence[Any]) -> tuple[Node, ...]:
    """A traced pass's ``operations`` as :class:`Node` records, each tensor
    keyed by its name (an identity chain's reader by its source's)."""
    return tuple(
        Node(
            op.type,
            tuple(_source(t).name for t in op.inputs),
            tuple((t.name, tensor_bytes(t)) for t in op.outputs),
        )
        for op in operations
    )


def float_bytes(nodes: Iterable[Node]) -> int:
    """Bytes of the floating tensors ``nodes`` make (less the op types
    :data:`NOT_ACTIVATIONS`)."""
    return sum(
        size
        for node in nodes
        if node.type not in NOT_ACTIVATIONS
        for _, size in node.made
    )


def backward_bytes(forward: Sequence[Node], sources: Collection[Hashable]) -> int:
    """What one row's backward pass keeps: the floating tensors the
    ``forward`` nodes downstream of ``sources`` (the keys of the targets'
    handles) make, plus the largest one a node upstream of them makes (the
    forward pass's working set).

    A frozen backbone's activations are not differentiated: counting them
    put a MobileNetV2 head's one-row prior at 78 MiB where all rows at once
    measure 16-19 MiB, and refused budgets the run fits. Where no node reads
    a source (no target reaches the rows), nothing is downstream: the
    largest tensor alone, the forward pass's working set, not every tensor
    (what the traced pass counted where its graph had not captured the
    targets, while the eager pass counted the largest where a read took
    nothing further)."""
    downstream = set(sources)
    below: list[Node] = []
    above = 0
    for node in forward:
        if any(key in downstream for key in node.reads):
            below.append(node)
            downstream.update(key for key, _ in node.made)
        else:
            above = max(above, float_bytes((node,)))
    return float_bytes(below) + above


def walk_nodes(nodes: Sequence[Node], forward_ops: int) -> SequentialMemory:
    """:class:`SequentialMemory` of a pass given as :class:`Node` records, in
    the order they ran (or were traced): the first ``forward_ops`` the
    forward pass, the rest one row's backward pass."""
    last_read: dict[Hashable, int] = {}
    for i, node in enumerate(nodes):
        for key in node.reads:
            last_read[key] = max(last_read.get(key, -1), i)
    # running totals, each tensor taken off after its last reader: one pass
    ending: dict[int, list[tuple[int, int]]] = defaultdict(list)
    alive = row_alive = peak = row_peak = largest = 0
    for i, node in enumerate(nodes):
        if node.type not in NOT_ACTIVATIONS:
            for key, size in node.made:
                largest = max(largest, size)
                if size and key in last_read:
                    row_size = size if i >= forward_ops else 0
                    alive, row_alive = alive + size, row_alive + row_size
                    ending[max(last_read[key], i)].append((size, row_size))
        peak, row_peak = max(peak, alive), max(row_peak, row_alive)
        for size, row_size in ending.pop(i, ()):
            alive, row_alive = alive - size, row_alive - row_size
    return SequentialMemory(
        first_row=int(FIRST_ROW_MARGIN * (peak + largest)),
        per_row=int(ROW_MARGIN * row_peak),
    )


def _source(tensor: Any) -> Any:
    """The tensor an identity chain reads."""
    while tensor.op.type == "Identity" and tensor.op.inputs:
        tensor = tensor.op.inputs[0]
    return tensor


def tensor_bytes(tensor: Any) -> int:
    """Bytes of a fully-shaped floating tensor (0 for any other)."""
    if tensor.dtype.is_floating and tensor.shape.is_fully_defined():
        return int(tensor.shape.num_elements() * tensor.dtype.size)
    return 0
