"""``structured``: exact shortcuts the model's structure allows.

Where the model ends in a linear ``Dense`` head on D < F channels, the D rows
of the head's input are computed with ``inner`` and combined with the head's
kernel; where the target's output channels reach the output features one to
one through elementwise layers, one backward pass gives every row (row
colouring). Why both are exact, and when they are recognised:
:mod:`jacobkit.problem.structure`. Elsewhere :meth:`Structured.check` refuses.

The first call for a model checks its result with :func:`jacobkit.verify`;
if the check fails, it warns and runs ``inner`` on the whole problem from
then on. The check's backward passes take their convolution gradients by
the rules the rows' loop takes (:func:`jacobkit.strategies.gradients.
patches_in_pass`: exact rewritings, tested against TensorFlow's own
kernels), so the check does not hold TensorFlow's kernel scratch either.

NOTE (measured, oneDNN off, AMD EPYC, 2 cores loaded). The Conv1D
generator (B=32, T=128, 8 -> 32 channels, 144 features, ``conv1``): the
first call's check peaked at 41 MiB through TensorFlow's kernels, 32+ of it
``Conv2DBackpropFilter``'s im2col buffer; through the rules 12.0 MiB, as
with oneDNN on (12.0), against 5 MiB for a later call. The price: a fault
of the rules themselves would agree with itself here; the check is for
the shortcut's structure, and the rules have their own tests.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, final

import tensorflow as tf

from jacobkit.problem import PerModel, Problem, structure
from jacobkit.problem.reduction import Output
from jacobkit.problem.solution import Stats
from jacobkit.strategies import conv_channels, gradients, vectorize
from jacobkit.strategies.base import ZERO, Strategy, check_wrapped
from jacobkit.strategies.registry import get as get_strategy
from jacobkit.verification import VerificationError, check

_VERIFIED = PerModel("structured: the first call's check per problem and strategy")


class NoShortcut(ValueError):
    """:meth:`Structured.check`'s refusal where no exact shortcut applies.

    Attributes:
        reason: why, in words (what ``auto``'s plan shows); the message is
            ``jacobian(strategy='structured'): <reason>`` and, where
            ``advise``, the advice to use another strategy.
    """

    def __init__(self, reason: str, *, advise: bool = True) -> None:
        advice = (
            ". Use another strategy (strategy='auto' uses this one where it applies)."
            if advise
            else ""
        )
        super().__init__(f"jacobian(strategy='structured'): {reason}{advice}")
        self.reason = reason


@final
@dataclass(frozen=True)
class Structured(Strategy):
    """Exact structural shortcuts (see the module docstring).

    Attributes:
        inner: the strategy for the D rows of a linear head's input, and the
            fallback if the first call's check fails: a configured strategy
            or a registered name. Default ``"while"``: on the generator
            (B=64, T=128, D=32 of 144 features, target ``conv1``) it was the
            fastest inner strategy for ``"features"`` rows (0.11 s vs 0.24 s
            for ``chunked``), with the lowest peak and the shortest trace.
        probes: random cotangents of the first call's check (0: no check).
        tolerance: that check's tolerance (``None``: by dtype, see
            :data:`jacobkit.verification.TOLERANCE`).
    """

    name = "structured"
    inner: Strategy | str = "while"
    probes: int = 2
    tolerance: float | None = None

    def __post_init__(self) -> None:
        check_wrapped(
            Structured,
            "inner",
            self.inner,
            "the inner strategy computes the rows the structure leaves; use "
            "'chunked', 'while', 'batch', ... (auto picks structured itself "
            "where it applies).",
        )
        if isinstance(self.probes, bool) or not isinstance(self.probes, int):
            raise TypeError(
                f"strategies.Structured(probes={self.probes!r}): expected an int "
                ">= 0 (0 skips the first call's check)."
            )
        if self.probes < 0:
            raise ValueError(
                f"strategies.Structured(probes={self.probes}): expected >= 0 "
                "(0 skips the first call's check)."
            )

    @property
    def label(self) -> str:
        inner = self.inner if isinstance(self.inner, str) else self.inner.label
        return f"{self.name}({inner})"

    def resolved_inner(self) -> Strategy:
        """``inner`` as a configured strategy (a name is looked up in the
        registry: strategies do not import each other)."""
        if isinstance(self.inner, Strategy):
            return self.inner
        return get_strategy(self.inner)

    def smaller(self) -> Structured | None:
        """The same shortcut with a smaller inner strategy, if it has one."""
        smaller = self.resolved_inner().smaller()
        if smaller is None:
            return None
        return Structured(smaller, self.probes, self.tolerance)

    def rows_at_once(self, num_rows: int) -> int:
        """At most the inner strategy's (it runs on fewer rows, or not at
        all)."""
        return self.resolved_inner().rows_at_once(num_rows)

    def sequential_rows(self) -> bool:
        """The inner strategy's."""
        return self.resolved_inner().sequential_rows()

    def vectorized_rows(self) -> bool:
        """The inner strategy's."""
        return self.resolved_inner().vectorized_rows()

    def passes_in_flight(self, num_rows: int) -> int:
        """The inner strategy's."""
        return self.resolved_inner().passes_in_flight(num_rows)

    def rows_formed(self, num_rows: int) -> int:
        """The inner strategy's."""
        return self.resolved_inner().rows_formed(num_rows)

    @property
    def convolution_gradients(self) -> str:  # type: ignore[override]
        """The inner strategy's, which runs the rows' backward passes where a
        linear head's rows are computed (:meth:`runs_inner`); elsewhere one
        backward pass of the shortcut's own runs them the tape's way."""
        return self.resolved_inner().convolution_gradients

    @staticmethod
    def runs_inner(problem: Problem) -> bool:
        """Whether the shortcut computes ``problem``'s rows by its inner
        strategy (a linear head whose input's rows are not separable), not
        by a backward pass of its own (separable channels), nor at all (no
        shortcut applies)."""
        if not isinstance(problem, Problem) or problem.tensor_targets is not None:
            return False
        try:
            found = structure.find(problem)
        except structure.NotApplicable:
            return False
        if not isinstance(found, structure.LinearHead):
            return False
        return _separable_or_none(found.sub_problem.with_inputs(problem.inputs)) is None

    def describe(self, problem: Problem) -> str:
        """The shortcut used for ``problem``, in words (for plans)."""
        found = structure.find(problem)
        text = found.describe()
        if isinstance(found, structure.LinearHead):
            sub = found.sub_problem.with_inputs(problem.inputs)
            if _separable_or_none(sub) is None:
                channels = self._conv_channels_or_none(sub)
                if channels is not None:
                    text = f"{text}; {channels.describe()}"
        return text

    def _conv_channels_or_none(self, sub: Problem) -> structure.ConvChannels | None:
        """The one-channel rows of a linear head's sub-problem, where the
        inner strategy runs rows in a way they reproduce."""
        if not conv_channels.supports(self.resolved_inner()):
            return None
        try:
            return structure.find_conv_channels(sub)
        except structure.NotApplicable:
            return None

    def check(self, problem: Problem) -> None:
        """Refuse (:class:`NoShortcut`, with the reason in words) where no
        exact shortcut applies; a linear head's inner strategy may refuse the
        head's input rows with its own error."""
        if not isinstance(problem, Problem):
            raise NoShortcut(
                "computes every row of a whole problem at once, not a view of "
                f"some rows ({type(problem).__name__}).",
                advise=False,
            )
        if problem.tensor_targets is not None:
            raise NoShortcut(
                "no exact shortcut applies to this problem (the shortcuts are "
                "for a layer's variables, not Inputs()/Output() targets)"
            )
        try:
            found = structure.find(problem)
        except structure.NotApplicable as err:
            raise NoShortcut(
                f"no exact shortcut applies to this problem ({err})"
            ) from None
        if isinstance(found, structure.LinearHead):
            sub = found.sub_problem.with_inputs(problem.inputs)
            if _separable_or_none(sub) is None:
                self.resolved_inner().check(sub)

    def build(self, problem: Problem) -> Callable[[Any], Any]:
        found = structure.find(problem)
        if isinstance(found, structure.SeparableChannels):
            separable_fn: Callable[[Any], Any] = _separable_fn(problem, found)
            return separable_fn
        sub = found.sub_problem.with_inputs(problem.inputs)
        separable = _separable_or_none(sub)
        channels = self._conv_channels_or_none(sub)
        if separable is not None:
            inner_fn = _separable_fn(sub, separable)
        elif channels is not None:
            inner_fn = conv_channels.rows_fn(sub, channels, self.resolved_inner())
        else:
            inner_fn = self.resolved_inner().build(sub)
        prefix = problem.rows_shape[:-1]

        def compute(inputs: Any) -> Any:
            kernel = found.kernel()  # (D, K)
            combined = []
            for jac, target in zip(inner_fn(inputs), problem.targets):
                # (prefix * D, *v.shape) -> (prefix, D, P)
                jac = tf.reshape(jac, (*prefix, found.width, -1))
                kernel_ = tf.cast(kernel, jac.dtype)
                # (D, K)ᵀ @ (prefix, D, P): one broadcasting matmul, 2-2.5x
                # faster than the same einsum, which transposes its output
                # (B=16, D=32, P=1312, K=144: 2.9 vs 6.4 ms, 2-core CPU)
                rows = tf.matmul(kernel_, jac, transpose_a=True)
                combined.append(tf.reshape(rows, (problem.num_rows, *target.shape)))
            return combined

        return compute

    def run(self, problem: Problem) -> tuple[Output, Stats]:
        """Run; on the first call for a model and problem, check the rows
        with :func:`jacobkit.verify` and fall back to ``inner`` if they fail
        (a reduction of the rows is checked on its own problem's first call
        of the rows; it is computed from them)."""
        if not self.computes(problem):
            return super().run(problem)
        verified = _VERIFIED.of(problem.model)
        key = (problem.key, self.key)
        if verified.get(key) is False:  # failed its check: inner from now on
            return self.resolved_inner().run(problem)
        output, stats = super().run(problem)
        jacobians = list(output.values)
        if key in verified or self.probes == 0 or not _all_finite(jacobians):
            # NaN/Inf rows (NaN inputs: the caller warned) pass through as a
            # plain tape gives them; a check on them would compare NaN with
            # NaN and fail, so it waits for a finite call
            return output, stats
        try:
            # through the rules the rows ran by, a kernel's gradient from its
            # input's patches: not TensorFlow's kernel's scratch, which with
            # oneDNN off more than tripled the check's peak (module NOTE)
            with gradients.patches_in_pass():
                check(problem, jacobians, probes=self.probes, tolerance=self.tolerance)
        except VerificationError as err:
            # not the exception: its traceback would keep the callers' frames
            # (and the Jacobians in their locals) alive
            verified[key] = False
            warnings.warn(
                f"jacobkit: strategy {self.label} ({self.describe(problem)}) "
                f"failed its check on this model ({err}); running "
                f"{self.resolved_inner().label} instead from now on.",
                RuntimeWarning,
                stacklevel=2,
            )
            return self.resolved_inner().run(problem)
        verified[key] = True
        return output, stats


