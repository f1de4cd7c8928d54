"""The DP-LoRA example (``examples/dp_lora.py``), its ``--quick`` run end to
end (slow: 25 s on 2 loaded cores, a GPT-2 pretrained, fine-tuned twice and
evaluated each epoch): what it claims, checked against what it did.

- the private fine-tuning's loss decreases (held out and on the sampled
  batches), and the held-out next-token accuracy rises above the pretrained
  model's;
- its epsilon per epoch is ``jk.privacy.epsilon`` for its ``q``, ``sigma``,
  the steps taken and ``delta``, by both accountants (the same library
  call: equal to the last bit);
- only the LoRA factors changed: every other weight of the model is
  bit-identical to the pretrained one, and the factors did change;
- the per-example loss is one row per example and leaves the padding out
  (against NumPy's cross-entropy over the real tokens, float64: measured
  within 4e-7, held to 1e-5).

The clipped sum itself is held to a float64 tape per example on GPT-2 with
LoRA in ``tests/test_privacy_models.py``.
"""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("keras_hub")
pytest.importorskip("dp_accounting")

import jacobkit as jk  # noqa: E402
from examples import dp_lora  # noqa: E402


@pytest.fixture(scope="module")
def outcome() -> dp_lora.Outcome:
    return dp_lora.main(["--quick"])


@pytest.mark.slow
def test_the_private_fine_tuning_learns(outcome):
    private = outcome.private
    loss, accuracy = outcome.before
    assert private.record.losses[-1] < loss
    assert private.record.accuracies[-1] > accuracy


@pytest.mark.slow
def test_epsilon_is_the_accountants_for_the_steps_taken(outcome):
    settings = outcome.settings
    q = settings.batch / settings.examples
    per_epoch = round(1 / q)
    assert outcome.private.steps == per_epoch * settings.epochs
    for epoch, (rdp, pld) in enumerate(outcome.private.epsilon, start=1):
        steps = per_epoch * epoch
        args = (q, settings.noise, steps, settings.delta)
        assert rdp == jk.privacy.epsilon(*args, "rdp")
        assert pld == jk.privacy.epsilon(*args, "pld")
    assert 0 < outcome.private.epsilon[0][0] < outcome.private.epsilon[-1][0]


@pytest.mark.slow
@pytest.mark.parametrize("run", ["private", "plain"])
def test_only_the_lora_factors_changed(outcome, run):
    model = getattr(outcome, run).model
    factors = [v for v in model.weights if "lora_kernel" in v.path]
    assert {v.path for v in model.trainable_variables} == {v.path for v in factors}
    assert any(
        not np.array_equal(v.numpy(), 0 * v.numpy())
        for v in factors
        if "lora_kernel_b" in v.path
    )  # B starts at 0: the factors moved
    rest = [v for v in model.weights if "lora_kernel" not in v.path]
    assert {v.path for v in rest} == set(outcome.pretrained)
    for variable in rest:
        want = outcome.pretrained[variable.path]
        assert np.array_equal(variable.numpy(), want), variable.path


def test_the_per_example_loss_leaves_the_padding_out():
    rng = np.random.default_rng(0)
    text = dp_lora.sentences(6, rng, ruled=True)
    _, y = dp_lora.encode(text, dp_lora.LENGTH)
    logits = rng.normal(size=(*y.shape, len(dp_lora.VOCABULARY))).astype("float32")
    rows = np.asarray(dp_lora.per_example_loss(y, logits), np.float64)
    assert rows.shape == (6,)
    for b, words in enumerate(text):
        real = len(words) - 1  # the targets before the padding
        assert (y[b, :real] != dp_lora.PAD).all() and (y[b, real:] == 0).all()
        z = logits[b, :real].astype(np.float64)
        log_p = z - np.log(np.exp(z).sum(-1, keepdims=True))
        want = -np.mean(log_p[np.arange(real), y[b, :real]])
        assert abs(rows[b] - want) <= 1e-5 * abs(want)
