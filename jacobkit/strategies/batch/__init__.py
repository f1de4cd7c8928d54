"""``batch``: per-example Jacobian at the layer's output, contracted with its input.

NOTE (why the contraction is exact). Let the target layer compute
``z = linear(x; W, b)`` (Dense: ``x @ W + b``; Conv: ``conv(x, W) + b``) and
then ``a = activation(z)``. ``x`` does not depend on ``W`` or ``b`` (checked:
the layer must run once per forward pass), so by the chain rule every row ``r``
has ``dr/dW = VJP of linear at x, applied to the cotangent dr/dz``, and the
VJP of a map that is linear in ``(W, b)`` is exact, not a linearization.
That VJP is written in closed form over the unfolded input (see the NOTE in
:func:`jacobkit.layers.contract.kernel_and_bias_gradients`): for rows that depend on a
single example ``b`` only (``"per_example"`` and ``"full"``), ``dr/dz`` is
zero outside example ``b``, so one batched einsum gives every (example, row)
pair; ``"features"`` rows are sums over examples, and the same product also
sums over the batch. ``dr/dz`` itself comes from the gradient of the
batch-summed rows ``sum_b P[b, k]`` with respect to ``z``, whose block
``z[b]`` is ``dP[b, k]/dz[b]`` (one backward pass gives row ``k`` of every
example), in vectorized chunks of :data:`ROWS_AT_ONCE` rows. That is correct
only when examples do not mix (no batch statistics, no attention across the
batch): that is checked once, numerically, before the first run.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, final

import tensorflow as tf

from jacobkit.layers.base import Tapped
from jacobkit.problem import Problem, through
from jacobkit.problem.reduction import Output, Rows
from jacobkit.strategies import vectorize
from jacobkit.strategies.base import Strategy
from jacobkit.strategies.batch import checks
from jacobkit.strategies.batch import seeds as seeding
from jacobkit.strategies.batch.contract import Cotangents
from jacobkit.strategies.batch.forms import FORMS, Contract
from jacobkit.strategies.batch.forward import tapped_forward


@final
@dataclass(frozen=True)
class Batch(Strategy):
    """Batched Jacobian with respect to the target layer's own pre-activation
    output ``z``, then the kernel/bias Jacobian by contracting with the layer's
    input in closed form: unfolded patches and one batched matmul, per example
    for per-example rows (see the NOTE in this module). Vectorized over rows
    with no per-row pass through the layers before the target; extra memory
    :data:`ROWS_AT_ONCE` rows' backward passes (each over the batch), and
    every row's cotangent at ``z`` (R × size(z) per example) besides the
    result. With ``reduce="norm"``,
    the norms come from the Gram form or chunks of rows
    (:mod:`jacobkit.layers.norms`).

    Needs a layer with a rule (:mod:`jacobkit.layers`: Dense, Conv,
    EinsumDense, MultiHeadAttention, ...), wherever it is called: as a node
    of a functional graph (tapped by running the graph beside it,
    :mod:`jacobkit.keras.graph`) or from Python (its calls found in the
    traced pass, :mod:`jacobkit.keras.calls`), never by changing it; a layer
    called several times gets the sum over its calls. A layer of several
    linear parts (an attention layer's projections, a separable convolution's
    halves) has each part's input and output tapped, and each part's kernel
    and bias contracted by its own rule.
    """

    name = "batch"

    #: measured first call minus steady call, relative to ``while``'s: 3.5x
    #: on the MLP (1.29 s vs 0.37 s), 6x on the wide generator (2-core CPU)
    trace_weight = 4.0
    result_copies = 1

    @classmethod
    def for_auto(cls, num_rows: int) -> Batch:
        return Batch()

    @classmethod
    def for_reduced(cls, problem: Problem) -> tuple[Strategy, ...]:
        """The closed forms first, where every target has one."""
        return (Batch(),)

    reduced_preference = 0

    def passes(self, problem: Problem) -> int:
        """One per row of each example where rows are of one example (each
        pass gives that row of every example), else one per row."""
        batch = problem.batch_size
        if problem.rows_spec.of_one_example and batch:
            return max(problem.num_rows // int(batch), 1)
        return problem.num_rows

    def rows_at_once(self, num_rows: int) -> int:
        """:data:`ROWS_AT_ONCE` backward passes (each over the batch) at once
        (more on a small layer, up to :data:`CHUNK_BYTES` of cotangents: too
        little to matter in ``auto``'s memory prior)."""
        return min(num_rows, ROWS_AT_ONCE)

    def rows_formed(self, num_rows: int) -> int:
        """None: the closed forms reduce each layer's factors."""
        return 0

    def cannot_run(self, problem: Problem) -> str | None:
        """Tensor targets (``Inputs()``, ``Output()``: the saliency maps,
        Grad-CAM, token attribution): no closed form is of a tensor, so
        ``auto`` leaves ``batch`` out before it runs. Kept as a candidate
        there, it was tried (and refused) after every other one, and a
        session with it pending was never settled."""
        return checks.tensor_refusal(problem)

    def check(self, problem: Problem) -> None:
        """Refuses what ``batch`` cannot run (:mod:`.checks`): a
        target without a closed form, rows that mix examples, a layer that
        cannot be tapped or computes more than its closed form."""
        checks.check(problem, self.name)

    def builds(self) -> Mapping[str, Callable[[Problem], Callable[[Any], Any]]]:
        """Every kind with a closed form (:mod:`.forms`)."""
        return {
            name: functools.partial(self._contracted, form=form)
            for name, form in FORMS.items()
        }

    def build(self, problem: Problem) -> Callable[[Any], Any]:
        return self._contracted(problem, FORMS[Rows.name])

    def _contracted(self, problem: Problem, form: Contract) -> Callable[[Any], Any]:
        summed = problem.rows_spec.summed_over_batch
        # pfor has no rule for a depthwise convolution's gradient: there, its
        # ops alone run in a while loop inside the vectorized pass (as
        # tape.jacobian does), the rest stays vectorized
        fallback = through.depthwise_layers(problem, after_only=True) is not None
        head = seeding.seed_head(problem)

        def compute(inputs: Any) -> Any:
            seeds: seeding.OneHotRows | seeding.HeadRows
            if head is None:
                forward = tapped_forward(problem, inputs)
                seeds = seeding.OneHotRows(int(forward.rows.shape[1]))
            else:
                # the rows of the head's input, seeded with the head's kernel
                forward = tapped_forward(head.sub_problem, inputs)
                seeds = seeding.HeadRows(tf.transpose(head.kernel()))
            zs = [tap.z for tap in forward.taps]
            batch, rows = int(forward.rows.shape[0]), seeds.count

            def one_row() -> list[Any]:
                # each (B, *z.shape[1:]): one row per example (a loss), one
                # backward pass as it is, not pfor's conversion of it (a
                # vectorized map of one seed: the same products, BERT tiny's
                # clipped sum traced 2,519 graph ops with it, 2,245 without;
                # its results moved by 1e-7 relative, float32 rounding)
                return forward.cotangents(seeds.only(batch, forward.rows.dtype))

            def cotangents(start: Any, count: Any) -> Any:
                # each (count, B, *z.shape[1:]): d P[b, k] / d z[b] for the
                # chunk's rows k, from the batch-summed rows (examples do not
                # mix)
                if rows == 1:
                    return [tf.expand_dims(d, 0) for d in one_row()]
                chunk = seeds.of(start, count, batch, forward.rows.dtype)
                found = vectorize.vectorized_map(
                    forward.cotangents,
                    chunk,
                    fallback_to_while_loop=fallback,
                )
                # inside map_chunks' while loop, pfor's outputs lose the
                # static row count, which the rules' reshapes read (an
                # EinsumDense's summed rows failed so)
                return [
                    d if z.shape.rank is None else tf.ensure_shape(d, (count, *z.shape))
                    for d, z in zip(found, zs, strict=True)
                ]

            size = rows_per_chunk(rows, zs)
            taps = ([_in_z_dtype(tap) for tap in forward.taps], forward.parts)
            found = form(
                problem,
                taps,
                Cotangents(cotangents, rows, size, one_row if rows == 1 else None),
                summed=summed,
            )
            if head is None and isinstance(found, Output) and found.norms is not None:
                # the clipped sum: its pass's rows (a DP step's loss) ride along
                found = found._replace(rows=tf.stop_gradient(forward.rows))
            return found

        return compute


#: rows whose cotangents at ``z`` are computed in one vectorized backward
#: pass (measured on CPU: chunks of 16 beat all 144 rows at once, which
#: ``tape.batch_jacobian`` did, by about 2x on the Conv1D generator)
ROWS_AT_ONCE = 16
#: more rows at once while their cotangents at ``z`` stay under this size: on
#: a small layer each iteration of the chunk loop costs more than its
#: arithmetic (MLP 32-64-64-144, B=16: the raw call 2.3-3.2 ms with all 144
#: rows at once against 3.4-4.1 ms in chunks of 16, 2-core CPU). At 2 MiB
#: the generator's conv1 (B=16, 64 x 32 per example) keeps chunks of 16.
CHUNK_BYTES = 2 * 2**20


def rows_per_chunk(rows: int, zs: list[tf.Tensor]) -> int:
    """Rows per vectorized backward pass: :data:`ROWS_AT_ONCE`, or more while
    their cotangents at the ``zs`` (``count × z.shape`` each) fit
    :data:`CHUNK_BYTES`, split into chunks of equal size (no small last
    chunk)."""
    per_row = max(sum(z.shape.num_elements() * z.dtype.size for z in zs), 1)
    most = min(rows, max(ROWS_AT_ONCE, CHUNK_BYTES // per_row))
    chunks = -(-rows // most)
    return int(-(-rows // chunks))


def _in_z_dtype(tap: Tapped) -> Any:
    """A tap's input cast to its ``z``'s dtype where it is floating (mixed
    precision: a float16 input, a float32 ``z``), so contractions accumulate
    as the loop's gradient does. Integer ids stay integers: an embedding's
    rule reads its per-example norms sparsely from them
    (:meth:`jacobkit.layers.embedding.EmbeddingRule.forms_rows`)."""
    if tap.inputs.dtype.is_floating:
        return tf.cast(tap.inputs, tap.z.dtype)
    return tap.inputs