def _all_finite(jacobians: list[tf.Tensor]) -> bool:
    """Whether every entry of every Jacobian is finite."""
    return all(bool(tf.reduce_all(tf.math.is_finite(j))) for j in jacobians)


def _separable_or_none(problem: Problem) -> structure.SeparableChannels | None:
    try:
        return structure.find_separable(problem)
    except structure.NotApplicable:
        return None


def _separable_fn(
    problem: Problem, found: structure.SeparableChannels
) -> Callable[[Any], Any]:
    """Row colouring: one backward pass (per example for per-example rows),
    demultiplexed by output channel (see the NOTE in
    :mod:`jacobkit.problem.structure`)."""
    targets = problem.targets
    mode = problem.rows_spec.mode
    channels = list(found.channels)
    width = int(problem.output_width or 0)

    def demultiplex(grad: tf.Tensor, target: tf.Variable) -> tf.Tensor:
        # grad: (E, *v.shape), E examples (1 for "features"); the row of
        # channel k owns column k of the last axis.
        mask = tf.one_hot(channels, width, dtype=grad.dtype)  # (K, F)
        mask = tf.reshape(
            mask, (len(channels),) + (1,) * (target.shape.rank - 1) + (width,)
        )
        rows = grad[:, None] * mask[None]  # (E, K, *v.shape)
        return tf.reshape(rows, (problem.num_rows, *target.shape))

    def compute(inputs: Any) -> Any:
        if mode == "features":
            with tf.GradientTape(watch_accessed_variables=False) as tape:
                tape.watch(targets)
                total = tf.reduce_sum(problem.call_model(inputs))
            grads = tape.gradient(total, targets, unconnected_gradients=ZERO)
            grads = [g[None] for g in grads]
        else:
            layer_input = found.layer_input(inputs)

            def one_example(x: Any) -> Any:
                with tf.GradientTape(watch_accessed_variables=False) as tape:
                    tape.watch(targets)
                    total = tf.reduce_sum(found.tail(x[None]))
                return tape.gradient(total, targets, unconnected_gradients=ZERO)

            grads = vectorize.vectorized_map(
                one_example, layer_input, fallback_to_while_loop=True
            )
        return [demultiplex(g, t) for g, t in zip(grads, targets)]

    return compute
