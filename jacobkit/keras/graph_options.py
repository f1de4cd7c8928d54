"""One pass of TensorFlow's graph optimizer over jacobkit's own compiled
computations (:class:`OnePass`, from :func:`jacobkit.keras.state.function`).

TensorFlow optimizes a function's graph (grappler) when it first runs it,
by default twice over: every optimizer once, then every one again on what
the first round left. jacobkit's computations are larger graphs than the
step they are compared with (the per-example rules' ops beside the forward
and backward pass), and the second round found nothing on them; it cost a
first call what the first round did. Called eagerly, a computation runs
with the caller's function options (its ``ConfigProto``, read from this
thread's ``context.function_call_options``: what ``tf.config.optimizer``
set) but one round of the optimizer (``meta_optimizer_iterations: ONE``)
where the caller left the rounds at TensorFlow's default; a round the
caller chose is kept. The options are this thread's for the duration of the
call and put back after it; nothing of the process's configuration
changes. Traced into another function (a ``jk.function`` in the caller's
``tf.function``, a computation nested in a Gram matrix's products), the
call is the enclosing function's, optimized as that one is.

NOTE (measured, one core, a loaded machine, oneDNN off, the conv net of
``benchmarks/reductions.py``: per first call on a fresh model in one
process, after a first call of each, medians of 6 alternating rounds). The
function's first run (grappler, the executor's kernels, the run): ``jk.gram``
69 -> 59 ms, the clipped sum 58 -> 44 ms (the plain step's 33 ms). The
optimized graph was the same: the second round changed no node (TensorFlow's
``meta_optimizer`` log: ``Graph size after: 170 nodes (0)`` for each of its
optimizers)."""

from __future__ import annotations

from typing import Any

import tensorflow as tf
from tensorflow.core.protobuf import config_pb2, rewriter_config_pb2
from tensorflow.python.eager import context as _context

from jacobkit import runtime

_Rewriter = rewriter_config_pb2.RewriterConfig


def one_pass(options: Any) -> Any:
    """``options`` (TensorFlow's ``FunctionCallOptions``) with one round of
    the graph optimizer where they leave the rounds at the default; made
    once per process and distinct options (``ProcessState.facts``)."""
    serialized = options.config_proto_serialized or b""
    key = ("one optimizer pass", serialized, options.executor_type)
    facts = runtime.PROCESS.facts
    found = facts.get(key)
    if found is None:
        config = config_pb2.ConfigProto()
        config.ParseFromString(serialized)
        rewrite = config.graph_options.rewrite_options
        if rewrite.meta_optimizer_iterations == _Rewriter.DEFAULT_NUM_ITERS:
            rewrite.meta_optimizer_iterations = _Rewriter.ONE
        found = _context.FunctionCallOptions(
            executor_type=options.executor_type, config_proto=config
        )
        facts[key] = found
    return found


class OnePass:
    """A ``tf.function`` (or :class:`jacobkit.keras.state.Compiled`) whose
    eager calls run with :func:`one_pass`'s options; anything else (its
    traces, ``get_concrete_function``, its attributes) is the function's
    own."""

    def __init__(self, function: Any) -> None:
        self.function = function

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if not tf.executing_eagerly():
            return self.function(*args, **kwargs)
        ctx = _context.context()
        before = ctx.function_call_options
        ctx.function_call_options = one_pass(before)
        try:
            return self.function(*args, **kwargs)
        finally:
            ctx.function_call_options = before

    def __getattr__(self, name: str) -> Any:
        if name == "function":  # not set yet (a copy being made)
            raise AttributeError(name)
        return getattr(self.function, name)
