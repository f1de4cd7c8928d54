"""Privacy accounting: epsilon of DP-SGD's steps, from Google's
``dp-accounting`` library (the optional extra ``jacobkit[privacy]``).

A DP-SGD step with Poisson sampling at rate ``q`` and noise multiplier
``sigma`` is one ``PoissonSampledDpEvent(q, GaussianDpEvent(sigma))``;
``steps`` of them compose into a ``SelfComposedDpEvent``, whose epsilon at
``delta`` the accountant bounds: RDP (Renyi DP, the bound TF Privacy's
``compute_dp_sgd_privacy`` and Opacus's default report) or PLD (privacy loss
distributions: tighter, slower). :class:`EpsilonCallback` logs it after
each epoch of :meth:`keras.Model.fit` on a :func:`~jacobkit.privacy.make_private`
model.
"""

from __future__ import annotations

import math
import numbers
from typing import Any

import keras

#: the accountants :func:`epsilon` knows
ACCOUNTANTS = ("rdp", "pld")


def _dp_accounting() -> Any:
    """The ``dp_accounting`` module, or an error naming the extra."""
    try:
        import dp_accounting
    except ModuleNotFoundError as err:
        raise ModuleNotFoundError(
            "jacobkit.privacy's accounting uses Google's dp-accounting library, "
            "which is not installed: pip install 'jacobkit[privacy]' (or "
            "pip install dp-accounting).",
            name="dp_accounting",
        ) from err
    return dp_accounting


def check_parameters(sampling_rate: Any, noise_multiplier: Any) -> None:
    """Refuse a sampling rate outside ``(0, 1]`` or a negative noise
    multiplier, in words."""
    if (
        isinstance(sampling_rate, bool)
        or not isinstance(sampling_rate, numbers.Real)
        or not 0 < float(sampling_rate) <= 1
    ):
        raise ValueError(
            f"jacobkit.privacy: sampling_rate={sampling_rate!r}; expected the "
            "probability q in (0, 1] with which each example joins each batch."
        )
    if (
        isinstance(noise_multiplier, bool)
        or not isinstance(noise_multiplier, numbers.Real)
        or not float(noise_multiplier) >= 0
    ):
        raise ValueError(
            f"jacobkit.privacy: noise_multiplier={noise_multiplier!r}; expected a "
            "number >= 0 (the noise's standard deviation over the clip norm)."
        )


def epsilon(
    sampling_rate: float,
    noise_multiplier: float,
    steps: int,
    delta: float,
    accountant: str = "rdp",
) -> float:
    """Epsilon at ``delta`` after ``steps`` DP-SGD steps, each a Poisson
    sample at rate ``sampling_rate`` with Gaussian noise of standard
    deviation ``noise_multiplier`` times the clip norm.

    Args:
        sampling_rate: ``q``, each example's probability to join a batch.
        noise_multiplier: ``sigma``; 0 gives ``inf`` (no privacy).
        steps: the steps taken; 0 gives 0.0.
        delta: in ``(0, 1)``.
        accountant: ``"rdp"`` (dp-accounting's ``RdpAccountant``) or
            ``"pld"`` (its ``PLDAccountant``).

    Returns:
        epsilon, a float (``inf`` without noise).
    """
    check_parameters(sampling_rate, noise_multiplier)
    if accountant not in ACCOUNTANTS:
        raise ValueError(
            f"jacobkit.privacy.epsilon(accountant={accountant!r}): expected one "
            f"of {', '.join(map(repr, ACCOUNTANTS))}."
        )
    if isinstance(steps, bool) or not isinstance(steps, numbers.Integral) or steps < 0:
        raise ValueError(
            f"jacobkit.privacy.epsilon(steps={steps!r}): expected a whole number "
            ">= 0 of DP-SGD steps."
        )
    if (
        isinstance(delta, bool)
        or not isinstance(delta, numbers.Real)
        or not (0 < float(delta) < 1)
    ):
        raise ValueError(
            f"jacobkit.privacy.epsilon(delta={delta!r}): expected a number in "
            "(0, 1), usually below 1 / the number of training examples."
        )
    dp = _dp_accounting()
    if steps == 0:
        return 0.0
    if noise_multiplier == 0:
        return math.inf
    event = dp.SelfComposedDpEvent(
        dp.PoissonSampledDpEvent(
            float(sampling_rate), dp.GaussianDpEvent(float(noise_multiplier))
        ),
        int(steps),
    )
    found = dp.rdp.RdpAccountant() if accountant == "rdp" else dp.pld.PLDAccountant()
    found.compose(event)
    return float(found.get_epsilon(float(delta)))


class EpsilonCallback(keras.callbacks.Callback):
    """Logs ``"epsilon"`` (at ``delta``) into ``logs`` after each epoch of
    ``fit`` on a :func:`~jacobkit.privacy.make_private` model: its
    sampling rate, noise multiplier and the DP steps it has taken
    (``model.dp_steps``, every step since it was made, all epochs and
    ``fit`` calls).

    Args:
        delta: in ``(0, 1)``.
        accountant: ``"rdp"`` or ``"pld"`` (:func:`epsilon`).
    """

    def __init__(self, delta: float, accountant: str = "rdp") -> None:
        super().__init__()
        self.delta = delta
        self.accountant = accountant
        epsilon(0.5, 1.0, 0, delta, accountant)  # the arguments checked now

    def on_epoch_end(self, epoch: int, logs: dict[str, Any] | None = None) -> None:
        model = self.model
        privacy = getattr(model, "privacy", None)
        if privacy is None:
            raise TypeError(
                "jacobkit.privacy.EpsilonCallback: fit's model was not made by "
                "jacobkit.privacy.make_private, so its sampling rate and noise "
                "are unknown."
            )
        if logs is not None:
            logs["epsilon"] = epsilon(
                privacy.sampling_rate,
                privacy.noise_multiplier,
                int(model.dp_steps.numpy()),
                self.delta,
                self.accountant,
            )
