"""The strategies jacobkit ships, registered in this order (the order
:func:`~jacobkit.strategies.registry.names` lists them, and ``auto`` breaks
ties in tracing cost by)."""

from __future__ import annotations

from jacobkit.strategies.base import Strategy
from jacobkit.strategies.batch import Batch
from jacobkit.strategies.chunked import Chunked
from jacobkit.strategies.forward import Forward
from jacobkit.strategies.grouped import Grouped
from jacobkit.strategies.jacobian import Jacobian
from jacobkit.strategies.loop import Loop
from jacobkit.strategies.registry import register
from jacobkit.strategies.structured import Structured
from jacobkit.strategies.while_loop import While

BUILT_IN: tuple[type[Strategy], ...] = (
    Loop,
    Jacobian,
    While,
    Batch,
    Chunked,
    Forward,
    Structured,
    Grouped,
)

for _cls in BUILT_IN:
    register(_cls)
