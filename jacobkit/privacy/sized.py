"""``fit``'s train function for a private model: one trace per batch size,
made when a batch of that size first comes.

Keras's TensorFlow trainer compiles ``train_step`` as one ``tf.function``
that takes the batch from the ``tf.data`` iterator inside the trace, where
a Poisson batch's size is unknown; the step must then switch on the size
to a branch per padded size of the sampler
(:class:`~jacobkit.privacy.traced.TracedSums`), and TensorFlow traces every
branch of a switch: ``fit``'s first step traced all 10 to 14 sizes
(measured under load: 12 to 23 s on a conv net, 65 to 165 s on BERT tiny,
112 to 247 s on a tiny GPT-2, against 0.4 to 10 s for a plain step).

:class:`SizedSteps` takes the batch from the iterator in Python instead,
where its shape is known (a :class:`~jacobkit.privacy.PoissonSampler`'s
batch is padded to one of its sizes already), and calls one ``tf.function``
whose traces are one per batch shape: the first step traces one size, a
later size is traced by the first batch of it, and a run traces only the
sizes it meets (of a ladder from the 1e-3 to the 1 - 1e-10 quantile of the
batch size, the few around the mean come first; the far ones may never
come). The price: a step that meets a new size pays that size's trace
then, and each step leaves ``tf.data`` in Python (one ``next`` on the
iterator). Measured under load (``benchmarks/privacy_fit.py``), paired with
Keras's switch in one process: the first step after planning 1.3 to 4.0 s
against 10.6 to 21.2 s on a conv net, 8 to 19 s against 77 to 171 s on
BERT tiny; runs of 67 steps traced 6 of their 10 sizes; the step alone
0.81 to 0.94 of the switch's; ``fit``'s loop on a trivial model 0.3 to
1.9 ms a step cheaper than with the switch in 5 of 6 processes (1.1 ms
dearer in one).

``steps_per_execution`` is honoured as Keras does: that many steps per
call (each its own DP step), the logs of the last. Eager
(``run_eagerly=True``) and under a ``tf.distribute`` strategy, Keras's own
train function runs (there, the switch traces every size at once).
"""

from __future__ import annotations

from typing import Any

import tensorflow as tf


def applies(model: Any) -> bool:
    """Whether ``model``'s ``fit`` steps by size (:class:`SizedSteps`):
    compiled, and with no ``tf.distribute`` strategy (a strategy's batches
    come split across replicas, their sizes unknown to Python)."""
    if model.run_eagerly or tf.distribute.has_strategy():
        return False
    # a model made under a strategy's scope keeps it
    return bool(model.distribute_strategy is tf.distribute.get_strategy())


def _signature(data: Any) -> tuple[Any, ...]:
    """A batch's shapes and dtypes: one trace each."""
    return tuple(
        None if t is None else (tuple(t.shape), t.dtype) for t in tf.nest.flatten(data)
    )


class SizedSteps:
    """A private model's train function (see the module's docstring):
    ``fn(iterator)`` takes ``steps_per_execution`` batches (``(x, y)`` or
    ``(x, y, sample_weight)``, ``B`` examples each, ``B`` known) from
    ``iterator``, steps on each and returns the last step's logs.

    Args:
        model: the :class:`~jacobkit.privacy.PrivateModel`; its
            ``train_step`` is traced, with its ``jit_compile``.
    """

    def __init__(self, model: Any) -> None:
        self.model = model
        self.step = tf.function(
            self.one_step,
            autograph=False,
            jit_compile=bool(model.jit_compile),
            reduce_retracing=False,  # a size relaxed to None: every size traced
        )
        #: each batch shape's trace, called directly
        self.traces: dict[tuple[Any, ...], Any] = {}

    @property
    def tracing_count(self) -> int:
        """How many batch shapes the step has been traced for."""
        count: int = self.step.experimental_get_tracing_count()
        return count

    def one_step(self, data: Any) -> dict[str, Any]:
        logs: dict[str, Any] = self.model.train_step(data)
        return logs

    def __call__(self, iterator: Any) -> dict[str, Any]:
        # fit's: a tf.data iterator's tensors; train_on_batch's: arrays
        arrays = not isinstance(
            iterator, (tf.data.Iterator, tf.distribute.DistributedIterator)
        )
        logs = None
        for _ in range(max(1, int(self.model.steps_per_execution))):
            try:
                data = next(iterator)
            except (StopIteration, tf.errors.OutOfRangeError):
                if logs is None:
                    raise StopIteration from None
                break
            if arrays:
                data = tf.nest.map_structure(
                    lambda t: t if t is None else tf.convert_to_tensor(t), data
                )
            logs = self.run(data)
        assert logs is not None
        return logs

    def run(self, data: Any) -> dict[str, Any]:
        """One step on ``data`` (tensors), traced for its shape the first
        time."""
        key = _signature(data)
        trace = self.traces.get(key)
        if trace is None:
            # traced by get_concrete_function, not by a call: a call that
            # traces counts towards TensorFlow's "frequent retracing" warning,
            # which a run's first steps (each a new size) would set off,
            # wrongly; and the trace called directly skips the tf.function's
            # dispatch on its arguments (measured: 0.2 to 0.3 ms a step)
            trace = self.traces[key] = self.step.get_concrete_function(data)
        logs: dict[str, Any] = trace(data)
        return logs
