"""DP-SGD with ``model.fit``: :func:`make_private` wraps a Keras model in a
:class:`PrivateModel`, compiled and fitted as usual.

Why a wrapper, made by a function: Keras users train with ``compile`` and
``fit`` and already know ``make_private`` from Opacus. A wrapper works for
any model (functional, Sequential, subclassed, a keras_hub task) without
the user changing its class, as a ``train_step`` mixin would ask; and the
user's model stays as it was: the wrapper holds it, trains its variables
(what ``fit`` does) and changes nothing else of it: no layer, loss or
``train_step`` of it is replaced. TF Privacy's ``DPModel`` /
``DPSequential`` subclass the model instead (Keras 2 only).

A step (:meth:`PrivateModel.train_step`) on a batch ``(x, y, w)`` from a
:class:`~jacobkit.privacy.PoissonSampler`: each example's loss gradient over
all trained variables, clipped to L2 norm ``C`` (or layer by layer),
summed (:func:`jacobkit.jacobian` with ``reduce=jk.ClippedSum(C)``: no
example's gradient is held); Gaussian noise ``N(0, (sigma * C)^2)`` added
to every coordinate, drawn statelessly from ``(seed, step)``
(:func:`~jacobkit.privacy.step.noise`); the result divided by the
expected batch size ``q * N``; the compiled optimizer applies it.

Compiled or eager: ``fit`` on a :class:`~jacobkit.privacy.PoissonSampler`
runs a compiled step (no ``run_eagerly``): before ``fit`` traces it, the
step is planned on the sampler's first batch, one
:func:`jacobkit.function` for every clipping group (:mod:`jacobkit.privacy.traced`;
per layer, ``jk.ClippedSum(groups=...)``: one forward pass),
and traced once per padded size, when a batch of that size first comes
(:mod:`jacobkit.privacy.sized`: the first step traces one size). With
``compile(run_eagerly=True)`` each step calls :func:`jacobkit.jacobian`
instead (:func:`jacobkit.privacy.step.clipped_sums`); both compute the same
step.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import keras
import tensorflow as tf

from jacobkit.privacy import checks, step
from jacobkit.privacy.accounting import check_parameters, epsilon
from jacobkit.privacy.sampling import PoissonSampler
from jacobkit.privacy.sized import SizedSteps, applies
from jacobkit.privacy.traced import TracedSums
from jacobkit.problem.loss import Loss


@dataclass(frozen=True)
class Privacy:
    """A private model's settings.

    Attributes:
        l2_norm_clip: ``C``, the bound on one example's clipped gradient.
        noise_multiplier: ``sigma``: the noise's standard deviation is
            ``sigma * C``.
        sampling_rate: ``q``, each example's probability to join a batch.
        num_examples: ``N``, the training set's size.
        seed: seeds the noise (step ``t``'s by ``(seed, t)``).
        training: the ``training`` flag the model's passes get.
    """

    l2_norm_clip: float
    noise_multiplier: float
    sampling_rate: float
    num_examples: int
    seed: int
    training: bool

    @property
    def expected_batch_size(self) -> float:
        """``q * N``: the noisy sum is divided by it."""
        return self.sampling_rate * self.num_examples


class PrivateModel(keras.Model):
    """A Keras model whose ``fit`` takes DP-SGD steps on ``model``'s
    trainable variables (see the module's docstring); made by
    :func:`make_private`. Calling it calls ``model``.

    Attributes:
        model: the user's model.
        privacy: the :class:`Privacy` settings.
        dp_steps: the DP steps taken (an int64 variable): what the noise is
            seeded with and the accountant composes.
    """

    #: fit's train function (Keras's, or :class:`SizedSteps`)
    train_function: Any

    def __init__(
        self, model: Any, privacy: Privacy, per_layer: bool | Mapping[str, float]
    ) -> None:
        super().__init__(name=f"private_{model.name}")
        self.model = model
        self.privacy = privacy
        self.per_layer = per_layer
        self.dp_steps = keras.Variable(
            0, dtype="int64", trainable=False, name="dp_steps"
        )
        self.loss_tracker = keras.metrics.Mean(name="loss")
        self.clipped = keras.metrics.Mean(name="clipped")
        self.per_example_loss: Any = None
        self.clipping: step.Clipping | None = None
        self.traced: TracedSums | None = None
        self.has_metrics = False

    def call(self, inputs: Any, training: bool | None = None) -> Any:
        return self.model(inputs, training=training)

    def compile(
        self,
        optimizer: Any = "rmsprop",
        loss: Any = None,
        metrics: Any = None,
        jit_compile: Any = False,
        **kwargs: Any,
    ) -> None:
        """As ``keras.Model.compile``; ``loss`` must be per-example (a Keras
        loss made with ``reduction=None``, or a function ``(y_true, y_pred)
        -> (batch,)``). ``metrics`` are computed on the model's outputs in
        inference mode (``training=False``), weighted by the batch's sample
        weights (the padding: 0), from one more forward pass per step (none
        without ``metrics``: see :meth:`train_step` for the loss).
        ``jit_compile`` is off by default."""
        self.per_example_loss = checks.per_example_loss(loss)
        self.has_metrics = bool(metrics) or bool(kwargs.get("weighted_metrics"))
        # planned for the previous loss: checked and planned anew
        self.clipping = None
        self.traced = None
        super().compile(
            optimizer=optimizer, metrics=metrics, jit_compile=jit_compile, **kwargs
        )

    def prepare(self, sampler: PoissonSampler) -> None:
        """Plan the compiled step on ``sampler``'s first batch and sizes
        (``fit`` on a sampler calls it; call it before ``train_on_batch``
        without ``run_eagerly``). Eager; checks the loss's rows there."""
        if self.per_example_loss is None:
            raise ValueError("jacobkit.privacy: compile the private model first.")
        x, y, weights = sampler[0]
        variables = list(self.model.trainable_variables)
        self.first_checks(y, self.model(x, training=False), variables)
        assert self.clipping is not None
        # a step traced before planned other sizes: traced anew
        self.train_function = None
        self.traced = TracedSums(
            self.model,
            variables,
            self.clipping,
            Loss(self.per_example_loss),
            self.privacy.training,
            (x, y, weights),
            sampler.sizes,
        )
        if self.has_metrics:
            # the compiled metrics' variables made now, eagerly: a traced step
            # that makes variables is traced twice (SizedSteps counts traces)
            self.compute_metrics(x, y, self.model(x, training=False), weights)
            self.reset_metrics()

    def first_checks(self, y: Any, y_pred: Any, variables: list[Any]) -> None:
        """The loss's rows checked, the clipping groups found (eagerly)."""
        checks.check_rows(self.per_example_loss, y, y_pred)
        self.clipping = step.clipping_for(
            self.model, variables, self.privacy.l2_norm_clip, self.per_layer
        )

    @property
    def metrics(self) -> list[Any]:
        own = [self.loss_tracker, self.clipped]
        # Keras's own "loss" tracker stays out: this model's loss is its own
        return [
            *own,
            *(m for m in super().metrics if m.name != "loss" and m not in own),
        ]

    def fit(self, x: Any = None, *args: Any, **kwargs: Any) -> Any:
        """As ``keras.Model.fit``; ``x`` should be a
        :class:`~jacobkit.privacy.PoissonSampler` at this model's sampling
        rate (anything else is warned about: the accountant's epsilon
        assumes Poisson sampling)."""
        if isinstance(x, PoissonSampler):
            if (x.sampling_rate, x.num_examples) != (
                self.privacy.sampling_rate,
                self.privacy.num_examples,
            ):
                raise ValueError(
                    f"jacobkit.privacy: fit's PoissonSampler samples {x.num_examples} "
                    f"examples at rate {x.sampling_rate}; the private model was "
                    f"made for {self.privacy.num_examples} at "
                    f"{self.privacy.sampling_rate}. Make them agree."
                )
            if not self.run_eagerly and (
                self.traced is None or self.traced.sizes != x.sizes
            ):
                self.prepare(x)
        else:
            warnings.warn(
                "jacobkit.privacy: fit's data is not a PoissonSampler; the epsilon "
                "reported assumes each example joins each batch independently "
                "with probability sampling_rate, which shuffled batches do not do.",
                UserWarning,
                stacklevel=2,
            )
        return super().fit(x, *args, **kwargs)

    def make_train_function(self, force: bool = False) -> Any:
        """``fit``'s train function: compiled, one trace per batch size, made
        when a batch of that size first comes
        (:class:`~jacobkit.privacy.sized.SizedSteps`); eager or under a
        ``tf.distribute`` strategy, Keras's own."""
        if self.train_function is not None and not force:
            return self.train_function
        if not applies(self):
            super().make_train_function(force=force)
        else:
            if not self.optimizer.built:
                # built now, not in the first trace: a trace that creates
                # variables is traced a second time (with metrics compiled)
                self.optimizer.build(list(self.model.trainable_variables))
            self.train_function = SizedSteps(self)
        return self.train_function

    def epsilon(self, delta: float, accountant: str = "rdp") -> float:
        """Epsilon at ``delta`` after the steps taken so far
        (:func:`~jacobkit.privacy.epsilon`)."""
        privacy = self.privacy
        steps = int(self.dp_steps.numpy())
        return epsilon(
            privacy.sampling_rate, privacy.noise_multiplier, steps, delta, accountant
        )

    def train_step(self, data: Any) -> dict[str, Any]:
        """One DP-SGD step on ``data``, ``(x, y)`` or ``(x, y,
        sample_weight)``, ``B`` examples (a :class:`PoissonSampler`'s
        padding of weight 0).

        The logged ``"loss"``: the weighted mean of the examples' loss rows
        (each example's loss, summed over its other axes). Compiled, where
        the clipped sum's strategy gives its own forward pass's rows
        (``batch``), those: the training pass's (dropout on), as a plain
        ``fit`` logs, at no extra pass. Else (eager, other strategies) from
        an inference-mode pass, which ``metrics`` get in any case."""
        if self.per_example_loss is None:
            raise ValueError("jacobkit.privacy: compile the private model first.")
        eager = tf.executing_eagerly()
        if not eager and self.traced is None:
            raise RuntimeError(
                "jacobkit.privacy: the compiled step is planned on a "
                "PoissonSampler: fit on one (fit(sampler, ...)), or call "
                "private.prepare(sampler) first, or compile with run_eagerly=True."
            )
        x, y, weights = keras.utils.unpack_x_y_sample_weight(data)
        batch = tf.shape(tf.nest.flatten(x)[0])[0]
        if weights is None:
            weights = tf.ones((batch,), tf.float32)
        variables = list(self.model.trainable_variables)
        y_pred = None
        if self.clipping is None:  # eager, the first step: checked once
            y_pred = self.model(x, training=False)
            self.first_checks(y, y_pred, variables)
        assert self.clipping is not None
        sums, norms, rows = self.clipped_sums(variables, (x, y, weights))
        if rows is None or self.has_metrics:  # before the update, as the rows
            y_pred = self.model(x, training=False) if y_pred is None else y_pred
        self.optimizer.apply(self.noisy(variables, sums), variables)
        self.dp_steps.assign_add(1)
        example = tf.reshape(tf.cast(weights, tf.float32), (batch, -1))[:, 0]
        if rows is None:
            self.loss_tracker.update_state(
                self.per_example_loss(y, y_pred), sample_weight=weights
            )
        else:  # the rows are weighted: their sum over the weights' sum
            total = tf.reduce_sum(example)
            self.loss_tracker.update_state(
                tf.math.divide_no_nan(tf.reduce_sum(rows), total), sample_weight=total
            )
        over = tf.cast(norms > self.clipping.total, tf.float32)
        self.clipped.update_state(over, sample_weight=tf.cast(example > 0, tf.float32))
        if y_pred is None:
            return self.get_metrics_result()
        return self.compute_metrics(x, y, y_pred, weights)

    def clipped_sums(
        self, variables: list[Any], data: tuple[Any, Any, Any]
    ) -> tuple[list[tf.Tensor], tf.Tensor, tf.Tensor | None]:
        """The clipped sums, one per variable, each example's norm before
        clipping, shape ``(B,)``, and its weighted loss row where the
        compiled clipped sum gives them (else ``None``)."""
        assert self.clipping is not None
        privacy = self.privacy
        rows = None
        if not tf.executing_eagerly():
            assert self.traced is not None
            sums, norms, rows = self.traced(data)
        else:
            sums, norms = step.clipped_sums(
                self.model,
                data,
                variables,
                self.clipping,
                Loss(self.per_example_loss),
                privacy.training,
            )
        return sums, norms, rows

    def noisy(self, variables: list[Any], sums: list[Any]) -> list[tf.Tensor]:
        """The noisy gradients ``(clipped sum + noise) / (q * N)``, one per
        variable. Noise: :func:`~jacobkit.privacy.step.noise` at this step."""
        assert self.clipping is not None
        privacy = self.privacy
        std = privacy.noise_multiplier * self.clipping.total
        noise = step.noise(variables, privacy.seed, self.dp_steps, std)
        divisor = privacy.expected_batch_size
        return [(s + n) / divisor for s, n in zip(sums, noise, strict=True)]


def make_private(
    model: Any,
    *,
    l2_norm_clip: float,
    noise_multiplier: float,
    sampling_rate: float,
    num_examples: int,
    seed: int = 0,
    per_layer: bool | Mapping[str, float] = False,
    training: bool = True,
) -> PrivateModel:
    """``model`` wrapped for DP-SGD with ``fit`` (see the module's docstring).

    Args:
        model: a built Keras 3 model (any kind), not changed.
        l2_norm_clip: ``C``: one example's clipped gradient has at most this
            L2 norm, over all trained variables together.
        noise_multiplier: ``sigma``; the noise's standard deviation is
            ``sigma * C``.
        sampling_rate: ``q``: the :class:`PoissonSampler`'s.
        num_examples: ``N``: the training set's size (the sum is divided by
            ``q * N``).
        seed: seeds the noise.
        per_layer: clip layer by layer: ``True``, each of the ``L`` layers
            with trained variables to ``C / sqrt(L)``; or a dict ``{layer
            path: C_l}`` naming each. The noise's scale is then ``sigma *
            sqrt(sum C_l^2)`` (``sigma * C`` with ``True``). Every layer's
            clipped sum comes from one forward pass (one draw of dropout's
            masks), eagerly or compiled.
        training: the model's ``training`` flag in the step (dropout on).
            ``BatchNormalization`` training on batch statistics is refused.

    Returns:
        a :class:`PrivateModel`; ``compile`` it with a per-example loss and
        ``fit`` it on a :class:`PoissonSampler`.
    """
    check_parameters(sampling_rate, noise_multiplier)
    if (
        not isinstance(num_examples, int)
        or isinstance(num_examples, bool)
        or (num_examples < 1)
    ):
        raise ValueError(
            f"jacobkit.privacy.make_private(num_examples={num_examples!r}): "
            "expected the training set's size, a whole number >= 1."
        )
    if not getattr(model, "built", False) or not model.trainable_variables:
        raise ValueError(
            "jacobkit.privacy.make_private: the model has no trainable "
            "variables yet; build it first (call it once on a batch)."
        )
    checks.refuse_batch_statistics(model, bool(training))
    # checks the clip norms (and per_layer's names) now, before any step
    step.clipping_for(model, model.trainable_variables, l2_norm_clip, per_layer)
    privacy = Privacy(
        float(l2_norm_clip),
        float(noise_multiplier),
        float(sampling_rate),
        num_examples,
        int(seed),
        bool(training),
    )
    return PrivateModel(model, privacy, per_layer)
