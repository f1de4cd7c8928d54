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

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar, cast, final

import tensorflow as tf

from jacobkit.keras.graph import TapError
from jacobkit.layers import LayerRule
from jacobkit.layers.base import Tapped
from jacobkit.problem import Problem
from jacobkit.problem.targets import Projection
from jacobkit.strategies import _seeds as seeding
from jacobkit.strategies import precision
from jacobkit.strategies.base import ZERO, Strategy, map_chunks

_SUPPORTED = (
    "Dense, Conv1D, Conv2D, DepthwiseConv2D, SeparableConv2D, EinsumDense, "
    "MultiHeadAttention (its four projections), Embedding, LayerNormalization "
    "and inference-mode BatchNormalization (Keras 3 or tf_keras)"
)
#: machine epsilon of the half-precision compute dtypes of mixed precision
_EPSILON = {tf.float16: 2.0**-10, tf.bfloat16: 2.0**-7}


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
    EinsumDense, MultiHeadAttention, ...) that runs once per forward pass in
    a functional or Sequential model: the layer is tapped by running the
    model's graph beside it (:mod:`jacobkit.keras.graph`), never by changing
    it. A layer of several linear parts (an attention layer's projections, a
    separable convolution's halves) has each part's input and output
    tapped, and each part's kernel and bias contracted by its own rule.
    """

    name = "batch"
    supports_norm = True

    #: measured first call minus steady call, relative to ``while``'s: 3.5x
    #: on the MLP (1.29 s vs 0.37 s), 6x on the wide generator (2-core CPU)
    trace_weight = 4.0
    result_copies = 1

    @classmethod
    def for_auto(cls, num_rows: int) -> Batch:
        return Batch()

    def rows_at_once(self, num_rows: int) -> int:
        """:data:`ROWS_AT_ONCE` backward passes (each over the batch) at once
        (more on a small layer, up to :data:`CHUNK_BYTES` of cotangents: too
        little to matter in ``auto``'s memory prior)."""
        return min(num_rows, ROWS_AT_ONCE)

    def check(self, problem: Problem) -> None:
        if problem.tensor_targets is not None:
            raise ValueError(
                "jacobian(strategy='batch'): differentiates a Dense or Conv "
                f"layer's kernel and bias, got the tensor target(s) "
                f"{', '.join(problem.target_names)}. Use strategy='chunked' or "
                "'jacobian' (per-example rows of Inputs()/Output() targets cost "
                "K rows there, not B x K)."
            )
        rule = problem.layer_rule
        if rule is None:
            what = (
                "a list of variables"
                if problem.layer is None
                else f"layer {problem.layer.name!r} ({type(problem.layer).__name__})"
            )
            raise ValueError(
                f"jacobian(strategy='batch'): supports {_SUPPORTED} layers, got "
                f"{what}. Use strategy='chunked' or 'jacobian' for this target."
            )
        if not problem.rows_spec.decomposes_per_example:
            raise ValueError(
                "jacobian(strategy='batch'): needs rows that each belong to one "
                "example or sum over examples (outputs='features', "
                "'per_example' or 'full'); a callable outputs= may mix "
                "examples. Use strategy='chunked'."
            )
        if problem.projections is None:
            raise ValueError(
                "jacobian(strategy='batch'): the targets must be exactly the "
                "layer's own kernel and bias (an attention layer's: those of its "
                "four projections)."
            )
        precision.refuse_float16_variables(problem, self.name)
        name = problem.layer.name
        why = rule.unsupported()
        if why is not None:
            raise ValueError(
                f"jacobian(strategy='batch'): layer {name!r} is not supported: "
                f"{why}. Use strategy='chunked' or 'jacobian'."
            )
        try:
            problem.layer_tap  # noqa: B018 - built here to raise early
        except TapError as err:
            raise ValueError(
                f"jacobian(strategy='batch'): {err}; the batch strategy needs "
                "the layer's input and output once per forward pass. Use "
                "strategy='chunked' or 'jacobian'."
            ) from err
        forward = _check_forward(problem)
        _check_closed_form(problem, forward)
        leak = _cross_example_leak(problem, forward)
        if leak > 1e-6:
            raise ValueError(
                "jacobian(strategy='batch'): the model mixes examples across the "
                f"batch: example 0's outputs depend on other examples' values at "
                f"layer {problem.layer.name!r} (relative size {leak:.1e}), as "
                "BatchNormalization with training=True does. The batch strategy "
                "assumes independent examples; use strategy='chunked' or "
                "'jacobian'."
            )

    def build(self, problem: Problem) -> Callable[[Any], Any]:
        summed = problem.rows_spec.summed_over_batch
        # pfor has no rule for a depthwise convolution's gradient: there, its
        # ops alone run in a while loop inside the vectorized pass (as
        # tape.jacobian does), the rest stays vectorized
        fallback = problem.depthwise_layers(after_only=True) is not None
        head = seeding.seed_head(problem)

        def compute(inputs: Any) -> Any:
            seeds: seeding.OneHotRows | seeding.HeadRows
            if head is None:
                forward = _tapped_forward(problem, inputs)
                seeds = seeding.OneHotRows(int(forward.rows.shape[1]))
            else:
                # the rows of the head's input, seeded with the head's kernel
                forward = _tapped_forward(head.sub_problem, inputs)
                seeds = seeding.HeadRows(tf.transpose(head.kernel()))
            zs = [tap.z for tap in forward.taps]
            batch, rows = int(forward.rows.shape[0]), seeds.count

            def cotangents(start: Any, count: Any) -> Any:
                # each (count, B, *z.shape[1:]): d P[b, k] / d z[b] for the
                # chunk's rows k, from the batch-summed rows (examples do not
                # mix)
                return tf.vectorized_map(
                    lambda ct: forward.tape.gradient(
                        forward.rows,
                        zs,
                        output_gradients=ct,
                        unconnected_gradients=ZERO,
                    ),
                    seeds.of(start, count, batch, forward.rows.dtype),
                    fallback_to_while_loop=fallback,
                )

            size = rows_per_chunk(rows, zs)
            xs = [tf.cast(tap.inputs, tap.z.dtype) for tap in forward.taps]
            if summed and problem.reduce != "norm":
                # each chunk's cotangents are contracted at once and written
                # into the result: the peak is the result plus one chunk
                return map_chunks(
                    lambda start, count: _summed_rows(
                        problem, xs, cotangents(start, count)
                    ),
                    rows,
                    size,
                )
            dzs = map_chunks(cotangents, rows, size)
            # (B, K, *z.shape[1:]), then one contraction writes the result once
            dzs = [tf.experimental.numpy.moveaxis(dz, 0, 1) for dz in dzs]
            if problem.reduce == "norm":
                return _norms(problem, xs, dzs, summed=summed)
            return _contract(problem, xs, dzs, summed=summed)

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


@dataclass(frozen=True)
class _Forward:
    """A forward pass with the target layer computed beside it.

    Attributes:
        taps: each linear part's input and pre-activation output ``z``
            (:meth:`jacobkit.layers.LayerRule.tapped_call`), watched by
            ``tape``.
        rows: the per-example rows ``P``, ``(B, K)``.
        tape: the persistent tape that recorded the pass.
        output: the layer's output as computed beside it.
        own: the layer's output as the layer itself computes it (``None``
            unless asked for).
    """

    taps: list[Tapped]
    rows: tf.Tensor
    tape: tf.GradientTape
    output: Any
    own: Any


def _tapped_forward(problem: Problem, inputs: Any, *, check: bool = False) -> _Forward:
    """Forward pass recording the target layer's parts' inputs and outputs.

    The model's graph is run with the layer's node computed beside the layer
    (:meth:`jacobkit.layers.LayerRule.tapped_call`, :attr:`Problem.layer_tap`);
    the user's layer is never changed. With ``check``, the node's output as
    the layer itself computes it is recorded too.
    """
    found: list[tuple[list[Tapped], Any, Any]] = []
    rule = _rule(problem)
    targets = problem.targets
    weights = [
        (targets[p.kernel], None if p.bias is None else targets[p.bias])
        for p in _projections(problem)
    ]

    def watch(z: tf.Tensor) -> tf.Tensor:
        tape.watch(z)
        return z

    def on_layer(call: Any, args: Any, kwargs: Any) -> Any:
        output, taps = rule.tapped_call(args, kwargs, weights, watch)
        found.append((taps, output, call(*args, **kwargs) if check else None))
        return output

    tape = tf.GradientTape(persistent=True, watch_accessed_variables=False)
    with tape:
        per_example = problem.per_example_rows(inputs, hook=on_layer)
    taps, output, own = found[0]
    return _Forward(taps, per_example, tape, output, own)


#: examples the checks before the first run look at: two show whether
#: examples mix, and an eager Keras call holds every layer's output (a
#: frozen MobileNetV2 at 96 px: 260 MiB for 16 images, against batch's 29
#: MiB steady peak)
CHECK_EXAMPLES = 2


def _check_forward(problem: Problem) -> _Forward:
    """One eager forward pass that serves both checks (each took 0.13 s of a
    2 s first call on the MLP 512-1024-1024-144), on the first
    :data:`CHECK_EXAMPLES` examples where the model runs on fewer than its
    batch (else on all of them)."""
    batch = problem.batch_size
    if batch is not None and batch > CHECK_EXAMPLES:
        first = tf.nest.map_structure(lambda t: t[:CHECK_EXAMPLES], problem.inputs)
        try:
            return _tapped_forward(problem, first, check=True)
        except (ValueError, TypeError, tf.errors.OpError):
            pass  # a model bound to its batch size: checked on all of it
    return _tapped_forward(problem, problem.inputs, check=True)


def _rule(problem: Problem) -> LayerRule:
    """The target layer's rule (``batch`` runs only where it has one)."""
    rule = problem.layer_rule
    assert rule is not None, "checked before batch runs"
    return rule


def _projections(problem: Problem) -> tuple[Projection, ...]:
    """The target layer's linear parts (checked before batch runs)."""
    found = problem.projections
    assert found is not None, "checked before batch runs"
    return found


_F = TypeVar("_F", bound=Callable[..., Any])


def _no_autograph(fn: _F) -> _F:
    """``fn`` left as written by AutoGraph (kept for tf_keras models): the
    helpers below have no data-dependent control flow, and AutoGraph
    miscalled a helper from inside a comprehension over ``zip``."""
    return cast(_F, tf.autograph.experimental.do_not_convert(fn))


@_no_autograph
def _placed(problem: Problem, parts: list[tuple[Any, Any]]) -> list[tf.Tensor]:
    """Each part's ``(kernel, bias)`` results (or norms) at its targets'
    positions, each in its target's dtype (bias rows reshaped to the
    variable's shape: a rule gives ``(R, units)``, ``EinsumDense``'s bias is
    ``(heads, dim)``)."""
    targets = problem.targets
    out: list[Any] = [None] * len(targets)
    for projection, (kernel, bias) in zip(_projections(problem), parts):
        out[projection.kernel] = tf.cast(kernel, targets[projection.kernel].dtype)
        if projection.bias is not None:
            target = targets[projection.bias]
            if problem.reduce != "norm":
                bias = tf.reshape(bias, (-1, *target.shape))
            out[projection.bias] = tf.cast(bias, target.dtype)
    return out


@_no_autograph
def _each_part(
    problem: Problem,
    xs: list[Any],
    dzs: list[Any],
    contract: Callable[[Projection, Any, Any, tuple[int, ...]], tuple[Any, Any]],
) -> list[tf.Tensor]:
    """``contract(part, x, dz, kernel_shape)`` of each part, placed in the
    order of the targets (:func:`_placed`)."""
    targets = problem.targets
    return _placed(
        problem,
        [
            contract(p, x, dz, tuple(targets[p.kernel].shape))
            for p, x, dz in zip(_projections(problem), xs, dzs)
        ],
    )


def _summed_rows(problem: Problem, xs: list[Any], dzs: list[Any]) -> list[tf.Tensor]:
    """One chunk of rows summed over the batch from its row-major cotangents
    (each ``(count, B, *z.shape[1:])``), in the order of the targets."""
    return _each_part(
        problem, xs, dzs, lambda p, x, dz, shape: p.rule.summed_gradients(x, dz, shape)
    )


def _contract(
    problem: Problem, xs: list[Any], dzs: list[Any], *, summed: bool
) -> list[tf.Tensor]:
    """The kernel/bias Jacobians from the ``dzs`` in closed form (see the NOTE
    in :func:`jacobkit.layers.contract.kernel_and_bias_gradients`): one einsum
    per part, no per-row ``vectorized_map`` and no while-loop fallback."""
    # under mixed precision the layer input is float16 and ``dz`` float32
    # (``z`` is computed in the kernel's dtype): contract in float32, as the
    # loop's gradient accumulates (``xs`` are cast to ``z``'s dtype)
    return _each_part(
        problem,
        xs,
        dzs,
        lambda p, x, dz, shape: p.rule.gradients(x, dz, shape, summed=summed),
    )


def _norms(
    problem: Problem, xs: list[Any], dzs: list[Any], *, summed: bool
) -> list[tf.Tensor]:
    """Per-row norms of the kernel/bias Jacobians (Gram form or chunks of
    rows, :func:`jacobkit.layers.norms.kernel_and_bias_norms`)."""
    return _each_part(
        problem,
        xs,
        dzs,
        lambda p, x, dz, _: p.rule.norms(x, dz, summed=summed, map_chunks=map_chunks),
    )


def _check_closed_form(problem: Problem, forward: _Forward) -> None:
    """Refuse a layer whose output is not what its rule computes beside it
    (``activation(linear(x))``, or an attention layer's projections and
    attention), from a ``forward`` pass with ``check``."""
    own, output = forward.own, forward.output
    # float32 rounding of the same operations differs by < 1e-6 relative; a
    # float16/bfloat16 layer (mixed precision) rounds its own output to a few
    # of its epsilons, against ``z`` computed in float32
    allowed = 1e-4 if own.dtype.size >= 4 else 16 * _EPSILON[own.dtype]
    own = tf.cast(own, output.dtype)
    scale = float(tf.reduce_max(tf.abs(own))) + 1e-30
    if float(tf.reduce_max(tf.abs(output - own))) > allowed * scale:
        raise ValueError(
            f"jacobian(strategy='batch'): layer {problem.layer.name!r} "
            f"({type(problem.layer).__name__}) computes more than "
            "activation(x @ kernel + bias) (or a convolution, or attention over "
            "its projections): its output differs from that closed form. Use "
            "strategy='chunked' or 'jacobian'."
        )


def _cross_example_leak(problem: Problem, forward: _Forward) -> float:
    """How much example 0's rows depend on other examples at the layer's parts'
    outputs (0 when examples are independent; exactly 0 up to rounding), from
    a ``forward`` pass on the problem's inputs."""
    per_example = forward.rows
    batch = int(per_example.shape[0])
    if batch < 2:
        return 0.0
    weights = tf.random.stateless_normal(
        per_example.shape[1:], seed=(0, 1), dtype=per_example.dtype
    )
    # Select example 0 with the cotangent, not by slicing: the tape has
    # stopped recording, so a slice of ``per_example`` taken here would have
    # no gradient and the check would always pass.
    only_first = tf.one_hot(0, batch, dtype=per_example.dtype)
    firsts = forward.tape.gradient(
        per_example,
        [tap.z for tap in forward.taps],
        output_gradients=only_first[:, None] * weights[None, :],
        unconnected_gradients=ZERO,
    )
    total = max(float(tf.reduce_max(tf.abs(f))) for f in firsts) + 1e-30
    return max(float(tf.reduce_max(tf.abs(f[1:]))) for f in firsts) / total
