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
from typing import Any, final

import tensorflow as tf

from jacobkit.keras.graph import TapError
from jacobkit.layers import LayerRule
from jacobkit.problem import Problem
from jacobkit.strategies import _precision as precision
from jacobkit.strategies.base import ZERO, Strategy, map_chunks

_SUPPORTED = (
    "Dense, Conv1D, Conv2D, DepthwiseConv2D, EinsumDense (MultiHeadAttention's "
    "projections), Embedding, LayerNormalization and inference-mode "
    "BatchNormalization (Keras 3 or tf_keras)"
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

    Needs a Dense/Conv1D/Conv2D layer that runs once per forward pass in a
    functional or Sequential model: the layer is tapped by running the
    model's graph beside it (:mod:`jacobkit.keras.graph`), never by changing it.
    """

    name = "batch"
    supports_norm = True

    #: measured first call minus steady call, relative to ``while``'s: 3.5x
    #: on the MLP (1.29 s vs 0.37 s), 6x on the wide generator (2-core CPU)
    trace_weight = 4.0

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
        if not problem.roles.cover(len(problem.targets)):
            raise ValueError(
                "jacobian(strategy='batch'): every target must be the layer's own "
                "kernel or bias."
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
        _check_closed_form(problem)
        leak = _cross_example_leak(problem)
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
        targets = problem.targets
        summed = problem.rows_spec.summed_over_batch

        contract = _norms if problem.reduce == "norm" else _contract
        # pfor has no rule for a depthwise convolution's gradient: there, its
        # ops alone run in a while loop inside the vectorized pass (as
        # tape.jacobian does), the rest stays vectorized
        fallback = problem.depthwise_layers(after_only=True) is not None

        def compute(inputs: Any) -> Any:
            layer_inputs, z, per_example, tape = _tapped_forward(problem, inputs)
            batch, rows = per_example.shape

            def cotangents(start: Any, count: Any) -> Any:
                # (count, B, *z.shape[1:]): d P[b, k] / d z[b] for the chunk's
                # rows k, from the batch-summed rows (examples do not mix)
                return tf.vectorized_map(
                    lambda ct: tape.gradient(
                        per_example, z, output_gradients=ct, unconnected_gradients=ZERO
                    ),
                    _row_cotangents(start, count, batch, rows, per_example.dtype),
                    fallback_to_while_loop=fallback,
                )

            size = rows_per_chunk(rows, z)
            if summed and problem.reduce != "norm":
                # each chunk's cotangents are contracted at once and written
                # into the result: the peak is the result plus one chunk
                x = tf.cast(layer_inputs, z.dtype)
                return map_chunks(
                    lambda start, count: _summed_rows(
                        problem, x, cotangents(start, count), targets
                    ),
                    rows,
                    size,
                    [t.dtype for t in targets],
                )
            (dz,) = map_chunks(
                lambda start, count: [cotangents(start, count)], rows, size, [z.dtype]
            )
            # (B, K, *z.shape[1:]), then one contraction writes the result once
            dz = tf.experimental.numpy.moveaxis(dz, 0, 1)
            return contract(problem, layer_inputs, dz, targets, summed=summed)

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


def rows_per_chunk(rows: int, z: tf.Tensor) -> int:
    """Rows per vectorized backward pass: :data:`ROWS_AT_ONCE`, or more while
    their cotangents at ``z`` (``count × z.shape``) fit :data:`CHUNK_BYTES`,
    split into chunks of equal size (no small last chunk)."""
    per_row = max(z.shape.num_elements() * z.dtype.size, 1)
    most = min(rows, max(ROWS_AT_ONCE, CHUNK_BYTES // per_row))
    chunks = -(-rows // most)
    return int(-(-rows // chunks))


def _row_cotangents(start: Any, count: Any, batch: Any, rows: Any, dtype: Any) -> Any:
    """``(count, B, K)`` cotangents selecting rows ``start..start+count-1`` of
    every example: the gradient of ``sum_b P[b, k]`` at ``z[b]`` is
    ``d P[b, k] / d z[b]`` when examples do not mix."""
    one_hot = tf.one_hot(tf.range(start, start + count), rows, dtype=dtype)
    return tf.broadcast_to(one_hot[:, None, :], (count, batch, rows))


def _tapped_forward(problem: Problem, inputs: Any, *, check: bool = False) -> Any:
    """Forward pass recording the target layer's input and output ``z``.

    The model's graph is run with the layer's node computed beside the layer
    (``activation(linear(x))``, :attr:`Problem.layer_tap`); the user's layer is
    never changed. With ``check``, the node's output as the layer itself
    computes it is recorded too.
    """
    taps: list[tuple[Any, Any, Any]] = []
    rule = _rule(problem)

    def on_layer(call: Any, args: Any, kwargs: Any) -> Any:
        layer_inputs = args[0]
        z = _pre_activation(problem, rule, layer_inputs)
        tape.watch(z)
        activated = rule.activation(z)
        taps.append((layer_inputs, z, call(*args, **kwargs) if check else None))
        return activated

    tape = tf.GradientTape(persistent=True, watch_accessed_variables=False)
    with tape:
        per_example = problem.per_example_rows(inputs, hook=on_layer)
    layer_inputs, z, own = taps[0]
    if check:
        return layer_inputs, z, per_example, tape, own
    return layer_inputs, z, per_example, tape


def _rule(problem: Problem) -> LayerRule:
    """The target layer's rule (``batch`` runs only where it has one)."""
    rule = problem.layer_rule
    assert rule is not None, "checked before batch runs"
    return rule


def _pre_activation(
    problem: Problem, rule: LayerRule, layer_inputs: tf.Tensor
) -> tf.Tensor:
    """The target layer's pre-activation output for ``layer_inputs``,
    computed beside the layer with its own variables (the targets).

    Outside ``layer.__call__`` Keras does not autocast: under mixed
    precision the kernel is float32 and ``layer_inputs`` float16. ``z`` is
    computed in the kernel's dtype, so the contraction with the cotangents
    accumulates in float32, as the loop's gradient does."""
    roles, targets = problem.roles, problem.targets
    assert roles.kernel is not None, "a layer rule's target has a kernel"
    kernel = targets[roles.kernel]
    bias = targets[roles.bias] if roles.bias is not None else None
    return rule.pre_activation(tf.cast(layer_inputs, kernel.dtype), kernel, bias)


def _in_target_order(
    problem: Problem, kernel: tf.Tensor, bias: tf.Tensor
) -> list[tf.Tensor]:
    """``kernel`` and ``bias`` results in the order of the targets, each in
    its target's dtype."""
    by_role = {"kernel": kernel, "bias": bias}
    roles = problem.roles.by_name()
    order = sorted(roles, key=lambda role: roles[role])
    return [tf.cast(by_role[r], problem.targets[roles[r]].dtype) for r in order]


def _contract(
    problem: Any, layer_inputs: Any, dz: Any, targets: Any, *, summed: Any
) -> Any:
    """The kernel/bias Jacobians from ``dz`` in closed form (see the NOTE in
    :func:`jacobkit.layers.contract.kernel_and_bias_gradients`): one einsum,
    no per-row ``vectorized_map`` and no while-loop fallback."""
    # under mixed precision the layer input is float16 and ``dz`` float32
    # (``z`` is computed in the kernel's dtype): contract in float32, as the
    # loop's gradient accumulates
    kernel, bias = problem.layer_rule.gradients(
        tf.cast(layer_inputs, dz.dtype),
        dz,
        tuple(targets[problem.roles.kernel].shape),
        summed=summed,
    )
    if problem.roles.bias is not None:
        # a rule gives (R, units) bias rows; EinsumDense's bias is (heads, dim)
        bias = tf.reshape(bias, (-1, *targets[problem.roles.bias].shape))
    return _in_target_order(problem, kernel, bias)


def _summed_rows(problem: Any, x: Any, dz: Any, targets: Any) -> Any:
    """One chunk of rows summed over the batch from its row-major cotangents
    ``dz`` (``(count, B, *z.shape[1:])``), in the order of the targets."""
    kernel, bias = problem.layer_rule.summed_gradients(
        x, dz, tuple(targets[problem.roles.kernel].shape)
    )
    if problem.roles.bias is not None:
        bias = tf.reshape(bias, (-1, *targets[problem.roles.bias].shape))
    return _in_target_order(problem, kernel, bias)


def _norms(
    problem: Any, layer_inputs: Any, dz: Any, targets: Any, *, summed: Any
) -> Any:
    """Per-row norms of the kernel/bias Jacobians (Gram form or chunks of
    rows, :func:`jacobkit.layers.norms.kernel_and_bias_norms`)."""
    kernel, bias = problem.layer_rule.norms(
        layer_inputs, dz, summed=summed, map_chunks=map_chunks
    )
    return _in_target_order(problem, kernel, bias)


def _check_closed_form(problem: Problem) -> None:
    """Refuse a layer whose output is not ``activation(linear(x))``."""
    _, z, _, _, own = _tapped_forward(problem, problem.inputs, check=True)
    activated = _rule(problem).activation(z)
    # float32 rounding of the same operations differs by < 1e-6 relative; a
    # float16/bfloat16 layer (mixed precision) rounds its own output to a few
    # of its epsilons, against ``z`` computed in float32
    allowed = 1e-4 if own.dtype.size >= 4 else 16 * _EPSILON[own.dtype]
    own = tf.cast(own, activated.dtype)
    scale = float(tf.reduce_max(tf.abs(own))) + 1e-30
    if float(tf.reduce_max(tf.abs(activated - own))) > allowed * scale:
        raise ValueError(
            f"jacobian(strategy='batch'): layer {problem.layer.name!r} "
            f"({type(problem.layer).__name__}) computes more than "
            "activation(x @ kernel + bias) (or a convolution): its output "
            "differs from that closed form. Use strategy='chunked' or 'jacobian'."
        )


def _cross_example_leak(problem: Problem) -> float:
    """How much example 0's rows depend on other examples at the layer's output
    (0 when examples are independent; exactly 0 up to rounding)."""
    if not problem.batch_size or problem.batch_size < 2:
        return 0.0
    _, z, per_example, tape = _tapped_forward(problem, problem.inputs)
    weights = tf.random.stateless_normal(
        per_example.shape[1:], seed=(0, 1), dtype=per_example.dtype
    )
    # Select example 0 with the cotangent, not by slicing: the tape has
    # stopped recording, so a slice of ``per_example`` taken here would have
    # no gradient and the check would always pass.
    only_first = tf.one_hot(0, problem.batch_size, dtype=per_example.dtype)
    first = tape.gradient(
        per_example,
        z,
        output_gradients=only_first[:, None] * weights[None, :],
        unconnected_gradients=ZERO,
    )
    total = float(tf.reduce_max(tf.abs(first))) + 1e-30
    return float(tf.reduce_max(tf.abs(first[1:]))) / total
