"""Kernel scratch space: what TensorFlow's gradient kernels allocate beyond
their inputs and outputs, measured once per process on a tiny probe.

NOTE (why the memory prior measures it). The forward pass's activations
bound what one row's backward pass *keeps*, not what its kernels allocate
while they run, and that depends on the kernel TensorFlow picks for this
CPU. Measured (TF 2.21, 2-core AMD EPYC, 32 MiB L3), the Conv1D generator of
``tests/test_planner.py`` (B=16, T=64, 8 -> 32 channels, 48 rows), peak of one
call above what was in use:

=================================  ================  ==================
strategy                           oneDNN on         oneDNN off
=================================  ================  ==================
``while(parallel=1)``              1.0 MiB           33.0 MiB
``while(parallel=2)``              1.5 MiB           65.4 MiB
``chunked(4)``                     3.9 MiB           33.8 MiB
``loop``                           1.8 MiB           33.8 MiB
=================================  ================  ==================

TensorFlow turns oneDNN on by default only where the CPU has
AVX512_VNNI, AVX512_BF16, AVX_VNNI or AMX; elsewhere (e.g. an AVX2-only AMD
EPYC Zen 3) convolution gradients run TensorFlow's own
``Conv2DCustomBackpropInput``/``Filter`` kernels, which allocate an im2col
buffer sized to the L3 cache, not to the problem: about 16 MiB per op here,
and a row's two ops (input and filter gradient) run at once. A ``while`` loop
runs as many rows' ops at once as it has iterations in flight, up to
TensorFlow's inter-op threads; a vectorized strategy (``chunked``, pfor) runs
one op over all its rows, so one buffer.

:func:`scratch_bytes` measures it on a tiny convolution of each kind whose
TensorFlow kernel runs in the problem's gradient for a strategy
(:func:`kinds_run`, from ``Problem.convolution_gradients``: jacobkit's
stride-1 ``Conv2D`` rule takes some ops with oneDNN off; the kinds and their
ops: :mod:`jacobkit.layers.convolutions`), in the problem's dtype, once per
process; the planner adds it per backward pass in flight
(:class:`MemoryPrior`).
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import tensorflow as tf

from jacobkit import memory, runtime, strategies
from jacobkit.layers import convolutions
from jacobkit.problem.liveness import SequentialMemory
from jacobkit.strategies.gradients import SHARED_PATCHES_BYTES

if TYPE_CHECKING:
    from jacobkit.problem import Problem

#: rows of a ``while`` loop holding their cotangents at once, per inter-op
#: thread. Measured on 2 threads (TF 2.21, CPU), the 144-feature generator
#: (B=64, T=128, Conv1D 64/128/128): ``while(2)`` 34-39 MiB, ``while(4)``
#: 35 MiB, ``while(10)`` 34 MiB, its structured shortcut's ``while(10)``
#: 46-64 MiB (first calls, checks included), over 23 MiB for ``while(1)``:
#: never more than 4 rows' worth (9.4 MiB each)
ROWS_PER_THREAD = 2
#: measured runs of a probe (the largest counts)
_RUNS = 3
#: what one backward pass's kernels' scratch space is taken to be at most
#: where it is not measured (:func:`bound`): 1 GiB. Measured (the module's
#: NOTE): at most one L3-sized im2col buffer per op, 16 MiB on a 32 MiB L3,
#: 33 MiB for a row's two ops at once; a server CPU's L3 is at most a few
#: hundred MiB
SCRATCH_BOUND = 2**30


@dataclass(frozen=True)
class MemoryPrior:
    """What ``auto`` predicts a run's peak from before it has measured one.

    Attributes:
        row_bytes: the forward pass's activations: what one row's backward
            pass keeps, per row alive at once in a vectorized pass
            (``batch``; the bound of pfor's, :meth:`vectorized_peak`).
        sequential: what a row's backward pass holds where rows run one
            after another over one kept forward pass (``loop``, ``while``),
            and per row batched by pfor (``chunked``, ``jacobian``);
            ``None``: unknown, ``row_bytes`` per row is used instead.
        scratch_bytes: the gradient kernels' work space of one backward pass
            (:func:`scratch_bytes`; 0 where none was measured).
        threads: backward passes that can run at once (TensorFlow's inter-op
            threads): a ``while`` loop's iterations beyond it wait.
        eager_bytes: what an eager forward pass holds at its peak (every
            activation: :attr:`jacobkit.problem.Problem.forward_bytes`), for
            strategies that run eagerly (``loop``).
        hoisted_bytes: the transposed copies the ``MatMul`` gradient rule
            makes once per call and holds while the rows run (oneDNN off:
            :func:`jacobkit.strategies.gradients.hoisted_bytes`; 0 where
            it replaces nothing).
        ways: ``scratch_bytes`` for the strategies whose convolution
            gradients run another way (:attr:`jacobkit.strategies.Strategy.
            convolution_gradients` -> bytes a pass: fewer of TensorFlow's
            kernels run there, :func:`runs_kernel`); a way not listed
            takes ``scratch_bytes``.
        patches_bytes: the input patches a loop over rows forms once and
            holds (``"loop"``: jacobkit's
            ``Conv2D`` rule, :func:`patches_held`).
        shortcut_runs_inner: whether the exact shortcut (``structured``)
            runs the rows' backward passes by its inner strategy, whose
            way its convolution gradients then take (:meth:`way`); else
            (one backward pass of its own) the tape's.
    """

    row_bytes: int
    sequential: SequentialMemory | None = None
    scratch_bytes: int = 0
    threads: int = 1
    eager_bytes: int = 0
    hoisted_bytes: int = 0
    ways: tuple[tuple[str, int], ...] = ()
    patches_bytes: int = 0
    shortcut_runs_inner: bool = False

    def way(self, strategy: strategies.Strategy) -> str:
        """How ``strategy``'s convolution gradients run on this problem:
        its :attr:`~jacobkit.strategies.Strategy.convolution_gradients`, but
        the tape's for a shortcut that runs no inner strategy here."""
        if isinstance(strategy, strategies.Structured) and not self.shortcut_runs_inner:
            return "tape"
        return strategy.convolution_gradients

    def scratch_in_flight(self, passes: int, way: str = "tape") -> int:
        """Scratch of ``passes`` separate backward passes started at once by
        a strategy whose convolution gradients run ``way``, and the patches
        that way holds."""
        held = self.patches_bytes if way == "loop" else 0
        return self.kernel_scratch(passes, way) + held

    def kernel_scratch(self, passes: int, way: str = "tape") -> int:
        """The kernels' own work space alone of :meth:`scratch_in_flight`
        (not the patches a loop holds)."""
        per_pass = dict(self.ways).get(way, self.scratch_bytes)
        return min(passes, self.threads) * per_pass

    def vectorized_peak(self, rows_in_flight: int) -> int | None:
        """What a pfor-vectorized pass (``chunked``, ``jacobian``) holds with
        ``rows_in_flight`` rows batched into one backward pass: the forward
        pass kept once and one row's backward pass, as a sequential row
        holds them, and each further row's own backward tensors, batched
        (``None``: not known, see :attr:`sequential`). Vectorizing a row
        batches its cotangents, not the forward pass: counting a forward
        pass's activations per row put ``chunked(32)`` of a 2-layer GPT-2's
        token attribution (96 tokens, hidden 64) at 201 MiB, measured 28.6
        MiB; this counts 33.6 (:func:`jacobkit.planner.estimates.
        predicted_peak` has the other measurements)."""
        if self.sequential is None:
            return None
        return self.sequential.peak(rows_in_flight)

    def sequential_peak(self, rows_in_flight: int) -> int | None:
        """What rows run one after another hold with ``rows_in_flight`` rows
        in flight (``None``: not known, see :attr:`sequential`). At most
        :data:`ROWS_PER_THREAD` per inter-op thread hold their cotangents at
        once: the others wait for a thread."""
        if self.sequential is None:
            return None
        holding = min(rows_in_flight, ROWS_PER_THREAD * self.threads)
        return self.sequential.peak(holding)


def bound(kinds: Iterable[str], device: str | None) -> int:
    """:data:`SCRATCH_BOUND` where :func:`scratch_bytes` would measure (a
    convolution's gradient on a device that reports its peak), else 0."""
    return SCRATCH_BOUND if device is not None and any(True for _ in kinds) else 0


#: one backward pass's kernels' scratch space where the probe is skipped
#: (:func:`prior_bytes`), per convolution kind and whether oneDNN's kernels
#: (not TensorFlow's own) run it: the most :func:`scratch_bytes` measured
#: (TF 2.21, float32, float64 and bfloat16 probes; oneDNN's never runs
#: float64), rounded up. TensorFlow's own ``Conv2D`` gradients size their
#: im2col buffer to a fixed 30 MiB "L3 cache" whatever the CPU's (31.9 MiB
#: measured on an Intel Xeon with a 480 MiB L3; 16-33 MiB on an AMD EPYC
#: with 32 MiB, the module's NOTE); oneDNN's took 9-80 KiB, the depthwise
#: and ``Conv3D`` gradients 0-45 KiB in float32 on either kind, rounded up
#: to 256 KiB. Small as they are, these priors decide tight plans: where a
#: prior is over the budget's share the probe is not run
#: (:func:`jacobkit.planner.opening.deciding_scratch`) and the prior is the need
PRIOR_BYTES = {
    # 33: the probe measured 32 MiB + 1 KiB once (a flaky test, 32 before)
    ("conv2d", False): 33 * 2**20,
    ("conv2d", True): 256 * 2**10,
    ("conv3d", False): 256 * 2**10,
    ("conv3d", True): 256 * 2**10,
    ("depthwise", False): 256 * 2**10,
    ("depthwise", True): 256 * 2**10,
}
#: float64, which only TensorFlow's own kernels run, probed after other work
#: in the process measures more than alone, cause not found (the least of
#: three runs too: not another thread's allocations). A ``Conv2D``: 31.9 MiB
#: alone, 41.5 MiB in a test worker after other tests (an AMD EPYC with
#: AVX-512, oneDNN on and off), 54.0 MiB (56,618,608 bytes) after the
#: structure, convolution-gradient, Gram and tracing tests in one process.
#: A ``Conv3D``: 0 alone, 45 KiB after its file's other tests, 138 KiB
#: (141,312 bytes) in a whole clean-clone run. Rounded up with room
FLOAT64_PRIOR_BYTES = {
    "conv2d": 64 * 2**20,
    "conv3d": 2**20,
    "depthwise": 2**20,
}


def prior_bytes(kinds: Iterable[str], dtype: tf.DType, device: str | None) -> int:
    """What :func:`scratch_bytes` is taken to be without measuring it: the
    largest :data:`PRIOR_BYTES` of ``kinds`` on this CPU's kind
    (:func:`jacobkit.runtime.cpu_kind`: oneDNN's kernels), or of
    :data:`FLOAT64_PRIOR_BYTES` (only TensorFlow's own kernels run
    float64); 0 off the CPU (no figures measured), without convolutions,
    or for a kind not listed."""
    if device is None or "CPU" not in device.upper():
        return 0
    float64 = tf.as_dtype(dtype) == tf.float64
    onednn = runtime.cpu_kind().onednn and not float64
    return max(
        (
            FLOAT64_PRIOR_BYTES.get(kind, 0)
            if float64
            else PRIOR_BYTES.get((kind, onednn), 0)
            for kind in kinds
        ),
        default=0,
    )


#: the ways a strategy's convolution gradients run
#: (:attr:`jacobkit.strategies.Strategy.convolution_gradients`)
WAYS = ("tape", "loop")


def runs_kernel(gradient: convolutions.Gradient, way: str, replaced: bool) -> bool:
    """Whether TensorFlow's own kernel (and its scratch space) runs
    ``gradient`` for a strategy whose convolution gradients run ``way``,
    where jacobkit's ``Conv2D`` rule is in place (``replaced``: oneDNN off,
    :func:`jacobkit.strategies.gradients.replaces`) or not. The rule takes
    a stride-1 ``Conv2D``'s input gradient (a forward convolution: no
    im2col buffer) and, in a loop over rows, its kernel gradient where the
    patches are known and small enough (:func:`jacobkit.strategies.
    gradients.shared_patches`); any other runs TensorFlow's op, a layer's
    closed form included (its per-example filter gradients,
    :func:`jacobkit.layers.conv.example_filters`, run TensorFlow's op: the
    wide conv net's ``jk.gram``, ``batch``, measured 16.3 MiB with oneDNN
    off against 0.75 with it on).

    NOTE (measured, oneDNN off, loaded 2 cores). Counted as TensorFlow's
    everywhere, the Conv1D generator's ``while`` was predicted 68.2 MiB and
    measured 2.8 (its every convolution stride 1: no TensorFlow kernel
    runs)."""
    if not replaced or not gradient.stride_one:
        return True
    if gradient.wrt == "input":
        return False
    size = gradient.patches_bytes
    return not (way == "loop" and size is not None and size <= SHARED_PATCHES_BYTES)


def kinds_run(problem: Problem, way: str, replaced: bool) -> frozenset[str]:
    """The convolution kinds whose TensorFlow kernels run in ``problem``'s
    backward pass by a strategy of ``way`` (:func:`runs_kernel`); every kind
    of it where its gradient ops were not read."""
    found = problem.convolution_gradients
    if found is None:
        return problem.convolutions
    return frozenset(g.kind for g in found if runs_kernel(g, way, replaced))


def patches_held(problem: Problem, replaced: bool) -> int:
    """What a loop over rows holds of the patches jacobkit's ``Conv2D``
    rule forms once (each kernel gradient it takes). Counted once: the
    patches and their transposed copy are not both held (measured, oneDNN
    off, the Conv1D generator: ``while(1)`` 1.2 MiB against 0.98 with oneDNN
    on, beside 1.16 MiB of patches)."""
    found = problem.convolution_gradients or ()
    taken = [
        g.patches_bytes or 0
        for g in found
        if g.wrt == "kernel"
        and g.used  # pruned, or not taken: no patches formed
        and g.stride_one
        and not runs_kernel(g, "loop", replaced)
    ]
    return sum(taken) if replaced else 0


def inter_op_threads() -> int:
    """Threads TensorFlow runs independent ops on (its inter-op pool)."""
    configured = tf.config.threading.get_inter_op_parallelism_threads()
    if configured > 0:
        return configured
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def scratch_bytes(kinds: Iterable[str], dtype: tf.DType, device: str) -> int:
    """The largest scratch space of one backward pass through a convolution
    of each of ``kinds`` in ``dtype`` on ``device`` (0 for none): measured on
    a tiny probe the first time each is asked for in this process, as the
    peak above what the probe's own tensors take.

    ``device`` must report its peak (see
    :func:`jacobkit.planner.probes.peak_measurable`)."""
    found = 0
    for kind in sorted(kinds):
        key = (kind, tf.as_dtype(dtype).name, device)
        measured = runtime.measured_once(
            ("convolution scratch", *key),
            lambda: _measure(kind, tf.as_dtype(dtype), device),  # noqa: B023
        )
        found = max(found, measured)
    return found


def _probe_tensors(
    convolution: convolutions.Convolution, dtype: tf.DType
) -> tuple[tf.Tensor, tf.Tensor]:
    """A small input and kernel, shaped so that TensorFlow's im2col kernels
    (where it uses them) allocate their full L3-sized buffer: many output
    positions, a small kernel, one output channel (a depthwise convolution
    reads it as its channel multiplier)."""
    generator = tf.random.Generator.from_seed(0)
    if convolution.spatial_axes == 3:
        x = generator.normal((2, 8, 32, 32, 2))
        k = generator.normal((3, 3, 3, 2, 1))
    else:
        x = generator.normal((2, 64, 64, 2))
        k = generator.normal((3, 3, 2, 1))
    return tf.cast(x, dtype), tf.cast(k, dtype)


def _measure(kind: str, dtype: tf.DType, device: str) -> int:
    """The larger work space of the two gradient ops (input, kernel), each
    measured alone: whether TensorFlow runs the two at once varies from run
    to run (32 or 64 MiB on the same probe without oneDNN), while one row's
    backward pass through the generator measured one buffer (33 MiB) every
    time."""
    convolution = convolutions.convolution(kind)
    with tf.device(device):
        x, k = _probe_tensors(convolution, dtype)
        try:
            return max(_measure_one(convolution, x, k, wrt, device) for wrt in (0, 1))
        except (tf.errors.OpError, RuntimeError):
            return 0  # no such kernel for this dtype here, or no statistics


def _measure_one(
    convolution: convolutions.Convolution,
    x: tf.Tensor,
    k: tf.Tensor,
    wrt: int,
    device: str,
) -> int:
    """Peak above the probe's own tensors of the gradient with respect to
    ``(x, k)[wrt]`` alone."""

    def gradient(x, k):
        with tf.GradientTape() as tape:
            tape.watch([x, k])
            y = convolution.forward(x, k)
        return y, tape.gradient(y, (x, k)[wrt])

    # a concrete function: traced once, never counted as a retrace
    concrete = tf.function(gradient, autograph=False).get_concrete_function(x, k)
    concrete(x, k)  # the kernel's first allocations made
    peaks = []
    for _ in range(_RUNS):
        with memory.PeakMemory(device) as peak:
            outputs = concrete(x, k)
        peaks.append(int(peak.extra_bytes or 0))
    # y, the ones it is differentiated with, and the gradient
    own = sum(t.shape.num_elements() * t.dtype.size for t in outputs)
    own += outputs[0].shape.num_elements() * outputs[0].dtype.size
    return max(max(peaks) - own, 0)
