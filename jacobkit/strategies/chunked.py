"""``chunked``: ``tf.vectorized_map`` over chunks of one-hot cotangents."""

from __future__ import annotations

import contextlib
import logging
import re
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, final

import tensorflow as tf

from jacobkit.problem import Problem, through
from jacobkit.problem.reduction import Norms, Rows
from jacobkit.strategies import precision, vectorize
from jacobkit.strategies.base import ZERO, Strategy
from jacobkit.strategies.chunks import (
    PerChunk,
    as_norms,
    as_rows,
    check_chunk_size,
    rows_in_chunks,
)

#: the rows a reduced call's ``chunked`` holds at once, tried largest first
REDUCED_CHUNKS = (16, 8, 4, 2, 1)


@final
@dataclass(frozen=True)
class Chunked(Strategy):
    """Vectorized chunking: the rows are split into chunks of ``chunk_size``;
    each chunk is one vectorized backward pass (``tf.vectorized_map`` of
    ``tape.gradient`` over one-hot cotangents), and chunks run one after
    another in a ``tf.while_loop``. Extra memory is ``chunk_size`` times the
    activations after the target layer; ``chunk_size=R`` is ``tape.jacobian``.

    The tape is persistent: the mapped gradient is built more than once while
    tracing (pfor conversion, and once per chunk shape).
    """

    name = "chunked"
    chunk_size: int = 16

    #: measured first call minus steady call, relative to ``while``'s: 1.4x
    #: on both the MLP and the wide generator (2-core CPU)
    trace_weight = 1.5
    #: it writes each chunk in place, but a chunk's pfor intermediates take
    #: about another result: on the MLP 512-1024-1024-144 (a 289 MiB
    #: result) chunked(36) peaked at 666-771 MiB and chunked(144) at 689 MiB
    #: (2.3-2.7x the result); predicted at one copy, chunked(36) was tried
    #: by auto and set the process's high-water mark over its bound
    result_copies = 2

    @classmethod
    def for_auto(cls, num_rows: int) -> Chunked:
        return Chunked(num_rows)

    @classmethod
    def for_reduced(cls, problem: Problem) -> tuple[Strategy, ...]:
        """Fewer and fewer rows at once (:data:`REDUCED_CHUNKS`)."""
        return tuple(Chunked(c) for c in REDUCED_CHUNKS)

    reduced_preference = 2

    def rows_at_once(self, num_rows: int) -> int:
        return min(self.chunk_size, num_rows)

    def vectorized_rows(self) -> bool:
        return True

    def rows_formed(self, num_rows: int) -> int:
        """Rows whose vectorized backward tensors are alive at once (the
        planner's one count of them, a reduction's rows formed and the
        prior's :meth:`~jacobkit.planner.scratch.MemoryPrior.vectorized_peak`
        alike): two chunks' rows where there is more than one chunk
        (:func:`jacobkit.strategies.chunks.map_chunks` runs one chunk at a
        time, yet the wide generator's ``chunked(36)`` measured what 72 rows
        predict; why is not known).

        Measured (TF 2.21, 2-core CPU, 2 inter-op threads, oneDNN on; pinned
        to one core, ``chunked(32)`` below measured 15.1 MiB and
        ``chunked(16)`` 11.7), against the prior's count for these rows
        (results included):

        =======================================  ============  =========  =====
        problem                                  strategy      measured   prior
        =======================================  ============  =========  =====
        GPT-2 token attribution (2 layers, 64)   chunked(32)   28.6 MiB   33.6
        same                                     chunked(16)   19.2 MiB   33.6
        generator B=16 T=64 (8 -> 32, 48 rows)   chunked(48)   28-44 MiB  37.3
        same                                     chunked(36)   28-35 MiB  55
        generator B=64 T=128 (64/128/128, 144)   chunked(144)  2184-2756  2614
        same                                     chunked(36)   1182 MiB   1318
        MLP 512-1024-1024-144, B=64, sq. rows    chunked(144)  577 MiB    724
        =======================================  ============  =========  =====

        One chunk's rows alone put the wide generator's ``chunked(36)`` at
        670 MiB, under its measured 1182. The forward pass's activations per
        row (the count before) put them at 201, 122, 9248 and 2364 MiB."""
        at_once = self.rows_at_once(num_rows)
        return num_rows if at_once >= num_rows else min(num_rows, 2 * at_once)

    def __post_init__(self) -> None:
        object.__setattr__(
            self, "chunk_size", check_chunk_size(self.name, self.chunk_size)
        )

    def smaller(self) -> Chunked | None:
        """Half the rows per chunk, down to one."""
        return Chunked(self.chunk_size // 2) if self.chunk_size > 1 else None

    def cannot_run(self, problem: Problem) -> str | None:
        layers = through.depthwise_layers(problem)
        if layers is None:
            return None
        return (
            f"TensorFlow's vectorization (pfor) has no rule for the gradient of "
            f"{layers}, which this target's gradient passes through; "
            "strategy='jacobian', 'while' or 'loop' run there"
        )

    def check(self, problem: Problem) -> None:
        reason = self.cannot_run(problem)
        if reason is not None:
            raise ValueError(f"jacobian(strategy='chunked'): {reason}.")
        precision.refuse_float16_vectorized(problem, self.name)

    def builds(self) -> Mapping[str, Callable[[Problem], Callable[[Any], Any]]]:
        """The rows, and their norms chunk by chunk."""
        return {
            Rows.name: self.build,
            Norms.name: lambda problem: self._in_chunks(problem, as_norms),
        }

    def build(self, problem: Problem) -> Callable[[Any], Any]:
        return self._in_chunks(problem, as_rows)

    def _in_chunks(self, problem: Problem, per_chunk: PerChunk) -> Callable[[Any], Any]:
        targets = problem.targets

        def vectorized(tape: Any, rows: tf.Tensor, cotangents: tf.Tensor) -> Any:
            with _pfor_refused():
                return vectorize.vectorized_map(
                    lambda ct: tape.gradient(
                        rows, targets, output_gradients=ct, unconnected_gradients=ZERO
                    ),
                    cotangents,
                    fallback_to_while_loop=False,
                )

        return rows_in_chunks(
            problem, self.chunk_size, vectorized, per_chunk, shared=True
        )


class _PforErrors(logging.Filter):
    """Drops pfor's own error records (the NodeDef of the op it could not
    convert, ~160 lines on a depthwise convolution): the refusal says it."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "pfor" not in record.pathname


@contextlib.contextmanager
def _pfor_refused() -> Iterator[None]:
    """While tracing a vectorized pass: pfor's error logs dropped, and its
    failure to convert an op refused in one sentence naming the op."""
    logger = logging.getLogger("tensorflow")
    dropper = _PforErrors()
    logger.addFilter(dropper)
    try:
        yield
    except ValueError as err:
        text = str(err)
        if "pfor" not in text and "loop invariant" not in text:
            raise
        found = re.search(r"op '(\w+)'", text)
        op = f"op {found.group(1)}" if found else "an op"
        raise ValueError(
            f"jacobian(strategy='chunked'): TensorFlow's vectorization (pfor) "
            f"cannot convert the gradient's {op} on this model; "
            "strategy='jacobian', 'while' or 'loop' run there."
        ) from None
    finally:
        logger.removeFilter(dropper)
